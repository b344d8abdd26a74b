"""Residency: what of a cache lies in the page cache (RAM), and reading it in or dropping it.

With a memory-mapped cache the resource that matters is RAM in the OS page cache: a read that
finds its page there costs a copy, one that misses waits for the disk. ``cache_info`` reports a
cache beside the share of its data file resident right now (``mincore(2)`` over a mapping) and
the machine's RAM; ``warm_cache`` reads the data file in sequentially until it is all resident
or memory use would pass a budget; ``evict_cache`` drops its pages (``posix_fadvise
DONTNEED``). None of this imports torch.

Memory accounting: the kernel counts page-cache pages as *available* (it drops clean ones under
pressure), so psutil's used memory does not grow as a cache is read in. The budget therefore
bounds *memory used by processes plus this cache's resident pages*. Inside a memory-limited
control group (a container, a job scheduler) the group's limit, not the host's RAM, is what the
page cache can hold, so the limit and the group's own usage are used when they are smaller.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from . import format as fmt
from ._generation import found_bad, garbage_bytes
from ._opening import open_for_reading
from ._staleness import recorded_source, stale_reason
from .reports import CacheInfo, Memory, ProgressFn, WarmReport
from .scan import source_exists

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "cache_info",
    "evict_cache",
    "memory",
    "resident_bytes",
    "warm_cache",
]

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
# mincore maps the file in windows of this size, so a file larger than the address space left
# (a 32-bit process, a tight RLIMIT_AS) is still measured; 1 GiB costs a 256 KiB vector.
WINDOW = 1 << 30
# warm_cache reads in 16 MiB pieces: large enough that the disk sees sequential reads (and the
# kernel's readahead ramps up to its maximum), small enough to stop close to the budget.
CHUNK = 16 << 20
DEFAULT_MAX_MEMORY = "90%"
_UNSUPPORTED = (errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP)


# mincore through libc ------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.mincore  # noqa: B018 - only to learn that this libc has it
        except (OSError, AttributeError, TypeError):
            return None
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


_MAP_FAILED = ctypes.c_void_p(-1).value


def _resident_pages(fd: int, offset: int, length: int) -> np.ndarray | None:
    """One bool per page of ``[offset, offset + length)`` of an open file: in RAM now?

    ``offset`` must be a multiple of the page size. The window is mapped read-only, which
    faults nothing in; None when mincore is not available here.
    """
    libc = _load_libc()
    if libc is None or length <= 0:
        return None if libc is None else np.zeros(0, bool)
    vec = np.zeros(-(-length // PAGE), np.uint8)
    addr = libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap for mincore failed: {os.strerror(err)}")
    try:
        if libc.mincore(addr, length, vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
    finally:
        libc.munmap(addr, length)
    return (vec & 1).astype(bool)


def resident_bytes(path: str | os.PathLike, start: int = 0, stop: int | None = None) -> int | None:
    """Bytes of the file at ``path`` (from ``start`` to ``stop``) in the page cache right now.

    Counted in whole pages, capped to the range; None where mincore cannot be called.

    Examples:
        >>> resident_bytes("cache/train/data-0123456789abcdef.bin")  # doctest: +SKIP
    """
    with os.fdopen(open_for_reading(Path(path)), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        stop = size if stop is None else min(stop, size)
        return _resident_in(f.fileno(), start, stop)


def _resident_in(fd: int, start: int, stop: int) -> int | None:
    total = 0
    pos = start - start % PAGE
    while pos < stop:
        n = min(WINDOW, stop - pos)
        pages = _resident_pages(fd, pos, n)
        if pages is None:
            return None
        total += int(pages.sum()) * PAGE
        pos += n
    # The first page may begin before start and the last end after stop: clip to the range.
    return max(0, min(total, stop - start))


# memory --------------------------------------------------------------------------------------


def memory() -> Memory:
    """Total and available RAM: psutil's, or this process's memory cgroup's if smaller.

    A group's available memory is its limit minus what its processes hold: its usage less its
    reclaimable page cache (file pages, not shared memory).
    """
    vm = psutil.virtual_memory()
    host = Memory(int(vm.total), int(vm.available))
    group = _cgroup_memory()
    if group is None or group[0] >= host.total:
        return host
    limit, used = group
    return Memory(limit, max(0, min(limit - used, host.available)), cgroup_limited=True)


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, bytes used by processes) of this process's memory cgroup, v1 or v2, or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", "total_shmem")
            mounts = [Path("/sys/fs/cgroup/memory")]
        elif controllers == "":
            files = ("memory.max", "memory.current", "file", "shmem")
            mounts = [Path("/sys/fs/cgroup")]
        else:
            continue
        # In a container the group's path as the host names it may not be mounted: then the
        # mount's root is the group.
        for folder in (mounts[0] / path.lstrip("/"), mounts[0]):
            try:
                raw_limit = (folder / files[0]).read_text().strip()
                usage = int((folder / files[1]).read_text())
                stat = (folder / "memory.stat").read_text()
            except (OSError, ValueError):
                continue
            if raw_limit == "max":
                return None
            # Shared memory (DataLoader batches in /dev/shm) is counted as cache, but without
            # swap the kernel cannot reclaim it: only file pages less shmem are reclaimable.
            cache, shmem = (_stat(stat, key) for key in files[2:])
            return int(raw_limit), max(0, usage - cache + shmem)
    return None


def _stat(text: str, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


def parse_memory(text: str | int, total: int) -> int:
    """A memory budget in bytes: ``"90%"`` of ``total``, a size (``"8G"``, ``"512MiB"``,
    ``"1.5GB"``; K/M/G/T are powers of 1024) or a number of bytes.

    Raises:
        ValueError: anything else, or a percentage outside 0..100.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a memory budget must not be negative, got {text}")
        return text
    s = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if m:
        pct = float(m.group(1))
        if not 0 <= pct <= 100:
            raise ValueError(f"a memory budget in percent must be within 0..100, got {s!r}")
        return int(total * pct / 100)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", s, re.I)
    if not m:
        raise ValueError(f"a memory budget is a percentage (90%) or a size (8G), got {s!r}")
    scale = 1024 ** " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * scale)


