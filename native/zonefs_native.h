/*
 * zonefs_native.h -- O_DIRECT I/O, zone ioctls and batched I/O for zonefs-py.
 *
 * Conventions (docs/DESIGN.md section 2):
 *   - every function returning int/int64_t returns >= 0 on success and -errno
 *     on failure; nothing sets or relies on errno across the API;
 *   - offsets and lengths are in BYTES; 512-byte sectors never leave the C code;
 *   - structs are fixed-size with explicit reserved padding (checked with
 *     _Static_assert) so the cffi cdef stays stable;
 *   - there is no global mutable state: buffer pools and io_uring rings are
 *     objects owned by the caller and safe to share between threads.
 * Every call may block; cffi's API mode releases the GIL around each call.
 *
 * The declarations between the CDEF-BEGIN / CDEF-END markers are fed
 * verbatim to cffi's cdef() by native/build_native.py.
 */
#ifndef ZONEFS_NATIVE_H
#define ZONEFS_NATIVE_H

#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
/* zn_open() flags */
#define ZN_O_DIRECT 1
#define ZN_O_RDONLY 2
#define ZN_O_EXCL 4

/* zn_geometry.model */
#define ZN_MODEL_NONE 0
#define ZN_MODEL_HOST_MANAGED 1
#define ZN_MODEL_HOST_AWARE 2

/* zn_zone_mgmt() operations */
#define ZN_OP_RESET 1
#define ZN_OP_OPEN 2
#define ZN_OP_CLOSE 3
#define ZN_OP_FINISH 4

/* zn_zone.flags */
#define ZN_ZONE_NON_SEQ 1
#define ZN_ZONE_RESET_RECOMMENDED 2

/* One zone, as reported by BLKREPORTZONE, converted to bytes (64 bytes). */
struct zn_zone {
    uint64_t start;      /* absolute byte offset of the zone */
    uint64_t len;        /* zone size in bytes */
    uint64_t capacity;   /* usable bytes (== len without BLK_ZONE_REP_CAPACITY) */
    uint64_t wp;         /* absolute byte offset of the write pointer */
    uint8_t type;        /* enum blk_zone_type */
    uint8_t cond;        /* enum blk_zone_cond */
    uint8_t flags;       /* ZN_ZONE_* */
    uint8_t reserved0[5];
    uint8_t reserved[24];
};

/* Geometry and limits of a block device (64 bytes); zero fields mean "none". */
struct zn_geometry {
    uint64_t size_bytes;
    uint64_t zone_size_bytes;      /* 0 on a non-zoned device */
    uint32_t logical_block_size;
    uint32_t physical_block_size;
    uint32_t nr_zones;
    uint32_t max_open_zones;       /* 0: no limit */
    uint32_t max_active_zones;     /* 0: no limit */
    uint32_t zone_append_max_bytes;
    uint32_t model;                /* ZN_MODEL_* */
    uint32_t max_io_bytes;         /* queue/max_sectors_kb in bytes */
    uint8_t reserved[16];
};

/* One request of a batch (32 bytes). */
struct zn_io {
    uint64_t offset;   /* bytes */
    uint64_t length;   /* bytes */
    void *buf;         /* read: destination; write: source (any alignment) */
    uint32_t group;    /* requests of one group run in array order, one at a time */
    int32_t result;    /* out: 0, or -errno (-ECANCELED after an earlier failure in the group) */
};

struct zn_pool_stats {
    uint64_t buf_size;
    uint32_t nr_bufs;
    uint32_t nr_free;
    uint64_t acquires;
    uint64_t waits;    /* acquisitions that had to wait for a free buffer */
};

struct zn_pool;
struct zn_ring;

int zn_open(const char *path, int flags);
int zn_close(int fd);
int zn_fdatasync(int fd);
int64_t zn_file_size(int fd);
int zn_is_block_device(int fd);

int zn_geometry(int fd, struct zn_geometry *out);
int zn_sysfs_zoned_model(const char *path);
int zn_report_zones(int fd, uint64_t offset, struct zn_zone *out, uint32_t max_zones);
int zn_zone_mgmt(int fd, int op, uint64_t offset, uint64_t length);

struct zn_pool *zn_pool_new(uint32_t nr_bufs, uint64_t buf_size, int *err);
void zn_pool_free(struct zn_pool *pool);
void zn_pool_get_stats(struct zn_pool *pool, struct zn_pool_stats *out);

int zn_pread(int fd, struct zn_pool *pool, uint32_t block_size,
             uint64_t offset, void *dst, uint64_t length);
