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

import os
import shutil
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import format as fmt
from . import pixels as px
from ._feedback import ProgressFn, human_bytes
from ._layout import Layout, append_layout, plan_layout
from ._version import __version__
from ._workers import Job, Result, chunked, decode_records
from .decode import Options, decoder_accepted, decoder_versions
from .errors import CacheFormatError, OptionsChangedError, SourceError, StrictBuildError
from .scan import Listing, scan_source
from .space import (
    check_free_space,
    disk_bytes,
    disk_full_error,
    free_bytes,
    generation_sizes,
)
from .staleness import carried_trust, fingerprints, is_current, same_options, to_match, trust_record


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

    ``appended``: the new records went at the end of the current data file, the kept ones
    staying where they were (a refresh), rather than into a new data file (a first build, other
    options, a compaction). ``written_bytes``: what the build wrote, pixels (decoded or copied)
    and the index, state and paths; ``garbage_bytes``: bytes of the data file that no record
    covers now (``fmt.garbage_bytes``: padding belongs to its record, so a first build or a
    compaction has none; ``bytes`` is the file's size); ``dropped_garbage``: what a compaction
    took out. ``compaction_deferred``: why a refresh appended although its garbage passed
    ``compact_at`` (a compact data file would not fit on the disk), else empty.
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
    appended: bool = False
    written_bytes: int = 0
    garbage_bytes: int = 0
    dropped_garbage: int = 0
    compaction_deferred: str = ""
    skipped: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def images_per_second(self) -> float:
        """Decoding rate: files decoded per second of decoding."""
        return self.decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0


# A refresh appends what changed to the data file and leaves the records it replaces as garbage,
# until garbage would pass this share of the file: then it writes a compact file instead. At 25%
# the file stays within 4/3 of its live bytes (garbage up to 1/3 of them), so refreshes that each
# replace 1% of the records copy the whole cache once every 34 of them (3% of a full copy per
# refresh, amortised: 3 bytes copied per byte replaced). docs/refresh.md has the arithmetic.
COMPACT_AT = 0.25


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


@dataclass
class Session:
    """A build holding the cache's writer lock: the listing, the cache found there, fingerprints.

    ``current``: the fingerprints of what this build makes; ``wanted``: those the previous cache
    must have to be current or to lend its records (``staleness.to_match``).
    """

    request: BuildRequest
    listing: Listing
    folder: Path
    previous: fmt.CacheFiles | None
    current: dict[str, str]
    wanted: dict[str, str]

    @property
    def lazy(self) -> bool:
        return self.request.lazy


@contextmanager
def session(request: BuildRequest) -> Iterator[Session]:
    """Scan the source, check the destination, and hold its writer lock while the build runs.

    A cache there made with other options is refused unless ``request.replace``.
    """
    source, opts = request.source, request.options
    listing = source if isinstance(source, Listing) else scan_source(source)
    folder = Path(request.cache).expanduser().absolute()
    created = fmt.prepare_folder(folder)
    try:
        with fmt.writer_lock(folder):
            previous = fmt.open_existing(folder)
            if previous is not None and not request.replace:
                refuse_other_options(previous.manifest, opts)
            # Before the up-to-date check: a build that finds the cache current also clears
            # what killed builds left behind.
            fmt.remove_stale_generations(folder, previous)
            current = fingerprints(listing, opts)
            wanted = current
            if previous is not None:
                wanted = to_match(previous.manifest, current, request.trust_decoder)
            yield Session(request, listing, folder, previous, current, wanted)
    except BaseException:
        if created:  # a first build that failed leaves no folder behind
            shutil.rmtree(folder, ignore_errors=True)
        raise


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
    """The report of a build that has nothing to do, or None if the cache must be (re)built."""
    if s.previous is None or not is_current(s.previous, s.listing, s.wanted, s.lazy):
        return None
    m = s.previous.manifest
    report = current_report(s.previous)
    report.ignored = list(s.listing.ignored)
    report.trusted_decoder = not decoder_accepted(
        m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")
    )
    if report.trusted_decoder:
        m.extra["trusted_decoder"] = trust_record(decoder_versions())
        fmt.write_manifest(m)
    return report


def current_report(files: fmt.CacheFiles) -> BuildReport:
    """The report of a build that found ``files`` current and did nothing."""
    m = files.manifest
    codes = files.state["state"]
    # A lazy cache keeps files found bad while filling as BAD records (a build leaves them out).
    bad = fmt.found_bad(files)
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
        return chunked(
            [
                Job(
                    record=i,
                    path=listing.abspath(i),
                    offset=int(layout.offsets[i]),
                    shape=tuple(int(v) for v in layout.shapes[i]),
                    size=int(listing.sizes[i]),
                    mtime_ns=int(listing.mtimes[i]),
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
    state = np.full(n, fmt.EMPTY, np.uint32)
    crcs = np.zeros(n, np.uint32)
    messages: dict[int, str] = {}
    _carry_skips(previous, listing, s.wanted, state, messages)
    skip = set(np.flatnonzero(state != fmt.EMPTY).tolist())
    kept = _kept_records(previous, listing, s.wanted)
    layout, appending, deferred = None, False, ""
    if previous is not None and kept is not None:
        layout = append_layout(listing, request.options, kept, previous, skip)
        appending = True
        if _garbage_share(layout) > request.compact_at:
            # Too much garbage: a compact data file instead, if the disk has room for it
            # beside the old one; else append now (it fits, or the check below says so) and
            # compact when there is room, rather than refuse a refresh that would fit.
            compact = plan_layout(listing, request.options)
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
        layout = plan_layout(listing, request.options)
    state = np.where(state != fmt.EMPTY, state, layout.state).astype(np.uint32)
    gen = fmt.new_generation()
    g = Generation(
        folder=s.folder,
        gen=gen,
        listing=listing,
        layout=layout,
        state=state,
        crcs=crcs,
        messages=messages,
        overflow={},
        reused=0,
        todo=[],
        data_gen=previous.manifest.data_generation if appending else gen,
        appended_after=previous.manifest.sizes["data"] if appending else None,
        compaction_deferred=deferred,
    )
    # Before anything is written: the bytes this generation adds, while the old one stays.
    new_bytes = layout.data_bytes - (g.appended_after or 0)
    records = [listing.paths[i] for i in np.flatnonzero(state == fmt.EMPTY)]
    check_free_space(s.folder, disk_bytes(generation_sizes(records, new_bytes)), request.force)
    with discarded_on_failure(g):
        if appending:
            fmt.extend_data_file(g.data_path, layout.data_bytes)
            g.reused = _keep_in_place(previous, kept or {}, g.crcs, g.state)
        else:
            fmt.create_data_file(g.data_path, layout.data_bytes)
            reuse = _reusable(previous, listing, s.wanted)
            g.reused, g.copied_bytes = _copy_reused(
                previous, reuse, layout, g.data_path, g.crcs, g.state
            )
    # A lazy cache decodes now only the records whose size, hence every later offset, is unknown.
    g.todo = [
        i for i in range(n) if g.state[i] == fmt.EMPTY and not (s.lazy and layout.shapes[i, 0])
    ]
    return g


@contextmanager
def discarded_on_failure(g: Generation) -> Iterator[None]:
    """Delete the new generation's files if anything fails (or is interrupted) inside, unless
    it failed after publishing them (``publish`` runs inside, so that a disk that fills up while
    the manifest is written discards the new generation and reads as InsufficientSpaceError)."""
    try:
        yield
    except BaseException as e:
        if fmt.published_generation(g.folder) == g.gen:  # failed after the commit point
            raise
        fmt.remove_generation(g.folder, g.gen)
        if g.appended_after is not None:  # what was appended to the shared data file
            fmt.cut_data_file(g.data_path, g.appended_after)
        full = disk_full_error(
            e,
            g.folder,
            f"the cache needs {g.layout.data_bytes:,} bytes of pixels. Nothing was published; "
            "the previous cache, if any, is intact",
        )
        if full is not None:
            raise full from None
        raise


def finish(g: Generation, s: Session) -> tuple[fmt.Manifest, BuildReport]:
    """Check strictness, place overflow records, write and flush the generation's files."""
    listing, layout, state = g.listing, g.layout, g.state
    strict = s.request.strict
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
    offsets, data_bytes = layout.offsets.copy(), layout.data_bytes
    if g.overflow:
        data_bytes = _append_overflow(g.data_path, g.overflow, layout, offsets, data_bytes)
    warnings = [
        {"path": listing.paths[i], "reason": g.messages[i]} for i in keep if i in g.messages
    ]
    index, paths_blob = fmt.index_records(
        offsets[keep],
        layout.shapes[keep],
        listing.labels[keep],
        [listing.paths[i].encode("utf-8", "surrogateescape") for i in keep],
        listing.sizes[keep],
        listing.mtimes[keep],
    )
    records = np.zeros(len(keep), fmt.STATE_DTYPE)
    records["crc32"], records["state"] = g.crcs[keep], state[keep]
    sizes = fmt.write_generation(
        g.folder, g.gen, index, records, paths_blob, data_bytes, g.data_gen
    )
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
        extra={
            "mmcache_version": __version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        },
    )
    previous = s.previous
    trusted = carried_trust(previous.manifest, s.wanted, s.current) if g.reused else None
    if trusted is not None:
        manifest.extra["trusted_decoder"] = trusted
    had_pixels = removed = changed = 0
    if previous is not None:
        filled = previous.state["state"] == fmt.FILLED
        had_pixels = int(filled.sum())
        old_paths = {previous.path(int(j)) for j in np.flatnonzero(filled)}
        removed = len(old_paths - set(listing.paths))
        changed = sum(listing.paths[i] in old_paths for i in g.todo)
    decoded = [i for i in g.todo if state[i] == fmt.FILLED]
    pixels_written = g.copied_bytes + int(layout.nbytes[decoded].sum())
    live = fmt.live_bytes(offsets[keep], layout.nbytes[keep], data_bytes)
    report = BuildReport(
        cache=g.folder,
        images=int((state == fmt.FILLED).sum()),
        classes=len(listing.classes),
        bytes=data_bytes,
        appended=g.appended_after is not None,
        written_bytes=pixels_written + sum(v for k, v in sizes.items() if k != "data"),
        garbage_bytes=max(0, data_bytes - live),
        compaction_deferred=g.compaction_deferred,
        seconds=0.0,
        decoded=int((state[g.todo] == fmt.FILLED).sum()) if g.todo else 0,
        reused=g.reused,
        dropped=had_pixels - g.reused,
        removed=removed,
        changed=changed,
        ignored=list(listing.ignored),
        pending=int((state[keep] == fmt.EMPTY).sum()),
        trusted_decoder=g.reused > 0 and s.wanted != s.current,
        skipped=skipped,
        warnings=warnings,
    )
    return manifest, report


def publish(s: Session | fmt.CacheFiles, manifest: fmt.Manifest) -> None:
    """Make ``manifest`` the cache's current version, then delete the previous generation's
    files (its data file only if the new one does not share it). ``s``: the build's session,
    or the cache files a repair replaces."""
    previous = s if isinstance(s, fmt.CacheFiles) else s.previous
    fmt.write_manifest(manifest)
    if previous is not None:
        fmt.retire(previous.manifest, manifest)


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
    listing = Listing(
        root=Path(m.source["root"]),
        kind=m.source.get("kind", "folder"),
        list_file=None,
        classes=list(m.classes),
        paths=[files.path(i) for i in range(n)],
        labels=files.index["label"].astype(np.int64),
        sizes=files.index["source_size"].astype(np.int64),
        mtimes=files.index["source_mtime_ns"].astype(np.int64),
    )
    shapes = fmt.record_shapes(files.index)
    offsets = files.index["offset"].astype(np.uint64)
    # The records to decode go after the current records, each on its own aligned start.
    start = fmt.aligned(m.sizes["data"])
    moved, end = fmt.layout_offsets(fmt.record_nbytes(files.index, m.pixels)[todo])
    offsets[todo] = moved + np.uint64(start)
    layout = Layout(shapes, offsets, start + end,
                    files.state["state"].copy(), np.zeros(n, np.int64), m.pixels)  # fmt: skip
    g = Generation(
        folder=m.path, gen=fmt.new_generation(), listing=listing, layout=layout,
        state=files.state["state"].copy(), crcs=files.state["crc32"].copy(), messages={},
        overflow={}, reused=n - len(todo), todo=todo, data_gen=m.data_generation,
        appended_after=m.sizes["data"],
    )  # fmt: skip
    check_free_space(m.path, disk_bytes({**m.sizes, "data": layout.data_bytes - start}))
    failed: dict[int, str] = {}
    try:
        with discarded_on_failure(g):
            fmt.extend_data_file(g.data_path, layout.data_bytes)
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
            sizes = fmt.write_generation(
                g.folder, g.gen, index, state, files.paths_blob, data_bytes, g.data_gen
            )
            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            manifest = fmt.Manifest(**{**vars(m), "generation": g.gen, "sizes": sizes,
                                       "extra": {**m.extra, "created": created}})  # fmt: skip
            publish(files, manifest)
    except _NothingRepaired:
        pass
    return failed


def _lends_records(previous: fmt.CacheFiles | None, wanted: dict[str, str]) -> bool:
    """Whether records of ``previous`` may be carried over: the same options and decoder."""
    return previous is not None and all(
        previous.manifest.fingerprints.get(k) == wanted[k] for k in ("options", "decoder")
    )


def _kept_records(
    previous: fmt.CacheFiles | None, listing: Listing, wanted: dict[str, str]
) -> dict[int, int] | None:
    """New record -> previous record, for every unchanged file of a previous cache of equal
    options and decoder (filled or not: its place in the data file stays its own); None when
    the previous cache cannot share its data file."""
    if not _lends_records(previous, wanted) or not previous.manifest.file("data").exists():
        return None
    return _unchanged(previous, listing, range(len(previous.index)))


def _garbage_share(layout: Layout) -> float:
    """The share of the data file that no record would cover after an appending refresh with
    ``layout`` (records left out have no shape there, so they cover nothing)."""
    if not layout.data_bytes:
        return 0.0
    live = fmt.live_bytes(layout.offsets, layout.nbytes, layout.data_bytes)
    return (layout.data_bytes - live) / layout.data_bytes


def _keep_in_place(
    previous: fmt.CacheFiles, kept: dict[int, int], crcs: np.ndarray, state: np.ndarray
) -> int:
    """Mark the kept records that hold pixels FILLED with their CRCs; returns how many. (The
    others keep their place, still to fill.)"""
    count = 0
    for i, j in kept.items():
        if previous.state[j]["state"] == fmt.FILLED:
            crcs[i] = previous.state[j]["crc32"]
            state[i] = fmt.FILLED
            count += 1
    return count


def _reusable(
    previous: fmt.CacheFiles | None, listing: Listing, wanted: dict[str, str]
) -> dict[int, int]:
    """New record -> old record, for files unchanged since a previous cache with equal options."""
    if not _lends_records(previous, wanted):
        return {}
    return _unchanged(previous, listing, np.flatnonzero(previous.state["state"] == fmt.FILLED))


def _unchanged(previous: fmt.CacheFiles, listing: Listing, candidates) -> dict[int, int]:
    """New record -> previous record, for the ``candidates`` (previous record numbers) whose
    file is listed again with the same size and mtime."""
    old = previous.index
    by_path = {previous.path(j): j for j in map(int, candidates)}
    found = {}
    for i, rel in enumerate(listing.paths):
        j = by_path.get(rel)
        if j is not None and (
            int(old[j]["source_size"]) == int(listing.sizes[i])
            and int(old[j]["source_mtime_ns"]) == int(listing.mtimes[i])
        ):
            found[i] = j
    return found


def _carry_skips(
    previous: fmt.CacheFiles | None,
    listing: Listing,
    wanted: dict[str, str],
    state: np.ndarray,
    messages: dict[int, str],
) -> None:
    """Keep skipping files the previous build skipped, if they and the options are unchanged."""
    if not _lends_records(previous, wanted):
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
    layout: Layout,
    data_path: Path,
    crcs: np.ndarray,
    state: np.ndarray,
) -> tuple[int, int]:
    """Copy unchanged records' pixels from the previous data file; returns how many, and the
    bytes copied."""
    if not reuse:
        return 0, 0
    old = previous.index
    src_fd = os.open(previous.manifest.file("data"), os.O_RDONLY)
    dst_fd = os.open(data_path, os.O_WRONLY)
    try:
        count = copied = 0
        for i, j in reuse.items():
            shape = previous.shape(j)
            if shape != tuple(int(v) for v in layout.shapes[i]):
                continue  # the header now predicts another size: decode it again
            nbytes = int(px.record_nbytes(*shape, layout.record_layout))
            fmt.copy_range(src_fd, dst_fd, int(old[j]["offset"]), int(layout.offsets[i]), nbytes)
            crcs[i] = previous.state[j]["crc32"]
            state[i] = fmt.FILLED
            count += 1
            copied += nbytes
        return count, copied
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _append_overflow(
    data_path: Path,
    overflow: dict[int, np.ndarray],
    layout: Layout,
    offsets: np.ndarray,
    data_bytes: int,
) -> int:
    """Append records whose header did not predict their size after the planned region."""
    fd = os.open(data_path, os.O_WRONLY)
    try:
        end = fmt.aligned(data_bytes)
        for i in sorted(overflow):
            pixels = overflow[i]
            layout.shapes[i] = px.image_shape(pixels)
            offsets[i] = end
            fmt.write_pixels(fd, pixels, end)
            data_bytes = end + pixels.nbytes
            end = fmt.aligned(data_bytes)
    finally:
        os.close(fd)
    return data_bytes


def compact(cache: str | os.PathLike) -> BuildReport:
    """Write the cache's current records into a data file of their own, in index order, with
    no garbage between them, and publish that as a new generation (``compact_cache``)."""
    start = time.perf_counter()
    folder = Path(cache).expanduser().absolute()
    fmt.read_manifest(folder)  # no cache there: its error, before anything else
    with fmt.writer_lock(folder):
        files = fmt.read_cache_files(fmt.read_manifest(folder))
        fmt.remove_stale_generations(folder, files)
        m = files.manifest
        nbytes = fmt.record_nbytes(files.index, m.pixels)
        offsets, data_bytes = fmt.layout_offsets(nbytes)
        gen = fmt.new_generation()
        sizes = {**m.sizes, "data": data_bytes}
        check_free_space(
            folder,
            disk_bytes(sizes),
            advice="free some space there; the cache is unchanged (a compaction writes the "
            "compact data file beside the current one)",
        )
        try:
            fmt.create_data_file(folder / fmt.file_name("data", gen), data_bytes)
            copied = _copy_filled(files, offsets, folder / fmt.file_name("data", gen))
            index = files.index.copy()
            index["offset"] = offsets
            sizes = fmt.write_generation(
                folder, gen, index, files.state.copy(), files.paths_blob, data_bytes
            )
            extra = {**m.extra, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            manifest = fmt.Manifest(**{**vars(m), "generation": gen, "data_generation": gen,
                                       "sizes": sizes, "extra": extra})  # fmt: skip
            fmt.write_manifest(manifest)
        except BaseException as e:
            if fmt.published_generation(folder) != gen:
                fmt.remove_generation(folder, gen)
                full = disk_full_error(e, folder, "nothing was published; the cache is intact")
                if full is not None:
                    raise full from None
            raise
        fmt.retire(m, manifest)
    codes = files.state["state"]
    return BuildReport(
        cache=folder,
        images=int((codes == fmt.FILLED).sum()),
        classes=len(m.classes),
        bytes=data_bytes,
        seconds=time.perf_counter() - start,
        pending=int((codes == fmt.EMPTY).sum()),
        written_bytes=copied + sum(v for k, v in sizes.items() if k != "data"),
        garbage_bytes=data_bytes - fmt.live_bytes(offsets, nbytes, data_bytes),
        dropped_garbage=fmt.garbage_bytes(files),
        skipped=list(m.skipped),
    )


def _copy_filled(files: fmt.CacheFiles, offsets: np.ndarray, data_path: Path) -> int:
    """Copy each FILLED record of ``files`` to its new offset in ``data_path``; bytes copied."""
    filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels)
    src = os.open(files.manifest.file("data"), os.O_RDONLY)
    dst = os.open(data_path, os.O_WRONLY)
    try:
        for i in filled.tolist():
            fmt.copy_range(src, dst, int(files.index["offset"][i]), int(offsets[i]), int(nbytes[i]))
        os.fsync(dst)
    finally:
        os.close(src)
        os.close(dst)
    return int(nbytes[filled].sum())
