"""The data plane's read map and dispatcher without FUSE (native/zonefs_dispatch.c).

The dispatcher runs on one end of a SOCK_SEQPACKET socket pair (one request per
read, like /dev/fuse; replies come back on it) through `zdp_test_start`; the
test writes FUSE requests into the other end, reads the replies, and takes what
the dispatcher hands on (`zdp_test_take`, what pyfuse3's receive loop gets).
A pipe as the "device" holds a READ's device read in flight until the test
writes its bytes, so pins and ordering are seen at a known moment.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from zonefs_py import dataplane
from zonefs_py.format.checksum import block_checksums

BS = 4096
NZONES = 8
OP_GETATTR, OP_READ, OP_WRITE, OP_SETATTR, OP_IOCTL = 3, 15, 16, 4, 39
IN_HDR = struct.Struct("<IIQQIIIHH")
READ_IN = struct.Struct("<QQIIQII")
OUT_HDR = struct.Struct("<IiQ")
SO_SNDBUFFORCE = 32  # Linux; not in the socket module

ext: Any = dataplane._ext()  # noqa: SLF001
pytestmark = pytest.mark.skipif(ext is None, reason="zonefs_py._fuseext is not built")


def _request(opcode: int, unique: int, ino: int, body: bytes = b"") -> bytes:
    return IN_HDR.pack(IN_HDR.size + len(body), opcode, unique, ino, 0, 0, 0, 0, 0) + body


def _read(unique: int, ino: int, offset: int, size: int) -> bytes:
    return _request(OP_READ, unique, ino, READ_IN.pack(0, offset, size, 0, 0, 0, 0))


def _piece(arr: Any, i: int, file_off: int, length: int, dev_off: int = 0, zone: int = 0,
           fd: int = -1, flags: int = 0, csum_idx: int = 0) -> None:
    p = arr[i]
    p.file_off, p.length, p.dev_off, p.zone = file_off, length, dev_off, zone
    p.fd, p.flags, p.csum_idx = fd, flags, csum_idx


def _publish(ino: int, size: int, pieces: list[dict[str, int]], csums: bytes = b"") -> int:
    arr = ext.ffi.new("struct zdp_piece[]", max(1, len(pieces)))
    for i, kw in enumerate(pieces):
        _piece(arr, i, **kw)
    return int(ext.lib.zdp_publish(ino, size, arr, len(pieces), csums, len(csums) // 4))


def _reasons() -> dict[str, int]:
    raw = dataplane.raw_stats()
    return dict(zip(dataplane.REASONS, raw[4:4 + len(dataplane.REASONS)], strict=True))


class Dispatcher:
    """The dispatcher on a socket pair; `send` a request, `reply` / `handed` what came back."""

    def __init__(self) -> None:
        self.sock, self.peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(10)
        # the dispatcher's writes are non-blocking: room for every reply of a test
        try:
            self.peer.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 64 << 20)
        except PermissionError:
            self.peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)
        rc = ext.lib.zdp_test_start(self.peer.fileno())
        if rc != 0:
            self.sock.close()
            self.peer.close()
            pytest.fail(f"the dispatcher did not start: {dataplane.why_not()}")

    def send(self, req: bytes) -> None:
        self.sock.send(req)

    def reply(self) -> tuple[int, int, bytes]:
        """(unique, error, data) of the next reply the dispatcher wrote."""
        msg = self.sock.recv(2 << 20)
        length, err, unique = OUT_HDR.unpack_from(msg)
        assert length == len(msg)
        return unique, err, msg[OUT_HDR.size:]

    def handed(self) -> tuple[int, int, int]:
        """(opcode, unique, ino) of the next request handed on (waits for it)."""
        out = ext.ffi.new("uint8_t[]", 4096)
        seq = ext.ffi.new("uint64_t *")
        while True:
            n = ext.lib.zdp_test_take(out, 4096, seq)
            if n > 0:
                _len, opcode, unique, ino = IN_HDR.unpack_from(ext.ffi.buffer(out, n))[:4]
                return opcode, unique, ino
            assert n == 0, "the session ended"
            ready = select.select([ext.lib.zdp_test_qfd()], [], [], 10)[0]
            assert ready, "nothing handed on within 10 s"

    def close(self) -> None:
        ext.lib.zdp_shutdown()
        self.sock.close()
        self.peer.close()


@pytest.fixture
def geometry() -> Iterator[None]:
    assert ext.lib.zdp_configure(NZONES, BS) == 0
    yield
    ext.lib.zdp_revoke_all()


@pytest.fixture
def disp(geometry: None) -> Iterator[Dispatcher]:
    d = Dispatcher()
    yield d
    d.close()


@pytest.fixture
def no_lone() -> Iterator[None]:
    """Every READ through the ring: a lone READ's pread of a pipe would hold the
    dispatcher itself until the test writes the bytes."""
    ext.lib.zdp_set_lone(0)
    yield
    ext.lib.zdp_set_lone(1)


@pytest.fixture
def device(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    """A file of 16 blocks, each a different byte, and its fd."""
    data = b"".join(bytes([0x40 + i]) * BS for i in range(16))
    path = tmp_path / "dev"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    yield fd, data
    os.close(fd)


# -- the read map alone ----------------------------------------------------------------
def test_publish_then_revoke(geometry: None) -> None:
    assert _publish(7, BS, [{"file_off": 0, "length": BS, "flags": dataplane.ZDP_HOLE}]) == 0
    assert ext.lib.zdp_published(7) == 1
    ext.lib.zdp_revoke(7)
    assert ext.lib.zdp_published(7) == 0


def test_publish_refuses_a_map_outside_the_geometry(geometry: None) -> None:
    sums = bytes(4)
    assert _publish(8, BS, [{"file_off": 0, "length": BS, "zone": NZONES}], sums) < 0
    assert _publish(8, BS, [{"file_off": 0, "length": BS, "dev_off": 100}], sums) < 0
    assert _publish(8, 2 * BS, [{"file_off": 0, "length": 2 * BS}], sums) < 0  # 1 sum, 2 blocks
    assert ext.lib.zdp_published(8) == 0


def test_revoke_all_empties_the_map(geometry: None) -> None:
    for ino in range(1, 2000):  # grows the table past its first size
        assert _publish(ino, 0, []) == 0
    ext.lib.zdp_revoke_all()
    assert not any(ext.lib.zdp_published(ino) for ino in (1, 1000, 1999))


# -- the dispatcher ----------------------------------------------------------------------
def test_read_of_a_published_file_is_served_in_c(disp: Dispatcher,
                                                 device: tuple[int, bytes]) -> None:
    fd, data = device
    sums = block_checksums(data[4 * BS:8 * BS], BS)
    # blocks 0-3 from device blocks 4-7, then a hole of 2 blocks, size 6 blocks - 100
    assert _publish(5, 6 * BS - 100, [
        {"file_off": 0, "length": 4 * BS, "dev_off": 4 * BS, "zone": 2, "fd": fd},
        {"file_off": 4 * BS, "length": 2 * BS, "flags": dataplane.ZDP_HOLE},
    ], sums) == 0
    served = dataplane.raw_stats()[0]
    disp.send(_read(1, 5, 100, 2 * BS))
    assert disp.reply() == (1, 0, data[4 * BS + 100:6 * BS + 100])
    disp.send(_read(2, 5, 3 * BS, 8 * BS))  # across the hole, cut at the size
    assert disp.reply() == (2, 0, data[7 * BS:8 * BS] + bytes(2 * BS - 100))
    disp.send(_read(3, 5, 6 * BS, BS))  # at the size: empty
    assert disp.reply() == (3, 0, b"")
    # The dispatcher counts a READ as served just after its reply is written: the
    # count may trail the reply the test already has by a moment.
    deadline = time.monotonic() + 5
    while dataplane.raw_stats()[0] < served + 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert dataplane.raw_stats()[0] == served + 3
    assert ext.lib.zdp_zone_pins(2) == 0
    assert dataplane.io_mode() == "io_uring"


def test_reads_are_counted_per_tenant(disp: Dispatcher, device: tuple[int, bytes]) -> None:
    """A map published with its tenant (issue 45): the bytes C serves from it are
    counted for that tenant, and only for it; an id past the table is refused."""
    fd, data = device
    arr = ext.ffi.new("struct zdp_piece[]", 1)
    _piece(arr, 0, 0, 4 * BS, dev_off=0, zone=1, fd=fd)
    sums = block_checksums(data[:4 * BS], BS)
    lib = ext.lib
    assert lib.zdp_publish_tenant(21, 4 * BS, arr, 1, sums, 4, 4096) == -errno.EINVAL
    assert lib.zdp_publish_tenant(21, 4 * BS, arr, 1, sums, 4, 4095) == 0
    assert lib.zdp_publish_tenant(22, 3 * BS, arr, 1, sums, 4, 7) == 0
    before = {t: lib.zdp_tenant_served(t) for t in (0, 7, 4095)}
    disp.send(_read(70, 21, 0, 2 * BS))
    assert disp.reply() == (70, 0, data[:2 * BS])
    disp.send(_read(71, 22, BS, 4 * BS))  # cut at the size: 2 blocks
    assert disp.reply() == (71, 0, data[BS:3 * BS])
    deadline = time.monotonic() + 5
    while lib.zdp_tenant_served(7) < before[7] + 2 * BS and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lib.zdp_tenant_served(4095) == before[4095] + 2 * BS
    assert lib.zdp_tenant_served(7) == before[7] + 2 * BS
    assert lib.zdp_tenant_served(0) == before[0]
    assert lib.zdp_tenant_served(4096) == 0  # out of range: nothing, no fault
    assert ext.lib.zdp_zone_pins(1) == 0


def _ring_counters() -> tuple[int, int, int]:
    """io_uring submits, device reads submitted, lone READs read by pread."""
    raw = dataplane.raw_stats()
    base = 4 + len(dataplane.REASONS) + dataplane.LAT_BUCKETS
    return raw[base], raw[base + 1], raw[base + 2]


def test_a_lone_read_is_read_by_pread(disp: Dispatcher, device: tuple[int, bytes]) -> None:
    """Queue depth 1: the only request at hand, nothing in flight, is read by pread
    and answered at once; the ring is not entered."""
    fd, data = device
    assert _publish(6, 16 * BS, [{"file_off": 0, "length": 16 * BS, "zone": 2, "fd": fd}],
                    block_checksums(data, BS)) == 0
    before = _ring_counters()
    for i in range(5):
        disp.send(_read(60 + i, 6, i * BS, 2 * BS))
        assert disp.reply() == (60 + i, 0, data[i * BS:(i + 2) * BS])
    deadline = time.monotonic() + 5
    while _ring_counters()[2] < before[2] + 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    after = _ring_counters()
    assert after[2] == before[2] + 5
    assert after[:2] == before[:2]
    assert ext.lib.zdp_zone_pins(2) == 0


def test_read_of_an_unpublished_file_is_handed_on(disp: Dispatcher) -> None:
    before = _reasons()["not_published"]
    disp.send(_read(9, 1234, 0, BS))
    assert disp.handed() == (OP_READ, 9, 1234)
    assert _reasons()["not_published"] == before + 1


def test_checksum_mismatch_is_handed_on(disp: Dispatcher, device: tuple[int, bytes]) -> None:
    fd, _data = device
    assert _publish(6, BS, [{"file_off": 0, "length": BS, "zone": 1, "fd": fd}],
                    b"\0\0\0\0") == 0
    before = _reasons()["checksum_mismatch"]
    disp.send(_read(4, 6, 0, BS))
    assert disp.handed() == (OP_READ, 4, 6)
    assert _reasons()["checksum_mismatch"] == before + 1
    assert ext.lib.zdp_zone_pins(1) == 0


def test_device_error_is_handed_on(disp: Dispatcher, tmp_path: Path) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"")  # a read past its end returns 0 bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        assert _publish(11, BS, [{"file_off": 0, "length": BS, "fd": fd}], bytes(4)) == 0
        before = _reasons()["device_error"]
        disp.send(_read(5, 11, 0, BS))
        assert disp.handed() == (OP_READ, 5, 11)
        assert _reasons()["device_error"] == before + 1
    finally:
        os.close(fd)


def test_read_after_a_write_is_handed_on_behind_it(disp: Dispatcher,
                                                  device: tuple[int, bytes]) -> None:
    fd, data = device
    sums = block_checksums(data[:BS], BS)
    assert _publish(12, BS, [{"file_off": 0, "length": BS, "fd": fd}], sums) == 0
    before = _reasons()["mutated"]
    disp.send(_request(OP_WRITE, 20, 12, bytes(40 + BS)))
    disp.send(_read(21, 12, 0, BS))  # after the WRITE: never from the old map
    assert disp.handed() == (OP_WRITE, 20, 12)
    assert disp.handed() == (OP_READ, 21, 12)
    assert _reasons()["mutated"] == before + 1
    assert ext.lib.zdp_published(12) == 0


def test_an_ioctl_leaves_the_map(disp: Dispatcher, device: tuple[int, bytes]) -> None:
    """The daemon answers every IOCTL ENOSYS, and Python's open() sends one (isatty's
    TCGETS) for each file it opens buffered: the READ after it is still served in C."""
    fd, data = device
    assert _publish(16, BS, [{"file_off": 0, "length": BS, "fd": fd}],
                    block_checksums(data[:BS], BS)) == 0
    disp.send(_request(OP_IOCTL, 22, 16, bytes(32)))
    assert disp.handed() == (OP_IOCTL, 22, 16)
    disp.send(_read(23, 16, 0, BS))
    assert disp.reply() == (23, 0, data[:BS])
    assert ext.lib.zdp_published(16) == 1


def test_publish_is_refused_while_a_write_is_not_handed_on(
        disp: Dispatcher, device: tuple[int, bytes]) -> None:
    fd, data = device
    sums = block_checksums(data[:BS], BS)
    piece = [{"file_off": 0, "length": BS, "fd": fd}]
    disp.send(_request(OP_SETATTR, 30, 13, bytes(88)))
    disp.send(_request(OP_GETATTR, 31, 99, bytes(16)))
    # the GETATTR is handed on only after the SETATTR was read; take nothing yet:
    ready = select.select([ext.lib.zdp_test_qfd()], [], [], 10)[0]
    assert ready
    assert _publish(13, BS, piece, sums) == -11  # -EAGAIN: SETATTR not handed on
    assert disp.handed() == (OP_SETATTR, 30, 13)
    assert _publish(13, BS, piece, sums) == 0
    assert disp.handed() == (OP_GETATTR, 31, 99)


def test_requests_are_not_held_behind_a_device_read_in_flight(
        no_lone: None, disp: Dispatcher) -> None:
    """A pipe as the device: the READ's device read stays in flight until the test
    writes the bytes. Meanwhile its zone is pinned, a later GETATTR is handed on at
    once, and revoking the map does not unpin it; the reply comes once the bytes do."""
    rfd, wfd = os.pipe()
    try:
        block = b"z" * BS
        assert _publish(14, BS, [{"file_off": 0, "length": BS, "zone": 3, "fd": rfd}],
                        block_checksums(block, BS)) == 0
        disp.send(_read(40, 14, 0, BS))
        disp.send(_request(OP_GETATTR, 41, 14, bytes(16)))
        assert disp.handed() == (OP_GETATTR, 41, 14)  # not behind the READ
        assert ext.lib.zdp_zone_pins(3) == 1  # the READ was taken first, and pinned
        ext.lib.zdp_revoke(14)
        assert ext.lib.zdp_zone_pins(3) == 1
        os.write(wfd, block)
        assert disp.reply() == (40, 0, block)
        assert ext.lib.zdp_zone_pins(3) == 0
    finally:
        os.close(rfd)
        os.close(wfd)


def test_shutdown_cancels_a_device_read_in_flight(geometry: None, no_lone: None) -> None:
    rfd, wfd = os.pipe()
    d = Dispatcher()
    try:
        assert _publish(15, BS, [{"file_off": 0, "length": BS, "zone": 4, "fd": rfd}],
                        bytes(4)) == 0
        d.send(_read(50, 15, 0, BS))
        d.send(_request(OP_GETATTR, 51, 15, bytes(16)))
        assert d.handed() == (OP_GETATTR, 51, 15)
        assert ext.lib.zdp_zone_pins(4) == 1
        ext.lib.zdp_shutdown()  # returns: the pipe read was cancelled, not waited for
        assert ext.lib.zdp_zone_pins(4) == 0
        assert ext.lib.zdp_running_flag() == 0
    finally:
        d.close()
        os.close(rfd)
        os.close(wfd)


def test_pread_mode_serves_the_same(geometry: None, device: tuple[int, bytes]) -> None:
    fd, data = device
    ext.lib.zdp_set_no_uring(1)
    d = Dispatcher()
    try:
        assert dataplane.io_mode().startswith("pread: switched off")
        assert _publish(16, 2 * BS, [{"file_off": 0, "length": 2 * BS, "fd": fd}],
                        block_checksums(data[:2 * BS], BS)) == 0
        d.send(_read(60, 16, 10, BS))
        assert d.reply() == (60, 0, data[10:BS + 10])
    finally:
        ext.lib.zdp_set_no_uring(0)
        d.close()


def test_many_reads_in_one_batch_all_answered(disp: Dispatcher,
                                              device: tuple[int, bytes]) -> None:
    fd, data = device
    assert _publish(17, 16 * BS, [{"file_off": 0, "length": 16 * BS, "fd": fd}],
                    block_checksums(data, BS)) == 0
    for i in range(100):  # more than the read slots: some wait for a free one
        disp.send(_read(1000 + i, 17, (i % 16) * BS, BS))
    got = dict((u, d) for u, _e, d in (disp.reply() for _ in range(100)))
    assert got == {1000 + i: data[(i % 16) * BS:(i % 16 + 1) * BS] for i in range(100)}


def test_reads_of_many_pieces_each_never_overflow_the_ring(
        disp: Dispatcher, device: tuple[int, bytes]) -> None:
    """20 READs of 256 one-block pieces each: 5,120 device reads, far more than the
    ring's completion entries; every READ is answered with its bytes."""
    fd, data = device
    nblocks = 256
    order = [(i * 7) % 16 for i in range(nblocks)]
    pieces = [{"file_off": i * BS, "length": BS, "dev_off": b * BS, "fd": fd, "csum_idx": i}
              for i, b in enumerate(order)]
    sums = b"".join(block_checksums(data[b * BS:(b + 1) * BS], BS) for b in order)
    assert _publish(18, nblocks * BS, pieces, sums) == 0
    expect = b"".join(data[b * BS:(b + 1) * BS] for b in order)
    for i in range(20):
        disp.send(_read(2000 + i, 18, 0, nblocks * BS))
    got = [disp.reply() for _ in range(20)]
    assert sorted(u for u, _e, _d in got) == list(range(2000, 2020))
    assert all(e == 0 and d == expect for _u, e, d in got)


