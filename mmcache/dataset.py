"""The dataset: ``MemmapImageDataset``, a torch Dataset that reads images as slices of a cache.

Each process maps the cache's data file itself, on first use: a DataLoader worker, forked or
spawned, receives only the cache path and generation (pickling the dataset never carries pixels
or the index), and reads pixels out of the OS page cache, which all processes and later runs
share. The mapping is private and copy-on-write, so a sample is a writable view that costs no
copy until a transform writes to it, and the default collate takes it without a warning.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from . import format as fmt
from .errors import CacheFormatError, CacheStaleError, DecodeError, StaleCacheWarning
from .residency import WarmReport, start_warming
from .staleness import stale_reason

ON_STALE = ("warn", "error", "ignore")
VERIFY = (None, "first-read")


class MemmapImageDataset(Dataset):
    """Images and labels from an mmcache cache, with torchvision ``ImageFolder``'s interface.

    ``ds[i]`` is ``(image, label)``: ``image`` an H x W x C uint8 numpy array (C = 3, RGB unless
    the cache was built with ``color="bgr"``; C = 1 for ``"gray"``), exactly the pixels the build
    stored, passed through ``transform``; ``label`` an int, through ``target_transform``.

    Args:
        cache: the cache folder, as made by ``build_cache`` / ``mmcache build``.
        transform: applied to each image array.
        target_transform: applied to each label.
        on_stale: what to do when the source changed since the build, or the cache was made by
            another decoder version: ``"warn"`` (a ``StaleCacheWarning`` with a summary),
            ``"error"`` (raise ``CacheStaleError``) or ``"ignore"`` (skip the check, which scans
            the source folder). A source that is not there (a copied cache) is not checked.
        verify: ``"first-read"`` checks each record's CRC-32 the first time this process reads
            it, and raises ``CacheFormatError`` naming the record if the pixels were damaged on
            disk; ``None`` (default) trusts the cache (``mmcache verify`` checks it whole).
            Costs one CRC-32 per record per process (~3 GB/s), nothing on later reads.
        warm: read the cache into the page cache in a background thread of this process (not
            of DataLoader workers) while training starts: ``True`` within the default budget
            (90% of RAM), or a budget such as ``"80%"`` or ``"8G"`` (see ``warm_cache``).
            ``wait_warm()`` waits for it and returns its ``WarmReport``.

    Example:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=4)  # doctest: +SKIP

    Raises:
        CacheNotFoundError: no finished cache at ``cache``.
        CacheFormatError: a damaged cache, or one of an unknown format version.
        CacheStaleError: with ``on_stale="error"`` and a changed source.
        CacheFormatError: with ``verify="first-read"``, from ``ds[i]`` whose pixels are damaged.
    """

    def __init__(
        self,
        cache: str | os.PathLike,
        transform: Callable[[np.ndarray], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
        on_stale: str = "warn",
        verify: str | None = None,
        warm: bool | str | int = False,
    ) -> None:
        if on_stale not in ON_STALE:
            raise ValueError(f"on_stale must be one of {', '.join(ON_STALE)}, got {on_stale!r}")
        if verify not in VERIFY:
            raise ValueError(f"verify must be None or 'first-read', got {verify!r}")
        self.verify = verify
        self.cache = Path(cache).expanduser().absolute()
        self.transform = transform
        self.target_transform = target_transform
        files = fmt.open_cache(self.cache)
        self.generation = files.manifest.generation
        self._attach(files)
        if on_stale != "ignore":
            reason = stale_reason(files)
            if reason is not None:
                message = f"{self.cache}: the cache is stale: {reason}; run `mmcache build` again"
                if on_stale == "error":
                    raise CacheStaleError(message)
                warnings.warn(message, StaleCacheWarning, stacklevel=2)
        self._warm_thread = start_warming(files.manifest, warm) if warm is not False else None

    def _attach(self, files: fmt.CacheFiles) -> None:
        """Keep what ``__getitem__`` needs as plain arrays; the pixels are mapped on first read."""
        self._files = files
        index = files.index
        self._offsets = index["offset"].astype(np.int64)
        self._shapes = np.stack([index["height"], index["width"], index["channels"]], 1).astype(
            np.int64
        )
        self._labels = index["label"].astype(np.int64)
        self._data: np.ndarray | None = None
        # verify="first-read": which records this process has checked (a bit each, ~160 KB
        # for 1.28M records); never pickled, so each worker checks what it reads itself.
        self._checked = np.zeros(len(index), bool) if self.verify else None

    def _load(self) -> None:
        """Open this dataset's generation in a new process (a spawned worker, an unpickled copy)."""
        manifest = fmt.read_manifest(self.cache)
        if manifest.generation != self.generation:
            raise self._rebuilt(manifest.generation)
        self._attach(fmt.read_cache_files(manifest))

    def _rebuilt(self, generation: str) -> CacheFormatError:
        return CacheFormatError(
            f"{self.cache}: the cache was rebuilt after this dataset was opened "
            f"(generation {generation}, expected {self.generation}); open it again"
        )

    def _map(self) -> np.ndarray:
        if self._files is None:
            self._load()
        if self._data is None:
            path = self._files.manifest.file("data")
            nbytes = self._files.manifest.sizes["data"]
            # mode "c": MAP_PRIVATE, so views are writable (no collate warning) and a transform
            # writing to one gets its own page instead of touching the cache.
            try:
                self._data = (
                    np.memmap(path, dtype=np.uint8, mode="c", shape=(nbytes,))
                    if nbytes
                    else np.zeros(0, np.uint8)
                )
            except FileNotFoundError:
                raise self._rebuilt(fmt.read_manifest(self.cache).generation) from None
            except ValueError:  # mmap refuses a file shorter than the mapping: it shrank
                raise CacheFormatError(
                    f"{path}: shorter than the {nbytes} bytes checked at open: the file was "
                    "truncated since; rebuild the cache"
                ) from None
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        # Only the path, generation and transforms travel to workers: O(1) in the cache size.
        state = self.__dict__.copy()
        for key in ("_files", "_offsets", "_shapes", "_labels", "_data", "_samples", "_checked"):
            state.pop(key, None)
        state["_files"] = None
        state["_data"] = None
        state["_warm_thread"] = None  # a thread does not pickle; workers do not warm
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __len__(self) -> int:
        if self._files is None:
            self._load()
        return len(self._offsets)

    def read(self, i: int) -> np.ndarray:
        """The stored pixels of record ``i`` (no transform), an H x W x C writable view."""
        data = self._map()
        if not -len(self._offsets) <= i < len(self._offsets):
            raise IndexError(f"index {i} out of range for {len(self._offsets)} images")
        state = int(self._files.state["state"][i])
        if state != fmt.FILLED:
            path = self._files.path(i)
            raise DecodeError(f"{path}: not in the cache: {fmt.BAD_REASONS.get(state, 'empty')}")
        h, w, c = self._shapes[i]
        off = self._offsets[i]
        img = data[off : off + h * w * c].reshape(h, w, c)
        if self._checked is not None and not self._checked[i]:
            self._check(i, img)
        return img

    def _check(self, i: int, img: np.ndarray) -> None:
        expected = int(self._files.state["crc32"][i])
        actual = zlib.crc32(img)
        if actual != expected:
            raise CacheFormatError(
                f"{self.cache}: record {i % len(self._offsets)} ({self._files.path(i)}): its "
                f"pixels fail their checksum (CRC-32 {actual:08x}, stored {expected:08x}): the "
                "data file is damaged; run `mmcache verify` and rebuild the cache"
            )
        self._checked[i] = True

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        img = self.read(i)
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
        if self._files is None:
            self._load()
        return list(self._files.manifest.classes)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def samples(self) -> list[tuple[str, int]]:
        """``(source path, label)`` per image, as in ImageFolder (the source need not exist)."""
        if self._files is None:
            self._load()
        root = self._files.manifest.source.get("root", "")
        return [
            (os.path.join(root, p), int(lab)) for p, lab in zip(self._files.paths(), self._labels)
        ]

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    @property
    def targets(self) -> list[int]:
        if self._files is None:
            self._load()
        return self._labels.tolist()

    @property
    def manifest(self) -> fmt.Manifest:
        if self._files is None:
            self._load()
        return self._files.manifest
