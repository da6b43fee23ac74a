/*
 * The data plane's request dispatcher and read map (issue 43, DESIGN 4.10).
 *
 * One C thread (the dispatcher) is the only reader of /dev/fuse. It answers
 * a READ of a file whose read map Python published itself (device read,
 * every block checked against its xxh3 checksum, reply written to
 * /dev/fuse); every other request goes, in arrival order, to a queue that
 * pyfuse3's unchanged receive loop takes from:
 *
 *   fuse_session_fd          -> an eventfd, readable while the queue holds a
 *                               request or the session ended;
 *   fuse_session_receive_buf -> the next queued request (its buffer handed
 *                               over: pyfuse3's old one comes back to the pool),
 *                               -EINTR when none, 0 once the dispatcher saw
 *                               ENODEV (after fuse_session_exit, as libfuse);
 *   fuse_session_destroy     -> stops and joins the dispatcher first.
 *
 * These definitions win over libfuse's the same way as fuse_session_new's in
 * zonefs_fuseext.c (this file is compiled into the same module): the module is
 * in the global symbol scope before pyfuse3 is imported. Unarmed (zdp_arm(0),
 * `-o c_reads=off`) each passes the call on to libfuse's own function.
 * libfuse keeps answering what it processes through its own descriptor (the
 * same open file as the dispatcher's dup of it); one writev of {out header,
 * data} to /dev/fuse is one complete reply, whichever thread writes it.
 *
 * The read map (what Python promises): an entry per inode, published by the
 * trio thread (zdp_publish) only while nothing can change the file's bytes
 * or size, and revoked (zdp_revoke) before any change to them is applied.
 * The dispatcher itself deletes an inode's entry when it reads a request
 * that may change the file (WRITE, SETATTR, FALLOCATE, COPY_FILE_RANGE's
 * destination, OPEN with O_TRUNC, SETXATTR, REMOVEXATTR, unknown opcodes) before it
 * queues it, and remembers its sequence number: a publish is refused while
 * such a request has not been handed to pyfuse3 (zdp_handed_seq), so a READ
 * that arrives after a mutating request is never answered from the bytes
 * before it (DESIGN 4.4's rule, extended to every mutating opcode).
 *
 * What C promises Python: a zone is pinned (zdp_zone_pins) from the moment a
 * READ's pieces are looked up (under zdp_lock, the same step) until its
 * device reads are done and verified; a piece without checksums, a checksum
 * mismatch, a failed device read, a READ larger than the buffer, or anything
 * else not known here is handed to Python untouched, with a reason counter.
 *
 * Batches: each turn the dispatcher reads every request at hand (non-blocking,
 * up to ZDP_BATCH, while one of ZDP_SLOTS read slots is free), looks up and
 * pins each servable READ into a slot (its own aligned buffer, spans and
 * checksums) and queues its device reads on an io_uring; every other request
 * is queued to pyfuse3 at once, in arrival order, not behind device reads. One
 * io_uring_submit per turn. Completions are reaped when the ring's eventfd
 * (polled with /dev/fuse and the stop fd) fires: a slot whose reads are all
 * done is verified, answered (or handed on), unpinned and freed. A READ served
 * in C may thus be answered after a later request was handed on: the two were
 * in flight together, either order is one the kernel allows (it has not
 * answered either). Shutdown and the end of the session wait for every device
 * read in flight before the ring and the buffers go. When the ring cannot be
 * set up the device is read by pread on the same thread (said once on stderr
 * and in the log; zdp_io_mode()).
 *
 * Write streams (issue 44, native/zonefs_cwrite.c, DESIGN 4.11): every request
 * the dispatcher reads passes zdw_request first, which takes a WRITE of a file
 * with an armed stream, answers the security.capability probe, or queues a
 * stream's staged bytes (or ends it) before the request is handed on.
 *
 * Tenants (issue 45): Python gives each published map its file's tenant id
 * (zdp_publish_tenant, 0: none); a READ served from it adds its reply bytes to
 * zdp_tenant_bytes[tenant], which Python reads (zdp_tenant_served) for the
 * tenants' read activity and rates (fs/data/tenantqos.py).
 *
 * Locking: `zdp_lock` protects the map (zdp_tab, every entry, zdp_mutseq).
 * `zdp_qlock` protects the queue, the buffer pool and the eventfd's value
 * (non-zero iff the queue holds a request or the session ended). Counters
 * written by the dispatcher alone are read by Python with atomic loads.
 * Conventions as native/zonefs_native.c: 0 or -errno, no Python objects.
 */
#include <fcntl.h>
#include <liburing.h>
#include <sched.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#define XXH_INLINE_ALL
#include <xxhash.h>

/* ---- the kernel's request layout (include/uapi/linux/fuse.h, 7.31+) ------- */
struct zdp_in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct zdp_out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct zdp_read_in {
    uint64_t fh, offset;
    uint32_t size, read_flags;
    uint64_t lock_owner;
    uint32_t flags, padding;
};
struct zdp_open_in {
    uint32_t flags, open_flags;
};
struct zdp_copy_in {
    uint64_t fh_in, off_in, nodeid_out, fh_out, off_out, len, flags;
};
struct zdp_write_in {
    uint64_t fh, offset;
    uint32_t size, write_flags;
    uint64_t lock_owner;
    uint32_t flags, padding;
};
_Static_assert(sizeof(struct zdp_in_header) == 40, "fuse_in_header");
_Static_assert(sizeof(struct zdp_write_in) == 40, "fuse_write_in");
_Static_assert(sizeof(struct zdp_out_header) == 16, "fuse_out_header");
_Static_assert(sizeof(struct zdp_read_in) == 40, "fuse_read_in");

enum {
    ZOP_FORGET = 2, ZOP_INTERRUPT = 36, ZOP_BATCH_FORGET = 42,
    ZOP_SETATTR = 4, ZOP_OPEN = 14, ZOP_READ = 15, ZOP_WRITE = 16, ZOP_SETXATTR = 21,
    ZOP_REMOVEXATTR = 24, ZOP_IOCTL = 39, ZOP_FALLOCATE = 43, ZOP_COPY_FILE_RANGE = 47,
    ZOP_KNOWN_MAX = 51,
};

/* ---- the read map ----------------------------------------------------------- */
/* One piece of a published file (48 bytes; the cffi cdef has the same). */
struct zdp_piece {
    uint64_t file_off;   /* bytes, block-aligned */
    uint64_t length;     /* bytes, whole blocks */
    uint64_t dev_off;    /* where pread reads it (the device's direct_read_target) */
    uint32_t zone;       /* zone pinned while it is read */
    uint32_t flags;      /* ZDP_HOLE, ZDP_PYTHON */
    uint64_t csum_idx;   /* index of its first block's checksum in the csums blob */
    int32_t fd;          /* device fd for pread */
    uint32_t reserved;
};
#define ZDP_HOLE 1u      /* zeros */
#define ZDP_PYTHON 2u    /* not readable here (no checksums at hand): hand on */

struct zdp_entry {
    uint64_t ino, size;
    uint32_t npieces;
    uint32_t tenant;     /* the file's tenant, < ZDP_TENANTS (0: none) */
    struct zdp_piece *pieces;
    uint8_t *csums;
    uint64_t ncsums;
    struct zdp_entry *next;
};

/* Reasons a READ went to Python (zdp_stats order; names in dataplane/__init__.py). */
enum {
    ZR_NOT_PUBLISHED, ZR_MUTATED, ZR_NO_CSUMS, ZR_CSUM_MISMATCH, ZR_DEVICE_ERROR,
    ZR_TOO_LARGE, ZR_NO_MEMORY, ZR_NREASONS
};

