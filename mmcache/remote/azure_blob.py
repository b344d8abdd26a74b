"""The ``az://`` engine: azure-storage-blob, one client per process, retried and classified errors.

Microsoft's own library, chosen over obstore and adlfs (docs/remote.md, "Engines"). The account
and its credentials come from the variables Azure's tools read: ``AZURE_STORAGE_CONNECTION_STRING``
(which names the endpoint too, as Azurite's does), else ``AZURE_STORAGE_ACCOUNT_NAME`` (or
``AZURE_STORAGE_ACCOUNT``) with ``AZURE_STORAGE_ACCOUNT_KEY`` (or ``AZURE_STORAGE_KEY``), or with
``AZURE_STORAGE_SAS_TOKEN``, or alone with azure-identity installed (its DefaultAzureCredential: a
managed identity, ``az login``, a service principal's ``AZURE_CLIENT_*``). As for ``s3://``, one
client per process and environment is shared by every store (``stores.process_client``): a
forked child makes its own.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import requests
import requests.adapters
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import BlobServiceClient

from ..errors import RemoteAccessError, RemoteError
from .stores import Location, Transient, process_client, retried

# Objects larger than this are uploaded as blocks of PART_BYTES (one request takes up to
# 5,000 MiB, but a block that fails is retried alone); a read of up to READ_BYTES is one GET.
MULTIPART_BYTES = 64 << 20
PART_BYTES = 16 << 20
READ_BYTES = 256 << 20
# Connections each process keeps: one per thread of a pull, push or filler.
POOL = 32
# Blob batch requests take at most 256 sub-requests.
BATCH = 256
# HTTP statuses that say "try again later".
TRANSIENT = {408, 429, 500, 502, 503, 504}


class AzureStore:
    """Objects under ``az://container/prefix``."""

    def __init__(self, where: Location, retry_seconds: float | None) -> None:
        self.where = where
        self.url = where.url
        self.retry_seconds = retry_seconds

    def __reduce__(self) -> tuple[Any, ...]:  # a worker process makes its own client
        return (AzureStore, (self.where, self.retry_seconds))

    def _key(self, key: str) -> str:
        return f"{self.where.prefix}/{key}" if self.where.prefix else key

    def client(self) -> BlobServiceClient:
        """This process's client for the environment as it is now (``process_client``)."""
        # (the sizes it is made with are part of what it is made for: a test lowers them)
        made_for = ("az", MULTIPART_BYTES, PART_BYTES, READ_BYTES, POOL)
        return process_client(made_for, ("AZURE_",), self._service)

    def container(self) -> Any:
        """The container, through this process's client (a handle: no request)."""
        return self.client().get_container_client(self.where.bucket)

    def _service(self) -> BlobServiceClient:
        session = requests.Session()
        pool = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=POOL)
        for scheme in ("https://", "http://"):
            session.mount(scheme, pool)
        options: dict[str, Any] = dict(
            session=session,
            retry_total=0,  # ``retried`` retries, for longer
            connection_timeout=10,
            read_timeout=60,
            max_single_put_size=MULTIPART_BYTES,
            max_block_size=PART_BYTES,
            max_single_get_size=READ_BYTES,
        )
        env = os.environ.get
        if connection := env("AZURE_STORAGE_CONNECTION_STRING"):
            try:
                return BlobServiceClient.from_connection_string(connection, **options)
            except ValueError:  # (its text may hold the key: not repeated)
                raise RemoteAccessError(
                    f"{self.url}: $AZURE_STORAGE_CONNECTION_STRING is not a connection string"
                ) from None
        account = env("AZURE_STORAGE_ACCOUNT_NAME") or env("AZURE_STORAGE_ACCOUNT")
        if not account:
            raise RemoteAccessError(
                f"{self.url}: no storage account named (set AZURE_STORAGE_CONNECTION_STRING, "
                "or AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY)"
            )
        credential: Any
        if key := env("AZURE_STORAGE_ACCOUNT_KEY") or env("AZURE_STORAGE_KEY"):
            credential = {"account_name": account, "account_key": key}
        elif sas := env("AZURE_STORAGE_SAS_TOKEN"):
            credential = sas
        else:
            try:
                identity = importlib.import_module("azure.identity")
            except ImportError:
                raise RemoteAccessError(
                    f"{self.url}: no credentials for account {account!r} (set "
                    "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN, or pip install "
                    "azure-identity for a managed identity or az login)"
                ) from None
            credential = identity.DefaultAzureCredential()
        endpoint = f"https://{account}.blob.core.windows.net"
        return BlobServiceClient(endpoint, credential=credential, **options)

    def _call(self, key: str, call: Any) -> Any:
        def once() -> Any:
            try:
                return call(self.container())
            except HttpResponseError as e:
                # (the storage library sets error_code on what it raises: a StorageErrorCode)
                code = getattr(e, "error_code", None)
                code = str(getattr(code, "value", code) or "")
                status = e.status_code
                if status is None and isinstance(e, ClientAuthenticationError):
                    status = 401  # no token to be had (azure-identity), not a cut reply
                raise self._classified(status, code, key) from None
            except (ServiceRequestError, ServiceResponseError) as e:  # refused, cut, timed out
                raise Transient(type(e).__name__) from None

        return retried(once, f"{self.url}/{key}", self.retry_seconds)

    def _classified(self, status: int | None, code: str, key: str) -> Exception:
        # Only the status and the error code: an exception's text holds the request's URL,
        # which holds a SAS token where one is used.
        what = code or str(status)
        if status is None or status in TRANSIENT:  # no status: the reply was cut short
            return Transient(f"{what} from the server")
        if status in (401, 403):
            return RemoteAccessError(
                f"{self.url}: access refused ({what}): check the credentials "
                "(AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_KEY) and the "
                "container's permissions"
            )
        if code == "ContainerNotFound":
            return RemoteError(f"{self.url}: no container {self.where.bucket!r} in this account")
        return RemoteError(f"{self.url}/{key}: {what} from the server")

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        def read(container: Any) -> bytes | None:
            ranged: dict[str, int | None] = {}
            if start or end is not None:
                ranged = {"offset": start, "length": None if end is None else end - start}
            try:
                return bytes(container.download_blob(self._key(key), **ranged).readall())
            except ResourceNotFoundError as e:
                if getattr(e, "error_code", None) == "ContainerNotFound":
                    raise
                return None

        return self._call(key, read)

    def put(self, key: str, data: bytes | memoryview) -> None:
        def write(container: Any) -> None:
            container.upload_blob(self._key(key), bytes(data), overwrite=True, max_concurrency=1)

        self._call(key, write)

    def sizes(self) -> dict[str, int]:
        prefix = self._key("")

        def listed(container: Any) -> dict[str, int]:
            blobs = container.list_blobs(name_starts_with=prefix or None)
            return {b.name[len(prefix) :]: int(b.size) for b in blobs}

        return self._call("", listed)

    def delete(self, keys: list[str]) -> None:
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            self._call(batch[0], lambda container, b=batch: self._delete_batch(container, b))

    def _delete_batch(self, container: Any, keys: list[str]) -> None:
        replies = container.delete_blobs(*map(self._key, keys), raise_on_any_failure=False)
        for key, reply in zip(keys, replies):
            if reply.status_code not in (202, 404):  # 404: gone already, as asked
                code = reply.headers.get("x-ms-error-code", "")
                raise self._classified(reply.status_code, code, key)
