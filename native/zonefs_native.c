/*
 * zonefs_native.c -- see zonefs_native.h for the conventions.
 *
 * Buffers: O_DIRECT needs aligned memory, and Python's bytes are not aligned,
 * so every transfer goes through a buffer of a zn_pool (one posix_memalign'd
 * slab cut into fixed-size buffers) and is copied to/from the caller's memory
 * here, in C, with the GIL released (a write from memory that is already
 * 4096-aligned goes to the device as it is). A transfer longer than one pool
 * buffer is done in buffer-sized chunks, in order.
 *
 * Batches: zn_batch() drives an io_uring (liburing) with at most one request
 * in flight per group -- the caller puts the writes of one zone in one group,
 * which keeps them in order, as a sequential zone requires -- and any number
 * of groups in flight up to the ring size. Without a ring it runs the same
 * requests one after the other with pread/pwrite.
 */
#define _GNU_SOURCE
#include "zonefs_native.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/blkzoned.h>
#include <linux/fs.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#define ZN_SECTOR 512ULL
#define ZN_ALIGN 4096ULL

_Static_assert(sizeof(struct zn_zone) == 64, "zn_zone must be 64 bytes");
_Static_assert(sizeof(struct zn_geometry) == 64, "zn_geometry must be 64 bytes");
_Static_assert(sizeof(struct zn_io) == 32, "zn_io must be 32 bytes");

/* ------------------------------------------------------------------ files */

int zn_open(const char *path, int flags)
{
    int oflags = O_CLOEXEC | ((flags & ZN_O_RDONLY) ? O_RDONLY : O_RDWR);
    struct stat st;

    if (flags & ZN_O_DIRECT)
        oflags |= O_DIRECT;
    /* O_EXCL without O_CREAT only means something for block devices. */
    if ((flags & ZN_O_EXCL) && stat(path, &st) == 0 && S_ISBLK(st.st_mode))
        oflags |= O_EXCL;
    int fd = open(path, oflags);
    return fd < 0 ? -errno : fd;
}

int zn_close(int fd)
{
    /* Never retry close() on EINTR: Linux has released the fd already. */
    if (close(fd) < 0 && errno != EINTR)
        return -errno;
    return 0;
}

int zn_fdatasync(int fd)
{
    while (fdatasync(fd) < 0) {
        if (errno != EINTR)
            return -errno;
    }
    return 0;
}

int zn_is_block_device(int fd)
{
    struct stat st;

    if (fstat(fd, &st) < 0)
        return -errno;
    return S_ISBLK(st.st_mode) ? 1 : 0;
}

int64_t zn_file_size(int fd)
{
    struct stat st;
    uint64_t size;

    if (fstat(fd, &st) < 0)
        return -errno;
    if (!S_ISBLK(st.st_mode))
        return (int64_t)st.st_size;
    if (ioctl(fd, BLKGETSIZE64, &size) < 0)
        return -errno;
    return (int64_t)size;
}

/* ------------------------------------------------------------------ sysfs */

/* Read a small sysfs text attribute into buf; return its length or -errno. */
static int read_attr(const char *path, char *buf, size_t size)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n;

    if (fd < 0)
        return -errno;
    do {
        n = read(fd, buf, size - 1);
    } while (n < 0 && errno == EINTR);
    int err = n < 0 ? -errno : 0;
    close(fd);
    if (err)
        return err;
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
        n--;
    buf[n] = '\0';
    return (int)n;
}

/* Find the queue/ directory of the block device st_rdev (a partition uses its disk's). */
static int queue_dir(dev_t rdev, char *out, size_t size)
{
    struct stat st;

    snprintf(out, size, "/sys/dev/block/%u:%u/queue", major(rdev), minor(rdev));
    if (stat(out, &st) == 0)
        return 0;
    snprintf(out, size, "/sys/dev/block/%u:%u/../queue", major(rdev), minor(rdev));
    if (stat(out, &st) == 0)
        return 0;
    return -ENOENT;
}

