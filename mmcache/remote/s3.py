"""The ``s3://`` engine: boto3, one client per process, retried and classified errors.

The endpoint, region and credentials come from boto3's standard chain (``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ``~/.aws``, an instance role), so an S3-compatible store (MinIO, Ceph,
SeaweedFS) is reached by setting ``AWS_ENDPOINT_URL``. A client is made in the process that uses
it: one made before ``fork`` shares its sockets with the child, whose requests would then
interleave with the parent's on one connection.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from ..errors import RemoteAccessError, RemoteError
from .stores import Location, Transient, process_client, retried

# Objects larger than this are uploaded in parts of PART_BYTES (S3 takes one PUT up to 5 GiB,
# but a part that fails is retried alone).
MULTIPART_BYTES = 64 << 20
PART_BYTES = 16 << 20
# Connections each process keeps: one per thread of a pull, push or filler.
POOL = 32

# Error codes that say "try again later", and those that say the credentials are refused.
TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
    "ServiceUnavailable", "RequestTimeTooSkewed", "503", "500", "502", "504", "429",
}  # fmt: skip
REFUSED_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "InvalidToken",
    "ExpiredToken", "AuthorizationHeaderMalformed",
}  # fmt: skip


def new_client() -> Any:
    """A boto3 S3 client from the standard chain (one per process: ``process_client``)."""
    config = botocore.config.Config(
        max_pool_connections=POOL,
        connect_timeout=10,
        read_timeout=60,
        retries={"total_max_attempts": 1},  # ``retried`` retries, for longer
    )
    return boto3.session.Session().client("s3", config=config)


class S3Store:
    """Objects under ``s3://bucket/prefix``."""

    def __init__(self, where: Location, retry_seconds: float | None) -> None:
        self.where = where
        self.url = where.url
        self.retry_seconds = retry_seconds

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process makes its own client
        return (S3Store, (self.where, self.retry_seconds))

    def _key(self, key: str) -> str:
        return f"{self.where.prefix}/{key}" if self.where.prefix else key

    def client(self) -> Any:
        """This process's client for the ``AWS_*`` variables as they are now: one per process
        and environment, shared by every store (making one costs tenths of a second of CPU)."""
        return process_client("s3", ("AWS_",), new_client)

    def _call(self, what: str, key: str, **kwargs: Any) -> Any:
        def once() -> Any:
            try:
                return getattr(self.client(), what)(Bucket=self.where.bucket, **kwargs)
            except botocore.exceptions.ClientError as e:
                raise self._classified(e, key) from None
            except (
                botocore.exceptions.NoCredentialsError,
                botocore.exceptions.PartialCredentialsError,
            ):
                raise RemoteAccessError(
                    f"{self.url}: no credentials found (set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or use an instance role)"
                ) from None
            except botocore.exceptions.BotoCoreError as e:  # connection refused, cut, timed out
                raise Transient(type(e).__name__) from None

        return retried(once, f"{self.url}/{key}", self.retry_seconds)

    def _classified(self, e: botocore.exceptions.ClientError, key: str) -> Exception:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in TRANSIENT_CODES or status in TRANSIENT_CODES - {"403"}:
            return Transient(f"{code or status} from the server")
        if code in REFUSED_CODES or status == "403":
            return RemoteAccessError(
                f"{self.url}: access refused ({code or status}): check the credentials "
                "(AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket's permissions"
            )
        if code == "NoSuchBucket":
            return RemoteError(f"{self.url}: no bucket {self.where.bucket!r} at this endpoint")
        return RemoteError(f"{self.url}/{key}: {code or status} from the server")

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        ranged = {"Range": f"bytes={start}-{'' if end is None else end - 1}"}

        def once() -> bytes | None:
            try:
                reply = self.client().get_object(
                    Bucket=self.where.bucket,
                    Key=self._key(key),
                    **(ranged if start or end is not None else {}),
                )
                body = reply["Body"].read()
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise self._classified(e, key) from None
            except botocore.exceptions.BotoCoreError as e:
                raise Transient(type(e).__name__) from None
            return body

        return retried(once, f"{self.url}/{key}", self.retry_seconds)

    def put(self, key: str, data: bytes | memoryview) -> None:
        if len(data) <= MULTIPART_BYTES:
            self._call("put_object", key, Key=self._key(key), Body=bytes(data))
            return
        upload = self._call("create_multipart_upload", key, Key=self._key(key))["UploadId"]
        try:
            parts = []
            for n, start in enumerate(range(0, len(data), PART_BYTES), 1):
                part = bytes(data[start : start + PART_BYTES])
                reply = self._call(
                    "upload_part", key, Key=self._key(key), UploadId=upload, PartNumber=n,
                    Body=part,
                )  # fmt: skip
                parts.append({"PartNumber": n, "ETag": reply["ETag"]})
            self._call(
                "complete_multipart_upload", key, Key=self._key(key), UploadId=upload,
                MultipartUpload={"Parts": parts},
            )  # fmt: skip
        except BaseException:
            # Best effort (a store's lifecycle rules clear what is left); the first failure is
            # the one to report.
            with suppress(Exception):
                self._call("abort_multipart_upload", key, Key=self._key(key), UploadId=upload)
            raise

    def sizes(self) -> dict[str, int]:
        prefix = self._key("")
        found: dict[str, int] = {}
        token: dict[str, str] = {}
        while True:
            page = self._call("list_objects_v2", "", Prefix=prefix, **token)
            for o in page.get("Contents", []):
                found[o["Key"][len(prefix) :]] = int(o["Size"])
            if not page.get("IsTruncated"):
                return found
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):  # S3 deletes at most 1,000 per request
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            self._call("delete_objects", "", Delete={"Objects": batch, "Quiet": True})
