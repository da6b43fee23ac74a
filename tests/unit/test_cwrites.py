"""The data plane's write streams without FUSE (native/zonefs_cwrite.c).

The dispatcher runs on a socket pair as in test_dataplane.py: the test arms a
stream (what the engine does after a streaming WRITE), sends FUSE requests,
reads the replies, takes what was handed on (pyfuse3's side) and what C staged
(`zdw_take`, the engine's side), and checks the stream rules of the C file's
header: which WRITEs C takes, which requests queue the staged bytes first, and
which end the stream, with the reason and the unused credit.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_dataplane import (
    IN_HDR,
    OP_GETATTR,
    OP_READ,
    OP_SETATTR,
    OP_WRITE,
    SO_SNDBUFFORCE,
    Dispatcher,
    _read,
)

from zonefs_py import dataplane
from zonefs_py.dataplane.cwrites import END_REASONS, c_stats

BS = 4096
CHUNK = 4 << 20
INO = 77
WRITE_IN = struct.Struct("<QQIIQII")
GETXATTR_IN = struct.Struct("<II")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FATTR_SIZE, FATTR_MTIME = 1 << 3, 1 << 5
OP_GETXATTR, OP_SETXATTR, OP_FSYNC, OP_FALLOCATE = 22, 21, 20, 43
FUSE_WRITE_CACHE, FUSE_WRITE_KILL_SUIDGID = 1, 4

ext: Any = dataplane._ext()  # noqa: SLF001
pytestmark = pytest.mark.skipif(ext is None, reason="zonefs_py._fuseext is not built")


def _write(unique: int, ino: int, offset: int, data: bytes, flags: int = FUSE_WRITE_CACHE
           ) -> bytes:
    body = WRITE_IN.pack(0, offset, len(data), flags, 0, 0, 0) + data
    return IN_HDR.pack(IN_HDR.size + len(body), OP_WRITE, unique, ino, 0, 0, 0, 0, 0) + body


def _req(opcode: int, unique: int, ino: int, body: bytes = b"") -> bytes:
    return IN_HDR.pack(IN_HDR.size + len(body), opcode, unique, ino, 0, 0, 0, 0, 0) + body


def _setattr(unique: int, ino: int, valid: int, size: int = 0) -> bytes:
    return _req(OP_SETATTR, unique, ino,
                SETATTR_IN.pack(valid, 0, 0, size, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def _getxattr(unique: int, ino: int, name: bytes) -> bytes:
    return _req(OP_GETXATTR, unique, ino, GETXATTR_IN.pack(0, 0) + name + b"\0")


def _blocks(n: int, seed: int) -> bytes:
    return b"".join(bytes([(seed + i) % 251]) * BS for i in range(n))


def _take() -> list[tuple[str, int, int, bytes, int, str]]:
    """What C staged, oldest first: (kind, ino, offset, bytes, credit left, reason)."""
    out = ext.ffi.new("struct zdw_out[]", 64)
    got: list[tuple[str, int, int, bytes, int, str]] = []
    while (n := ext.lib.zdw_take(out, 64)) > 0:
        for i in range(n):
            r = out[i]
            data = b""
            if r.mem != ext.ffi.NULL:
                data = ext.ffi.buffer(r.mem, r.len)[:]
                ext.lib.zdw_free(r.mem)
            kind = "end" if r.kind == 1 else "data"
            reason = END_REASONS[r.reason] if r.kind == 1 else ""
            got.append((kind, int(r.ino), int(r.file_off), data, int(r.credit_left), reason))
    return got


@pytest.fixture
def streams() -> Iterator[tuple[Dispatcher, int]]:
    """The dispatcher on its socket pair (test_dataplane.py) with streams enabled."""
    assert ext.lib.zdp_configure(8, BS) == 0
    d = Dispatcher()
    efd = ext.lib.zdw_enable(1)
    assert efd >= 0
    yield d, efd
    ext.lib.zdw_close()
    _take()
    d.close()
    ext.lib.zdp_revoke_all()


def _staged_reply(d: Dispatcher, unique: int, size: int) -> None:
    u, err, data = d.reply()
    assert (u, err) == (unique, 0)
    assert struct.unpack("<II", data) == (size, 0)


def test_sequential_writes_are_answered_in_c_and_staged_in_order(
        streams: tuple[Dispatcher, int]) -> None:
    d, efd = streams
    assert ext.lib.zdw_arm(INO, 0, 64 * BS) == 0
    assert ext.lib.zdw_armed(INO) == 1
    a, b = _blocks(4, 1), _blocks(2, 9)
    d.send(_write(1, INO, 0, a))
    _staged_reply(d, 1, len(a))
    d.send(_write(2, INO, len(a), b))
    _staged_reply(d, 2, len(b))
    assert _take() == []  # a partial buffer stays in C until something asks for it
    # A GETATTR of the file queues the staged bytes before it is handed on.
    d.send(_req(OP_GETATTR, 3, INO))
    assert d.handed()[:2] == (OP_GETATTR, 3)
    assert select.select([efd], [], [], 0)[0]
    assert _take() == [("data", INO, 0, a + b, 0, "")]
    assert not select.select([efd], [], [], 0)[0]  # cleared once the list is empty
    assert ext.lib.zdw_armed(INO) == 1  # and the stream goes on
    d.send(_write(4, INO, len(a + b), a))
    _staged_reply(d, 4, len(a))
    d.send(_read(5, INO, 0, BS))
    assert d.handed()[:2] == (OP_READ, 5)
    assert _take() == [("data", INO, len(a + b), a, 0, "")]
    stats = c_stats()
    assert stats["writes_c"] >= 3
    assert stats["staged_bytes"] == 0


def test_a_full_buffer_is_queued_at_once(streams: tuple[Dispatcher, int]) -> None:
    d, efd = streams
    d.sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)  # 1 MiB requests
    assert ext.lib.zdw_arm(INO, 0, 2 * CHUNK) == 0
    mib = 1 << 20
    for i in range(5):
        d.send(_write(10 + i, INO, i * mib, bytes([i]) * mib))
        _staged_reply(d, 10 + i, mib)
    assert select.select([efd], [], [], 5)[0]
    got = _take()
    assert [(k, o, len(b)) for k, _i, o, b, _c, _r in got] == [("data", 0, CHUNK)]
    assert got[0][3] == b"".join(bytes([i]) * mib for i in range(4))
    ext.lib.zdw_end(INO)
    got = _take()
    assert [(k, o, len(b), c, r) for k, _i, o, b, c, r in got] == [
        ("data", CHUNK, mib, 0, ""), ("end", 0, 0, 2 * CHUNK - 5 * mib, "python_change")]


@pytest.mark.parametrize("case", ["not_sequential", "unaligned", "no_credit", "flags"])
def test_a_write_c_does_not_take_ends_the_stream_first(
        streams: tuple[Dispatcher, int], case: str) -> None:
    d, _efd = streams
    assert ext.lib.zdw_arm(INO, 8 * BS, 4 * BS) == 0
    d.send(_write(1, INO, 8 * BS, _blocks(1, 3)))
    _staged_reply(d, 1, BS)
    bad = {"not_sequential": _write(2, INO, 20 * BS, _blocks(1, 4)),
           "unaligned": _write(2, INO, 9 * BS, b"x" * 100),
           "no_credit": _write(2, INO, 9 * BS, _blocks(4, 5)),
           "flags": _write(2, INO, 9 * BS, _blocks(1, 4),
                           flags=FUSE_WRITE_CACHE | FUSE_WRITE_KILL_SUIDGID)}[case]
    d.send(bad)
    assert d.handed()[:2] == (OP_WRITE, 2)
    assert ext.lib.zdw_armed(INO) == 0
    assert _take() == [("data", INO, 8 * BS, _blocks(1, 3), 0, ""),
                       ("end", INO, 0, b"", 3 * BS, case)]
    # Later WRITEs of the file go to Python.
    d.send(_write(3, INO, 9 * BS, _blocks(1, 6)))
    assert d.handed()[:2] == (OP_WRITE, 3)


def test_requests_that_change_the_file_end_it_others_keep_it(
        streams: tuple[Dispatcher, int]) -> None:
    d, _efd = streams
    assert ext.lib.zdw_arm(INO, 0, 64 * BS) == 0
    d.send(_write(1, INO, 0, _blocks(1, 1)))
    _staged_reply(d, 1, BS)
    d.send(_setattr(2, INO, FATTR_MTIME))  # the kernel's time update: bytes stay
    assert d.handed()[:2] == (OP_SETATTR, 2)
    assert _take() == [("data", INO, 0, _blocks(1, 1), 0, "")]
    assert ext.lib.zdw_armed(INO) == 1
    d.send(_write(3, INO, BS, _blocks(1, 2)))
    _staged_reply(d, 3, BS)
    d.send(_setattr(4, INO, FATTR_SIZE, size=0))  # truncate
    assert d.handed()[:2] == (OP_SETATTR, 4)
    assert _take() == [("data", INO, BS, _blocks(1, 2), 0, ""),
                       ("end", INO, 0, b"", 62 * BS, "other_request")]
    for op in (OP_FSYNC, OP_FALLOCATE):
        assert ext.lib.zdw_arm(INO, 2 * BS, 8 * BS) == 0
        d.send(_req(op, 5, INO))
        assert d.handed()[:2] == (op, 5)
        assert [r[0] for r in _take()] == ["end"]
    # Another file's requests do not touch it.
    assert ext.lib.zdw_arm(INO, 2 * BS, 8 * BS) == 0
    d.send(_setattr(6, INO + 1, FATTR_SIZE))
    assert d.handed()[:2] == (OP_SETATTR, 6)
    assert ext.lib.zdw_armed(INO) == 1
    assert _take() == []


def test_arm_is_refused_while_a_change_of_the_file_waits_for_pyfuse3(
        streams: tuple[Dispatcher, int]) -> None:
    d, _efd = streams
    d.send(_write(1, INO, 0, _blocks(1, 1)))  # no stream: queued for pyfuse3
    deadline = time.monotonic() + 10
    while ext.lib.zdw_arm(INO, BS, 8 * BS) != -errno.EAGAIN:
        ext.lib.zdw_end(INO)  # the dispatcher had not read the WRITE yet: again
        _take()
        assert time.monotonic() < deadline, "the queued WRITE never blocked an arm"
        time.sleep(0.001)
    assert d.handed()[:2] == (OP_WRITE, 1)  # pyfuse3 takes it: now it may be armed
    assert ext.lib.zdw_arm(INO, BS, 8 * BS) == 0
    assert ext.lib.zdw_arm(INO, BS, 8 * BS) == -errno.EEXIST
    assert ext.lib.zdw_arm(INO + 1, 100, 8 * BS) == -errno.EINVAL


def test_close_ends_every_stream_and_c_takes_no_write_after_it(
        streams: tuple[Dispatcher, int]) -> None:
    d, _efd = streams
    for k in range(3):
        assert ext.lib.zdw_arm(INO + k, 0, 8 * BS) == 0
        d.send(_write(10 + k, INO + k, 0, _blocks(1, k)))
        _staged_reply(d, 10 + k, BS)
    ext.lib.zdw_close()
    got = _take()
    assert sorted((k, i, r) for k, i, _o, _b, _c, r in got) == sorted(
        [("data", INO + k, "") for k in range(3)] + [("end", INO + k, "closed")
                                                      for k in range(3)])
    assert ext.lib.zdw_arm(INO, BS, 8 * BS) == -errno.EPERM
    d.send(_write(20, INO, BS, _blocks(1, 5)))
    assert d.handed()[:2] == (OP_WRITE, 20)


def test_the_capability_probe_is_answered_in_c_until_one_is_set(
        streams: tuple[Dispatcher, int]) -> None:
    d, _efd = streams
    before = c_stats()["caps_probes_c"]
    ext.lib.zfx_set_no_caps(1)
    try:
        d.send(_getxattr(1, INO, b"security.capability"))
        u, err, _data = d.reply()
        assert (u, err) == (1, -errno.ENODATA)
        d.send(_getxattr(2, INO, b"user.x"))
        assert d.handed()[:2] == (OP_GETXATTR, 2)
        assert c_stats()["caps_probes_c"] == before + 1
        ext.lib.zfx_set_no_caps(0)  # Python says a file has one: Python answers
        d.send(_getxattr(3, INO, b"security.capability"))
        assert d.handed()[:2] == (OP_GETXATTR, 3)
        ext.lib.zfx_set_no_caps(1)
        # A SETXATTR of the attribute seen by the dispatcher: never answered here again
        # (Python's flag may be set back only after it handled that SETXATTR).
        d.send(_req(OP_SETXATTR, 4, INO, struct.pack("<II", 20, 0) + b"security.capability\0"
                    + b"v" * 20))
        assert d.handed()[:2] == (OP_SETXATTR, 4)
        d.send(_getxattr(5, INO, b"security.capability"))
        assert d.handed()[:2] == (OP_GETXATTR, 5)
    finally:
        ext.lib.zfx_set_no_caps(0)


def test_nothing_is_taken_for_a_file_without_a_stream(streams: tuple[Dispatcher, int]
                                                       ) -> None:
    d, _efd = streams
    d.send(_write(1, INO, 0, _blocks(1, 1)))
    assert d.handed()[:2] == (OP_WRITE, 1)
    assert _take() == []


def _handed_whole(d: Dispatcher) -> bytes:
    """The next request handed on, all of it (Dispatcher.handed keeps 4 KiB)."""
    out = ext.ffi.new("uint8_t[]", (1 << 20) + 8192)
    seq = ext.ffi.new("uint64_t *")
    while True:
        n = ext.lib.zdp_test_take(out, len(out), seq)
        if n > 0:
            return ext.ffi.buffer(out, n)[:]
        assert n == 0, "the session ended"
        assert select.select([ext.lib.zdp_test_qfd()], [], [], 10)[0], "nothing handed on"


def test_requests_read_into_a_staging_buffer_reach_python_whole(
        streams: tuple[Dispatcher, int]) -> None:
    """While a stream is armed, what follows a request's first 80 bytes is read into
    the stream's staging buffer (zdp_read_one): the stream's WRITEs stay there
    (no copy), and anything handed on gets its bytes back behind its header: another
    file's WRITE, a long GETXATTR name, a WRITE of the file that ends the stream."""
    d, _efd = streams
    d.sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)
    before = c_stats()["writes_c_in_place"]
    assert ext.lib.zdw_arm(INO, 0, 2 * CHUNK) == 0
    mib = 1 << 20
    first = _blocks(256, 1)
    d.send(_write(1, INO, 0, first))
    _staged_reply(d, 1, mib)
    other = _write(2, INO + 1, 0, _blocks(256, 7))
    d.send(other)
    assert _handed_whole(d) == other
    name = _getxattr(3, INO, b"user." + b"n" * 200)
    d.send(name)
    assert _handed_whole(d) == name
    second = _blocks(200, 3)
    d.send(_write(4, INO, mib, second))
    _staged_reply(d, 4, len(second))
    gap = _write(5, INO, 3 * mib, _blocks(256, 5))
    d.send(gap)
    assert _handed_whole(d) == gap
    # (the GETXATTR of the file queued what was staged before it)
    assert _take() == [("data", INO, 0, first, 0, ""), ("data", INO, mib, second, 0, ""),
                       ("end", INO, 0, b"", 2 * CHUNK - mib - len(second), "not_sequential")]
    assert c_stats()["writes_c_in_place"] - before == 2


