/*
 * FUSE requests pyfuse3 does not handle: FALLOCATE and COPY_FILE_RANGE (issue 28).
 *
 * pyfuse3 (3.5) fills libfuse's `struct fuse_lowlevel_ops` without
 * `fallocate` and `copy_file_range` members, so libfuse answers them with
 * ENOSYS: the kernel then turns every later fallocate(2) into EOPNOTSUPP and
 * copies every copy_file_range(2) itself, through READ and WRITE requests. This file defines
 * `fuse_session_new` itself: once the module is promoted to the global symbol
 * scope (zonefs_py/fuseext.py, before pyfuse3.init), pyfuse3's lazily bound
 * call to libfuse's `fuse_session_new` resolves here. When armed, it copies
 * pyfuse3's table, adds our handlers and calls libfuse's own function with the
 * copy; unarmed it passes the table through unchanged.
 *
 * The handlers run on the thread that runs fuse_session_process_buf (the trio
 * thread in pyfuse3) and hand the request to Python (`zfx_py_fallocate`,
 * `zfx_py_copy_file_range`: extern "Python" callbacks), which answers later
 * with zfx_reply_err or zfx_reply_write.
 * Conventions as native/zonefs_native.c: 0 or -errno, no Python objects here.
 */
#define FUSE_USE_VERSION 35
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <fuse_lowlevel.h>

typedef struct fuse_session *(*zfx_session_new_fn)(struct fuse_args *,
                                                    const struct fuse_lowlevel_ops *,
                                                    size_t, void *);

/* Defined by cffi (extern "Python" in native/build_fuseext.py's cdef). */
static void zfx_py_fallocate(void *req, uint64_t ino, int mode, int64_t offset,
                             int64_t length, uint64_t fh);

static void zfx_py_copy_file_range(void *req, uint64_t fh_in, int64_t off_in, uint64_t fh_out,
                                   int64_t off_out, uint64_t length, int flags);

static struct fuse_lowlevel_ops zfx_ops;
static int zfx_armed;
static int zfx_installed;

static void zfx_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset,
                          off_t length, struct fuse_file_info *fi)
{
    zfx_py_fallocate((void *)req, (uint64_t)ino, mode, (int64_t)offset, (int64_t)length,
                     fi ? (uint64_t)fi->fh : 0);
}

static void zfx_copy_file_range(fuse_req_t req, fuse_ino_t ino_in, off_t off_in,
                                struct fuse_file_info *fi_in, fuse_ino_t ino_out,
                                off_t off_out, struct fuse_file_info *fi_out, size_t len,
                                int flags)
{
    zfx_py_copy_file_range((void *)req, fi_in ? (uint64_t)fi_in->fh : 0, (int64_t)off_in,
                           fi_out ? (uint64_t)fi_out->fh : 0, (int64_t)off_out,
                           (uint64_t)len, flags);
}

struct fuse_session *fuse_session_new(struct fuse_args *args,
                                      const struct fuse_lowlevel_ops *op,
                                      size_t op_size, void *userdata)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    zfx_session_new_fn real = NULL;
    if (lib != NULL) {
        real = (zfx_session_new_fn)dlvsym(lib, "fuse_session_new", "FUSE_3.0");
        if (real == NULL)
            real = (zfx_session_new_fn)dlsym(lib, "fuse_session_new");
        dlclose(lib);
    }
    if (real == NULL || real == fuse_session_new) {
        errno = ENOSYS;
        return NULL;
    }
    if (!zfx_armed)
        return real(args, op, op_size, userdata);
    memset(&zfx_ops, 0, sizeof zfx_ops);
    memcpy(&zfx_ops, op, op_size < sizeof zfx_ops ? op_size : sizeof zfx_ops);
    zfx_ops.fallocate = zfx_fallocate;
    zfx_ops.copy_file_range = zfx_copy_file_range;
    zfx_installed = 1;
    return real(args, &zfx_ops, sizeof zfx_ops, userdata);
}

void zfx_arm(int on)
{
    zfx_armed = on;
    if (on)
        zfx_installed = 0;
}

int zfx_installed_flag(void)
{
    return zfx_installed;
}

int zfx_reply_err(void *req, int err)
{
    return fuse_reply_err((fuse_req_t)req, err);
}

int zfx_reply_write(void *req, uint64_t count)
{
    return fuse_reply_write((fuse_req_t)req, (size_t)count);
}