def test_requests_left_in_the_queue_at_shutdown_are_answered(geometry: None) -> None:
    """pyfuse3's loop has ended: what the dispatcher read and queued is answered
    ENOTCONN (a caller waits uninterruptibly once its request was read), except a
    FORGET, which has no answer."""
    d = Dispatcher()
    try:
        read_before = dataplane.raw_stats()[3]
        d.send(_request(2, 70, 5, bytes(8)))  # FORGET
        d.send(_request(OP_GETATTR, 71, 5, bytes(16)))
        while dataplane.raw_stats()[3] < read_before + 2:  # both read and queued
            select.select([], [], [], 0.001)
        ext.lib.zdp_shutdown()
        assert d.reply() == (71, -errno.ENOTCONN, b"")
        d.sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing for the FORGET
            d.sock.recv(4096)
    finally:
        d.close()


def test_drained_files_are_settled_evicted_ones_are_not() -> None:
    """A queued, uploading or drained file holds its bytes on the device (its map may
    be published); an evicted one holds none (DESIGN 4.10)."""
    from types import SimpleNamespace

    from zonefs_py.model.drain import DrainRecord, DrainState
    maps = dataplane.ReadMaps.__new__(dataplane.ReadMaps)
    maps.writes = SimpleNamespace(has_state=lambda ino: False, writes_arriving=lambda ino: False)
    maps.state = SimpleNamespace(drain={})
    inode = SimpleNamespace(ino=5, extents=object(), inline=False)
    assert maps.settled(inode)
    for st in (DrainState.QUEUED, DrainState.UPLOADING, DrainState.DRAINED):
        maps.state.drain[5] = DrainRecord(st)
        assert maps.settled(inode), st
    maps.state.drain[5] = DrainRecord(DrainState.EVICTED)
    assert not maps.settled(inode)
    maps.state.drain.clear()
    maps.writes = SimpleNamespace(has_state=lambda ino: True, writes_arriving=lambda ino: False)
    assert not maps.settled(inode)
