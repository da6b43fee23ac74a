/*
 * FUSE requests pyfuse3 does not handle: FALLOCATE and COPY_FILE_RANGE (issue 28),
 * and the request census (issues 29, 42).
 *
 * pyfuse3 (3.5) fills libfuse's `struct fuse_lowlevel_ops` without
 * `fallocate` and `copy_file_range` members, so libfuse answers them with
 * ENOSYS: the kernel then turns every later fallocate(2) into EOPNOTSUPP and
 * copies every copy_file_range(2) itself, through READ and WRITE requests. This file defines
 * `fuse_session_new` itself: once the module is promoted to the global symbol
 * scope (zonefs_py/fuseext.py, before pyfuse3.init), pyfuse3's
 * call to libfuse's `fuse_session_new` resolves here. When armed, it copies
 * pyfuse3's table, adds our handlers and calls libfuse's own function with the
 * copy; unarmed it passes the table through unchanged.
 *
 * The handlers run on the thread that runs fuse_session_process_buf (the trio
 * thread in pyfuse3) and hand the request to Python (`zfx_py_fallocate`,
 * `zfx_py_copy_file_range`: extern "Python" callbacks), which answers later
 * with zfx_reply_err or zfx_reply_write. A callback that returns 0 (it raised,
 * or could not start the request's task) did not take the request: it is
 * answered EIO here, so each request is answered exactly once.
 *
 * The request census (native/zonefs_census.h): when `zfx_census_arm(1)` was
 * called, every handler in the table is wrapped by one that begins the request
 * in the census (received, by kernel opcode; GETXATTR also by attribute name;
 * in flight with its inode and arrival time) before calling pyfuse3's, and
 * every fuse_reply_* of libfuse is wrapped to end it (answered). Requests libfuse
 * answers without a handler (ENOSYS for a NULL member, INTERRUPT) are not
 * counted. The dispatch guard (zfx_after_dispatch) answers EIO for a request
 * whose pyfuse3 handler failed before taking it.
 *
 * The write gate (issue 42, DESIGN 4.3): while the filesystem is nearly full,
 * Python lists the handles open for writing (`zfx_gate_add`), and a GETATTR
 * that names one of them (FUSE_GETATTR_FH: the kernel sends it from write(2)
 * once the inode's attributes were invalidated, never from stat(2)) is
 * answered ENOSPC here, so that write(2) fails before its bytes enter the page
 * cache. The list is touched only on the thread that runs the handlers.
 * Conventions as native/zonefs_native.c: 0 or -errno; Python objects only in the
 * dispatch guard, on the thread that holds the GIL.
 */
#define FUSE_USE_VERSION 35
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <fuse_lowlevel.h>
#include "zonefs_census.h"

typedef struct fuse_session *(*zfx_session_new_fn)(struct fuse_args *,
                                                    const struct fuse_lowlevel_ops *,
                                                    size_t, void *);

/* Defined by cffi (extern "Python" in native/build_fuseext.py's cdef): 1 if Python
 * took the request (it answers it), 0 if not (then it is answered EIO here). */
static int zfx_py_fallocate(void *req, uint64_t ino, int mode, int64_t offset,
                            int64_t length, uint64_t fh);

static int zfx_py_copy_file_range(void *req, uint64_t fh_in, int64_t off_in, uint64_t fh_out,
                                  int64_t off_out, uint64_t length, int flags);

static struct fuse_lowlevel_ops zfx_ops;
static int zfx_armed;
static int zfx_installed;

static int zfx_census_pending(const void *key);
static int zfx_census_armed;
static int zfx_count_only;

/* Whether `req`, which failed to be taken, is still to be answered: per the census
 * when it tracks requests; without it, nothing else can have answered it. */
static int zfx_unanswered(fuse_req_t req)
{
    return !zfx_census_armed || zfx_count_only || zfx_census_pending(req);
}

/* Python did not take `req`: answer it EIO unless it was answered already. */
static void zfx_not_taken(fuse_req_t req)
{
    if (zfx_unanswered(req))
        fuse_reply_err(req, EIO);
}

static void zfx_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset,
                          off_t length, struct fuse_file_info *fi)
{
    if (!zfx_py_fallocate((void *)req, (uint64_t)ino, mode, (int64_t)offset,
                          (int64_t)length, fi ? (uint64_t)fi->fh : 0))
        zfx_not_taken(req);
}

static void zfx_copy_file_range(fuse_req_t req, fuse_ino_t ino_in, off_t off_in,
                                struct fuse_file_info *fi_in, fuse_ino_t ino_out,
                                off_t off_out, struct fuse_file_info *fi_out, size_t len,
                                int flags)
{
    if (!zfx_py_copy_file_range((void *)req, fi_in ? (uint64_t)fi_in->fh : 0,
                                (int64_t)off_in, fi_out ? (uint64_t)fi_out->fh : 0,
                                (int64_t)off_out, (uint64_t)len, flags))
        zfx_not_taken(req);
}

/* ---- the write gate -------------------------------------------------------- */

static uint64_t *zfx_gate_fhs;   /* handles whose GETATTR is refused; unordered */
static size_t zfx_gate_n, zfx_gate_cap;
static uint64_t zfx_gate_refused;
static void (*zfx_gate_next)(fuse_req_t, fuse_ino_t, struct fuse_file_info *);

static int zfx_gate_has(uint64_t fh)
{
    size_t i;
    for (i = 0; i < zfx_gate_n; i++)
        if (zfx_gate_fhs[i] == fh)
            return 1;
    return 0;
}

