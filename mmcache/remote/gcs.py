"""The ``gs://`` engine: google-cloud-storage, a client per process, retried and classified errors.

Google's own library, chosen over obstore and gcsfs (docs/remote.md, "Engines"): it reads the
standard environment itself. The credentials come from Application Default Credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the metadata
server of a GCE/GKE node); no project is needed, as a URL names its bucket. With
``STORAGE_EMULATOR_HOST`` set (an emulator, such as fake-gcs-server) the client talks to that
endpoint without credentials. As for ``s3://``, one client per process and environment is
shared by every store (``stores.process_client``): a forked child makes its own.
"""

from __future__ import annotations

import contextlib
from typing import Any

import google.api_core.exceptions as gexc
import google.auth.exceptions
import requests
import requests.adapters
from google.cloud import storage

from ..errors import RemoteAccessError, RemoteError
from .stores import Location, Transient, process_client, retried

# Objects larger than this go as a resumable upload in parts of PART_BYTES (a multiple of
# 256 KiB, as GCS requires); smaller ones in one request.
PART_BYTES = 16 << 20
# Connections each process keeps: one per thread of a pull, push or filler (requests' default
# pool keeps 10 and drops the rest after each use).
POOL = 32
# Seconds to connect, and to wait for each read from the socket.
TIMEOUT = (10, 60)
# The environment variables the client reads (a change makes another client).
ENVIRONMENT = ("GOOGLE_", "STORAGE_EMULATOR_HOST", "API_ENDPOINT_OVERRIDE", "CLOUDSDK_")


class GCSStore:
    """Objects under ``gs://bucket/prefix``."""

    def __init__(self, where: Location, retry_seconds: float | None) -> None:
        self.where = where
        self.url = where.url
        self.retry_seconds = retry_seconds

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process makes its own client
        return (GCSStore, (self.where, self.retry_seconds))

    def _key(self, key: str) -> str:
        return f"{self.where.prefix}/{key}" if self.where.prefix else key

    def client(self) -> Any:
        """This process's client for the environment as it is now (``process_client``)."""
        return process_client("gs", ENVIRONMENT, self._new_client)

    def bucket(self) -> Any:
        """The bucket, through this process's client (a handle: no request)."""
        return self.client().bucket(self.where.bucket)

    def _new_client(self) -> Any:
        try:
            # project None: none needed (the default looks for one, and fails where the
            # environment names none)
            client = storage.Client(project=None)
        except google.auth.exceptions.DefaultCredentialsError:
            raise RemoteAccessError(
                f"{self.url}: no credentials found (set GOOGLE_APPLICATION_CREDENTIALS, "
                "run gcloud auth application-default login, or use a node's service account)"
            ) from None
        pool = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=POOL)
        for scheme in ("https://", "http://"):
            client._http.mount(scheme, pool)  # its requests session, made here
        return client

    def _call(self, key: str, call: Any) -> Any:
        def once() -> Any:
            try:
                return call(self.bucket())
            except gexc.GoogleAPICallError as e:
                raise self._classified(e, key) from None
            except google.auth.exceptions.RefreshError:
                raise RemoteAccessError(
                    f"{self.url}: access refused (the credentials could not be refreshed): "
                    "check GOOGLE_APPLICATION_CREDENTIALS and the account's permissions"
                ) from None
            except (requests.RequestException, google.auth.exceptions.TransportError) as e:
                raise Transient(type(e).__name__) from None  # refused, cut, timed out

        return retried(once, f"{self.url}/{key}", self.retry_seconds)

    def _classified(self, e: gexc.GoogleAPICallError, key: str) -> Exception:
        status = e.code or ""
        if isinstance(e, gexc.ServerError | gexc.TooManyRequests) or status == 408:
            return Transient(f"{status} from the server")
        if isinstance(e, gexc.Unauthorized | gexc.Forbidden):
            return RemoteAccessError(
                f"{self.url}: access refused ({status}): check the credentials "
                "(GOOGLE_APPLICATION_CREDENTIALS) and the bucket's permissions"
            )
        if isinstance(e, gexc.NotFound):
            return RemoteError(f"{self.url}: no bucket {self.where.bucket!r} at this endpoint")
        return RemoteError(f"{self.url}/{key}: {status} from the server")

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        def read(bucket: Any) -> bytes | None:
            blob = bucket.blob(self._key(key))
            last = None if end is None else end - 1  # inclusive here
            try:
                # no MD5 check of a whole object: the records' CRC-32s check what is read
                data = blob.download_as_bytes(
                    start=start or None, end=last, checksum=None, retry=None, timeout=TIMEOUT
                )
            except gexc.NotFound:
                return None
            except gexc.RequestRangeNotSatisfiable:  # start at or past the end
                return b""
            return bytes(data)

        return self._call(key, read)

    def put(self, key: str, data: bytes | memoryview) -> None:
        def write(bucket: Any) -> None:
            blob = bucket.blob(self._key(key), chunk_size=PART_BYTES)
            blob.upload_from_string(bytes(data), retry=None, timeout=TIMEOUT)

        self._call(key, write)

    def sizes(self) -> dict[str, int]:
        prefix = self._key("")

        def listed(bucket: Any) -> dict[str, int]:
            blobs = bucket.client.list_blobs(
                bucket, prefix=prefix or None, retry=None, timeout=TIMEOUT
            )
            return {b.name[len(prefix) :]: int(b.size) for b in blobs}

        return self._call("", listed)

    def delete(self, keys: list[str]) -> None:
        for key in keys:  # one request each (a push deletes few objects)
            self._call(key, lambda bucket, k=key: self._delete_one(bucket, k))

    def _delete_one(self, bucket: Any, key: str) -> None:
        with contextlib.suppress(gexc.NotFound):  # gone already, as asked
            bucket.blob(self._key(key)).delete(retry=None, timeout=TIMEOUT)
