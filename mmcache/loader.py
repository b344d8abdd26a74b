"""The fast batch path: ``BatchLoader`` gathers batches from a cache into reused buffers.

A DataLoader worker copies each batch into a fresh shared-memory segment that the main process
maps, and that segment (its allocation, the page faults writing it, the ``munmap`` that frees
it) costs far more than the copy of the pixels. ``BatchLoader`` skips all of that: threads of
the consuming process copy records straight from the memory-mapped cache into a small ring of
preallocated buffers (numpy and OpenCV release the GIL during large copies and resizes), so a
batch costs one memory copy, or one resize per image with ``crop``, and no allocation.

With ``crop`` (``mmcache.RandomResizedCrop`` or ``CenterCrop``) records of any mix of shapes
batch together: each thread takes a view of the record's box in the mapping (no copy of the
record) and resizes it straight into its slot. Boxes and flips are a function of the seed, the
epoch, the rank and each sample's position in the epoch, so the same seed gives the same batches
whatever the thread count, and ``state_dict`` / ``load_state_dict`` resume an epoch mid-way.

When the cache does not fit in RAM the threads read with ``pread`` instead of copying from the
mapping: under memory pressure every page fault on a mapping also pays for reclaiming mapped
pages, which made a mapped random order many times slower than ``pread``. In RAM the mapping is
faster. docs/loader.md gives both measurements and their commands. A shuffled order is read
through a descriptor advised ``POSIX_FADV_RANDOM``: the kernel otherwise takes a read whose
preceding record is cached for a sequential stream and reads ahead records the order will not
want yet, which costs a slow disk more reads than the order makes. A sampler that reads ahead
itself (``QuasiRandomSampler``) is told, batch by batch, how far the threads have got, and a
thread waits for the buffer it needs to be read rather than ask the disk for its records one
by one.
"""

from __future__ import annotations

import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import cv2
import numpy as np
import torch

from . import pixels as px
from ._feedback import count
from ._staleness import recorded_source
from .dataset import MemmapImageDataset
from .decode import Options
from .errors import MixedShapesError, StateMismatchError
from .format import Manifest
from .residency import memory
from .sampler import check_resume, dataset_identity, order_identity
from .transforms import DRAWS, resize_into

__all__ = ["BatchLoader"]

# An order with fewer steps forward by at most NEARBY records than this share is read as a
# random one (see the module docstring); a sequential order (shuffle=False), or a rank's strided
# share of one (DistributedSampler without shuffling), keeps the kernel's read-ahead.
SEQUENTIAL_SHARE = 0.5
NEARBY = 8
# Uniform numbers for boxes and flips come in blocks of this many positions, each block from
# its own generator keyed by (seed, epoch, rank, block): any batch is drawn without drawing the
# epoch before it, whatever the batch size or thread count.
DRAW_BLOCK = 1024
STATE_VERSION = 1


