/*
 * The data plane's write streams (issue 44, first step; DESIGN 4.11).
 *
 * A file being written sequentially in whole blocks (a checkpoint, a dataset
 * shard, fio) gets a *stream*, armed by Python after a WRITE it served
 * (zdw_arm: the offset the next WRITE must start at, and a credit of bytes
 * that passed Python's space, quota and tenant admission). While a stream is
 * armed the dispatcher takes that file's WRITEs itself: the payload is read
 * into the stream's staging buffer (4 MiB of record, 4096-aligned; straight
 * from /dev/fuse when it lands there, zdw_land_begin, else copied) and the
 * WRITE answered at once, as Python answers a buffered WRITE (DESIGN 3.6:
 * a WRITE is not durable until fsync). Full buffers, and the partial one when
 * Python must see the file's bytes, become *records* on one FIFO list that
 * Python takes (zdw_take) and hands to the engine's write pipeline, which
 * places, checksums and appends them as chunks like any other. The eventfd
 * zdw_efd is readable while the list is not empty.
 *
 * What C promises Python (every step under zdw_lock, in the dispatcher's
 * request order):
 *   - a WRITE is taken only at the stream's next offset, whole blocks, without
 *     flags other than FUSE_WRITE_CACHE/LOCKOWNER, within the credit and the
 *     staging bound; a WRITE of the file that is not is handed to Python after
 *     the stream ends (its staged bytes and an end record queued first);
 *   - any other request naming the file queues the staged bytes first: READ,
 *     GETATTR, GETXATTR, LISTXATTR, ACCESS, FLUSH, LSEEK, POLL, SETATTR without
 *     a size (the kernel's time updates) and OPEN without O_TRUNC keep the
 *     stream, every other request ends it, as does COPY_FILE_RANGE into it;
 *     SYNCFS and DESTROY queue every stream's bytes;
 *   - Python takes the records at the start of every request handler, so a
 *     request handed to Python sees every byte of every WRITE answered before
 *     the kernel sent it, in order.
 * What Python promises C: before it changes the file's bytes or size itself (a
 * WRITE, truncate, fallocate, a copy into it) it ends the stream (zdw_end) and
 * takes what was staged, so every byte C answered lands before the change;
 * it arms a stream past the end of every write of the file it is serving,
 * so C's bytes never overlap one of those (fs/cstreams.py). An arm is refused
 * while a request that may change the file is queued for pyfuse3 and not
 * handed yet (zdp_mutseq, as a read map's publish).
 *
 * zdw_close (the end of the serve, before Python's last take) ends every stream;
 * no WRITE is taken in C after it. Conventions as zonefs_dispatch.c.
 */

#define ZDW_CHUNK (4u << 20)             /* staging buffer: one record */
/* A staging buffer's size: a record and room past it, so that a request can be
 * read straight into the buffer's tail (zdw_land_begin) while up to a request's
 * size of the record is still free (1 MiB WRITEs at 3 MiB staged). */
#define ZDW_BUFSZ (ZDW_CHUNK + (16u << 10))
#define ZDW_STREAMS 64                   /* streams armed at once */
#define ZDW_MAX_STAGED (128ull << 20)    /* bytes staged and not taken, all streams */
#define ZDW_FATTR_SIZE (1u << 3)         /* fuse_setattr_in.valid: FATTR_SIZE */

enum {   /* why a stream ended (zdw_stats order; names in dataplane/cwrites.py) */
    ZW_NOT_SEQUENTIAL, ZW_UNALIGNED, ZW_FLAGS, ZW_NO_CREDIT, ZW_STAGED_FULL,
    ZW_NO_MEMORY, ZW_OTHER_REQUEST, ZW_CLOSED, ZW_PYTHON_CHANGE, ZW_NREASONS
};

struct zdw_rec {          /* what Python takes (struct zdw_out) */
    struct zdw_rec *next;
    uint64_t ino, file_off, len, credit_left;
    uint8_t *mem;         /* ZDW_CHUNK bytes, aligned; Python frees it (zdw_free) */
    uint32_t kind;        /* 0 data, 1 the stream ended */
};

struct zdw_out {
    uint64_t ino, file_off, len, credit_left;
    uint8_t *mem;
    uint32_t kind, reason;
};

