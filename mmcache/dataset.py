"""The dataset: ``MemmapImageDataset``, a torch Dataset that reads images as slices of a cache.

Each process opens the cache's data file itself, on first use: a DataLoader worker, forked or
spawned, receives only the cache path and generation (pickling the dataset never carries pixels
or the index), and reads pixels out of the OS page cache, which all processes and later runs
share. Each sample is a writable array of its own, a private copy-on-write mapping of the
record's pages made for that read: nothing is allocated or copied to read it, transforms may
write to it (only the pages they write are copied, privately), the default collate takes it
without a warning, and a process's memory does not grow with the cache. The reading itself is
its ``reader``'s (``mmcache._records``), which ``BatchLoader`` and ``QuasiRandomSampler`` use too.

In lazy mode the dataset also fills the cache: an empty record is decoded on its first read and
stored with ``pwrite``; the record states are mapped shared, so every process sees every other's
fills at once, through the cache files alone (no Manager, no lock).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any, overload

import numpy as np
import torch
from torch.utils.data import Dataset

from . import format as fmt
from . import pixels as px
from ._records import RecordReader, open_reader
from ._staleness import (
    SOURCE_CHECKS,
    rebuild_advice,
    recorded_source,
    rescan,
    same_options,
    same_source,
    stale_reason,
)
from .annotations import annotate
from .build import build_cache, create_lazy_cache
from .decode import Options
from .errors import (
    BadImageWarning,
    CacheNotFoundError,
    CacheStaleError,
    DecodeError,
    StaleCacheWarning,
)
from .remote.local_copy import up_to_date_copy
from .remote.stores import is_remote
from .residency import WarmReport, start_warming
from .scan import Listing, scan_source, source_exists
from .transforms import UpscaleCause, crops_in, leading_crop

__all__ = ["MemmapImageDataset"]

ON_STALE = ("warn", "error", "ignore", "refresh")
ON_BAD = ("raise", "substitute")
VERIFY = (None, "first-read")


class MemmapImageDataset(Dataset):
    """Images and labels from an mmcache cache, with torchvision ``ImageFolder``'s interface.

    ``ds[i]`` is ``(image, label)``: ``image`` an H x W x C uint8 numpy array (C = 3, RGB unless
    the cache was built with ``color="bgr"``; C = 1 for ``"gray"``), exactly the pixels the build
    stored, passed through ``transform``; ``label`` an int, through ``target_transform``. A cache
    built with ``pixels="yuv420"`` stores planar I420: each image is converted back to RGB (BGR)
    as it is read, and ``planes(i)`` gives the stored planes instead (``docs/pixels.md``).

    A cache with annotations (built with ``masks=``, ``coco=`` or ``fields=``) gives
    ``(image, target)`` with ``target`` a dict, as torchvision's segmentation and detection
    datasets wrapped for transforms v2 do: ``"mask"`` (H x W, uint8 or uint16), ``"boxes"``
    (N x 4 float32 x1, y1, x2, y2 in the image's pixels), ``"labels"`` (N int64),
    ``"iscrowd"`` (N uint8) and the user's fields, as present; ``transform`` is then called
    with the pair and returns one (mmcache's crops, flip and ``Compose`` move masks and boxes
    with the image). Boxes vary in number: a DataLoader needs a ``collate_fn`` that keeps them
    a list (``lambda batch: tuple(zip(*batch))``), as torchvision's detection references do.

    Lazy mode: given ``source`` (and the build's preprocessing options), a missing cache is
    created at once without decoding, and each record is decoded and stored the first time any
    process reads it; later reads, by any worker, epoch or run, come from the cache. A cache of
    the same source and options (lazy or built) is opened as it is; a cache of other options is
    replaced by a new lazy cache only with ``replace``; a changed source is handled as
    ``on_stale`` says.

    Args:
        cache: the cache folder, as made by ``build_cache`` / ``mmcache build``, or to be made.
        transform: applied to each image array, a private copy of the stored record (it may
            write into it).
        target_transform: applied to each label.
        on_stale: what to do when the source changed since the cache was made, or the cache was
            made by another decoder version: ``"warn"`` (a ``StaleCacheWarning`` with a summary),
            ``"error"`` (raise ``CacheStaleError``), ``"ignore"`` (skip the check, which scans
            the source folder) or ``"refresh"`` (bring the cache up to date now: a built cache
            is rebuilt, decoding only new and modified files; a lazy cache gets a new generation
            keeping the filled records of unchanged files). A source that is not there (a copied
            cache) is not checked, except that ``"error"`` raises ``CacheStaleError`` naming it.
        source: the image folder or ``path,label`` list: enables lazy mode.
        on_bad: a file that cannot be cached (undecodable, over ``max_pixels``, changed since it
            was listed, or decoding to another size than its header says): ``"raise"`` a
            ``DecodeError`` naming it, as ``ImageFolder`` raises on a corrupt file, or
            ``"substitute"`` the next good record (image and label), with a ``BadImageWarning``
            once per bad record and process.
        verify: ``"first-read"`` checks each record's CRC-32 the first time this process reads
            it, and raises ``CacheFormatError`` naming the record if the pixels were damaged on
            disk; ``None`` (default) trusts the cache (``mmcache verify`` checks it whole).
            Costs one CRC-32 per record per process, nothing on later reads; a record
            this process fills itself is not checked again.
        warm: read the cache into the page cache in a background thread of this process (not
            of DataLoader workers) while training starts: ``True`` within the default budget
            (90% of RAM), or a budget such as ``"80%"`` or ``"8G"`` (see ``warm_cache``).
            ``wait_warm()`` waits for it and returns its ``WarmReport``.
        replace: in lazy mode, replace a cache made from another source or with other
            preprocessing options by a new lazy cache; without it such a cache raises
            ``SourceChangedError`` or ``OptionsChangedError``.
        source_moved: in lazy mode, accept a cache made from another folder as ``source``'s
            (the same images moved there), as ``build_cache`` does.
        source_check: how ``on_stale`` finds a changed source. ``"quick"`` (default): the
            source is taken as unchanged, without listing it, while every folder of it has the
            mtime the build recorded (an archive, its size and mtime): files added, removed or
            renamed (or replaced by a rename) are seen, a file rewritten in place is not.
            ``"full"``: list the source and compare each file's size and mtime, as every
            ``mmcache build`` does (docs/refresh.md).
        local: with ``cache`` a URL (``s3://bucket/prefix``, ``file:///folder``: a cache
            pushed with ``push_cache``), the local folder of its copy (default: under
            ``$MMCACHE_LOCAL``, else ``~/.cache/mmcache/remote``). The first open makes it a
            sparse copy, each record fetched (with its neighbours) on its first read. A copy
            of a generation pushed over since is used as it is (``on_stale="warn"``, with a
            ``StaleCacheWarning``; ``"ignore"``, without asking the store), refused
            (``"error"``), or brought to the new push (``"refresh"``: only its new records are
            fetched); a store that cannot be reached leaves the copy usable as it is ("warn",
            "ignore"; "error" and "refresh" raise).
        **options: in lazy mode, the preprocessing (``short_side=256``, ...), as for
            ``build_cache``; a built cache keeps the options it was built with.

    Examples:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> lazy = MemmapImageDataset("cache/lazy", source="data/train")  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP

    Raises:
        CacheNotFoundError: no finished cache at ``cache`` (and no ``source``).
        CacheFormatError: a damaged cache, or one of an unknown format version.
        CacheStaleError: with ``on_stale="error"`` and a changed source.
        SourceChangedError: lazy mode over a cache of another source, without ``replace``
            or ``source_moved``.
        OptionsChangedError: lazy mode over a cache of other options, without ``replace``.
        CacheFormatError: with ``verify="first-read"``, from ``ds[i]`` whose pixels are damaged.
        DecodeError: when reading a bad record, with ``on_bad="raise"``.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        transform: Callable[[np.ndarray], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        on_stale: str = "warn",
        *,
        source: str | os.PathLike | None = None,
        on_bad: str = "raise",
        verify: str | None = None,
        warm: bool | str | int = False,
        replace: bool = False,
        source_moved: bool = False,
        masks: str | os.PathLike | None = None,
        coco: str | os.PathLike | None = None,
        source_check: str = "quick",
        local: str | os.PathLike | None = None,
        **options: Any,
    ) -> None:
        if on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {', '.join(ON_STALE)}, got {on_stale!r}")
        if is_remote(cache):
            if source is not None:
                raise ValueError("source= makes a lazy cache from images; a URL's is published")
            # on_stale applies to the remote: the check of its sources is the builder's.
            cache, on_stale = up_to_date_copy(str(cache), local, on_stale), "ignore"
        elif local is not None:
            raise ValueError(f"local= is the folder of a remote cache's copy; {cache} is local")
        if source_check not in SOURCE_CHECKS:
            raise ValueError(f"source_check must be 'quick' or 'full', got {source_check!r}")
        self.source_check = source_check
        if on_bad not in ON_BAD:
            raise ValueError(f"on_bad must be one of {', '.join(ON_BAD)}, got {on_bad!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be None or 'first-read', got {verify!r}")
        if source is None and (options or masks is not None or coco is not None):
            given = [*options, *(["masks"] if masks else []), *(["coco"] if coco else [])]
            raise ValueError(
                f"preprocessing options and annotations ({', '.join(given)}) apply only with "
                "source= (lazy mode); a built cache keeps those it was built with"
            )
        if masks is not None or coco is not None:
            options = {**options, "exif_orientation": False}  # as build_cache's, see there
        if masks is not None:
            options = {"mask": "uint8", **options}
        self._masks, self._coco = masks, coco
        self.cache = fmt.cache_folder(cache)
        self.transform = transform
        self.target_transform = target_transform
        self.on_bad = on_bad
        self.verify = verify
        self._source_given = source is not None  # lazy fills trust the recorded root then
        files = self._open(source, Options(**options), on_stale, replace, source_moved)
        self.generation = files.manifest.generation
        self._attach(files)
        self.warn_if_upscaling([transform], stacklevel=2)
        self._warm_thread = start_warming(files.manifest, warm) if warm is not False else None

    def _open(
        self,
        source: str | os.PathLike | None,
        options: Options,
        on_stale: str,
        replace: bool,
        source_moved: bool,
    ) -> fmt.CacheFiles:
        """Read the cache; in lazy mode create or replace it first when it does not fit."""
        try:
            files = fmt.open_cache(self.cache)
        except CacheNotFoundError:
            if source is None:
                raise
            files = None
        listing = None
        if source is not None:
            if (
                files is None
                or not same_options(files.manifest, options)
                or not same_source(files.manifest, source)
            ):
                create_lazy_cache(
                    scan_source(source),
                    self.cache,
                    replace=replace,
                    source_moved=source_moved,
                    masks=self._masks,
                    coco=self._coco,
                    **asdict(options),
                )
                return fmt.open_cache(self.cache)
            if on_stale != "ignore":
                listing = scan_source(source)
                listing.annotations = annotate(listing, self._masks, self._coco)
        assert files is not None  # a missing cache was created above, or CacheNotFoundError raised
        if on_stale == "ignore":
            return files
        recorded = recorded_source(files.manifest)
        if on_stale == "error" and recorded and not source_exists(recorded):
            raise CacheStaleError(
                f"{self.cache}: on_stale='error' cannot check the cache: its source {recorded} "
                "is not there (unmounted, moved or mistyped?); mount it, or open the cache with "
                "on_stale='ignore' (a copy used without its source)"
            )
        reason = stale_reason(files, listing, quick=self.source_check == "quick")
        if reason is None:
            return files
        if on_stale == "refresh":
            return self._refresh(files, listing, options if source is not None else None)
        message = f"{self.cache}: the cache is stale: {reason}; {rebuild_advice(files.manifest)}"
        if on_stale == "error":
            raise CacheStaleError(message)
        warnings.warn(message, StaleCacheWarning, stacklevel=3)
        return files

    def warn_if_upscaling(self, transforms: Sequence[Any], stacklevel: int = 1) -> None:
        """Warn, once per crop and output size, of mmcache's crops in ``transforms`` (crops,
        ``Compose``, ``MultiCrop``; anything else, None included, is passed over) that upscale
        stored images, saying whether this cache's size option or the source made them that small
        (a ``UserWarning``). Called here, in the process that makes the dataset or loader, it
        marks the crops warned: DataLoader workers, forked or spawned, inherit the mark and
        do not warn again, each their own."""
        crops = [crop for t in transforms for crop in crops_in(t)]
        cause = self._upscale_cause() if crops else None
        for crop in crops:
            crop.warn_if_upscaling(self.reader.records.shapes, cause, stacklevel=stacklevel + 1)

    def _upscale_cause(self) -> UpscaleCause:
        m = self.manifest
        options = Options.from_json(m.options)
        hw = self.reader.records.shapes[:, :2]
        if options.size is not None:
            sized = np.ones(len(hw), bool)
        elif options.short_side is not None:  # never enlarged: at the side, it was shrunk
            sized = hw.min(axis=1) >= options.short_side
        elif options.max_side is not None:
            sized = hw.max(axis=1) >= options.max_side
        else:
            sized = np.zeros(len(hw), bool)

        def rebuild(short_side: int) -> str:
            wanted = replace(options, size=None, max_side=None, short_side=short_side)
            if m.mode == "lazy":
                return f"make it again with short_side={short_side} and replace=True"
            command = f"mmcache build {recorded_source(m)} {m.path} {wanted.flags()} --replace"
            return f"rebuild it with `{command}`"

        size_option = Options(size=options.size, max_side=options.max_side,
                              short_side=options.short_side)  # fmt: skip
        return UpscaleCause(sized, size_option.flags(), rebuild)

    def _refresh(
        self, files: fmt.CacheFiles, listing: Listing | None, options: Options | None
    ) -> fmt.CacheFiles:
        """Bring a stale cache up to date the way it was made: built caches by a build."""
        m = files.manifest
        if listing is None:
            listing = rescan(m)
        kwargs = asdict(options if options is not None else Options.from_json(m.options))
        update = build_cache if m.mode == "build" else create_lazy_cache
        update(listing, self.cache, **kwargs)
        return fmt.open_cache(self.cache)

    def _attach(self, files: fmt.CacheFiles) -> None:
        self._reader: RecordReader | None = RecordReader(
            self.cache, files, verify=self.verify is not None, source_given=self._source_given
        )
        self._warned: set[int] = set()  # bad records this process has warned of

    @property
    def reader(self) -> RecordReader:
        """How this process reads the cache's records (for mmcache's loaders and samplers):
        opened first in a new process (a spawned worker, an unpickled copy)."""
        reader = self._reader
        if reader is None:
            verify = self.verify is not None
            reader = self._reader = open_reader(
                self.cache, self.generation, verify, self._source_given
            )
        return reader

    def __getstate__(self) -> dict[str, Any]:
        # Only the path, generation and transforms travel to workers: O(1) in the cache size.
        # Each process maps and opens the files itself, on first use.
        state = self.__dict__.copy()
        state["_reader"] = None
        state["_warned"] = set()
        state["_warm_thread"] = None  # a thread does not pickle; workers do not warm
        return state

    def __len__(self) -> int:
        return len(self.reader)

    def _checked(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            if not (isinstance(i, torch.Tensor) and i.ndim == 0 and not i.is_floating_point()):
                raise TypeError(f"dataset indices are ints, got {type(i).__name__}")
            i = int(i)  # a sampler's 0-d integer tensor
        i = int(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} images")
        return i + n if i < 0 else i

    def read(self, i: int) -> np.ndarray:
        """The image of record ``i`` (no transform), an H x W x C writable array: the stored
        pixels themselves (an I420 record converted).

        Raises:
            DecodeError: the record's file could not be cached.
        """
        return self.reader.read(self._checked(i))

    def planes(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stored (Y, Cb, Cr) planes of record ``i`` of a ``pixels="yuv420"`` cache:
        H x W and twice ceil(H/2) x ceil(W/2) uint8 views of the record, nothing converted (for
        ``mmcache.yuv420_to_rgb``, on the GPU say).

        Raises:
            ValueError: the cache stores RGB records.
            DecodeError: the record's file could not be cached.
        """
        return self.reader.planes(self._checked(i))

    def _substitute(self, i: int) -> tuple[int, np.ndarray]:
        """The next good record after bad record ``i``, wrapping around."""
        reader = self.reader
        n = len(reader)
        for k in range(1, n):
            j = (i + k) % n
            stored = reader.stored_or_none(j)
            if stored is not None:
                if i not in self._warned:
                    self._warned.add(i)
                    warnings.warn(
                        f"{reader.bad(i)}; returning image {j} in its place",
                        BadImageWarning,
                        stacklevel=3,
                    )
                return j, stored
        raise DecodeError(f"{self.cache}: no image of the cache can be read")

    @overload
    def __getitem__(self, i: int) -> tuple[Any, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> list[tuple[Any, Any]]: ...

    def __getitem__(self, i: int | slice) -> tuple[Any, Any] | list[tuple[Any, Any]]:
        """Sample ``i``: ``(image, label)`` (or ``(image, target)``), through the transforms;
        a slice gives the list of its samples, as a list's slice does."""
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = self._checked(i)
        reader = self.reader
        stored = reader.stored_or_none(i)
        if stored is None:
            if self.on_bad == "raise":
                raise DecodeError(
                    f"{reader.bad(i)}; pass on_bad='substitute' to read the next image instead"
                )
            i, stored = self._substitute(i)
        target: Any = reader.target(i, stored) if reader.annotated else int(reader.labels[i])
        # An I420 record under one of mmcache's crops: only the box is converted (the same
        # pixels as cropping the converted image, drawn the same way).
        crop, transform = leading_crop(self.transform) if reader.layout.planar else (None, None)
        if crop is not None:
            height, width = px.image_shape(stored)[:2]
            box = crop.draw(height, width)
            img = crop.crop_planes(*px.planes(stored), reader.color, box=box)
            if reader.annotated:
                target = crop.crop_target(box, (height, width), target)
        else:
            img, transform = reader.image(stored), self.transform
        if transform is not None:
            if reader.annotated:  # torchvision's detection and segmentation transforms' way
                img, target = transform((img, target))
            else:
                img = transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __repr__(self) -> str:
        # torchvision's VisionDataset form: the class, then a line per fact, indented.
        m = self.manifest
        flags = Options.from_json(m.options).flags()
        made = ", ".join(["built" if m.mode == "build" else "lazy", *([flags] if flags else [])])
        lines = [
            f"Number of images: {len(self)}",
            f"Classes: {len(m.classes)}",
            f"Cache: {self.cache} ({made})",
            *(f"{name}: {value!r}".replace("\n", "\n    ") for name, value in (
                ("Transform", self.transform), ("Target transform", self.target_transform))
              if value is not None),
        ]  # fmt: skip
        return "\n    ".join([type(self).__name__, *lines])

    def wait_warm(self, timeout: float | None = None) -> WarmReport | None:
        """Wait for the ``warm=`` background read; its report, or None if none ran (or it is
        still running after ``timeout`` seconds). An error it met is raised here."""
        thread = getattr(self, "_warm_thread", None)
        return None if thread is None else thread.result(timeout)

    # torchvision ImageFolder's attributes ---------------------------------------------------

    @property
    def classes(self) -> list[str]:
        return list(self.reader.manifest.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(source path, label)`` per image, as in ImageFolder (the source need not exist)."""
        reader = self.reader
        return [(p, int(label)) for p, label in zip(reader.source_paths(), reader.labels)]

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    @property
    def targets(self) -> list[int]:
        return self.reader.labels.tolist()

    @property
    def manifest(self) -> fmt.Manifest:
        """The cache's manifest: its options, classes, source, sizes and generation."""
        return self.reader.manifest