int zn_pwrite(int fd, struct zn_pool *pool, uint32_t block_size,
              uint64_t offset, const void *src, uint64_t length);

struct zn_ring *zn_ring_new(uint32_t entries, int *err);
void zn_ring_free(struct zn_ring *ring);
int zn_batch(struct zn_ring *ring, int fd, struct zn_pool *pool, uint32_t block_size,
             int is_write, struct zn_io *reqs, uint32_t nr_reqs);

/* Completion-driven reads for an event loop: an io_uring whose completions
 * signal an eventfd, so that one thread submits reads without blocking and
 * waits for the eventfd to be readable (no worker thread per read). The
 * caller owns the (block-aligned) buffers until each tag completes.
 * Single-threaded: one thread submits and reaps. */
struct zn_aring;
/* sqpoll_idle_ms > 0: a kernel thread polls submissions (falls back to none). */
struct zn_aring *zn_aring_new(uint32_t entries, uint32_t sqpoll_idle_ms, int *err);
void zn_aring_free(struct zn_aring *ring);
int zn_aring_eventfd(struct zn_aring *ring);
/* zn_aring_reap result of a read whose data failed its checksums. */
#define ZN_AR_BADSUM -100000
/* Queue and submit one read into `slot` (< entries, the caller's own slot
 * number, free until reaped). csums: NULL, or length / block_size
 * little-endian u32 block checksums (docs/SPEC.md) that the completed data is
 * verified against in zn_aring_reap; the caller keeps them alive until then.
 * 0, -EBUSY when the ring is full, or -errno. */
int zn_aring_read(struct zn_aring *ring, int fd, void *buf, uint32_t length,
                  uint64_t offset, uint32_t slot, const uint8_t *csums,
                  uint32_t block_size);
/* Return up to `max` completions, without blocking: slots[i] and results[i]
 * (bytes read; ZN_AR_BADSUM with bad[i] the first block that failed its
 * checksum; or -errno), each read of a slot with checksums verified here
 * (C, GIL released). clear: read the eventfd first (a completion posted
 * after that signals again); 0 peeks at the completion queue only. */
int zn_aring_reap(struct zn_aring *ring, uint32_t *slots, int32_t *results, int32_t *bad,
                  uint32_t max, int clear);
void *zn_aligned_alloc(uint64_t size);
void zn_aligned_free(void *ptr);

/* Per-block checksums (docs/SPEC.md): the low 32 bits of XXH3-64 (seed 0) of
 * each block_size block of data, stored little-endian, 4 bytes per block.
 * length must be a multiple of block_size. Pure computation, GIL released. */
int zn_block_csums(const void *data, uint64_t length, uint32_t block_size, uint8_t *out);
/* Index of the first block whose checksum differs from csums, or -1. */
int64_t zn_first_bad_block(const void *data, uint64_t length, uint32_t block_size,
                           const uint8_t *csums);
/* NVMe Zone Append through io_uring passthrough on the generic char device
 * (/dev/ngXnY), native/zonefs_zappend.c. One append (48 bytes): */
struct zn_zappend {
    uint64_t zone_start;   /* in: byte offset of the zone's first block */
    uint64_t length;       /* in: bytes, a multiple of the block size, <= max_bytes */
    const void *buf;       /* in: the data (any alignment; copied) */
    uint64_t landed;       /* out: byte offset where the device put the data */
    int32_t result;        /* out: 0, or -errno (-ECANCELED: not issued) */
    uint32_t nvme_status;  /* out: the NVMe status when the device refused it, else 0 */
    uint8_t reserved[8];
};
struct zn_zapp;
/* Open `chardev`, learn its namespace id and prove passthrough works (an NVMe
 * Flush); `entries` appends may be in flight per call. NULL and *err = -errno
 * (-EOPNOTSUPP: no passthrough on this kernel; -EACCES: not permitted). */
struct zn_zapp *zn_zapp_open(const char *chardev, uint32_t block_size, uint32_t max_bytes,
                             uint32_t entries, int *err);
void zn_zapp_free(struct zn_zapp *z);
uint32_t zn_zapp_nsid(struct zn_zapp *z);
/* Issue the appends, up to `entries` at a time (in no particular order on the
 * device), and wait for all. 0 when every one landed; -EIO if any failed
 * (see each result); -EINVAL (nothing issued) for a bad request. One call at a
 * time per handle (others wait). */
int zn_zapp_run(struct zn_zapp *z, struct zn_zappend *reqs, uint32_t nr);
/* CDEF-END */

#endif /* ZONEFS_NATIVE_H */
