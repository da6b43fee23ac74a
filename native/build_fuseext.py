"""Build `zonefs_py._fuseext` (FALLOCATE, COPY_FILE_RANGE: pyfuse3 does not handle them).

Used by setup.py (`cffi_modules`) next to build_native.py; `python
native/build_fuseext.py` builds it in place. Needs libfuse3's and liburing's
headers and libraries (Debian 12: libfuse3-dev liburing-dev pkg-config).
native/zonefs_fuseext.c says how it reaches libfuse; zonefs_py/fuseext.py is
its Python side.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from cffi import FFI

NATIVE_DIR = Path(__file__).resolve().parent
SOURCE = NATIVE_DIR / "zonefs_fuseext.c"
#: The data plane's dispatcher and read map (issue 43), compiled into the same
#: module so that its libfuse stand-ins are in the global scope with the others.
DISPATCH_SOURCE = NATIVE_DIR / "zonefs_dispatch.c"
#: The write streams (issue 44): compiled after the dispatcher, whose statics they use.
CWRITE_SOURCE = NATIVE_DIR / "zonefs_cwrite.c"

CDEF = """
extern "Python" int zfx_py_fallocate(void *req, uint64_t ino, int mode, int64_t offset,
                                     int64_t length, uint64_t fh);
void zfx_arm(int on);
int zfx_installed_flag(void);
extern "Python" int zfx_py_copy_file_range(void *req, uint64_t fh_in, int64_t off_in,
                                           uint64_t fh_out, int64_t off_out,
                                           uint64_t length, int flags);
int zfx_reply_err(void *req, int err);
int zfx_reply_write(void *req, uint64_t count);
void zfx_census_arm(int on);
int zfx_census_slots(void);
const char *zfx_census_name(int slot);
uint64_t zfx_census_count(int slot);
uint64_t zfx_census_answered_count(int slot);
uint64_t zfx_census_forgotten(void);
uint64_t zfx_census_dispatch_failures(void);
uint64_t zfx_census_untracked(void);
uint64_t zfx_census_in_flight(void);
struct zfx_waiting { uint64_t seq; uint64_t ino; uint64_t age_ns; uint32_t opcode;
                     uint32_t reserved; };
int zfx_census_waiting(struct zfx_waiting *out, int max, uint64_t older_than_ns);
uint64_t zfx_census_begin(const void *key, uint32_t opcode, uint64_t ino);
int zfx_census_end(const void *key);
void zfx_census_received(uint32_t opcode);
void zfx_census_answered(uint32_t opcode);
extern uint64_t zfx_current_seq;
int zfx_census_fail(uint64_t seq, int err);
const char *zfx_census_xattr(int i, uint64_t *count);
void zfx_set_no_caps(int on);
void zfx_set_no_system_ns(int on);
uint64_t zfx_caps_answered_count(void);
int zfx_gate_add(uint64_t fh);
void zfx_gate_remove(uint64_t fh);
void zfx_gate_clear(void);
uint64_t zfx_gate_refused_count(void);
"""

#: native/zonefs_dispatch.c's API (zonefs_py/dataplane/ is its Python side).
DISPATCH_CDEF = """
struct zdp_piece {
    uint64_t file_off;
    uint64_t length;
    uint64_t dev_off;
    uint32_t zone;
    uint32_t flags;
    uint64_t csum_idx;
    int32_t fd;
    uint32_t reserved;
};
int zdp_configure(uint32_t nzones, uint32_t block_size);
int zdp_publish(uint64_t ino, uint64_t size, const struct zdp_piece *pieces,
                uint32_t npieces, const uint8_t *csums, uint64_t ncsums);
int zdp_publish_tenant(uint64_t ino, uint64_t size, const struct zdp_piece *pieces,
                       uint32_t npieces, const uint8_t *csums, uint64_t ncsums,
                       uint32_t tenant);
uint64_t zdp_tenant_served(uint32_t tenant);
void zdp_revoke(uint64_t ino);
void zdp_revoke_all(void);
int zdp_published(uint64_t ino);
uint32_t zdp_zone_pins(uint32_t zone);
void zdp_arm(int on);
int zdp_running_flag(void);
const char *zdp_why_not(void);
uint64_t zdp_handed_seq(void);
int zdp_stats(uint64_t *out, int max);
void zdp_shutdown(void);
void zdp_set_no_uring(int on);
void zdp_set_lone(int on);
const char *zdp_io_mode(void);
int zdp_test_start(int fd);
int zdp_test_qfd(void);
int64_t zdp_test_take(uint8_t *out, uint64_t max, uint64_t *seq);
"""

#: native/zonefs_cwrite.c's API (zonefs_py/dataplane/cwrites.py is its Python side).
CWRITE_CDEF = """
struct zdw_out {
    uint64_t ino, file_off, len, credit_left;
    uint8_t *mem;
    uint32_t kind, reason;
};
int zdw_enable(int on);
int zdw_arm(uint64_t ino, uint64_t next_off, uint64_t credit);
int zdw_end(uint64_t ino);
int zdw_credit(uint64_t ino, uint64_t add);
int zdw_armed(uint64_t ino);
int zdw_take(struct zdw_out *out, int max);
void zdw_free(void *mem);
void zdw_close(void);
int zdw_stats(uint64_t *out, int max);
"""


def _pkg_config(*args: str) -> list[str]:
    """Return pkg-config's answer for fuse3, or [] if pkg-config is missing."""
    try:
        out = subprocess.run(["pkg-config", *args, "fuse3"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return shlex.split(out)


def _make_builder() -> FFI:
    builder = FFI()
    builder.cdef(CDEF + DISPATCH_CDEF + CWRITE_CDEF)
    cflags = _pkg_config("--cflags") or ["-I/usr/include/fuse3"]
    libs = [flag[2:] for flag in _pkg_config("--libs") if flag.startswith("-l")] or ["fuse3"]
    # The C text goes into the generated module itself (not a separate source),
    # so that it sees cffi's declaration of the extern "Python" callback.
    builder.set_source(
        "zonefs_py._fuseext",
        SOURCE.read_text() + "\n" + DISPATCH_SOURCE.read_text() + "\n"
        + CWRITE_SOURCE.read_text(),
        # liburing: the dispatcher's device reads (one io_uring_submit per batch)
        libraries=[*libs, "uring", "dl", "pthread"],
        include_dirs=[str(NATIVE_DIR)],
        depends=[str(NATIVE_DIR / "zonefs_census.h")],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                            *cflags],
    )
    return builder


ffibuilder = _make_builder()

if __name__ == "__main__":
    import os

    os.chdir(NATIVE_DIR.parent)
    # Writes zonefs_py/_fuseext.c and zonefs_py/_fuseext*.so (git-ignored).
    print(ffibuilder.compile(tmpdir=".", verbose=False))