class BatchLoader:
    """Batches of ``(images, labels)`` from a cache, gathered by threads into reused buffers.

    ``images`` is a uint8 tensor N x H x W x C (the stored pixels, or with ``crop`` the crops
    resized to ``crop.size``), ``labels`` an int64 tensor N. With ``normalize`` the images are
    floats N x C x H x W instead: ``(x / 255 - mean) / std``, of ``dtype``. Background threads
    fill a ring of ``prefetch + 1`` preallocated batch buffers (pinned if ``pin_memory``);
    nothing is allocated per batch on the CPU and nothing crosses a process boundary.

    Buffer contract (CPU batches, ``device`` None or CPU): a yielded batch is a view of a ring
    buffer and stays valid until you ask for the next batch (the next ``next()`` call, i.e. the
    next turn of the ``for`` loop); from then on its buffer may be refilled. To keep a batch
    longer, copy it: ``images.clone()``. Do not ``.to("cuda", non_blocking=True)`` a CPU batch
    yourself (the copy may outlive the buffer's turn): pass ``device``. With a CUDA ``device``,
    each batch is a new device tensor (from torch's caching allocator, so no real allocation)
    that stays valid as long as you hold it; the copy to the device runs on a side stream,
    asynchronously from pinned buffers, then normalisation runs there, and the batch is ordered
    before any work you queue on the current stream.

    Ending an iteration early (``break``, an exception, dropping the iterator) stops and joins
    its threads. An error raised in a thread (a record not in the cache, say) is raised from
    the ``next()`` that would have returned the batch it was filling, after the batches before
    it; the iteration is then over. Starting a new iteration of a loader ends its previous one
    (they share the buffers).

    Args:
        dataset: an opened cache. Its ``transform`` and ``target_transform`` must be None:
            crop with ``crop``, transform the batches (on the GPU, typically).
        batch_size: records per batch.
        shuffle: a new random order each epoch (see ``seed``, ``set_epoch``).
        sampler: any iterable of record indices (``RandomSampler``, ``DistributedSampler``,
            ``QuasiRandomSampler``...); with a sampler, ``shuffle`` must be False, as in
            ``DataLoader``.
        drop_last: drop the last batch if it is smaller than ``batch_size``.
        pin_memory: page-lock the buffers (needs CUDA; without it, ordinary memory is used
            and a warning says so).
        device: ``None``/``"cpu"``, or a CUDA device to copy batches to asynchronously.
        num_threads: filling threads; 2 saturate memory bandwidth on most machines.
        prefetch: batches prepared ahead of the one you hold.
        seed: the epoch's order and every sample's box and flip are functions of ``(seed,
            epoch)`` and its position; None draws a fresh seed for every iteration (recorded in
            ``state_dict``, so a resumed iteration still matches).
        read: how records leave the page cache: ``"mmap"`` copies them out of a memory map
            (fastest when the cache fits in RAM), ``"pread"`` reads them with ``pread`` (much
            faster when it does not); ``"auto"`` picks ``"mmap"`` when the data file fits in
            the RAM available now (a memory cgroup's limit counts), at the start of each
            iteration. A data file cut short under the loader is a ``CacheFormatError`` naming
            it and the first record past its end, from the batch that holds that record: with
            ``"mmap"`` the file's size is checked before each batch is read (a batch that finds
            it cut short is read with ``pread``); only a truncation while a batch is being
            copied, after its check, still ends the process with SIGBUS, which ``"pread"``
            never does.
        crop: ``mmcache.RandomResizedCrop`` or ``mmcache.CenterCrop``: every record, of any
            shape, is cropped and resized to ``crop.size``. Set ``crop.size`` between epochs to
            change the output size (progressive resizing); the buffers follow. An iteration
            whose crops upscale stored images (smaller than the output) warns, once per size.
        flip: mirror each image left to right with probability 1/2 (drawn like the boxes).
        normalize: ``(mean, std)`` per channel, on the 0..1 scale (ImageNet's are
            ``((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))``): the batches become floats
            N x C x H x W, normalised on the ``device``.
        dtype: the float type of normalised batches (default ``torch.float32``).
        channels_last: with ``normalize``, give the batches torch's ``channels_last`` memory
            format (the layout the pixels already have; no copy); without, give the uint8
            images as an N x C x H x W view of that layout.

    Example:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # mean, std
        >>> loader = BatchLoader(ds, 256, shuffle=True, seed=0, crop=RandomResizedCrop(224),
        ...                      flip=True, device="cuda", normalize=IMAGENET)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     loader.set_epoch(epoch)
        ...     for images, labels in loader:
        ...         train_step(images, labels.cuda())

    Raises:
        MixedShapesError: without ``crop``, records that do not all share one shape.
        ValueError: bad arguments (``shuffle`` with ``sampler``, a dataset with a transform,
            an unknown ``read``).
    """

    def __init__(
        self,
        dataset: MemmapImageDataset,
        batch_size: int,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        drop_last: bool = False,
        pin_memory: bool = False,
        device: torch.device | str | None = None,
        num_threads: int = 2,
        prefetch: int = 2,
        seed: int | None = None,
        read: str = "auto",
        *,
        crop: Any = None,
        flip: bool = False,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
    ) -> None:
        if read not in ("auto", "mmap", "pread"):
            raise ValueError(f"read must be 'auto', 'mmap' or 'pread', got {read!r}")
        if batch_size < 1 or num_threads < 1 or prefetch < 1:
            raise ValueError(
                f"batch_size, num_threads and prefetch must be >= 1, got {batch_size}, "
                f"{num_threads}, {prefetch}"
            )
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if dataset.transform is not None or dataset.target_transform is not None:
            raise ValueError(
                "BatchLoader yields the stored pixels and labels: open the dataset without "
                "transform/target_transform; crop with crop=, and transform the batches"
            )
        if crop is not None and not all(hasattr(crop, a) for a in ("boxes", "size", "draws")):
            raise ValueError(f"crop must be mmcache.RandomResizedCrop or CenterCrop, got {crop!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle, self.sampler, self.seed = shuffle, sampler, seed
        self.drop_last, self.read = drop_last, read
        self.num_threads, self.prefetch = num_threads, prefetch
        self.crop, self.flip = crop, flip
        self.epoch = 0
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {self.device}")
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device} asked for, but CUDA is not available")
            pin_memory = True  # an asynchronous host-to-device copy needs page-locked memory
        if pin_memory and not torch.cuda.is_available():
            warnings.warn(
                "BatchLoader: pin_memory=True but CUDA is not available: "
                "the buffers are ordinary (pageable) memory",
                UserWarning,
                stacklevel=2,
            )
            pin_memory = False
        self.pin_memory = pin_memory
        channels = _channels(dataset)
        self.normalize = None if normalize is None else _Normalize(normalize, channels, dtype)
        self.channels_last = channels_last
        self._record_shape = None if crop is not None else _one_shape(dataset)
        self._ring: _Ring | None = None
        self._live: weakref.ref | None = None
        self._iteration_seed: int | None = None  # the seed of the last or live iteration
        self._start = 0  # batches of the epoch the next iteration skips (a resumed epoch)
        self._done = 0  # batches of this epoch handed out

    @property
    def shape(self) -> tuple[int, int, int]:
        """The (H, W, C) of every image of the batches (before ``normalize``)."""
        if self.crop is None:
            return self._record_shape
        return (*self.crop.size, _channels(self.dataset))

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order, boxes and flips next (and forward it to the sampler)."""
        self.epoch = epoch
        self._start = self._done = 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its epoch, as plain JSON-serialisable data.

        A loader (made with the same dataset and arguments) given it by ``load_state_dict``
        goes on from the next batch: the same indices and, with the same ``crop``, the same
        pixels. Save it with the model's checkpoint.
        """
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batches": self._done,
            "batch_size": self.batch_size,
            "seed": self.seed if self.seed is not None else self._iteration_seed,
            "size": list(self.crop.size) if self.crop is not None else None,
            "sampler": self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None,
            "dataset": dataset_identity(self.dataset),
            "order": self._order_identity(),
        }

    def _order_identity(self) -> dict[str, Any]:
        if self.sampler is None:
            return {"sampler": None, "shuffle": self.shuffle}
        return order_identity(self.sampler)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration resume where the loader that gave ``state`` stopped.

        The state must be of this run: the same batch size, seed (unless this loader's is
        None: it takes the state's), dataset (the same records: the cache generation the state
        was saved over, or a copy of it) and order (``shuffle``, or the sampler's class and
        settings). A state saved by an older mmcache, which recorded no dataset and order, is
        accepted with a ``UserWarning`` saying they were not checked.

        Raises:
            ValueError: ``state`` is not a BatchLoader's.
            StateMismatchError: ``state`` is of another batch size, seed, dataset or order,
                named with both values.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a BatchLoader state (version {STATE_VERSION}): {state!r}")
        if state["batch_size"] != self.batch_size:
            raise StateMismatchError(
                f"the state is of batch size {state['batch_size']}, this loader's is "
                f"{self.batch_size}: its batches would not be the same"
            )
        current: dict[str, Any] = {"dataset": dataset_identity(self.dataset)}
        if self.seed is not None and state.get("seed") is not None:
            current = {"seed": self.seed, **current}
        current["order"] = self._order_identity()
        check_resume("BatchLoader", state, current)
        self.set_epoch(int(state["epoch"]))
        if state.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        if self.seed is None:
            self._iteration_seed = state["seed"]
        if state.get("size") is not None and self.crop is not None:
            self.crop.size = tuple(state["size"])
        self._start = self._done = int(state["batches"])

    def plan(self, batch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What batch ``batch`` of the current epoch holds: its record indices, each one's crop
        box ``(top, left, height, width)`` (None without ``crop``) and whether it is flipped
        (None without ``flip``), as the threads compute them. For checking and debugging; it
        runs the sampler, if any, once more.

        The current epoch's seed is the loader's ``seed``, or with None that of its last
        iteration.
        """
        seed = self.seed if self.seed is not None else self._iteration_seed
        if seed is None:
            raise ValueError("plan(): seed=None and no iteration has drawn a seed yet")
        first = batch * self.batch_size
        order, ahead = self._order(seed)
        if ahead is not None:
            ahead.close()  # only the order is wanted here
        idx = order[first : first + self.batch_size]
        shapes = self.dataset.records.shapes[idx]
        boxes, flips = _draw(self.crop, self.flip, (seed, self.epoch, self._rank()), shapes,
                             first, _Scratch())  # fmt: skip
        return idx, boxes, flips

    def _rank(self) -> int:
        """This process's rank, which the draws of boxes and flips depend on, as its sampler's."""
        rank = getattr(self.sampler, "rank", None)
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return int(rank)

    def _order(self, seed: int) -> tuple[np.ndarray, Any]:
        """This iteration's order, and the sampler's read-ahead to drive (or None).

        A sampler with ``take_epoch`` (``QuasiRandomSampler``) gives its order at once and a
        read-ahead that follows the positions the threads report; iterating it here would
        request the whole epoch's reads before the first batch.
        """
        n = len(self.dataset)
        ahead = None
        if hasattr(self.sampler, "take_epoch"):
            order, ahead = self.sampler.take_epoch()
            order = np.asarray(order, np.int64)
        elif self.sampler is not None:
            order = np.fromiter((int(i) for i in self.sampler), np.int64)
        if self.sampler is not None:
            bad = (order < 0) | (order >= n)
            if bad.any():
                if ahead is not None:
                    ahead.close()
                raise IndexError(
                    f"sampler gave index {int(order[bad][0])}, outside 0..{n - 1} for {n} images"
                )
        elif self.shuffle:
            order = np.random.default_rng([seed, self.epoch]).permutation(n)
        else:
            order = np.arange(n, dtype=np.int64)
        if self.drop_last:
            order = order[: self._num_batches(len(order)) * self.batch_size]
        return order, ahead

    def _num_batches(self, count: int) -> int:
        return count // self.batch_size if self.drop_last else -(-count // self.batch_size)

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.dataset)
        return self._num_batches(count)

    def _reads_mapped(self) -> bool:
        """Whether this iteration copies records out of the mapping (else it uses pread)."""
        if self.read != "auto":
            return self.read == "mmap"
        return self.dataset.manifest.sizes["data"] <= memory().available

    def _buffers(self) -> _Ring:
        """The ring, made on first use and again only when the batches' shape changes."""
        shape = self.shape
        if self._ring is None or self._ring.shape != shape:
            self._ring = None  # the old ring's memory goes before the new one is made
            slots = self.prefetch + 1 if self.device.type == "cpu" else self.num_threads
            self._ring = _Ring(
                slots,
                self.batch_size,
                shape,
                self.pin_memory,
                self.normalize if self.device.type == "cpu" else None,
                self.channels_last,
            )
        return self._ring

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        previous = self._live() if self._live is not None else None
        if previous is not None:
            previous.close(f"{type(self).__name__}: a newer iteration of this loader started")
        seed = self.seed
        if seed is None:  # a fresh seed per iteration, unless one is being resumed
            if not self._start or self._iteration_seed is None:
                self._iteration_seed = secrets.randbits(63)
            seed = self._iteration_seed
        if hasattr(self.crop, "warn_if_upscaling"):  # once per size: a cache built too small?
            advice = _upscale_advice(self.dataset.manifest, self.crop.short_side_needed())
            self.crop.warn_if_upscaling(self.dataset.records.shapes, advice, stacklevel=2)
        start, self._start = self._start, 0
        order, ahead = self._order(seed)
        it = _Iteration(self, order, ahead, seed, start)
        self._done = start
        self._live = weakref.ref(it)
        return it


def _upscale_advice(m: Manifest, short_side: int) -> str:
    """What to do about crops that upscale the images of cache ``m``: make it again at
    ``short_side`` if its own size option shrank them, else crop smaller."""
    try:
        options = Options.from_json(m.options)
    except (TypeError, ValueError):
        options = Options()
    if all(getattr(options, name) is None for name in ("size", "max_side", "short_side")):
        return "the cache holds the source images' sizes: crop smaller, or accept the upscaling"
    wanted = replace(options, size=None, max_side=None, short_side=short_side)
    if m.mode == "lazy":
        how = f"make it again with short_side={short_side} and replace=True"
    else:
        command = f"mmcache build {recorded_source(m)} {m.path} {wanted.flags()} --replace"
        how = f"rebuild it with `{command}`"
    return (
        f"the cache was made with {options.flags()}: {how} (images smaller in the source stay "
        "as they are), or crop smaller"
    )


def _channels(dataset: MemmapImageDataset) -> int:
    shapes = dataset.records.shapes
    return int(shapes[0, 2]) if len(shapes) else 3


def _one_shape(dataset: MemmapImageDataset) -> tuple[int, int, int]:
    """The (H, W, C) every record shares, or MixedShapesError naming the shapes found."""
    shapes = dataset.records.shapes
    if len(shapes) == 0:
        return (0, 0, 0)
    distinct, counts = np.unique(shapes, axis=0, return_counts=True)
    if len(distinct) > 1:
        top = np.argsort(-counts, kind="stable")[:5]
        found = ", ".join(
            f"{h}x{w}x{c} ({count(int(n), 'image')})"
            for (h, w, c), n in zip(distinct[top], counts[top])
        )
        more = f" and {len(distinct) - 5} more" if len(distinct) > 5 else ""
        raise MixedShapesError(
            f"{dataset.cache}: without crop=, BatchLoader needs records of one shape (H x W x "
            f"C), found {len(distinct)}: {found}{more}; pass crop=mmcache.RandomResizedCrop("
            "224) (or CenterResizedCrop), or build the cache with size=(H, W)"
        )
    return tuple(int(v) for v in distinct[0])


class _Normalize:
    """``(x / 255 - mean) / std`` as one subtraction and one division of 0..255 values."""

    def __init__(self, normalize, channels: int, dtype: torch.dtype | None) -> None:
        mean, std = (np.asarray(v, np.float64).reshape(-1) for v in normalize)
        if len(mean) != channels or len(std) != channels or (std <= 0).any():
            raise ValueError(
                f"normalize must be (mean, std) of {channels} values each, std > 0, got "
                f"{normalize!r}"
            )
        self.dtype = dtype or torch.float32
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a float type, got {self.dtype}")
        self.mean = torch.tensor(mean * 255, dtype=self.dtype).view(1, -1, 1, 1)
        self.std = torch.tensor(std * 255, dtype=self.dtype).view(1, -1, 1, 1)

    def into(self, out: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Normalise uint8 N x H x W x C ``images`` into the float N x C x H x W ``out``."""
        out.copy_(images.permute(0, 3, 1, 2))
        return out.sub_(self.mean.to(out.device)).div_(self.std.to(out.device))


class _Ring:
    """The batch buffers: uint8 images and labels, and (CPU normalisation) float images.

    Each slot is a tensor of its own, not a view of one ring: autograd checks that a tensor it
    saved for the backward pass was not written since, by a version count that all views of a
    tensor share, so refilling one slot must not touch the version of the batch being trained
    on.
    """

    def __init__(
        self,
        slots: int,
        batch_size: int,
        shape: tuple[int, int, int],
        pin_memory: bool,
        normalize: _Normalize | None,
        channels_last: bool,
    ) -> None:
        self.shape = shape
        if pin_memory:
            self.images = [
                torch.empty((batch_size, *shape), dtype=torch.uint8, pin_memory=True)
                for _ in range(slots)
            ]
            self.labels = [
                torch.empty(batch_size, dtype=torch.int64).pin_memory() for _ in range(slots)
            ]
        else:
            # numpy's allocator asks for transparent huge pages on large arrays: the first
            # touch of a 50 MB slot faults 25 huge pages instead of 12,000 small ones.
            self.images = [
                torch.from_numpy(np.empty((batch_size, *shape), np.uint8)) for _ in range(slots)
            ]
            self.labels = [torch.from_numpy(np.empty(batch_size, np.int64)) for _ in range(slots)]
        self.floats = None
        if normalize is not None:
            h, w, c = shape
            if channels_last:  # N x C x H x W views of N x H x W x C memory
                self.floats = [
                    torch.empty((batch_size, h, w, c), dtype=normalize.dtype).permute(0, 3, 1, 2)
                    for _ in range(slots)
                ]
            else:
                self.floats = [
                    torch.empty((batch_size, c, h, w), dtype=normalize.dtype) for _ in range(slots)
                ]
        self.normalize, self.channels_last = normalize, channels_last

    def output(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s first ``n`` images and labels as the loader hands them out (CPU)."""
        images = self.images[slot][:n]
        if self.floats is not None:
            images = self.normalize.into(self.floats[slot][:n], images)
        elif self.channels_last:
            images = images.permute(0, 3, 1, 2)
        return images, self.labels[slot][:n]


class _Shared:
    """What the filling threads and the consumer share (the threads never see the iterator, so
    dropping the iterator can finalize it and stop them)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.next_batch = 0  # the next batch number a thread will take
        self.released = 0  # batches before this one are given back by the consumer
        # batch number -> (images, labels, CUDA event of its copy to the device or None)
        self.ready: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}
        # (batch number, exception) of the first failure: batches before it are still handed out
        self.error: tuple[int, BaseException] | None = None
        self.stop = False


class _Iteration:
    """One pass over a BatchLoader's order: starts the threads, hands out batches in order."""

    def __init__(
        self, loader: BatchLoader, order: np.ndarray, ahead: Any, seed: int, start: int
    ) -> None:
        ds = loader.dataset
        ring = loader._buffers()
        # A data file cut short already: this iteration reads with pread (see _fill).
        mapped = len(order) > 0 and loader._reads_mapped() and not ds.cut_short()
        self._loader = loader
        self._shared = shared = _Shared()
        self._count = -(-len(order) // loader.batch_size)
        self._taken = min(start, self._count)
        shared.next_batch = shared.released = self._taken
        self._closed: str | None = None
        job = _Job(
            order=order,
            batch_size=loader.batch_size,
            count=self._count,
            # CPU: prefetch batches ahead of the one held, so prefetch + 1 slots; CUDA: each
            # thread reuses its own pinned slot, the ready device batches are bounded instead.
            ahead=loader.prefetch,
            ring=ring,
            device=loader.device,
            normalize=loader.normalize,
            channels_last=loader.channels_last,
            dataset=ds,
            records=ds.records,
            data=_as_tensor(ds.mapping()) if len(order) else None,
            mapped=mapped,
            read_ahead=ahead,
            fd=-1 if mapped or ahead is not None or not len(order) else _random_reader(ds, order),
            crop=loader.crop,
            size=loader.crop.size if loader.crop is not None else None,
            flip=loader.flip,
            draws=(seed, loader.epoch, loader._rank()),
            pixels=ds.manifest.pixels,
            color=ds.manifest.options.get("color", "rgb"),
        )
        self._threads = [
            threading.Thread(
                target=_work, args=(job, shared, k), name=f"mmcache-BatchLoader-{k}", daemon=True
            )
            for k in range(min(loader.num_threads, max(self._count - self._taken, 1)))
        ]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop, shared, self._threads, job)

    def __iter__(self) -> _Iteration:
        return self

    def __len__(self) -> int:
        return self._count - self._taken

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed is not None:
            raise RuntimeError(self._closed)
        shared = self._shared
        if self._taken >= self._count:
            self.close()
            raise StopIteration
        t = self._taken
        with shared.cond:
            shared.released = t  # the batch handed out before this one may now be refilled
            shared.cond.notify_all()
            while t not in shared.ready and (shared.error is None or shared.error[0] > t):
                shared.cond.wait()
            if t not in shared.ready:
                error = shared.error[1]
                shared.error = None
            else:
                error = None
                images, labels, copied = shared.ready.pop(t)
        if error is not None:
            self.close("BatchLoader: this iteration stopped on an error")
            raise error
        self._taken += 1
        self._loader._done = self._taken
        if copied is not None:
            # The current stream is per thread: order the caller's stream after the copy, and
            # tell the caching allocator that stream uses the tensors, so their memory is not
            # handed to a later side-stream allocation while the caller's work still reads it.
            current = torch.cuda.current_stream(images.device)
            current.wait_event(copied)
            images.record_stream(current)
            labels.record_stream(current)
        return images, labels

    def close(self, reason: str | None = None) -> None:
        """Stop and join the threads; a later ``next()`` raises ``reason`` if one is given."""
        self._finalizer()
        if reason is not None:
            self._closed = reason


class _Job:
    """The read-only inputs of the filling threads."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _stop(shared: _Shared, threads: list[threading.Thread], job: _Job) -> None:
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join()
    if job.read_ahead is not None:
        job.read_ahead.close()
    if job.fd >= 0:
        os.close(job.fd)
        job.fd = -1


def _random_reader(ds: MemmapImageDataset, order: np.ndarray) -> int:
    """A descriptor of the data file advised ``POSIX_FADV_RANDOM`` for a shuffled order's
    ``pread``s (see the module docstring), or -1: a sequential order, or no such advice here
    (the dataset's own reads are used then)."""
    steps = np.diff(order)
    forward = np.count_nonzero((steps > 0) & (steps <= NEARBY))  # in order, or a small stride
    if len(steps) == 0 or forward >= SEQUENTIAL_SHARE * len(steps):
        return -1
    if not hasattr(os, "posix_fadvise"):
        return -1
    try:
        fd = os.open(ds.data_path, os.O_RDONLY)
    except OSError:
        return -1  # a data file replaced since the dataset opened: read through the dataset
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        os.close(fd)
        return -1
    return fd


def _work(job: _Job, shared: _Shared, k: int) -> None:
    """A filling thread: take batch numbers in turn, fill each into its slot, publish it."""
    cuda = job.device.type == "cuda"
    u = -1
    try:
        stream = torch.cuda.Stream(job.device) if cuda else None
        scratch = _Scratch()
        slots = len(job.ring.images)
        while True:
            with shared.cond:
                u = shared.next_batch
                if u >= job.count or shared.stop or shared.error is not None:
                    return
                shared.next_batch += 1
                # CPU: slot u % slots last held batch u - slots, given back once the consumer
                # asks for batch u - slots + 1. CUDA: bound the device batches waiting.
                while u > shared.released + job.ahead and not shared.stop:
                    shared.cond.wait()
                if shared.stop:
                    return
            slot = k if cuda else u % slots
            if job.read_ahead is not None:  # the sampler's read-ahead follows the threads
                first = u * job.batch_size
                last = min(first + job.batch_size, len(job.order)) - 1
                for position in (first, last):
                    job.read_ahead.reached(position)
                    job.read_ahead.wait(position)
            n = _fill(job, slot, u, shared, scratch)
            if n is None:
                return
            if cuda:
                ring = job.ring
                images, labels, copied = _to_device(job, ring.images[slot][:n],
                                                    ring.labels[slot][:n], stream)  # fmt: skip
            else:
                (images, labels), copied = job.ring.output(slot, n), None
            with shared.cond:
                shared.ready[u] = (images, labels, copied)
                shared.cond.notify_all()
    except BaseException as e:  # handed to the consumer, which raises it from next()
        with shared.cond:
            if shared.error is None or u < shared.error[0]:
                shared.error = (u, e)
            shared.cond.notify_all()


class _Scratch:
    """A filling thread's reusable buffers: rows read with pread, the uniform numbers of
    boxes and flips."""

    def __init__(self) -> None:
        self.rows = np.empty(0, np.uint8)
        self.numbers = np.empty(0, np.uint8)
        self.ycc = np.empty(0, np.uint8)  # I420 crops: the planes resized, then converted
        self.plane = np.empty(0, np.uint8)

    def take(self, name: str, nbytes: int) -> np.ndarray:
        buf = getattr(self, name)
        if buf.size < nbytes:  # grows to the largest record once, then is reused
            buf = np.empty(nbytes, np.uint8)
            setattr(self, name, buf)
        return buf[:nbytes]


def _uniforms(draws: tuple[int, int, int], first: int, n: int, scratch: _Scratch) -> np.ndarray:
    """The ``DRAWS`` uniform numbers of positions ``first .. first + n - 1`` of the epoch,
    drawn into the thread's scratch buffer."""
    blocks = range(first // DRAW_BLOCK, (first + n - 1) // DRAW_BLOCK + 1)
    numbers = scratch.take("numbers", len(blocks) * DRAW_BLOCK * DRAWS * 8).view(np.float64)
    numbers = numbers.reshape(len(blocks) * DRAW_BLOCK, DRAWS)
    for k, b in enumerate(blocks):
        rng = np.random.default_rng([*draws, b])
        rng.random(out=numbers[k * DRAW_BLOCK : (k + 1) * DRAW_BLOCK])
    start = first - blocks[0] * DRAW_BLOCK
    return numbers[start : start + n]


def _fill(job: _Job, slot: int, u: int, shared: _Shared, scratch: _Scratch) -> int | None:
    """Fill ring slot ``slot`` with batch ``u``; its count, or None if told to stop."""
    first = u * job.batch_size
    idx = job.order[first : first + job.batch_size]
    n = len(idx)
    ds, records, data = job.dataset, job.records, job.data
    # A data file cut short since it was mapped would kill the process with SIGBUS at the
    # first page past its end: checked before each batch (one fstat), and a batch that finds it
    # cut short is read with pread, which raises the dataset's CacheFormatError for the records
    # past the end. Left: a truncation during the batch's copies (see BatchLoader's ``read``).
    mapped = job.mapped and not ds.cut_short()
    ring_images = job.ring.images[slot]
    images = ring_images.numpy()
    np.take(records.labels, idx, out=job.ring.labels[slot][:n].numpy())
    filled = ds.filled(idx)
    offsets = records.offsets[idx].tolist()
    shapes = records.shapes[idx]
    boxes, flips = _draw(job.crop, job.flip, job.draws, shapes, first, scratch)
    if boxes is not None:
        boxes = boxes.tolist()
    else:
        flat = images.reshape(images.shape[0], -1)
        nbytes = flat.shape[1]
        data = None if data is None else data.numpy()
    # One slice copy (or one resize) per record, each releasing the GIL (np.take over a
    # strided 2-D view of the mapping was slower for records of a megabyte).
    for j, off in enumerate(offsets):
        if shared.stop:
            return None
        r = int(idx[j])
        if job.pixels != "rgb":
            box = None if boxes is None else boxes[j]
            _fill_planar(job, mapped, r, off, shapes[j], box, images[j], filled[j], scratch)
        elif boxes is None:
            if not filled[j]:  # the dataset's own read raises its error (or, lazily, fills it)
                flat[j] = ds.read(r).reshape(-1)
            elif mapped:
                flat[j] = data[off : off + nbytes]
            else:
                _pread(job, r, off, flat[j])
        else:
            top, left, bh, bw = boxes[j]
            src = _box_rows(job, mapped, r, off, shapes[j], top, bh, filled[j], scratch)
            resize_into(src[:, left : left + bw], ring_images[j], *job.crop.kernel)
        if flips is not None and flips[j]:
            cv2.flip(images[j], 1, dst=images[j])
    return n


def _fill_planar(
    job: _Job,
    mapped: bool,
    r: int,
    off: int,
    shape: np.ndarray,
    box: list[int] | None,
    out: np.ndarray,
    filled: bool,
    scratch: _Scratch,
) -> None:
    """Convert I420 record ``r`` into ``out``, whole, or its ``box`` resized plane by plane
    to the output size first (so only the output's pixels are converted). Unless ``mapped``
    (see ``_fill``), a box's rows of each plane are read with ``pread``, not the record."""
    rows_from = (0, 0)
    if not filled:  # the dataset's own read raises its error (or, lazily, fills it)
        y, cb, cr = job.dataset.planes(r)
    elif box is not None and not mapped:
        h, w = int(shape[0]), int(shape[1])
        ch, cw = px.chroma_shape(h, w)
        ct, _, cbh, _ = px.chroma_box(box)
        top, bh = box[0], box[2]
        buf = scratch.take("rows", bh * w + 2 * cbh * cw)
        y = buf[: bh * w]
        cb = buf[bh * w : bh * w + cbh * cw]
        cr = buf[bh * w + cbh * cw :]
        for part, plane_start, row, width in zip(
            (y, cb, cr), px.plane_offsets(h, w), (top, ct, ct), (w, cw, cw)
        ):
            _pread(job, r, off, part, plane_start + row * width)
        y, cb, cr = y.reshape(bh, w), cb.reshape(cbh, cw), cr.reshape(cbh, cw)
        rows_from = (top, ct)
    else:
        n = int(px.record_nbytes(*(int(v) for v in shape), job.pixels))
        if mapped:
            flat = job.data[off : off + n].numpy()
        else:
            flat = scratch.take("rows", n)
            _pread(job, r, off, flat)
        y, cb, cr = px.planes(px.stored_view(flat, shape, job.pixels))
    if box is None:
        px.convert(y, cb, cr, job.color, out)
        return
    kernel = job.crop.kernel

    def resize(src: np.ndarray, dst: np.ndarray) -> None:
        resize_into(torch.from_numpy(src), torch.from_numpy(dst), *kernel)

    px.crop_into(y, cb, cr, box, out, resize, scratch.take, job.color, rows_from)


def _draw(
    crop: Any,
    flip: bool,
    draws: tuple[int, int, int],
    shapes: np.ndarray,
    first: int,
    scratch: _Scratch,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The crop boxes and flips of the records of ``shapes`` at positions ``first ...`` of an
    epoch (None for what is not asked)."""
    if crop is None and not flip:
        return None, None
    numbers = _uniforms(draws, first, len(shapes), scratch)
    flips = (numbers[:, -1] < 0.5) if flip else None
    boxes = crop.boxes(shapes, numbers[:, : crop.draws]) if crop is not None else None
    return boxes, flips


def _box_rows(
    job: _Job,
    mapped: bool,
    r: int,
    off: int,
    shape: np.ndarray,
    top: int,
    rows: int,
    filled: bool,
    scratch: _Scratch,
) -> torch.Tensor:
    """Rows ``top .. top + rows - 1`` of record ``r`` as an H x W x C tensor: a view of the
    mapping (``mapped``), or just those rows read with ``pread`` into the thread's scratch
    buffer."""
    h, w, c = (int(v) for v in shape)
    if not filled:
        return torch.from_numpy(job.dataset.read(r))[top : top + rows]
    if mapped:
        return job.data[off : off + h * w * c].view(h, w, c)[top : top + rows]
    buf = scratch.take("rows", rows * w * c)
    _pread(job, r, off, buf, top * w * c)
    return torch.from_numpy(buf).view(rows, w, c)


def _pread(job: _Job, r: int, off: int, out: np.ndarray, start: int = 0) -> None:
    """Read ``out.nbytes`` of record ``r`` (at ``off``) from byte ``start`` of it on: through the
    iteration's own descriptor when it has one, else (or on a short read, so that the error
    is the dataset's) through the dataset."""
    if job.fd < 0 or os.preadv(job.fd, [out], off + start) != out.nbytes:
        job.dataset.read_into(r, out, start)


def _as_tensor(mapping: np.ndarray) -> torch.Tensor:
    """The read-only mapping of the data file as a flat uint8 tensor (no copy). torch warns
    that it cannot mark the tensor read-only; nothing writes through it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(mapping)


def _to_device(
    job: _Job, images: torch.Tensor, labels: torch.Tensor, stream: Any
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Copy a pinned batch to the device on ``stream`` (normalising it there), and wait for
    the copy: the slot refills next."""
    with torch.cuda.stream(stream):
        d_images = images.to(job.device, non_blocking=True)
        d_labels = labels.to(job.device, non_blocking=True)
        if job.normalize is not None:
            floats = d_images.permute(0, 3, 1, 2).to(job.normalize.dtype)  # channels_last
            floats.sub_(job.normalize.mean.to(job.device)).div_(job.normalize.std.to(job.device))
            d_images = floats if job.channels_last else floats.contiguous()
        elif job.channels_last:
            d_images = d_images.permute(0, 3, 1, 2)
        copied = torch.cuda.Event()
        copied.record(stream)
    # The copy of a batch takes a few milliseconds at PCIe speed, less than filling the next
    # batch; waiting here lets this thread's one pinned slot be refilled without a second ring.
    copied.synchronize()
    return d_images, d_labels, copied
