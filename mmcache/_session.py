"""A build's session: what it is asked, the cache folder it locks, and whether it is current.

A build (single-process or distributed) starts with ``session``: it scans the source, checks and
locks the destination and reads the cache there, refusing one made from another source or with
other options. ``up_to_date_report`` then says whether the cache there is current and the build
has nothing to write (else ``mmcache._writer`` writes a new generation). ``new_report`` makes the
``BuildReport`` every build, refresh and compaction returns.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from ._generation import (
    found_bad,
    open_existing,
    prepare_folder,
    remove_stale_generations,
    write_manifest,
    writer_lock,
)
from ._staleness import (
    fingerprints,
    is_current,
    recorded_source,
    same_options,
    same_source,
    source_of,
    source_stamps,
    to_match,
    trust_record,
)
from .annotations import annotate, carry_user_fields
from .decode import Options, decoder_accepted, decoder_versions
from .errors import DestinationError, OptionsChangedError, SourceChangedError
from .reports import BuildReport, ProgressFn
from .scan import Listing, scan_source

# A refresh appends what changed to the data file and leaves the records it replaces as garbage,
# until garbage would pass this share of the file: then it writes a compact file instead. At 25%
# the file stays within 4/3 of its live bytes (garbage up to 1/3 of them), so refreshes that each
# replace 1% of the records copy the whole cache once every 34 of them (3% of a full copy per
# refresh, amortised: 3 bytes copied per byte replaced). docs/refresh.md has the arithmetic.
COMPACT_AT = 0.25
# Seconds a rank of a distributed build waits for the others at each step before the build fails:
# long enough for the slowest rank's share of a large decode.
DIST_TIMEOUT = 1800.0


@dataclass(frozen=True)
class BuildRequest:
    """What a build is asked to do: the source, the cache folder, the options, and how.

    ``lazy``: lay out a lazy cache (decode only the records of unknown size) instead of a build.
    """

    source: str | os.PathLike | Listing
    cache: str | os.PathLike
    options: Options
    workers: int | None = None
    strict: bool = False
    progress: ProgressFn | None = None
    force: bool = False
    trust_decoder: bool = False
    replace: bool = False
    lazy: bool = False
    compact_at: float = COMPACT_AT
    source_moved: bool = False
    # What the images are paired with (``mmcache.annotations``): a masks folder, a COCO file,
    # the user's arrays by relative path.
    masks: str | os.PathLike | None = None
    coco: str | os.PathLike | None = None
    fields: Mapping[str, Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        workers = self.workers
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 0
        ):  # (0: decode in this process)
            raise ValueError(f"workers must be None or an int >= 0, got {workers!r}")
        if not 0 <= self.compact_at <= 1:  # (0: compact whenever there is garbage)
            raise ValueError(
                f"compact_at must be a share of the data file in [0, 1], got {self.compact_at!r}"
            )


@dataclass
class Session:
    """A build holding the cache's writer lock: the listing, the cache found there, fingerprints.

    ``current``: the fingerprints of what this build makes; ``wanted``: those the previous cache
    must have to be current or to lend its records (``_staleness.to_match``).
    """

    request: BuildRequest
    listing: Listing
    folder: Path
    previous: fmt.CacheFiles | None
    current: dict[str, str]
    wanted: dict[str, str]
    stamps: dict[str, Any] | None = None  # what the quick open-time check compares
    # Why the folder cannot be written (a read-only mount), else None: such a session may
    # only find the cache up to date.
    read_only: DestinationError | None = None

    @property
    def lazy(self) -> bool:
        return self.request.lazy


@contextmanager
def session(request: BuildRequest) -> Iterator[Session]:
    """Scan the source, check the destination, and hold its writer lock while the build runs.

    A cache there made from another source, or with other options, is refused unless
    ``request.replace`` (or, for the source alone, ``request.source_moved``).
    """
    source, opts = request.source, request.options
    scanned_ns = time.time_ns()
    listing = source if isinstance(source, Listing) else scan_source(source)
    if request.masks is not None or request.coco is not None or request.fields:
        listing.annotations = annotate(listing, request.masks, request.coco, request.fields)
    # When a listing is given its scan time is unknown: no stamps, the quick check scans.
    stamps = None if isinstance(source, Listing) else source_stamps(listing, scanned_ns)
    folder = fmt.cache_folder(request.cache)
    try:
        created = prepare_folder(folder)
    except DestinationError as e:
        previous = open_existing(folder) if folder.is_dir() else None
        if previous is None:
            raise
        # A read-only mount of a cache: readable without the lock, which no writer can take.
        yield read_only_session(request, listing, previous, stamps, e)
        return
    try:
        with writer_lock(folder):
            previous = open_existing(folder)
            if previous is not None and not request.fields and not request.replace:
                # The user's arrays are not found again in the source: a build without them
                # keeps the previous generation's, by path, rather than drop them.
                carry_user_fields(previous, listing)
            if previous is not None and not request.replace:
                if not request.source_moved:
                    refuse_other_source(previous.manifest, listing)
                refuse_other_options(previous.manifest, opts)
            # Before the up-to-date check: a build that finds the cache current also clears
            # what killed builds left behind.
            previous = remove_stale_generations(folder, previous)
            current = fingerprints(listing, opts)
            wanted = current
            if previous is not None:
                wanted = to_match(previous.manifest, current, request.trust_decoder)
            yield Session(request, listing, folder, previous, current, wanted, stamps)
    except BaseException:
        if created:  # a first build that failed leaves no folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise


def read_only_session(
    request: BuildRequest,
    listing: Listing,
    previous: fmt.CacheFiles,
    stamps: dict[str, Any] | None,
    why: DestinationError,
) -> Session:
    """The session of a build over a cache whose folder cannot be written (``why``)."""
    if not request.replace:
        if not request.source_moved:
            refuse_other_source(previous.manifest, listing)
        refuse_other_options(previous.manifest, request.options)
    current = fingerprints(listing, request.options)
    wanted = to_match(previous.manifest, current, request.trust_decoder)
    folder = fmt.cache_folder(request.cache)
    return Session(request, listing, folder, previous, current, wanted, stamps, why)


def refuse_other_source(m: fmt.Manifest, listing: Listing) -> None:
    """SourceChangedError if cache ``m`` was made from another folder or list than ``listing``.

    Every file of another source would be "changed", so a build would silently turn the cache
    into a cache of that source (a validation set built into the training cache).
    """
    if same_source(m, listing):
        return
    old, new = recorded_source(m), source_of(listing)
    gone = "" if Path(old).exists() else " (no longer there)"
    raise SourceChangedError(
        f"{m.path}: the cache there was made from {old}{gone}; this build's source is {new}, "
        f"which would replace its {m.count:,} records. Give the source it was made from, pass "
        "--replace (replace=True) to rebuild it from the new one, or --source-moved "
        "(source_moved=True) if the same images moved there (unchanged files keep their records)"
    )


def refuse_other_options(m: fmt.Manifest, opts: Options) -> None:
    """OptionsChangedError if cache ``m`` was made with other preprocessing than ``opts``."""
    if same_options(m, opts):
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


def up_to_date_report(s: Session) -> BuildReport | None:
    """The report of a build that has nothing to do, or None if the cache must be (re)built.

    Raises:
        DestinationError: the cache must be rebuilt, and its folder cannot be written.
    """
    if s.previous is None or not is_current(s.previous, s.listing, s.wanted, s.lazy):
        if s.read_only is not None:
            raise DestinationError(f"{s.read_only} and the cache there is not up to date")
        return None
    m = s.previous.manifest
    report = current_report(s.previous)
    report.ignored = list(s.listing.ignored)
    report.other_files = dict(s.listing.other_files)
    note_unpaired(report, s.listing)
    report.trusted_decoder = not decoder_accepted(
        m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")
    )
    stale_stamps = s.stamps is not None and m.extra.get("source_stamps") != s.stamps
    if stale_stamps:  # this build listed the source in full: its stamps are as good and newer
        m.extra["source_stamps"] = s.stamps
    if report.trusted_decoder:
        m.extra["trusted_decoder"] = trust_record(decoder_versions())
    if (report.trusted_decoder or stale_stamps) and s.read_only is None:
        write_manifest(m)
    return report


def current_report(files: fmt.CacheFiles) -> BuildReport:
    """The report of a build that found ``files`` current and did nothing."""
    m = files.manifest
    codes = files.state["state"]
    # A lazy cache keeps files found bad while filling as BAD records (a build leaves them out).
    bad = found_bad(files)
    return new_report(
        m.path,
        codes,
        len(m.classes),
        m.sizes,
        seconds=0.0,
        up_to_date=True,
        skipped=m.skipped + bad,
        warnings=m.warnings,
    )


def new_report(
    cache: Path,
    codes: np.ndarray,
    classes: int,
    sizes: dict[str, int],
    written_pixels: int | None = None,
    **fields: Any,
) -> BuildReport:
    """The report of a build that leaves ``cache`` with records in the states ``codes`` and
    files of ``sizes``: ``images`` (FILLED) and ``pending`` (EMPTY) counted, ``bytes`` the data
    file's size, ``written_bytes`` the ``written_pixels`` and the index, state and paths files
    (0 when nothing was written); ``fields``: the rest of ``BuildReport``'s."""
    written = 0
    if written_pixels is not None:
        written = written_pixels + sum(v for k, v in sizes.items() if k != "data")
    return BuildReport(
        cache=cache,
        images=int((codes == fmt.FILLED).sum()),
        classes=classes,
        bytes=sizes["data"],
        pending=int((codes == fmt.EMPTY).sum()),
        written_bytes=written,
        **fields,
    )


def note_unpaired(report: BuildReport, listing: Listing) -> None:
    """Put in ``report`` what of the COCO file pairs with nothing in ``listing``."""
    a = listing.annotations
    if a is not None:
        report.coco_missing = list(a.coco_missing)
        report.coco_unknown_ids = list(a.coco_unknown_ids)
        report.coco_orphans = a.coco_orphans
