/*
 * zonefs_zappend.c -- NVMe Zone Append through io_uring passthrough.
 *
 * Linux gives user space no zone-append call on a block device; the NVMe
 * generic char device (/dev/ngXnY) does: an IORING_OP_URING_CMD whose 80-byte
 * command area (hence 128-byte SQEs, IORING_SETUP_SQE128) holds a
 * `struct nvme_uring_cmd` with NVMe opcode 0x7d (Zone Append), the zone's
 * start LBA in cdw10/11 and the 0-based block count in cdw12. The device
 * picks the address; the kernel copies the command's 64-bit result (NVMe
 * completion dwords 0-1: the LBA where the data landed) into the first extra
 * word of a 32-byte CQE (IORING_SETUP_CQE32). cqe->res is 0, a positive NVMe
 * status (status code type << 8 | status code, plus the DNR/More bits), or
 * -errno for a failure before the device saw the command. The kernel (6.1)
 * refuses passthrough on a ring without both SQE128 and CQE32 (-EOPNOTSUPP).
 *
 * Written after reading the NVMe ZNS command set specification (section 3.4.1)
 * and liburing's test/io_uring_passthrough.c; the code is our own.
 *
 * A handle (`struct zn_zapp`) owns one fd of the char device, one ring and one
 * aligned bounce buffer per ring entry (the caller's bytes are not aligned):
 * one call at a time uses a handle (a mutex enforces it), so callers that want
 * appends from several threads at once use one handle per thread, and a batch
 * call puts up to `entries` appends in flight from one thread.
 */
#define _GNU_SOURCE
#include "zonefs_native.h"

#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/nvme_ioctl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

/* From <linux/nvme_ioctl.h> (kernel 5.19+); defined here for older headers. */
#ifndef NVME_URING_CMD_IO
struct nvme_uring_cmd {
    __u8 opcode;
    __u8 flags;
    __u16 rsvd1;
    __u32 nsid;
    __u32 cdw2;
    __u32 cdw3;
    __u64 metadata;
    __u64 addr;
    __u32 metadata_len;
    __u32 data_len;
    __u32 cdw10;
    __u32 cdw11;
    __u32 cdw12;
    __u32 cdw13;
    __u32 cdw14;
    __u32 cdw15;
    __u32 timeout_ms;
    __u32 rsvd2;
};
#define NVME_URING_CMD_IO _IOWR('N', 0x80, struct nvme_uring_cmd)
#endif
#ifndef NVME_IOCTL_ID
#define NVME_IOCTL_ID _IO('N', 0x40)
#endif
/* From <linux/io_uring.h> (kernel 5.19+, liburing 2.2+). */
#ifndef IORING_SETUP_SQE128
#define IORING_SETUP_SQE128 (1U << 10)
#endif
#ifndef IORING_SETUP_CQE32
#define IORING_SETUP_CQE32 (1U << 11)
#endif

#define NVME_CMD_FLUSH 0x00
#define NVME_CMD_ZONE_APPEND 0x7d
/* Status codes (SCT 1, command specific) of the ZNS command set, figure 35. */
#define NVME_SC_MASK 0x7ff
#define NVME_SC_ZONE_TOO_MANY_ACTIVE 0x1bd
#define NVME_SC_ZONE_TOO_MANY_OPEN 0x1be
#define ZN_ZAPP_ALIGN 4096

_Static_assert(sizeof(struct nvme_uring_cmd) == 72, "nvme_uring_cmd is 72 bytes");
_Static_assert(sizeof(struct zn_zappend) == 48, "zn_zappend must be 48 bytes");

struct zn_zapp {
    pthread_mutex_t mu;
    int fd;
    uint32_t nsid;
    uint32_t block_size;
    uint32_t max_bytes;
    uint32_t entries;
    int broken;           /* io_uring_enter failed with appends in flight: unusable */
    struct io_uring ring;
    unsigned char *bufs;  /* entries x max_bytes, aligned */
};

/* The errno the kernel's block layer gives for the same NVMe status (nvme_error_status). */
static int errno_of_status(uint32_t status)
{
    switch (status & NVME_SC_MASK) {
    case NVME_SC_ZONE_TOO_MANY_ACTIVE:
        return EOVERFLOW;
    case NVME_SC_ZONE_TOO_MANY_OPEN:
        return ETOOMANYREFS;
    default:
        return EIO;
    }
}

static void prep_cmd(struct zn_zapp *z, struct io_uring_sqe *sqe, uint8_t opcode,
                     uint64_t slba, void *buf, uint32_t len, uint64_t tag)
{
    struct nvme_uring_cmd *cmd;

    memset(sqe, 0, 128);  /* SQE128: the command area runs past the 64-byte SQE */
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = z->fd;
    sqe->cmd_op = NVME_URING_CMD_IO;
    sqe->user_data = tag;
    cmd = (struct nvme_uring_cmd *)sqe->cmd;
    cmd->opcode = opcode;
    cmd->nsid = z->nsid;
    if (len) {
        cmd->addr = (uint64_t)(uintptr_t)buf;
        cmd->data_len = len;
        cmd->cdw10 = (uint32_t)slba;
        cmd->cdw11 = (uint32_t)(slba >> 32);
        cmd->cdw12 = len / z->block_size - 1;  /* NLB, 0-based */
    }
}