/* Refuse GETATTR with this handle from now on: 0, or -ENOMEM. */
int zfx_gate_add(uint64_t fh)
{
    if (zfx_gate_has(fh))
        return 0;
    if (zfx_gate_n == zfx_gate_cap) {
        size_t cap = zfx_gate_cap ? 2 * zfx_gate_cap : 64;
        uint64_t *grown = realloc(zfx_gate_fhs, cap * sizeof *grown);
        if (grown == NULL)
            return -ENOMEM;
        zfx_gate_fhs = grown;
        zfx_gate_cap = cap;
    }
    zfx_gate_fhs[zfx_gate_n++] = fh;
    return 0;
}

void zfx_gate_remove(uint64_t fh)
{
    size_t i;
    for (i = 0; i < zfx_gate_n; i++)
        if (zfx_gate_fhs[i] == fh) {
            zfx_gate_fhs[i] = zfx_gate_fhs[--zfx_gate_n];
            return;
        }
}

void zfx_gate_clear(void)
{
    zfx_gate_n = 0;
}

uint64_t zfx_gate_refused_count(void)
{
    return zfx_gate_refused;
}

static void zfx_gate_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    if (fi != NULL && zfx_gate_n != 0 && zfx_gate_has((uint64_t)fi->fh)) {
        zfx_gate_refused++;
        fuse_reply_err(req, ENOSPC);
        return;
    }
    zfx_gate_next(req, ino, fi);
}

/* ---- the request census (native/zonefs_census.h) ---------------------------- */

/* Kernel opcodes (enum fuse_opcode, linux/fuse.h; ABI, never renumbered). libfuse's
 * headers do not export them and linux/fuse.h clashes with fuse_lowlevel.h. */
enum {
    ZO_LOOKUP = 1, ZO_FORGET = 2, ZO_GETATTR = 3, ZO_SETATTR = 4, ZO_READLINK = 5,
    ZO_SYMLINK = 6, ZO_MKNOD = 8, ZO_MKDIR = 9, ZO_UNLINK = 10, ZO_RMDIR = 11,
    ZO_RENAME = 12, ZO_LINK = 13, ZO_OPEN = 14, ZO_READ = 15, ZO_WRITE = 16,
    ZO_STATFS = 17, ZO_RELEASE = 18, ZO_FSYNC = 20, ZO_SETXATTR = 21, ZO_GETXATTR = 22,
    ZO_LISTXATTR = 23, ZO_REMOVEXATTR = 24, ZO_FLUSH = 25, ZO_INIT = 26, ZO_OPENDIR = 27,
    ZO_READDIR = 28, ZO_RELEASEDIR = 29, ZO_FSYNCDIR = 30, ZO_ACCESS = 34, ZO_CREATE = 35,
    ZO_POLL = 40, ZO_BATCH_FORGET = 42, ZO_FALLOCATE = 43, ZO_READDIRPLUS = 44,
    ZO_COPY_FILE_RANGE = 47,
};

static const char *const zfx_opcode_names[ZFX_CENSUS_OPCODES] = {
    [0] = "OTHER",
    [ZO_LOOKUP] = "LOOKUP", [ZO_FORGET] = "FORGET", [ZO_GETATTR] = "GETATTR",
    [ZO_SETATTR] = "SETATTR", [ZO_READLINK] = "READLINK", [ZO_SYMLINK] = "SYMLINK",
    [ZO_MKNOD] = "MKNOD", [ZO_MKDIR] = "MKDIR", [ZO_UNLINK] = "UNLINK", [ZO_RMDIR] = "RMDIR",
    [ZO_RENAME] = "RENAME", [ZO_LINK] = "LINK", [ZO_OPEN] = "OPEN", [ZO_READ] = "READ",
    [ZO_WRITE] = "WRITE", [ZO_STATFS] = "STATFS", [ZO_RELEASE] = "RELEASE",
    [ZO_FSYNC] = "FSYNC", [ZO_SETXATTR] = "SETXATTR", [ZO_GETXATTR] = "GETXATTR",
    [ZO_LISTXATTR] = "LISTXATTR", [ZO_REMOVEXATTR] = "REMOVEXATTR", [ZO_FLUSH] = "FLUSH",
    [ZO_INIT] = "INIT", [ZO_OPENDIR] = "OPENDIR", [ZO_READDIR] = "READDIR",
    [ZO_RELEASEDIR] = "RELEASEDIR", [ZO_FSYNCDIR] = "FSYNCDIR", [31] = "GETLK",
    [32] = "SETLK", [33] = "SETLKW", [ZO_ACCESS] = "ACCESS", [ZO_CREATE] = "CREATE",
    [36] = "INTERRUPT", [37] = "BMAP", [38] = "DESTROY", [39] = "IOCTL", [ZO_POLL] = "POLL",
    [ZO_BATCH_FORGET] = "BATCH_FORGET", [ZO_FALLOCATE] = "FALLOCATE",
    [ZO_READDIRPLUS] = "READDIRPLUS", [45] = "RENAME2", [46] = "LSEEK",
    [ZO_COPY_FILE_RANGE] = "COPY_FILE_RANGE", [50] = "SYNCFS", [51] = "TMPFILE",
};

/* Received and answered, by opcode; inodes named by FORGET and BATCH_FORGET.
 * Atomic (relaxed): any thread may count. */
