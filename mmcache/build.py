"""Building a cache: scan the source, plan the layout from headers, decode in parallel, publish.

A build writes a new generation of files inside the cache folder and publishes it by replacing
``manifest.json`` atomically (see ``mmcache.format``), so a build stopped at any point leaves the
previous cache untouched and nothing a reader would accept. The layout (every record's offset)
is planned from the files' headers before decoding, so decode workers write their records in
place with ``pwrite`` and send back only a few numbers; pixels never cross a pipe. A file whose
header does not predict its decoded size (rare: a malformed header) is decoded, sent back and
appended after the planned records.

``create_lazy_cache`` publishes the same layout without decoding (mode ``"lazy"``): records stay
``EMPTY`` until ``MemmapImageDataset`` fills them on first read, with ``RecordFiller``. Only files
whose header cannot be read are decoded at creation, because their record's size, hence every
later offset, is unknown until then; they land where the build puts them, after the planned
records, so a lazy cache once full is record for record the cache a build makes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import format as fmt
from ._version import __version__
from ._workers import CHUNK, Job, Result, run_jobs
from .decode import (
    Options,
    decode_record,
    decoder_accepted,
    decoder_fingerprint,
    decoder_versions,
)
from .errors import (
    CacheError,
    CacheFormatError,
    CacheNotFoundError,
    DestinationError,
    InsufficientSpaceError,
    NotACacheError,
    OptionsChangedError,
    SourceError,
    StrictBuildError,
)
from .probe import probe_size
from .scan import Listing, scan_source
from .space import check_free_space, disk_bytes, generation_sizes

ProgressFn = Callable[[int, int], None]

logger = logging.getLogger(__name__)


@dataclass
class BuildReport:
    """What a build did. ``up_to_date`` means it found the cache current and did nothing.

    ``decoded``: files decoded into records now (files that failed count in ``skipped``);
    ``reused``: records carried over from the previous cache without decoding; ``dropped``:
    records of the previous cache whose pixels were discarded, of which ``removed`` because
    their file left the source; ``changed`` counts the decoded files that had a record there
    (modified since, or the cache replaced with other options). ``images`` counts the
    records with pixels; a lazy cache's records still to be filled count in ``pending``.
    ``seconds`` is the whole build, ``decode_seconds`` the decoding alone. ``ignored``: folders
    inside the source left out because they hold a cache (see ``scan_source``).
    """

    cache: Path
    images: int
    classes: int
    bytes: int
    seconds: float
    decoded: int = 0
    reused: int = 0
    dropped: int = 0
    removed: int = 0
    changed: int = 0
    up_to_date: bool = False
    trusted_decoder: bool = False
    pending: int = 0
    decode_seconds: float = 0.0
    skipped: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        """Decoding rate: files decoded per second of decoding."""
        return self.decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0


def preprocessing_options(
    *,
    size: tuple[int, int] | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
    interpolation: str = "auto",
    color: str = "rgb",
    max_pixels: int | None = None,
    reduced_decode: bool = False,
) -> Options:
    """``Options`` from the keywords ``build_cache`` takes (``max_pixels=None``: the default)."""
    return Options(
        size=size,
        max_side=max_side,
        short_side=short_side,
        interpolation=interpolation,
        color=color,
        reduced_decode=reduced_decode,
        **({} if max_pixels is None else {"max_pixels": max_pixels}),
    )


def build_cache(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    *,
    size: tuple[int, int] | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
    interpolation: str = "auto",
    color: str = "rgb",
    max_pixels: int | None = None,
    reduced_decode: bool = False,
    workers: int | None = None,
    strict: bool = False,
    progress: ProgressFn | None = None,
    force: bool = False,
    trust_decoder: bool = False,
    replace: bool = False,
    distributed: bool | None = None,
    dist_timeout: float = 1800.0,
) -> BuildReport:
    """Decode every image of ``source`` once into the cache folder ``cache``.

    An unchanged source with the same options is a no-op (``report.up_to_date``); a changed
    source decodes only new and modified files and carries the rest over (``report.reused``).
    A lazy cache is completed: its filled records are carried over, the rest decoded.

    Args:
        source: an ImageFolder-style folder, a flat folder of images, or a ``path,label`` list
            (or its ``Listing``, from ``scan_source``).
        cache: the cache folder to create or update.
        size: exact ``(width, height)``; or ``max_side`` / ``short_side`` to bound a side while
            keeping the aspect ratio (never upscaling). Default: native size.
        interpolation: ``"auto"`` (INTER_AREA to shrink), ``"area"``, ``"linear"``, ``"cubic"``,
            ``"lanczos"`` or ``"nearest"``.
        color: ``"rgb"``, ``"bgr"`` or ``"gray"``.
        max_pixels: refuse larger images without decoding them (default: Pillow's bomb limit).
        reduced_decode: decode JPEGs shrunk 2x or more at reduced scale: faster, but not the
            exact reference pixels (see ``Options``).
        workers: decode processes (default: all cores); 0 decodes in this process, without
            the protection from decoder crashes (for debuggers and profilers).
        strict: fail, leaving no new cache, if any file cannot be decoded.
        progress: called as ``progress(done, total)`` while decoding (in a distributed build,
            for this rank's share).
        force: start even when the destination lacks the free space the cache needs.
        trust_decoder: keep a cache made by another decoder version (its pixels may differ
            slightly from what this machine decodes) instead of decoding everything again, and
            record that choice in its manifest as ``"trusted_decoder"``.
        replace: rebuild a cache made with other preprocessing options; without it such a
            build raises ``OptionsChangedError`` naming the options, and changes nothing.
        distributed: build with every rank of the initialised ``torch.distributed`` process
            group (see ``mmcache.distributed``); every rank must then call ``build_cache`` with
            the same arguments, and every rank gets the same report or error. ``None`` (the
            default) does so when a group of more than one process is initialised.
        dist_timeout: in a distributed build, seconds a rank waits for the others at each step
            (rank 0 planning, the slowest share) before the build fails.

    Example:
        >>> report = build_cache("data/train", "cache/train", short_side=256)  # doctest: +SKIP
        >>> report.images, report.skipped  # doctest: +SKIP

    Raises:
        SourceError: no source, or no image of it could be decoded (nothing is published).
        OptionsChangedError: the cache there has other options, and ``replace`` is False.
        NotACacheError, DestinationError, StrictBuildError, InsufficientSpaceError,
        DistributedBuildError, DecodeWorkerError.
    """
    opts = preprocessing_options(
        size=size,
        max_side=max_side,
        short_side=short_side,
        interpolation=interpolation,
        color=color,
        max_pixels=max_pixels,
        reduced_decode=reduced_decode,
    )
    if _in_process_group(distributed):
        from .distributed import build_distributed

        return build_distributed(
            source,
            cache,
            opts,
            workers=workers,
            strict=strict,
            progress=progress,
            force=force,
            trust_decoder=trust_decoder,
            replace=replace,
            timeout=dist_timeout,
        )
    return _update(
        source,
        cache,
        opts,
        workers=workers,
        strict=strict,
        progress=progress,
        force=force,
        trust_decoder=trust_decoder,
        replace=replace,
    )


def create_lazy_cache(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    *,
    size: tuple[int, int] | None = None,
    max_side: int | None = None,
    short_side: int | None = None,
    interpolation: str = "auto",
    color: str = "rgb",
    max_pixels: int | None = None,
    reduced_decode: bool = False,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    force: bool = False,
    replace: bool = False,
) -> BuildReport:
    """Create a lazy cache of ``source`` at once, without decoding: records fill on first read.

    The layout is planned from the files' headers, the data file allocated sparse, and every
    record published ``EMPTY``; ``MemmapImageDataset`` then fills records as they are read.
    A cache already there with the same source and options is left as it is (lazy or built,
    ``report.up_to_date``); one made from an older listing becomes a new lazy generation that
    carries over the filled records of unchanged files (``report.reused``); a cache of other
    options is replaced only with ``replace``. Files whose header cannot be read are decoded
    now (``report.decoded``). Files
    refused from their header (over ``max_pixels``) are left out, as a build leaves them.
    Arguments are those of ``build_cache``.

    Example:
        >>> report = create_lazy_cache("data/train", "cache/lazy", short_side=256)  # doctest: +SKIP
        >>> report.pending  # doctest: +SKIP

    Raises:
        SourceError, OptionsChangedError, NotACacheError, DestinationError,
        InsufficientSpaceError.
    """
    opts = preprocessing_options(
        size=size,
        max_side=max_side,
        short_side=short_side,
        interpolation=interpolation,
        color=color,
        max_pixels=max_pixels,
        reduced_decode=reduced_decode,
    )
    return _update(
        source, cache, opts, lazy=True, workers=workers, progress=progress, force=force,
        replace=replace,
    )  # fmt: skip


def _update(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    opts: Options,
    *,
    lazy: bool = False,
    workers: int | None,
    strict: bool = False,
    progress: ProgressFn | None,
    force: bool,
    trust_decoder: bool = False,
    replace: bool,
) -> BuildReport:
    """Build (or, ``lazy``, lay out) a new generation unless the cache is current already.

    The single-process path; ``mmcache.distributed`` runs the same steps with the decoding
    shared out among the ranks.
    """
    start = time.perf_counter()
    with _session(source, cache, opts, trust_decoder, lazy, replace) as s:
        report = _up_to_date_report(s)
        if report is None:
            g = _allocate(s, opts, force)
            with _discarded_on_failure(g):
                decoding = time.perf_counter()
                g.record(_decode_records(g.jobs(g.todo), g.data_path, opts, workers, progress))
                decode_seconds = time.perf_counter() - decoding
                manifest, report = _finish(g, s, opts, strict)
                _publish(s, manifest)
            report.decode_seconds = decode_seconds
    report.seconds = time.perf_counter() - start
    return report


def _in_process_group(distributed: bool | None) -> bool:
    """Whether to build with every rank of torch.distributed's default process group."""
    if distributed is False:
        return False
    # No torch in sys.modules means no process group: do not pay ~1 s to import it to find out.
    dist = sys.modules.get("torch.distributed")
    active = dist is not None and dist.is_available() and dist.is_initialized()
    if distributed and not active:
        raise ValueError(
            "distributed=True needs an initialised torch.distributed process group "
            "(run under torchrun and call torch.distributed.init_process_group first)"
        )
    return active and dist.get_world_size() > 1


@dataclass
class _Session:
    """A build holding the cache's writer lock: the listing, the cache found there, fingerprints.

    ``same`` are the fingerprints the previous cache must match to be current or to lend its
    records: ``fingerprints``, but with its own decoder's when the user trusts that decoder.
    ``lazy``: lay out a lazy cache (decode only the records of unknown size) instead of a build.
    """

    listing: Listing
    folder: Path
    previous: fmt.CacheFiles | None
    fingerprints: dict[str, str]
    same: dict[str, str]
    lazy: bool = False


@contextmanager
def _session(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    opts: Options,
    trust_decoder: bool,
    lazy: bool = False,
    replace: bool = False,
) -> Iterator[_Session]:
    """Scan the source, check the destination, and hold its writer lock while the build runs.

    A cache there made with other options is refused unless ``replace``.
    """
    listing = source if isinstance(source, Listing) else scan_source(source)
    folder = Path(cache).expanduser().absolute()
    created = _prepare_folder(folder)
    try:
        with _locked(folder):
            previous = _read_previous(folder)
            if previous is not None and not replace:
                _refuse_other_options(previous.manifest, opts)
            # Before the up-to-date check: a build that finds the cache current also clears
            # what killed builds left behind.
            _remove_stale_generations(folder, previous)
            fingerprints = {
                "listing": listing.fingerprint(),
                "options": opts.fingerprint(),
                "decoder": decoder_fingerprint(),
            }
            same = fingerprints
            if previous is not None:
                same = _decoder_trust(previous.manifest, fingerprints, trust_decoder)
            yield _Session(listing, folder, previous, fingerprints, same, lazy)
    except BaseException:
        if created:  # a first build that failed leaves no folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise


def _refuse_other_options(m: fmt.Manifest, opts: Options) -> None:
    """OptionsChangedError if cache ``m`` was made with other preprocessing than ``opts``."""
    if m.fingerprints.get("options") == opts.fingerprint():
        return
    try:
        built_with = Options.from_json(m.options).describe()
    except (TypeError, ValueError):
        built_with = f"options this mmcache cannot read ({m.options})"
    raise OptionsChangedError(
        f"{m.path}: the cache there was made with {built_with}; this build asks for "
        f"{opts.describe()}, which would decode every image again and replace all "
        f"{m.count:,} records. Repeat the options it was made with, or pass --replace "
        "(replace=True) to rebuild it with the new ones"
    )


def _up_to_date_report(s: _Session) -> BuildReport | None:
    """The report of a build that has nothing to do, or None if the cache must be (re)built."""
    if s.previous is None or not _is_current(s.previous, s.listing, s.same, s.lazy):
        return None
    m = s.previous.manifest
    report = _current_report(s.previous)
    report.ignored = list(s.listing.ignored)
    report.trusted_decoder = not decoder_accepted(
        m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")
    )
    if report.trusted_decoder:
        m.extra["trusted_decoder"] = _trust_record(decoder_versions())
        fmt.write_manifest(m)
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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another build of %s to finish (it holds the lock)", folder)
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


def _is_current(
    previous: fmt.CacheFiles, listing: Listing, fingerprints: dict[str, str], lazy: bool
) -> bool:
    """Same source, listing, options and decoder; and, for a build, no record left to fill."""
    m = previous.manifest
    # A file that changed while it was decoded was skipped, yet may read the same as when listed
    # (restored with its mtime): such a cache is never current, so the next build retries it.
    retry = any(e.get("state") == fmt.BAD_SOURCE_CHANGED for e in m.skipped)
    return (
        m.source == listing.source_json()
        and all(m.fingerprints.get(k) == v for k, v in fingerprints.items())
        and (lazy or bool((previous.state["state"] != fmt.EMPTY).all()))
        and not retry
    )


def _current_report(previous: fmt.CacheFiles) -> BuildReport:
    """The report of a build that found ``previous`` current and did nothing."""
    m = previous.manifest
    codes = previous.state["state"]
    # A lazy cache keeps files found bad while filling as BAD records (a build leaves them out).
    bad = [
        {"path": previous.path(i), "reason": fmt.BAD_REASONS[int(codes[i])]}
        for i in np.flatnonzero(codes > fmt.FILLED)
    ]
    return BuildReport(
        cache=m.path,
        images=int((codes == fmt.FILLED).sum()),
        classes=len(m.classes),
        bytes=m.sizes["data"],
        seconds=0.0,
        up_to_date=True,
        pending=int((codes == fmt.EMPTY).sum()),
        skipped=m.skipped + bad,
        warnings=m.warnings,
    )


@dataclass
class _Plan:
    """Per-record shapes and offsets in the new data file, and what to do for each record."""

    shapes: np.ndarray  # (N, 3) int64; 0 where unknown from the header
    offsets: np.ndarray  # uint64
    data_bytes: int
    state: np.ndarray  # fmt codes: EMPTY = to decode, BAD_* = refused before decoding
    pixels: np.ndarray  # (N,) int64 source pixels from the header (the decode cost); 0 = unknown


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
    if opts.size is not None:
        # The stored shape needs no header; decoding checks the rest (and the pixel limit).
        shapes[~known] = opts.output_shape(1, 1)
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
    return _Plan(shapes, offsets, data_bytes, state, hw[:, 0] * hw[:, 1])


@dataclass
class _Generation:
    """A new generation being written: its layout, and every record's outcome so far."""

    folder: Path
    gen: str
    listing: Listing
    plan: _Plan
    state: np.ndarray
    crcs: np.ndarray
    messages: dict[int, str]
    overflow: dict[int, np.ndarray]
    reused: int
    todo: list[int]  # records to decode, in listing order

    @property
    def data_path(self) -> Path:
        return self.folder / fmt.file_name("data", self.gen)

    def jobs(self, records: Iterable[int]) -> list[list[Job]]:
        """Decode jobs for ``records``, in chunks of ``CHUNK``."""
        listing, plan = self.listing, self.plan
        flat = [
            (
                i,
                listing.abspath(i),
                int(plan.offsets[i]),
                tuple(int(v) for v in plan.shapes[i]),
                int(listing.sizes[i]),
                int(listing.mtimes[i]),
            )
            for i in records
        ]
        return [flat[k : k + CHUNK] for k in range(0, len(flat), CHUNK)]

    def record(self, results: Iterable[Result]) -> None:
        """Take decode results: state, crc, decoder message, overflow pixels."""
        for i, code, crc, message, pixels in results:
            self.state[i], self.crcs[i] = code, crc
            if message:
                self.messages[i] = message
            if pixels is not None:
                self.overflow[i] = pixels


def _allocate(s: _Session, opts: Options, force: bool) -> _Generation:
    """Plan the layout, create the new generation's (sparse) data file, copy reused records."""
    listing = s.listing
    plan = plan_layout(listing, opts)
    # Before anything is written: the whole new generation, while the old one stays on disk.
    kept = [listing.paths[i] for i in np.flatnonzero(plan.state == fmt.EMPTY)]
    check_free_space(s.folder, disk_bytes(generation_sizes(kept, plan.data_bytes)), force)
    n = len(listing)
    g = _Generation(
        folder=s.folder,
        gen=fmt.new_generation(),
        listing=listing,
        plan=plan,
        state=plan.state.copy(),
        crcs=np.zeros(n, np.uint32),
        messages={},
        overflow={},
        reused=0,
        todo=[],
    )
    _carry_skips(s.previous, listing, s.same, g.state, g.messages)
    with _discarded_on_failure(g):
        with open(g.data_path, "wb") as f:
            f.truncate(plan.data_bytes)  # sparse until written
        reuse = _reusable(s.previous, listing, s.same)
        g.reused = _copy_reused(s.previous, reuse, plan, g.data_path, g.crcs, g.state)
    # A lazy cache decodes now only the records whose size, hence every later offset, is unknown.
    g.todo = [i for i in range(n) if g.state[i] == fmt.EMPTY and not (s.lazy and plan.shapes[i, 0])]
    return g


@contextmanager
def _discarded_on_failure(g: _Generation) -> Iterator[None]:
    """Delete the new generation's files if anything fails (or is interrupted) inside, unless
    it failed after publishing them (``_publish`` runs inside, so that a disk that fills up while
    the manifest is written discards the new generation and reads as InsufficientSpaceError)."""
    try:
        yield
    except BaseException as e:
        if _published(g.folder) == g.gen:  # failed after the commit point (flushing the folder)
            raise
        _remove_generation(g.folder, g.gen)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InsufficientSpaceError(
                f"{g.folder}: the disk is full ({e.strerror}); the cache needs "
                f"{g.plan.data_bytes:,} bytes of pixels. Nothing was published; the previous "
                "cache, if any, is intact"
            ) from None
        raise


def _decode_records(
    jobs: list[list[Job]],
    data_path: Path,
    opts: Options,
    workers: int | None,
    progress: ProgressFn | None,
) -> Iterator[Result]:
    """Decode ``jobs`` into ``data_path``; yields each record's result as its chunk finishes."""
    total = sum(len(chunk) for chunk in jobs)
    done = 0
    for results in run_jobs(jobs, str(data_path), opts, workers):
        yield from results
        done += len(results)
        if progress is not None:
            progress(done, total)


def _finish(
    g: _Generation, s: _Session, opts: Options, strict: bool
) -> tuple[fmt.Manifest, BuildReport]:
    """Check strictness, place overflow records, write and flush the generation's files."""
    listing, plan, state = g.listing, g.plan, g.state
    # A lazy cache keeps its EMPTY records: filling them is the readers' job.
    kept = (state == fmt.FILLED) | ((state == fmt.EMPTY) if s.lazy else False)
    keep = np.flatnonzero(kept)
    skipped = [
        {
            "path": listing.paths[i],
            "reason": g.messages.get(i) or fmt.BAD_REASONS[int(state[i])],
            "size": int(listing.sizes[i]),
            "mtime_ns": int(listing.mtimes[i]),
            "state": int(state[i]),
        }
        for i in np.flatnonzero(~kept)
    ]
    if skipped and (strict or not len(keep)):
        names = "; ".join(f"{e['path']}: {e['reason']}" for e in skipped[:5])
        more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
        if strict:
            raise StrictBuildError(
                f"{listing.root}: {len(skipped)} file(s) could not be decoded: {names}{more}"
            )
        raise SourceError(
            f"{listing.root}: none of its {len(skipped):,} images could be cached, so nothing "
            f"was published: {names}{more}"
        )
    offsets, data_bytes = plan.offsets.copy(), plan.data_bytes
    if g.overflow:
        data_bytes = _append_overflow(g.data_path, g.overflow, plan, offsets, data_bytes)
    warnings = [
        {"path": listing.paths[i], "reason": g.messages[i]} for i in keep if i in g.messages
    ]
    manifest = _write_generation(
        g.folder,
        g.gen,
        listing,
        opts,
        plan,
        offsets,
        data_bytes,
        keep,
        g.crcs,
        s.fingerprints,
        skipped,
        warnings,
        mode="lazy" if s.lazy else "build",
        state_codes=state,
    )
    previous = s.previous
    trusted = _carried_trust(previous.manifest, s.same, s.fingerprints) if g.reused else None
    if trusted is not None:
        manifest.extra["trusted_decoder"] = trusted
    had_pixels = removed = changed = 0
    if previous is not None:
        filled = previous.state["state"] == fmt.FILLED
        had_pixels = int(filled.sum())
        old_paths = {previous.path(int(j)) for j in np.flatnonzero(filled)}
        removed = len(old_paths - set(listing.paths))
        changed = sum(listing.paths[i] in old_paths for i in g.todo)
    report = BuildReport(
        cache=g.folder,
        images=int((state == fmt.FILLED).sum()),
        classes=len(listing.classes),
        bytes=data_bytes,
        seconds=0.0,
        decoded=int((state[g.todo] == fmt.FILLED).sum()) if g.todo else 0,
        reused=g.reused,
        dropped=had_pixels - g.reused,
        removed=removed,
        changed=changed,
        ignored=list(listing.ignored),
        pending=int((state[keep] == fmt.EMPTY).sum()),
        trusted_decoder=g.reused > 0 and s.same != s.fingerprints,
        skipped=skipped,
        warnings=warnings,
    )
    return manifest, report


def _publish(s: _Session, manifest: fmt.Manifest) -> None:
    """Make ``manifest`` the cache's current version, then delete the previous generation."""
    fmt.write_manifest(manifest)
    if s.previous is not None:
        _remove_generation(s.folder, s.previous.manifest.generation)


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


class RecordFiller:
    """Fills the records of one lazy cache generation in place; one per process.

    A record is filled by decoding its file, writing the pixels with ``pwrite``, then writing its
    8-byte state ``(crc32, FILLED)`` with ``pwrite``. Readers look at the state first, so a
    record that reads ``FILLED`` is complete, and a process killed between the two writes leaves
    it ``EMPTY``, to be decoded again by the next reader. Processes filling the same record at
    once write the same bytes, so no lock is taken. Writes never go through a mapping: on a full
    disk a store to a mapped sparse page kills the process with SIGBUS, where ``pwrite`` raises.
    """

    def __init__(self, files: fmt.CacheFiles) -> None:
        m = files.manifest
        self._files = files
        self._root = str(m.source.get("root", ""))
        try:
            self._options = Options.from_json(m.options)
        except (TypeError, ValueError) as e:
            raise CacheFormatError(f"{m.path}: bad options in the manifest ({e})") from None
        self._fds: list[int] = []
        try:
            for kind in ("data", "state"):
                self._fds.append(os.open(m.file(kind), os.O_WRONLY))
        except OSError as e:
            self.close()
            raise DestinationError(
                f"{m.file(kind)}: cannot fill the lazy cache ({e.strerror}); records are stored "
                "where the cache lies, so its user must be able to write there"
            ) from None

    def fill(self, i: int) -> tuple[int, np.ndarray | None]:
        """Decode record ``i`` and store it: ``(its new state, its pixels if FILLED)``."""
        r = self._files.index[i]
        rel = self._files.path(i)
        if fmt.check_relative_path(rel) is not None:
            raise CacheFormatError(f"{self._files.manifest.path}: unsafe source path {rel!r}")
        shape = (int(r["height"]), int(r["width"]), int(r["channels"]))
        code, crc, _, pixels = decode_record(
            os.path.join(self._root, rel),
            int(r["source_size"]),
            int(r["source_mtime_ns"]),
            self._options,
        )
        if pixels is not None and pixels.shape != shape:
            # The header promised another size (a lying header, an orientation the probe read
            # differently): the record's place is fixed, so the file is refused, never cropped.
            code, crc, pixels = fmt.BAD_HEADER_MISMATCH, 0, None
        data_fd, state_fd = self._fds
        try:
            if pixels is not None:
                fmt.write_pixels(data_fd, pixels, int(r["offset"]))
            state = np.array([(crc, code)], fmt.STATE_DTYPE).tobytes()
            os.pwrite(state_fd, state, i * fmt.STATE_DTYPE.itemsize)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise InsufficientSpaceError(
                    f"{self._files.manifest.path}: the disk is full ({e.strerror}); free "
                    f"{self._files.manifest.sizes['data']:,} bytes for the whole cache, or "
                    "build it elsewhere"
                ) from None
            raise
        return code, pixels

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __del__(self) -> None:
        self.close()


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
