"""What a new generation takes over from the previous cache: unchanged records, and skips.

A record carries over when its file is listed again with the same size and mtime and the
previous cache has the same options and decoder: an appending refresh keeps it where it is
(``kept_records``, ``keep_in_place``), a new data file gets a copy of its pixels (``reusable``,
``copy_reused``). Files the previous build skipped stay skipped while unchanged (``carry_skips``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeGuard

import numpy as np

from . import format as fmt
from . import pixels as px
from ._files import copy_range
from ._layout import Layout
from ._opening import open_for_reading, open_for_writing
from .annotations import recorded_mask
from .scan import Listing


def _lends_records(
    previous: fmt.CacheFiles | None, wanted: dict[str, str]
) -> TypeGuard[fmt.CacheFiles]:
    """Whether records of ``previous`` may be carried over: the same options and decoder."""
    return previous is not None and all(
        previous.manifest.fingerprints.get(k) == wanted[k] for k in ("options", "decoder")
    )


def kept_records(
    previous: fmt.CacheFiles | None, listing: Listing, wanted: dict[str, str]
) -> dict[int, int] | None:
    """New record -> previous record, for every unchanged file of a previous cache of equal
    options and decoder (filled or not: its place in the data file stays its own); None when
    the previous cache cannot share its data file."""
    if not _lends_records(previous, wanted) or not previous.manifest.file("data").exists():
        return None
    return _unchanged(previous, listing, range(len(previous.index)))


def keep_in_place(
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


def reusable(
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
            and _same_mask(previous, j, listing, i)
        ):
            found[i] = j
    return found


def _same_mask(previous: fmt.CacheFiles, j: int, listing: Listing, i: int) -> bool:
    """Whether listed image ``i``'s mask is the one previous record ``j`` was made with (the
    same file, size and mtime), or neither has one."""
    a = listing.annotations
    mine = None if a is None else a.mask_file(i)
    theirs = recorded_mask(previous, j)
    if mine is None or theirs is None:
        return mine is theirs
    return a is not None and theirs == (a.mask_paths[i], *mine[1:])


def carry_skips(
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
        e["path"]: (e.get("size"), e.get("mtime_ns"), e["reason"], e.get("state"))
        for e in previous.manifest.skipped
        # A file that changed may be whole now, and a mask may have come or been fixed: tried
        # again.
        if e.get("state") not in (fmt.BAD_SOURCE_CHANGED, fmt.BAD_MASK)
    }
    for i, rel in enumerate(listing.paths):
        old = stats.get(rel)
        if old and (old[0], old[1]) == (int(listing.sizes[i]), int(listing.mtimes[i])):
            state[i] = old[3] if old[3] in fmt.BAD_REASONS else fmt.BAD_UNDECODABLE
            messages[i] = old[2]


def copy_reused(
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
    assert previous is not None  # the records to reuse are previous's
    old = previous.index
    src_fd = open_for_reading(previous.manifest.file("data"))
    dst_fd = open_for_writing(data_path)
    try:
        count = copied = 0
        for i, j in reuse.items():
            shape = previous.shape(j)
            if shape != layout.shape(i):
                continue  # the header now predicts another size: decode it again
            nbytes = int(px.record_nbytes(*shape, layout.record_layout, layout.mask))
            copy_range(src_fd, dst_fd, int(old[j]["offset"]), int(layout.offsets[i]), nbytes)
            crcs[i] = previous.state[j]["crc32"]
            state[i] = fmt.FILLED
            count += 1
            copied += nbytes
        return count, copied
    finally:
        os.close(src_fd)
        os.close(dst_fd)