struct zdw_stream {
    uint64_t ino, next_off, credit;
    uint8_t *buf;          /* NULL until a WRITE is staged or lands (ZDW_BUFSZ) */
    uint64_t buf_off;      /* file offset of buf[0] */
    uint32_t buf_len;
    int used;
    struct zdw_rec *endrec;   /* allocated at arm: ending never fails */
};

static pthread_mutex_t zdw_lock = PTHREAD_MUTEX_INITIALIZER;
static struct zdw_stream zdw_streams[ZDW_STREAMS];   /* zdw_lock */
static int zdw_nstreams;                             /* zdw_lock; read unlocked as a hint */
static struct zdw_rec *zdw_head, *zdw_tail;          /* zdw_lock */
static uint64_t zdw_staged;                          /* zdw_lock */
static int zdw_efd = -1;
static int zdw_on;                                   /* zdw_lock */
static int zdw_caps_off;    /* dispatcher only: a security.capability was set */
static uint64_t zdw_last_ino;   /* zdw_lock: the file of the last WRITE taken */

/* Staging buffers given back by Python (zdw_free), kept for the next record: a
 * buffer freshly allocated each time was memory the kernel faulted in and zeroed
 * again, on the thread that serves READs (perf: 11% of its time in a write burst;
 * glibc trims the dispatcher's arena when Python frees from the trio thread). A
 * lock of its own: zdw_free runs on whichever thread drops the last view. */
#define ZDW_POOL 8
static pthread_mutex_t zdw_pool_lock = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *zdw_pool[ZDW_POOL];                  /* zdw_pool_lock */
static int zdw_npool;                                /* zdw_pool_lock */
/* The buffer a read of /dev/fuse may be writing into (zdw_land_begin to
 * zdw_land_end): pinned, neither freed nor pooled until then. A stream ended
 * meanwhile hands it to Python (whose zdw_free waits for the pin) or, still
 * empty, leaves it to zdw_land_end (orphan). */
static uint8_t *zdw_landing;                         /* zdw_pool_lock */
static int zdw_landing_orphan;                       /* zdw_pool_lock */
static pthread_cond_t zdw_landing_cv = PTHREAD_COND_INITIALIZER;

static uint8_t *zdw_buf_get(void)
{
    uint8_t *b = NULL;
    pthread_mutex_lock(&zdw_pool_lock);
    if (zdw_npool > 0)
        b = zdw_pool[--zdw_npool];
    pthread_mutex_unlock(&zdw_pool_lock);
    return b != NULL ? b : aligned_alloc(4096, ZDW_BUFSZ);
}

/* Caller holds zdw_pool_lock: keep `b` for the next record, or free it. */
static void zdw_buf_put_locked(uint8_t *b)
{
    if (zdw_npool < ZDW_POOL)
        zdw_pool[zdw_npool++] = b;
    else
        free(b);
}

/* An empty staging buffer of an ending stream (never waits: zdw_lock may be held). */
static void zdw_buf_drop(uint8_t *b)
{
    pthread_mutex_lock(&zdw_pool_lock);
    if (b == zdw_landing)
        zdw_landing_orphan = 1;
    else
        zdw_buf_put_locked(b);
    pthread_mutex_unlock(&zdw_pool_lock);
}

static uint64_t zdw_served, zdw_served_bytes, zdw_records, zdw_partials, zdw_arms;
static uint64_t zdw_ended[ZW_NREASONS];
static uint64_t zdw_caps_probes;
static uint64_t zdw_in_place;   /* WRITEs whose payload was read into its staging buffer */

static void zdw_append_locked(struct zdw_rec *r)
{
    r->next = NULL;
    if (zdw_tail != NULL)
        zdw_tail->next = r;
    else {
        uint64_t one = 1;
        zdw_head = r;
        (void)!write(zdw_efd, &one, sizeof one);
    }
    zdw_tail = r;
}

/* Queue the stream's staged bytes (whole blocks) as a record. 0, or -ENOMEM. */
static int zdw_push_locked(struct zdw_stream *st)
{
    struct zdw_rec *r;
    if (st->buf == NULL || st->buf_len == 0)
        return 0;
    r = malloc(sizeof *r);
    if (r == NULL)
        return -ENOMEM;
    *r = (struct zdw_rec){NULL, st->ino, st->buf_off, st->buf_len, 0, st->buf, 0};
    zdw_append_locked(r);
    st->buf = NULL;
    st->buf_len = 0;
    BUMP(zdw_records, 1);
    return 0;
}