#define ZDP_MUTSEQ 65536         /* last mutating request's seq, by ino % this */
#define ZDP_LAT_BUCKETS 32       /* log2(ns) latency histogram */
#define ZDP_BUFSZ ((1u << 20) + 8192u)
#define ZDP_MAX_READ (1u << 20)
#define ZDP_POOL_KEEP 64

static pthread_mutex_t zdp_lock = PTHREAD_MUTEX_INITIALIZER;
static struct zdp_entry **zdp_tab;        /* protected by zdp_lock */
static uint64_t zdp_tab_size;             /* protected by zdp_lock */
static uint64_t zdp_entries;              /* protected by zdp_lock */
static uint64_t zdp_mutseq[ZDP_MUTSEQ];   /* protected by zdp_lock */
static uint32_t *zdp_pins;                /* per zone, atomic; sized by zdp_configure */
static uint32_t zdp_nzones;
static uint32_t zdp_block_size = 4096;

/* ---- the queue to pyfuse3 --------------------------------------------------- */
struct zdp_node {
    struct zdp_node *next;
    void *mem;        /* ZDP_BUFSZ bytes, malloc'd (pyfuse3 frees with free()) */
    size_t size;
    uint64_t seq;
};
static pthread_mutex_t zdp_qlock = PTHREAD_MUTEX_INITIALIZER;
static struct zdp_node *zdp_qhead, *zdp_qtail;  /* protected by zdp_qlock */
static void *zdp_pool[ZDP_POOL_KEEP];            /* protected by zdp_qlock */
static int zdp_npool;                            /* protected by zdp_qlock */
static int zdp_ended;       /* 1: ENODEV seen; protected by zdp_qlock */
static int zdp_end_err;     /* -errno of a failed read (0: unmounted); zdp_qlock */
static uint64_t zdp_handed;  /* seq of the last request handed (trio thread; zdp_lock to read) */

/* ---- the thread ------------------------------------------------------------- */
static int zdp_armed_flag;
static int zdp_no_uring;        /* 1: pread mode (tests, zdp_set_no_uring) */
static int zdp_running;         /* the dispatcher thread was started */
static pthread_t zdp_thread;
static int zdp_fd = -1;         /* our dup of the session's /dev/fuse fd */
static int zdp_qfd = -1;        /* eventfd: what pyfuse3 waits on */
static int zdp_stopfd = -1;     /* eventfd: tells the dispatcher to stop */
static char zdp_why[160];       /* why the dispatcher did not start */

/* Counters (written by the dispatcher; read with atomic loads). */
static uint64_t zdp_seq;                   /* requests read */
static uint64_t zdp_served, zdp_served_bytes;
static uint64_t zdp_handed_reads[ZR_NREASONS];
static uint64_t zdp_lat[ZDP_LAT_BUCKETS];
static uint64_t zdp_lat_sum_ns;
#define ZDP_TENANTS 4096                   /* TENANT_MAX_ID + 1 (format/constants.py) */
static uint64_t zdp_tenant_bytes[ZDP_TENANTS];   /* bytes served per tenant */

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define BUMP(x, n) __atomic_fetch_add(&(x), (n), __ATOMIC_RELAXED)

typedef int (*zdp_fd_fn)(struct fuse_session *);
typedef int (*zdp_recv_fn)(struct fuse_session *, struct fuse_buf *);
typedef void (*zdp_destroy_fn)(struct fuse_session *);

static void *zdp_real(const char *name)
{
    void *lib = dlopen("libfuse3.so.3", RTLD_LAZY | RTLD_NOLOAD);
    void *fn = NULL;
    if (lib != NULL) {
        fn = dlvsym(lib, name, "FUSE_3.0");
        if (fn == NULL)
            fn = dlsym(lib, name);
        dlclose(lib);
    }
    return fn;
}

/* ---- map ---------------------------------------------------------------------- */
static void zdp_entry_free(struct zdp_entry *e)
{
    if (e != NULL) {
        free(e->pieces);
        free(e->csums);
        free(e);
    }
}

/* Unlink and free ino's entry; caller holds zdp_lock. */
static void zdp_remove_locked(uint64_t ino)
{
    struct zdp_entry **pp, *e;
    if (zdp_tab == NULL)
        return;
    for (pp = &zdp_tab[ino % zdp_tab_size]; (e = *pp) != NULL; pp = &e->next)
        if (e->ino == ino) {
            *pp = e->next;
            zdp_entries--;
            zdp_entry_free(e);
            return;
        }
}

static struct zdp_entry *zdp_find_locked(uint64_t ino)
{
    struct zdp_entry *e;
    if (zdp_tab == NULL)
        return NULL;
    for (e = zdp_tab[ino % zdp_tab_size]; e != NULL; e = e->next)
        if (e->ino == ino)
            return e;
    return NULL;
}

static void zdp_grow_locked(void)
{
    uint64_t n = zdp_tab_size ? zdp_tab_size * 2 : 1024, i;
    struct zdp_entry **t = calloc(n, sizeof *t), *e, *next;
    if (t == NULL)
        return;
    for (i = 0; i < zdp_tab_size; i++)
        for (e = zdp_tab[i]; e != NULL; e = next) {
            next = e->next;
            e->next = t[e->ino % n];
            t[e->ino % n] = e;
        }
    free(zdp_tab);
    zdp_tab = t;
    zdp_tab_size = n;
}

/* Configure the geometry (before arming): zones, block size. 0 or -errno. */
int zdp_configure(uint32_t nzones, uint32_t block_size)
{
    uint32_t *pins;
    if (block_size == 0 || (block_size & (block_size - 1)) != 0)
        return -EINVAL;
    pins = calloc(nzones ? nzones : 1, sizeof *pins);
    if (pins == NULL)
        return -ENOMEM;
    pthread_mutex_lock(&zdp_lock);
    free(zdp_pins);
    zdp_pins = pins;
    zdp_nzones = nzones;
    zdp_block_size = block_size;
    pthread_mutex_unlock(&zdp_lock);
    return 0;
}

/* Publish ino's map (copied). -EAGAIN when a request that may change the file
 * was read by the dispatcher and not yet handed to pyfuse3; -EINVAL for a map
 * that does not fit the geometry. */
int zdp_publish_tenant(uint64_t ino, uint64_t size, const struct zdp_piece *pieces,
                       uint32_t npieces, const uint8_t *csums, uint64_t ncsums,
                       uint32_t tenant)
{
    struct zdp_entry *e;
    uint32_t i;
    if (tenant >= ZDP_TENANTS)
        return -EINVAL;
    for (i = 0; i < npieces; i++) {
        const struct zdp_piece *p = &pieces[i];
        if (p->flags & (ZDP_HOLE | ZDP_PYTHON))
            continue;
        if (p->zone >= zdp_nzones || p->length % zdp_block_size != 0
                || p->dev_off % zdp_block_size != 0
                || p->csum_idx + p->length / zdp_block_size > ncsums)
            return -EINVAL;
    }
    e = calloc(1, sizeof *e);
    if (e == NULL)
        return -ENOMEM;
    e->ino = ino;
    e->size = size;
    e->npieces = npieces;
    e->tenant = tenant;
    e->ncsums = ncsums;
    e->pieces = malloc((npieces ? npieces : 1) * sizeof *pieces);
    e->csums = malloc(ncsums ? ncsums * 4 : 1);
    if (e->pieces == NULL || e->csums == NULL) {
        zdp_entry_free(e);
        return -ENOMEM;
    }
    memcpy(e->pieces, pieces, npieces * sizeof *pieces);
    memcpy(e->csums, csums, ncsums * 4);
    pthread_mutex_lock(&zdp_lock);
    if (zdp_mutseq[ino % ZDP_MUTSEQ] > zdp_handed) {
        pthread_mutex_unlock(&zdp_lock);
        zdp_entry_free(e);
        return -EAGAIN;
    }
    zdp_remove_locked(ino);
    if (zdp_entries + 1 > zdp_tab_size)
        zdp_grow_locked();
    if (zdp_tab == NULL) {
        pthread_mutex_unlock(&zdp_lock);
        zdp_entry_free(e);
        return -ENOMEM;
    }
    e->next = zdp_tab[ino % zdp_tab_size];
    zdp_tab[ino % zdp_tab_size] = e;
    zdp_entries++;
    pthread_mutex_unlock(&zdp_lock);
    return 0;
}

