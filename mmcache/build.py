"""Building a cache: scan the source, plan the layout from headers, decode in parallel, publish.

A build writes a new generation of files inside the cache folder and publishes it by replacing
``manifest.json`` atomically (see ``mmcache.format``), so a build stopped at any point leaves the
previous cache untouched and nothing a reader would accept. The layout (every record's offset)
is planned from the files' headers before decoding, so decode workers write their records in
place with ``pwrite`` and send back only a few numbers; pixels never cross a pipe. A file whose
header does not predict its decoded size (rare: a malformed header) is decoded, sent back and
appended after the planned records.
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import shutil
import signal
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import cv2
import numpy as np

from . import format as fmt
from ._version import __version__
from .decode import (
    Options,
    StderrCapture,
    decoder_accepted,
    decoder_fingerprint,
    decoder_versions,
    preprocess,
    read_flags,
)
from .errors import (
    CacheError,
    CacheNotFoundError,
    DestinationError,
    InsufficientSpaceError,
    NotACacheError,
    StrictBuildError,
)
from .probe import probe_size
from .scan import Listing, scan_source
from .space import check_free_space, disk_bytes, generation_sizes

# Records per task sent to a decode worker: large enough that the per-task overhead (~100 us)
# vanishes next to a decode (~2 ms for 720x480), small enough to balance the last tasks.
CHUNK = 16

ProgressFn = Callable[[int, int], None]


@dataclass
class BuildReport:
    """What a build did. ``up_to_date`` means it found the cache current and did nothing."""

    cache: Path
    images: int
    classes: int
    bytes: int
    seconds: float
    decoded: int = 0
    reused: int = 0
    dropped: int = 0
    up_to_date: bool = False
    trusted_decoder: bool = False
    skipped: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        return self.decoded / self.seconds if self.seconds > 0 else 0.0


def build_cache(
    source: str | os.PathLike,
    cache: str | os.PathLike,
    *,
    size: tuple[int, int] | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
    interpolation: str = "auto",
    color: str = "rgb",
    max_pixels: int | None = None,
    workers: int | None = None,
    strict: bool = False,
    progress: ProgressFn | None = None,
    force: bool = False,
    trust_decoder: bool = False,
) -> BuildReport:
    """Decode every image of ``source`` once into the cache folder ``cache``.

    An unchanged source with the same options is a no-op (``report.up_to_date``); a changed
    source decodes only new and modified files and carries the rest over (``report.reused``).

    Args:
        source: an ImageFolder-style folder, a flat folder of images, or a ``path,label`` list.
        cache: the cache folder to create or update.
        size: exact ``(width, height)``; or ``max_side`` / ``short_side`` to bound a side while
            keeping the aspect ratio (never upscaling). Default: native size.
        interpolation: ``"auto"`` (INTER_AREA to shrink), ``"area"``, ``"linear"``, ``"cubic"``,
            ``"lanczos"`` or ``"nearest"``.
        color: ``"rgb"``, ``"bgr"`` or ``"gray"``.
        max_pixels: refuse larger images without decoding them (default: Pillow's bomb limit).
        workers: decode processes (default: all cores).
        strict: fail, leaving no new cache, if any file cannot be decoded.
        progress: called as ``progress(done, total)`` while decoding.
        force: start even when the destination lacks the free space the cache needs.
        trust_decoder: keep a cache made by another decoder version (its pixels may differ
            slightly from what this machine decodes) instead of decoding everything again, and
            record that choice in its manifest as ``"trusted_decoder"``.

    Example:
        >>> report = build_cache("data/train", "cache/train", short_side=256)  # doctest: +SKIP
        >>> report.images, report.skipped  # doctest: +SKIP

    Raises:
        SourceError, NotACacheError, DestinationError, StrictBuildError, InsufficientSpaceError.
    """
    opts = Options(
        size=size,
        max_side=max_side,
        short_side=short_side,
        interpolation=interpolation,
        color=color,
        **({} if max_pixels is None else {"max_pixels": max_pixels}),
    )
    start = time.perf_counter()
    listing = scan_source(source)
    folder = Path(cache).expanduser().absolute()
    created = _prepare_folder(folder)
    try:
        with _locked(folder):
            report = _build_locked(
                listing,
                opts,
                folder,
                workers=workers,
                strict=strict,
                progress=progress,
                force=force,
                trust_decoder=trust_decoder,
            )
    except BaseException:
        if created:  # a first build that failed leaves no folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - start
    return report


def _build_locked(
    listing: Listing,
    opts: Options,
    folder: Path,
    *,
    workers: int | None,
    strict: bool,
    progress: ProgressFn | None,
    force: bool,
    trust_decoder: bool,
) -> BuildReport:
    previous = _read_previous(folder)
    fingerprints = {
        "listing": listing.fingerprint(),
        "options": opts.fingerprint(),
        "decoder": decoder_fingerprint(),
    }
    # What the previous cache must match: its own decoder counts as this one when a user
    # trusted it (now, or in an earlier build).
    same = fingerprints
    if previous is not None:
        same = _decoder_trust(previous.manifest, fingerprints, trust_decoder)
    if previous is not None and _is_current(previous, same):
        m = previous.manifest
        newly_trusted = not decoder_accepted(
            m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")
        )
        if newly_trusted:
            m.extra["trusted_decoder"] = _trust_record(decoder_versions())
            fmt.write_manifest(m)
        return BuildReport(
            cache=folder,
            images=m.count,
            classes=len(m.classes),
            bytes=m.sizes["data"],
            seconds=0.0,
            up_to_date=True,
            trusted_decoder=newly_trusted,
            skipped=m.skipped,
            warnings=m.warnings,
        )
    report = _build(
        listing, opts, folder, previous, fingerprints, workers, strict, progress, force, same
    )
    report.trusted_decoder = report.reused > 0 and same != fingerprints
    return report


def _prepare_folder(folder: Path) -> bool:
    """Check that ``folder`` is free or an mmcache cache, create it; True if it was created."""
    if folder.exists() and not folder.is_dir():
        raise NotACacheError(f"{folder}: a file is in the way; choose another cache path")
    if folder.is_dir():
        strangers = [n for n in os.listdir(folder) if not fmt.is_cache_file_name(n)]
        if strangers:
            raise NotACacheError(
                f"{folder}: exists and is not an mmcache cache (it holds {strangers[0]!r}"
                f"{' and more' if len(strangers) > 1 else ''}); refusing to write into it"
            )
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Opening the lock file for writing is the write test: it is created on the first build.
        os.close(os.open(folder / fmt.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666))
    except OSError as e:
        raise DestinationError(f"{folder}: cannot write the cache here ({e.strerror})") from None
    return created


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the cache's writer lock: concurrent builds of one cache run one after the other."""
    fd = os.open(folder / fmt.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_previous(folder: Path) -> fmt.CacheFiles | None:
    try:
        return fmt.read_cache_files(fmt.read_manifest(folder))
    except CacheNotFoundError:
        return None
    except CacheError:
        return None  # a damaged cache is rebuilt from scratch; nothing of it is reused


def _trust_record(versions: dict[str, str]) -> dict:
    return {
        "versions": versions,
        "fingerprint": decoder_fingerprint(versions),
        "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _decoder_trust(m: fmt.Manifest, fingerprints: dict[str, str], trust: bool) -> dict[str, str]:
    """The fingerprints cache ``m`` must match to be current or to lend records: its decoder
    counts as this machine's when the user trusts it now (``trust``) or trusted it before."""
    recorded = m.fingerprints.get("decoder")
    if recorded != fingerprints["decoder"] and (
        trust or decoder_accepted(recorded, m.extra.get("trusted_decoder"))
    ):
        return {**fingerprints, "decoder": recorded}
    return fingerprints


def _carried_trust(m: fmt.Manifest, same: dict[str, str], fingerprints: dict[str, str]):
    """The ``trusted_decoder`` record of a generation that reuses records of cache ``m``: the
    other decoder whose pixels it keeps (``m``'s own, or the one ``m`` already trusted)."""
    if same["decoder"] != fingerprints["decoder"]:
        return _trust_record(m.decoder)
    return m.extra.get("trusted_decoder")


def _is_current(previous: fmt.CacheFiles, fingerprints: dict[str, str]) -> bool:
    m = previous.manifest
    # A file that changed while it was decoded was skipped, yet may read the same as when listed
    # (restored with its mtime): such a cache is never current, so the next build retries it.
    retry = any(e.get("state") == fmt.BAD_SOURCE_CHANGED for e in m.skipped)
    return (
        all(m.fingerprints.get(k) == v for k, v in fingerprints.items())
        and bool((previous.state["state"] != fmt.EMPTY).all())
        and not retry
    )


@dataclass
class _Plan:
    """Per-record shapes and offsets in the new data file, and what to do for each record."""

    shapes: np.ndarray  # (N, 3) int64; 0 where unknown from the header
    offsets: np.ndarray  # uint64
    data_bytes: int
    state: np.ndarray  # fmt codes: EMPTY = to decode, BAD_* = refused before decoding


def plan_layout(listing: Listing, opts: Options) -> _Plan:
    """Shapes from headers (no decoding) and the offsets they give, in listing order."""
    return layout_from_sizes(probe_sizes(listing), opts)


def probe_sizes(listing: Listing, progress: ProgressFn | None = None) -> np.ndarray:
    """Native ``(height, width)`` of each listed file from its header; ``(0, 0)`` if unreadable."""
    n = len(listing)
    hw = np.zeros((n, 2), np.int64)
    for i in range(n):
        try:
            size = probe_size(listing.abspath(i))
        except OSError:
            size = None
        if size is not None:
            hw[i] = size
        # ~15 us per probe: a call every 4096 files costs nothing and updates a bar 15x a second.
        if progress is not None and ((i + 1) % 4096 == 0 or i + 1 == n):
            progress(i + 1, n)
    return hw


def layout_from_sizes(hw: np.ndarray, opts: Options) -> _Plan:
    """The layout of records of native sizes ``hw`` (as ``probe_sizes`` gives) under ``opts``."""
    n = len(hw)
    shapes = np.zeros((n, 3), np.int64)
    state = np.full(n, fmt.EMPTY, np.uint32)
    known = hw[:, 0] > 0
    too_large = known & (hw[:, 0] * hw[:, 1] > opts.max_pixels)
    state[too_large] = fmt.BAD_TOO_LARGE
    ok = known & ~too_large
    if ok.any():
        # Files share sizes (a camera's few resolutions), so each distinct size is shaped once;
        # one int64 key per size sorts ~10x faster than np.unique(axis=0) on the pairs.
        keys, inverse = np.unique(hw[ok, 0] << 32 | hw[ok, 1], return_inverse=True)
        shaped = np.array([opts.output_shape(int(k >> 32), int(k & 0xFFFFFFFF)) for k in keys])
        shapes[ok] = shaped.reshape(-1, 3)[inverse.reshape(-1)]
    offsets, data_bytes = fmt.layout_offsets(np.prod(shapes, axis=1))
    return _Plan(shapes, offsets, data_bytes, state)


def _build(
    listing: Listing,
    opts: Options,
    folder: Path,
    previous: fmt.CacheFiles | None,
    fingerprints: dict[str, str],
    workers: int | None,
    strict: bool,
    progress: ProgressFn | None,
    force: bool = False,
    same: dict[str, str] | None = None,
) -> BuildReport:
    """Write and publish a new generation; ``same`` are the fingerprints a previous cache's
    records must match to be reused (``fingerprints`` unless its decoder is trusted)."""
    same = fingerprints if same is None else same
    _remove_stale_generations(folder, previous)
    plan = plan_layout(listing, opts)
    # Before anything is written: the whole new generation, while the old one stays on disk.
    kept = [listing.paths[i] for i in np.flatnonzero(plan.state == fmt.EMPTY)]
    check_free_space(folder, disk_bytes(generation_sizes(kept, plan.data_bytes)), force)
    n = len(listing)
    gen = fmt.new_generation()
    data_path = folder / fmt.file_name("data", gen)
    crcs = np.zeros(n, np.uint32)
    state = plan.state.copy()
    messages: dict[int, str] = {}
    overflow: dict[int, np.ndarray] = {}
    reuse = _reusable(previous, listing, same)
    _carry_skips(previous, listing, same, state, messages)
    try:
        with open(data_path, "wb") as f:
            f.truncate(plan.data_bytes)  # sparse until written
        reused = _copy_reused(previous, reuse, plan, data_path, crcs, state)
        todo = [i for i in range(n) if state[i] == fmt.EMPTY]
        jobs = [
            [
                (
                    i,
                    listing.abspath(i),
                    int(plan.offsets[i]),
                    tuple(int(v) for v in plan.shapes[i]),
                    int(listing.sizes[i]),
                    int(listing.mtimes[i]),
                )
                for i in todo[k : k + CHUNK]
            ]
            for k in range(0, len(todo), CHUNK)
        ]
        done = 0
        for results in _run_jobs(jobs, str(data_path), opts, workers):
            for i, code, crc, message, pixels in results:
                state[i], crcs[i] = code, crc
                if message:
                    messages[i] = message
                if pixels is not None:
                    overflow[i] = pixels
            done += len(results)
            if progress is not None:
                progress(done, len(todo))
        keep = np.flatnonzero(state == fmt.FILLED)
        skipped = [
            {
                "path": listing.paths[i],
                "reason": messages.get(i) or fmt.BAD_REASONS[int(state[i])],
                "size": int(listing.sizes[i]),
                "mtime_ns": int(listing.mtimes[i]),
                "state": int(state[i]),
            }
            for i in np.flatnonzero(state != fmt.FILLED)
        ]
        if strict and skipped:
            names = "; ".join(f"{s['path']}: {s['reason']}" for s in skipped[:5])
            more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
            raise StrictBuildError(
                f"{listing.root}: {len(skipped)} file(s) could not be decoded: {names}{more}"
            )
        offsets, data_bytes = plan.offsets.copy(), plan.data_bytes
        if overflow:
            data_bytes = _append_overflow(data_path, overflow, plan, offsets, data_bytes)
        warnings = [
            {"path": listing.paths[i], "reason": messages[i]} for i in keep if i in messages
        ]
        manifest = _write_generation(
            folder,
            gen,
            listing,
            opts,
            plan,
            offsets,
            data_bytes,
            keep,
            crcs,
            fingerprints,
            skipped,
            warnings,
        )
        trusted = _carried_trust(previous.manifest, same, fingerprints) if reused else None
        if trusted is not None:
            manifest.extra["trusted_decoder"] = trusted
        fmt.write_manifest(manifest)  # the commit point
    except BaseException as e:
        if _published(folder) == gen:  # failed after the commit point (flushing the folder)
            raise
        _remove_generation(folder, gen)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpaceError(
                f"{folder}: the disk is full ({e.strerror}); the cache needs "
                f"{plan.data_bytes:,} bytes of pixels. Nothing was published; the previous "
                "cache, if any, is intact"
            ) from None
        raise
    if previous is not None:
        _remove_generation(folder, previous.manifest.generation)
    return BuildReport(
        cache=folder,
        images=len(keep),
        classes=len(listing.classes),
        bytes=data_bytes,
        seconds=0.0,
        decoded=len(todo),
        reused=reused,
        dropped=0 if previous is None else previous.manifest.count - reused,
        skipped=skipped,
        warnings=warnings,
    )


def _published(folder: Path) -> str | None:
    """The generation the folder's manifest names now, or None."""
    try:
        return fmt.read_manifest(folder).generation
    except CacheError:
        return None


def _reusable(
    previous: fmt.CacheFiles | None, listing: Listing, fingerprints: dict[str, str]
) -> dict[int, int]:
    """New record -> old record, for files unchanged since a previous cache with equal options."""
    if previous is None:
        return {}
    m = previous.manifest
    if any(m.fingerprints.get(k) != fingerprints[k] for k in ("options", "decoder")):
        return {}
    old = previous.index
    filled = previous.state["state"] == fmt.FILLED
    by_path = {previous.path(j): j for j in range(len(old)) if filled[j]}
    reuse = {}
    for i, rel in enumerate(listing.paths):
        j = by_path.get(rel)
        if j is not None and (
            int(old[j]["source_size"]) == int(listing.sizes[i])
            and int(old[j]["source_mtime_ns"]) == int(listing.mtimes[i])
        ):
            reuse[i] = j
    return reuse


def _carry_skips(
    previous: fmt.CacheFiles | None,
    listing: Listing,
    fingerprints: dict[str, str],
    state: np.ndarray,
    messages: dict[int, str],
) -> None:
    """Keep skipping files the previous build skipped, if they and the options are unchanged."""
    if previous is None or any(
        previous.manifest.fingerprints.get(k) != fingerprints[k] for k in ("options", "decoder")
    ):
        return
    stats = {
        e["path"]: (e.get("size"), e.get("mtime_ns"), e["reason"])
        for e in previous.manifest.skipped
        if e.get("state") != fmt.BAD_SOURCE_CHANGED  # it may be whole now: decode it again
    }
    for i, rel in enumerate(listing.paths):
        old = stats.get(rel)
        if old and (old[0], old[1]) == (int(listing.sizes[i]), int(listing.mtimes[i])):
            state[i] = fmt.BAD_UNDECODABLE
            messages[i] = old[2]


def _copy_reused(
    previous: fmt.CacheFiles | None,
    reuse: dict[int, int],
    plan: _Plan,
    data_path: Path,
    crcs: np.ndarray,
    state: np.ndarray,
) -> int:
    """Copy unchanged records' pixels from the previous data file; returns how many."""
    if not reuse:
        return 0
    old = previous.index
    src_fd = os.open(previous.manifest.file("data"), os.O_RDONLY)
    dst_fd = os.open(data_path, os.O_WRONLY)
    try:
        count = 0
        for i, j in reuse.items():
            shape = (int(old[j]["height"]), int(old[j]["width"]), int(old[j]["channels"]))
            if shape != tuple(int(v) for v in plan.shapes[i]):
                continue  # the header now predicts another size: decode it again
            nbytes = shape[0] * shape[1] * shape[2]
            src, dst = int(old[j]["offset"]), int(plan.offsets[i])
            while nbytes:
                k = os.copy_file_range(src_fd, dst_fd, nbytes, src, dst)
                if k == 0:
                    raise OSError(errno.EIO, "short copy from the previous cache")
                src, dst, nbytes = src + k, dst + k, nbytes - k
            crcs[i] = previous.state[j]["crc32"]
            state[i] = fmt.FILLED
            count += 1
        return count
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _append_overflow(
    data_path: Path,
    overflow: dict[int, np.ndarray],
    plan: _Plan,
    offsets: np.ndarray,
    data_bytes: int,
) -> int:
    """Append records whose header did not predict their size after the planned region."""
    with open(data_path, "r+b") as f:
        end = fmt.aligned(data_bytes)
        for i in sorted(overflow):
            pixels = overflow[i]
            plan.shapes[i] = pixels.shape
            offsets[i] = end
            f.seek(end)
            f.write(pixels.tobytes())
            data_bytes = end + pixels.nbytes
            end = fmt.aligned(data_bytes)
    return data_bytes


def _write_generation(
    folder: Path,
    gen: str,
    listing: Listing,
    opts: Options,
    plan: _Plan,
    offsets: np.ndarray,
    data_bytes: int,
    keep: np.ndarray,
    crcs: np.ndarray,
    fingerprints: dict[str, str],
    skipped: list[dict[str, str]],
    warnings: list[dict[str, str]],
    mode: str = "build",
    state_codes: np.ndarray | None = None,
) -> fmt.Manifest:
    """Write index, state and paths for records ``keep``, flush all four files to disk."""
    paths = [listing.paths[i].encode("utf-8", "surrogateescape") for i in keep]
    lengths = np.array([len(p) for p in paths], np.uint64)
    index = np.zeros(len(keep), fmt.INDEX_DTYPE)
    index["offset"] = offsets[keep]
    index["path_offset"] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(keep) else 0
    index["path_length"] = lengths
    index["source_size"] = listing.sizes[keep]
    index["source_mtime_ns"] = listing.mtimes[keep]
    index["height"], index["width"], index["channels"] = plan.shapes[keep].T
    index["label"] = listing.labels[keep]
    state = np.zeros(len(keep), fmt.STATE_DTYPE)
    state["crc32"] = crcs[keep]
    state["state"] = fmt.FILLED if state_codes is None else state_codes[keep]
    blobs = {"index": index.tobytes(), "state": state.tobytes(), "paths": b"".join(paths)}
    for kind, blob in blobs.items():
        with open(folder / fmt.file_name(kind, gen), "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    with open(folder / fmt.file_name("data", gen), "r+b") as f:
        f.truncate(data_bytes)
        os.fsync(f.fileno())
    sizes = {kind: len(blob) for kind, blob in blobs.items()}
    sizes["data"] = data_bytes
    return fmt.Manifest(
        path=folder,
        generation=gen,
        count=len(keep),
        mode=mode,
        source=listing.source_json(),
        options=opts.to_json(),
        classes=listing.classes,
        skipped=skipped,
        warnings=warnings,
        fingerprints=fingerprints,
        decoder=decoder_versions(),
        sizes=sizes,
        extra={
            "mmcache_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )


def _remove_generation(folder: Path, gen: str) -> None:
    for kind in fmt.FILE_KINDS:
        with suppress(FileNotFoundError):
            os.unlink(folder / fmt.file_name(kind, gen))


def _remove_stale_generations(folder: Path, current: fmt.CacheFiles | None) -> None:
    """Delete files left by builds that were killed (we hold the writer lock, so none is live)."""
    keep = set() if current is None else {current.manifest.file(k).name for k in fmt.FILE_KINDS}
    for name in os.listdir(folder):
        if (
            fmt.is_cache_file_name(name)
            and name not in keep
            and name not in (fmt.MANIFEST_NAME, fmt.LOCK_NAME)
        ):
            with suppress(FileNotFoundError):
                os.unlink(folder / name)


# --- decode workers -------------------------------------------------------------------------

Job = tuple[int, str, int, tuple[int, int, int], int, int]
Result = tuple[int, int, int, str, "np.ndarray | None"]

_worker: dict = {}


def _init_worker(data_path: str, options: dict, in_process: bool = False) -> None:
    if not in_process:
        # Ctrl-C goes to the whole process group; the parent alone decides to stop, then
        # terminates the pool, so workers must not die first in the middle of a pwrite.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cv2.setNumThreads(1)  # one decode per core: parallelism comes from the processes
    _worker["fd"] = os.open(data_path, os.O_WRONLY)
    _worker["options"] = Options.from_json(options)
    _worker["stderr"] = StderrCapture()


def _close_worker() -> None:
    os.close(_worker.pop("fd"))
    _worker.pop("stderr").close()


def _decode_chunk(jobs: list[Job]) -> list[Result]:
    return [_decode_one(*job) for job in jobs]


def _decode_one(
    i: int, path: str, offset: int, shape: tuple[int, int, int], size: int, mtime_ns: int
) -> Result:
    opts: Options = _worker["options"]
    capture: StderrCapture = _worker["stderr"]
    try:
        before = os.stat(path)
    except OSError:
        return i, fmt.BAD_SOURCE_CHANGED, 0, "vanished since it was listed", None
    if (before.st_size, before.st_mtime_ns) != (size, mtime_ns):
        return i, fmt.BAD_SOURCE_CHANGED, 0, "changed since it was listed", None
    with capture:
        img = cv2.imread(path, read_flags(opts))
    message = capture.text()
    if img is None:
        if _stat_key(path) != (size, mtime_ns):  # gone or rewritten while read: not its fault
            return i, fmt.BAD_SOURCE_CHANGED, 0, "changed or vanished while it was decoded", None
        return i, fmt.BAD_UNDECODABLE, 0, message or fmt.BAD_REASONS[fmt.BAD_UNDECODABLE], None
    if img.shape[0] * img.shape[1] > opts.max_pixels:
        return i, fmt.BAD_TOO_LARGE, 0, f"{img.shape[1]}x{img.shape[0]} pixels", None
    pixels = np.ascontiguousarray(preprocess(img, opts))
    if _stat_key(path) != (size, mtime_ns):
        return i, fmt.BAD_SOURCE_CHANGED, 0, "changed while it was decoded", None
    crc = zlib.crc32(pixels)
    if pixels.shape != shape:
        return i, fmt.FILLED, crc, message, pixels  # header lied or was unreadable: overflow
    written = os.pwrite(_worker["fd"], pixels, offset)
    if written != pixels.nbytes:
        raise OSError(errno.ENOSPC, "short write to the data file")
    return i, fmt.FILLED, crc, message, None


def _stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _run_jobs(
    jobs: list[list[Job]], data_path: str, opts: Options, workers: int | None
) -> Iterator[list[Result]]:
    """Decode ``jobs`` in worker processes (in this process for one worker), as they finish."""
    workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    if workers == 1:
        _init_worker(data_path, opts.to_json(), in_process=True)
        try:
            for chunk in jobs:
                yield _decode_chunk(chunk)
        finally:
            _close_worker()
        return
    # forkserver: workers start from a clean process (no inherited threads or locks from
    # torch or OpenCV in the parent), and the server forks them quickly after the first time.
    ctx = multiprocessing.get_context("forkserver")
    pool = ctx.Pool(workers, initializer=_init_worker, initargs=(data_path, opts.to_json()))
    try:
        yield from pool.imap_unordered(_decode_chunk, jobs)
        pool.close()
    except BaseException:
        pool.terminate()  # Ctrl-C or an error: stop the workers now, not after their queue
        raise
    finally:
        pool.join()
