"""The layout of a new generation: each record's shape and offset, planned from file headers.

Shapes come from headers (``mmcache.probe``) and the preprocessing options, before anything is
decoded, so decode workers can write each record in place and ``plan_cache`` can say to the byte
how large a cache will be. A file whose header cannot be read gets shape 0 here: its size is
known only once it is decoded, and its record is then appended after the planned ones.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from . import format as fmt
from . import pixels as px
from .decode import Options, sample_size
from .probe import probe_size
from .reports import ProgressFn
from .scan import Listing


@dataclass
class Layout:
    """Per-record shapes and offsets in a new data file, and what to do with each record."""

    shapes: np.ndarray  # (N, 3) int64; 0 where unknown from the header
    offsets: np.ndarray  # uint64
    data_bytes: int
    state: np.ndarray  # fmt codes: EMPTY = to decode, BAD_* = refused before decoding
    pixels: np.ndarray  # (N,) int64 source pixels from the header (the decode cost); 0 = unknown
    record_layout: str = "rgb"  # how records store their pixels (Options.pixels)
    mask: str | None = None  # the dtype of each record's mask, if records carry one
    # Why each record refused from its header for its annotations (state BAD_MASK) is.
    reasons: dict[int, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> np.ndarray:
        """Each record's size in the data file (0 if unknown)."""
        height, width, channels = self.shapes.T
        return px.record_nbytes(height, width, channels, self.record_layout, self.mask)

    def shape(self, i: int) -> tuple[int, int, int]:
        """Record ``i``'s (height, width, channels) (zeros if unknown from the header)."""
        height, width, channels = self.shapes[i]
        return int(height), int(width), int(channels)


