"""What an object store is: the ``Store`` protocol, the table of URL schemes, and retrying.

A store holds objects under one prefix of a bucket (or of a local folder, for ``file://``).
Keys given to a store are relative to that prefix and are plain names (no ``/`` but within a
data file's chunk names, see ``mmcache.remote.published``): a store never reaches outside its
prefix. Each engine is one module with one class, registered here under its URL schemes.
"""

from __future__ import annotations

import importlib
import os
import random
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from ..errors import CacheError, RemoteError

T = TypeVar("T")

# How long a store keeps retrying a request that fails for a reason that may pass (the server
# down or restarting, throttling, a connection cut): a restart of an S3 gateway takes seconds,
# a rolling upgrade of a cluster a minute or so.
RETRY_SECONDS = 120.0
# Sets it for the stores a process opens without being given a time: those of a dataset opened
# by URL and of its DataLoader workers' fills.
RETRY_ENV = "MMCACHE_RETRY_SECONDS"


class Transient(Exception):
    """A failure worth retrying (the engines raise it; ``retried`` retries it)."""


class Store(Protocol):
    """Objects under one prefix. ``url`` names the prefix in messages (never a credential).

    Every method retries transient failures for ``retry_seconds`` (``retried``) and raises
    ``RemoteError`` (or ``RemoteAccessError``: refused credentials) when they do not pass.
    """

    url: str
    retry_seconds: float | None  # None: as ``retry_time`` says at each request

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes ``start`` to ``end`` (exclusive; None: to the end) of object ``key``; None if
        there is no such object. Fewer bytes than asked: the object is shorter (a connection
        cut short is retried, never returned short)."""
        ...

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write object ``key`` whole (one request, or a multipart upload of a large one)."""
        ...

    def sizes(self) -> dict[str, int]:
        """Every object under the prefix, by key, with its size."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Delete these objects (those missing are no error)."""
        ...


@dataclass(frozen=True)
class Location:
    """A URL taken apart: ``scheme://bucket/prefix``; ``prefix`` without leading or trailing
    ``/`` (``""``: the bucket's top). For ``file://``, ``bucket`` is empty and ``prefix`` the
    folder's absolute path."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        if self.scheme == "file":
            return f"file://{self.prefix}"
        return f"{self.scheme}://{self.bucket}/{self.prefix}".rstrip("/")


# Each scheme's engine: (module, class), imported when first used, so that the core never
# imports an optional library; and the extra that installs it, for the message without it.
ENGINES: dict[str, tuple[str, str, str]] = {
    "s3": ("mmcache.remote.s3", "S3Store", "remote"),
    "gs": ("mmcache.remote.gcs", "GCSStore", "gcs"),
    "az": ("mmcache.remote.azure_blob", "AzureStore", "azure"),
    "file": ("mmcache.remote.local", "LocalStore", ""),
}


def is_remote(url: object) -> bool:
    """Whether ``url`` is a string naming an object store (``s3://``, ``gs://``, ``az://``,
    ``file://``)."""
    return isinstance(url, str) and urlsplit(url).scheme in ENGINES and "://" in url


def locate(url: str) -> Location:
    """``url`` taken apart and checked.

    Raises:
        RemoteError: an unknown scheme, no bucket, or credentials written into the URL.
    """
    parts = urlsplit(url)
    if parts.scheme not in ENGINES:
        raise RemoteError(
            f"{url}: not an object store URL (known: {', '.join(f'{s}://' for s in ENGINES)})"
        )
    if parts.username or parts.password:
        # (the message must not repeat the URL: it holds a secret)
        raise RemoteError(
            f"{parts.scheme}://{parts.hostname}/...: credentials in a URL are refused; use "
            "the environment (AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, "
            "AZURE_STORAGE_CONNECTION_STRING, a profile, an instance role)"
        )
    if parts.query or parts.fragment:
        raise RemoteError(f"{url}: a store URL takes no ?query or #fragment")
    path = parts.path.strip("/")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RemoteError(f"{url}: a file:// URL names a local folder (file:///path)")
        return Location("file", "", "/" + path)
    if not parts.netloc:
        raise RemoteError(f"{url}: no bucket (expected {parts.scheme}://bucket/prefix)")
    if any(p in (".", "..") for p in path.split("/")):
        raise RemoteError(f"{url}: a prefix with '.' or '..' parts is refused")
    return Location(parts.scheme, parts.netloc, path)


def open_store(url: str, retry_seconds: float | None = None) -> Store:
    """The store for ``url``, through the engine its scheme names; ``retry_seconds`` None:
    ``$MMCACHE_RETRY_SECONDS`` as it is at each request, else ``RETRY_SECONDS``.

    Raises:
        RemoteError: as ``locate``, or the engine's library is not installed, or the
            variable is not a number of seconds.
    """
    where = locate(url)
    retry_time(retry_seconds)  # (a bad variable is refused here, before any request)
    module, name, extra = ENGINES[where.scheme]
    try:
        engine = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise RemoteError(
            f"{where.url}: needs {e.name}, not installed here: pip install 'mmcache[{extra}]'"
        ) from None
    return engine(where, retry_seconds)


# Each engine's clients, by what they are made for, process and environment (``process_client``).
_CLIENTS: dict[tuple[Hashable, int, tuple[tuple[str, str], ...]], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def process_client(made_for: Hashable, variables: tuple[str, ...], make: Callable[[], T]) -> T:
    """The client that ``make()`` made in this process for ``made_for`` (an engine's name, and
    the settings it makes a client with), with the environment variables whose names start with
    one of ``variables`` as they are now.

    Made on first use in each process: a forked child makes its own (a client's pooled sockets
    must not be shared by two processes). Then shared by every store and thread of the process
    (a sparse copy's fill, its read-ahead and its publication each open a store): one pool of
    connections kept open, and one client made (0.2-0.3 ms of CPU for the GCS and Azure ones).
    """
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(variables)))
    key = (made_for, os.getpid(), env)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = make()
        return _CLIENTS[key]


def retry_time(seconds: float | None) -> float:
    """``seconds``, or for None ``$MMCACHE_RETRY_SECONDS`` now, else ``RETRY_SECONDS``.

    Raises:
        RemoteError: the variable is not a number of seconds.
    """
    if seconds is not None:
        return seconds
    try:
        return float(os.environ.get(RETRY_ENV) or RETRY_SECONDS)
    except ValueError:
        value = os.environ[RETRY_ENV]
        raise RemoteError(f"${RETRY_ENV}={value!r}: not a number of seconds") from None


def retried(call: Callable[[], T], what: str, seconds: float | None) -> T:
    """``call()``, again after each ``Transient`` failure, waiting longer each time (0.1 s
    doubling to 5 s, jittered), for at most ``seconds`` (None: ``retry_time``); then
    ``RemoteError`` naming ``what`` and the last failure."""
    seconds = retry_time(seconds)
    deadline = time.monotonic() + seconds
    wait = 0.1
    while True:
        try:
            return call()
        except Transient as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(
                    f"{what}: failed for {seconds:.0f} s, still failing ({e}); giving up"
                ) from None
            time.sleep(min(wait * random.uniform(0.5, 1.0), left))
            wait = min(wait * 2, 5.0)
        except CacheError:
            raise