/* zdp_publish_tenant for a file of no tenant. */
int zdp_publish(uint64_t ino, uint64_t size, const struct zdp_piece *pieces,
                uint32_t npieces, const uint8_t *csums, uint64_t ncsums)
{
    return zdp_publish_tenant(ino, size, pieces, npieces, csums, ncsums, 0);
}

/* Revoke ino's map: when this returns no READ will be served from it (a READ
 * that looked it up before has its zones pinned). */
void zdp_revoke(uint64_t ino)
{
    pthread_mutex_lock(&zdp_lock);
    zdp_remove_locked(ino);
    pthread_mutex_unlock(&zdp_lock);
}

void zdp_revoke_all(void)
{
    uint64_t i;
    struct zdp_entry *e, *next;
    pthread_mutex_lock(&zdp_lock);
    for (i = 0; i < zdp_tab_size; i++) {
        for (e = zdp_tab[i]; e != NULL; e = next) {
            next = e->next;
            zdp_entry_free(e);
        }
        zdp_tab[i] = NULL;
    }
    zdp_entries = 0;
    pthread_mutex_unlock(&zdp_lock);
}

int zdp_published(uint64_t ino)
{
    int r;
    pthread_mutex_lock(&zdp_lock);
    r = zdp_find_locked(ino) != NULL;
    pthread_mutex_unlock(&zdp_lock);
    return r;
}

uint32_t zdp_zone_pins(uint32_t zone)
{
    return zdp_pins != NULL && zone < zdp_nzones ? LOAD(zdp_pins[zone]) : 0;
}

/* ---- serving READs: slots, io_uring batches ------------------------------------ */
struct zdp_span {        /* a piece's part of one READ, copied out under zdp_lock */
    uint64_t buf_off, dev_off, length;
    int fd;
    uint32_t zone, hole;
    const uint8_t *sums;  /* into the slot's sums */
};
#define ZDP_MAX_SPANS 256
#define ZDP_SLOTS 32             /* READs in flight at most */
#define ZDP_BATCH 64             /* requests read from /dev/fuse per turn at most */
#define ZDP_BIG_REQUEST (64u << 10)   /* a request this large: submit and reap after it */
#define ZDP_RING 256             /* SQ entries (device reads in flight at most) */
#define ZDP_CANCEL_TAG UINT64_MAX   /* user_data of the cancel-all SQE */

/* One READ being served: looked up and pinned, its device reads in flight. */
struct zdp_slot {
    int used;
    uint64_t t0, seq, skip, reply_len;
    uint32_t tenant;              /* its map's tenant (zdp_tenant_bytes) */
    struct zdp_in_header in;      /* the request, to hand it on if it fails */
    struct zdp_read_in rd;
    int nspans, pending, fail;    /* fail: 0, or 1 + reason */
    uint8_t *buf;                 /* ZDP_BUFSZ, 4096-aligned, kept across READs */
    struct zdp_span spans[ZDP_MAX_SPANS];
    uint8_t sums[(ZDP_MAX_READ / 512 + 8) * 4];
};
static struct zdp_slot *zdp_slots;    /* ZDP_SLOTS of them (dispatcher only) */
static int zdp_nfree;                 /* free slots (dispatcher only) */
static struct io_uring zdp_ring;      /* dispatcher only once started */
static int zdp_uring;                 /* 1: zdp_ring set up; 0: pread */
static int zdp_ringfd = -1;           /* eventfd registered with zdp_ring */
static uint32_t zdp_sq_inflight;      /* device reads submitted and not reaped */
static uint32_t zdp_sq_prepped;       /* SQEs prepared and not submitted */
static char zdp_io_why[160];          /* why io_uring is not used ("" when it is) */
static uint64_t zdp_submits, zdp_submitted;   /* io_uring_submit calls, SQEs submitted */
static uint64_t zdp_inline_reads;     /* READs read by pread as the only request at hand */
static int zdp_ring_signalled = 1;    /* the ring's eventfd may be non-zero (poll said so) */
static int zdp_lone_on = 1;           /* the lone READ is read by pread (zdp_set_lone) */
#define ZDP_LONE_PIECES 2             /* at most this many device reads by pread */

static uint64_t zdp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Look up and pin into slot s (its spans and sums). >= 0: number of spans (bytes
 * to reply in s->reply_len, first byte at s->buf + s->skip); -1 - reason: hand on. */
static int zdp_lookup_pin(struct zdp_slot *sl, uint64_t ino, uint64_t off, uint32_t size)
{
    struct zdp_entry *e;
    uint64_t bs = zdp_block_size, end, a0, a1, cur, sumpos = 0;
    uint32_t i, lo, hi, mid;
    int n = 0, k;
    struct zdp_span *spans = sl->spans;
    pthread_mutex_lock(&zdp_lock);
    e = zdp_find_locked(ino);
    if (e == NULL) {
        pthread_mutex_unlock(&zdp_lock);
        return -1 - (zdp_mutseq[ino % ZDP_MUTSEQ] ? ZR_MUTATED : ZR_NOT_PUBLISHED);
    }
    sl->tenant = e->tenant;
    if (off >= e->size || size == 0) {
        pthread_mutex_unlock(&zdp_lock);
        sl->reply_len = 0;
        sl->skip = 0;
        return 0;
    }
    end = off + size < e->size ? off + size : e->size;
    a0 = off / bs * bs;
    a1 = (end + bs - 1) / bs * bs;
    if (a1 - a0 > ZDP_BUFSZ) {
        pthread_mutex_unlock(&zdp_lock);
        return -1 - ZR_TOO_LARGE;
    }
    sl->skip = off - a0;
    sl->reply_len = end - off;
    /* first piece whose end is past a0 (pieces sorted, contiguous or not) */
    lo = 0;
    hi = e->npieces;
    while (lo < hi) {
        mid = (lo + hi) / 2;
        if (e->pieces[mid].file_off + e->pieces[mid].length <= a0)
            lo = mid + 1;
        else
            hi = mid;
    }
    cur = a0;
    for (i = lo; i < e->npieces && cur < a1; i++) {
        const struct zdp_piece *p = &e->pieces[i];
        uint64_t s, t;
        if (p->file_off > cur) {   /* a gap in the map: zeros */
            if (n == ZDP_MAX_SPANS)
                goto other;
            t = p->file_off < a1 ? p->file_off : a1;
            spans[n++] = (struct zdp_span){cur - a0, 0, t - cur, -1, 0, 1, NULL};
            cur = t;
            if (cur >= a1)
                break;
        }
        s = cur;
        t = p->file_off + p->length < a1 ? p->file_off + p->length : a1;
        if (p->flags & ZDP_PYTHON) {
            pthread_mutex_unlock(&zdp_lock);
            return -1 - ZR_NO_CSUMS;
        }
        if (n == ZDP_MAX_SPANS)
            goto other;
        if (p->flags & ZDP_HOLE) {
            spans[n++] = (struct zdp_span){s - a0, 0, t - s, -1, 0, 1, NULL};
        } else {
            uint64_t nb = (t - s) / bs, first = p->csum_idx + (s - p->file_off) / bs;
            memcpy(sl->sums + sumpos, e->csums + first * 4, nb * 4);
            spans[n++] = (struct zdp_span){s - a0, p->dev_off + (s - p->file_off), t - s,
                                           p->fd, p->zone, 0, sl->sums + sumpos};
            sumpos += nb * 4;
        }
        cur = t;
    }
    if (cur < a1) {   /* past the last piece, below the size: zeros */
        if (n == ZDP_MAX_SPANS)
            goto other;
        spans[n++] = (struct zdp_span){cur - a0, 0, a1 - cur, -1, 0, 1, NULL};
    }
    for (k = 0; k < n; k++)
        if (!spans[k].hole)
            BUMP(zdp_pins[spans[k].zone], 1);
    pthread_mutex_unlock(&zdp_lock);
    return n;
other:
    pthread_mutex_unlock(&zdp_lock);
    return -1 - ZR_TOO_LARGE;
}