/* End the stream: its staged bytes, then the end record (the unused credit). If
 * the staged bytes cannot be queued (no memory for a record) they go with the
 * end record, which was allocated at arm. */
static void zdw_end_locked(struct zdw_stream *st, int reason)
{
    struct zdw_rec *r = st->endrec;
    if (st->buf != NULL && st->buf_len == 0) {   /* given for a read to land in */
        zdw_buf_drop(st->buf);
        st->buf = NULL;
    }
    if (zdw_push_locked(st) < 0) {
        *r = (struct zdw_rec){NULL, st->ino, st->buf_off, st->buf_len, st->credit, st->buf, 1};
    } else {
        *r = (struct zdw_rec){NULL, st->ino, 0, 0, st->credit, NULL, 1};
    }
    r->kind = 1u | ((uint32_t)reason << 8);
    zdw_append_locked(r);
    BUMP(zdw_ended[reason], 1);
    *st = (struct zdw_stream){0};
    __atomic_store_n(&zdw_nstreams, zdw_nstreams - 1, __ATOMIC_RELAXED);
}

static struct zdw_stream *zdw_find_locked(uint64_t ino)
{
    int i;
    if (ino == 0)
        return NULL;
    for (i = 0; i < ZDW_STREAMS; i++)
        if (zdw_streams[i].used && zdw_streams[i].ino == ino)
            return &zdw_streams[i];
    return NULL;
}

/* Copy a WRITE's payload into the stream: 0, or -ENOMEM (nothing staged then
 * beyond what fitted: the stream ends and the WRITE goes to Python, which
 * writes all of it again after the staged part, in order). */
static int zdw_stage_locked(struct zdw_stream *st, uint64_t off, const uint8_t *data,
                            uint32_t size)
{
    while (size > 0) {
        uint32_t n;
        if (st->buf == NULL) {
            st->buf = zdw_buf_get();
            if (st->buf == NULL)
                return -ENOMEM;
            st->buf_off = off;
            st->buf_len = 0;
        }
        n = ZDW_CHUNK - st->buf_len < size ? ZDW_CHUNK - st->buf_len : size;
        if (data != st->buf + st->buf_len)   /* else it was read there (zdw_land_begin) */
            memcpy(st->buf + st->buf_len, data, n);
        else
            BUMP(zdw_in_place, 1);
        st->buf_len += n;
        st->next_off += n;
        st->credit -= n;
        zdw_staged += n;
        off += n;
        data += n;
        size -= n;
        if (st->buf_len == ZDW_CHUNK && zdw_push_locked(st) < 0)
            return -ENOMEM;
    }
    return 0;
}

/* The kernel's security.capability probe (before every write(2)), answered here
 * while no file has the attribute (zfx_no_caps, as zc_getxattr does on the trio
 * thread): 1 answered. Once a SETXATTR of that name passes, never again. */
static int zdw_caps_probe(const struct zdp_in_header *in, const uint8_t *body, size_t blen)
{
    static const char name[] = "security.capability";
    if (in->opcode == ZOP_SETXATTR) {
        /* fuse_setxattr_in is 8 or 16 bytes (FUSE_SETXATTR_EXT): look at both */
        if ((blen >= 8 + sizeof name && memcmp(body + 8, name, sizeof name) == 0)
                || (blen >= 16 + sizeof name && memcmp(body + 16, name, sizeof name) == 0))
            zdw_caps_off = 1;
        return 0;
    }
    if (in->opcode != 22 || zdw_caps_off || !__atomic_load_n(&zfx_no_caps, __ATOMIC_RELAXED)
            || blen < 8 + sizeof name || memcmp(body + 8, name, sizeof name) != 0)
        return 0;
    {
        struct zdp_out_header out = {(uint32_t)sizeof out, -ENODATA, in->unique};
        if (zfx_census_armed)
            ZFX_ADD(zfx_recv[22], 1);
        (void)!write(zdp_fd, &out, sizeof out);
        if (zfx_census_armed)
            ZFX_ADD(zfx_done[22], 1);
        BUMP(zdw_caps_probes, 1);
    }
    return 1;
}

