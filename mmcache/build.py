"""Building a cache: scan the source, plan the layout from headers, decode in parallel, publish.

A build writes a new generation of files inside the cache folder and publishes it by replacing
``manifest.json`` atomically (see ``mmcache.format``), so a build stopped at any point leaves the
previous cache untouched and nothing a reader would accept. The layout (every record's offset)
is planned from the files' headers before decoding, so decode workers write their records in
place with ``pwrite`` and send back only a few numbers; pixels never cross a pipe. A file whose
header does not predict its decoded size (rare: a malformed header) is decoded, sent back and
appended after the planned records.

``create_lazy_cache`` publishes the same layout without decoding (mode ``"lazy"``): records stay
``EMPTY`` until ``MemmapImageDataset`` fills them on first read. Only files whose header cannot
be read are decoded at creation, because their record's size, hence every later offset, is
unknown until then; they land where the build puts them, after the planned records, so a lazy
cache once full is record for record the cache a build makes.

The steps live in ``mmcache._session`` (the request, the lock, the up-to-date check),
``mmcache._writer`` (the generation), ``mmcache._layout`` (the offsets) and ``mmcache._workers``
(the decode processes); ``mmcache.distributed`` runs the same steps with the decoding shared out
among the ranks of a torch.distributed group.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

from . import _writer as writer
from ._compact import compact
from ._session import COMPACT_AT, DIST_TIMEOUT, BuildRequest, Session, session, up_to_date_report
from ._workers import DecodePool, decode_records
from .decode import Options
from .reports import BuildReport, ProgressFn
from .scan import Listing

__all__ = ["build_cache", "compact_cache", "create_lazy_cache"]


def build_cache(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    *,
    workers: int | None = None,
    strict: bool = False,
    progress: ProgressFn | None = None,
    force: bool = False,
    trust_decoder: bool = False,
    replace: bool = False,
    source_moved: bool = False,
    compact_at: float = COMPACT_AT,
    distributed: bool | None = None,
    dist_timeout: float = DIST_TIMEOUT,
    masks: str | os.PathLike | None = None,
    coco: str | os.PathLike | None = None,
    fields: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> BuildReport:
    """Decode every image of ``source`` once into the cache folder ``cache``.

    An unchanged source with the same options is a no-op (``report.up_to_date``); a changed one
    decodes only new and modified files, appended (``report.appended``; unchanged ones keep their
    records: ``report.reused``). A lazy cache is completed: its empty records decoded in place.

    Args:
        source: an ImageFolder-style or flat folder of images, a ``path,label`` list, or an
            archive read in place (``.tar`` of class folders or of one tar per class, ``.zip``,
            WebDataset shards; docs/archives.md); or its ``Listing`` from ``scan_source``
            (which takes the ``label_key`` of WebDataset ``.json`` labels).
        cache: the cache folder to create or update.
        workers: decode processes (default: all cores); 0 decodes in this process, without
            the protection from decoder crashes (for debuggers and profilers).
        strict: fail, leaving no new cache, if any file cannot be decoded.
        progress: called as ``progress(done, total)`` while decoding (this rank's share).
        force: start even when the destination lacks the free space the cache needs.
        trust_decoder: keep a cache of another decoder version (pixels may differ slightly)
            rather than decode it all again, recording that in its manifest.
        replace: rebuild a cache made from another source or with other preprocessing options
            (without it: ``SourceChangedError`` or ``OptionsChangedError``, nothing changed).
        source_moved: accept a cache of another folder (or list file) as this source's, moved:
            files unchanged (relative path, size, mtime) keep their records, others are decoded.
        compact_at: past this share of the data file left to unused records (of removed or
            replaced files), a refresh writes a compact data file instead (``compact_cache``).
        distributed: build with every rank of the initialised ``torch.distributed`` group
            (``mmcache.distributed``), each calling ``build_cache`` with the same arguments and
            getting the same report or error; ``None``: if the group has over one process.
        dist_timeout: in a distributed build, seconds a rank waits for the others at each step
            (rank 0 planning, the slowest share) before the build fails.
        masks: a folder of segmentation masks, one per image at its relative path and stem
            (``mmcache.annotations``), stored and resized with it; 8-bit unless ``mask="uint16"``.
        coco: a COCO ``instances.json``: each record stores its boxes (in the stored image's
            pixels), labels and crowd flags.
        fields: the user's own arrays, ``{name: {path relative to the source: array}}``,
            one dtype and row shape per name (rows may vary: ``(n, *row)``).
        **options: the preprocessing, ``Options``' fields (native size, RGB by default; ``Options``
            says what each does): ``size=(height, width)`` or ``max_side`` or ``short_side``,
            ``interpolation``, ``color``, ``max_pixels``, ``reduced_decode``, ``pixels``,
            ``keep_truncated``, ``mask``.

    Examples:
        >>> report = build_cache("data/train", "cache/train", short_side=256)  # doctest: +SKIP
        >>> report.images, report.skipped  # doctest: +SKIP

    Raises:
        SourceError: no source, or no image of it could be decoded (nothing is published).
        SourceChangedError, OptionsChangedError: the cache there is another source's (without
            ``replace`` or ``source_moved``), or has other options (without ``replace``).
        NotACacheError, DestinationError: a file or a folder of other things is where the
            cache would go; the cache folder cannot be created or written.
        StrictBuildError: ``strict`` and a file could not be decoded (nothing is published).
        InsufficientSpaceError: the disk lacks room for the cache, or filled up while writing.
        DistributedBuildError: a rank of a distributed build failed or timed out.
        DecodeWorkerError: the decode workers could not run (they die at start, or on each file).
        TypeError, ValueError: an unknown or an invalid preprocessing option.
    """
    request = _request(source, cache, options, masks, coco, dist_timeout, workers=workers,
        strict=strict, progress=progress, force=force, trust_decoder=trust_decoder, fields=fields,
        replace=replace, compact_at=compact_at, source_moved=source_moved)  # fmt: skip
    return _build(request, distributed, dist_timeout)


def create_lazy_cache(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    *,
    workers: int | None = None,
    progress: ProgressFn | None = None,
    force: bool = False,
    replace: bool = False,
    source_moved: bool = False,
    compact_at: float = COMPACT_AT,
    masks: str | os.PathLike | None = None,
    coco: str | os.PathLike | None = None,
    fields: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> BuildReport:
    """Create a lazy cache of ``source`` at once, without decoding: records fill on first read.

    The layout is planned from the files' headers, the data file allocated sparse, and every
    record published ``EMPTY``; ``MemmapImageDataset`` then fills records as they are read.
    A cache already there with the same source and options is left as it is (lazy or built,
    ``report.up_to_date``); one made from an older listing becomes a new lazy generation that
    carries over the filled records of unchanged files (``report.reused``); a cache of another
    source is replaced only with ``replace`` (or kept as this source's with ``source_moved``),
    one of other options only with ``replace``. Files whose header cannot be read are decoded
    now (``report.decoded``). Files refused from their header (over ``max_pixels``) are left
    out, as a build leaves them. Arguments are those of ``build_cache``.

    Examples:
        >>> report = create_lazy_cache("data/train", "cache/lazy", short_side=256)  # doctest: +SKIP
        >>> report.pending  # doctest: +SKIP

    Raises:
        SourceError, SourceChangedError, OptionsChangedError: as ``build_cache``.
        NotACacheError, DestinationError, InsufficientSpaceError: as ``build_cache``.
    """
    request = _request(
        source, cache, options, masks, coco, workers=workers, progress=progress, force=force,
        replace=replace, lazy=True, compact_at=compact_at, source_moved=source_moved, fields=fields,
    )  # fmt: skip
    return _build_here(request)


def _request(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike,
    options: dict[str, Any],
    masks: str | os.PathLike | None,
    coco: str | os.PathLike | None,
    dist_timeout: Any = DIST_TIMEOUT,
    **settings: Any,
) -> BuildRequest:
    """A build's request, its arguments checked: ``dist_timeout``, then the preprocessing
    ``Options`` (``_options``); the others by ``BuildRequest``."""
    if not (isinstance(dist_timeout, int | float) and 0 < dist_timeout < math.inf):
        raise ValueError(f"dist_timeout must be a number of seconds above 0, got {dist_timeout!r}")
    return BuildRequest(
        source, cache, _options(options, masks, coco), masks=masks, coco=coco, **settings
    )


def _build(request: BuildRequest, distributed: bool | None, dist_timeout: float) -> BuildReport:
    """Build with every rank of the process group when there is one to build with, else here."""
    if _in_process_group(distributed):
        from .distributed import build_distributed

        return build_distributed(request, timeout=dist_timeout)
    return _build_here(request)


def _options(
    options: dict[str, Any],
    masks: str | os.PathLike | None,
    coco: str | os.PathLike | None = None,
) -> Options:
    """The preprocessing ``Options`` of a build: with ``masks``, records carry 8-bit masks
    unless ``mask`` says 16; ``mask`` without ``masks`` has no masks to store. With ``masks``
    or ``coco``, images are read without their EXIF orientation, as the annotations were
    drawn on them (docs/annotations.md)."""
    if masks is not None or coco is not None:
        if options.get("exif_orientation"):
            raise ValueError(
                "exif_orientation=True with masks= or coco=: masks and boxes are drawn on the "
                "pixels as the file stores them, and rotating the image alone would misalign "
                "them; leave exif_orientation out"
            )
        options = {**options, "exif_orientation": False}
    if masks is not None:
        options = {"mask": "uint8", **options}
        if options["mask"] is None:
            raise ValueError("mask=None: a build with masks= stores them as uint8 or uint16")
    elif options.get("mask") is not None:
        raise ValueError(f"mask={options['mask']!r} needs masks= (the folder of the masks)")
    return Options(**options)


def compact_cache(cache: str | os.PathLike) -> BuildReport:
    """Write a cache's records into a new data file with nothing between them, atomically.

    Refreshes append new and modified records to the data file and leave the records they
    replace behind as garbage; a build compacts by itself past its ``compact_at`` share, and
    this does it now. The source is not read (a copied cache compacts too). Processes that
    opened the previous generation keep reading it until they reopen.

    Examples:
        >>> report = compact_cache("cache/train")  # doctest: +SKIP
        >>> report.dropped_garbage, report.bytes  # doctest: +SKIP

    Raises:
        CacheNotFoundError, CacheFormatError: no cache there, or a damaged one.
        InsufficientSpaceError: the disk lacks room for the compact data file.
    """
    return compact(cache)


def _build_here(request: BuildRequest) -> BuildReport:
    """Build (or, lazily, lay out) a new generation unless the cache is current already.

    The single-process path; ``mmcache.distributed`` runs the same steps with the decoding
    shared out among the ranks.
    """
    start = time.perf_counter()
    with session(request) as s:
        report = up_to_date_report(s)
        if report is None:
            # A build has files to decode: its workers start now, while it plans the layout
            # and prepares the data file. (A lazy cache decodes only files of unreadable
            # headers, if any: its workers start only for them.)
            pool = None if request.lazy else DecodePool(request.options, request.workers)
            try:
                report = _write_generation(s, pool)
            finally:
                if pool is not None:
                    pool.close()
    report.seconds = time.perf_counter() - start
    return report


def _write_generation(s: Session, pool: DecodePool | None) -> BuildReport:
    request = s.request
    g = writer.allocate(s)
    with writer.discarded_on_failure(g):
        decoding = time.perf_counter()
        jobs = g.jobs(g.todo)
        options, workers, progress = request.options, request.workers, request.progress
        g.record(decode_records(jobs, g.data_path, options, workers, progress, pool))
        decode_seconds = time.perf_counter() - decoding
        manifest, report = writer.finish(g, s)
        writer.publish(s, manifest)
    report.decode_seconds = decode_seconds
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
    return active and dist is not None and dist.get_world_size() > 1
