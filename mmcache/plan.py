"""Planning a cache before building it: its exact size under each resize policy, from headers.

Decoded pixels are far larger than the files they come from (a 100 KB JPEG of 500x375 is 562 KB
of RGB), so ``plan_cache`` tells, before anything is decoded, how many bytes a cache would take,
whether the destination has them and how much of the cache the page cache could hold. It reads
only file headers (``mmcache.probe``, a few kilobytes a file) and lays the records out with the
build's own code, so its figure for the data file is the byte count the build will write.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from . import format as fmt
from . import pixels as px
from ._generation import open_existing
from ._layout import layout_from_sizes, layout_offsets, probe_sizes
from ._staleness import fingerprints, is_current, to_match
from .decode import Options
from .reports import ProgressFn
from .scan import Listing, scan_source
from .space import (
    check_free_space,
    disk_bytes,
    existing_ancestor,
    free_bytes,
    generation_sizes,
)

__all__ = ["CachePlan", "PolicyPlan", "SizeDistribution", "check_free_space", "plan_cache"]

# The resize policies a plan compares, as Options fields (the user's color and pixel limit are
# added): the native size, and the three common ways to bound it for training at ~224 px.
COMMON_POLICIES: tuple[dict[str, Any], ...] = (
    {},
    {"max_side": 512},
    {"short_side": 256},
    {"size": (224, 224)},
)


def describe(options: Options) -> str:
    """A resize policy as the command line spells it: ``"--short-side 256"``, or ``"native"``."""
    if options.size is not None:
        return f"--size {options.size[1]}x{options.size[0]}"
    if options.max_side is not None:
        return f"--max-side {options.max_side}"
    if options.short_side is not None:
        return f"--short-side {options.short_side}"
    return "native"


@dataclass
class SizeDistribution:
    """Min / median / max of the native sizes whose headers were read (medians are lower
    medians, so each is a real image's value)."""

    width: tuple[int, int, int]
    height: tuple[int, int, int]
    pixels: tuple[int, int, int]

    @classmethod
    def of(cls, hw: np.ndarray) -> SizeDistribution | None:
        if len(hw) == 0:
            return None

        def stats(v: np.ndarray) -> tuple[int, int, int]:
            v = np.sort(v)
            return int(v[0]), int(v[(len(v) - 1) // 2]), int(v[-1])

        return cls(stats(hw[:, 1]), stats(hw[:, 0]), stats(hw[:, 0] * hw[:, 1]))


@dataclass
class PolicyPlan:
    """What a cache built with ``options`` would hold and take."""

    options: Options
    images: int
    sizes: dict[str, int]  # exact bytes of the index, state, paths and data files
    # The data file's bytes under each record layout the options' color allows (gray: RGB only).
    layout_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return describe(self.options)

    @property
    def data_bytes(self) -> int:
        return self.sizes["data"]

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())

    @property
    def disk_bytes(self) -> int:
        """What a build must find free: the files in whole disk blocks, and the manifest."""
        return disk_bytes(self.sizes)


@dataclass
class CachePlan:
    """What building ``source`` into ``cache`` would take, learnt from file headers only.

    ``build`` is the plan under the options asked for; ``policies`` the same figures under the
    common resize policies (``COMMON_POLICIES``, with the asked color and pixel limit). Each
    ``data_bytes`` is exact for the files whose header was read and that decode: a build
    appends the pixels of ``unreadable`` files (if they decode) after them, and leaves out
    ``too_large`` files and those that fail to decode (a truncated JPEG's header is sound).
    """

    source: Path
    cache: Path | None
    files: int
    classes: int
    native: SizeDistribution | None
    unreadable: list[str]
    too_large: list[str]
    build: PolicyPlan
    policies: list[PolicyPlan]
    destination: Path | None  # the existing folder on whose filesystem the cache would live
    free_bytes: int | None
    existing_bytes: int  # the cache already at ``cache`` (kept until a rebuild is published)
    up_to_date: bool  # a build would find ``cache`` current and do nothing
    ram_total: int
    ram_available: int
    seconds: float

    @property
    def images(self) -> int:
        return self.build.images

    @property
    def data_bytes(self) -> int:
        return self.build.data_bytes

    @property
    def total_bytes(self) -> int:
        return self.build.total_bytes

    @property
    def fits_on_disk(self) -> bool | None:
        """Whether a build would pass the free-space check (None without a destination)."""
        if self.free_bytes is None:
            return None
        return self.up_to_date or self.free_bytes >= self.build.disk_bytes

    def ram_fraction(self, policy: PolicyPlan | None = None) -> float:
        """The share of a cache's pixels that this machine's available RAM could keep cached."""
        data = (policy or self.build).data_bytes
        return 1.0 if data <= self.ram_available else self.ram_available / data


def plan_cache(
    source: str | os.PathLike | Listing,
    cache: str | os.PathLike | None = None,
    *,
    progress: ProgressFn | None = None,
    **options: Any,
) -> CachePlan:
    """How large a cache of ``source`` would be, under ``options`` and the common policies,
    and whether it fits at ``cache`` and in RAM; reads only file headers, decodes nothing.

    Args:
        source: what ``build_cache`` takes: a class-folder tree, a flat folder, a list, an
            archive, or a ``Listing``.
        cache: the cache folder a build would write (it need not exist): for its free space.
        progress: called as ``progress(done, total)`` while headers are read.
        **options: the build's preprocessing, as ``Options`` fields (``short_side=256``, ...).

    Examples:
        >>> plan = plan_cache("data/train", "cache/train", short_side=256)  # doctest: +SKIP
        >>> plan.data_bytes, plan.free_bytes, plan.ram_fraction()  # doctest: +SKIP

    Raises:
        SourceError: the source is missing or holds no images.
        ValueError: invalid options.
    """
    opts = Options(**options)
    start = time.perf_counter()
    listing = source if isinstance(source, Listing) else scan_source(source)
    hw = probe_sizes(listing, progress, opts=opts)
    known = hw[:, 0] > 0

    def policy(o: Options) -> PolicyPlan:
        layout = layout_from_sizes(hw, o)
        kept = [listing.paths[i] for i in np.flatnonzero(layout.state == fmt.EMPTY)]
        layouts = [name for name in px.LAYOUTS
                   if o.color != "gray" or not px.layout_named(name).colour_only]  # fmt: skip
        heights, widths, channels = layout.shapes.T
        by_layout = {
            name: layout_offsets(px.record_nbytes(heights, widths, channels, name, o.mask))[1]
            for name in layouts
        }
        return PolicyPlan(o, len(kept), generation_sizes(kept, layout.data_bytes), by_layout)

    base: dict[str, Any] = {
        "color": opts.color,
        "max_pixels": opts.max_pixels,
        "pixels": opts.pixels,
        "mask": opts.mask,  # records with masks: each policy's sizes count them
    }
    policies = [policy(Options(**base, **p)) for p in COMMON_POLICIES]
    same = [p for p in policies if _same_shapes(p.options, opts)]
    build = replace(same[0], options=opts) if same else policy(opts)
    too_large = known & (hw[:, 0] * hw[:, 1] > opts.max_pixels)
    folder = None if cache is None else fmt.cache_folder(cache)
    existing_bytes, up_to_date = _existing(folder, listing, opts)
    memory = psutil.virtual_memory()
    return CachePlan(
        source=listing.list_file or listing.root,
        cache=folder,
        files=len(listing),
        classes=len(listing.classes),
        native=SizeDistribution.of(hw[known]),
        unreadable=[listing.paths[i] for i in np.flatnonzero(~known)],
        too_large=[listing.paths[i] for i in np.flatnonzero(too_large)],
        build=build,
        policies=policies,
        destination=None if folder is None else existing_ancestor(folder),
        free_bytes=None if folder is None else free_bytes(folder),
        existing_bytes=existing_bytes,
        up_to_date=up_to_date,
        ram_total=memory.total,
        ram_available=memory.available,
        seconds=time.perf_counter() - start,
    )


def _same_shapes(a: Options, b: Options) -> bool:
    """Whether two options store every image at the same shape (interpolation aside)."""
    return (a.size, a.max_side, a.short_side, a.color, a.max_pixels, a.pixels, a.mask) == (
        b.size,
        b.max_side,
        b.short_side,
        b.color,
        b.max_pixels,
        b.pixels,
        b.mask,
    )


def _existing(folder: Path | None, listing: Listing, opts: Options) -> tuple[int, bool]:
    """Bytes of the cache at ``folder`` (0 if none), and whether a build would leave it as is."""
    files = None if folder is None else open_existing(folder)
    if files is None:
        return 0, False
    m = files.manifest
    current = is_current(files, listing, to_match(m, fingerprints(listing, opts)))
    return sum(m.sizes.values()), current