/* Submit what is queued and reap `want` completions into reqs[tag]. */
static int reap(struct zn_zapp *z, struct zn_zappend *reqs, uint32_t want)
{
    struct io_uring_cqe *cqe;

    while (want) {
        int rc = io_uring_submit_and_wait(&z->ring, 1);

        if (rc < 0 && rc != -EINTR)
            return rc;
        while (want && io_uring_peek_cqe(&z->ring, &cqe) == 0 && cqe) {
            struct zn_zappend *r = &reqs[cqe->user_data];

            if (cqe->res < 0) {
                r->result = cqe->res;
            } else if (cqe->res > 0) {
                r->nvme_status = (uint32_t)cqe->res;
                r->result = -errno_of_status((uint32_t)cqe->res);
            } else {
                r->landed = cqe->big_cqe[0] * z->block_size;
                r->result = 0;
            }
            io_uring_cqe_seen(&z->ring, cqe);
            want--;
        }
    }
    return 0;
}

int zn_zapp_run(struct zn_zapp *z, struct zn_zappend *reqs, uint32_t nr)
{
    uint32_t next = 0, inflight = 0, failed = 0;
    int rc = 0;

    for (uint32_t i = 0; i < nr; i++) {
        if (reqs[i].length == 0 || reqs[i].length % z->block_size ||
            reqs[i].length > z->max_bytes || reqs[i].zone_start % z->block_size)
            return -EINVAL;
        reqs[i].result = -ECANCELED;
        reqs[i].nvme_status = 0;
        reqs[i].landed = 0;
    }
    pthread_mutex_lock(&z->mu);
    if (z->broken) {
        pthread_mutex_unlock(&z->mu);
        return -EIO;
    }
    /* Slot s of the ring's bounce buffers serves request next % entries; a slot is
     * reused only after `entries` completions, when its request is surely done. */
    while (next < nr || inflight) {
        while (next < nr && inflight < z->entries) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&z->ring);
            unsigned char *buf = z->bufs + (size_t)(next % z->entries) * z->max_bytes;

            if (!sqe)
                break;
            memcpy(buf, reqs[next].buf, reqs[next].length);
            prep_cmd(z, sqe, NVME_CMD_ZONE_APPEND, reqs[next].zone_start / z->block_size,
                     buf, (uint32_t)reqs[next].length, next);
            next++;
            inflight++;
        }
        if (!inflight) {
            rc = -EBUSY;  /* no SQE although the ring is idle: cannot happen */
            break;
        }
        /* Wait for all in flight before refilling: the slot of request k is k % entries. */
        rc = reap(z, reqs, inflight);
        if (rc < 0) {
            /* The kernel may still read the bounce buffers of appends in flight:
             * never reuse them (the handle is dropped by its owner). */
            z->broken = 1;
            break;
        }
        inflight = 0;
    }
    pthread_mutex_unlock(&z->mu);
    if (rc < 0)
        return rc;
    for (uint32_t i = 0; i < nr; i++)
        failed += reqs[i].result < 0;
    return failed ? -EIO : 0;
}

/* A Flush through the same path: proves that passthrough works on this fd. */
static int probe(struct zn_zapp *z)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&z->ring);
    struct io_uring_cqe *cqe;
    int rc;

    if (!sqe)
        return -EBUSY;
    prep_cmd(z, sqe, NVME_CMD_FLUSH, 0, NULL, 0, 0);
    rc = io_uring_submit_and_wait(&z->ring, 1);
    if (rc < 0)
        return rc;
    rc = io_uring_wait_cqe(&z->ring, &cqe);
    if (rc < 0)
        return rc;
    rc = cqe->res > 0 ? -errno_of_status((uint32_t)cqe->res) : cqe->res;
    io_uring_cqe_seen(&z->ring, cqe);
    return rc;
}

struct zn_zapp *zn_zapp_open(const char *chardev, uint32_t block_size, uint32_t max_bytes,
                             uint32_t entries, int *err)
{
    struct zn_zapp *z;
    void *bufs = NULL;
    int rc;

    if (block_size < 512 || block_size > ZN_ZAPP_ALIGN || (block_size & (block_size - 1)) ||
        max_bytes < block_size || max_bytes % block_size || max_bytes > (16U << 20) ||
        (uint64_t)max_bytes / block_size > 65536 || entries == 0 || entries > 256) {
        *err = -EINVAL;
        return NULL;
    }
    z = calloc(1, sizeof(*z));
    if (!z) {
        *err = -ENOMEM;
        return NULL;
    }
    z->block_size = block_size;
    z->max_bytes = max_bytes;
    z->fd = open(chardev, O_RDWR | O_CLOEXEC);
    if (z->fd < 0) {
        rc = -errno;
        goto fail_free;
    }
    rc = ioctl(z->fd, NVME_IOCTL_ID);
    if (rc <= 0) {
        rc = rc < 0 ? -errno : -ENOTTY;
        goto fail_close;
    }
    z->nsid = (uint32_t)rc;
    rc = posix_memalign(&bufs, ZN_ZAPP_ALIGN, (size_t)entries * max_bytes);
    if (rc) {
        rc = -rc;
        goto fail_close;
    }
    z->bufs = bufs;
    rc = io_uring_queue_init(entries, &z->ring, IORING_SETUP_SQE128 | IORING_SETUP_CQE32);
    if (rc < 0)
        goto fail_bufs;
    z->entries = entries < z->ring.sq.ring_entries ? entries : z->ring.sq.ring_entries;
    rc = probe(z);
    if (rc < 0)
        goto fail_ring;
    pthread_mutex_init(&z->mu, NULL);
    *err = 0;
    return z;

fail_ring:
    io_uring_queue_exit(&z->ring);
fail_bufs:
    free(bufs);
fail_close:
    close(z->fd);
fail_free:
    free(z);
    *err = rc;
    return NULL;
}

void zn_zapp_free(struct zn_zapp *z)
{
    if (!z)
        return;
    io_uring_queue_exit(&z->ring);
    pthread_mutex_destroy(&z->mu);
    close(z->fd);
    free(z->bufs);
    free(z);
}

uint32_t zn_zapp_nsid(struct zn_zapp *z)
{
    return z->nsid;
}
