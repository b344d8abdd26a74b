"""Pulling a published cache into a local folder: ranged reads in parallel, every record checked,
published atomically, resumed after a kill, incremental after the remote was refreshed."""

from __future__ import annotations

import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import numpy as np

from .. import format as fmt
from .._files import fsync_dir
from .._generation import (
    open_existing,
    prepare_folder,
    publish_manifest,
    remove_stale_generations,
    retire,
    writer_lock,
)
from .._opening import create_exclusively, open_for_writing, resize
from ..errors import CacheFormatError, DestinationError
from ..reports import ProgressFn, PullReport, VerifyReport
from ..space import check_free_space, disk_bytes
from ..verify import check_checksums
from .published import Published, file_size, read_published
from .stores import RETRY_SECONDS, Store, open_store

__all__ = ["pull_cache"]

# Requests in flight; each asks for a run of neighbouring records of at most RUN_BYTES, and
# records at most GAP_BYTES apart share a request (the bytes between them are fetched too).
CONCURRENCY = 16
RUN_BYTES = 16 << 20
GAP_BYTES = 256 << 10


def pull_cache(
    url: str,
    dest: str | os.PathLike,
    progress: ProgressFn | None = None,
    *,
    concurrency: int = CONCURRENCY,
    retry_seconds: float = RETRY_SECONDS,
) -> PullReport:
    """Make ``dest`` a local copy of the cache published under ``url``.

    Records are fetched in runs of neighbours with ranged reads, ``concurrency`` at a time, and
    each is checked against its CRC-32 before it is written (a record that fails is fetched
    once more, then the pull stops naming it). The local cache is published (its manifest
    written) only when every record is there and checked. A pull that was killed or failed
    leaves what it fetched: the next pull checks those records and fetches only the rest. A
    ``dest`` that holds an earlier pull of the same data file (the remote was refreshed since)
    fetches only the records it lacks.

    Args:
        url: the prefix a cache was pushed to (``s3://bucket/prefix``, ``file:///folder``).
        dest: the local folder (created, or a cache it replaces atomically).
        progress: called as ``progress(done, total)`` in bytes fetched.
        concurrency: requests in flight.
        retry_seconds: how long a failing request is retried before the pull gives up.

    Examples:
        >>> pull_cache("s3://bucket/imagenet/train", "/nvme/cache/train")  # doctest: +SKIP

    Raises:
        CacheNotFoundError: nothing is published under ``url``.
        CacheFormatError: the publication is malformed, or a record fails its CRC-32 twice.
        RemoteError, RemoteAccessError: the store failed or refused, for longer than the
            retries allow (what was fetched is kept for the next pull).
        NotACacheError, DestinationError, InsufficientSpaceError: ``dest`` cannot take it.
    """
    start = time.perf_counter()
    store = open_store(url, retry_seconds)
    folder = fmt.cache_folder(dest)
    published = read_published(store, folder)
    m = published.manifest
    prepare_folder(folder)
    with writer_lock(folder):
        current = open_existing(folder)
        report = PullReport(store.url, folder, m.count, sum(m.sizes.values()), 0, 0, 0, 0.0)
        same = current is not None and current.manifest.generation == m.generation
        if same and current is not None and current.manifest.origin is None:
            report.up_to_date, report.present = True, m.count
        else:  # (a sparse copy of this generation is completed: its records are kept)
            current = remove_stale_generations(folder, current, resumed=m)
            _pull(published, current, report, progress, concurrency)
            publish_manifest(folder, published.raw["manifest"])
            if current is not None and not same:
                retire(current.manifest, m)
    report.seconds = time.perf_counter() - start
    return report


def _pull(
    published: Published,
    current: fmt.CacheFiles | None,
    report: PullReport,
    progress: ProgressFn | None,
    concurrency: int,
) -> None:
    """Fetch the small files and every record not already in the folder, checked and flushed."""
    m, store = published.manifest, published.store
    data = m.file("data")
    existed = data.exists()
    # Before anything is fetched: what the manifest says it needs (a forged size is refused
    # here, never allocated).
    needed = {k: file_size(m, k) for k in m.written_kinds if k != "data" or not existed}
    check_free_space(m.path, disk_bytes(needed), advice="free some space or pull elsewhere")
    for kind, o in published.objects.items():
        fetch_whole(store, o, m.file(kind))
    if not existed:
        os.close(create_exclusively(data))
    fd = open_for_writing(data)
    try:
        resize(fd, m.sizes["data"], only_grow=True)
        files = fmt.read_cache_files(m)
        filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
        missing = _missing(files, filled, current) if existed else filled
        report.present = len(filled) - len(missing)
        runs = _runs(files, missing)
        fetch = _Fetch(published, files, fd, progress, sum(b - a for a, b, _ in runs))
        with ThreadPoolExecutor(concurrency) as pool:
            for run in runs:
                pool.submit(fetch.run, run)
        if fetch.failure is not None:
            raise fetch.failure
        report.fetched, report.fetched_records = fetch.bytes, len(missing)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(m.path)


