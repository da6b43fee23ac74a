"""Object stores the drainer talks to: the `ObjectStore` contract and `S3Store` (boto3).

Every method blocks (network I/O): the engine calls them only through
`trio.to_thread.run_sync`, never on the trio thread. Errors are `StoreError`
with a kind the drainer acts on: `transient` (store down, slow, 5xx:
retry with backoff), `auth` (wrong or missing credentials, access denied:
stop retrying, one log line, shown in stat), `missing` (no such object), or
`fatal` (anything else: the file is retried after a long pause).

Credentials, region and endpoint come from boto3's standard resolution
(environment variables, `~/.aws/credentials` and `~/.aws/config`, profiles,
instance roles); the mount options `drain_endpoint=`, `drain_region=`,
`drain_profile=` and `drain_credentials=` (a shared-credentials file) only
feed that resolution. boto3's own retries are off (one attempt per call):
the drainer's backoff is the only retry loop, so a dead store sees one
request per backoff step, not a storm.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

#: Object metadata keys (S3 user metadata: sent as x-amz-meta-*).
META_XXH3 = "zonefs-xxh3"
META_SIZE = "zonefs-size"


class StoreError(Exception):
    """A failed store call. `kind` is one of transient, auth, missing, fatal."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a HEAD of an object returns: its size, ETag and user metadata."""

    size: int
    etag: str
    metadata: dict[str, str]


def parse_url(url: str) -> tuple[str, str]:
    """Split s3://bucket/prefix into (bucket, prefix without slashes at the ends).

    Raises ValueError with a one-line message for anything else.
    """
    parts = urlsplit(url.strip())
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(f"drain target must look like s3://bucket/prefix, not {url!r}")
    bucket = parts.netloc
    if not 3 <= len(bucket) <= 63 or not all(c.isalnum() or c in "-." for c in bucket):
        raise ValueError(f"invalid bucket name {bucket!r}")
    return bucket, parts.path.strip("/")


def join_url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def b64(digest: bytes) -> str:
    """Content-MD5 header value of an MD5 digest (the caller computed it once)."""
    return base64.b64encode(digest).decode()


def multipart_etag(part_md5s: list[bytes]) -> str:
    """The ETag S3 gives a multipart object: md5 of the parts' md5s, dash, part count."""
    return f"{hashlib.md5(b''.join(part_md5s)).hexdigest()}-{len(part_md5s)}"


class ObjectStore(Protocol):
    """The object-store calls the drain makes (S3Store implements them; tests use a fake). Every
    call may block and runs in a worker thread.
    """

    def put(self, bucket: str, key: str, data: bytes, metadata: dict[str, str],
            md5: bytes) -> str: ...

    def create_multipart(self, bucket: str, key: str, metadata: dict[str, str]) -> str: ...

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int,
                    data: bytes, md5: bytes) -> str: ...

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           etags: list[str]) -> str: ...

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None: ...

    def list_parts(self, bucket: str, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        """Part number -> (ETag, size) of the parts an upload holds (`missing` if the
        upload is gone: aborted, completed or expired)."""
        ...

    def copy(self, src_bucket: str, src_key: str, bucket: str, key: str, size: int) -> str:
        """Server-side copy of an object of `size` bytes, metadata included; its ETag."""
        ...

    def delete(self, bucket: str, key: str) -> None:
        """Delete an object (no error if it is not there)."""
        ...

    def head(self, bucket: str, key: str) -> ObjectInfo: ...

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes: ...


_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
    "InvalidToken", "AuthorizationHeaderMalformed", "403", "401", "AllAccessDisabled",
})
#: S3 refuses a CopyObject of more than 5 GiB: larger objects copy in parts.
COPY_MAX_BYTES = 5 << 30
COPY_PART_BYTES = 1 << 30
#: ListParts pages (1000 parts each): S3 allows at most 10,000 parts per upload.
MAX_LIST_PAGES = 10

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound", "NoSuchBucket", "NoSuchUpload"})