# the public verbs ----------------------------------------------------------------------------


def cache_info(
    cache: str | os.PathLike, *, check_stale: bool = True, source_check: str = "quick"
) -> CacheInfo:
    """Describe a cache, with how much of it is in RAM right now.

    Args:
        cache: a cache folder.
        check_stale: compare against the source listing and decoder (scans the source folder,
            when it is there); False skips that and reports ``stale=None``.
        source_check: ``"quick"``: take the source as unchanged, without scanning it, when
            its folders' mtimes (an archive's size and mtime) are those the build recorded
            (docs/refresh.md says what that sees); ``"full"``: scan it.

    Examples:
        >>> info = cache_info("cache/train")  # doctest: +SKIP
        >>> f"{info.resident_share:.0%} of {info.data_bytes} bytes in RAM"  # doctest: +SKIP

    Raises:
        CacheNotFoundError, CacheFormatError: as opening the cache does.
    """
    files = fmt.read_cache_files(fmt.read_manifest(Path(cache).absolute()))
    m = files.manifest
    idx = files.index
    shapes = fmt.record_shapes(idx)
    smallest: tuple[int, int, int] | None = None
    largest: tuple[int, int, int] | None = None
    if len(shapes):
        pixels = shapes.prod(1)
        smallest, largest = (
            (int(height), int(width), int(channels))
            for height, width, channels in (shapes[np.argmin(pixels)], shapes[np.argmax(pixels)])
        )
    paths = [m.path / fmt.MANIFEST_NAME] + [m.file(kind) for kind in m.written_kinds]
    stats = [p.stat() for p in paths]
    garbage = garbage_bytes(files)
    ram = memory()
    return CacheInfo(
        cache=str(m.path),
        images=m.count,
        filled=int((files.state["state"] == fmt.FILLED).sum()),
        classes=list(m.classes),
        min_size=smallest,
        max_size=largest,
        data_bytes=m.sizes["data"],
        live_bytes=m.sizes["data"] - garbage,
        garbage_bytes=garbage,
        apparent_bytes=sum(s.st_size for s in stats),
        disk_bytes=sum(s.st_blocks * 512 for s in stats),
        format_version=m.format_version,
        mode=m.mode,
        generation=m.generation,
        options=dict(m.options),
        skipped=list(m.skipped) + found_bad(files),  # and what lazy fills found bad
        warnings=list(m.warnings),
        stale=stale_reason(files, quick=source_check == "quick") if check_stale else None,
        source=recorded_source(m),
        source_found=source_exists(recorded_source(m)),  # (a shard pattern is no path)
        resident_bytes=resident_bytes(m.file("data"), 0, m.sizes["data"]),
        ram_total=ram.total,
        ram_available=ram.available,
        cgroup_limited=ram.cgroup_limited,
        annotations={
            **({"mask": m.mask} if m.mask else {}),
            **{f["name"]: f for f in m.fields if not f["name"].startswith("_")},
        },
        source_paired={k: str(m.source[k]) for k in ("masks", "coco") if m.source.get(k)},
        origin=str(m.origin["url"]) if m.origin else None,
    )


def warm_cache(
    cache: str | os.PathLike,
    max_memory: str | int = DEFAULT_MAX_MEMORY,
    progress: ProgressFn | None = None,
) -> WarmReport:
    """Read a cache's data file into the page cache, sequentially, within a memory budget.

    Pieces already resident are skipped, so warming a warm cache reads nothing. Warming stops
    before the piece that would make memory used by processes plus this cache's resident pages
    pass ``max_memory`` (see the module docstring), so a cache larger than the budget ends
    warmed up to the budget rather than pushing its own first pages out again.

    Args:
        cache: a cache folder.
        max_memory: the budget: a percentage of RAM (``"90%"``) or a size (``"8G"``, bytes).
        progress: called as ``progress(bytes_done, data_bytes)`` as the file is walked.

    Examples:
        >>> report = warm_cache("cache/train", max_memory="80%")  # doctest: +SKIP
        >>> report.resident_share  # doctest: +SKIP
        1.0

    Raises:
        CacheNotFoundError, CacheFormatError: as opening the cache does.
        ValueError: a malformed budget.
    """
    manifest = fmt.read_manifest(Path(cache).absolute())
    return _warm_file(
        manifest.file("data"), manifest.sizes["data"], max_memory, progress, manifest.path
    )


