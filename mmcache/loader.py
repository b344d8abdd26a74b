"""The fast batch path: ``BatchLoader`` gathers batches from a cache into reused buffers.

A DataLoader worker copies each batch into a fresh shared-memory segment that the main process
maps, and that segment (its allocation, the page faults writing it, the ``munmap`` that frees
it) costs far more than the copy of the pixels. ``BatchLoader`` skips all of that: threads of
the consuming process copy records straight from the memory-mapped cache into a small ring of
preallocated buffers (numpy releases the GIL during large copies), so a batch costs one memory
copy and no allocation.

When the cache does not fit in RAM the threads read with ``pread`` instead of copying from the
mapping: under memory pressure every page fault on a mapping also pays for reclaiming mapped
pages, which made a mapped random order many times slower than ``pread``. In RAM the mapping is
faster. docs/loader.md gives both measurements and their commands.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ._feedback import count
from .dataset import MemmapImageDataset
from .errors import MixedShapesError
from .residency import memory

__all__ = ["BatchLoader"]


class BatchLoader:
    """Batches of ``(images, labels)`` from a cache whose records all share one shape.

    ``images`` is a uint8 tensor N x H x W x C (the stored pixels, no transform), ``labels`` an
    int64 tensor N. Background threads copy records from the memory-mapped cache into a ring of
    ``prefetch + 1`` preallocated batch buffers (pinned if ``pin_memory``); nothing is allocated
    per batch and nothing crosses a process boundary.

    Buffer contract (CPU batches, ``device`` None or CPU): a yielded batch is a view of a ring
    buffer and stays valid until you ask for the next batch (the next ``next()`` call, i.e. the
    next turn of the ``for`` loop); from then on its buffer may be refilled. To keep a batch
    longer, copy it: ``images.clone()``. Do not ``.to("cuda", non_blocking=True)`` a CPU batch
    yourself (the copy may outlive the buffer's turn): pass ``device``. With a CUDA ``device``,
    each batch is a new device tensor (from torch's caching allocator, so no real allocation)
    that stays valid as long as you hold it; the copy to the device runs on a side stream,
    asynchronously from pinned buffers, and the batch is ordered before any work you queue on
    the current stream.

    Ending an iteration early (``break``, an exception, dropping the iterator) stops and joins
    its threads. An error raised in a thread (a record not in the cache, say) is raised from
    the ``next()`` that would have returned the batch it was filling, after the batches before
    it; the iteration is then over.
    Starting a new iteration ends the previous one of the same loader (they share the buffers).

    Args:
        dataset: an opened cache. Its ``transform`` and ``target_transform`` must be None:
            transform the batch instead (on the GPU, typically).
        batch_size: records per batch.
        shuffle: a new random order each epoch (see ``seed``, ``set_epoch``).
        sampler: any iterable of record indices (``RandomSampler``, ``DistributedSampler``,
            ...); with a sampler, ``shuffle`` must be False, as in ``DataLoader``.
        drop_last: drop the last batch if it is smaller than ``batch_size``.
        pin_memory: page-lock the buffers (needs CUDA; without it, ordinary memory is used
            and a warning says so).
        device: ``None``/``"cpu"``, or a CUDA device to copy batches to asynchronously.
        num_threads: copying threads; 2 saturate memory bandwidth on most machines.
        prefetch: batches prepared ahead of the one you hold.
        seed: with ``shuffle``, the order of epoch ``e`` is a function of ``(seed, e)``; None
            draws a fresh order every iteration.
        read: how records leave the page cache: ``"mmap"`` copies them out of a memory map
            (fastest when the cache fits in RAM), ``"pread"`` reads them with ``pread`` (much
            faster when it does not, and a data file truncated under the loader is a
            ``CacheFormatError`` rather than a SIGBUS); ``"auto"`` picks ``"mmap"`` when the
            data file fits in the RAM available now (a memory cgroup's limit counts), at the
            start of each iteration.

    Example:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> loader = BatchLoader(ds, batch_size=256, shuffle=True, seed=0)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     loader.set_epoch(epoch)
        ...     for images, labels in loader:
        ...         train_step(images.cuda().permute(0, 3, 1, 2).float() / 255, labels.cuda())

    Raises:
        MixedShapesError: the records do not all have one shape (the message lists the shapes).
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
                "transform/target_transform and transform the batches instead"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.drop_last = drop_last
        self.num_threads = num_threads
        self.prefetch = prefetch
        self.seed = seed
        self.read = read
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
        self.shape = _one_shape(dataset)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._live: weakref.ref | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order next (and forward it to the sampler, if it has one)."""
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _indices(self) -> np.ndarray:
        n = len(self.dataset)
        if self.sampler is not None:
            order = np.fromiter((int(i) for i in self.sampler), np.int64)
            bad = (order < 0) | (order >= n)
            if bad.any():
                raise IndexError(
                    f"sampler gave index {int(order[bad][0])}, outside 0..{n - 1} for {n} images"
                )
            return order
        if self.shuffle:
            rng = np.random.default_rng(None if self.seed is None else [self.seed, self.epoch])
            return rng.permutation(n)
        return np.arange(n, dtype=np.int64)

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

    def _ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring buffers, made on first use and kept for the loader's life."""
        if self._buffers is None:
            slots = self.prefetch + 1 if self.device.type == "cpu" else self.num_threads
            shape = (slots, self.batch_size, *self.shape)
            if self.pin_memory:
                images = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            else:
                # numpy's allocator asks for transparent huge pages on large arrays: the first
                # touch of a 200 MB ring faults 100 huge pages instead of 50,000 small ones.
                images = torch.from_numpy(np.empty(shape, np.uint8))
            labels = torch.empty((slots, self.batch_size), dtype=torch.int64)
            if self.pin_memory:
                labels = labels.pin_memory()
            self._buffers = (images, labels)
        return self._buffers

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        previous = self._live() if self._live is not None else None
        if previous is not None:
            previous.close(f"{type(self).__name__}: a newer iteration of this loader started")
        order = self._indices()
        if self.drop_last:
            order = order[: self._num_batches(len(order)) * self.batch_size]
        it = _Iteration(self, order)
        self._live = weakref.ref(it)
        return it


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
            f"{dataset.cache}: BatchLoader needs records of one shape (H x W x C), found "
            f"{len(distinct)}: {found}{more}; build the cache with size=(W, H), or use "
            "DataLoader with a transform that makes them equal"
        )
    return tuple(int(v) for v in distinct[0])


class _Shared:
    """What the copying threads and the consumer share (the threads never see the iterator, so
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

    def __init__(self, loader: BatchLoader, order: np.ndarray) -> None:
        ds = loader.dataset
        images, labels = loader._ring()
        self._shared = shared = _Shared()
        self._count = -(-len(order) // loader.batch_size)
        self._taken = 0
        self._closed: str | None = None
        job = _Job(
            order=order,
            batch_size=loader.batch_size,
            count=self._count,
            # CPU: prefetch batches ahead of the one held, so prefetch + 1 slots; CUDA: each
            # thread reuses its own pinned slot, the ready device batches are bounded instead.
            ahead=loader.prefetch,
            slots=len(images),
            images=images,
            labels=labels,
            device=loader.device,
            dataset=ds,
            data=ds.mapping() if len(order) else None,
            mapped=len(order) > 0 and loader._reads_mapped(),
        )
        self._threads = [
            threading.Thread(
                target=_work, args=(job, shared, k), name=f"mmcache-BatchLoader-{k}", daemon=True
            )
            for k in range(min(loader.num_threads, max(self._count, 1)))
        ]
        for t in self._threads:
            t.start()
        self._finalizer = weakref.finalize(self, _stop, shared, self._threads)

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
    """The read-only inputs of the copying threads."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _stop(shared: _Shared, threads: list[threading.Thread]) -> None:
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join()


def _work(job: _Job, shared: _Shared, k: int) -> None:
    """A copying thread: take batch numbers in turn, fill each into its slot, publish it."""
    cuda = job.device.type == "cuda"
    u = -1
    try:
        stream = torch.cuda.Stream(job.device) if cuda else None
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
            slot = k if cuda else u % job.slots
            n = _fill(job, slot, job.order[u * job.batch_size : (u + 1) * job.batch_size], shared)
            if n is None:
                return
            images, labels, copied = job.images[slot, :n], job.labels[slot, :n], None
            if cuda:
                images, labels, copied = _to_device(images, labels, job.device, stream)
            with shared.cond:
                shared.ready[u] = (images, labels, copied)
                shared.cond.notify_all()
    except BaseException as e:  # handed to the consumer, which raises it from next()
        with shared.cond:
            if shared.error is None or u < shared.error[0]:
                shared.error = (u, e)
            shared.cond.notify_all()


def _fill(job: _Job, slot: int, idx: np.ndarray, shared: _Shared) -> int | None:
    """Copy records ``idx`` into ring slot ``slot``; their count, or None if told to stop."""
    ds, data, mapped = job.dataset, job.data, job.mapped
    n = len(idx)
    flat = job.images[slot].numpy().reshape(job.images.shape[1], -1)
    nbytes = flat.shape[1]
    records = ds.records
    np.take(records.labels, idx, out=job.labels[slot, :n].numpy())
    filled = ds.filled(idx)
    offsets = records.offsets[idx].tolist()
    # One slice copy per record, each releasing the GIL (np.take over a strided 2-D view of
    # the mapping was slower for records of a megabyte).
    for j, off in enumerate(offsets):
        if shared.stop:
            return None
        if not filled[j]:  # the dataset's own read raises its error (or, lazily, fills it)
            flat[j] = ds.read(int(idx[j])).reshape(-1)
        elif mapped:
            flat[j] = data[off : off + nbytes]
        else:
            ds.read_into(int(idx[j]), flat[j])
    return n


def _to_device(
    images: torch.Tensor, labels: torch.Tensor, device: torch.device, stream: Any
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Copy a pinned batch to ``device`` on ``stream``, and wait for it: the slot refills next."""
    with torch.cuda.stream(stream):
        d_images = images.to(device, non_blocking=True)
        d_labels = labels.to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    # The copy of ~66 MB takes ~3 ms at PCIe speed, less than filling the next batch; waiting
    # here lets this thread's one pinned slot be refilled without a second ring.
    copied.synchronize()
    return d_images, d_labels, copied