static uint64_t zfx_recv[ZFX_CENSUS_OPCODES];
static uint64_t zfx_done[ZFX_CENSUS_OPCODES];
static uint64_t zfx_forgotten;
/* Requests that failed inside the dispatch and were answered EIO here. */
static uint64_t zfx_dispatch_failures;

#define ZFX_ADD(var, n) __atomic_fetch_add(&(var), (n), __ATOMIC_RELAXED)
#define ZFX_LOAD(var) __atomic_load_n(&(var), __ATOMIC_RELAXED)

static inline uint32_t zfx_op_index(uint32_t opcode)
{
    return opcode < ZFX_CENSUS_OPCODES ? opcode : 0;
}

void zfx_census_received(uint32_t opcode)
{
    ZFX_ADD(zfx_recv[zfx_op_index(opcode)], 1);
}

void zfx_census_answered(uint32_t opcode)
{
    ZFX_ADD(zfx_done[zfx_op_index(opcode)], 1);
}

/* The requests in flight: an open-addressing table keyed by pointer (linear
 * probing, deletion by backward shift, doubled at half full). Protected by
 * zfx_flight_lock: every field below. */
struct zfx_flight {
    const void *key;   /* NULL: free slot */
    uint64_t seq;
    uint64_t ino;
    uint64_t start_ns;
    uint32_t opcode;
    uint32_t reserved;
};

static pthread_mutex_t zfx_flight_lock = PTHREAD_MUTEX_INITIALIZER;
static struct zfx_flight *zfx_flight;
static size_t zfx_flight_cap;  /* a power of two, or 0 before the first request */
static size_t zfx_flight_used;
static uint64_t zfx_flight_seq;
/* Requests that could not be tracked (no memory for the table): counted only. */
static uint64_t zfx_untracked;

static uint64_t zfx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline size_t zfx_slot_of(const void *key, size_t cap)
{
    return (size_t)(((uintptr_t)key >> 4) * 0x9E3779B97F4A7C15ull) & (cap - 1);
}

/* Caller holds zfx_flight_lock. Returns 0, or -ENOMEM (the table is unchanged). */
static int zfx_flight_grow_locked(void)
{
    size_t cap = zfx_flight_cap ? zfx_flight_cap * 2 : 256, i;
    struct zfx_flight *t = calloc(cap, sizeof *t);
    if (t == NULL)
        return -ENOMEM;
    for (i = 0; i < zfx_flight_cap; i++) {
        if (zfx_flight[i].key != NULL) {
            size_t j = zfx_slot_of(zfx_flight[i].key, cap);
            while (t[j].key != NULL)
                j = (j + 1) & (cap - 1);
            t[j] = zfx_flight[i];
        }
    }
    free(zfx_flight);
    zfx_flight = t;
    zfx_flight_cap = cap;
    return 0;
}

/* Caller holds zfx_flight_lock. The slot of `key`, or -1. */
static ssize_t zfx_flight_find_locked(const void *key)
{
    size_t i;
    if (zfx_flight_cap == 0)
        return -1;
    for (i = zfx_slot_of(key, zfx_flight_cap); zfx_flight[i].key != NULL;
         i = (i + 1) & (zfx_flight_cap - 1))
        if (zfx_flight[i].key == key)
            return (ssize_t)i;
    return -1;
}

/* Caller holds zfx_flight_lock: empty slot i, shifting later entries of its run back. */
static void zfx_flight_remove_locked(size_t i)
{
    size_t mask = zfx_flight_cap - 1, j = i;
    for (;;) {
        size_t k;
        j = (j + 1) & mask;
        if (zfx_flight[j].key == NULL)
            break;
        k = zfx_slot_of(zfx_flight[j].key, zfx_flight_cap);
        /* Move j into the hole at i unless its home k lies cyclically in (i, j]. */
        if ((j > i && (k <= i || k > j)) || (j < i && k <= i && k > j)) {
            zfx_flight[i] = zfx_flight[j];
            i = j;
        }
    }
    zfx_flight[i].key = NULL;
    zfx_flight_used--;
}

/* zfx_count_only (declared above) is set when the answers cannot be seen (pyfuse3
 * bound libfuse's reply functions before this module was global): count only. */

uint64_t zfx_census_begin(const void *key, uint32_t opcode, uint64_t ino)
{
    uint64_t seq = 0, now;
    uint32_t op = zfx_op_index(opcode);
    ZFX_ADD(zfx_recv[op], 1);
    if (zfx_count_only)
        return 0;
    now = zfx_now_ns();
    pthread_mutex_lock(&zfx_flight_lock);
    if ((zfx_flight_used + 1) * 2 > zfx_flight_cap && zfx_flight_grow_locked() != 0) {
        zfx_untracked++;
    } else {
        size_t i = zfx_slot_of(key, zfx_flight_cap);
        while (zfx_flight[i].key != NULL && zfx_flight[i].key != key)
            i = (i + 1) & (zfx_flight_cap - 1);
        if (zfx_flight[i].key == NULL)
            zfx_flight_used++;
        /* (A key still in the table was answered without a reply through libfuse:
         * impossible for fuse_req_t, which libfuse frees only on a reply.) */
        seq = ++zfx_flight_seq;
        zfx_flight[i] = (struct zfx_flight){key, seq, ino, now, op, 0};
    }
    pthread_mutex_unlock(&zfx_flight_lock);
    return seq;
}

