"""``QuasiRandomSampler``: a shuffled order that reads a cache larger than RAM mostly sequentially.

With a plain random order over a cache that does not fit in RAM, an epoch's page-cache hit rate
is about RAM / cache size and every miss is a small random read. This sampler shuffles *blocks*
of consecutive records, then shuffles records within a *buffer* of a few blocks: the records in
RAM at any time are those of about one buffer, each block is read from disk once per epoch, and
(given a ``MemmapImageDataset``) the sampler asks the kernel to read the next buffer's blocks
ahead, as large sequential reads, while the current one is consumed.

The order mixes less than a full shuffle: a batch draws from the ``buffer_blocks`` blocks of one
buffer. Blocks are small (about 8 MiB) and a buffer holds many (32), so a batch of 256 images
still comes from up to 32 places spread over the dataset.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sized

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from .dataset import MemmapImageDataset

# 8 MiB of consecutive records is a sequential read long enough that a disk's seek is a small
# part of it (an HDD's 10 ms seek against 55 ms of transfer at 150 MB/s), and small enough that
# a buffer of 32 such blocks, 256 MiB, fits in RAM beside a training job on any machine.
BLOCK_BYTES = 8 << 20
DEFAULT_BUFFER_BLOCKS = 32
# For a dataset whose record sizes are unknown (not a MemmapImageDataset).
DEFAULT_BLOCK_SIZE = 64


class QuasiRandomSampler(Sampler[int]):
    """Every index once per epoch, in blocks of consecutive records shuffled as blocks and then
    within a buffer of ``buffer_blocks`` blocks: an order for caches larger than RAM.

    Distributed training (``num_replicas`` > 1) splits each epoch's order into ``num_replicas``
    contiguous, equal parts, one per rank, so each rank reads whole blocks. When the dataset
    size N is not a multiple of ``num_replicas``, equal lengths need padding or dropping, as in
    ``DistributedSampler``: by default (``drop_last=False``) the order is padded by repeating
    its first indices, so the ranks together cover every index and fewer than ``num_replicas``
    indices are seen twice in that epoch; with ``drop_last=True`` the last N % num_replicas
    indices of the epoch's order are left out, so the ranks are disjoint and, as the order
    changes every epoch, a different few are left out each time.

    Args:
        data_source: the dataset (anything with ``len``).
        block_size: records per block. Default: as many as fill about 8 MiB, from the record
            sizes of a ``MemmapImageDataset``; 64 for another dataset.
        seed: the same seed and epoch give the same order, on every rank.
        num_replicas, rank: default to the world size and rank of ``torch.distributed`` when it
            is initialised, else 1 and 0.
        buffer_blocks: blocks whose records are shuffled together.
        drop_last: see above; only matters with several replicas.
        prefetch: for a ``MemmapImageDataset``, advise the kernel to read the next buffer's
            blocks while this one is consumed (``posix_fadvise WILLNEED``, in a thread).

    Example:
        >>> ds = MemmapImageDataset("cache/train")  # doctest: +SKIP
        >>> sampler = QuasiRandomSampler(ds, seed=0)  # doctest: +SKIP
        >>> loader = DataLoader(ds, batch_size=256, sampler=sampler)  # doctest: +SKIP
        >>> for epoch in range(10):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for images, labels in loader: ...
    """

    def __init__(
        self,
        data_source: Sized,
        block_size: int | None = None,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
        drop_last: bool = False,
        prefetch: bool = True,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if _distributed() else 1
        if rank is None:
            rank = dist.get_rank() if _distributed() else 0
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be within 0..{num_replicas - 1}, got {rank}")
        if buffer_blocks < 1:
            raise ValueError(f"buffer_blocks must be at least 1, got {buffer_blocks}")
        if seed < 0:
            raise ValueError(f"seed must not be negative, got {seed}")
        self.data_source = data_source
        self.n = len(data_source)
        self._layout = _layout(data_source)
        if block_size is None:
            block_size = _default_block_size(self.n, self._layout)
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size, self.buffer_blocks = block_size, buffer_blocks
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        self.seed, self.epoch, self.start = seed, 0, 0
        self.prefetch = prefetch

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (call before each epoch; every rank with the same one)."""
        self.epoch = epoch
        self.start = 0

    def state_dict(self, consumed: int = 0) -> dict[str, int]:
        """Where training is in this epoch, as plain JSON-serialisable data: the epoch, the
        seed, and ``consumed``, the samples of this epoch's order training has taken (a
        DataLoader reads ahead of training, so only the caller knows it: batches done times
        the batch size). ``load_state_dict`` makes a new sampler go on from there.
        """
        return {"epoch": self.epoch, "seed": self.seed, "start": int(consumed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next iteration yield this epoch's order from ``state["start"]`` on (then
        whole epochs again)."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"the state is of seed {state['seed']}, this sampler's is {self.seed}: its "
                "order would not be the same"
            )
        self.set_epoch(int(state["epoch"]))
        self.start = int(state["start"])

    def __len__(self) -> int:
        """Samples per epoch for this rank (a resumed epoch yields fewer: the rest of it)."""
        if self.drop_last:
            return self.n // self.num_replicas
        return -(-self.n // self.num_replicas)

    def indices(self) -> np.ndarray:
        """This rank's order for the current epoch, as an int64 array."""
        return self._epoch()[0]

    def _epoch(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's order, and where each of its buffers starts in it."""
        rng = np.random.default_rng([self.seed, self.epoch])
        b = self.block_size
        n_blocks = -(-self.n // b)
        slots = np.arange(n_blocks * b, dtype=np.int64).reshape(n_blocks, b)
        order = slots[rng.permutation(n_blocks)].ravel()
        # A record's buffer: its block's place in the shuffled block order // buffer_blocks,
        # so buffers hold whole blocks even after the short last block.
        buffer = np.repeat(np.arange(n_blocks) // self.buffer_blocks, b)[order < self.n]
        order = order[order < self.n]
        per_rank = len(self)
        total = per_rank * self.num_replicas
        if total > len(order):  # pad by repeating from the start
            order, buffer = np.resize(order, total), np.resize(buffer, total)
        mine = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        order, buffer = order[mine], buffer[mine]
        # Shuffle within buffers: sorting by (buffer + a uniform in [0, 1)) permutes each
        # buffer and keeps the buffers in order. (A padded tail's buffer numbers restart low:
        # it sorts first, which is as good a place as any for those few records.)
        rng_rank = np.random.default_rng([self.seed, self.epoch, self.rank, 1])
        perm = np.argsort(buffer + rng_rank.random(len(buffer)), kind="stable")
        order, buffer = order[perm], buffer[perm]
        starts = np.flatnonzero(np.diff(buffer, prepend=-1) != 0)
        return order, starts

    def __iter__(self) -> Iterator[int]:
        order, starts = self._epoch()
        skip, self.start = self.start, 0
        if skip:  # a resumed epoch: from position ``skip`` of its order
            order, starts = order[skip:], np.unique(np.maximum(starts - skip, 0))
        if not (self.prefetch and self._layout is not None and len(order)):
            yield from order.tolist()
            return
        bounds = [*starts.tolist(), len(order)]
        buffers = [order[a:z] for a, z in zip(bounds[:-1], bounds[1:])]
        with _Prefetcher(*self._layout) as prefetcher:
            prefetcher.advise(buffers[0])
            for k, buf in enumerate(buffers):
                if k + 1 < len(buffers):
                    prefetcher.advise(buffers[k + 1])
                yield from buf.tolist()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _layout(data_source: Sized) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(data file, record offsets, record byte sizes) of a MemmapImageDataset, else None."""
    if not isinstance(data_source, MemmapImageDataset):
        return None
    records = data_source.records
    return str(data_source.data_path), records.offsets, records.nbytes


def _default_block_size(n: int, layout: tuple[str, np.ndarray, np.ndarray] | None) -> int:
    if layout is None or n == 0:
        return DEFAULT_BLOCK_SIZE
    mean = max(1, int(layout[2].sum()) // n)
    return max(1, BLOCK_BYTES // mean)


class _Prefetcher:
    """Asks the kernel, from a thread, to read the byte ranges of the given records."""

    def __init__(self, path: str, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.path, self.offsets, self.sizes = path, offsets, sizes
        self.fd = -1
        self.thread: threading.Thread | None = None

    def __enter__(self) -> _Prefetcher:
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            self.fd = -1  # a rebuilt cache: the dataset will say so; prefetching is only advice
        return self

    def __exit__(self, *exc) -> None:
        self._join()
        if self.fd >= 0:
            os.close(self.fd)

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def advise(self, records: np.ndarray) -> None:
        if self.fd < 0 or not len(records) or not hasattr(os, "posix_fadvise"):
            return
        ranges = _runs(np.sort(records), self.offsets, self.sizes)
        self._join()  # one request in flight: the previous buffer's reads come first
        self.thread = threading.Thread(
            target=_advise, args=(self.fd, ranges), name="mmcache-prefetch", daemon=True
        )
        self.thread.start()


def _runs(records: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """(offset, length) of each run of consecutive record numbers in sorted ``records``."""
    breaks = np.flatnonzero(np.diff(records) != 1) + 1
    firsts = records[np.concatenate([[0], breaks])]
    lasts = records[np.concatenate([breaks - 1, [len(records) - 1]])]
    starts = offsets[firsts]
    ends = offsets[lasts] + sizes[lasts]
    return list(zip(starts.tolist(), (ends - starts).tolist()))


def _advise(fd: int, ranges: list[tuple[int, int]]) -> None:
    for offset, length in ranges:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            return  # unsupported here, or the file went away: it was only advice