static void zdp_unpin(struct zdp_slot *sl)
{
    int k;
    for (k = 0; k < sl->nspans; k++)
        if (!sl->spans[k].hole)
            __atomic_fetch_sub(&zdp_pins[sl->spans[k].zone], 1, __ATOMIC_RELEASE);
}

/* pread the rest of span k from `done` on (the pread mode, a short io_uring read). */
static int zdp_pread_span(struct zdp_slot *sl, int k, uint64_t done)
{
    struct zdp_span *s = &sl->spans[k];
    while (done < s->length) {
        ssize_t r = pread(s->fd, sl->buf + s->buf_off + done, s->length - done,
                          (off_t)(s->dev_off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0 || r % zdp_block_size != 0)
            return -1;
        done += (uint64_t)r;
    }
    return 0;
}

static void zdp_record_latency(uint64_t t0)
{
    uint64_t dt = zdp_now_ns() - t0;
    int b = dt ? 63 - __builtin_clzll(dt) : 0;
    BUMP(zdp_lat_sum_ns, dt);
    BUMP(zdp_lat[b < ZDP_LAT_BUCKETS ? b : ZDP_LAT_BUCKETS - 1], 1);
}

static void zdp_enqueue(void *mem, size_t size, uint64_t seq);
static void *zdp_buf_get(void);
/* The write streams (native/zonefs_cwrite.c, compiled after this file). */
static int zdw_request(const struct zdp_in_header *in, const uint8_t *body, size_t blen,
                       const uint8_t *payload,
                       uint64_t mut);
void zdw_close(void);
static void zdw_session_start(void);
static int zdw_nstreams;   /* streams armed (zonefs_cwrite.c; read here as a hint) */
static uint8_t *zdw_land_begin(size_t want);
static void zdw_land_end(void);
/* A WRITE read with its payload left in a stream's staging buffer (zdp_read_one):
 * the request's buffer and where the payload is (dispatcher only). */
static const void *zdp_landed_mem;
static const uint8_t *zdp_landed;

/* Answer a request with -err here, for a request that cannot be handed on (no
 * memory to queue it): every request gets an answer, an error rather than none.
 * FORGET and BATCH_FORGET (2, 42) get none by protocol. */
static void zdp_reply_err(const struct zdp_in_header *in, int err)
{
    struct zdp_out_header out = {(uint32_t)sizeof out, -err, in->unique};
    if (in->opcode == 2 || in->opcode == 42)
        return;
    (void)!write(zdp_fd, &out, sizeof out);
}

/* Hand a READ to Python (its request copied into a queue buffer), counted. */
static void zdp_hand_read(const struct zdp_in_header *in, const struct zdp_read_in *rd,
                          uint64_t seq, int reason)
{
    void *mem = zdp_buf_get();
    BUMP(zdp_handed_reads[reason], 1);
    if (mem == NULL) {
        fprintf(stderr, "zonefs-py dispatcher: out of memory, READ answered EIO\n");
        zdp_reply_err(in, EIO);
        return;
    }
    memcpy(mem, in, sizeof *in);
    memcpy((uint8_t *)mem + sizeof *in, rd, sizeof *rd);
    zdp_enqueue(mem, sizeof *in + sizeof *rd, seq);
}

/* All of a slot's device reads are done: verify, reply or hand on, unpin, free. */
static void zdp_finish(struct zdp_slot *sl)
{
    uint32_t bs = zdp_block_size;
    int k;
    if (!sl->fail)
        for (k = 0; k < sl->nspans && !sl->fail; k++) {
            struct zdp_span *s = &sl->spans[k];
            uint64_t b;
            if (s->hole)
                continue;
            for (b = 0; b < s->length / bs; b++) {
                uint32_t want, got = (uint32_t)XXH3_64bits(sl->buf + s->buf_off + b * bs, bs);
                memcpy(&want, s->sums + b * 4, 4);   /* little-endian, as x86-64 */
                if (got != want) {
                    sl->fail = 1 + ZR_CSUM_MISMATCH;
                    break;
                }
            }
        }
    zdp_unpin(sl);
    if (sl->fail) {
        zdp_hand_read(&sl->in, &sl->rd, sl->seq, sl->fail - 1);
    } else {
        struct zdp_out_header out = {(uint32_t)(sizeof out + sl->reply_len), 0, sl->in.unique};
        struct iovec iov[2] = {{&out, sizeof out}, {sl->buf + sl->skip, sl->reply_len}};
        /* ENOENT: the request was interrupted and is gone; ENODEV: unmounted. */
        (void)!writev(zdp_fd, iov, sl->reply_len ? 2 : 1);
        BUMP(zdp_served, 1);
        BUMP(zdp_served_bytes, sl->reply_len);
        BUMP(zdp_tenant_bytes[sl->tenant], sl->reply_len);
        zdp_record_latency(sl->t0);
    }
    sl->used = 0;
    zdp_nfree++;
}

static struct zdp_slot *zdp_slot_get(void)
{
    int i;
    for (i = 0; i < ZDP_SLOTS; i++)
        if (!zdp_slots[i].used) {
            struct zdp_slot *sl = &zdp_slots[i];
            if (sl->buf == NULL && (sl->buf = aligned_alloc(4096, ZDP_BUFSZ)) == NULL)
                return NULL;
            sl->used = 1;
            zdp_nfree--;
            return sl;
        }
    return NULL;
}

/* Submit every prepared SQE (one io_uring_submit for the batch). */
static void zdp_submit(void)
{
    while (zdp_sq_prepped > 0) {
        int r = io_uring_submit(&zdp_ring);
        if (r == -EINTR || r == -EAGAIN || r == -EBUSY) {
            if (r != -EINTR)
                sched_yield();
            continue;
        }
        if (r < 0) {   /* cannot happen with valid SQEs; say so, do not spin */
            fprintf(stderr, "zonefs-py dispatcher: io_uring_submit: %s\n", strerror(-r));
            break;
        }
        BUMP(zdp_submits, 1);
        BUMP(zdp_submitted, (uint64_t)r);
        zdp_sq_inflight += (uint32_t)r;
        zdp_sq_prepped -= (uint32_t)r < zdp_sq_prepped ? (uint32_t)r : zdp_sq_prepped;
    }
}

static int zdp_reap(void);

/* Take a READ: look it up and pin (under zdp_lock), then queue its device reads
 * (io_uring) or read them now (pread mode, or `alone`: the only request at hand
 * with no device read in flight, where a pread is the fewest syscalls).
 * 1 taken, 0 handed on (counted). */
static int zdp_take_read(const struct zdp_in_header *in, const struct zdp_read_in *rd,
                         uint64_t t0, uint64_t seq, int alone)
{
    struct zdp_slot *sl;
    int n, k, need = 0;
    if (rd->size > ZDP_MAX_READ) {
        BUMP(zdp_handed_reads[ZR_TOO_LARGE], 1);
        return 0;
    }
    sl = zdp_slot_get();
    if (sl == NULL) {   /* only without memory for a buffer: the caller had a free slot */
        BUMP(zdp_handed_reads[ZR_NO_MEMORY], 1);
        return 0;
    }
    n = zdp_lookup_pin(sl, in->nodeid, rd->offset, rd->size);
    if (n < 0) {
        sl->used = 0;
        zdp_nfree++;
        BUMP(zdp_handed_reads[-1 - n], 1);
        return 0;
    }
    sl->in = *in;
    sl->rd = *rd;
    sl->t0 = t0;
    sl->seq = seq;
    sl->nspans = n;
    sl->pending = 0;
    sl->fail = 0;
    for (k = 0; k < n; k++)
        if (sl->spans[k].hole)
            memset(sl->buf + sl->spans[k].buf_off, 0, sl->spans[k].length);
        else
            need++;
    if (alone && need > ZDP_LONE_PIECES)
        alone = 0;   /* many pieces: the ring reads them in parallel */
    if (!zdp_uring || need == 0 || alone) {
        if (alone && need > 0)
            BUMP(zdp_inline_reads, 1);
        for (k = 0; k < n && !sl->fail; k++)
            if (!sl->spans[k].hole && zdp_pread_span(sl, k, 0) < 0)
                sl->fail = 1 + ZR_DEVICE_ERROR;
        zdp_finish(sl);
        return 1;
    }
    /* Never more device reads in flight than CQ entries: no completion overflows
     * (an overflowed CQ makes submits fail with EBUSY until it is drained). */
    while (zdp_sq_inflight + zdp_sq_prepped + (uint32_t)need > zdp_ring.cq.ring_entries) {
        struct io_uring_cqe *cqe;
        zdp_submit();
        if (io_uring_wait_cqe(&zdp_ring, &cqe) == 0)
            zdp_reap();
    }
    sl->pending = need;   /* all up front: a reap below cannot finish the slot early */
    for (k = 0; k < n; k++) {
        struct zdp_span *s = &sl->spans[k];
        struct io_uring_sqe *sqe;
        if (s->hole)
            continue;
        while ((sqe = io_uring_get_sqe(&zdp_ring)) == NULL)
            zdp_submit();   /* SQ full: submit what is queued, then go on */
        io_uring_prep_read(sqe, s->fd, sl->buf + s->buf_off, (unsigned)s->length,
                           s->dev_off);
        io_uring_sqe_set_data64(sqe, ((uint64_t)(sl - zdp_slots) << 16) | (uint64_t)k);
        zdp_sq_prepped++;
    }
    return 1;
}

/* Reap every completion at hand: finish the slots whose reads are all done.
 * Returns the number of completions seen. */
static int zdp_reap(void)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;
    uint64_t v;
    if (!zdp_uring || zdp_sq_inflight == 0)
        return 0;
    if (zdp_ring_signalled) {   /* clear first: a later CQE signals again */
        (void)!read(zdp_ringfd, &v, sizeof v);
        zdp_ring_signalled = 0;
    }
    if (io_uring_cq_ready(&zdp_ring) == 0)
        return 0;
    io_uring_for_each_cqe(&zdp_ring, head, cqe) {
        uint64_t d = io_uring_cqe_get_data64(cqe);
        struct zdp_slot *sl;
        struct zdp_span *s;
        int k, res = cqe->res;
        seen++;
        if (d == ZDP_CANCEL_TAG)
            continue;
        sl = &zdp_slots[d >> 16];
        k = (int)(d & 0xffff);
        s = &sl->spans[k];
        if (res < 0 || res % (int)zdp_block_size != 0 || (res == 0 && s->length > 0))
            sl->fail = sl->fail ? sl->fail : 1 + ZR_DEVICE_ERROR;
        else if ((uint64_t)res < s->length && !sl->fail && zdp_pread_span(sl, k, (uint64_t)res) < 0)
            sl->fail = 1 + ZR_DEVICE_ERROR;   /* a short read: the rest by pread */
        if (--sl->pending == 0)
            zdp_finish(sl);
    }
    io_uring_cq_advance(&zdp_ring, seen);
    zdp_sq_inflight -= seen;
    return (int)seen;
}

