"""The node-local sparse copy behind ``MemmapImageDataset(url)``: made at open without fetching a
record, each record fetched on its first read (with its neighbours), checked, stored in place.

The copy is a ``"lazy"`` cache whose manifest is the publication's with an ``"origin"`` (the
format's specification): its ``state`` file starts with every record ``EMPTY`` beside the
published CRC-32, and its data file is allocated sparse. A reader that finds a record ``EMPTY``
asks this process's ``RemoteFiller``, which fetches the record's *block*, the records that start
in the same ``BLOCK_BYTES`` of the data file, with one ranged read per chunk it spans; checks
each record against its CRC-32 (fetching the block once more if one fails, then raising naming
it); writes the bytes with ``pwrite`` and then each record's state, as a lazy fill does. A
``QuasiRandomSampler`` reads blocks of neighbouring records of the same size, so an epoch of it
asks the store for large ranges, each once; its read-ahead asks ``fill_ahead`` for the next
buffer's blocks, ``AHEAD_REQUESTS`` at a time, while the loader reads the current one.

Processes and threads that fill one copy take turns per block: a thread holds the block's lock
in its process and a POSIX record lock on byte ``<block>`` of the cache's ``lock`` file (which
writers ``flock``: the two kinds of lock do not meet), and fetches only the records still
``EMPTY`` once it has them. So a block is fetched once, whichever of a node's DataLoader workers
and ranks reads it first. A process killed mid-fetch leaves its records ``EMPTY``; power cuts are
covered by the ``filling-`` files, as for any lazy cache.
"""

from __future__ import annotations

import bisect
import dataclasses
import fcntl
import multiprocessing.util
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path

import numpy as np

from .. import format as fmt
from .. import pixels as px
from .._files import write_state
from .._filler import fill_marker, foreign_owner, release
from .._generation import (
    open_existing,
    open_lock,
    prepare_folder,
    remove_stale_generations,
    retire,
    write_manifest,
    writer_lock,
)
from .._opening import create_exclusively, open_for_writing, resize
from .._records import mapped
from ..errors import (
    CacheError,
    CacheFormatError,
    CacheStaleError,
    DestinationError,
    StaleCacheWarning,
    UnsafeCacheError,
)
from ..space import check_free_space, disk_bytes
from .published import Published, file_size, read_published
from .pull import fetch_whole, first_bad_record
from .stores import Store, locate, open_store

__all__ = ["RemoteFiller", "sparse_copy"]

# A record's first read fetches the records that start in the same 8 MiB of the data file: the
# block a QuasiRandomSampler reads whole (its BLOCK_BYTES), in one request per chunk.
BLOCK_BYTES = 8 << 20
# Reading ahead (``fill_ahead``) keeps as many block requests in flight as a pull, each retried
# briefly (a read that meets the failure retries for the store's full time and raises it).
AHEAD_REQUESTS = 16
AHEAD_RETRY_SECONDS = 5.0

# The publications this process read when it opened copies, by (URL, generation): its fillers
# start from them instead of reading remote.json again (forked workers inherit them).
_OPENED: dict[tuple[str, str], Published] = {}


