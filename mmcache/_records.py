"""A process's reader of a cache generation's records: mapping, views, reads, fills, checks.

``MemmapImageDataset``, ``BatchLoader`` and ``QuasiRandomSampler`` all read records through a
``RecordReader``; it is made in each process that reads (never pickled), from the cache files.

A record is read three ways: as a private copy-on-write mapping of its pages (``view``: a
writable array of its own, no copy), with one ``pread`` into a buffer (``read_into``), or out of
the shared read-only mapping of the whole data file (``mapping``, for loaders that copy many
records and check ``cut_short`` first). The record states are mapped shared: a record another
process fills (a lazy cache, with ``pwrite``) reads FILLED here at once.
"""

from __future__ import annotations

import mmap
import os
import time
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from . import pixels as px
from ._filler import Filler, lost_fill_markers, open_filler
from ._opening import open_for_reading
from .decode import undecodable_reason
from .errors import CacheFormatError, DecodeError
from .residency import memory
from .sources import SOURCES

# How often a reader looks again whether its data file fits in the RAM available (psutil and
# the cgroup's files: tens of microseconds, too much for every read).
FIT_CHECK_SECONDS = 2.0


@dataclass(frozen=True)
class Records:
    """A cache's records as arrays, in record order (do not modify them).

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


def rebuilt(cache: Path, found: str, expected: str) -> CacheFormatError:
    """The error of a reader whose cache generation was replaced since it was opened."""
    return CacheFormatError(
        f"{cache}: the cache was rebuilt after this dataset was opened "
        f"(generation {found}, expected {expected}); open it again"
    )


def open_reader(
    cache: Path, generation: str, verify: bool, source_given: bool = False
) -> RecordReader:
    """A reader of generation ``generation`` of ``cache``, in a process that has none yet (a
    spawned DataLoader worker, an unpickled dataset).

    Raises:
        CacheFormatError: the cache is another generation now, or damaged.
    """
    manifest = fmt.read_manifest(cache)
    if manifest.generation != generation:
        raise rebuilt(cache, manifest.generation, generation)
    return RecordReader(cache, fmt.read_cache_files(manifest), verify, source_given)


def mapped(path: Path, dtype: np.dtype, count: int, fd: int = -1) -> np.ndarray:
    """``count`` items of ``dtype`` of the cache file ``path`` (or of its open descriptor
    ``fd``), mapped read-only and shared; the file opened safely (``open_for_reading``)."""
    own = fd < 0
    if own:
        fd = open_for_reading(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return np.memmap(f, dtype=dtype, mode="r", shape=(count,))
    finally:
        if own:
            os.close(fd)


_LAZY = frozenset(("records", "offsets", "shapes", "nbytes", "labels"))


class RecordReader:
    """The records of one opened cache generation, as this process reads them.

    Args:
        cache: the cache folder (for messages).
        files: the generation's files, as ``format.open_cache`` read them.
        verify: check each FILLED record's CRC-32 the first time this reader reads it.
    """

    # The records as arrays, and (the same arrays) those each read indexes without an attribute
    # lookup each: made on first use (``__getattr__``), as they cost 48 bytes per record and the
    # process that opens a dataset for DataLoader workers may never read a record itself.
    records: Records
    offsets: np.ndarray
    shapes: np.ndarray
    nbytes: np.ndarray
    labels: np.ndarray

    def __init__(
        self, cache: Path, files: fmt.CacheFiles, verify: bool, source_given: bool = False
    ) -> None:
        self.cache, self.files, self.manifest = cache, files, files.manifest
        # Whether the caller named the source (lazy fills trust the manifest's root then).
        self.source_given = source_given
        index = files.index
        self.data_path = files.manifest.file("data")
        self.pixels = files.manifest.pixels
        self.layout = px.layout_named(self.pixels)
        self.color = files.manifest.options.get("color", "rgb")
        self.data: np.ndarray | None = None  # the data file, mapped on first read
        self.fd = -1
        # The record states and their codes, mapped with the data (empty until then).
        self.states = np.zeros(0, fmt.STATE_DTYPE)
        self.codes = self.states["state"]
        self.filler: Filler | None = None
        self.fit_checked, self.exact = -FIT_CHECK_SECONDS, False  # see reads_exactly
        # Fills a power cut may have lost (another boot's ``filling-`` files): each FILLED
        # record's CRC-32 is checked before it is trusted, and one that fails is filled again.
        lazy = files.manifest.mode == "lazy"
        self.unsure = lazy and bool(lost_fill_markers(files.manifest.path))
        # Which records this reader has checked (a bit each, ~160 KB for 1.28M records).
        self.verified = np.zeros(len(index), bool) if verify or self.unsure else None

    def __getattr__(self, name: str) -> Any:
        if name not in _LAZY or "files" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        index = self.files.index
        records = Records(
            offsets=index["offset"].astype(np.int64),
            shapes=fmt.record_shapes(index),
            nbytes=fmt.record_nbytes(index, self.manifest.pixels, self.manifest.mask),
            labels=index["label"].astype(np.int64),
        )
        self.records = records
        self.offsets, self.shapes = records.offsets, records.shapes
        self.nbytes, self.labels = records.nbytes, records.labels
        return self.__dict__[name]

    def __len__(self) -> int:
        return len(self.files.index)

    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            with suppress(OSError):
                os.close(fd)

    def mapping(self) -> np.ndarray:
        """The data file mapped read-only and shared, as a flat uint8 array (mapped on first
        use, with the record states). Reading it past the file's end is SIGBUS: a reader of
        the mapping checks ``cut_short`` first.

        Raises:
            CacheFormatError: the cache was rebuilt, or the data file truncated, since it was
                opened.
        """
        if self.data is None:
            return self._map()
        return self.data

    def _map(self) -> np.ndarray:
        m = self.manifest
        nbytes, count = m.sizes["data"], m.count
        try:
            # The record states are mapped shared and read-only: a record another process
            # fills (they write with pwrite) reads FILLED here at once, without a syscall.
            self.states = (
                mapped(m.file("state"), fmt.STATE_DTYPE, count)
                if count
                else np.zeros(0, fmt.STATE_DTYPE)
            )
            self.codes = self.states["state"]
            # Shared and read-only: pwrites by other processes (lazy fills) show at once, and
            # nothing this process does can change what a later read returns.
            self.fd = open_for_reading(m.file("data"))
            self.data = data = (
                mapped(m.file("data"), np.dtype(np.uint8), nbytes, self.fd)
                if nbytes
                else np.zeros(0, np.uint8)
            )
        except FileNotFoundError:
            found = fmt.read_manifest(self.cache).generation
            raise rebuilt(self.cache, found, m.generation) from None
        except ValueError:  # mmap refuses a file shorter than the mapping: it shrank
            raise CacheFormatError(
                f"{m.file('data')}: shorter than the {nbytes} bytes checked at open: the "
                "file was truncated since; rebuild the cache"
            ) from None
        return data

    def cut_short(self, end: int | None = None) -> bool:
        """Whether the data file now ends before byte ``end`` (default: the end of
        ``mapping``), that is, was truncated after it was opened: one ``fstat``.

        A reader of the mapping that finds the file cut short reads with ``read_into``
        instead, which raises ``CacheFormatError`` for the records past the end. A truncation
        between this check and the read is not caught (no Python code can catch a SIGBUS).
        """
        data = self.mapping()
        return os.fstat(self.fd).st_size < (len(data) if end is None else end)

    def filled(self, indices: np.ndarray) -> np.ndarray:
        """Whether each of the records ``indices`` holds its pixels now (a lazy cache's others
        are read with ``read``, which fills them); a bool array."""
        self.mapping()
        filled = self.codes[indices] == fmt.FILLED
        # Records not yet checked (verify="first-read", or fills a power cut may have lost)
        # are read with ``read``, which checks their CRC-32 first, as ds[i] does.
        if self.verified is not None:
            filled &= self.verified[indices]
        return filled

    def stored_or_none(self, i: int) -> np.ndarray | None:
        """Record ``i`` as stored (H x W x C, or an I420 record), filling it first if it is
        empty, checked first with ``verify``; None if it is bad."""
        self.mapping()
        code = self.codes[i]
        if self.unsure and code == fmt.FILLED and self.lost(i):
            code = fmt.EMPTY  # a fill that a power cut lost: filled again
        if code == fmt.EMPTY:
            code, pixels = self.own_filler().fill(i)
            if pixels is not None and self.verified is not None:
                self.verified[i] = True  # its CRC was computed from these very pixels
            return pixels  # the decoded array: no need to read back what was just written
        if code != fmt.FILLED:
            return None
        stored = self.view(i)
        if self.verified is not None and not self.verified[i]:
            self.verify(i, stored)
        return stored

    def own_filler(self) -> Filler:
        """This process's filler (a forked DataLoader worker fills under a ``filling-`` file of
        its own)."""
        if self.filler is None or self.filler.pid != os.getpid():
            self.filler = open_filler(self.files, self.source_given)
        return self.filler

    def fill_ahead(self, records: np.ndarray, stopped: Callable[[], bool]) -> None:
        """Fill those of ``records`` that are ``EMPTY``, ahead of their reads, where the filler
        does many at once for less (a sparse copy's fetches), until ``stopped()``."""
        self.mapping()
        empty = records[self.codes[records] == fmt.EMPTY]
        if len(empty):
            self.own_filler().fill_ahead(empty, stopped)

    def lost(self, i: int) -> bool:
        """Whether FILLED record ``i`` fails its CRC-32 (checked once per reader): its fill
        did not reach the disk before a power cut."""
        if self.verified is None or self.verified[i]:
            return False
        if zlib.crc32(self.view(i).data) != int(self.states["crc32"][i]):
            return True
        self.verified[i] = True
        return False

    def stored(self, i: int) -> np.ndarray:
        """Record ``i`` as stored, as ``stored_or_none``.

        Raises:
            DecodeError: the record's file could not be cached.
        """
        stored = self.stored_or_none(i)
        if stored is None:
            raise DecodeError(f"{self.bad(i)}; it is not in the cache")
        return stored

    def read(self, i: int) -> np.ndarray:
        """The image of record ``i``, an H x W x C writable array (an I420 record converted).

        Raises:
            DecodeError: the record's file could not be cached.
        """
        return self.image(self.stored(i))

    def image(self, stored: np.ndarray) -> np.ndarray:
        """A stored record as an H x W x C image (I420 converted to the cache's color)."""
        return px.to_image(stored, self.color)

    @property
    def annotated(self) -> bool:
        """Whether records carry annotations (a mask, fields): reads give ``(image, target)``."""
        return self.manifest.annotated

    def target(self, i: int, stored: np.ndarray) -> dict[str, Any]:
        """Record ``i``'s annotations, torchvision's way: ``"mask"`` (H x W, the stored
        record's own, from ``stored``), and each field (``"boxes"``, ``"labels"``, ...: copies
        of its rows), as the cache has them."""
        target: dict[str, Any] = {}
        mask = px.mask_part(stored)
        if mask is not None:
            target["mask"] = mask
        for name in self.files.fields:
            if not name.startswith("_"):  # mmcache's own (where each mask came from)
                target[name] = self.files.field_rows(name, i).copy()
        return target

    def planes(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stored (Y, Cb, Cr) planes of record ``i`` of a planar cache (views).

        Raises:
            ValueError: the cache stores RGB records.
            DecodeError: the record's file could not be cached.
        """
        if not self.layout.planar:
            raise ValueError(f"{self.cache}: stores RGB records, not planes; read(i) gives them")
        return px.planes(self.stored(i))

    def view(self, i: int) -> np.ndarray:
        """Record ``i`` as a writable array of its own: a private (copy-on-write) mapping of
        just the record's pages, made for this read and gone with the array.

        No memory is allocated or copied: the array's pages are the page cache's until
        someone writes to them, and a write (a transform working in place) copies only the
        page written, privately: it never reaches the cache, another read, or another process.
        The mapping ends when the array is freed, so a process's memory does not grow with
        the cache. The file's size is checked first: a page past its end would be SIGBUS.
        """
        off, n = int(self.offsets[i]), int(self.nbytes[i])
        if self.cut_short(off + n):
            raise self.truncated(i)
        start = off - off % mmap.ALLOCATIONGRANULARITY
        exact = self.reads_exactly()
        if exact:  # ask for the record's pages, all of them and no others (see below)
            os.posix_fadvise(self.fd, start, off + n - start, os.POSIX_FADV_WILLNEED)
        pages = mmap.mmap(self.fd, off + n - start, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)  # fmt: skip
        if exact:
            pages.madvise(mmap.MADV_RANDOM)
        flat = np.frombuffer(pages, np.uint8, n, off - start)
        return px.stored_view(flat, self.shapes[i], self.pixels, self.manifest.mask)

    def reads_exactly(self) -> bool:
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
        if now - self.fit_checked >= FIT_CHECK_SECONDS:
            self.fit_checked = now
            self.exact = (
                hasattr(os, "posix_fadvise")
                and hasattr(mmap, "MADV_RANDOM")
                and self.manifest.sizes["data"] > memory().available
            )
        return self.exact

    def read_into(self, i: int, out: np.ndarray, start: int = 0) -> None:
        """Read ``out.nbytes`` stored bytes of FILLED record ``i``, from byte ``start`` of the
        record on (a crop's rows, say), into the writable buffer ``out`` with one ``pread``.

        Raises:
            CacheFormatError: the data file was truncated after it was opened.
        """
        self.mapping()
        if os.preadv(self.fd, [out.data], int(self.offsets[i]) + start) != out.nbytes:
            raise self.truncated(i)

    def truncated(self, i: int) -> CacheFormatError:
        return CacheFormatError(
            f"{self.data_path}: record {i} is cut short: the file was truncated after the "
            "cache was opened; rebuild the cache"
        )

    def verify(self, i: int, stored: np.ndarray) -> None:
        """Check FILLED record ``i`` against its CRC-32 on disk now.

        The CRC comes from the shared state mapping, not the copy read at open: in a lazy cache
        other processes fill records (and write their CRCs) after this one opened it.

        Raises:
            CacheFormatError: naming the record, its file and the repair command.
        """
        expected = int(self.states["crc32"][i])
        actual = zlib.crc32(stored.data)
        if actual != expected:
            raise CacheFormatError(
                f"{self.cache}: record {i} ({self.files.path(i)}): its pixels fail their "
                f"checksum (CRC-32 {actual:08x}, stored {expected:08x}): the data file is "
                f"damaged; `mmcache verify {self.cache} --repair` decodes it again from the "
                "source"
            )
        if self.verified is not None:
            self.verified[i] = True

    def bad(self, i: int) -> str:
        """``source path: why`` for a bad record."""
        root = self.manifest.source.get("root", "")
        path = os.path.join(root, self.files.path(i))
        code = int(self.codes[i])
        reason = fmt.BAD_REASONS.get(code, "unknown state")
        kind = SOURCES[self.manifest.source["kind"]]
        # What the file is, when it is still there and OpenCV failed on it (an archive's member
        # has no file to look at; a kind that reads its files itself judges them itself).
        if code == fmt.BAD_UNDECODABLE and kind.reads_files and kind.images is None:
            reason = undecodable_reason(path)
        return f"{path}: {reason}"

    def source_paths(self) -> list[str]:
        """Each record's source path (the source need not exist)."""
        root = self.manifest.source.get("root", "")
        return [os.path.join(root, p) for p in self.files.paths()]
