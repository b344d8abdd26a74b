"""One ``BatchLoader`` iteration: the threads that fill the batches, handed out in order.

An ``Iteration`` starts the filling threads over a ``Job`` (everything they read, fixed for the
iteration) and hands out the batches in order. Threads and consumer share a ``Shared`` under
one condition: a thread takes the next batch number, waits for the slot to be given back,
fills it (``mmcache._batches.fill``), and publishes a ``Batch`` (``batch_of``: on the CPU, or
copied to the device). An error raised in a thread is kept with the number of the batch it was
filling and raised from the ``next()`` that would have returned that batch.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from ._batches import Job, Scratch, fill, output, renew
from ._opening import open_for_reading
from ._records import RecordReader

# An order with fewer steps forward by at most NEARBY records than this share is read as a
# random one (see ``random_reader``); a sequential order (shuffle=False), or a rank's strided
# share of one (DistributedSampler without shuffling), keeps the kernel's read-ahead.
SEQUENTIAL_SHARE = 0.5
NEARBY = 8


class Batch(NamedTuple):
    """A filled batch, ready to hand out."""

    images: Any  # a tensor; with views, a list of one per view
    labels: Any  # int64 labels, or an annotated cache's target dict (see ``Ring.target``)
    copied: Any  # CUDA: the event of its copy to the device; CPU: None
    params: Any = None  # with views and return_params: a tensor per view of its boxes and flips


class Failure(NamedTuple):
    """The first error of an iteration's threads: batches before it are still handed out."""

    batch: int  # the number of the batch being filled
    error: BaseException


class Shared:
    """What the filling threads and the consumer share (the threads never see the iterator, so
    dropping the iterator can finalize it and stop them)."""

    def __init__(self, first: int) -> None:
        self.cond = threading.Condition()
        self.next_batch = first  # the next batch number a thread will take
        self.released = first  # batches before this one are given back by the consumer
        self.ready: dict[int, Batch] = {}  # batch number -> batch
        self.failure: Failure | None = None
        self.stop = False


class Iteration:
    """One pass over a BatchLoader's order: starts the threads, hands out batches in order.

    Args:
        job: what the threads read.
        start: batches of the order to skip (a resumed epoch).
        threads: filling threads (no more than there are batches to fill).
        taken: called with the number of batches handed out, after each, and whether the
            iteration is over (once more, with True, when it ends: ``StopIteration``).
    """

    def __init__(
        self, job: Job, start: int, threads: int, taken: Callable[[int, bool], None]
    ) -> None:
        self._count = job.count
        self._taken = min(start, self._count)
        self._shared = shared = Shared(self._taken)
        self._on_taken = taken
        self._closed: str | None = None
        self._threads = [
            threading.Thread(
                target=fill_batches,
                args=(job, shared, number),
                name=f"mmcache-BatchLoader-{number}",
                daemon=True,
            )
            for number in range(min(threads, max(self._count - self._taken, 1)))
        ]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, stop, shared, self._threads, job)

    def __iter__(self) -> Iteration:
        return self

    def __len__(self) -> int:
        return self._count - self._taken

    def __next__(self) -> tuple[Any, ...]:
        if self._closed is not None:
            raise RuntimeError(self._closed)
        if self._taken >= self._count:
            self.close()
            self._on_taken(self._taken, True)
            raise StopIteration
        batch = self._wait(self._taken)
        self._taken += 1
        self._on_taken(self._taken, False)
        if batch.copied is not None:
            # The current stream is per thread: order the caller's stream after the copy, and
            # tell the caching allocator that stream uses the tensors, so their memory is not
            # handed to a later side-stream allocation while the caller's work still reads it.
            images = batch.images if isinstance(batch.images, list) else [batch.images]
            current = torch.cuda.current_stream(images[0].device)
            current.wait_event(batch.copied)
            for tensor in [*images, *_tensors(batch.labels), *(batch.params or [])]:
                tensor.record_stream(current)
        if batch.params is not None:
            return batch.images, batch.params, batch.labels
        return batch.images, batch.labels

    def _wait(self, number: int) -> Batch:
        """Batch ``number`` once a thread has filled it; a thread's error instead if it failed
        on this batch (or on an earlier one, which cannot happen: they were handed out)."""
        shared = self._shared
        with shared.cond:
            shared.released = number  # the batch handed out before this one may be refilled
            shared.cond.notify_all()
            while number not in shared.ready and (
                shared.failure is None or shared.failure.batch > number
            ):
                shared.cond.wait()
            batch = shared.ready.pop(number, None)
            if batch is None:
                # the wait above ends on a ready batch or on a failure
                assert shared.failure is not None
                error, shared.failure = shared.failure.error, None
        if batch is None:
            self.close("BatchLoader: this iteration stopped on an error")
            raise error
        return batch

    def close(self, reason: str | None = None) -> None:
        """Stop and join the threads; a later ``next()`` raises ``reason`` if one is given."""
        self._finalizer()
        if reason is not None:
            self._closed = reason


def stop(shared: Shared, threads: list[threading.Thread], job: Job) -> None:
    """Tell the threads to stop, join them, and close what the job opened."""
    with shared.cond:
        shared.stop = True
        shared.cond.notify_all()
    me = threading.current_thread()
    for thread in threads:
        if thread is not me:
            thread.join()
    if job.read_ahead is not None:
        job.read_ahead.close()
    if job.fd >= 0:
        os.close(job.fd)
        job.fd = -1