def test_a_stream_ended_with_an_empty_buffer_gives_it_back(
        streams: tuple[Dispatcher, int]) -> None:
    """A stream is given a staging buffer before its next WRITE arrives (for the read
    to land in); ended before one does, it queues no data, only its end."""
    d, _efd = streams
    assert ext.lib.zdw_arm(INO, 0, 16 * BS) == 0
    d.send(_write(1, INO, 0, _blocks(2, 1)))
    _staged_reply(d, 1, 2 * BS)
    d.send(_req(OP_GETATTR, 2, INO))  # the staged bytes go: the stream's buffer with them
    assert d.handed()[:2] == (OP_GETATTR, 2)
    d.send(_req(OP_GETATTR, 3, INO + 1))  # a read with the stream armed: a new buffer
    assert d.handed()[:2] == (OP_GETATTR, 3)
    assert ext.lib.zdw_end(INO) == 0
    assert _take() == [("data", INO, 0, _blocks(2, 1), 0, ""),
                       ("end", INO, 0, b"", 14 * BS, "python_change")]


def _handed_now() -> bytes | None:
    out = ext.ffi.new("uint8_t[]", 64 << 10)
    seq = ext.ffi.new("uint64_t *")
    n = ext.lib.zdp_test_take(out, len(out), seq)
    return ext.ffi.buffer(out, n)[:] if n > 0 else None


