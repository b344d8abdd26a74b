"""The dataset: ``MemmapImageDataset``, a torch Dataset that reads images as slices of a cache.

Each process opens the cache's data file itself, on first use: a DataLoader worker, forked or
spawned, receives only the cache path and generation (pickling the dataset never carries pixels
or the index), and reads pixels out of the OS page cache, which all processes and later runs
share. Each sample is a writable array of its own, a private copy-on-write mapping of the
record's pages made for that read: nothing is allocated or copied to read it, transforms may
write to it (only the pages they write are copied, privately), the default collate takes it
without a warning, and a process's memory does not grow with the cache. ``BatchLoader`` reads
records through the same dataset (its ``records`` and ``read_into``) into batch buffers.

In lazy mode the dataset also fills the cache: ``RecordFiller`` decodes an empty record on its
first read and stores it with ``pwrite``; the record states are mapped shared, so every process
sees every other's fills at once, through the cache files alone (no Manager, no lock).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from . import format as fmt
from . import pixels as px
from ._filler import RecordFiller
from ._staleness import rebuild_advice, recorded_source, same_options, same_source, stale_reason
from .build import build_cache, create_lazy_cache
from .decode import Options, undecodable_reason
from .errors import (
    BadImageWarning,
    CacheFormatError,
    CacheNotFoundError,
    CacheStaleError,
    DecodeError,
    StaleCacheWarning,
)
from .residency import WarmReport, memory, start_warming
from .scan import Listing, scan_source

ON_STALE = ("warn", "error", "ignore", "refresh")
ON_BAD = ("raise", "substitute")
VERIFY = (None, "first-read")
# How often a dataset looks again whether its data file fits in the RAM available (psutil and
# the cgroup's files: tens of microseconds, too much for every read).
FIT_CHECK_SECONDS = 2.0
# What __getstate__ drops: each process maps and opens these itself, on first use.
_PER_PROCESS = (
    "_files", "_records", "_offsets", "_shapes", "_nbytes", "_labels", "_data", "_fd", "_states",
    "_codes", "_filler", "_warned", "_verified",
)  # fmt: skip


@dataclass(frozen=True)
class Records:
    """A dataset's records as arrays, in record order (do not modify them).

    Attributes:
        offsets: each record's offset in the data file (int64).
        shapes: each record's ``(height, width, channels)``, an (N, 3) int64 array.
        nbytes: each record's size in the data file (int64): height * width * channels in an
            RGB cache (``mmcache.pixels.record_nbytes`` gives the other layouts').
        labels: each record's label (int64).
    """

    offsets: np.ndarray
    shapes: np.ndarray
    nbytes: np.ndarray
    labels: np.ndarray


class MemmapImageDataset(Dataset):
    """Images and labels from an mmcache cache, with torchvision ``ImageFolder``'s interface.

    ``ds[i]`` is ``(image, label)``: ``image`` an H x W x C uint8 numpy array (C = 3, RGB unless
    the cache was built with ``color="bgr"``; C = 1 for ``"gray"``), exactly the pixels the build
    stored, passed through ``transform``; ``label`` an int, through ``target_transform``. A cache
    built with ``pixels="yuv420"`` stores planar I420: each image is converted back to RGB (BGR)
    as it is read, and ``planes(i)`` gives the stored planes instead (``docs/pixels.md``).

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
            cache) is not checked.
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
        **options: in lazy mode, the preprocessing (``short_side=256``, ...), as for
            ``build_cache``; a built cache keeps the options it was built with.

    Example:
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
        **options: Any,
    ) -> None:
        if on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {', '.join(ON_STALE)}, got {on_stale!r}")
        if on_bad not in ON_BAD:
            raise ValueError(f"on_bad must be one of {', '.join(ON_BAD)}, got {on_bad!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be None or 'first-read', got {verify!r}")
        if source is None and options:
            raise ValueError(
                f"preprocessing options ({', '.join(options)}) apply only with source= (lazy "
                "mode); a built cache keeps the options it was built with"
            )
        self.cache = Path(cache).expanduser().absolute()
        self.transform = transform
        self.target_transform = target_transform
        self.on_bad = on_bad
        self.verify = verify
        files = self._open(source, Options(**options), on_stale, replace, source_moved)
        self.generation = files.manifest.generation
        self._attach(files)
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
                    **asdict(options),
                )
                return fmt.open_cache(self.cache)
            if on_stale != "ignore":
                listing = scan_source(source)
        if on_stale == "ignore":
            return files
        reason = stale_reason(files, listing)
        if reason is None:
            return files
        if on_stale == "refresh":
            return self._refresh(files, listing, options if source is not None else None)
        message = f"{self.cache}: the cache is stale: {reason}; {rebuild_advice(files.manifest)}"
        if on_stale == "error":
            raise CacheStaleError(message)
        warnings.warn(message, StaleCacheWarning, stacklevel=3)
        return files

    def _refresh(
        self, files: fmt.CacheFiles, listing: Listing | None, options: Options | None
    ) -> fmt.CacheFiles:
        """Bring a stale cache up to date the way it was made: built caches by a build."""
        m = files.manifest
        if listing is None:
            listing = scan_source(recorded_source(m))
        kwargs = asdict(options if options is not None else Options.from_json(m.options))
        update = build_cache if m.mode == "build" else create_lazy_cache
        update(listing, self.cache, **kwargs)
        return fmt.open_cache(self.cache)

    def _attach(self, files: fmt.CacheFiles) -> None:
        """Keep what ``__getitem__`` needs as plain arrays; the pixels are mapped on first read."""
        self._files = files
        index = files.index
        self._records = Records(
            offsets=index["offset"].astype(np.int64),
            shapes=fmt.record_shapes(index),
            nbytes=fmt.record_nbytes(index, files.manifest.pixels),
            labels=index["label"].astype(np.int64),
        )
        # The arrays __getitem__ indexes, without an attribute lookup each.
        records = self._records
        self._offsets, self._shapes, self._nbytes, self._labels = (
            records.offsets, records.shapes, records.nbytes, records.labels,
        )  # fmt: skip
        self._data: np.ndarray | None = None
        self._fd = -1
        self._fit_checked, self._exact = -FIT_CHECK_SECONDS, False  # see _reads_exactly
        self._states: np.ndarray | None = None
        self._codes: np.ndarray | None = None
        self._filler: RecordFiller | None = None
        self._warned: set[int] = set()
        # verify="first-read": which records this process has checked (a bit each, ~160 KB
        # for 1.28M records); never pickled, so each worker checks what it reads itself.
        self._verified = np.zeros(len(index), bool) if self.verify else None

    def _loaded(self) -> fmt.CacheFiles:
        """This dataset's generation, opened first in a new process (a spawned worker, an
        unpickled copy)."""
        if self._files is None:
            manifest = fmt.read_manifest(self.cache)
            if manifest.generation != self.generation:
                raise self._rebuilt(manifest.generation)
            self._attach(fmt.read_cache_files(manifest))
        return self._files

    def _rebuilt(self, generation: str) -> CacheFormatError:
        return CacheFormatError(
            f"{self.cache}: the cache was rebuilt after this dataset was opened "
            f"(generation {generation}, expected {self.generation}); open it again"
        )

    def _map(self) -> np.ndarray:
        self._loaded()
        if self._data is None:
            m = self._files.manifest
            nbytes, count = m.sizes["data"], m.count
            try:
                # The record states are mapped shared and read-only: a record another process
                # fills (they write with pwrite) reads FILLED here at once, without a syscall.
                self._states = (
                    np.memmap(m.file("state"), dtype=fmt.STATE_DTYPE, mode="r", shape=(count,))
                    if count
                    else np.zeros(0, fmt.STATE_DTYPE)
                )
                self._codes = self._states["state"]
                # Shared and read-only: pwrites by other processes (lazy fills) show at once,
                # and nothing this process does can change what a later read returns.
                self._data = (
                    np.memmap(m.file("data"), dtype=np.uint8, mode="r", shape=(nbytes,))
                    if nbytes
                    else np.zeros(0, np.uint8)
                )
                self._fd = os.open(m.file("data"), os.O_RDONLY)
            except FileNotFoundError:
                raise self._rebuilt(fmt.read_manifest(self.cache).generation) from None
            except ValueError:  # mmap refuses a file shorter than the mapping: it shrank
                raise CacheFormatError(
                    f"{m.file('data')}: shorter than the {nbytes} bytes checked at open: the "
                    "file was truncated since; rebuild the cache"
                ) from None
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        # Only the path, generation and transforms travel to workers: O(1) in the cache size.
        state = self.__dict__.copy()
        for key in _PER_PROCESS:
            state.pop(key, None)
        state["_files"] = None
        state["_data"] = None
        state["_warm_thread"] = None  # a thread does not pickle; workers do not warm
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fd = -1

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            with suppress(OSError):
                os.close(fd)

    def __len__(self) -> int:
        self._loaded()
        return len(self._offsets)

    def _pixels(self, i: int) -> np.ndarray | None:
        """Record ``i``'s pixels, filling it first if it is empty; None if it is bad."""
        self._map()
        code = self._codes[i]
        if code == fmt.EMPTY:
            if self._filler is None:
                self._filler = RecordFiller(self._files)
            code, pixels = self._filler.fill(i)
            if pixels is not None and self._verified is not None:
                self._verified[i] = True  # its CRC was computed from these very pixels
            return pixels  # the decoded array: no need to read back what was just written
        if code != fmt.FILLED:
            return None
        img = self._private_view(i)
        if self._verified is not None and not self._verified[i]:
            self._verify(i, img)
        return img

    def _private_view(self, i: int) -> np.ndarray:
        """Record ``i`` as a writable array of its own: a private (copy-on-write) mapping of
        just the record's pages, made for this read and gone with the array.

        No memory is allocated or copied: the array's pages are the page cache's until
        someone writes to them, and a write (a transform working in place) copies only the
        page written, privately: it never reaches the cache, another read, or another process.
        The mapping ends when the array is freed, so a process's memory does not grow with
        the cache. The file's size is checked first: a page past its end would be SIGBUS.
        """
        off, n = int(self._offsets[i]), int(self._nbytes[i])
        if self.cut_short(off + n):
            raise self._truncated(i)
        start = off - off % mmap.ALLOCATIONGRANULARITY
        exact = self._reads_exactly()
        if exact:  # ask for the record's pages, all of them and no others (see below)
            os.posix_fadvise(self._fd, start, off + n - start, os.POSIX_FADV_WILLNEED)
        pages = mmap.mmap(self._fd, off + n - start, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)  # fmt: skip
        if exact:
            pages.madvise(mmap.MADV_RANDOM)
        flat = np.frombuffer(pages, np.uint8, n, off - start)
        return px.stored_view(flat, self._shapes[i], self._files.manifest.pixels)

    def _reads_exactly(self) -> bool:
        """Whether a record's pages are read exactly, because the data file does not fit in
        the RAM available (looked at every ``FIT_CHECK_SECONDS``).

        A page fault on a file mapping that misses the page cache reads around the page, as
        much as the disk's read-ahead setting (8 MiB on some cloud VMs): for a random order over
        a cache larger than RAM that is megabytes from disk per record, most of it evicted
        unused. There, the record's range is requested (``POSIX_FADV_WILLNEED``) and the
        mapping advised ``MADV_RANDOM``. A cache that fits keeps the read-around: what it
        brings in is read later in the epoch anyway.
        """
        now = time.monotonic()
        if now - self._fit_checked >= FIT_CHECK_SECONDS:
            self._fit_checked = now
            self._exact = (
                hasattr(os, "posix_fadvise")
                and hasattr(mmap, "MADV_RANDOM")
                and self._files.manifest.sizes["data"] > memory().available
            )
        return self._exact

    def _truncated(self, i: int) -> CacheFormatError:
        return CacheFormatError(
            f"{self._files.manifest.file('data')}: record {i} is cut short: the file was "
            "truncated after the cache was opened; rebuild the cache"
        )

    def read_into(self, i: int, out: np.ndarray, start: int = 0) -> None:
        """Read ``out.nbytes`` stored bytes of FILLED record ``i``, from byte ``start`` of the
        record on (a crop's rows, say), into the writable buffer ``out`` with one ``pread``:
        part of the reading surface (see ``records``).

        Raises:
            CacheFormatError: the data file was truncated after the dataset opened it.
        """
        self._map()
        if os.preadv(self._fd, [out], int(self._offsets[i]) + start) != out.nbytes:
            raise self._truncated(i)

    def _verify(self, i: int, img: np.ndarray) -> None:
        """verify="first-read": check a FILLED record against its CRC-32 on disk now.

        The CRC comes from the shared state mapping, not the copy read at open: in a lazy cache
        other processes fill records (and write their CRCs) after this one opened it.
        """
        expected = int(self._states["crc32"][i])
        actual = zlib.crc32(img)
        if actual != expected:
            raise CacheFormatError(
                f"{self.cache}: record {i} ({self._files.path(i)}): its pixels fail their "
                f"checksum (CRC-32 {actual:08x}, stored {expected:08x}): the data file is "
                f"damaged; `mmcache verify {self.cache} --repair` decodes it again from the "
                "source"
            )
        self._verified[i] = True

    def _checked(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} images")
        return i + n if i < 0 else i

    def _bad(self, i: int) -> str:
        """``source path: why`` for a bad record."""
        root = self._files.manifest.source.get("root", "")
        path = os.path.join(root, self._files.path(i))
        code = int(self._codes[i])
        reason = fmt.BAD_REASONS.get(code, "unknown state")
        if code == fmt.BAD_UNDECODABLE:
            reason = undecodable_reason(path)  # what the file is, when it is still there
        return f"{path}: {reason}"

    def read(self, i: int) -> np.ndarray:
        """The image of record ``i`` (no transform), an H x W x C writable array: the stored
        pixels themselves (an I420 record converted).

        Raises:
            DecodeError: the record's file could not be cached.
        """
        return self._image(self._stored(i))

    def planes(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stored (Y, Cb, Cr) planes of record ``i`` of a ``pixels="yuv420"`` cache:
        H x W and twice ceil(H/2) x ceil(W/2) uint8 views of the record, nothing converted (for
        ``mmcache.yuv420_to_rgb``, on the GPU say).

        Raises:
            ValueError: the cache stores RGB records.
            DecodeError: the record's file could not be cached.
        """
        if self.manifest.pixels == "rgb":
            raise ValueError(f"{self.cache}: stores RGB records, not planes; read(i) gives them")
        return px.planes(self._stored(i))

    def _stored(self, i: int) -> np.ndarray:
        """Record ``i`` as stored: H x W x C, or an I420 record (``mmcache.pixels``)."""
        i = self._checked(i)
        pixels = self._pixels(i)
        if pixels is None:
            raise DecodeError(f"{self._bad(i)}; it is not in the cache")
        return pixels

    def _image(self, stored: np.ndarray) -> np.ndarray:
        return px.to_image(stored, self._files.manifest.options.get("color", "rgb"))

    def _substitute(self, i: int) -> tuple[int, np.ndarray]:
        """The next good record after bad record ``i``, wrapping around."""
        n = len(self._offsets)
        for k in range(1, n):
            j = (i + k) % n
            pixels = self._pixels(j)
            if pixels is not None:
                if i not in self._warned:
                    self._warned.add(i)
                    warnings.warn(
                        f"{self._bad(i)}; returning image {j} in its place",
                        BadImageWarning,
                        stacklevel=3,
                    )
                return j, pixels
        raise DecodeError(f"{self.cache}: no image of the cache can be read")

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        i = self._checked(i)
        img = self._pixels(i)
        if img is None:
            if self.on_bad == "raise":
                raise DecodeError(
                    f"{self._bad(i)}; pass on_bad='substitute' to read the next image instead"
                )
            i, img = self._substitute(i)
        img = self._image(img)
        target = int(self._labels[i])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def wait_warm(self, timeout: float | None = None) -> WarmReport | None:
        """Wait for the ``warm=`` background read; its report, or None if none ran (or it is
        still running after ``timeout`` seconds). An error it met is raised here."""
        thread = getattr(self, "_warm_thread", None)
        return None if thread is None else thread.result(timeout)

    # torchvision ImageFolder's attributes ---------------------------------------------------

    @property
    def classes(self) -> list[str]:
        return list(self._loaded().manifest.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(source path, label)`` per image, as in ImageFolder (the source need not exist)."""
        files = self._loaded()
        root = files.manifest.source.get("root", "")
        return [(os.path.join(root, p), int(lab)) for p, lab in zip(files.paths(), self._labels)]

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    @property
    def targets(self) -> list[int]:
        self._loaded()
        return self._labels.tolist()

    @property
    def manifest(self) -> fmt.Manifest:
        return self._loaded().manifest

    # The reading surface: what BatchLoader and QuasiRandomSampler read records with ---------

    @property
    def records(self) -> Records:
        """The records' offsets, shapes, sizes and labels as arrays (see ``Records``).

        With ``data_path``, ``filled``, ``mapping`` and ``read_into``, the reading surface for
        loaders and samplers that read records themselves.
        """
        self._loaded()
        return self._records

    @property
    def data_path(self) -> Path:
        """The data file this dataset's generation reads."""
        return self.manifest.file("data")

    def filled(self, indices: np.ndarray) -> np.ndarray:
        """Whether each of the records ``indices`` holds its pixels now (a lazy cache's others
        are read with ``read``, which fills them); a bool array."""
        self._map()
        return self._codes[indices] == fmt.FILLED

    def mapping(self) -> np.ndarray:
        """The data file mapped read-only and shared, as a flat uint8 array (fast to copy
        records out of while the cache is in RAM; a file truncated under it kills the process
        with SIGBUS, where ``read_into`` raises: check ``cut_short`` before reading it)."""
        return self._map()

    def cut_short(self, end: int | None = None) -> bool:
        """Whether the data file now ends before byte ``end`` (default: the end of ``mapping``),
        that is, was truncated after this dataset opened it: one ``fstat``.

        A read of the mapping past the file's end is SIGBUS, which kills the process; a reader
        of the mapping that finds the file cut short reads with ``read_into`` instead, which
        raises ``CacheFormatError`` for the records past the end. A truncation between this
        check and the read is not caught (no Python code can catch a SIGBUS).
        """
        data = self._map()
        return os.fstat(self._fd).st_size < (len(data) if end is None else end)
