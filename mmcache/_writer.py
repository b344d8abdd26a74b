"""Writing a new generation of a cache, from the session that locks it to its publication.

A build (single-process or distributed) runs these steps in order: ``session`` (scan the source,
check and lock the destination, read the cache there), ``up_to_date_report`` (nothing to do?),
``allocate`` (plan the layout, create the sparse data file, copy unchanged records), the decode
workers write the other records in place, ``Generation.record`` takes their outcomes,
``finish`` writes the index, state and paths and flushes everything, and ``publish`` renames
the manifest over the old one. Anything that fails inside ``discarded_on_failure`` deletes the
new generation's files: the previous cache stays as it was.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from . import _generation as generation
from . import format as fmt
from . import pixels as px
from ._feedback import human_bytes
from ._files import create_data_file, extend_data_file, write_pixels
from ._generation import (
    fields_file,
    found_bad,
    index_records,
    live_bytes,
    new_generation,
    open_existing,
    prepare_folder,
    remove_stale_generations,
    retire,
    write_generation,
    write_manifest,
    writer_lock,
)
from ._layout import Layout, aligned, append_layout, layout_offsets, plan_layout
from ._opening import open_for_writing
from ._reuse import carry_skips, copy_reused, keep_in_place, kept_records, reusable
from ._staleness import (
    carried_trust,
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
from ._version import __version__
from ._workers import Job, Result, chunked, decode_records
from .annotations import annotate, carry_user_fields, recorded_annotations
from .decode import Options, decoder_accepted, decoder_versions, too_large_reason
from .errors import (
    CacheFormatError,
    DestinationError,
    OptionsChangedError,
    SourceChangedError,
    SourceError,
    StrictBuildError,
)
from .reports import BuildReport, ProgressFn
from .scan import Listing, scan_source
from .sources import SOURCES, carry_member_table, write_member_table
from .space import (
    check_free_space,
    disk_bytes,
    free_bytes,
    generation_sizes,
)

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
    _note_unpaired(report, s.listing)
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


@dataclass
class Generation:
    """A new generation being written: its layout, and every record's outcome so far."""

    folder: Path
    gen: str
    listing: Listing
    layout: Layout
    state: np.ndarray
    crcs: np.ndarray
    messages: dict[int, str]
    overflow: dict[int, np.ndarray]
    reused: int
    todo: list[int]  # records to decode, in listing order
    # The data file's generation: this one's, or (a refresh appending to it) an earlier one's;
    # and, appending, the size its published records end at (the new ones start after it).
    data_gen: str = ""
    appended_after: int | None = None
    copied_bytes: int = 0
    compaction_deferred: str = ""

    @property
    def data_path(self) -> Path:
        return self.folder / fmt.file_name("data", self.data_gen or self.gen)

    def jobs(self, records: Iterable[int]) -> list[list[Job]]:
        """Decode jobs for ``records``, in the chunks the workers take."""
        listing, layout = self.listing, self.layout
        annotations = listing.annotations
        reader = listing.images  # a kind that reads its files itself, or None
        return chunked(
            [
                Job(
                    record=i,
                    path=listing.abspath(i),
                    offset=int(layout.offsets[i]),
                    shape=layout.shape(i),
                    size=int(listing.sizes[i]),
                    mtime_ns=int(listing.mtimes[i]),
                    mask=None if annotations is None else annotations.mask_file(i),
                    reader=reader,
                )
                for i in records
            ]
        )

    def record(self, results: Iterable[Result]) -> None:
        """Take decode results: state, crc, decoder message, overflow pixels."""
        for i, code, crc, message, pixels in results:
            self.state[i], self.crcs[i] = code, crc
            if message:
                self.messages[i] = message
            if pixels is not None:
                self.overflow[i] = pixels