@dataclass(slots=True)
class S3Settings:
    """Where and as whom to connect; empty fields are left to boto3's resolution."""

    endpoint: str = ""
    region: str = ""
    profile: str = ""
    credentials_file: str = ""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0


class S3Store:
    """`ObjectStore` over boto3 (one client, shared by the worker threads: boto3
    clients are thread-safe; sessions are not, so the client is built once)."""

    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._client: Any = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client()
            return self._client

    def _make_client(self) -> Any:
        try:
            import boto3
            import botocore.session
            from botocore.config import Config
        except ImportError:
            raise StoreError("fatal", "boto3 is not installed: pip install "
                                      "'zonefs-py[s3]' to drain to an object store") from None
        s = self.settings
        core = botocore.session.Session(profile=s.profile or None)
        if s.credentials_file:
            core.set_config_variable("credentials_file", s.credentials_file)
        session = boto3.session.Session(botocore_session=core)
        config = Config(retries={"max_attempts": 1, "mode": "standard"},
                        connect_timeout=s.connect_timeout_s, read_timeout=s.read_timeout_s,
                        s3={"addressing_style": "path"} if s.endpoint else {},
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required")
        return session.client("s3", endpoint_url=s.endpoint or None,
                              region_name=s.region or None, config=config)

    def _call(self, what: str, fn: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client(), fn)(**kwargs)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below, never swallowed
            raise _classify(what, exc) from exc

    def put(self, bucket: str, key: str, data: bytes, metadata: dict[str, str],
            md5: bytes) -> str:
        r = self._call(f"PUT s3://{bucket}/{key}", "put_object", Bucket=bucket, Key=key,
                       Body=data, Metadata=metadata, ContentMD5=b64(md5))
        return str(r["ETag"]).strip('"')

    def create_multipart(self, bucket: str, key: str, metadata: dict[str, str]) -> str:
        r = self._call(f"create upload s3://{bucket}/{key}", "create_multipart_upload",
                       Bucket=bucket, Key=key, Metadata=metadata)
        return str(r["UploadId"])

    def upload_part(self, bucket: str, key: str, upload_id: str, number: int,
                    data: bytes, md5: bytes) -> str:
        """Send one part; its ETag (the caller compares it with `md5`).

        No Content-MD5 header: the ETag of a part is the MD5 the store computed
        of what it received, and the drainer checks it against `md5` before it
        completes the upload (a damaged part is sent again, never completed).
        The header made SeaweedFS verify each part before storing it: 0.75 ->
        0.96 of boto3's throughput in one A/B on a loaded machine (DESIGN 6.5).
        """
        r = self._call(f"part {number} of s3://{bucket}/{key}", "upload_part", Bucket=bucket,
                       Key=key, UploadId=upload_id, PartNumber=number, Body=data)
        return str(r["ETag"]).strip('"')

    def complete_multipart(self, bucket: str, key: str, upload_id: str,
                           etags: list[str]) -> str:
        parts = [{"ETag": f'"{e}"', "PartNumber": i + 1} for i, e in enumerate(etags)]
        r = self._call(f"complete s3://{bucket}/{key}", "complete_multipart_upload",
                       Bucket=bucket, Key=key, UploadId=upload_id,
                       MultipartUpload={"Parts": parts})
        return str(r["ETag"]).strip('"')

    def abort_multipart(self, bucket: str, key: str, upload_id: str) -> None:
        self._call(f"abort upload of s3://{bucket}/{key}", "abort_multipart_upload",
                   Bucket=bucket, Key=key, UploadId=upload_id)

    def list_parts(self, bucket: str, key: str, upload_id: str) -> dict[int, tuple[str, int]]:
        parts: dict[int, tuple[str, int]] = {}
        marker = 0
        for _ in range(MAX_LIST_PAGES):  # bounded: at most 10,000 parts
            r = self._call(f"list parts of s3://{bucket}/{key}", "list_parts", Bucket=bucket,
                           Key=key, UploadId=upload_id, PartNumberMarker=marker)
            for p in r.get("Parts") or []:
                parts[int(p["PartNumber"])] = (str(p["ETag"]).strip('"'), int(p["Size"]))
            if not r.get("IsTruncated"):
                break
            marker = int(r.get("NextPartNumberMarker") or 0)
        return parts

    def copy(self, src_bucket: str, src_key: str, bucket: str, key: str, size: int) -> str:
        what = f"copy s3://{src_bucket}/{src_key} to s3://{bucket}/{key}"
        source = {"Bucket": src_bucket, "Key": src_key}
        if size <= COPY_MAX_BYTES:
            r = self._call(what, "copy_object", Bucket=bucket, Key=key, CopySource=source,
                           MetadataDirective="COPY")
            return str(r["CopyObjectResult"]["ETag"]).strip('"')
        # Larger: a multipart upload whose parts are ranges of the source (UploadPartCopy).
        meta = self.head(src_bucket, src_key).metadata
        upload_id = self.create_multipart(bucket, key, meta)
        try:
            etags = []
            for n, start in enumerate(range(0, size, COPY_PART_BYTES), 1):
                end = min(size, start + COPY_PART_BYTES) - 1
                r = self._call(f"{what} (part {n})", "upload_part_copy", Bucket=bucket,
                               Key=key, UploadId=upload_id, PartNumber=n, CopySource=source,
                               CopySourceRange=f"bytes={start}-{end}")
                etags.append(str(r["CopyPartResult"]["ETag"]).strip('"'))
            return self.complete_multipart(bucket, key, upload_id, etags)
        except BaseException:
            try:
                self.abort_multipart(bucket, key, upload_id)
            except StoreError:
                pass
            raise

    def delete(self, bucket: str, key: str) -> None:
        self._call(f"DELETE s3://{bucket}/{key}", "delete_object", Bucket=bucket, Key=key)

    def head(self, bucket: str, key: str) -> ObjectInfo:
        r = self._call(f"HEAD s3://{bucket}/{key}", "head_object", Bucket=bucket, Key=key)
        return ObjectInfo(int(r["ContentLength"]), str(r["ETag"]).strip('"'),
                          dict(r.get("Metadata") or {}))

    def get_range(self, bucket: str, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        r = self._call(f"GET s3://{bucket}/{key}", "get_object", Bucket=bucket, Key=key,
                       Range=f"bytes={start}-{end - 1}")
        try:
            data = r["Body"].read()
        except Exception as exc:  # noqa: BLE001 - a connection cut mid-body
            raise _classify(f"GET s3://{bucket}/{key}", exc) from exc
        if len(data) != end - start:
            raise StoreError("transient", f"GET s3://{bucket}/{key} bytes {start}-{end}: "
                                          f"{len(data)} bytes came back")
        return bytes(data)


def _classify(what: str, exc: Exception) -> StoreError:
    """Map a boto3/botocore exception to a StoreError kind (see the module docstring)."""
    try:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            PartialCredentialsError,
        )
    except ImportError:  # pragma: no cover - boto3 missing is reported earlier
        return StoreError("fatal", f"{what}: {exc}")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return StoreError("auth", f"{what}: no usable credentials ({exc})")
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        msg = f"{what}: {code or status} {err.get('Message', '')}".strip()
        if code in _AUTH_CODES or status in (401, 403):
            return StoreError("auth", msg)
        if code in _MISSING_CODES or status == 404:
            return StoreError("missing", msg)
        if status >= 500 or status in (408, 429) or code in ("SlowDown", "RequestTimeout",
                                                             "InternalError", "BadDigest"):
            return StoreError("transient", msg)
        return StoreError("fatal", msg)
    if isinstance(exc, BotoCoreError | OSError):
        return StoreError("transient", f"{what}: {exc}")
    return StoreError("fatal", f"{what}: {type(exc).__name__}: {exc}")


def object_key(prefix: str, rel_path: str) -> str:
    """The key of a file `rel_path` (relative to the policy directory) under `prefix`."""
    key = rel_path.strip("/")
    return f"{prefix}/{key}" if prefix else key