static int queue_u64(const char *qdir, const char *name, uint64_t *out)
{
    char path[512], text[64], *end;
    int n;

    snprintf(path, sizeof(path), "%s/%s", qdir, name);
    n = read_attr(path, text, sizeof(text));
    if (n < 0)
        return n;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || end == text)
        return -EINVAL;
    *out = v;
    return 0;
}

static int model_of(const char *qdir)
{
    char path[512], text[64];

    snprintf(path, sizeof(path), "%s/zoned", qdir);
    if (read_attr(path, text, sizeof(text)) < 0)
        return ZN_MODEL_NONE;  /* kernels without zoned support have no attribute */
    if (strcmp(text, "host-managed") == 0)
        return ZN_MODEL_HOST_MANAGED;
    if (strcmp(text, "host-aware") == 0)
        return ZN_MODEL_HOST_AWARE;
    return ZN_MODEL_NONE;
}

int zn_sysfs_zoned_model(const char *path)
{
    struct stat st;
    char qdir[256];

    if (stat(path, &st) < 0)
        return -errno;
    if (!S_ISBLK(st.st_mode))
        return -ENOTBLK;
    if (queue_dir(st.st_rdev, qdir, sizeof(qdir)) < 0)
        return ZN_MODEL_NONE;
    return model_of(qdir);
}

int zn_geometry(int fd, struct zn_geometry *out)
{
    struct stat st;
    char qdir[256];
    uint64_t v;
    int lbs = 0;
    unsigned int pbs = 0;
    uint32_t zone_sectors = 0, nr_zones = 0;

    memset(out, 0, sizeof(*out));
    if (fstat(fd, &st) < 0)
        return -errno;
    if (!S_ISBLK(st.st_mode))
        return -ENOTBLK;
    if (ioctl(fd, BLKGETSIZE64, &out->size_bytes) < 0)
        return -errno;
    if (ioctl(fd, BLKSSZGET, &lbs) < 0)
        return -errno;
    if (ioctl(fd, BLKPBSZGET, &pbs) < 0)
        return -errno;
    out->logical_block_size = (uint32_t)lbs;
    out->physical_block_size = pbs;
    if (queue_dir(st.st_rdev, qdir, sizeof(qdir)) == 0) {
        out->model = (uint32_t)model_of(qdir);
        if (queue_u64(qdir, "max_open_zones", &v) == 0)
            out->max_open_zones = (uint32_t)v;
        if (queue_u64(qdir, "max_active_zones", &v) == 0)
            out->max_active_zones = (uint32_t)v;
        if (queue_u64(qdir, "zone_append_max_bytes", &v) == 0)
            out->zone_append_max_bytes = (uint32_t)v;
        if (queue_u64(qdir, "max_sectors_kb", &v) == 0)
            out->max_io_bytes = (uint32_t)(v * 1024);
    }
    if (out->model == ZN_MODEL_NONE)
        return 0;
    if (ioctl(fd, BLKGETZONESZ, &zone_sectors) < 0)
        return -errno;
    if (ioctl(fd, BLKGETNRZONES, &nr_zones) < 0)
        return -errno;
    out->zone_size_bytes = (uint64_t)zone_sectors * ZN_SECTOR;
    out->nr_zones = nr_zones;
    return 0;
}

/* ------------------------------------------------------------------ zones */

#define ZN_REPORT_CHUNK 256U

