"""Writing a new generation of a cache, from its allocation to its publication.

A build (single-process or distributed) runs these steps in order, inside the ``session`` of
``mmcache._session`` that holds the cache's writer lock: ``allocate`` (plan the layout, create
the sparse data file, copy unchanged records), the decode workers write the other records in
place, ``Generation.record`` takes their outcomes, ``finish`` writes the index, state and paths
and flushes everything, and ``publish`` renames the manifest over the old one. Anything that
fails inside ``discarded_on_failure`` deletes the new generation's files: the previous cache
stays as it was.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
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
    index_records,
    live_bytes,
    new_generation,
    retire,
    write_generation,
    write_manifest,
)
from ._layout import Layout, aligned, append_layout, layout_offsets, plan_layout
from ._opening import open_for_writing
from ._reuse import carry_skips, copy_reused, keep_in_place, kept_records, reusable
from ._session import Session, new_report, note_unpaired
from ._staleness import carried_trust
from ._version import __version__
from ._workers import Job, Result, chunked
from .decode import Options, decoder_versions, too_large_reason
from .errors import CacheFormatError, SourceError, StrictBuildError
from .reports import BuildReport
from .scan import Listing
from .sources import write_member_table
from .space import check_free_space, disk_bytes, free_bytes, generation_sizes


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
    skipped = _skipped(g, kept)
    if skipped and (s.request.strict or not len(keep)):
        raise _refusal(skipped, s)
    offsets, data_bytes = layout.offsets.copy(), layout.data_bytes
    if not s.lazy:  # (a lazy build decodes only records it could not place: no gaps)
        data_bytes = _close_gaps(g, keep, offsets, data_bytes)
    if g.overflow:
        data_bytes = append_overflow(g.data_path, g.overflow, layout, offsets, data_bytes)
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


def _skipped(g: Generation, kept: np.ndarray) -> list[dict[str, Any]]:
    """The manifest's entries of the records ``g`` leaves out (not ``kept``), with their reasons."""
    listing, state = g.listing, g.state
    return [
        {
            "path": listing.paths[i],
            "reason": g.messages.get(i) or fmt.BAD_REASONS[int(state[i])],
            "size": int(listing.sizes[i]),
            "mtime_ns": int(listing.mtimes[i]),
            "state": int(state[i]),
        }
        for i in np.flatnonzero(~kept).tolist()
    ]


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
    note_unpaired(report, listing)
    return report


def publish(s: Session | fmt.CacheFiles, manifest: fmt.Manifest) -> None:
    """Make ``manifest`` the cache's current version, then delete the previous generation's
    files (its data file only if the new one does not share it). ``s``: the build's session,
    or the cache files a repair replaces."""
    previous = s if isinstance(s, fmt.CacheFiles) else s.previous
    write_manifest(manifest)
    if previous is not None:
        retire(previous.manifest, manifest)


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
    placed = placed[~np.isin(placed, list(g.overflow))]  # (they go after, see append_overflow)
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


def append_overflow(
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