int zfx_census_end(const void *key)
{
    ssize_t i;
    int op = -1;
    pthread_mutex_lock(&zfx_flight_lock);
    i = zfx_flight_find_locked(key);
    if (i >= 0) {
        op = (int)zfx_flight[i].opcode;
        zfx_flight_remove_locked((size_t)i);
    }
    pthread_mutex_unlock(&zfx_flight_lock);
    if (op >= 0)
        ZFX_ADD(zfx_done[op], 1);
    return op;
}

/* Whether `key` is in flight (not answered yet). */
static int zfx_census_pending(const void *key)
{
    ssize_t i;
    pthread_mutex_lock(&zfx_flight_lock);
    i = zfx_flight_find_locked(key);
    pthread_mutex_unlock(&zfx_flight_lock);
    return i >= 0;
}

/* The requests in flight for at least `older_than_ns`: up to `max` into `out` (in
 * table order); returns how many there are in all (may exceed max). */
int zfx_census_waiting(struct zfx_waiting *out, int max, uint64_t older_than_ns)
{
    uint64_t now = zfx_now_ns();
    size_t i;
    int n = 0;
    pthread_mutex_lock(&zfx_flight_lock);
    for (i = 0; i < zfx_flight_cap; i++) {
        const struct zfx_flight *f = &zfx_flight[i];
        uint64_t age = now > f->start_ns ? now - f->start_ns : 0;
        if (f->key == NULL || age < older_than_ns)
            continue;
        if (n < max)
            out[n] = (struct zfx_waiting){f->seq, f->ino, age, f->opcode, 0};
        n++;
    }
    pthread_mutex_unlock(&zfx_flight_lock);
    return n;
}

uint64_t zfx_census_in_flight(void)
{
    uint64_t n;
    pthread_mutex_lock(&zfx_flight_lock);
    n = zfx_flight_used;
    pthread_mutex_unlock(&zfx_flight_lock);
    return n;
}

/* ---- answering: libfuse's fuse_reply_* end the request in the census -------- *
 * Defined here, these win over libfuse's own for pyfuse3 and for libfuse itself
 * (the module is in the global symbol scope before pyfuse3 is imported; libfuse
 * calls its exported functions through its PLT). Each ends `req` in the census,
 * then calls libfuse's function. Replies to requests never begun (libfuse's own
 * ENOSYS answers, INIT) pass through uncounted. */
#define ZFX_REAL(name, ret, params)                                                  \
    typedef ret (*zfx_##name##_fn) params;                                           \
    static zfx_##name##_fn zfx_real_##name;

ZFX_REAL(fuse_reply_err, int, (fuse_req_t, int))
ZFX_REAL(fuse_reply_none, void, (fuse_req_t))
ZFX_REAL(fuse_reply_entry, int, (fuse_req_t, const struct fuse_entry_param *))
ZFX_REAL(fuse_reply_create, int, (fuse_req_t, const struct fuse_entry_param *,
                                  const struct fuse_file_info *))
ZFX_REAL(fuse_reply_attr, int, (fuse_req_t, const struct stat *, double))
ZFX_REAL(fuse_reply_readlink, int, (fuse_req_t, const char *))
ZFX_REAL(fuse_reply_open, int, (fuse_req_t, const struct fuse_file_info *))
ZFX_REAL(fuse_reply_write, int, (fuse_req_t, size_t))
ZFX_REAL(fuse_reply_buf, int, (fuse_req_t, const char *, size_t))
ZFX_REAL(fuse_reply_data, int, (fuse_req_t, struct fuse_bufvec *, enum fuse_buf_copy_flags))
ZFX_REAL(fuse_reply_iov, int, (fuse_req_t, const struct iovec *, int))
ZFX_REAL(fuse_reply_statfs, int, (fuse_req_t, const struct statvfs *))
ZFX_REAL(fuse_reply_xattr, int, (fuse_req_t, size_t))
ZFX_REAL(fuse_reply_lock, int, (fuse_req_t, const struct flock *))
ZFX_REAL(fuse_reply_bmap, int, (fuse_req_t, uint64_t))
ZFX_REAL(fuse_reply_poll, int, (fuse_req_t, unsigned))
ZFX_REAL(fuse_reply_lseek, int, (fuse_req_t, off_t))

/* libfuse's definition of `name` (never ours), or NULL. */
static void *zfx_libfuse_sym(const char *name)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD), *fn = NULL;
    if (lib == NULL)
        return NULL;
    fn = dlvsym(lib, name, "FUSE_3.0");
    if (fn == NULL)
        fn = dlsym(lib, name);
    dlclose(lib);
    return fn;
}

#define ZFX_RESOLVE(name) zfx_real_##name = (zfx_##name##_fn)zfx_libfuse_sym(#name)

/* Look up libfuse's reply functions (at fuse_session_new, before any request). */
static int zfx_resolve_replies(void)
{
    ZFX_RESOLVE(fuse_reply_err); ZFX_RESOLVE(fuse_reply_none); ZFX_RESOLVE(fuse_reply_entry);
    ZFX_RESOLVE(fuse_reply_create); ZFX_RESOLVE(fuse_reply_attr);
    ZFX_RESOLVE(fuse_reply_readlink); ZFX_RESOLVE(fuse_reply_open);
    ZFX_RESOLVE(fuse_reply_write); ZFX_RESOLVE(fuse_reply_buf); ZFX_RESOLVE(fuse_reply_data);
    ZFX_RESOLVE(fuse_reply_iov); ZFX_RESOLVE(fuse_reply_statfs);
    ZFX_RESOLVE(fuse_reply_xattr); ZFX_RESOLVE(fuse_reply_lock); ZFX_RESOLVE(fuse_reply_bmap);
    ZFX_RESOLVE(fuse_reply_poll); ZFX_RESOLVE(fuse_reply_lseek);
    return zfx_real_fuse_reply_err != NULL && zfx_real_fuse_reply_none != NULL ? 0 : -ENOSYS;
}

