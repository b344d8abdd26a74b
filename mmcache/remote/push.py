"""Publishing a built cache under an object-store prefix, uploading only what changed."""

from __future__ import annotations

import functools
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import format as fmt
from .._opening import open_for_reading, read_whole
from ..errors import CacheError, CacheFormatError, CacheNotFoundError
from ..reports import ProgressFn, PushReport
from .published import (
    CHUNK_BYTES,
    OWN_KEY,
    REMOTE_NAME,
    Published,
    chunk_key,
    description,
    file_size,
    manifest_object,
    read_published,
)
from .stores import RETRY_SECONDS, open_store

__all__ = ["push_cache"]

# Uploads in flight: each holds one chunk in memory (8 x 64 MiB).
CONCURRENCY = 8


def push_cache(
    cache: str | os.PathLike,
    url: str,
    progress: ProgressFn | None = None,
    *,
    concurrency: int = CONCURRENCY,
    chunk_bytes: int = CHUNK_BYTES,
    retry_seconds: float = RETRY_SECONDS,
) -> PushReport:
    """Publish the cache ``cache`` under ``url`` (``s3://bucket/prefix``, ``file:///folder``).

    Every file is read and its CRC-32 computed; an object the prefix already holds with the same
    key and CRC-32 is not uploaded again, so pushing an unchanged cache uploads nothing and a
    push after a refresh that appended records uploads the new records' chunks (and the small
    files). ``remote.json`` is written last: a reader sees the previous publication or this
    one, never half of one. Objects that neither this publication nor the previous one names
    are deleted afterwards (a reader that opened the previous one can finish).

    Args:
        cache: a cache folder whose every record is filled (a built cache).
        url: the prefix to publish under.
        progress: called as ``progress(done, total)`` in bytes read.
        concurrency: uploads in flight.
        chunk_bytes: the size of the data file's objects (see ``mmcache.remote.published``).
        retry_seconds: how long a failing request is retried before the push gives up.

    Examples:
        >>> push_cache("/data/cache/train", "s3://bucket/imagenet/train")  # doctest: +SKIP

    Raises:
        CacheNotFoundError, CacheFormatError: ``cache`` is no cache, or is damaged.
        CacheError: the cache has records not filled yet (a lazy cache).
        RemoteError, RemoteAccessError: the store failed or refused, for longer than the
            retries allow; what was published before stays published.
    """
    start = time.perf_counter()
    store = open_store(url, retry_seconds)
    folder = fmt.cache_folder(cache)
    fmt.read_manifest(folder)  # (a missing or damaged cache is named as a reader names it)
    # The manifest exactly as published locally: read once, checked, and then sent as it is.
    mpath = folder / fmt.MANIFEST_NAME
    manifest = manifest_object(read_whole(mpath, fmt.MAX_MANIFEST_BYTES + 1), mpath)
    m = fmt.manifest_from_json(manifest, folder, mpath)
    fds = {kind: open_for_reading(m.file(kind)) for kind in m.written_kinds}
    try:
        files = fmt.read_cache_files(m)  # the state as it is now: a snapshot of its bytes
        empty = int((files.state["state"] == fmt.EMPTY).sum())
        if empty:
            raise CacheError(
                f"{m.path}: {empty:,} records are not filled yet (a lazy cache): build it "
                "(`mmcache build`, without --lazy) before pushing it"
            )
        try:
            previous = read_published(store, m.path)
        except (CacheNotFoundError, CacheFormatError):
            previous = None  # nothing there, or a damaged publication this one replaces
        old = _crcs(previous)
        uploads = _Uploads(store, old, progress, sum(m.sizes.values()))
        objects, chunks = _upload(files, fds, uploads, concurrency, chunk_bytes, previous)
        store.put(REMOTE_NAME, description(manifest, objects, chunk_bytes, chunks))
        keep = {REMOTE_NAME, *objects_keys(objects, chunks), *old}
        stale = [k for k in store.sizes() if OWN_KEY.fullmatch(k) and k not in keep]
        store.delete(stale)
    finally:
        for fd in fds.values():
            os.close(fd)
    return PushReport(
        cache=m.path,
        url=store.url,
        images=m.count,
        bytes=sum(m.sizes.values()),
        uploaded=uploads.bytes,
        objects_uploaded=uploads.objects,
        objects_kept=len(chunks) + len(objects) - uploads.objects,
        objects_deleted=len(stale),
        seconds=time.perf_counter() - start,
    )


