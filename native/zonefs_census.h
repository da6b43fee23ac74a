/*
 * The request census (issues 29 and 42): every FUSE request counted when it is
 * received and when it is answered, by kernel opcode, and every request in
 * flight remembered (opcode, inode, arrival time) so that one waiting too long
 * can be reported. Defined in native/zonefs_fuseext.c (zonefs_py._fuseext),
 * which is in the process's global symbol scope once zonefs_py is imported
 * (zonefs_py/fuseext.py): other native code of the daemon (the C request
 * dispatcher) calls these directly.
 *
 * Two ways to count:
 *   - tracked: zfx_census_begin(key, opcode, ino) when a request arrives and
 *     zfx_census_end(key) when it is answered. `key` is any pointer unique
 *     among the requests in flight (libfuse's fuse_req_t for requests that go
 *     through libfuse: every fuse_reply_* of libfuse is wrapped to call
 *     zfx_census_end, so those are ended by the reply itself). Tracked
 *     requests appear in zfx_census_waiting() while unanswered.
 *   - counted only: zfx_census_received(opcode) / zfx_census_answered(opcode),
 *     for a path that answers within the same call (never in flight for long).
 * Thread-safe: counters are atomic, the in-flight table has its own mutex
 * (zfx_flight_lock), so a C thread may count while the trio thread does.
 * Opcodes are the kernel's (enum fuse_opcode of linux/fuse.h: FUSE_READ = 15);
 * unknown opcodes (>= ZFX_CENSUS_OPCODES) are counted under 0.
 */
#ifndef ZONEFS_CENSUS_H
#define ZONEFS_CENSUS_H

#include <stdint.h>

#define ZFX_CENSUS_OPCODES 64

/* One request waiting longer than asked (zfx_census_waiting): 32 bytes. */
struct zfx_waiting {
    uint64_t seq;     /* arrival number since the mount (1, 2, ...): unique */
    uint64_t ino;     /* inode the request names (the parent for name ops; 0 if none) */
    uint64_t age_ns;  /* time since it arrived */
    uint32_t opcode;  /* kernel opcode */
    uint32_t reserved;
};

uint64_t zfx_census_begin(const void *key, uint32_t opcode, uint64_t ino);
int zfx_census_end(const void *key);
void zfx_census_received(uint32_t opcode);
void zfx_census_answered(uint32_t opcode);

#endif