/* Every request the dispatcher reads passes here first (zdp_handle): 1 when it
 * was answered here (a WRITE staged, a capability probe), else 0 after the
 * stream rules of the header comment. `mut`: the inode the request may change
 * (zdp_mutated_ino). */
static int zdw_request(const struct zdp_in_header *in, const uint8_t *body, size_t blen,
                       const uint8_t *payload, uint64_t mut)
{
    struct zdw_stream *st;
    int reason = -1;
    uint32_t op = in->opcode;
    if (zdw_caps_probe(in, body, blen))
        return 1;
    if (__atomic_load_n(&zdw_nstreams, __ATOMIC_RELAXED) == 0)
        return 0;
    pthread_mutex_lock(&zdw_lock);
    if (op == 50 || op == 38) {   /* SYNCFS, DESTROY: every stream's bytes */
        int i;
        for (i = 0; i < ZDW_STREAMS; i++)
            if (zdw_streams[i].used && zdw_push_locked(&zdw_streams[i]) < 0)
                zdw_end_locked(&zdw_streams[i], ZW_NO_MEMORY);
        pthread_mutex_unlock(&zdw_lock);
        return 0;
    }
    if (mut != 0 && mut != in->nodeid && (st = zdw_find_locked(mut)) != NULL)
        zdw_end_locked(st, ZW_OTHER_REQUEST);   /* a copy into it */
    st = op == ZOP_FORGET || op == ZOP_BATCH_FORGET ? NULL : zdw_find_locked(in->nodeid);
    if (st == NULL) {
        pthread_mutex_unlock(&zdw_lock);
        return 0;
    }
    if (op == ZOP_WRITE) {
        const struct zdp_write_in *w = (const void *)body;
        if (blen < sizeof *w || blen - sizeof *w < w->size)
            reason = ZW_FLAGS;
        else if (w->offset != st->next_off)
            reason = ZW_NOT_SEQUENTIAL;
        else if (w->size == 0 || w->size % zdp_block_size != 0)
            reason = ZW_UNALIGNED;
        else if ((w->write_flags & ~3u) != 0)
            reason = ZW_FLAGS;   /* FUSE_WRITE_KILL_SUIDGID: Python drops the bits */
        else if (w->size > st->credit)
            reason = ZW_NO_CREDIT;
        else if (zdw_staged + w->size > ZDW_MAX_STAGED)
            reason = ZW_STAGED_FULL;
        else if (zdw_stage_locked(st, w->offset, payload ? payload : body + sizeof *w,
                                  w->size) < 0)
            reason = ZW_NO_MEMORY;
        if (reason >= 0) {
            zdw_end_locked(st, reason);
            pthread_mutex_unlock(&zdw_lock);
            return 0;
        }
        zdw_last_ino = st->ino;
        pthread_mutex_unlock(&zdw_lock);
        /* The read map is gone since the stream's first WRITE (Python publishes
         * none while a stream is armed); say so again for the one in between. */
        pthread_mutex_lock(&zdp_lock);
        zdp_remove_locked(in->nodeid);
        pthread_mutex_unlock(&zdp_lock);
        {
            struct { struct zdp_out_header h; uint32_t size, padding; } out = {
                {(uint32_t)sizeof out, 0, in->unique}, w->size, 0};
            (void)!write(zdp_fd, &out, sizeof out);
        }
        BUMP(zdw_served, 1);
        BUMP(zdw_served_bytes, w->size);
        return 1;
    }
    switch (op) {
    case ZOP_READ: case 3: case 22: case 23: case 34: case 25: case 46: case 40:
        if (zdw_push_locked(st) < 0)
            zdw_end_locked(st, ZW_NO_MEMORY);
        else
            BUMP(zdw_partials, 1);
        break;
    case ZOP_SETATTR:   /* times, mode, owner: the bytes stay; a new size ends it */
        if (blen >= 4 && !(*(const uint32_t *)(const void *)body & ZDW_FATTR_SIZE)) {
            if (zdw_push_locked(st) < 0)
                zdw_end_locked(st, ZW_NO_MEMORY);
            break;
        }
        zdw_end_locked(st, ZW_OTHER_REQUEST);
        break;
    case ZOP_OPEN:
        if (blen >= sizeof(struct zdp_open_in)
                && !(((const struct zdp_open_in *)(const void *)body)->flags & O_TRUNC)) {
            if (zdw_push_locked(st) < 0)
                zdw_end_locked(st, ZW_NO_MEMORY);
            break;
        }
        zdw_end_locked(st, ZW_OTHER_REQUEST);
        break;
    default:
        zdw_end_locked(st, ZW_OTHER_REQUEST);
    }
    pthread_mutex_unlock(&zdw_lock);
    return 0;
}

