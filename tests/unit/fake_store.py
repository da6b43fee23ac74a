"""An in-memory `ObjectStore` that fails, stalls and corrupts on command (drain unit tests).

It follows S3's rules where the drainer depends on them (ETag = MD5, or
MD5-of-MD5s-dash-N for multipart; parts only become an object at completion;
aborted uploads vanish), and records every call, so tests can count
attempts (no retry storm) and see what was sent.
"""

from __future__ import annotations

import hashlib
import threading

from zonefs_py.drain.store import ObjectInfo, StoreError, multipart_etag


class FakeStore:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], tuple[bytes, str, dict[str, str]]] = {}
        self.uploads: dict[str, tuple[str, str, dict[str, str], dict[int, bytes]]] = {}
        self.calls: list[str] = []
        self._fail: list[tuple[str, str]] = []  # (call name or "*", kind)
        self.fail_always: str | None = None  # a kind every call fails with
        self.stall = threading.Event()
        self.stall.set()  # set = not stalled
        self.stalled_calls = 0
        self.stall_only: str | None = None
        #: When set, upload_part calls past this many fail (transient), as a store that
        #: goes away mid-upload: the parts before stay stored.
        self.parts_budget: int | None = None
        self._lock = threading.Lock()
        self._next_id = 0

    # -- commands -----------------------------------------------------------------
    def fail_next(self, kind: str, n: int = 1, call: str = "*") -> None:
        self._fail += [(call, kind)] * n

    def hold(self, call: str | None = None) -> None:
        """Calls (all, or those named `call`) block until `release()` (a slow store)."""
        self.stall_only = call
        self.stall.clear()

    def release(self) -> None:
        self.stall.set()

    def corrupt(self, bucket: str, key: str, at: int = 0) -> None:
        data, etag, meta = self.objects[(bucket, key)]
        b = bytearray(data)
        b[at] ^= 0xFF
        self.objects[(bucket, key)] = (bytes(b), etag, meta)

    def count(self, name: str) -> int:
        return sum(1 for c in self.calls if c == name)

    # -- the contract ----------------------------------------------------------------
    def _enter(self, name: str) -> None:
        with self._lock:
            self.calls.append(name)
        if not self.stall.is_set() and self.stall_only in (None, name):
            with self._lock:
                self.stalled_calls += 1
            self.stall.wait(30)
        if self.fail_always:
            raise StoreError(self.fail_always, f"{name}: injected {self.fail_always}")
        with self._lock:
            for i, (call, kind) in enumerate(self._fail):
                if call in ("*", name):
                    del self._fail[i]
                    raise StoreError(kind, f"{name}: injected {kind}")

    def put(self, bucket: str, key: str, data: bytes, metadata: dict[str, str],
            md5: bytes) -> str:
        self._enter("put")
        assert md5 == hashlib.md5(data).digest(), "Content-MD5 of other bytes"
        etag = hashlib.md5(data).hexdigest()
        self.objects[(bucket, key)] = (bytes(data), etag, dict(metadata))
        return etag

    def create_multipart(self, bucket: str, key: str, metadata: dict[str, str]) -> str:
        self._enter("create_multipart")
        with self._lock:
            self._next_id += 1
            uid = f"upload-{self._next_id}"
        self.uploads[uid] = (bucket, key, dict(metadata), {})
        return uid

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int,
                    data: bytes, md5: bytes) -> str:
        self._enter("upload_part")
        assert md5 == hashlib.md5(data).digest(), "Content-MD5 of other bytes"
        with self._lock:
            if self.parts_budget is not None:
                if self.parts_budget <= 0:
                    raise StoreError("transient", "upload_part: the store went away")
                self.parts_budget -= 1
        if upload_id not in self.uploads:
            raise StoreError("missing", "NoSuchUpload")
        self.uploads[upload_id][3][number] = bytes(data)
        return hashlib.md5(data).hexdigest()

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           etags: list[str]) -> str:
        self._enter("complete_multipart")
        b, k, meta, parts = self.uploads.pop(upload_id)
        assert (b, k) == (bucket, key)
        assert sorted(parts) == list(range(1, len(etags) + 1))
        data = b"".join(parts[i] for i in sorted(parts))
        etag = multipart_etag([hashlib.md5(parts[i]).digest() for i in sorted(parts)])
        self.objects[(bucket, key)] = (data, etag, meta)
        return etag

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._enter("abort_multipart")
        if self.uploads.pop(upload_id, None) is None:
            raise StoreError("missing", "NoSuchUpload")

    def list_parts(self, bucket: str, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        self._enter("list_parts")
        if upload_id not in self.uploads:
            raise StoreError("missing", "NoSuchUpload")
        parts = self.uploads[upload_id][3]
        return {n: (hashlib.md5(d).hexdigest(), len(d)) for n, d in sorted(parts.items())}

    def copy(self, src_bucket: str, src_key: str, bucket: str, key: str, size: int) -> str:
        self._enter("copy")
        try:
            data, _etag, meta = self.objects[(src_bucket, src_key)]
        except KeyError:
            raise StoreError("missing", f"no {src_bucket}/{src_key}") from None
        assert len(data) == size
        etag = hashlib.md5(data).hexdigest()  # a copy is a new, single-part object
        self.objects[(bucket, key)] = (data, etag, dict(meta))
        return etag

    def delete(self, bucket: str, key: str) -> None:
        self._enter("delete")
        self.objects.pop((bucket, key), None)

    def head(self, bucket: str, key: str) -> ObjectInfo:
        self._enter("head")
        try:
            data, etag, meta = self.objects[(bucket, key)]
        except KeyError:
            raise StoreError("missing", f"no {bucket}/{key}") from None
        return ObjectInfo(len(data), etag, dict(meta))

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        self._enter("get_range")
        try:
            data = self.objects[(bucket, key)][0]
        except KeyError:
            raise StoreError("missing", f"no {bucket}/{key}") from None
        return data[start:end]