def sparse_copy(
    url: str, folder: Path, on_stale: str = "refresh", retry_seconds: float | None = None
) -> Path:
    """Make ``folder`` a sparse copy of the cache published under ``url``, fetching only its
    small files, unless it is a copy (sparse or pulled) of that generation already.

    A copy of an earlier generation (the cache was pushed again since) is brought to the new
    one with ``on_stale="refresh"``, keeping every record it had filled that the new generation
    keeps in place (same data file, offset and CRC-32); ``"warn"`` keeps it as it is with a
    ``StaleCacheWarning``, ``"error"`` raises ``CacheStaleError``, and ``"ignore"`` uses any
    copy as it is without asking the store.

    Raises:
        CacheNotFoundError, CacheFormatError, RemoteError: as ``pull_cache``.
        CacheStaleError: with ``on_stale="error"``, the copy is of an earlier generation.
        NotACacheError, DestinationError, InsufficientSpaceError: ``folder`` cannot take it.
    """
    folder = fmt.cache_folder(folder)
    if on_stale == "ignore" and _copy_of(open_existing(folder), locate(url).url):
        return folder
    store = open_store(url, retry_seconds)
    published = read_published(store, folder)
    m = published.manifest
    _OPENED[store.url, m.generation] = published
    prepare_folder(folder)
    with writer_lock(folder):
        current = open_existing(folder)
        if current is not None and not _copy_of(current, store.url):
            other = (current.manifest.origin or {}).get("url")
            raise DestinationError(
                f"{folder}: holds a copy of {other}, not of {store.url}; give this URL a local "
                "folder of its own"
            )
        if current is not None and current.manifest.generation == m.generation:
            return folder
        if current is not None and on_stale != "refresh":
            _stale(current.manifest, m, store.url, on_stale)
            return folder
        current = remove_stale_generations(folder, current)
        _make_copy(published, current)
        if current is not None:
            retire(current.manifest, m)
    return folder


def _copy_of(files: fmt.CacheFiles | None, url: str) -> bool:
    """Whether ``files`` are a copy of the cache at ``url``: a sparse one whose origin is
    ``url``, or one pulled (a pull records no origin; it replaces what the folder held)."""
    return files is not None and (files.manifest.origin or {"url": url})["url"] == url


def _stale(copy: fmt.Manifest, latest: fmt.Manifest, url: str, on_stale: str) -> None:
    """Say that ``copy`` is of an earlier generation than ``latest``, as ``on_stale`` asks."""
    message = (
        f"{copy.path}: a copy of generation {copy.generation} ({copy.count:,} images); {url} was "
        f"pushed again since (generation {latest.generation}, {latest.count:,} images)"
    )
    if on_stale == "error":
        raise CacheStaleError(f"{message}; on_stale='refresh' follows it")
    warnings.warn(
        f"{message}: using the copy as it is; on_stale='refresh' follows the new push, "
        "fetching only what it adds",
        StaleCacheWarning,
        stacklevel=5,  # (the caller of MemmapImageDataset)
    )


def _make_copy(published: Published, current: fmt.CacheFiles | None) -> None:
    """Write the copy's files (the small ones fetched, the state made here, the data file grown
    sparse) and publish its manifest, the publication's made lazy with an origin."""
    m, store = published.manifest, published.store
    data = m.file("data")
    shared = current is not None and current.manifest.file("data") == data and data.exists()
    needed = {k: file_size(m, k) for k in m.written_kinds if k != "data" or not shared}
    check_free_space(m.path, disk_bytes(needed), advice="free some space or copy elsewhere")
    if not shared:
        os.close(create_exclusively(data))
    fd = open_for_writing(data)
    try:
        resize(fd, m.sizes["data"], only_grow=True)
        os.fsync(fd)
    finally:
        os.close(fd)
    for kind, o in published.objects.items():
        fetch_whole(store, o, m.file(kind))
    files = fmt.read_cache_files(m)  # the fetched state: the published CRC-32s
    state = files.state.copy()
    state["state"][state["state"] == fmt.FILLED] = fmt.EMPTY
    if shared and current is not None:
        state["state"][_carried(files, current)] = fmt.FILLED
    path = m.file("state")
    os.unlink(path)
    with os.fdopen(create_exclusively(path), "wb") as f:
        f.write(state.tobytes())
        f.flush()
        os.fsync(f.fileno())
    write_manifest(dataclasses.replace(m, mode="lazy", origin={"url": store.url}))


def _carried(files: fmt.CacheFiles, current: fmt.CacheFiles) -> np.ndarray:
    """Which records of ``files`` the current copy holds already (FILLED there at the same
    offset, of the same size and CRC-32, in the data file they share): a bool array."""
    cm, m = current.manifest, files.manifest
    filled = current.state["state"] == fmt.FILLED
    key = np.dtype([("offset", "<u8"), ("nbytes", "<i8"), ("crc32", "<u4")])
    had = np.zeros(int(filled.sum()), key)
    had["offset"] = current.index["offset"][filled]
    had["nbytes"] = fmt.record_nbytes(current.index, cm.pixels, cm.mask)[filled]
    had["crc32"] = current.state["crc32"][filled]
    now = np.zeros(len(files.index), key)
    now["offset"] = files.index["offset"]
    now["nbytes"] = fmt.record_nbytes(files.index, m.pixels, m.mask)
    now["crc32"] = files.state["crc32"]
    return np.isin(now, had)