def _warm_file(
    path: Path,
    size: int,
    max_memory: str | int,
    progress: ProgressFn | None,
    cache: str | os.PathLike,
) -> WarmReport:
    start_time = time.perf_counter()
    ram = memory()
    budget = parse_memory(max_memory, ram.total)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    read = 0
    stopped = False
    with os.fdopen(open_for_reading(Path(path)), "rb", buffering=0) as f:
        fd = f.fileno()
        with _suppress_unsupported():
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
        pieces = range(0, size, CHUNK)
        at_start = [_resident_in(fd, pos, min(pos + CHUNK, size)) or 0 for pos in pieces]
        before = sum(at_start)
        # This cache's resident bytes are tracked piece by piece rather than re-measured: what
        # we read, plus what the kernel's readahead brought into a piece before we reached it.
        # Processes' memory is sampled every piece: training may be starting beside us.
        resident = before
        for k, pos in enumerate(pieces):
            n = min(CHUNK, size - pos)
            now = _resident_in(fd, pos, pos + n)
            now = 0 if now is None else now
            resident += now - at_start[k]
            if now < n:
                ram = memory()
                if ram.used + resident + (n - now) > budget:
                    stopped = True
                    break
                f.seek(pos)
                got = f.readinto(view[:n])
                if not got:
                    break
                read += got
                resident += n - now
            if progress is not None:
                progress(pos + n, size)
        after = _resident_in(fd, 0, size)
    return WarmReport(
        cache=str(cache),
        data_bytes=size,
        resident_before=before,
        resident_after=after if after is not None else resident,
        read_bytes=read,
        seconds=time.perf_counter() - start_time,
        budget_bytes=budget,
        stopped_by_budget=stopped,
        ram=ram,
    )


class Warming:
    """A ``warm_cache`` running in a daemon thread (so it never holds up the process's exit)."""

    def __init__(self, manifest: fmt.Manifest, max_memory: str | int) -> None:
        parse_memory(max_memory, memory().total)  # a malformed budget fails here, not later
        self.report: WarmReport | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(manifest, max_memory), name="mmcache-warm", daemon=True
        )
        self._thread.start()

    def _run(self, manifest: fmt.Manifest, max_memory: str | int) -> None:
        try:
            self.report = _warm_file(
                manifest.file("data"), manifest.sizes["data"], max_memory, None, manifest.path
            )
        except BaseException as e:  # kept for result(): a thread's exception would be lost
            self.error = e
            logger.warning("warming %s failed: %s", manifest.path, e)

    def result(self, timeout: float | None = None) -> WarmReport | None:
        """The report once done (None while still running after ``timeout`` seconds)."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.report


def start_warming(manifest: fmt.Manifest, warm: bool | str | int) -> Warming | None:
    """Start warming a cache in the background (``warm``: False, True, or a budget)."""
    if warm is False or warm is None:
        return None
    return Warming(manifest, DEFAULT_MAX_MEMORY if warm is True else warm)


def evict_cache(cache: str | os.PathLike) -> int | None:
    """Drop a cache's pages from the page cache; returns the data file's resident bytes after.

    Each file is flushed first (``fsync``): the kernel does not drop dirty pages, such as
    records a lazy fill just wrote. Pages that a running process has mapped *and* touched may
    stay resident (the kernel does not drop mapped pages on advice); close the datasets first
    for a cold measurement.

    Examples:
        >>> evict_cache("cache/train")  # doctest: +SKIP
        0

    Raises:
        CacheNotFoundError, CacheFormatError: as opening the cache does.
    """
    manifest = fmt.read_manifest(cache)
    for kind in manifest.written_kinds:
        evict_file(manifest.file(kind))
    return resident_bytes(manifest.file("data"), 0, manifest.sizes["data"])


def evict_file(path: str | os.PathLike) -> None:
    """Flush one file and advise the kernel to drop its pages (``POSIX_FADV_DONTNEED``)."""
    with os.fdopen(open_for_reading(Path(path)), "rb") as f:
        os.fsync(f.fileno())
        with _suppress_unsupported():
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


class _suppress_unsupported:
    """Ignore a posix_fadvise that this OS or filesystem lacks: it is only advice."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None:
            return False
        if issubclass(kind, AttributeError):  # no os.posix_fadvise (macOS)
            return True
        return issubclass(kind, OSError) and exc.errno in _UNSUPPORTED