/* A reply before zfx_resolve_replies (none should come) resolves on the spot. */
#define ZFX_REPLY(name, params, args)                                                \
    int name params                                                                  \
    {                                                                                \
        zfx_census_end(req);                                                         \
        if (zfx_real_##name == NULL)                                                 \
            ZFX_RESOLVE(name);                                                       \
        return zfx_real_##name != NULL ? zfx_real_##name args : -ENOSYS;            \
    }

ZFX_REPLY(fuse_reply_err, (fuse_req_t req, int err), (req, err))
ZFX_REPLY(fuse_reply_entry, (fuse_req_t req, const struct fuse_entry_param *e), (req, e))
ZFX_REPLY(fuse_reply_create, (fuse_req_t req, const struct fuse_entry_param *e,
                              const struct fuse_file_info *fi), (req, e, fi))
ZFX_REPLY(fuse_reply_attr, (fuse_req_t req, const struct stat *attr, double timeout),
          (req, attr, timeout))
ZFX_REPLY(fuse_reply_readlink, (fuse_req_t req, const char *link), (req, link))
ZFX_REPLY(fuse_reply_open, (fuse_req_t req, const struct fuse_file_info *fi), (req, fi))
ZFX_REPLY(fuse_reply_write, (fuse_req_t req, size_t count), (req, count))
ZFX_REPLY(fuse_reply_buf, (fuse_req_t req, const char *buf, size_t size), (req, buf, size))
ZFX_REPLY(fuse_reply_data, (fuse_req_t req, struct fuse_bufvec *bufv,
                            enum fuse_buf_copy_flags flags), (req, bufv, flags))
ZFX_REPLY(fuse_reply_iov, (fuse_req_t req, const struct iovec *iov, int count),
          (req, iov, count))
ZFX_REPLY(fuse_reply_statfs, (fuse_req_t req, const struct statvfs *stbuf), (req, stbuf))
ZFX_REPLY(fuse_reply_xattr, (fuse_req_t req, size_t count), (req, count))
ZFX_REPLY(fuse_reply_lock, (fuse_req_t req, const struct flock *lock), (req, lock))
ZFX_REPLY(fuse_reply_bmap, (fuse_req_t req, uint64_t idx), (req, idx))
ZFX_REPLY(fuse_reply_poll, (fuse_req_t req, unsigned revents), (req, revents))
ZFX_REPLY(fuse_reply_lseek, (fuse_req_t req, off_t off), (req, off))

void fuse_reply_none(fuse_req_t req)
{
    zfx_census_end(req);
    if (zfx_real_fuse_reply_none == NULL)
        ZFX_RESOLVE(fuse_reply_none);
    if (zfx_real_fuse_reply_none != NULL)
        zfx_real_fuse_reply_none(req);
}

/* ---- the dispatch guard ------------------------------------------------------ *
 * pyfuse3's C-level handlers (Cython `cdef void`, Cython 3) return with a Python
 * exception set when they fail before handing a coroutine to their loop (a
 * conversion of the arguments, a failed buffer copy): nobody answers that
 * request, and the exception surfaces later as a SystemError that ends
 * pyfuse3's request loop. After every handler, on the thread that armed the
 * census (the trio thread, which holds the GIL while libfuse dispatches), a
 * pending exception is taken here: the request is answered EIO if it is still
 * in flight, and the exception goes to zonefs_py.fuseext._dispatch_failed (one
 * log line). */
static pthread_t zfx_py_thread;
static int zfx_py_thread_set;

static void zfx_after_dispatch(fuse_req_t req, uint32_t opcode)
{
    PyObject *type, *value, *tb, *mod, *res;
    int answered = 0;
    if (!zfx_py_thread_set || !pthread_equal(pthread_self(), zfx_py_thread) ||
        PyErr_Occurred() == NULL)
        return;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    if (req != NULL && zfx_unanswered(req)) {
        ZFX_ADD(zfx_dispatch_failures, 1);
        if (opcode == ZO_FORGET || opcode == ZO_BATCH_FORGET)
            fuse_reply_none(req);  /* no answer by protocol: only end the request */
        else
            fuse_reply_err(req, EIO);
        answered = 1;
    }
    mod = PyImport_ImportModule("zonefs_py.fuseext");
    if (mod != NULL) {
        res = PyObject_CallMethod(mod, "_dispatch_failed", "sOi",
                                  zfx_opcode_names[zfx_op_index(opcode)],
                                  value != NULL ? value : Py_None, answered);
        Py_XDECREF(res);
        Py_DECREF(mod);
    }
    PyErr_Clear();  /* a failure of the report itself goes nowhere */
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
}

/* The arrival number of the request being dispatched on the armed thread (0 between
 * requests): zonefs_py.fuseext's guard around pyfuse3's request coroutines reads it
 * (a cffi global, no call) when pyfuse3 creates the coroutine, to answer that
 * request if the coroutine fails later (zfx_census_fail). Trio thread only. */
uint64_t zfx_current_seq;

#define ZC_GUARD(req, opcode, ino, call)                                             \
    do {                                                                             \
        zfx_current_seq = zfx_census_begin((req), (opcode), (ino));                  \
        call;                                                                        \
        zfx_current_seq = 0;                                                         \
        zfx_after_dispatch((req), (opcode));                                         \
    } while (0)

/* Answer the request with arrival number `seq` with `err` if it is still in flight
 * (FORGET: end it, no answer by protocol); 1 if answered here, 0 if it had been. */
int zfx_census_fail(uint64_t seq, int err)
{
    const void *key = NULL;
    uint32_t op = 0;
    size_t i;
    if (seq == 0)
        return 0;
    pthread_mutex_lock(&zfx_flight_lock);
    for (i = 0; i < zfx_flight_cap; i++)
        if (zfx_flight[i].key != NULL && zfx_flight[i].seq == seq) {
            key = zfx_flight[i].key;
            op = zfx_flight[i].opcode;
            break;
        }
    pthread_mutex_unlock(&zfx_flight_lock);
    if (key == NULL)
        return 0;
    ZFX_ADD(zfx_dispatch_failures, 1);
    if (op == ZO_FORGET || op == ZO_BATCH_FORGET)
        fuse_reply_none((fuse_req_t)key);
    else
        fuse_reply_err((fuse_req_t)key, err);
    return 1;
}

/* ---- the wrappers around pyfuse3's handlers ---------------------------------- */

#define ZC_XATTR_NAMES 16
#define ZC_XATTR_LEN 64
/* GETXATTR by name: the first ZC_XATTR_NAMES - 1 names seen, then "(other)". Only the
 * trio thread counts these (libfuse dispatches GETXATTR there). */
static char zfx_xattr_name[ZC_XATTR_NAMES][ZC_XATTR_LEN];
static uint64_t zfx_xattr_count[ZC_XATTR_NAMES];
static int zfx_xattr_used;
static struct fuse_lowlevel_ops zfx_orig;

static void zfx_count_xattr(const char *name)
{
    int i;
    for (i = 0; i < zfx_xattr_used; i++)
        if (strncmp(zfx_xattr_name[i], name, ZC_XATTR_LEN - 1) == 0) {
            zfx_xattr_count[i]++;
            return;
        }
    if (zfx_xattr_used < ZC_XATTR_NAMES - 1) {
        i = zfx_xattr_used++;
        strncpy(zfx_xattr_name[i], name, ZC_XATTR_LEN - 1);
    } else {
        i = ZC_XATTR_NAMES - 1;
        strcpy(zfx_xattr_name[i], "(other)");
    }
    zfx_xattr_count[i]++;
}

/* One wrapper per handler: begin the request in the census, call pyfuse3's (or
 * ours), then the dispatch guard. `ino` is the inode the request names. */
#define ZC_WRAP(op, opcode, params, ino, args)                                       \
    static void zc_##op params                                                       \
    {                                                                                \
        ZC_GUARD(r, opcode, ino, zfx_orig.op args);                                  \
    }

typedef struct fuse_file_info zfi;
ZC_WRAP(lookup, ZO_LOOKUP, (fuse_req_t r, fuse_ino_t p, const char *n), p, (r, p, n))
ZC_WRAP(getattr, ZO_GETATTR, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(setattr, ZO_SETATTR, (fuse_req_t r, fuse_ino_t i, struct stat *a, int s, zfi *fi),
        i, (r, i, a, s, fi))
ZC_WRAP(readlink, ZO_READLINK, (fuse_req_t r, fuse_ino_t i), i, (r, i))
ZC_WRAP(mknod, ZO_MKNOD, (fuse_req_t r, fuse_ino_t p, const char *n, mode_t m, dev_t d),
        p, (r, p, n, m, d))
ZC_WRAP(mkdir, ZO_MKDIR, (fuse_req_t r, fuse_ino_t p, const char *n, mode_t m), p,
        (r, p, n, m))
ZC_WRAP(unlink, ZO_UNLINK, (fuse_req_t r, fuse_ino_t p, const char *n), p, (r, p, n))
ZC_WRAP(rmdir, ZO_RMDIR, (fuse_req_t r, fuse_ino_t p, const char *n), p, (r, p, n))
ZC_WRAP(symlink, ZO_SYMLINK, (fuse_req_t r, const char *l, fuse_ino_t p, const char *n),
        p, (r, l, p, n))
ZC_WRAP(rename, ZO_RENAME, (fuse_req_t r, fuse_ino_t p, const char *n, fuse_ino_t np,
                            const char *nn, unsigned int f), p, (r, p, n, np, nn, f))
ZC_WRAP(link, ZO_LINK, (fuse_req_t r, fuse_ino_t i, fuse_ino_t np, const char *nn), i,
        (r, i, np, nn))
ZC_WRAP(open, ZO_OPEN, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(read, ZO_READ, (fuse_req_t r, fuse_ino_t i, size_t s, off_t o, zfi *fi), i,
        (r, i, s, o, fi))
ZC_WRAP(write, ZO_WRITE, (fuse_req_t r, fuse_ino_t i, const char *b, size_t s, off_t o,
                          zfi *fi), i, (r, i, b, s, o, fi))
ZC_WRAP(write_buf, ZO_WRITE, (fuse_req_t r, fuse_ino_t i, struct fuse_bufvec *b, off_t o,
                              zfi *fi), i, (r, i, b, o, fi))
ZC_WRAP(flush, ZO_FLUSH, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(release, ZO_RELEASE, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(fsync, ZO_FSYNC, (fuse_req_t r, fuse_ino_t i, int d, zfi *fi), i, (r, i, d, fi))
ZC_WRAP(opendir, ZO_OPENDIR, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(readdir, ZO_READDIR, (fuse_req_t r, fuse_ino_t i, size_t s, off_t o, zfi *fi), i,
        (r, i, s, o, fi))
ZC_WRAP(readdirplus, ZO_READDIRPLUS, (fuse_req_t r, fuse_ino_t i, size_t s, off_t o,
                                      zfi *fi), i, (r, i, s, o, fi))
ZC_WRAP(releasedir, ZO_RELEASEDIR, (fuse_req_t r, fuse_ino_t i, zfi *fi), i, (r, i, fi))
ZC_WRAP(fsyncdir, ZO_FSYNCDIR, (fuse_req_t r, fuse_ino_t i, int d, zfi *fi), i,
        (r, i, d, fi))
ZC_WRAP(statfs, ZO_STATFS, (fuse_req_t r, fuse_ino_t i), i, (r, i))
ZC_WRAP(listxattr, ZO_LISTXATTR, (fuse_req_t r, fuse_ino_t i, size_t s), i, (r, i, s))
ZC_WRAP(access, ZO_ACCESS, (fuse_req_t r, fuse_ino_t i, int m), i, (r, i, m))
ZC_WRAP(create, ZO_CREATE, (fuse_req_t r, fuse_ino_t p, const char *n, mode_t m, zfi *fi),
        p, (r, p, n, m, fi))
ZC_WRAP(poll, ZO_POLL, (fuse_req_t r, fuse_ino_t i, zfi *fi, struct fuse_pollhandle *ph), i,
        (r, i, fi, ph))
ZC_WRAP(fallocate, ZO_FALLOCATE, (fuse_req_t r, fuse_ino_t i, int m, off_t o, off_t l,
                                  zfi *fi), i, (r, i, m, o, l, fi))
ZC_WRAP(copy_file_range, ZO_COPY_FILE_RANGE,
        (fuse_req_t r, fuse_ino_t ii, off_t oi, zfi *fi, fuse_ino_t io, off_t oo, zfi *fo,
         size_t l, int f), ii, (r, ii, oi, fi, io, oo, fo, l, f))

/* INIT: libfuse answers it itself (not through fuse_reply_*) right after the handler. */
static void zc_init(void *u, struct fuse_conn_info *c)
{
    zfx_census_received(ZO_INIT);
    zfx_orig.init(u, c);
    zfx_after_dispatch(NULL, ZO_INIT);
    zfx_census_answered(ZO_INIT);
}

/* FORGET and BATCH_FORGET get no answer by protocol: pyfuse3 ends them with
 * fuse_reply_none within the call, which counts them as answered. */
static void zc_forget(fuse_req_t r, fuse_ino_t i, uint64_t n)
{
    ZFX_ADD(zfx_forgotten, 1);
    ZC_GUARD(r, ZO_FORGET, i, zfx_orig.forget(r, i, n));
}

static void zc_forget_multi(fuse_req_t r, size_t count, struct fuse_forget_data *f)
{
    ZFX_ADD(zfx_forgotten, count);
    ZC_GUARD(r, ZO_BATCH_FORGET, 0, zfx_orig.forget_multi(r, count, f));
}

/* Set by Python (zfx_set_no_caps) while no file has a security.capability xattr. */
static int zfx_no_caps;
/* Set by Python (zfx_set_no_system_ns) when the engine stores no system.* xattr. */
static int zfx_no_system_ns;
static uint64_t zfx_caps_answered;

static void zc_getxattr(fuse_req_t r, fuse_ino_t i, const char *n, size_t s)
{
    uint64_t seq = zfx_census_begin(r, ZO_GETXATTR, i);
    zfx_count_xattr(n);
    /* The kernel asks this before every write(2) (security_inode_need_killpriv:
     * FUSE has no SB_NOSEC without FUSE_HANDLE_KILLPRIV_V2, which libfuse 3.14
     * cannot ask for). While no file has the attribute the answer is known:
     * give it here, without a trip through Python. */
    if (zfx_no_caps && strcmp(n, "security.capability") == 0) {
        zfx_caps_answered++;
        fuse_reply_err(r, ENODATA);
        return;
    }
    if (zfx_no_system_ns && strncmp(n, "system.", 7) == 0) {
        fuse_reply_err(r, EOPNOTSUPP);
        return;
    }
    zfx_current_seq = seq;
    zfx_orig.getxattr(r, i, n, s);
    zfx_current_seq = 0;
    zfx_after_dispatch(r, ZO_GETXATTR);
}

/* `cp -a` asks for and sets system.posix_acl_access on every file; the engine
 * stores no system.* attribute (ACLs are off), so the answer is known. */
static void zc_setxattr(fuse_req_t r, fuse_ino_t i, const char *n, const char *v, size_t s,
                        int f)
{
    uint64_t seq = zfx_census_begin(r, ZO_SETXATTR, i);
    if (zfx_no_system_ns && strncmp(n, "system.", 7) == 0) {
        fuse_reply_err(r, EOPNOTSUPP);
        return;
    }
    zfx_current_seq = seq;
    zfx_orig.setxattr(r, i, n, v, s, f);
    zfx_current_seq = 0;
    zfx_after_dispatch(r, ZO_SETXATTR);
}

static void zc_removexattr(fuse_req_t r, fuse_ino_t i, const char *n)
{
    uint64_t seq = zfx_census_begin(r, ZO_REMOVEXATTR, i);
    if (zfx_no_system_ns && strncmp(n, "system.", 7) == 0) {
        fuse_reply_err(r, EOPNOTSUPP);
        return;
    }
    zfx_current_seq = seq;
    zfx_orig.removexattr(r, i, n);
    zfx_current_seq = 0;
    zfx_after_dispatch(r, ZO_REMOVEXATTR);
}

void zfx_set_no_system_ns(int on)
{
    zfx_no_system_ns = on;
}

void zfx_set_no_caps(int on)
{
    zfx_no_caps = on;
}

uint64_t zfx_caps_answered_count(void)
{
    return zfx_caps_answered;
}

#define ZC_HOOK(op)                                                                  \
    do {                                                                             \
        if (zfx_ops.op != NULL)                                                      \
            zfx_ops.op = zc_##op;                                                    \
    } while (0)

/* Replace every handler present in zfx_ops by its counting wrapper. */
static void zfx_census_wrap(void)
{
    zfx_orig = zfx_ops;
    ZC_HOOK(init); ZC_HOOK(lookup); ZC_HOOK(forget); ZC_HOOK(forget_multi);
    ZC_HOOK(getattr); ZC_HOOK(setattr); ZC_HOOK(readlink); ZC_HOOK(mknod);
    ZC_HOOK(mkdir); ZC_HOOK(unlink); ZC_HOOK(rmdir); ZC_HOOK(symlink); ZC_HOOK(rename);
    ZC_HOOK(link); ZC_HOOK(open); ZC_HOOK(read); ZC_HOOK(write); ZC_HOOK(write_buf);
    ZC_HOOK(flush); ZC_HOOK(release); ZC_HOOK(fsync); ZC_HOOK(opendir);
    ZC_HOOK(readdir); ZC_HOOK(readdirplus); ZC_HOOK(releasedir); ZC_HOOK(fsyncdir);
    ZC_HOOK(statfs); ZC_HOOK(setxattr); ZC_HOOK(getxattr); ZC_HOOK(listxattr);
    ZC_HOOK(removexattr); ZC_HOOK(access); ZC_HOOK(create); ZC_HOOK(poll);
    ZC_HOOK(fallocate); ZC_HOOK(copy_file_range);
}

/* Arm (1), arm counting received requests only (2: the answers cannot be seen),
 * or disarm (0) the census for the next fuse_session_new; the calling thread is
 * the one whose handler failures the dispatch guard takes (it must hold the GIL
 * while libfuse dispatches there: pyfuse3's trio thread). */
void zfx_census_arm(int on)
{
    zfx_census_armed = on != 0;
    zfx_count_only = on == 2;
    zfx_py_thread = pthread_self();
    zfx_py_thread_set = on;
}

int zfx_census_slots(void)
{
    return ZFX_CENSUS_OPCODES;
}

/* The name of kernel opcode `slot` (NULL for numbers without a name here). */
const char *zfx_census_name(int slot)
{
    return slot >= 0 && slot < ZFX_CENSUS_OPCODES ? zfx_opcode_names[slot] : NULL;
}

/* Requests of opcode `slot` received since the mount. */
uint64_t zfx_census_count(int slot)
{
    return slot >= 0 && slot < ZFX_CENSUS_OPCODES ? ZFX_LOAD(zfx_recv[slot]) : 0;
}

/* Requests of opcode `slot` answered since the mount. */
uint64_t zfx_census_answered_count(int slot)
{
    return slot >= 0 && slot < ZFX_CENSUS_OPCODES ? ZFX_LOAD(zfx_done[slot]) : 0;
}

/* Inodes named by FORGET and BATCH_FORGET; failures answered by the dispatch guard;
 * requests not tracked (no memory for the table). */
uint64_t zfx_census_forgotten(void)
{
    return ZFX_LOAD(zfx_forgotten);
}

uint64_t zfx_census_dispatch_failures(void)
{
    return ZFX_LOAD(zfx_dispatch_failures);
}

uint64_t zfx_census_untracked(void)
{
    uint64_t n;
    pthread_mutex_lock(&zfx_flight_lock);
    n = zfx_untracked;
    pthread_mutex_unlock(&zfx_flight_lock);
    return n;
}

/* The i-th GETXATTR name seen (NULL past the last) and its count. */
const char *zfx_census_xattr(int i, uint64_t *count)
{
    if (i < 0 || i >= ZC_XATTR_NAMES || zfx_xattr_name[i][0] == '\0')
        return NULL;
    *count = zfx_xattr_count[i];
    return zfx_xattr_name[i];
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
    if (real == NULL || real == fuse_session_new || zfx_resolve_replies() != 0) {
        errno = ENOSYS;
        return NULL;
    }
    if (!zfx_armed && !zfx_census_armed)
        return real(args, op, op_size, userdata);
    memset(&zfx_ops, 0, sizeof zfx_ops);
    memcpy(&zfx_ops, op, op_size < sizeof zfx_ops ? op_size : sizeof zfx_ops);
    if (zfx_armed) {
        zfx_ops.fallocate = zfx_fallocate;
        zfx_ops.copy_file_range = zfx_copy_file_range;
        if (zfx_ops.getattr != NULL) {
            zfx_gate_next = zfx_ops.getattr;
            zfx_ops.getattr = zfx_gate_getattr;
        }
        zfx_installed = 1;
    }
    if (zfx_census_armed)
        zfx_census_wrap();
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