def aligned(n: int) -> int:
    """``n`` rounded up to the next multiple of ``DATA_ALIGN``."""
    return -(-n // fmt.DATA_ALIGN) * fmt.DATA_ALIGN


def layout_offsets(nbytes: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets of records of the given byte sizes laid out in order, and the data file size."""
    sizes = np.asarray(nbytes, dtype=np.int64)
    if len(sizes) == 0:
        return np.zeros(0, np.uint64), 0
    steps = -(-sizes // fmt.DATA_ALIGN) * fmt.DATA_ALIGN
    offsets = np.concatenate([[0], np.cumsum(steps[:-1])]).astype(np.uint64)
    return offsets, int(offsets[-1]) + int(sizes[-1])


def plan_layout(listing: Listing, opts: Options, skip: Collection[int] = ()) -> Layout:
    """Shapes from headers (no decoding) and the offsets they give, in listing order; the
    records ``skip`` (known to be left out: no mask, skipped before and unchanged) get no
    place in the data file, and their headers are not read."""
    n = len(listing)
    left_out = np.zeros(n, bool)
    left_out[list(skip)] = True
    probed = np.flatnonzero(~left_out)
    hw = np.zeros((n, 2), np.int64)
    hw[probed] = probe_sizes(listing, records=probed, opts=opts)
    reasons = refused_by_annotations(listing, probed, hw[probed])
    left_out[list(reasons)] = True
    layout = layout_from_sizes(hw, opts, left_out)
    layout.state[list(reasons)] = fmt.BAD_MASK
    layout.reasons = reasons
    return layout


def refused_by_annotations(listing: Listing, records: np.ndarray, hw: np.ndarray) -> dict[int, str]:
    """Why each of ``records``, of native sizes ``hw`` from headers, cannot take its
    annotations (a COCO size that is not the image's), for those that cannot."""
    a = listing.annotations
    if a is None or a.coco is None:
        return {}
    found = ((i, a.size_mismatch(i, size)) for i, size in zip(records.tolist(), hw))
    return {i: reason for i, reason in found if reason is not None}


def probe_sizes(
    listing: Listing,
    progress: ProgressFn | None = None,
    records: np.ndarray | None = None,
    opts: Options | None = None,
) -> np.ndarray:
    """Native ``(height, width)`` of each listed file (of ``records`` only, if given) from its
    header, as ``opts`` decode it (EXIF orientation applied or not); ``(0, 0)`` if
    unreadable."""
    exif = opts is None or opts.exif_orientation
    records = np.arange(len(listing)) if records is None else records
    n = len(records)
    hw = np.zeros((n, 2), np.int64)
    reader = listing.images  # a kind that reads its files itself says their sizes
    for k, i in enumerate(records.tolist()):
        try:
            if listing.members is not None:  # an archive's member
                size = listing.members.probe(i, int(listing.sizes[i]), exif)
            elif reader is not None:
                size = sample_size(reader, os.path.join(listing.root, listing.paths[i]))
            else:
                size = probe_size(os.path.join(listing.root, listing.paths[i]), exif)
        except OSError:
            size = None
        if size is not None:
            hw[k] = size
        # ~15 us per probe: a call every 4096 files costs nothing and updates a bar 15x a second.
        if progress is not None and ((k + 1) % 4096 == 0 or k + 1 == n):
            progress(k + 1, n)
    return hw


def append_layout(
    listing: Listing,
    opts: Options,
    kept: dict[int, int],
    previous: fmt.CacheFiles,
    skip: set[int],
) -> Layout:
    """The layout of a refresh that shares ``previous``'s data file: the records of ``kept``
    (new record -> previous record) stay where they are; the others, but ``skip``, are laid out
    after ``previous``'s records, their shapes from headers read now."""
    n = len(listing)
    shapes = np.zeros((n, 3), np.int64)
    offsets = np.zeros(n, np.uint64)
    state = np.full(n, fmt.EMPTY, np.uint32)
    pixels = np.zeros(n, np.int64)
    if kept:
        new, old = (np.fromiter(v, np.int64, len(kept)) for v in (kept.keys(), kept.values()))
        shapes[new] = fmt.record_shapes(previous.index)[old]
        offsets[new] = previous.index["offset"][old]
    base = previous.manifest.sizes["data"]
    added = np.array([i for i in range(n) if i not in kept and i not in skip], np.int64)
    data_bytes = base
    reasons: dict[int, str] = {}
    if len(added):
        hw = probe_sizes(listing, records=added, opts=opts)
        reasons = refused_by_annotations(listing, added, hw)
        refused = np.isin(added, list(reasons))
        part = layout_from_sizes(hw, opts, refused)
        part.state[refused] = fmt.BAD_MASK
        start = aligned(base)
        shapes[added], state[added], pixels[added] = part.shapes, part.state, part.pixels
        offsets[added] = part.offsets + np.uint64(start)
        data_bytes = start + part.data_bytes if part.data_bytes else base
    layout = Layout(shapes, offsets, data_bytes, state, pixels, opts.pixels, opts.mask)
    layout.reasons = reasons
    return layout


def layout_from_sizes(hw: np.ndarray, opts: Options, left_out: np.ndarray | None = None) -> Layout:
    """The layout of records of native sizes ``hw`` (as ``probe_sizes`` gives) under ``opts``;
    records ``left_out`` (a mask) take no space."""
    n = len(hw)
    shapes = np.zeros((n, 3), np.int64)
    state = np.full(n, fmt.EMPTY, np.uint32)
    placed = np.ones(n, bool) if left_out is None else ~left_out
    known = (hw[:, 0] > 0) & placed
    if opts.size is not None:
        # The stored shape needs no header; decoding checks the rest (and the pixel limit).
        shapes[~known & placed] = opts.output_shape(1, 1)
    too_large = known & (hw[:, 0] * hw[:, 1] > opts.max_pixels)
    state[too_large] = fmt.BAD_TOO_LARGE
    ok = known & ~too_large
    if ok.any():
        # Files share sizes (a camera's few resolutions), so each distinct size is shaped once;
        # one int64 key per size sorts ~10x faster than np.unique(axis=0) on the pairs.
        keys, inverse = np.unique(hw[ok, 0] << 32 | hw[ok, 1], return_inverse=True)
        shaped = np.array([opts.output_shape(int(k >> 32), int(k & 0xFFFFFFFF)) for k in keys])
        shapes[ok] = shaped.reshape(-1, 3)[inverse.reshape(-1)]
    layout = Layout(
        shapes, np.zeros(n, np.uint64), 0, state, hw[:, 0] * hw[:, 1], opts.pixels, opts.mask
    )
    layout.offsets, layout.data_bytes = layout_offsets(layout.nbytes)
    return layout