def test_streams_ended_and_freed_by_python_while_requests_land(
        streams: tuple[Dispatcher, int]) -> None:
    """Python ends streams, arms them again and frees what it took on its own thread
    while the dispatcher reads WRITEs into their buffers (the pin of zdw_land_begin,
    an empty buffer orphaned mid-read): every WRITE is answered in C or handed on,
    and the staged and handed bytes together are the file, each block once."""
    d, _efd = streams
    blocks = 3000
    content = {i: _blocks(1, i) for i in range(blocks)}
    got: dict[int, bytes] = {}
    stop = threading.Event()
    handed = 0
    before = c_stats()["writes_c_in_place"]

    def python_side() -> None:
        # the engine's calls, racing the dispatcher (zdw_end empties a stream whose
        # buffer a read may be landing in; zdw_take + zdw_free give buffers back)
        while not stop.is_set():
            ext.lib.zdw_end(INO)
            for kind, _ino, off, data, _c, _r in _take():
                if kind == "data":
                    for k in range(0, len(data), BS):
                        got[(off + k) // BS] = data[k:k + BS]

    t = threading.Thread(target=python_side)
    t.start()
    try:
        for i in range(blocks):
            ext.lib.zdw_arm(INO, i * BS, 64 * BS)  # refused while armed: fine
            d.send(_write(i + 1, INO, i * BS, content[i]))
            while True:
                r, _w, _x = select.select([d.sock, ext.lib.zdp_test_qfd()], [], [], 10)
                assert r, f"WRITE {i} got no answer and was not handed on"
                if d.sock in r:
                    _staged_reply(d, i + 1, BS)
                    break
                req = _handed_now()
                if req is not None:
                    _len, opcode, unique = IN_HDR.unpack_from(req)[:3]
                    assert (opcode, unique) == (OP_WRITE, i + 1)
                    got[i] = req[IN_HDR.size + WRITE_IN.size:]
                    handed += 1
                    break
    finally:
        stop.set()
        t.join()
    ext.lib.zdw_end(INO)
    for kind, _ino, off, data, _c, _r in _take():
        if kind == "data":
            for k in range(0, len(data), BS):
                got[(off + k) // BS] = data[k:k + BS]
    assert got == content
    in_place = c_stats()["writes_c_in_place"] - before
    print(f"{in_place} WRITEs read into a staging buffer, {handed} handed on")
    assert in_place > 0, "no WRITE was read into a staging buffer"
    assert handed > 0, "Python never ended a stream before a WRITE of it"


def test_two_streams_written_in_turn_keep_their_own_bytes(
        streams: tuple[Dispatcher, int]) -> None:
    """Two files' WRITEs in turn (two ranks' shards): each is read into the tail of
    the buffer of the stream that took the last WRITE, the other file's, and
    staged from there into its own; both files come out whole and in order."""
    d, _efd = streams
    a, b = INO, INO + 1
    assert ext.lib.zdw_arm(a, 0, 64 * BS) == 0
    assert ext.lib.zdw_arm(b, 0, 64 * BS) == 0
    want: dict[int, bytes] = {a: b"", b: b""}
    for i in range(12):
        for ino in (a, b):
            data = _blocks(2, 7 * i + ino)
            d.send(_write(100 + 2 * i + (ino - a), ino, len(want[ino]), data))
            _staged_reply(d, 100 + 2 * i + (ino - a), len(data))
            want[ino] += data
    for u, ino in enumerate((a, b)):
        d.send(_req(OP_GETATTR, 200 + u, ino))
        assert d.handed()[:2] == (OP_GETATTR, 200 + u)
    got: dict[int, bytes] = {a: b"", b: b""}
    for kind, ino, off, data, _c, _r in _take():
        assert kind == "data"
        assert off == len(got[ino])
        got[ino] += data
    assert got == want
