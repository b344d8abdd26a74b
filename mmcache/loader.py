"""The fast batch path: ``BatchLoader`` gathers batches from a cache into reused buffers.

A DataLoader worker copies each batch into a fresh shared-memory segment that the main process
maps, and that segment (its allocation, the page faults writing it, the ``munmap`` that frees
it) costs far more than the copy of the pixels. ``BatchLoader`` skips all of that: threads of
the consuming process (``mmcache._iteration``) copy records straight from the memory-mapped cache
into a small ring of preallocated buffers (numpy and OpenCV release the GIL during large copies
and resizes), so a batch costs one memory copy, or one resize per image with ``crop``, and no
allocation.

With ``crop`` (``mmcache.RandomResizedCrop`` or ``CenterResizedCrop``) records of any mix of shapes
batch together: each thread takes a view of the record's box in the mapping (no copy of the
record) and resizes it straight into its slot. Boxes and flips are a function of the seed, the
epoch, the rank and each sample's position in the epoch, so the same seed gives the same batches
whatever the thread count, and ``state_dict`` / ``load_state_dict`` resume an epoch mid-way.
With ``views`` (several crops of each record, the multi-crop of self-supervised training) each
view has its own ring, its boxes and flips are drawn under a key of their own (the view's
number added), and each record is read once per batch for all its views.

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
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Subset

from ._batches import Job, Normalize, Ring, Scratch, View, draw, param_buffers
from ._feedback import count
from ._iteration import Iteration, as_tensor, random_reader
from .dataset import MemmapImageDataset
from .errors import MixedShapesError, StateMismatchError
from .residency import memory
from .sampler import ReadAhead, check_resume, dataset_identity, order_identity
from .transforms import Crop, check_draws, expand_views

__all__ = ["BatchLoader"]

STATE_VERSION = 1


class BatchLoader:
    """Batches of ``(images, labels)`` from a cache, gathered by threads into reused buffers.

    ``images`` is a uint8 tensor N x H x W x C (the stored pixels, or with ``crop`` the crops
    resized to ``crop.size``), ``labels`` an int64 tensor N. With ``normalize`` the images are
    floats N x C x H x W instead: ``(x / 255 - mean) / std``, of ``dtype``. Background threads
    fill a ring of ``prefetch + 2`` preallocated batch buffers (pinned if ``pin_memory``):
    a loop that drops each batch allocates nothing per batch, and nothing crosses a process
    boundary.

    Ownership: a batch stays as it was for as long as you hold it (images, labels, targets,
    views), as with ``DataLoader``; keep batches in a list without copying them. CPU batches
    are views of a ring of ``prefetch + 2`` buffers: a buffer that a batch you hold still uses
    (or a view or numpy array of it) is replaced by a new one before its slot is refilled, so
    a loop that drops each batch reuses the ring and allocates nothing. Pinned buffers are
    never refilled in place: each refill takes a new one from torch's caching host allocator,
    which reuses a block only after the asynchronous copies from it have finished, so
    ``images.to("cuda", non_blocking=True)`` of a pinned batch is safe. With a CUDA ``device``,
    each batch is a new device tensor (from torch's caching allocator, so no real allocation);
    the copy to the device runs on a side stream, asynchronously from pinned buffers, then
    normalisation runs there, and the batch is ordered before any work you queue on the
    current stream.

    Epochs: each new iteration starts the epoch after the last one's, unless ``set_epoch``
    was called since (it pins the next iteration's epoch), as ``DataLoader(shuffle=True)``
    reshuffles on every ``iter()``.

    Ending an iteration early (``break``, an exception, dropping the iterator) stops and joins
    its threads. An error raised in a thread (a record not in the cache, say) is raised from
    the ``next()`` that would have returned the batch it was filling, after the batches before
    it; the iteration is then over. Starting a new iteration of a loader ends its previous one
    (they share the buffers).

    Args:
        dataset: an opened cache. Its ``transform`` and ``target_transform`` must be None:
            crop with ``crop``, transform the batches (on the GPU, typically).
        batch_size: records per batch. The arguments after it are keyword-only.
        shuffle: a new random order each epoch, that is each iteration unless ``set_epoch``
            pins one (see ``seed``).
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
        crop: ``mmcache.RandomResizedCrop`` or ``mmcache.CenterResizedCrop`` (or a crop of
            one's own: any ``mmcache.Crop``): every record, of any shape, is cropped and
            resized to ``crop.size``. Set ``crop.size`` between epochs to change the output
            size (progressive resizing); the buffers follow. An iteration whose crops (mmcache's)
            upscale stored images (smaller than the output) warns, once per size
            (``MemmapImageDataset.warn_if_upscaling``).
        flip: mirror each image left to right with probability 1/2 (drawn like the boxes).
        normalize: ``(mean, std)`` per channel, on the 0..1 scale (ImageNet's are
            ``((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))``): the batches become floats
            N x C x H x W, normalised on the ``device``.
        dtype: the float type of normalised batches (default ``torch.float32``).
        channels_last: with ``normalize``, give the batches torch's ``channels_last`` memory
            format (the layout the pixels already have; no copy); without, give the uint8
            images as an N x C x H x W view of that layout.
        views: ``[(crop, count), ...]`` instead of ``crop``: several views of every record
            (SimCLR's two, DINO's two global and several local crops). Each step yields
            ``(views, labels)``, ``views`` a list of one batch per view in the order given,
            counts expanded; each view of a sample has its own box and flip, drawn from the
            seed, the epoch, its position and the view's number. ``normalize``, ``dtype``,
            ``channels_last`` and ``device`` apply to every view; set a crop's ``size``
            between epochs to change the size of its views.
        return_params: with ``views``, yield ``(views, params, labels)``: ``params`` a list
            of one int64 tensor N x 5 per view, each row the sample's box (top, left,
            height, width, in the stored image's pixels) and 1 if it was mirrored, else 0
            (``mmcache.MultiCrop.apply`` makes the same view from the record).

    Examples:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # mean, std
        >>> loader = BatchLoader(ds, 256, shuffle=True, seed=0, crop=RandomResizedCrop(224),
        ...                      flip=True, device="cuda", normalize=IMAGENET)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     loader.set_epoch(epoch)
        ...     for images, labels in loader:
        ...         train_step(images, labels.cuda())
        >>> dino = BatchLoader(ds, 256, shuffle=True, seed=0, flip=True, device="cuda",
        ...                    views=[(RandomResizedCrop(224, scale=(0.32, 1.0)), 2),
        ...                           (RandomResizedCrop(96, scale=(0.05, 0.32)), 6)],
        ...                    normalize=IMAGENET)  # doctest: +SKIP
        >>> for views, labels in dino:  # doctest: +SKIP
        ...     dino_step(views[:2], views)  # 2 global batches N x 3 x 224 x 224, 6 local ones

    Raises:
        MixedShapesError: without ``crop``, records that do not all share one shape.
        ValueError: bad arguments (``shuffle`` with ``sampler``, a dataset with a transform,
            an unknown ``read``).
    """

    def __init__(
        self,
        dataset: MemmapImageDataset,
        batch_size: int,
        *,
        shuffle: bool = False,
        sampler: Iterable[int] | None = None,
        drop_last: bool = False,
        pin_memory: bool = False,
        device: torch.device | str | None = None,
        num_threads: int = 2,
        prefetch: int = 2,
        seed: int | None = None,
        read: str = "auto",
        crop: Crop | None = None,
        flip: bool = False,
        normalize: tuple[Sequence[float], Sequence[float]] | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
        views: Sequence[tuple[Crop, int]] | None = None,
        return_params: bool = False,
    ) -> None:
        _check_arguments(
            dataset,
            batch_size,
            num_threads,
            prefetch,
            read,
            shuffle,
            sampler,
            crop,
            views,
            return_params,
        )
        self._view_crops = None if views is None else expand_views(views)  # checks them
        self.views = None if views is None else [(crop, int(n)) for crop, n in views]
        self.return_params = return_params
        self._view_rings: list[Ring] | None = None
        self._params: list[list[torch.Tensor]] | None = None
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle, self.sampler, self.seed = shuffle, sampler, seed
        self.drop_last, self.read = drop_last, read
        self.num_threads, self.prefetch = num_threads, prefetch
        self.crop, self.flip = crop, flip
        self.epoch = 0
        self.device, pin_memory = _device_and_pinning(device, pin_memory)
        self.pin_memory = pin_memory
        channels = _channels(dataset)
        self.normalize = None if normalize is None else Normalize(normalize, channels, dtype)
        self.channels_last = channels_last
        self._record_shape = None if crop is not None or views else _one_shape(dataset)
        self._ring: Ring | None = None
        self._live: weakref.ref | None = None
        self._iteration_seed: int | None = None  # the seed of the last or live iteration
        self._start = 0  # batches of the epoch the next iteration skips (a resumed epoch)
        self._done = 0  # batches of this epoch handed out
        # The next iteration is epoch self.epoch (set_epoch, load_state_dict, or none yet);
        # otherwise it starts the one after. And the epoch last given to the sampler.
        self._epoch_set = True
        self._sampler_epoch: int | None = None
        self._over = False  # the last iteration ended (StopIteration)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The (H, W, C) of every image of the batches (before ``normalize``); with ``views``,
        of the first view's (``shapes`` gives each view's)."""
        if self.crop is not None:
            return (*self.crop.size, _channels(self.dataset))
        if self._view_crops is not None:
            return self.shapes[0]
        assert self._record_shape is not None  # measured at construction when there is no crop
        return self._record_shape

    @property
    def shapes(self) -> list[tuple[int, int, int]]:
        """The (H, W, C) of each view's images (``[shape]`` without ``views``)."""
        if self._view_crops is None:
            return [self.shape]
        return [(*crop.size, _channels(self.dataset)) for crop in self._view_crops]

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order, boxes and flips next (and forward it to the sampler).

        Without it, each new iteration starts the epoch after the last one's, as
        ``DataLoader(shuffle=True)`` reshuffles on every ``iter()``; with it, the next
        iteration is epoch ``epoch`` however often it is called.
        """
        self.epoch = epoch
        self._start = self._done = 0
        self._epoch_set = True
        if self.sampler is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _next_epoch(self) -> None:
        """Start the epoch after the last iteration's (no ``set_epoch`` since it began), and
        the sampler's next epoch too, unless the caller gave it one since (its ``set_epoch``
        called directly, as with a ``DataLoader``)."""
        self.epoch += 1
        self._start = self._done = 0
        sampler = self.sampler
        if sampler is None or not hasattr(sampler, "set_epoch"):
            return
        current = getattr(sampler, "epoch", None)
        if current is None:
            sampler.set_epoch(self.epoch)
        elif current == self._sampler_epoch:
            sampler.set_epoch(current + 1)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is in its epoch, as plain JSON-serialisable data.

        A loader (made with the same dataset and arguments) given it by ``load_state_dict``
        goes on from the next batch: the same indices and, with the same ``crop``, the same
        pixels. Save it with the model's checkpoint.
        """
        epoch, batches, sampler = self.epoch, self._done, self.sampler
        if self._over and not self._epoch_set:
            # The iteration ended and the next one starts the next epoch: say so, so that a
            # resumed loader's first iteration is that epoch, not the empty rest of this one.
            epoch, batches, sampler = epoch + 1, 0, None
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches": batches,
            "batch_size": self.batch_size,
            "seed": self.seed if self.seed is not None else self._iteration_seed,
            "size": list(self.crop.size) if self.crop is not None else None,
            **({"view_sizes": [list(c.size) for c, _ in self.views]} if self.views else {}),
            "sampler": (
                sampler.state_dict()
                if sampler is not None and hasattr(sampler, "state_dict")
                else None
            ),
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
        settings). A cache refreshed since (made from the same source with the same options:
        ``mmcache build`` before each run) is accepted with a ``UserWarning``: the epoch goes on
        from the state's batch in the refreshed cache's order, so it may repeat or skip a few
        images. A state that records no dataset or order is refused.

        Raises:
            ValueError: ``state`` is not a BatchLoader's.
            StateMismatchError: ``state`` is of another batch size, seed, dataset or order,
                named with both values, or records no dataset or order.
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
        if (
            state.get("sampler") is not None
            and self.sampler is not None
            and hasattr(self.sampler, "load_state_dict")
        ):
            self.sampler.load_state_dict(state["sampler"])
        if self.seed is None:
            self._iteration_seed = state["seed"]
        if state.get("size") is not None and self.crop is not None:
            self.crop.size = _pair(state["size"])
        if state.get("view_sizes") is not None and self.views is not None:
            for (crop, _), size in zip(self.views, state["view_sizes"]):
                crop.size = _pair(size)
        self._start = self._done = int(state["batches"])

    def draw_batch(self, batch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """What batch ``batch`` of the current epoch holds: its record indices, each one's crop
        box ``(top, left, height, width)`` (None without ``crop``) and whether it is flipped
        (None without ``flip``), as the threads draw them. For checking and debugging; it runs
        the sampler, if any, once more.

        The current epoch's seed is the loader's ``seed``, or with None that of its last
        iteration.

        Raises:
            ValueError: ``seed=None`` and no iteration has drawn a seed yet, or a loader with
                ``views`` (``return_params=True`` gives each view's boxes and flips).
        """
        if self.views is not None:
            raise ValueError("draw_batch(): a loader with views= draws a box and flip per view: "
                             "pass return_params=True to have them with each batch")  # fmt: skip
        seed = self.seed if self.seed is not None else self._iteration_seed
        if seed is None:
            raise ValueError("draw_batch(): seed=None and no iteration has drawn a seed yet")
        first = batch * self.batch_size
        order, ahead = self._order(seed)
        if ahead is not None:
            ahead.close()  # only the order is wanted here
        idx = order[first : first + self.batch_size]
        shapes = self.dataset.reader.records.shapes[idx]
        boxes, flips = draw(self.crop, self.flip, (seed, self.epoch, self._rank()), shapes,
                            first, Scratch())  # fmt: skip
        return idx, boxes, flips

    def _rank(self) -> int:
        """This process's rank, which the draws of boxes and flips depend on, as its sampler's."""
        rank = getattr(self.sampler, "rank", None)
        if rank is None:
            dist = torch.distributed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return int(rank)

    def _order(self, seed: int) -> tuple[np.ndarray, ReadAhead | None]:
        """This iteration's order, and the sampler's read-ahead to drive (or None).

        A sampler with ``take_epoch`` (``QuasiRandomSampler``) gives its order at once and a
        read-ahead that follows the positions the threads report; iterating it here would
        request the whole epoch's reads before the first batch.
        """
        n = len(self.dataset)
        ahead = None
        if self.sampler is not None and hasattr(self.sampler, "take_epoch"):
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
        # A sampler without __len__ raises TypeError here, as len(DataLoader) does: the
        # parameter's type (any iterable) cannot say "sized for len()" alone.
        count = len(cast(Sized, self.sampler)) if self.sampler is not None else len(self.dataset)
        return self._num_batches(count)

    def _reads_mapped(self) -> bool:
        """Whether this iteration copies records out of the mapping (else it uses pread)."""
        if self.read != "auto":
            return self.read == "mmap"
        return self.dataset.manifest.sizes["data"] <= memory().available

    def _buffers(self) -> Ring:
        """The ring, made on first use and again only when the batches' shape changes."""
        shape = self.shape
        if self._ring is None or self._ring.shape != shape:
            self._ring = None  # the old ring's memory goes before the new one is made
            slots = self.prefetch + 2 if self.device.type == "cpu" else self.num_threads
            reader = self.dataset.reader
            self._ring = Ring(
                slots,
                self.batch_size,
                shape,
                self.pin_memory,
                self.normalize if self.device.type == "cpu" else None,
                self.channels_last,
                reader.manifest.mask,
                [name for name in reader.files.fields if not name.startswith("_")],
            )
        return self._ring

    def _views_buffers(self) -> list[Ring]:
        """A ring per view (and with ``return_params`` the boxes' buffers), made again only
        when a view's shape changes."""
        shapes = self.shapes
        if self._view_rings is None or [r.shape for r in self._view_rings] != shapes:
            self._view_rings = None  # the old rings' memory goes before the new ones are made
            slots = self.prefetch + 2 if self.device.type == "cpu" else self.num_threads
            normalize = self.normalize if self.device.type == "cpu" else None
            self._view_rings = [
                Ring(slots, self.batch_size, shape, self.pin_memory, normalize,
                     self.channels_last)
                for shape in shapes
            ]  # fmt: skip
            if self.return_params:
                self._params = param_buffers(slots, len(shapes), self.batch_size,
                                             self.pin_memory)  # fmt: skip
        return self._view_rings

    def __repr__(self) -> str:
        shown = {"batch_size": self.batch_size, "shuffle": self.shuffle, "seed": self.seed,
                 "crop": self.crop, "flip": self.flip, "views": self.views,
                 "device": str(self.device), "num_threads": self.num_threads}  # fmt: skip
        args = ", ".join(f"{k}={v!r}" for k, v in shown.items() if v is not None)
        return f"{type(self).__name__}(cache={str(self.dataset.cache)!r}, {args})"

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        previous = self._live() if self._live is not None else None
        if previous is not None:
            previous.close(f"{type(self).__name__}: a newer iteration of this loader started")
        if not self._epoch_set:
            self._next_epoch()
        self._epoch_set = False
        self._sampler_epoch = getattr(self.sampler, "epoch", None)
        seed = self.seed
        if seed is None:  # a fresh seed per iteration, unless one is being resumed
            if not self._start or self._iteration_seed is None:
                self._iteration_seed = secrets.randbits(63)
            seed = self._iteration_seed
        crops = [self.crop] if self.views is None else [c for c, _ in self.views]
        self.dataset.warn_if_upscaling(crops, stacklevel=2)  # once per size
        start, self._start = self._start, 0
        order, ahead = self._order(seed)
        it = Iteration(self._job(order, ahead, seed), start, self.num_threads, self._taken)
        self._done, self._over = start, False
        self._live = weakref.ref(it)
        return it

    def _taken(self, batches: int, over: bool) -> None:
        self._done, self._over = batches, over

    def _job(self, order: np.ndarray, read_ahead: ReadAhead | None, seed: int) -> Job:
        """What the filling threads of an iteration over ``order`` read."""
        reader = self.dataset.reader
        # A data file cut short already: this iteration reads with pread (see _batches.fill).
        mapped = len(order) > 0 and self._reads_mapped() and not reader.cut_short()
        mapping = as_tensor(reader.mapping()) if len(order) else None
        random_fd = len(order) and not mapped and read_ahead is None
        draws = (seed, self.epoch, self._rank())
        if self._view_crops is None:  # one view: the crop's (or each record whole)
            views = [View(self.crop, self._buffers(), draws)]
        else:  # each view's numbers drawn under a key of its own: its number added
            views = [View(crop, ring, (*draws, v)) for v, (crop, ring)
                     in enumerate(zip(self._view_crops, self._views_buffers()))]  # fmt: skip
        return Job(
            order=order,
            batch_size=self.batch_size,
            # CPU: prefetch batches ahead of the one held, so prefetch + 2 slots (see Job);
            # CUDA: each thread reuses its own pinned slot, the ready device batches are
            # bounded instead.
            ahead=self.prefetch,
            views=views,
            listed=self._view_crops is not None,
            device=self.device,
            normalize=self.normalize,
            channels_last=self.channels_last,
            reader=reader,
            mapping=None if mapping is None else mapping.numpy(),
            mapped=mapped,
            read_ahead=read_ahead,
            fd=random_reader(reader, order) if random_fd else -1,
            flip=self.flip,
            params=self._params if self.return_params else None,
        )


def _pair(size: Sequence[int]) -> tuple[int, int]:
    """A size as a state dict holds it (a list, from JSON too), as a crop's ``size``."""
    height, width = size
    return int(height), int(width)


def check_dataset(dataset: Any) -> None:
    """TypeError unless ``dataset`` is a ``MemmapImageDataset``, saying what to pass instead."""
    if isinstance(dataset, MemmapImageDataset):
        return
    if isinstance(dataset, Subset):
        raise TypeError(
            "BatchLoader reads a MemmapImageDataset's records itself, not a Subset: pass the "
            "dataset and its indices as sampler=[0, 1, ...] (or a sampler of them), e.g. "
            "BatchLoader(subset.dataset, 256, sampler=subset.indices)"
        )
    if isinstance(dataset, str | os.PathLike):
        raise TypeError(
            f"BatchLoader takes a dataset, not a path: BatchLoader(MemmapImageDataset("
            f"{os.fspath(dataset)!r}), ...)"
        )
    raise TypeError(f"BatchLoader takes a MemmapImageDataset, got {type(dataset).__name__}")


def _check_arguments(
    dataset: MemmapImageDataset,
    batch_size: int,
    num_threads: int,
    prefetch: int,
    read: str,
    shuffle: bool,
    sampler: Iterable[int] | None,
    crop: Crop | None,
    views: Sequence[tuple[Crop, int]] | None,
    return_params: bool,
) -> None:
    """Refuse ``BatchLoader``'s arguments that are wrong alone or together, before any setup."""
    check_dataset(dataset)
    for name, value in (("batch_size", batch_size), ("num_threads", num_threads),
                        ("prefetch", prefetch)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {value!r}")
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
    if crop is not None and not isinstance(crop, Crop):
        raise ValueError(
            f"crop must be mmcache.RandomResizedCrop or CenterResizedCrop, got {crop!r}"
        )
    if crop is not None:
        check_draws(crop)
    if views is not None and crop is not None:
        raise ValueError("pass crop= or views=, not both (one crop is views=[(crop, 1)])")
    if views is not None and dataset.reader.annotated:
        raise ValueError(
            "views= of a cache with masks or boxes is not supported: its targets would need "
            "moving with every view; use crop= (one view), or a cache without annotations"
        )
    if return_params and views is None:
        raise ValueError("return_params=True needs views= (one crop is views=[(crop, 1)])")


def _device_and_pinning(
    device: torch.device | str | None, pin_memory: bool
) -> tuple[torch.device, bool]:
    """The device batches go to (a CUDA one given its index), and whether the buffers are
    page-locked: always towards CUDA, never without it."""
    torch_device = torch.device(device) if device is not None else torch.device("cpu")
    if torch_device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be a CPU or CUDA device, got {torch_device}")
    if torch_device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {torch_device} asked for, but CUDA is not available")
        if torch_device.index is None:  # this thread's device; the filling threads' is GPU 0
            torch_device = torch.device("cuda", torch.cuda.current_device())
        pin_memory = True  # an asynchronous host-to-device copy needs page-locked memory
    if pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "BatchLoader: pin_memory=True but CUDA is not available: "
            "the buffers are ordinary (pageable) memory",
            UserWarning,
            stacklevel=3,  # BatchLoader's caller, past __init__
        )
        pin_memory = False
    return torch_device, pin_memory


def _channels(dataset: MemmapImageDataset) -> int:
    shapes = dataset.reader.records.shapes
    return int(shapes[0, 2]) if len(shapes) else 3


def _one_shape(dataset: MemmapImageDataset) -> tuple[int, int, int]:
    """The (H, W, C) every record shares, or MixedShapesError naming the shapes found."""
    shapes = dataset.reader.records.shapes
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
    height, width, channels = distinct[0]
    return int(height), int(width), int(channels)