/* Wait for every device read in flight and finish its READ (no buffer is freed
 * while the kernel may still write into it). `cancel`: ask the kernel to cancel
 * them first (shutdown; a cancelled read is a failed one, handed on). */
static void zdp_drain_inflight(int cancel)
{
    zdp_submit();
    if (cancel && zdp_uring && zdp_sq_inflight > 0) {
        struct io_uring_sqe *sqe;
        while ((sqe = io_uring_get_sqe(&zdp_ring)) == NULL)
            zdp_submit();
        io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
        io_uring_sqe_set_data64(sqe, ZDP_CANCEL_TAG);
        zdp_sq_prepped++;
        zdp_submit();
    }
    while (zdp_uring && zdp_sq_inflight > 0) {
        struct io_uring_cqe *cqe;
        int r = io_uring_wait_cqe(&zdp_ring, &cqe);
        if (r < 0 && r != -EINTR && r != -EAGAIN) {
            fprintf(stderr, "zonefs-py dispatcher: io_uring_wait_cqe: %s\n", strerror(-r));
            return;   /* the ring is not torn down below while reads may be in flight */
        }
        zdp_reap();
    }
}

/* Set up the ring (or say why not: the pread mode). */
static void zdp_uring_setup(void)
{
    int rc = io_uring_queue_init(ZDP_RING, &zdp_ring, 0);
    zdp_io_why[0] = '\0';
    if (rc < 0) {
        snprintf(zdp_io_why, sizeof zdp_io_why, "io_uring_queue_init: %s", strerror(-rc));
        return;
    }
    zdp_ringfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (zdp_ringfd < 0) {
        snprintf(zdp_io_why, sizeof zdp_io_why, "eventfd: %s", strerror(errno));
        io_uring_queue_exit(&zdp_ring);
        return;
    }
    rc = io_uring_register_eventfd(&zdp_ring, zdp_ringfd);
    if (rc < 0) {
        snprintf(zdp_io_why, sizeof zdp_io_why, "io_uring_register_eventfd: %s",
                 strerror(-rc));
        close(zdp_ringfd);
        zdp_ringfd = -1;
        io_uring_queue_exit(&zdp_ring);
        return;
    }
    zdp_uring = 1;
}

static void zdp_uring_teardown(void)
{
    if (zdp_uring && zdp_sq_inflight == 0) {
        io_uring_queue_exit(&zdp_ring);
        close(zdp_ringfd);
    }
    zdp_uring = 0;
    zdp_ringfd = -1;
}

/* The inode a request may change the bytes or size of, or 0. */
static uint64_t zdp_mutated_ino(const struct zdp_in_header *in, const uint8_t *body,
                                size_t blen)
{
    switch (in->opcode) {
    case ZOP_SETATTR: case ZOP_WRITE: case ZOP_SETXATTR: case ZOP_REMOVEXATTR:
    case ZOP_FALLOCATE:
        return in->nodeid;
    case ZOP_IOCTL:   /* answered ENOSYS (pyfuse3 has no ioctl): changes nothing. Python's
                       * open() asks TCGETS (isatty) of every file it opens buffered. */
        return 0;
    case ZOP_OPEN:
        if (blen >= sizeof(struct zdp_open_in)) {
            const struct zdp_open_in *o = (const void *)body;
            return (o->flags & O_TRUNC) ? in->nodeid : 0;
        }
        return in->nodeid;
    case ZOP_COPY_FILE_RANGE:
        if (blen >= sizeof(struct zdp_copy_in))
            return ((const struct zdp_copy_in *)(const void *)body)->nodeid_out;
        return 0;
    default:
        return in->opcode > ZOP_KNOWN_MAX ? in->nodeid : 0;
    }
}