def allocate(s: Session) -> Generation:
    """Plan the layout and make room for the new records: at the end of the current data file
    (a refresh, the kept records where they are), or in a new data file with the kept records
    copied into it (a first build, other options, or a compaction of the garbage)."""
    listing, previous, request = s.listing, s.previous, s.request
    n = len(listing)
    state: np.ndarray = np.full(n, fmt.EMPTY, np.uint32)
    crcs = np.zeros(n, np.uint32)
    messages: dict[int, str] = {}
    carry_skips(previous, listing, s.wanted, state, messages)
    if listing.annotations is not None:
        for i in np.flatnonzero(state == fmt.EMPTY).tolist():
            missing = listing.annotations.missing_mask(i)
            if missing is not None:  # known now: no decoding, no place in the data file
                state[i], messages[i] = fmt.BAD_MASK, missing
    skip = set(np.flatnonzero(state != fmt.EMPTY).tolist())
    kept = kept_records(previous, listing, s.wanted)
    layout, appending, deferred = None, False, ""
    if previous is not None and kept is not None:
        layout = append_layout(listing, request.options, kept, previous, skip)
        appending = True
        if _garbage_share(layout) > request.compact_at:
            # Too much garbage: a compact data file instead, if the disk has room for it
            # beside the old one; else append now (it fits, or the check below says so) and
            # compact when there is room, rather than refuse a refresh that would fit.
            compact = plan_layout(listing, request.options, skip)
            needed = disk_bytes(generation_sizes(listing.paths, compact.data_bytes))
            free = free_bytes(s.folder)
            if request.force or free >= needed:
                layout, appending = compact, False
            else:
                deferred = (
                    f"the garbage passed compact_at={request.compact_at:g}, but a compact data "
                    f"file needs {human_bytes(needed)} free and {human_bytes(free)} are: "
                    "appended instead; free some space, then run `mmcache compact`"
                )
    if layout is None:
        layout = plan_layout(listing, request.options, skip)
    state = np.where(state != fmt.EMPTY, state, layout.state).astype(np.uint32)
    for i, reason in layout.reasons.items():
        messages.setdefault(i, reason)
    for i in np.flatnonzero(layout.state == fmt.BAD_TOO_LARGE).tolist():
        if i not in messages:  # (a skip carried over has its reason: no header read again)
            messages[i] = _too_large(listing, i, request.options)
    gen = new_generation()
    appended_to = previous if appending else None
    g = Generation(
        folder=s.folder, gen=gen, listing=listing, layout=layout, state=state, crcs=crcs,
        messages=messages, overflow={}, reused=0, todo=[],
        data_gen=appended_to.manifest.data_generation if appended_to else gen,
        appended_after=appended_to.manifest.sizes["data"] if appended_to else None,
        compaction_deferred=deferred,
    )  # fmt: skip
    # Before anything is written: the bytes this generation adds, while the old one stays.
    new_bytes = layout.data_bytes - (g.appended_after or 0)
    records = [listing.paths[i] for i in np.flatnonzero(state == fmt.EMPTY)]
    check_free_space(s.folder, disk_bytes(generation_sizes(records, new_bytes)), request.force)
    with discarded_on_failure(g):
        if appended_to is not None:
            extend_data_file(g.data_path, layout.data_bytes)
            g.reused = keep_in_place(appended_to, kept or {}, g.crcs, g.state)
        else:
            create_data_file(g.data_path, layout.data_bytes)
            reuse = reusable(previous, listing, s.wanted)
            g.reused, g.copied_bytes = copy_reused(
                previous, reuse, layout, g.data_path, g.crcs, g.state
            )
    # A lazy cache decodes now only the records whose size, hence every later offset, is unknown.
    g.todo = [
        i for i in range(n) if g.state[i] == fmt.EMPTY and not (s.lazy and layout.shapes[i, 0])
    ]
    return g


def discarded_on_failure(g: Generation) -> AbstractContextManager[None]:
    """``_generation.discarded_on_failure`` for ``g``: its files go if anything fails inside
    (``publish`` may run inside), and what it appended to a shared data file is cut off."""
    return generation.discarded_on_failure(
        g.folder,
        g.gen,
        f"the cache needs {g.layout.data_bytes:,} bytes of pixels. Nothing was published; "
        "the previous cache, if any, is intact",
        None if g.appended_after is None else (g.data_path, g.appended_after),
    )