def random_reader(reader: RecordReader, order: np.ndarray) -> int:
    """A descriptor of the data file advised ``POSIX_FADV_RANDOM`` for a shuffled order's
    ``pread``s, or -1: a sequential order, or no such advice here (the reader's own descriptor
    is used then).

    The kernel otherwise takes a read whose preceding record is cached for a sequential stream
    and reads ahead records the order will not want yet, which costs a slow disk more reads
    than the order makes.
    """
    steps = np.diff(order)
    forward = np.count_nonzero((steps > 0) & (steps <= NEARBY))  # in order, or a small stride
    if len(steps) == 0 or forward >= SEQUENTIAL_SHARE * len(steps):
        return -1
    if not hasattr(os, "posix_fadvise"):
        return -1
    try:
        fd = open_for_reading(reader.data_path)
    except OSError:
        return -1  # a data file replaced since the dataset opened: read through the reader
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError:
        os.close(fd)
        return -1
    return fd


def as_tensor(mapping: np.ndarray) -> torch.Tensor:
    """The read-only mapping of the data file as a flat uint8 tensor (no copy). torch warns
    that it cannot mark the tensor read-only; nothing writes through it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(mapping)


def fill_batches(job: Job, shared: Shared, thread_number: int) -> None:
    """A filling thread: take batch numbers in turn, fill each into its slot, publish it."""
    cuda = job.device.type == "cuda"
    number = -1  # the batch being filled
    try:
        stream = torch.cuda.Stream(job.device) if cuda else None
        scratch = Scratch()
        slots = len(job.ring.images)
        while True:
            with shared.cond:
                number = shared.next_batch
                if number >= job.count or shared.stop or shared.failure is not None:
                    return
                shared.next_batch += 1
                # CPU: slot number % slots last held batch number - slots, which the consumer
                # dropped (unless kept: Ring.claim) once it asks for the batch two after it.
                # CUDA: bound the device batches waiting.
                while number > shared.released + job.ahead and not shared.stop:
                    shared.cond.wait()
                if shared.stop:
                    return
            slot = thread_number if cuda else number % slots
            if not cuda:  # a batch the caller still holds keeps its buffers
                for one in job.views:
                    one.ring.claim(slot)
                if job.params is not None:  # this slot's only: others are being filled
                    for view in range(len(job.params[slot])):
                        renew(job.params[slot], view, job.ring.pinned)
            if job.read_ahead is not None:  # the sampler's read-ahead follows the threads
                first = number * job.batch_size
                last = min(first + job.batch_size, len(job.order)) - 1
                for position in (first, last):
                    job.read_ahead.reached(position)
                    job.read_ahead.wait(position)
            n = fill(job, slot, number, lambda: shared.stop, scratch)
            if n is None:
                return
            batch = batch_of(job, slot, n, stream)
            with shared.cond:
                shared.ready[number] = batch
                # Hold nothing of a batch once handed out (the consumer takes it under this
                # lock): its slot's buffers count as in use while anything references them.
                del batch
                shared.cond.notify_all()
    except BaseException as e:  # handed to the consumer, which raises it from next()
        with shared.cond:
            if shared.failure is None or number < shared.failure.batch:
                shared.failure = Failure(number, e)
            shared.cond.notify_all()


def _tensors(labels: Any) -> list[torch.Tensor]:
    """The tensors of a batch's labels or target dict (its mask and fields' rows)."""
    if isinstance(labels, torch.Tensor):
        return [labels]
    return [t for v in labels.values() for t in (v if isinstance(v, list) else [v])]


def _to(labels: Any, device: torch.device) -> Any:
    """A batch's labels or target dict on ``device`` (copies from pinned memory are async)."""
    if isinstance(labels, torch.Tensor):
        return labels.to(device, non_blocking=True)
    return {
        k: [t.to(device) for t in v] if isinstance(v, list) else v.to(device, non_blocking=True)
        for k, v in labels.items()
    }


def batch_of(job: Job, slot: int, n: int, stream: Any) -> Batch:
    """Slot ``slot``'s first ``n`` samples as a ``Batch`` (its images a list of one batch per
    view with ``views=``): the ring's buffers (CPU), or copies on the device made on
    ``stream``, normalised there, and waited for (CUDA)."""
    target = job.ring.target(slot, n)
    params = [p[:n] for p in job.params[slot]] if job.params is not None else None
    if job.device.type != "cuda":
        images = [view.ring.output(slot, n) for view in job.views]
        return Batch(images if job.listed else images[0], target, None, params)
    with torch.cuda.stream(stream):
        images = [
            output(view.ring.images[slot][:n].to(job.device, non_blocking=True), job.normalize,
                   job.channels_last)
            for view in job.views
        ]  # fmt: skip
        target = _to(target, job.device)
        if params is not None:
            params = [p.to(job.device, non_blocking=True) for p in params]
        copied = torch.cuda.Event()
        copied.record(stream)
    # The copy of a batch takes a few milliseconds at PCIe speed, less than filling the next
    # batch; waiting here lets this thread's one pinned slot be refilled without a second ring.
    copied.synchronize()
    return Batch(images if job.listed else images[0], target, copied, params)