class RemoteFiller:
    """Fills the records of one sparse copy from its origin; one per process (see the module
    docstring). ``fill`` has ``RecordFiller``'s contract."""

    def __init__(self, files: fmt.CacheFiles) -> None:
        m = files.manifest
        assert m.origin is not None
        self.files, self.url = files, str(m.origin["url"])
        foreign = foreign_owner(m)
        if foreign is not None:  # its manifest would choose what our credentials fetch
            raise UnsafeCacheError(
                f"{foreign[0]}: belongs to uid {foreign[1]}, so the store its manifest names "
                f"({self.url}) is not fetched into it; open the URL with a local= of your own"
            )
        self.published: Published | None = None  # read on the first fill
        self.fetched = 0  # records this process fetched
        self.ahead_store: Store | None = None  # read-ahead's client, of short retries
        self.nbytes = fmt.record_nbytes(files.index, m.pixels, m.mask).astype(np.int64)
        offsets = files.index["offset"].astype(np.int64)
        self.order = np.argsort(offsets, kind="stable")
        self.starts = (offsets[self.order] // BLOCK_BYTES).tolist()
        self.guard = threading.Lock()
        self.reading = threading.Lock()  # held while the publication is read
        self.block_locks: dict[int, threading.Lock] = {}
        self.fds: list[int] = []
        try:
            for kind in ("data", "state"):
                self.fds.append(open_for_writing(m.file(kind)))
            self.fds.append(open_lock(m.path))
            self.marker = fill_marker(m.path)
        except OSError as e:
            while self.fds:
                os.close(self.fds.pop())
            if isinstance(e, CacheError):
                raise
            raise DestinationError(
                f"{m.path}: cannot fill the copy ({e.strerror}); records are stored where the "
                "copy lies, so its user must be able to write there"
            ) from None
        self.states = mapped(m.file("state"), fmt.STATE_DTYPE, m.count)  # shared: others' fills
        self.pid = os.getpid()
        self._release = weakref.finalize(self, release, self.fds, self.marker, self.pid)
        multiprocessing.util.Finalize(self, self._release, exitpriority=0)

    def fill(self, i: int) -> tuple[int, np.ndarray | None]:
        """Fetch the block of record ``i`` (what of it is still ``EMPTY``) and store it:
        ``(FILLED, record i as stored)``.

        Raises:
            CacheFormatError: a record fails its CRC-32 twice.
            CacheStaleError: the remote was pushed again with another data file since.
            RemoteError: the store failed for longer than its retries allow.
        """
        off, n = int(self.files.index["offset"][i]), int(self.nbytes[i])
        got = self._fill_block(off // BLOCK_BYTES, None)
        if got is not None and got[0] <= off and off + n <= got[0] + len(got[1]):
            flat = np.frombuffer(got[1], np.uint8, n, off - got[0]).copy()
            return fmt.FILLED, self._shaped(i, flat)
        return int(self.states["state"][i]), self._stored(i)

    def fill_ahead(self, records: np.ndarray, stopped: Callable[[], bool]) -> None:
        """Fetch the blocks of ``records`` that hold ``EMPTY`` records, ``AHEAD_REQUESTS`` at a
        time, until ``stopped()``: a reader's read-ahead (``QuasiRandomSampler``'s next buffer).
        A failure is left for the record's own read to meet and raise."""
        blocks = np.unique(self.files.index["offset"][records] // BLOCK_BYTES).tolist()
        with self.reading:
            if self.ahead_store is None:
                self.ahead_store = open_store(self.url, AHEAD_RETRY_SECONDS)
            store = self.ahead_store

        def fetch(b: int) -> None:
            if not stopped():
                with suppress(CacheError):
                    self._fill_block(b, store)

        with ThreadPoolExecutor(AHEAD_REQUESTS, thread_name_prefix="mmcache-fetch") as pool:
            list(pool.map(fetch, blocks))

    def _fill_block(self, b: int, store: Store | None) -> tuple[int, bytes] | None:
        """Fetch, check and store the records of block ``b`` still ``EMPTY``, holding the
        block's locks: ``(start, bytes)`` fetched, or None if none was left to fetch."""
        lo, hi = bisect.bisect_left(self.starts, b), bisect.bisect_right(self.starts, b)
        with self.guard:
            lock = self.block_locks.setdefault(b, threading.Lock())
        lock_fd = self.fds[2]
        with lock:
            fcntl.lockf(lock_fd, fcntl.LOCK_EX, 1, b)
            try:
                records = self.order[lo:hi]
                todo = records[self.states["state"][records] == fmt.EMPTY]
                return self._fetch(todo, store) if len(todo) else None
            finally:
                fcntl.lockf(lock_fd, fcntl.LOCK_UN, 1, b)

    def _fetch(self, records: np.ndarray, store: Store | None) -> tuple[int, bytes]:
        """Fetch ``records`` (of one block, in offset order), check and write them."""
        offsets = self.files.index["offset"]
        start = int(offsets[records[0]])
        end = int(offsets[records[-1]]) + int(self.nbytes[records[-1]])
        published = self._publication()
        for attempt in (1, 2):
            buf = published.read_range(start, end, store)
            bad = first_bad_record(buf, start, records, self.files, self.nbytes)
            if bad is None:
                break
            if attempt == 2:
                raise CacheFormatError(
                    f"{self.url}: record {bad} ({self.files.path(bad)}) fails its CRC-32 twice: "
                    "the published data is damaged; push it again"
                )
        data_fd, state_fd, _ = self.fds
        written = os.pwrite(data_fd, buf, start)
        if written != len(buf):
            raise OSError(f"short write ({written} of {len(buf)} bytes)")
        crcs = self.files.state["crc32"]
        for r in records:
            write_state(state_fd, int(r), int(crcs[r]), fmt.FILLED)
        with self.guard:
            self.fetched += len(records)
        return start, buf

    def _publication(self) -> Published:
        """The publication this copy fetches from, read once per process: the copy's own, or a
        later one whose records lie in the same data file (a refresh appends, so the copy's
        bytes are where they were)."""
        with self.reading:  # (one thread reads it: each open_store makes a client)
            return self._read_publication()

    def _read_publication(self) -> Published:
        if self.published is None:
            m = self.files.manifest
            p = _OPENED.get((self.url, m.generation))
            if p is None:
                p = read_published(open_store(self.url), m.path)
            pm = p.manifest  # (its path may be another copy's folder: names are compared)
            data = m.file("data").name
            if pm.file("data").name != data or pm.sizes["data"] < m.sizes["data"]:
                raise CacheStaleError(
                    f"{self.url}: pushed again with another data file (generation "
                    f"{pm.generation}) since the copy in {m.path} was made; open it again"
                )
            self.published = p
        return self.published

    def _stored(self, i: int) -> np.ndarray | None:
        """Record ``i`` as another thread or process stored it, or None if it is not FILLED."""
        if self.states["state"][i] != fmt.FILLED:
            return None
        n, off = int(self.nbytes[i]), int(self.files.index["offset"][i])
        got = os.pread(self.fds[0], n, off)
        if len(got) != n:
            raise CacheFormatError(f"{self.files.manifest.file('data')}: cut short at record {i}")
        return self._shaped(i, np.frombuffer(bytearray(got), np.uint8))

    def _shaped(self, i: int, flat: np.ndarray) -> np.ndarray:
        m = self.files.manifest
        return px.stored_view(flat, fmt.record_shapes(self.files.index[i : i + 1])[0],
                              m.pixels, m.mask)  # fmt: skip

    def close(self) -> None:
        """Flush what this process filled, delete its ``filling-`` file, close its files."""
        self._release()