def finish(g: Generation, s: Session) -> tuple[fmt.Manifest, BuildReport]:
    """Check strictness, place overflow records, write and flush the generation's files."""
    listing, layout, state = g.listing, g.layout, g.state
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
        for i in np.flatnonzero(~kept).tolist()
    ]
    if skipped and (s.request.strict or not len(keep)):
        raise _refusal(skipped, s)
    offsets, data_bytes = layout.offsets.copy(), layout.data_bytes
    if not s.lazy:  # (a lazy build decodes only records it could not place: no gaps)
        data_bytes = _close_gaps(g, keep, offsets, data_bytes)
    if g.overflow:
        data_bytes = _append_overflow(g.data_path, g.overflow, layout, offsets, data_bytes)
    warnings = list(listing.warnings) + [
        {"path": listing.paths[i], "reason": g.messages[i]}
        for i in keep.tolist()
        if i in g.messages
    ]
    index, paths_blob = index_records(
        offsets[keep],
        layout.shapes[keep],
        listing.labels[keep],
        [listing.paths[i].encode("utf-8", "surrogateescape") for i in keep],
        listing.sizes[keep],
        listing.mtimes[keep],
    )
    records = np.zeros(len(keep), fmt.STATE_DTYPE)
    records["crc32"], records["state"] = g.crcs[keep], state[keep]
    annotations = listing.annotations
    specs = annotations.specs() if annotations is not None else []
    blob = (
        fields_file(specs, annotations.values(keep, layout.shapes[keep]))
        if annotations is not None and specs
        else None
    )
    sizes = write_generation(
        g.folder, g.gen, index, records, paths_blob, data_bytes, g.data_gen, blob
    )
    members = write_member_table(g.folder, g.gen, listing.members, keep)  # (archives only)
    manifest = fmt.Manifest(
        path=g.folder,
        generation=g.gen,
        data_generation=g.data_gen,
        count=len(keep),
        mode="lazy" if s.lazy else "build",
        source=listing.source_json(),
        options=s.request.options.to_json(),
        classes=listing.classes,
        skipped=skipped,
        warnings=warnings,
        fingerprints=s.current,
        decoder=decoder_versions(),
        sizes=sizes,
        fields=specs,
        members=members,
        extra={
            "mmcache_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )
    previous = s.previous
    trusted = (
        carried_trust(previous.manifest, s.wanted, s.current)
        if g.reused and previous is not None  # records are reused from previous only
        else None
    )
    if trusted is not None:
        manifest.extra["trusted_decoder"] = trusted
    if s.stamps is not None:
        manifest.extra["source_stamps"] = s.stamps
    report = _finish_report(g, s, keep, offsets, data_bytes, sizes, skipped, warnings)
    return manifest, report


def _refusal(skipped: list[dict[str, Any]], s: Session) -> StrictBuildError | SourceError:
    """Why a build that left out ``skipped`` publishes nothing: it is strict, or nothing is left."""
    root = s.listing.root
    names = "; ".join(f"{e['path']}: {e['reason']}" for e in skipped[:5])
    more = f" (and {len(skipped) - 5} more)" if len(skipped) > 5 else ""
    if not s.request.strict:
        return SourceError(
            f"{root}: none of its {len(skipped):,} images could be cached, so nothing "
            f"was published: {names}{more}"
        )
    truncated = sum(e["state"] == fmt.BAD_TRUNCATED for e in skipped)
    keep = ""
    if truncated:  # (a cache there has other options then: it takes --replace too)
        also = " with --replace (replace=True)" if s.previous is not None else ""
        keep = (
            f"; {truncated} of them truncated, which --keep-truncated "
            f"(keep_truncated=True){also} keeps"
        )
    return StrictBuildError(
        f"{root}: {len(skipped)} file(s) could not be cached: {names}{more}{keep}"
    )


def _finish_report(
    g: Generation,
    s: Session,
    keep: np.ndarray,
    offsets: np.ndarray,
    data_bytes: int,
    sizes: dict[str, int],
    skipped: list[dict[str, Any]],
    warnings: list[dict[str, str]],
) -> BuildReport:
    """The report of a build that keeps the records ``keep`` of ``g`` at ``offsets`` in a data
    file of ``data_bytes``: what it decoded, reused, dropped, wrote, left out and warns of."""
    listing, layout, state, previous = g.listing, g.layout, g.state, s.previous
    had_pixels = removed = changed = 0
    if previous is not None:
        filled = previous.state["state"] == fmt.FILLED
        had_pixels = int(filled.sum())
        old_paths = {previous.path(int(j)) for j in np.flatnonzero(filled)}
        removed = len(old_paths - set(listing.paths))
        changed = sum(listing.paths[i] in old_paths for i in g.todo)
    decoded = [i for i in g.todo if state[i] == fmt.FILLED]
    pixels_written = g.copied_bytes + int(layout.nbytes[decoded].sum())
    live = live_bytes(offsets[keep], layout.nbytes[keep], data_bytes)
    report = new_report(
        g.folder,
        state[keep],  # every FILLED record is kept
        len(listing.classes),
        sizes,
        pixels_written,
        appended=g.appended_after is not None,
        garbage_bytes=max(0, data_bytes - live),
        compaction_deferred=g.compaction_deferred,
        seconds=0.0,
        decoded=int((state[g.todo] == fmt.FILLED).sum()) if g.todo else 0,
        reused=g.reused,
        dropped=had_pixels - g.reused,
        removed=removed,
        changed=changed,
        ignored=list(listing.ignored),
        other_files=dict(listing.other_files),
        trusted_decoder=g.reused > 0 and s.wanted != s.current,
        skipped=skipped,
        warnings=warnings,
    )
    _note_unpaired(report, listing)
    return report


def _note_unpaired(report: BuildReport, listing: Listing) -> None:
    """Put in ``report`` what of the COCO file pairs with nothing in ``listing``."""
    a = listing.annotations
    if a is not None:
        report.coco_missing = list(a.coco_missing)
        report.coco_unknown_ids = list(a.coco_unknown_ids)
        report.coco_orphans = a.coco_orphans


def publish(s: Session | fmt.CacheFiles, manifest: fmt.Manifest) -> None:
    """Make ``manifest`` the cache's current version, then delete the previous generation's
    files (its data file only if the new one does not share it). ``s``: the build's session,
    or the cache files a repair replaces."""
    previous = s if isinstance(s, fmt.CacheFiles) else s.previous
    write_manifest(manifest)
    if previous is not None:
        retire(previous.manifest, manifest)


class _NothingRepaired(Exception):
    """Raised inside ``redecode`` when no record decoded again: nothing is to be published."""


def redecode(
    files: fmt.CacheFiles,
    records: Iterable[int],
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> dict[int, str]:
    """Decode ``records`` of a cache again from its recorded source, and publish a generation
    in which they hold the new pixels; the caller holds the cache's writer lock.

    As a refresh does, the new pixels are appended to the data file and every other record
    stays where it is, so readers of the current generation are undisturbed and the previous
    record becomes garbage (``compact_cache`` drops it). A record whose source file is gone,
    changed since it was listed (the decoder checks its size and mtime) or no longer decodes
    keeps its old offset, pixels and checksum: the cache keeps its records and their order.
    Nothing is published when no record decoded again.

    Returns:
        Why each record that was not decoded again was not (empty when all were).
    """
    m = files.manifest
    n = len(files.index)
    todo = sorted(set(map(int, records)))
    if not todo:
        return {}
    try:
        options = Options.from_json(m.options)
    except (TypeError, ValueError) as e:
        raise CacheFormatError(f"{m.path / fmt.MANIFEST_NAME}: bad options ({e})") from None
    layout, start = _layout_after(files, todo)
    g = Generation(
        folder=m.path, gen=new_generation(), listing=_recorded_listing(files), layout=layout,
        state=files.state["state"].copy(), crcs=files.state["crc32"].copy(), messages={},
        overflow={}, reused=n - len(todo), todo=todo, data_gen=m.data_generation,
        appended_after=m.sizes["data"],
    )  # fmt: skip
    check_free_space(
        m.path,
        disk_bytes({**m.sizes, "data": layout.data_bytes - start}),
        advice="free some space there; the cache is unchanged (the repaired records are "
        "appended to its data file)",
    )
    failed: dict[int, str] = {}
    try:
        with discarded_on_failure(g):
            extend_data_file(g.data_path, layout.data_bytes)
            g.state[todo] = fmt.EMPTY
            g.record(decode_records(g.jobs(todo), g.data_path, options, workers, progress))
            for i in todo:
                if g.state[i] != fmt.FILLED:  # left as it was
                    failed[i] = g.messages.get(i) or fmt.BAD_REASONS[int(g.state[i])]
                    g.state[i] = files.state["state"][i]
                    g.crcs[i] = files.state["crc32"][i]
                    layout.offsets[i] = files.index["offset"][i]
            if len(failed) == len(todo):
                raise _NothingRepaired
            data_bytes = layout.data_bytes
            if g.overflow:  # the source now decodes to another size
                data_bytes = _append_overflow(
                    g.data_path, g.overflow, layout, layout.offsets, data_bytes
                )
            index = files.index.copy()
            index["offset"] = layout.offsets
            index["height"], index["width"], index["channels"] = layout.shapes.T
            state = np.zeros(n, fmt.STATE_DTYPE)
            state["crc32"], state["state"] = g.crcs, g.state
            sizes = write_generation(
                g.folder, g.gen, index, state, files.paths_blob, data_bytes, g.data_gen,
                files.fields_blob,
            )
            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            manifest = fmt.Manifest(**{**vars(m), "generation": g.gen, "sizes": sizes,
                                       "members": carry_member_table(m, m.path, g.gen),
                                       "extra": {**m.extra, "created": created}})  # fmt: skip
            publish(files, manifest)
    except _NothingRepaired:
        pass
    return failed


def _recorded_listing(files: fmt.CacheFiles) -> Listing:
    """The listing a cache's records were made from, as its manifest and index record it."""
    m, n = files.manifest, len(files.index)
    listing = Listing(
        root=Path(m.source["root"]),
        kind=m.source.get("kind", "folder"),
        list_file=None,
        classes=list(m.classes),
        paths=[files.path(i) for i in range(n)],
        labels=files.index["label"].astype(np.int64),
        sizes=files.index["source_size"].astype(np.int64),
        mtimes=files.index["source_mtime_ns"].astype(np.int64),
        annotations=recorded_annotations(files),
    )
    # An archive's members: where the members file places them; a file lies at its path.
    listing.members = SOURCES[listing.kind].recorded(files)
    return listing


def _layout_after(files: fmt.CacheFiles, todo: list[int]) -> tuple[Layout, int]:
    """The cache's layout with the records ``todo`` moved after the current records, each on its
    own aligned start; and where the first of them starts."""
    m, n = files.manifest, len(files.index)
    shapes = fmt.record_shapes(files.index)
    offsets = files.index["offset"].astype(np.uint64)
    start = aligned(m.sizes["data"])
    moved, end = layout_offsets(fmt.record_nbytes(files.index, m.pixels, m.mask)[todo])
    offsets[todo] = moved + np.uint64(start)
    state = files.state["state"].copy()
    layout = Layout(shapes, offsets, start + end, state, np.zeros(n, np.int64), m.pixels, m.mask)
    return layout, start


def _garbage_share(layout: Layout) -> float:
    """The share of the data file that no record would cover after an appending refresh with
    ``layout`` (records left out have no shape there, so they cover nothing)."""
    if not layout.data_bytes:
        return 0.0
    live = live_bytes(layout.offsets, layout.nbytes, layout.data_bytes)
    return (layout.data_bytes - live) / layout.data_bytes


def _too_large(listing: Listing, i: int, opts: Options) -> str:
    """Why file ``i``, refused from its header, is over the pixel limit: its size, the limit."""
    try:
        native = listing.probe(i, opts.exif_orientation)
    except OSError:
        native = None
    if native is None:  # (it was readable when planned; changed since)
        return fmt.BAD_REASONS[fmt.BAD_TOO_LARGE]
    assert opts.max_pixels is not None  # Options replaces None with the default
    return too_large_reason(native[0], native[1], opts.max_pixels)


def _close_gaps(g: Generation, keep: np.ndarray, offsets: np.ndarray, data_bytes: int) -> int:
    """Move the records this generation placed down over the space of the files it found bad
    only when decoding them (truncated, a mask that does not fit, ...), so that a first build
    leaves no garbage and a refresh appends none; ``offsets`` are updated, and the data file's
    new size returned. Each run of records between two such gaps moves in one piece: the
    bytes after the first gap are copied once."""
    start = 0 if g.appended_after is None else aligned(g.appended_after)
    nbytes = g.layout.nbytes
    placed = keep[(nbytes[keep] > 0) & (offsets[keep] >= start)]
    placed = placed[~np.isin(placed, list(g.overflow))]  # (they go after, see _append_overflow)
    placed = placed[np.argsort(offsets[placed], kind="stable")]
    moved, end = layout_offsets(nbytes[placed])
    moved += np.uint64(start)
    shift = offsets[placed].astype(np.int64) - moved.astype(np.int64)
    # (Gaps at the end need no move: the file is cut there.)
    new_size = start + end if len(placed) else (g.appended_after or 0)
    if not shift.any():
        return min(new_size, data_bytes)
    fd = open_for_writing(g.data_path)
    try:
        # Runs: consecutive records that move by the same amount lie side by side.
        firsts = np.flatnonzero(np.diff(shift, prepend=-1) != 0)
        lasts = np.append(firsts[1:], len(placed)) - 1
        for a, b in zip(firsts.tolist(), lasts.tolist()):
            if shift[a]:
                src = int(offsets[placed[a]])
                length = int(offsets[placed[b]]) + int(nbytes[placed[b]]) - src
                _move_down(fd, src, src - int(shift[a]), length)
    finally:
        os.close(fd)
    offsets[placed] = moved
    return new_size


# Bytes per read when records move down in the data file.
_MOVE_CHUNK = 8 << 20


def _move_down(fd: int, src: int, dst: int, length: int) -> None:
    """Copy ``length`` bytes at ``src`` of file ``fd`` to ``dst`` < ``src``, in chunks from
    the start: a chunk is written only below bytes already read, so overlap is safe."""
    done = 0
    while done < length:
        chunk = os.pread(fd, min(_MOVE_CHUNK, length - done), src + done)
        if not chunk:
            raise CacheFormatError(f"the data file ended early, at byte {src + done}")
        if os.pwrite(fd, chunk, dst + done) != len(chunk):
            raise OSError(errno.ENOSPC, "short write to the data file")
        done += len(chunk)


def _append_overflow(
    data_path: Path,
    overflow: dict[int, np.ndarray],
    layout: Layout,
    offsets: np.ndarray,
    data_bytes: int,
) -> int:
    """Append records whose header did not predict their size after the planned region."""
    fd = open_for_writing(data_path)
    try:
        end = aligned(data_bytes)
        for i in sorted(overflow):
            pixels = overflow[i]
            layout.shapes[i] = px.image_shape(pixels)
            offsets[i] = end
            write_pixels(fd, pixels, end)
            data_bytes = end + pixels.nbytes
            end = aligned(data_bytes)
    finally:
        os.close(fd)
    return data_bytes