/* ---- buffers and queue ---------------------------------------------------------- */
static void *zdp_buf_get(void)
{
    void *m = NULL;
    pthread_mutex_lock(&zdp_qlock);
    if (zdp_npool > 0)
        m = zdp_pool[--zdp_npool];
    pthread_mutex_unlock(&zdp_qlock);
    return m != NULL ? m : malloc(ZDP_BUFSZ);
}

/* Caller holds zdp_qlock. */
static void zdp_buf_put_locked(void *m)
{
    if (zdp_npool < ZDP_POOL_KEEP)
        zdp_pool[zdp_npool++] = m;
    else
        free(m);
}

static void zdp_signal_locked(void)
{
    uint64_t one = 1;
    (void)!write(zdp_qfd, &one, sizeof one);
}

static void zdp_enqueue(void *mem, size_t size, uint64_t seq)
{
    struct zdp_node *node = malloc(sizeof *node);
    if (node == NULL) {   /* no memory for a queue node: answered EIO, never lost */
        fprintf(stderr, "zonefs-py dispatcher: out of memory, request answered EIO\n");
        if (size >= sizeof(struct zdp_in_header))
            zdp_reply_err(mem, EIO);
        free(mem);
        return;
    }
    node->next = NULL;
    node->mem = mem;
    node->size = size;
    node->seq = seq;
    pthread_mutex_lock(&zdp_qlock);
    if (zdp_qtail != NULL)
        zdp_qtail->next = node;
    else {
        zdp_qhead = node;
        zdp_signal_locked();
    }
    zdp_qtail = node;
    pthread_mutex_unlock(&zdp_qlock);
}

static void zdp_end(int err)
{
    pthread_mutex_lock(&zdp_qlock);
    if (!zdp_ended) {
        zdp_ended = 1;
        zdp_end_err = err;
        if (zdp_qhead == NULL)
            zdp_signal_locked();
    }
    pthread_mutex_unlock(&zdp_qlock);
}

/* Read one request: 1 read (into *mem, size *n), 0 none now (EAGAIN), -1 the
 * session ended (zdp_end called).
 *
 * While C write streams are armed, the read lands in two pieces (readv): the
 * header and the WRITE arguments into *mem, the rest straight into the tail of
 * the last stream's staging buffer (zdw_land_begin), so that a WRITE C takes
 * for that file costs no copy on this thread. Any other request with a longer
 * body read that way is copied back behind its header at once; a WRITE is left
 * there for zdp_handle (zdp_landed), with the buffer pinned until then: staged
 * in place, or copied once into its own stream's buffer (another file's), or
 * copied back if it is handed on. */
static int zdp_read_one(void **mem, ssize_t *n)
{
    const size_t head = sizeof(struct zdp_in_header) + sizeof(struct zdp_write_in);
    for (;;) {
        uint8_t *land = NULL;
        if (*mem == NULL && (*mem = zdp_buf_get()) == NULL) {
            zdp_end(-ENOMEM);
            return -1;
        }
        if (__atomic_load_n(&zdw_nstreams, __ATOMIC_RELAXED) > 0)
            land = zdw_land_begin(ZDP_BUFSZ - head);
        if (land != NULL) {
            struct iovec iov[2] = {{*mem, head}, {land, ZDP_BUFSZ - head}};
            *n = readv(zdp_fd, iov, 2);
        } else {
            *n = read(zdp_fd, *mem, ZDP_BUFSZ);
        }
        if (*n >= 0) {
            if ((size_t)*n < sizeof(struct zdp_in_header)) {
                if (land != NULL)
                    zdw_land_end();
                zdp_end(-EIO);
                return -1;
            }
            if (land != NULL) {
                const struct zdp_in_header *in = *mem;
                if ((size_t)*n > head && in->opcode == ZOP_WRITE) {
                    zdp_landed_mem = *mem;
                    zdp_landed = land;
                } else {
                    if ((size_t)*n > head)
                        memcpy((uint8_t *)*mem + head, land, (size_t)*n - head);
                    zdw_land_end();
                }
            }
            return 1;
        }
        if (land != NULL)
            zdw_land_end();
        if (errno == EAGAIN)
            return 0;
        if (errno == EINTR || errno == ENOENT)   /* ENOENT: interrupted before we read it */
            continue;
        zdp_end(errno == ENODEV ? 0 : -errno);
        return -1;
    }
}

/* One request read from /dev/fuse: serve it (a READ taken: 0, `mem` may be
 * reused) or hand it on (1: `mem` now belongs to the queue). `alone`: see
 * zdp_take_read. */
static int zdp_handle(void *mem, ssize_t n, int alone)
{
    struct zdp_in_header *in = mem;
    uint64_t t0 = zdp_now_ns(), seq = ++zdp_seq, ino;
    const uint8_t *body = (uint8_t *)mem + sizeof *in;
    size_t blen = (size_t)n - sizeof *in;
    const uint8_t *payload = NULL;
    int staged;
    ino = zdp_mutated_ino(in, body, blen);
    if (zdp_landed_mem == mem) {   /* its payload is in a staging buffer (zdp_read_one) */
        payload = zdp_landed;
        zdp_landed_mem = NULL;
    }
    staged = zdw_request(in, body, blen, payload, ino);   /* a WRITE staged, a probe answered */
    if (payload != NULL) {
        if (!staged)   /* handed on: the payload goes back behind its arguments */
            memcpy((uint8_t *)mem + sizeof *in + sizeof(struct zdp_write_in), payload,
                   (size_t)n - sizeof *in - sizeof(struct zdp_write_in));
        zdw_land_end();
    }
    if (staged)
        return 0;
    if (in->opcode == ZOP_READ && blen >= sizeof(struct zdp_read_in)
            && zdp_take_read(in, (const void *)body, t0, seq, alone))
        return 0;
    if (ino != 0) {
        pthread_mutex_lock(&zdp_lock);
        zdp_remove_locked(ino);
        zdp_mutseq[ino % ZDP_MUTSEQ] = seq;
        pthread_mutex_unlock(&zdp_lock);
    }
    zdp_enqueue(mem, (size_t)n, seq);
    return 1;
}

/* The dispatcher: each turn reaps finished device reads, reads every request at
 * hand (up to ZDP_BATCH, while a slot is free), takes the READs it can serve and
 * hands every other request on in arrival order at once (not behind device
 * reads), submits the turn's device reads in one io_uring_submit (and after
 * every large request: a READ read before a 1 MiB WRITE does not wait for the
 * rest of the batch's copies to go to the device or to be answered), and sleeps in
 * poll on /dev/fuse (while a slot is free), the ring's eventfd and the stop fd
 * once /dev/fuse had nothing more (EAGAIN) or there was nothing to do.
 *
 * The lone READ (queue depth 1): a READ read first in a turn with no device read
 * in flight is held while the next read of /dev/fuse looks for company; alone
 * (EAGAIN), it is read by pread and answered at once: poll, read, read, pread,
 * writev, where the ring costs an io_uring_enter, a second poll and an eventfd
 * read more. A request that arrives meanwhile waits for that one device read. */