/* A new session (zdp_start): the probe is answered here again until a SETXATTR. */
static void zdw_session_start(void)
{
    zdw_caps_off = 0;
}

/* Where the next read of /dev/fuse may put what follows a WRITE's arguments: the
 * tail of the staging buffer of the stream that took the last WRITE (given one
 * if it has none), when `want` bytes fit there; NULL otherwise. The buffer is
 * pinned until zdw_land_end. Dispatcher only. */
static uint8_t *zdw_land_begin(size_t want)
{
    struct zdw_stream *st;
    uint8_t *tail = NULL;
    pthread_mutex_lock(&zdw_lock);
    st = zdw_find_locked(zdw_last_ino);
    if (st == NULL) {
        int i;
        for (i = 0; i < ZDW_STREAMS && st == NULL; i++)
            if (zdw_streams[i].used)
                st = &zdw_streams[i];
    }
    if (st != NULL && st->buf == NULL && (st->buf = zdw_buf_get()) != NULL) {
        st->buf_off = st->next_off;
        st->buf_len = 0;
    }
    if (st != NULL && st->buf != NULL && ZDW_BUFSZ - st->buf_len >= want) {
        tail = st->buf + st->buf_len;
        pthread_mutex_lock(&zdw_pool_lock);
        zdw_landing = st->buf;
        pthread_mutex_unlock(&zdw_pool_lock);
    }
    pthread_mutex_unlock(&zdw_lock);
    return tail;
}

/* The read that zdw_land_begin prepared is done with: unpin its buffer. */
static void zdw_land_end(void)
{
    pthread_mutex_lock(&zdw_pool_lock);
    if (zdw_landing_orphan)
        zdw_buf_put_locked(zdw_landing);
    zdw_landing_orphan = 0;
    zdw_landing = NULL;
    pthread_cond_broadcast(&zdw_landing_cv);
    pthread_mutex_unlock(&zdw_pool_lock);
}

/* ---- Python's side -------------------------------------------------------------- */

/* Let streams be armed (1; returns the eventfd) or not (0). */
int zdw_enable(int on)
{
    pthread_mutex_lock(&zdw_lock);
    if (on && zdw_efd < 0)
        zdw_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    zdw_on = on && zdw_efd >= 0;
    pthread_mutex_unlock(&zdw_lock);
    return on ? (zdw_efd >= 0 ? zdw_efd : -EMFILE) : 0;
}

/* Arm ino's stream at `next_off` with `credit` bytes. -EEXIST: armed already;
 * -EAGAIN: a request that may change the file is queued and not handed to
 * pyfuse3 yet; -ENOSPC: no free stream; -EINVAL: not block-aligned; -EPERM: off. */
int zdw_arm(uint64_t ino, uint64_t next_off, uint64_t credit)
{
    struct zdw_rec *endrec;
    int i, rc = -ENOSPC;
    if (next_off % zdp_block_size != 0 || ino == 0)
        return -EINVAL;
    endrec = malloc(sizeof *endrec);
    if (endrec == NULL)
        return -ENOMEM;
    pthread_mutex_lock(&zdw_lock);
    if (!zdw_on) {
        rc = -EPERM;
    } else if (zdw_find_locked(ino) != NULL) {
        rc = -EEXIST;
    } else {
        int busy;
        pthread_mutex_lock(&zdp_lock);
        busy = zdp_mutseq[ino % ZDP_MUTSEQ] > zdp_handed;
        pthread_mutex_unlock(&zdp_lock);
        if (busy)
            rc = -EAGAIN;
        else
            for (i = 0; i < ZDW_STREAMS; i++)
                if (!zdw_streams[i].used) {
                    zdw_streams[i] = (struct zdw_stream){ino, next_off, credit, NULL, 0, 0, 1,
                                                         endrec};
                    __atomic_store_n(&zdw_nstreams, zdw_nstreams + 1, __ATOMIC_RELAXED);
                    BUMP(zdw_arms, 1);
                    rc = 0;
                    break;
                }
    }
    pthread_mutex_unlock(&zdw_lock);
    if (rc != 0)
        free(endrec);
    return rc;
}