def _upload(
    files: fmt.CacheFiles,
    fds: dict[str, int],
    uploads: _Uploads,
    concurrency: int,
    chunk_bytes: int,
    previous: Published | None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Send every file (the data file in chunks) the store lacks; their descriptions."""
    m = files.manifest
    blobs = {"state": files.state.tobytes()}  # as read: a snapshot of a lazy cache's states
    objects: dict[str, dict[str, Any]] = {}
    chunks: list[dict[str, Any]] = []
    data = m.file("data").name
    with ThreadPoolExecutor(concurrency) as pool:
        for kind in m.written_kinds:
            if kind != "data":
                size = file_size(m, kind)
                blob = blobs.get(kind) or os.pread(fds[kind], size, 0)
                if len(blob) != size:
                    raise CacheFormatError(f"{m.file(kind)}: changed while it was pushed")
                objects[kind] = {"key": m.file(kind).name, "size": len(blob)}
                pool.submit(uploads.send, objects[kind], lambda b=blob: b)
        for at, n in _cuts(m, previous, chunk_bytes):
            chunks.append({"start": at, "size": n})
            read = functools.partial(_pread, fds["data"], n, at)
            pool.submit(uploads.send, chunks[-1], read, functools.partial(chunk_key, data, at, n))
    uploads.raise_first()
    return objects, chunks


def _cuts(
    m: fmt.Manifest, previous: Published | None, chunk_bytes: int
) -> list[tuple[int, int]]:
    """Where the data file is cut into chunks: as the previous publication of the same data
    file cut it, as far as it went (a refresh appended to it since), then every
    ``chunk_bytes``."""
    cuts, at, size = [], 0, m.sizes["data"]
    if previous is not None and previous.manifest.file("data").name == m.file("data").name:
        for _, start, n, _ in previous.chunks:
            if start + n > size:
                break
            cuts.append((start, n))
            at = start + n
    cuts += [(a, min(chunk_bytes, size - a)) for a in range(at, size, chunk_bytes)]
    return cuts


def objects_keys(objects: dict[str, dict[str, Any]], chunks: list[dict[str, Any]]) -> set[str]:
    return {o["key"] for o in objects.values()} | {c["key"] for c in chunks}


def _crcs(previous: Published | None) -> dict[str, int]:
    """The CRC-32 of each object the previous publication names, by key."""
    if previous is None:
        return {}
    found = {o["key"]: o["crc32"] for o in previous.objects.values()}
    found.update({key: crc for key, _, _, crc in previous.chunks})
    return found


def _pread(fd: int, n: int, at: int) -> bytes:
    data = os.pread(fd, n, at)
    if len(data) != n:
        raise CacheFormatError(f"the data file ends before byte {at + n}: it was cut short")
    return data


class _Uploads:
    """Uploads run by a pool's threads: each reads its bytes, sums them, names the object (a
    chunk's key holds its CRC-32) and sends it unless the store has it already with that CRC;
    the first failure is kept for the caller to raise."""

    def __init__(self, store: Any, old: dict[str, int], progress: Any, total: int) -> None:
        self.store, self.old, self.progress, self.total = store, old, progress, total
        self.bytes = self.objects = self.done = 0
        self.failure: BaseException | None = None
        self.lock = threading.Lock()

    def send(self, entry: dict[str, Any], read: Any, key: Any = None) -> None:
        """Upload ``read()`` as the object ``entry`` describes; fills in its ``crc32`` (and,
        with ``key``, a function of the CRC-32, its ``key``)."""
        if self.failure is not None:
            return
        try:
            data = read()
            entry["crc32"] = crc = zlib.crc32(data)
            if key is not None:
                entry["key"] = key(crc)
            if self.old.get(entry["key"]) != crc:
                self.store.put(entry["key"], data)
                with self.lock:
                    self.bytes += len(data)
                    self.objects += 1
            with self.lock:
                self.done += len(data)
                if self.progress is not None:
                    self.progress(self.done, self.total)
        except BaseException as e:  # noqa: BLE001 - kept, raised by the caller's thread
            self.failure = self.failure or e

    def raise_first(self) -> None:
        if self.failure is not None:
            raise self.failure