int zn_report_zones(int fd, uint64_t offset, struct zn_zone *out, uint32_t max_zones)
{
    struct blk_zone_report *rep;
    uint32_t done = 0;
    uint64_t sector;
    int err = 0;

    if (offset % ZN_SECTOR)
        return -EINVAL;
    if (max_zones == 0)
        return 0;
    rep = calloc(1, sizeof(*rep) + ZN_REPORT_CHUNK * sizeof(struct blk_zone));
    if (!rep)
        return -ENOMEM;
    sector = offset / ZN_SECTOR;
    while (done < max_zones) {
        uint32_t want = max_zones - done < ZN_REPORT_CHUNK ? max_zones - done : ZN_REPORT_CHUNK;

        memset(rep, 0, sizeof(*rep));
        rep->sector = sector;
        rep->nr_zones = want;
        if (ioctl(fd, BLKREPORTZONE, rep) < 0) {
            err = -errno;
            break;
        }
        if (rep->nr_zones == 0)
            break;  /* past the last zone */
        for (uint32_t i = 0; i < rep->nr_zones && done < max_zones; i++) {
            const struct blk_zone *z = &rep->zones[i];
            struct zn_zone *o = &out[done++];

            memset(o, 0, sizeof(*o));
            o->start = z->start * ZN_SECTOR;
            o->len = z->len * ZN_SECTOR;
            o->capacity = (rep->flags & BLK_ZONE_REP_CAPACITY) ? z->capacity * ZN_SECTOR
                                                               : o->len;
            o->wp = z->wp * ZN_SECTOR;
            o->type = z->type;
            o->cond = z->cond;
            o->flags = (z->non_seq ? ZN_ZONE_NON_SEQ : 0) |
                       (z->reset ? ZN_ZONE_RESET_RECOMMENDED : 0);
            sector = z->start + z->len;
        }
    }
    free(rep);
    if (err && done == 0)
        return err;
    return (int)done;
}

int zn_zone_mgmt(int fd, int op, uint64_t offset, uint64_t length)
{
    struct blk_zone_range range;
    unsigned long req;

    switch (op) {
    case ZN_OP_RESET: req = BLKRESETZONE; break;
    case ZN_OP_OPEN: req = BLKOPENZONE; break;
    case ZN_OP_CLOSE: req = BLKCLOSEZONE; break;
    case ZN_OP_FINISH: req = BLKFINISHZONE; break;
    default: return -EINVAL;
    }
    if (offset % ZN_SECTOR || length % ZN_SECTOR || length == 0)
        return -EINVAL;
    range.sector = offset / ZN_SECTOR;
    range.nr_sectors = length / ZN_SECTOR;
    if (ioctl(fd, req, &range) < 0)
        return -errno;
    return 0;
}

/* ------------------------------------------------------------------ buffer pool */

struct zn_pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t buf_size;
    uint32_t nr_bufs;
    uint32_t nr_free;
    uint64_t acquires;
    uint64_t waits;
    unsigned char *slab;
    unsigned char **free_list;
};

struct zn_pool *zn_pool_new(uint32_t nr_bufs, uint64_t buf_size, int *err)
{
    struct zn_pool *p;
    void *slab = NULL;