static void *zdp_main(void *arg)
{
    void *mem = NULL;
    int ended = 0;
    (void)arg;
    int stopped = 0;
    while (!ended) {
        int got = 0, r = 0, reaped = zdp_reap();
        struct pollfd p[3];
        int np = 0;
        while (got < ZDP_BATCH && zdp_nfree > 0) {
            ssize_t n;
            r = zdp_read_one(&mem, &n);
            if (r <= 0)
                break;
            got++;
            if (got == 1 && zdp_uring && zdp_lone_on && zdp_sq_inflight + zdp_sq_prepped == 0
                    && ((struct zdp_in_header *)mem)->opcode == ZOP_READ) {
                ssize_t hn = n;
                void *held = mem;
                mem = NULL;
                r = zdp_read_one(&mem, &n);
                if (!zdp_handle(held, hn, r == 0)) {   /* served: the buffer goes back */
                    pthread_mutex_lock(&zdp_qlock);
                    zdp_buf_put_locked(held);
                    pthread_mutex_unlock(&zdp_qlock);
                }
                if (r <= 0)
                    break;
                got++;
            }
            if (zdp_handle(mem, n, 0))
                mem = NULL;   /* else mem is reused: the slot copied what it needs */
            if (zdp_uring && (size_t)n > ZDP_BIG_REQUEST
                    && zdp_sq_inflight + zdp_sq_prepped > 0) {
                /* A large request (a WRITE: copied here, or staged in C) took time:
                 * the READs read before it go to the device now, and those whose
                 * device reads finished are answered, not after the whole batch. */
                zdp_submit();
                zdp_reap();
            }
        }
        if (zdp_uring)
            zdp_submit();
        if (r < 0) {
            ended = 1;
            break;
        }
        /* More at hand (the batch or the slots ran out), or slots freed: go on.
         * /dev/fuse said EAGAIN: sleep, the ring's eventfd wakes for completions. */
        if (r > 0 || (got == 0 && reaped > 0))
            continue;
        if (zdp_nfree > 0)
            p[np++] = (struct pollfd){zdp_fd, POLLIN, 0};
        if (zdp_uring && zdp_sq_inflight > 0)
            p[np++] = (struct pollfd){zdp_ringfd, POLLIN, 0};
        p[np++] = (struct pollfd){zdp_stopfd, POLLIN, 0};
        if (poll(p, (nfds_t)np, -1) < 0 && errno != EINTR) {
            zdp_end(-errno);
            break;
        }
        if (zdp_uring && zdp_sq_inflight > 0 && p[np - 2].revents)
            zdp_ring_signalled = 1;
        if (p[np - 1].revents) {
            stopped = 1;
            break;
        }
    }
    zdp_drain_inflight(stopped);
    free(mem);
    return NULL;
}

/* Start the dispatcher on the session's fd: 0, or -errno with zdp_why set. */
static int zdp_start(int real_fd)
{
    int fl, err, i;
    if (zdp_pins == NULL) {
        snprintf(zdp_why, sizeof zdp_why, "zdp_configure was not called");
        return -EINVAL;
    }
    zdp_slots = calloc(ZDP_SLOTS, sizeof *zdp_slots);
    if (zdp_slots == NULL) {
        snprintf(zdp_why, sizeof zdp_why, "no memory for the read slots");
        return -ENOMEM;
    }
    zdp_nfree = ZDP_SLOTS;
    zdw_session_start();
    for (i = 0; i < 1; i++)   /* one buffer up front: a READ never waits for memory */
        if ((zdp_slots[i].buf = aligned_alloc(4096, ZDP_BUFSZ)) == NULL) {
            free(zdp_slots);
            zdp_slots = NULL;
            snprintf(zdp_why, sizeof zdp_why, "no memory for the read buffer");
            return -ENOMEM;
        }
    zdp_fd = fcntl(real_fd, F_DUPFD_CLOEXEC, 3);
    zdp_qfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    zdp_stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (zdp_fd < 0 || zdp_qfd < 0 || zdp_stopfd < 0) {
        err = -errno;
        snprintf(zdp_why, sizeof zdp_why, "dup/eventfd failed: %s", strerror(-err));
        goto fail;
    }
    fl = fcntl(zdp_fd, F_GETFL);
    if (fl < 0 || fcntl(zdp_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
        err = -errno;
        snprintf(zdp_why, sizeof zdp_why, "O_NONBLOCK on /dev/fuse: %s", strerror(-err));
        goto fail;
    }
    if (!zdp_no_uring)
        zdp_uring_setup();
    else
        snprintf(zdp_io_why, sizeof zdp_io_why, "switched off (zdp_set_no_uring)");
    if (!zdp_uring)   /* said once, here; Python logs zdp_io_mode() too */
        fprintf(stderr, "zonefs-py dispatcher: device reads by pread, not io_uring (%s)\n",
                zdp_io_why);
    err = -pthread_create(&zdp_thread, NULL, zdp_main, NULL);
    if (err != 0) {
        fcntl(zdp_fd, F_SETFL, fl);
        zdp_uring_teardown();
        snprintf(zdp_why, sizeof zdp_why, "pthread_create: %s", strerror(-err));
        goto fail;
    }
    pthread_setname_np(zdp_thread, "zonefs-dispatch");
    zdp_running = 1;
    return 0;
fail:
    if (zdp_fd >= 0)
        close(zdp_fd);
    if (zdp_qfd >= 0)
        close(zdp_qfd);
    if (zdp_stopfd >= 0)
        close(zdp_stopfd);
    zdp_fd = zdp_qfd = zdp_stopfd = -1;
    for (i = 0; i < ZDP_SLOTS; i++)
        free(zdp_slots[i].buf);
    free(zdp_slots);
    zdp_slots = NULL;
    return err;
}

/* ---- libfuse stand-ins ---------------------------------------------------------- */
int fuse_session_fd(struct fuse_session *se)
{
    zdp_fd_fn real = (zdp_fd_fn)zdp_real("fuse_session_fd");
    int fd;
    if (real == NULL || real == fuse_session_fd)
        return -1;
    fd = real(se);
    if (zdp_running)
        return zdp_qfd;
    if (!zdp_armed_flag || fd < 0)
        return fd;
    zdp_armed_flag = 0;   /* one attempt per arm */
    return zdp_start(fd) == 0 ? zdp_qfd : fd;
}

/* Take the queue's next request: its node (the caller frees it after taking
 * node->mem) with zdp_handed advanced, or NULL when the queue is empty. *ended:
 * the session ended (*err its -errno, 0: unmounted). `old`: the caller's buffer,
 * back to the pool when a request is taken (kept by the caller otherwise). */
static struct zdp_node *zdp_take(void *old, int *ended, int *err)
{
    struct zdp_node *node;
    pthread_mutex_lock(&zdp_qlock);
    node = zdp_qhead;
    *ended = zdp_ended;
    *err = zdp_end_err;
    if (node == NULL) {
        if (!zdp_ended) {
            uint64_t v;
            (void)!read(zdp_qfd, &v, sizeof v);   /* empty: not readable until a push */
        }
        pthread_mutex_unlock(&zdp_qlock);
        return NULL;
    }
    zdp_qhead = node->next;
    if (zdp_qhead == NULL) {
        zdp_qtail = NULL;
        if (!zdp_ended) {
            uint64_t v;
            (void)!read(zdp_qfd, &v, sizeof v);
        }
    }
    if (old != NULL)
        zdp_buf_put_locked(old);
    pthread_mutex_unlock(&zdp_qlock);
    pthread_mutex_lock(&zdp_lock);
    /* max: a READ handed on after its device read failed keeps its (earlier) seq;
     * every mutating request before any later seq was queued before it. */
    if (node->seq > zdp_handed)
        zdp_handed = node->seq;
    pthread_mutex_unlock(&zdp_lock);
    return node;
}

int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf)
{
    struct zdp_node *node;
    int ended, err;
    if (!zdp_running) {
        zdp_recv_fn real = (zdp_recv_fn)zdp_real("fuse_session_receive_buf");
        if (real == NULL || real == fuse_session_receive_buf)
            return -ENOSYS;
        return real(se, buf);
    }
    node = zdp_take(buf->mem != NULL && !(buf->flags & FUSE_BUF_IS_FD) ? buf->mem : NULL,
                    &ended, &err);
    if (node == NULL) {
        if (!ended)
            return -EINTR;
        if (err == 0)
            fuse_session_exit(se);   /* as libfuse does on ENODEV */
        return err;
    }
    buf->mem = node->mem;
    buf->size = node->size;
    buf->flags = 0;
    buf->pos = 0;
    free(node);
    return (int)buf->size;
}