def _missing(
    files: fmt.CacheFiles, filled: np.ndarray, current: fmt.CacheFiles | None
) -> np.ndarray:
    """The records of ``filled`` whose bytes in the data file (from an earlier pull, killed or
    of an earlier version of the remote) fail their CRC-32: those to fetch."""
    found = VerifyReport(cache=files.manifest.path, records=0, checked=0, bytes=0, seconds=0.0)
    check_checksums(files, filled, found)
    bad = np.array([b.index for b in found.bad], np.int64)
    if (
        current is not None
        and current.manifest.origin is None  # (a sparse copy's bytes are the remote's)
        and current.manifest.file("data") == files.manifest.file("data")
    ):
        # Records of the published local cache are below its size: they must be the remote's.
        ends = files.index["offset"][bad] + fmt.record_nbytes(
            files.index, files.manifest.pixels, files.manifest.mask
        )[bad]
        if (ends <= current.manifest.sizes["data"]).any():
            raise DestinationError(
                f"{files.manifest.path}: holds a cache refreshed here since it was pulled, "
                "which the remote's records would overwrite; pull into another folder"
            )
    return bad


def _runs(files: fmt.CacheFiles, records: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """``(start, end, records)``: byte ranges of the data file to fetch, each covering records
    at most ``GAP_BYTES`` apart, at most ``RUN_BYTES`` long (or one larger record)."""
    if not len(records):
        return []
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels, files.manifest.mask)
    order = records[np.argsort(files.index["offset"][records], kind="stable")]
    starts = files.index["offset"][order].astype(np.int64)
    ends = starts + nbytes[order].astype(np.int64)
    runs, first = [], 0
    for j in range(1, len(order) + 1):
        if (
            j == len(order)
            or starts[j] - ends[j - 1] > GAP_BYTES
            or ends[j] - starts[first] > RUN_BYTES
        ):
            runs.append((int(starts[first]), int(ends[j - 1]), order[first:j]))
            first = j
    return runs


class _Fetch:
    """Fetching runs in a pool's threads: read each run's ranges of the chunks it spans, check
    every record's CRC-32 (fetching the run once more if one fails), write it with ``pwrite``."""

    def __init__(
        self, published: Published, files: fmt.CacheFiles, fd: int, progress: object, total: int
    ) -> None:
        self.published, self.files, self.fd = published, files, fd
        self.progress, self.total = progress, total
        self.nbytes = fmt.record_nbytes(files.index, files.manifest.pixels, files.manifest.mask)
        self.bytes = 0
        self.failure: BaseException | None = None
        self.lock = threading.Lock()

    def run(self, run: tuple[int, int, np.ndarray]) -> None:
        if self.failure is not None:
            return
        try:
            start, end, records = run
            for attempt in (1, 2):
                buf = self.published.read_range(start, end)
                bad = self._first_bad(buf, start, records)
                if bad is None:
                    break
                if attempt == 2:
                    raise CacheFormatError(
                        f"{self.published.store.url}: record {bad} ({self.files.path(bad)}) "
                        "fails its CRC-32 twice: the published data is damaged; push it again"
                    )
            written = os.pwrite(self.fd, buf, start)
            if written != len(buf):
                raise OSError(f"short write ({written} of {len(buf)} bytes)")
            with self.lock:
                self.bytes += len(buf)
                if self.progress is not None:
                    self.progress(self.bytes, self.total)  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - kept, raised by the caller's thread
            self.failure = self.failure or e

    def _first_bad(self, buf: bytes, start: int, records: np.ndarray) -> int | None:
        return first_bad_record(buf, start, records, self.files, self.nbytes)


def first_bad_record(
    buf: bytes | bytearray, start: int, records: np.ndarray, files: fmt.CacheFiles,
    nbytes: np.ndarray,
) -> int | None:
    """The first of ``records`` (sizes ``nbytes``) whose bytes in ``buf``, bytes of the data
    file from ``start``, fail the CRC-32 ``files.state`` gives it; None if all pass."""
    view = memoryview(buf)
    crcs = files.state["crc32"]
    for r in records:
        a = int(files.index["offset"][r]) - start
        if zlib.crc32(view[a : a + int(nbytes[r])]) != int(crcs[r]):
            return int(r)
    return None


def fetch_whole(store: Store, o: dict, path: Path) -> None:
    """Fetch object ``o`` (``{"key", "size", "crc32"}``) into ``path``, afresh (a resumed pull
    writes it again), in parts of at most RUN_BYTES, checked against its size and CRC-32."""
    with suppress(FileNotFoundError):
        os.unlink(path)
    crc = 0
    with os.fdopen(create_exclusively(path), "wb") as f:
        for at in range(0, o["size"], RUN_BYTES):
            part = store.get(o["key"], at, min(o["size"], at + RUN_BYTES))
            if part is None or len(part) != min(o["size"] - at, RUN_BYTES):
                raise CacheFormatError(f"{store.url}/{o['key']}: missing or cut short; push again")
            crc = zlib.crc32(part, crc)
            f.write(part)
        if crc != o["crc32"]:
            raise CacheFormatError(f"{store.url}/{o['key']}: fails its CRC-32; push it again")
        f.flush()
        os.fsync(f.fileno())