/* End ino's stream (Python is about to change the file): 0, or -ENOENT. */
int zdw_end(uint64_t ino)
{
    struct zdw_stream *st;
    int rc = -ENOENT;
    pthread_mutex_lock(&zdw_lock);
    if ((st = zdw_find_locked(ino)) != NULL) {
        zdw_end_locked(st, ZW_PYTHON_CHANGE);
        rc = 0;
    }
    pthread_mutex_unlock(&zdw_lock);
    return rc;
}

/* Add `add` bytes to ino's credit; 0, or -ENOENT when it has no stream. */
int zdw_credit(uint64_t ino, uint64_t add)
{
    struct zdw_stream *st;
    int rc = -ENOENT;
    pthread_mutex_lock(&zdw_lock);
    if ((st = zdw_find_locked(ino)) != NULL) {
        st->credit += add;
        rc = 0;
    }
    pthread_mutex_unlock(&zdw_lock);
    return rc;
}

/* Whether ino has a stream. */
int zdw_armed(uint64_t ino)
{
    int r;
    pthread_mutex_lock(&zdw_lock);
    r = zdw_find_locked(ino) != NULL;
    pthread_mutex_unlock(&zdw_lock);
    return r;
}

/* Take up to `max` records, oldest first: the count. Data records' `mem` is the
 * caller's to zdw_free. The eventfd is cleared once the list is empty. */
int zdw_take(struct zdw_out *out, int max)
{
    int n = 0;
    pthread_mutex_lock(&zdw_lock);
    while (n < max && zdw_head != NULL) {
        struct zdw_rec *r = zdw_head;
        zdw_head = r->next;
        if (zdw_head == NULL)
            zdw_tail = NULL;
        out[n] = (struct zdw_out){r->ino, r->file_off, r->len, r->credit_left, r->mem,
                                  r->kind & 0xff, r->kind >> 8};
        zdw_staged -= r->len;
        free(r);
        n++;
    }
    if (zdw_head == NULL && zdw_efd >= 0) {
        uint64_t v;
        (void)!read(zdw_efd, &v, sizeof v);
    }
    pthread_mutex_unlock(&zdw_lock);
    return n;
}

/* A record's buffer, once Python holds no view of it: back to the pool, or freed. */
void zdw_free(void *mem)
{
    if (mem == NULL)
        return;
    pthread_mutex_lock(&zdw_pool_lock);
    while (mem == zdw_landing)   /* a read of /dev/fuse may still write past the record */
        pthread_cond_wait(&zdw_landing_cv, &zdw_pool_lock);
    zdw_buf_put_locked(mem);
    pthread_mutex_unlock(&zdw_pool_lock);
}

/* End every stream (the serve ends, or C writes are switched off): no WRITE is
 * taken in C after this returns; what was staged waits for zdw_take. */
void zdw_close(void)
{
    int i;
    pthread_mutex_lock(&zdw_lock);
    zdw_on = 0;
    for (i = 0; i < ZDW_STREAMS; i++)
        if (zdw_streams[i].used)
            zdw_end_locked(&zdw_streams[i], ZW_CLOSED);
    pthread_mutex_unlock(&zdw_lock);
}

/* out: served WRITEs, their bytes, records queued, partial flushes, arms, bytes
 * staged now, capability probes answered, then ZW_NREASONS stream ends, then the
 * WRITEs read straight into their staging buffer. */
int zdw_stats(uint64_t *out, int max)
{
    int i, n = 0;
    uint64_t staged;
    pthread_mutex_lock(&zdw_lock);
    staged = zdw_staged;
    pthread_mutex_unlock(&zdw_lock);
#define PUT(v) do { if (n < max) out[n] = (v); n++; } while (0)
    PUT(LOAD(zdw_served));
    PUT(LOAD(zdw_served_bytes));
    PUT(LOAD(zdw_records));
    PUT(LOAD(zdw_partials));
    PUT(LOAD(zdw_arms));
    PUT(staged);
    PUT(LOAD(zdw_caps_probes));
    for (i = 0; i < ZW_NREASONS; i++)
        PUT(LOAD(zdw_ended[i]));
    PUT(LOAD(zdw_in_place));
#undef PUT
    return n < max ? n : max;
}