/* ---- tests: the dispatcher on any fd, without FUSE (tests/unit/test_dataplane.py) -- */
/* Start the dispatcher reading requests from `fd` (a SOCK_SEQPACKET socket: one
 * request per read, replies written back to it). 0 or -errno (zdp_why_not). */
int zdp_test_start(int fd)
{
    if (zdp_running)
        return -EBUSY;
    if (zdp_qfd >= 0)
        close(zdp_qfd);   /* a test's earlier session: no pyfuse3 holds it */
    zdp_qfd = -1;
    pthread_mutex_lock(&zdp_qlock);
    zdp_ended = 0;
    zdp_end_err = 0;
    pthread_mutex_unlock(&zdp_qlock);
    return zdp_start(fd);
}

/* The eventfd readable while a handed-on request is queued (or the session ended). */
int zdp_test_qfd(void)
{
    return zdp_qfd;
}

/* Take the next handed-on request into out: its size, 0 when none is queued,
 * -1 once the session ended and the queue is empty. */
int64_t zdp_test_take(uint8_t *out, uint64_t max, uint64_t *seq)
{
    int ended, err;
    int64_t n;
    struct zdp_node *node = zdp_take(NULL, &ended, &err);
    if (node == NULL)
        return ended ? -1 : 0;
    n = (int64_t)(node->size < max ? node->size : max);
    memcpy(out, node->mem, (size_t)n);
    *seq = node->seq;
    pthread_mutex_lock(&zdp_qlock);
    zdp_buf_put_locked(node->mem);
    pthread_mutex_unlock(&zdp_qlock);
    free(node);
    return n;
}

/* Answer a request nobody will process (session over) with ENOTCONN; not the
 * ones the kernel expects no answer to. */
static void zdp_answer_gone(const void *mem, size_t size)
{
    const struct zdp_in_header *in = mem;
    struct zdp_out_header out;
    if (size < sizeof *in || in->unique == 0 || in->opcode == ZOP_FORGET
            || in->opcode == ZOP_BATCH_FORGET || in->opcode == ZOP_INTERRUPT)
        return;
    out.len = sizeof out;
    out.error = -ENOTCONN;
    out.unique = in->unique;
    (void)!write(zdp_fd, &out, sizeof out);
}

/* Stop the dispatcher (idempotent): the thread is joined, what it queued and
 * pyfuse3 did not take is answered, its fds closed. */
void zdp_shutdown(void)
{
    struct zdp_node *node;
    if (!zdp_running)
        return;
    {
        uint64_t one = 1;
        (void)!write(zdp_stopfd, &one, sizeof one);
    }
    pthread_join(zdp_thread, NULL);
    zdp_running = 0;
    zdw_close();   /* no WRITE staged after this; Python takes what was */
    close(zdp_stopfd);
    zdp_stopfd = -1;
    /* zdp_qfd stays open: pyfuse3 may still hold it registered with trio.
     * Every request read and not taken by pyfuse3 (its loop has ended) is
     * answered ENOTCONN: a caller waits for an answer once its request was read,
     * uninterruptibly, and when that caller is a thread of this process (a
     * statvfs of the mount point) the connection is never aborted (its fd table
     * lives on) and the process never exits. */
    pthread_mutex_lock(&zdp_qlock);
    while ((node = zdp_qhead) != NULL) {
        zdp_qhead = node->next;
        zdp_answer_gone(node->mem, node->size);
        free(node->mem);
        free(node);
    }
    zdp_qtail = NULL;
    while (zdp_npool > 0)
        free(zdp_pool[--zdp_npool]);
    pthread_mutex_unlock(&zdp_qlock);
    close(zdp_fd);
    zdp_fd = -1;
    zdp_uring_teardown();
    if (zdp_slots != NULL) {
        int i;
        for (i = 0; i < ZDP_SLOTS; i++)
            free(zdp_slots[i].buf);
        free(zdp_slots);
        zdp_slots = NULL;
    }
    zdp_revoke_all();
}

void fuse_session_destroy(struct fuse_session *se)
{
    zdp_destroy_fn real = (zdp_destroy_fn)zdp_real("fuse_session_destroy");
    zdp_shutdown();
    if (real != NULL && real != fuse_session_destroy)
        real(se);
}

/* ---- control and counters (Python) ------------------------------------------------ */
void zdp_arm(int on)
{
    zdp_armed_flag = on;
    if (on)
        zdp_why[0] = '\0';
}

/* Before arming: 1 makes the next dispatcher read the device by pread (tests). */
void zdp_set_no_uring(int on)
{
    zdp_no_uring = on;
}

/* Tests: 0 turns the lone READ's pread off (a pipe as the device would hold the
 * dispatcher); the dispatcher looks at it per turn. */
void zdp_set_lone(int on)
{
    zdp_lone_on = on;
}

/* "io_uring", or "pread: why" (after the dispatcher started). */
const char *zdp_io_mode(void)
{
    static char mode[200];
    if (zdp_uring)
        return "io_uring";
    snprintf(mode, sizeof mode, "pread: %s", zdp_io_why[0] ? zdp_io_why : "not started");
    return mode;
}

int zdp_running_flag(void)
{
    return zdp_running;
}

const char *zdp_why_not(void)
{
    return zdp_why;
}

/* Seq of the last request handed to pyfuse3 and of the last one read. */
uint64_t zdp_handed_seq(void)
{
    return zdp_handed;
}

/* Bytes served from maps of `tenant` since the module was loaded (0 out of range). */
uint64_t zdp_tenant_served(uint32_t tenant)
{
    return tenant < ZDP_TENANTS ? LOAD(zdp_tenant_bytes[tenant]) : 0;
}

/* out[0] served, out[1] served bytes, out[2] latency sum (ns), out[3] requests
 * read, out[4..4+ZR_NREASONS) handed READs by reason, then ZDP_LAT_BUCKETS
 * latency buckets (bucket b: [2^b, 2^(b+1)) ns), then io_uring_submit calls and
 * device reads submitted through them. Returns the count written. */
int zdp_stats(uint64_t *out, int max)
{
    int i, n = 0;
#define PUT(v) do { if (n < max) out[n] = (v); n++; } while (0)
    PUT(LOAD(zdp_served));
    PUT(LOAD(zdp_served_bytes));
    PUT(LOAD(zdp_lat_sum_ns));
    PUT(LOAD(zdp_seq));
    for (i = 0; i < ZR_NREASONS; i++)
        PUT(LOAD(zdp_handed_reads[i]));
    for (i = 0; i < ZDP_LAT_BUCKETS; i++)
        PUT(LOAD(zdp_lat[i]));
    PUT(LOAD(zdp_submits));
    PUT(LOAD(zdp_submitted));
    PUT(LOAD(zdp_inline_reads));
#undef PUT
    return n < max ? n : max;
}