    if (nr_bufs == 0 || buf_size == 0 || buf_size % ZN_ALIGN || buf_size > (1ULL << 30)) {
        *err = -EINVAL;
        return NULL;
    }
    p = calloc(1, sizeof(*p));
    if (!p) {
        *err = -ENOMEM;
        return NULL;
    }
    p->free_list = calloc(nr_bufs, sizeof(*p->free_list));
    int rc = p->free_list ? posix_memalign(&slab, ZN_ALIGN, (size_t)nr_bufs * buf_size) : ENOMEM;
    if (rc) {
        free(p->free_list);
        free(p);
        *err = -rc;
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->slab = slab;
    p->buf_size = buf_size;
    p->nr_bufs = p->nr_free = nr_bufs;
    for (uint32_t i = 0; i < nr_bufs; i++)
        p->free_list[i] = p->slab + (size_t)i * buf_size;
    *err = 0;
    return p;
}

void zn_pool_free(struct zn_pool *pool)
{
    if (!pool)
        return;
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
    free(pool->slab);
    free(pool->free_list);
    free(pool);
}

void zn_pool_get_stats(struct zn_pool *pool, struct zn_pool_stats *out)
{
    pthread_mutex_lock(&pool->mu);
    out->buf_size = pool->buf_size;
    out->nr_bufs = pool->nr_bufs;
    out->nr_free = pool->nr_free;
    out->acquires = pool->acquires;
    out->waits = pool->waits;
    pthread_mutex_unlock(&pool->mu);
}

/* Take a buffer; wait for one when `wait`, else return NULL if none is free. */
static unsigned char *pool_get(struct zn_pool *p, int wait)
{
    unsigned char *buf = NULL;

    pthread_mutex_lock(&p->mu);
    if (p->nr_free == 0 && wait) {
        p->waits++;
        while (p->nr_free == 0)
            pthread_cond_wait(&p->cv, &p->mu);
    }
    if (p->nr_free) {
        buf = p->free_list[--p->nr_free];
        p->acquires++;
    }
    pthread_mutex_unlock(&p->mu);
    return buf;
}

static void pool_put(struct zn_pool *p, unsigned char *buf)
{
    pthread_mutex_lock(&p->mu);
    p->free_list[p->nr_free++] = buf;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* ------------------------------------------------------------------ synchronous I/O */

static int check_io(uint32_t block_size, uint64_t offset, uint64_t length)
{
    if (block_size < ZN_SECTOR || block_size > ZN_ALIGN || (block_size & (block_size - 1)))
        return -EINVAL;
    if (offset % block_size || length % block_size || offset > INT64_MAX ||
        length > INT64_MAX - offset)
        return -EINVAL;
    return 0;
}

int zn_pread(int fd, struct zn_pool *pool, uint32_t block_size,
             uint64_t offset, void *dst, uint64_t length)
{
    uint64_t done = 0;
    int err = check_io(block_size, offset, length);

    if (err)
        return err;
    unsigned char *buf = length ? pool_get(pool, 1) : NULL;
    while (done < length) {
        uint64_t chunk = length - done < pool->buf_size ? length - done : pool->buf_size;
        ssize_t n = pread(fd, buf, chunk, (off_t)(offset + done));

        if (n < 0) {
            if (errno == EINTR)
                continue;
            err = -errno;
            break;
        }
        if (n == 0) {
            err = -EIO;  /* end of file or device before `length` bytes */
            break;
        }
        memcpy((unsigned char *)dst + done, buf, (size_t)n);
        done += (uint64_t)n;
    }
    if (buf)
        pool_put(pool, buf);
    return err;
}

int zn_pwrite(int fd, struct zn_pool *pool, uint32_t block_size,
              uint64_t offset, const void *src, uint64_t length)
{
    uint64_t done = 0;
    int err = check_io(block_size, offset, length);

    if (err)
        return err;
    /* An aligned source goes to the device as it is: no copy through the pool. */
    int direct = ((uintptr_t)src % ZN_ALIGN) == 0;
    unsigned char *buf = length && !direct ? pool_get(pool, 1) : NULL;
    while (done < length) {
        uint64_t chunk = length - done < pool->buf_size ? length - done : pool->buf_size;
        const unsigned char *from = (const unsigned char *)src + done;
        ssize_t n;

        if (!direct) {
            memcpy(buf, from, (size_t)chunk);
            from = buf;
        }
        do {
            n = pwrite(fd, from, chunk, (off_t)(offset + done));
        } while (n < 0 && errno == EINTR);
        if (n < 0) {
            err = -errno;
            break;
        }
        if (n == 0) {
            err = -EIO;
            break;
        }
        done += (uint64_t)n;  /* a short write continues from where it stopped */
    }
    if (buf)
        pool_put(pool, buf);
    return err;
}

/* ------------------------------------------------------------------ io_uring batches */

struct zn_ring {
    pthread_mutex_t mu;  /* one batch at a time per ring: an SQ is single-producer */
    uint32_t entries;
    struct io_uring ring;
};

struct zn_ring *zn_ring_new(uint32_t entries, int *err)
{
    struct zn_ring *r;

    if (entries == 0 || entries > 4096) {
        *err = -EINVAL;
        return NULL;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    int rc = io_uring_queue_init(entries, &r->ring, 0);
    if (rc < 0) {
        free(r);
        *err = rc;
        return NULL;
    }
    pthread_mutex_init(&r->mu, NULL);
    r->entries = r->ring.sq.ring_entries;
    *err = 0;
    return r;
}

void zn_ring_free(struct zn_ring *ring)
{
    if (!ring)
        return;
    io_uring_queue_exit(&ring->ring);
    pthread_mutex_destroy(&ring->mu);
    free(ring);
}

/* Per-group progress of a batch. */
struct zn_slot {
    uint32_t first, end;     /* range of `order` holding this group's requests */
    uint32_t cur;            /* index into `order` of the request in progress */
    uint64_t pos;            /* bytes of that request done */
    uint64_t chunk;          /* bytes of the chunk in flight */
    unsigned char *buf;      /* pool buffer of the chunk in flight, or NULL */
};

static int cmp_group(const void *a, const void *b, void *arg)
{
    const struct zn_io *reqs = arg;
    uint32_t ia = *(const uint32_t *)a, ib = *(const uint32_t *)b;

    if (reqs[ia].group != reqs[ib].group)
        return reqs[ia].group < reqs[ib].group ? -1 : 1;
    return ia < ib ? -1 : (ia > ib);
}

/* Finish the current request of slot s with `result` and move to the next one. */
static void slot_advance(struct zn_slot *s, struct zn_io *reqs, const uint32_t *order, int result)
{
    reqs[order[s->cur]].result = result;
    s->cur++;
    s->pos = 0;
    if (result < 0) {  /* later writes of the group would land at the wrong place */
        for (; s->cur < s->end; s->cur++)
            reqs[order[s->cur]].result = -ECANCELED;
    }
}

static int batch_sync(int fd, struct zn_pool *pool, uint32_t bs, int is_write,
                      struct zn_io *reqs, uint32_t n, const uint32_t *order)
{
    int first_err = 0;
    uint32_t i = 0;

    while (i < n) {
        struct zn_io *r = &reqs[order[i]];
        int rc = is_write ? zn_pwrite(fd, pool, bs, r->offset, r->buf, r->length)
                          : zn_pread(fd, pool, bs, r->offset, r->buf, r->length);

        r->result = rc;
        i++;
        if (rc < 0) {
            if (!first_err)
                first_err = rc;
            for (; i < n && reqs[order[i]].group == r->group; i++)
                reqs[order[i]].result = -ECANCELED;
        }
    }
    return first_err;
}

/* Queue the next chunk of slot `g`; return 1 if queued, 0 if no buffer is free. */
static int slot_queue(struct zn_ring *ring, struct zn_pool *pool, struct zn_slot *s, uint32_t g,
                      int fd, int is_write, struct zn_io *reqs, const uint32_t *order,
                      int wait)
{
    struct zn_io *r = &reqs[order[s->cur]];
    struct io_uring_sqe *sqe;

    if (!s->buf) {
        s->buf = pool_get(pool, wait);
        if (!s->buf)
            return 0;
    }
    s->chunk = r->length - s->pos < pool->buf_size ? r->length - s->pos : pool->buf_size;
    sqe = io_uring_get_sqe(&ring->ring);
    if (!sqe) {  /* cannot happen: in-flight count is kept below the SQ size */
        pool_put(pool, s->buf);
        s->buf = NULL;
        return 0;
    }
    if (is_write) {
        memcpy(s->buf, (const unsigned char *)r->buf + s->pos, (size_t)s->chunk);
        io_uring_prep_write(sqe, fd, s->buf, (unsigned)s->chunk, r->offset + s->pos);
    } else {
        io_uring_prep_read(sqe, fd, s->buf, (unsigned)s->chunk, r->offset + s->pos);
    }
    io_uring_sqe_set_data64(sqe, g);
    return 1;
}

/* Handle one completion for slot s; return -errno if its request failed, else 0. */
static int slot_complete(struct zn_slot *s, struct zn_pool *pool, int is_write, int res,
                         struct zn_io *reqs, const uint32_t *order)
{
    struct zn_io *r = &reqs[order[s->cur]];

    if (res == -EINTR || res == -EAGAIN)
        return 0;  /* resubmit the same chunk (buffer kept, still filled) */
    if (res == 0)
        res = -EIO;  /* end of device or file */
    if (res > 0) {
        if (!is_write)
            memcpy((unsigned char *)r->buf + s->pos, s->buf, (size_t)res);
        s->pos += (uint64_t)res;  /* short transfer: continue from here */
    }
    pool_put(pool, s->buf);
    s->buf = NULL;
    if (res < 0) {
        slot_advance(s, reqs, order, res);
        return res;
    }
    if (s->pos == r->length)
        slot_advance(s, reqs, order, 0);
    return 0;
}

static int batch_ring(struct zn_ring *ring, int fd, struct zn_pool *pool, int is_write,
                      struct zn_io *reqs, struct zn_slot *slots, uint32_t nslots,
                      const uint32_t *order)
{
    uint32_t inflight = 0, busy_mask_len = nslots;
    unsigned char *busy = calloc(busy_mask_len ? busy_mask_len : 1, 1);
    int first_err = 0;

    if (!busy)
        return -ENOMEM;
    for (;;) {
        uint32_t queued = 0;

        for (uint32_t g = 0; g < nslots && inflight + queued < ring->entries; g++) {
            struct zn_slot *s = &slots[g];

            if (busy[g] || s->cur >= s->end)
                continue;
            while (s->cur < s->end && reqs[order[s->cur]].length == 0)
                slot_advance(s, reqs, order, 0);
            if (s->cur >= s->end)
                continue;
            /* Wait for a buffer only when nothing of ours is in flight to free one. */
            if (!slot_queue(ring, pool, s, g, fd, is_write, reqs, order,
                            inflight + queued == 0))
                break;
            busy[g] = 1;
            queued++;
        }
        inflight += queued;
        if (inflight == 0)
            break;
        int rc = io_uring_submit_and_wait(&ring->ring, 1);
        if (rc < 0 && rc != -EINTR) {
            /* The ring itself failed: reap what we can, fail the rest. */
            first_err = rc;
            break;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;

        io_uring_for_each_cqe(&ring->ring, head, cqe) {
            uint32_t g = (uint32_t)io_uring_cqe_get_data64(cqe);
            int err = slot_complete(&slots[g], pool, is_write, cqe->res, reqs, order);

            if (err && !first_err)
                first_err = err;
            busy[g] = 0;
            inflight--;
            seen++;
        }
        io_uring_cq_advance(&ring->ring, seen);
    }
    if (inflight) {
        /* Only after a ring failure: drain before buffers go back to the pool. */
        while (inflight) {
            struct io_uring_cqe *cqe;

            if (io_uring_wait_cqe(&ring->ring, &cqe) < 0)
                break;
            uint32_t g = (uint32_t)io_uring_cqe_get_data64(cqe);
            if (slots[g].buf) {
                pool_put(pool, slots[g].buf);
                slots[g].buf = NULL;
            }
            io_uring_cqe_seen(&ring->ring, cqe);
            inflight--;
        }
        for (uint32_t g = 0; g < nslots; g++) {
            for (; slots[g].cur < slots[g].end; slots[g].cur++)
                reqs[order[slots[g].cur]].result = first_err;
        }
    }
    free(busy);
    return first_err;
}

int zn_batch(struct zn_ring *ring, int fd, struct zn_pool *pool, uint32_t block_size,
             int is_write, struct zn_io *reqs, uint32_t nr_reqs)
{
    uint32_t *order, nslots = 0;
    struct zn_slot *slots;
    int err = 0;

    for (uint32_t i = 0; i < nr_reqs; i++) {
        reqs[i].result = check_io(block_size, reqs[i].offset, reqs[i].length);
        if (reqs[i].result)
            err = reqs[i].result;
    }
    if (err || nr_reqs == 0)
        return err;  /* nothing was submitted: validation is all-or-nothing */
    order = malloc(nr_reqs * sizeof(*order));
    slots = calloc(nr_reqs, sizeof(*slots));
    if (!order || !slots) {
        free(order);
        free(slots);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < nr_reqs; i++)
        order[i] = i;
    qsort_r(order, nr_reqs, sizeof(*order), cmp_group, reqs);
    for (uint32_t i = 0; i < nr_reqs; i++) {
        if (i == 0 || reqs[order[i]].group != reqs[order[i - 1]].group) {
            slots[nslots].first = slots[nslots].cur = i;
            nslots++;
        }
        slots[nslots - 1].end = i + 1;
    }
    if (!ring) {
        err = batch_sync(fd, pool, block_size, is_write, reqs, nr_reqs, order);
    } else {
        pthread_mutex_lock(&ring->mu);
        err = batch_ring(ring, fd, pool, is_write, reqs, slots, nslots, order);
        pthread_mutex_unlock(&ring->mu);
    }
    free(order);
    free(slots);
    return err;
}

/* ------------------------------------------------------------ completion-driven reads */

/* What a slot's read is checked against when it completes (zn_aring_reap). */
struct zn_aslot {
    const uint8_t *csums;  /* NULL: not verified; else length / block_size checksums */
    uint32_t length;
    uint32_t block_size;
    const void *buf;
};

struct zn_aring {
    struct io_uring ring;
    int efd;
    uint32_t entries;      /* slots: reads in flight at most (<= CQ entries) */
    uint32_t inflight;
    struct zn_aslot *slots;
};

struct zn_aring *zn_aring_new(uint32_t entries, uint32_t sqpoll_idle_ms, int *err)
{
    struct zn_aring *r;
    int rc;

    if (entries == 0 || entries > 4096) {
        *err = -EINVAL;
        return NULL;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    r->slots = calloc(entries, sizeof(*r->slots));
    if (!r->slots) {
        free(r);
        *err = -ENOMEM;
        return NULL;
    }
    if (sqpoll_idle_ms) {
        /* A kernel thread takes submissions off the caller's thread; it sleeps
         * after sqpoll_idle_ms without work. Fall back to plain submission. */
        struct io_uring_params p;
        memset(&p, 0, sizeof(p));
        p.flags = IORING_SETUP_SQPOLL;
        p.sq_thread_idle = sqpoll_idle_ms;
        rc = io_uring_queue_init_params(entries, &r->ring, &p);
        if (rc < 0)
            rc = io_uring_queue_init(entries, &r->ring, 0);
    } else {
        rc = io_uring_queue_init(entries, &r->ring, 0);
    }
    if (rc < 0) {
        free(r->slots);
        free(r);
        *err = rc;
        return NULL;
    }
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        rc = -errno;
        io_uring_queue_exit(&r->ring);
        free(r->slots);
        free(r);
        *err = rc;
        return NULL;
    }
    rc = io_uring_register_eventfd(&r->ring, r->efd);
    if (rc < 0) {
        close(r->efd);
        io_uring_queue_exit(&r->ring);
        free(r->slots);
        free(r);
        *err = rc;
        return NULL;
    }
    /* Never more reads in flight than CQ entries: no completion is ever dropped. */
    r->entries = entries < r->ring.cq.ring_entries ? entries : r->ring.cq.ring_entries;
    *err = 0;
    return r;
}

void zn_aring_free(struct zn_aring *ring)
{
    if (!ring)
        return;
    io_uring_queue_exit(&ring->ring);
    close(ring->efd);
    free(ring->slots);
    free(ring);
}

int zn_aring_eventfd(struct zn_aring *ring)
{
    return ring->efd;
}

static inline uint32_t block_csum(const uint8_t *p, uint32_t block_size);

static int block_csum_ok(const uint8_t *p, uint32_t length, uint32_t block_size,
                         const uint8_t *csums)
{
    for (uint32_t i = 0; i < length / block_size; i++) {
        const uint8_t *e = csums + (uint64_t)i * 4;
        uint32_t want = (uint32_t)e[0] | (uint32_t)e[1] << 8 | (uint32_t)e[2] << 16
                        | (uint32_t)e[3] << 24;
        if (block_csum(p + (uint64_t)i * block_size, block_size) != want)
            return (int)i;
    }
    return -1;
}

int zn_aring_read(struct zn_aring *ring, int fd, void *buf, uint32_t length,
                  uint64_t offset, uint32_t slot, const uint8_t *csums,
                  uint32_t block_size)
{
    struct io_uring_sqe *sqe;
    int rc;

    if (length == 0 || slot >= ring->entries || (csums && (block_size == 0
            || length % block_size)))
        return -EINVAL;
    if (ring->inflight >= ring->entries)
        return -EBUSY;
    sqe = io_uring_get_sqe(&ring->ring);
    if (!sqe)
        return -EBUSY;
    io_uring_prep_read(sqe, fd, buf, length, offset);
    io_uring_sqe_set_data64(sqe, slot);
    ring->slots[slot].csums = csums;
    ring->slots[slot].length = length;
    ring->slots[slot].block_size = block_size;
    ring->slots[slot].buf = buf;
    do {
        rc = io_uring_submit(&ring->ring);
    } while (rc == -EINTR);
    if (rc < 0)
        return rc;
    ring->inflight++;
    return 0;
}

int zn_aring_reap(struct zn_aring *ring, uint32_t *slots, int32_t *results, int32_t *bad,
                  uint32_t max, int clear)
{
    struct io_uring_cqe *cqe;
    unsigned head;
    uint32_t n = 0;
    uint64_t count;

    /* Clear first: a completion posted after this read signals again. */
    if (clear && read(ring->efd, &count, sizeof(count)) < 0 && errno != EAGAIN)
        return -errno;
    io_uring_for_each_cqe(&ring->ring, head, cqe) {
        if (n == max)
            break;
        slots[n] = (uint32_t)io_uring_cqe_get_data64(cqe);
        results[n] = cqe->res;
        bad[n] = -1;
        n++;
    }
    io_uring_cq_advance(&ring->ring, n);
    ring->inflight -= n;
    /* Verify after advancing: the slots' buffers are the caller's now, the CQ is free. */
    for (uint32_t i = 0; i < n; i++) {
        struct zn_aslot *s = &ring->slots[slots[i] < ring->entries ? slots[i] : 0];
        if (slots[i] >= ring->entries || !s->csums || results[i] != (int32_t)s->length)
            continue;
        bad[i] = block_csum_ok(s->buf, s->length, s->block_size, s->csums);
        if (bad[i] >= 0)
            results[i] = ZN_AR_BADSUM;
        s->csums = NULL;
    }
    return (int)n;
}

void *zn_aligned_alloc(uint64_t size)
{
    void *p = NULL;

    if (posix_memalign(&p, 4096, size ? size : 4096) != 0)
        return NULL;
    return p;
}

void zn_aligned_free(void *ptr)
{
    free(ptr);
}

/* ------------------------------------------------------------------ block checksums */

static inline uint32_t block_csum(const uint8_t *p, uint32_t block_size)
{
    return (uint32_t)XXH3_64bits(p, block_size);
}

int zn_block_csums(const void *data, uint64_t length, uint32_t block_size, uint8_t *out)
{
    const uint8_t *p = data;

    if (block_size == 0 || length % block_size)
        return -EINVAL;
    for (uint64_t i = 0; i < length / block_size; i++) {
        uint32_t c = block_csum(p + i * block_size, block_size);
        out[i * 4] = (uint8_t)c;
        out[i * 4 + 1] = (uint8_t)(c >> 8);
        out[i * 4 + 2] = (uint8_t)(c >> 16);
        out[i * 4 + 3] = (uint8_t)(c >> 24);
    }
    return 0;
}

int64_t zn_first_bad_block(const void *data, uint64_t length, uint32_t block_size,
                           const uint8_t *csums)
{
    const uint8_t *p = data;

    if (block_size == 0)
        return -EINVAL;
    for (uint64_t i = 0; i < length / block_size; i++) {
        const uint8_t *e = csums + i * 4;
        uint32_t want = (uint32_t)e[0] | (uint32_t)e[1] << 8 | (uint32_t)e[2] << 16
                        | (uint32_t)e[3] << 24;
        if (block_csum(p + i * block_size, block_size) != want)
            return (int64_t)i;
    }
    return -1;
}
