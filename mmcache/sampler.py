"""``QuasiRandomSampler``: a shuffled order that reads a cache larger than RAM mostly sequentially.

With a plain random order over a cache that does not fit in RAM, an epoch's page-cache hit rate
is at most RAM / cache size and every miss is a small random read. This sampler shuffles *blocks*
of consecutive records, then shuffles records within a *buffer* of a few blocks: the records in
RAM at any time are those of about one buffer, each block is read from disk once per epoch, and
(given a ``MemmapImageDataset``) the sampler reads the next buffer's blocks ahead, as large
sequential reads, while the current one is consumed.

The order mixes less than a full shuffle: a batch draws from the ``buffer_blocks`` blocks of one
buffer. Blocks are small (about 8 MiB) and a buffer holds many (32), so a batch of 256 images
still comes from up to 32 places spread over the dataset.

The read-ahead follows consumption, not iteration: ``ReadAhead`` is told the position in the
epoch's order that has been reached and reads the buffer after the current one, only then. A
loader that takes the whole order at once (``BatchLoader``) reports positions as it fills
batches; reading the whole epoch ahead up front would push its start out of a page cache that
holds half of it before it is used.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from ._opening import open_for_reading
from ._staleness import recorded_source
from .dataset import MemmapImageDataset
from .errors import StateMismatchError
from .residency import memory

__all__ = ["QuasiRandomSampler"]

logger = logging.getLogger(__name__)

# 8 MiB of consecutive records is a sequential read long enough that a disk's seek is a small
# part of it (an HDD's 10 ms seek against 55 ms of transfer at 150 MB/s), and small enough that
# a buffer of 32 such blocks, 256 MiB, fits in RAM beside a training job on any machine.
BLOCK_BYTES = 8 << 20
DEFAULT_BUFFER_BLOCKS = 32
# For a dataset whose record sizes are unknown (not a MemmapImageDataset).
DEFAULT_BLOCK_SIZE = 64
# The buffers read ahead may take this share of the RAM available (a memory cgroup's limit
# counts): the rest is for the process's own growth and other files. A buffer read ahead
# into a page cache that cannot hold it beside the current one would push out records not yet
# used, which are then read twice.
READ_AHEAD_SHARE = 0.8
# Reading ahead reads runs of records with pread, in pieces of this size, rather than advising
# WILLNEED: the kernel's read-ahead of a sequential pread fills large folios and sends reads
# of up to 4 MB, while WILLNEED under memory pressure fills single pages and sent reads of
# about 600 KB, which an IOPS-limited disk (150 IOPS: 90 MB/s) serves at a fraction of its
# bandwidth (docs/residency.md).
READ_PIECE = 8 << 20
# A sampler's attributes that decide its order (torch's samplers' and this module's names),
# recorded in a BatchLoader's state to refuse resuming with another order.
ORDER_ATTRIBUTES = ("seed", "num_replicas", "shuffle", "drop_last", "block_size", "buffer_blocks")


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
        num_replicas: the number of ranks; default: the world size of ``torch.distributed``
            when it is initialised, else 1.
        rank: this process's rank; default: ``torch.distributed``'s rank when it is
            initialised, else 0.
        buffer_blocks: blocks whose records are shuffled together.
        drop_last: see above; only matters with several replicas.
        prefetch: for a ``MemmapImageDataset``, read the next buffer's blocks, as large
            sequential reads from a thread, while this one is consumed, and wait for a buffer
            to be read before yielding its records; for a cache larger than the RAM available,
            drop the buffers consumed but the epoch's last (see ``ReadAhead``). When the RAM
            available cannot hold two buffers, only the current one is read ahead.

    Examples:
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
        # Where this epoch's order is: the position of the next index iterating yields (a
        # taken epoch stays at its first position: its taker tracks it, as BatchLoader does).
        self._position = 0
        self.prefetch = prefetch
        # Iterating gives epoch self.epoch (set_epoch, load_state_dict, or none yet), else
        # the one after the last iteration's.
        self._epoch_set = True
        self._over = False  # the last iteration ran to its end

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` (call before each epoch; every rank with the same one).

        Without it, each new iteration starts the epoch after the last one's (as
        ``torch.utils.data.RandomSampler`` reshuffles on every ``iter()``); with it, iterating
        gives epoch ``epoch`` however often it is called. (Loaders that take the order with
        ``take_epoch`` set the epoch themselves.)
        """
        self.epoch = epoch
        self.start = self._position = 0
        self._epoch_set = True

    def state_dict(self) -> dict[str, Any]:
        """Where this sampler is in its epoch, as plain JSON-serialisable data: the epoch, the
        seed, and the position in this epoch's order of the next index it yields.
        ``load_state_dict`` makes a new sampler go on from there. The dataset
        (``dataset_identity``) and the order's other settings are recorded to be checked.

        The position counts the indices handed out: a DataLoader with workers takes indices
        for the batches it prefetches, so save its state with a loader that snapshots its
        sampler per batch (torchdata's ``StatefulDataLoader``), or with ``num_workers=0``.
        ``BatchLoader`` records its own position beside this state.
        """
        epoch, start = self.epoch, self._position
        if self._over and not self._epoch_set:
            epoch, start = epoch + 1, 0  # over: iterating again would start the next epoch
        return {
            "epoch": epoch,
            "seed": self.seed,
            "start": start,
            "dataset": dataset_identity(self.data_source),
            "order": order_identity(self),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration yield this epoch's order from ``state["start"]`` on (then
        whole epochs again).

        Raises:
            StateMismatchError: ``state`` is of another seed, dataset or order settings (its
                order would not be this one's), or records no dataset or order.
        """
        check_resume("QuasiRandomSampler", state, self._identity())
        self.set_epoch(int(state["epoch"]))
        self.start = self._position = int(state["start"])

    def _identity(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "dataset": dataset_identity(self.data_source),
            "order": order_identity(self),
        }

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
        order: np.ndarray = slots[rng.permutation(n_blocks)].ravel()
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

    def take_epoch(self) -> tuple[np.ndarray, ReadAhead | None]:
        """What iterating now would yield, as one int64 array, and (with ``prefetch``, for a
        ``MemmapImageDataset``) a started ``ReadAhead`` for it, to be told with ``reached``
        how far consumption has got and closed after. For loaders that take the whole order
        at once; like iterating, it ends a resumed epoch's offset.
        """
        order, starts = self._epoch()
        skip, self.start, self._over = self.start, 0, False
        self._position = skip
        if skip:  # a resumed epoch: from position ``skip`` of its order
            order, starts = order[skip:], np.unique(np.maximum(starts - skip, 0))
        if not (self.prefetch and self._layout is not None and len(order)):
            return order, None
        assert isinstance(self.data_source, MemmapImageDataset)  # (it has a layout)
        fill = self.data_source.reader.fill_ahead
        return order, ReadAhead(*self._layout, order, starts, fill)

    def __iter__(self) -> Iterator[int]:
        if not self._epoch_set:
            self.set_epoch(self.epoch + 1)
        self._epoch_set = False
        order, ahead = self.take_epoch()
        if ahead is None:
            yield from self._counted(order.tolist())
            self._over = True
            return
        with ahead:
            bounds = [*ahead.starts, len(order)]
            for a, z in zip(bounds[:-1], bounds[1:]):
                ahead.reached(a)
                ahead.wait(a)
                yield from self._counted(order[a:z].tolist())
        self._over = True

    def _counted(self, indices: list[int]) -> Iterator[int]:
        """``indices``, each counted into the position ``state_dict`` records as it is yielded."""
        for index in indices:
            self._position += 1
            yield index


def dataset_identity(data_source: Sized) -> dict[str, Any]:
    """What a saved loader or sampler state records of its dataset, so that a resume over
    another dataset is refused: its length and, for a ``MemmapImageDataset``, the cache
    generation and its index's CRC-32 (which fixes every record's file, shape, label and place:
    a copy made by ``mmcache copy`` is another generation of the same records)."""
    identity: dict[str, Any] = {"images": len(data_source)}
    if isinstance(data_source, MemmapImageDataset):
        m = data_source.manifest
        identity["generation"] = m.generation
        identity["index_crc32"] = (m.checksums or {}).get("index")
        # What a refresh keeps: the source and options (a refreshed cache goes on, see
        # check_resume).
        identity["source"] = recorded_source(m)
        identity["options"] = m.options
    return identity


def order_identity(sampler: Any) -> dict[str, Any]:
    """What decides a sampler's order, for a saved state: its class and those of its
    ``ORDER_ATTRIBUTES`` it has (not its rank: one rank's state may resume every rank)."""
    identity: dict[str, Any] = {"sampler": type(sampler).__name__}
    for name in ORDER_ATTRIBUTES:
        value = getattr(sampler, name, None)
        if isinstance(value, bool | int):
            identity[name] = value
    return identity


def check_resume(owner: str, state: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume from ``state`` a run whose ``current`` seed, dataset or order differ.

    A state that records no value for a key of ``current`` (saved by a development version
    of mmcache that did not record it) is refused: what it would resume could not be checked.

    Raises:
        StateMismatchError: naming what differs, the state's value and this run's, or what
            the state does not record.
    """
    missing = [key for key in current if key not in state]
    if missing:
        raise StateMismatchError(
            f"{owner}.load_state_dict: the state records no {' or '.join(missing)}, so it "
            "cannot be checked to be this run's; start the epoch afresh without load_state_dict"
        )
    for key, value in current.items():
        saved = state[key]
        if key == "dataset" and _same_records(saved, value):
            continue
        if key == "dataset" and _refreshed(saved, value):
            warnings.warn(
                f"{owner}.load_state_dict: the cache was refreshed since the state was saved "
                f"({saved.get('images')} images, now {value.get('images')}): going on from the "
                "state's epoch and position in the refreshed cache's order, so the rest of this "
                "epoch may repeat or skip a few images; the epochs after it are whole",
                UserWarning,
                stacklevel=3,
            )
            continue
        if saved != value:
            raise StateMismatchError(
                f"{owner}.load_state_dict: the state was saved with another {key} "
                f"({_show(key, saved)}) than this run's ({_show(key, value)}): resuming would "
                f"repeat some images and skip others; {RESUME_ADVICE[key]}"
            )


RESUME_ADVICE = {
    "seed": "make this run with the seed of the state",
    "dataset": "open the cache the state was saved over (or a copy of it), or start the epoch "
    "afresh without load_state_dict",
    "order": "make this run with the sampler (or shuffle) and settings of the state",
}


def _same_records(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two dataset identities are the same records: the same length and index
    checksum (another generation may hold them: a copy); without checksums, one generation."""
    if saved.get("images") != current.get("images"):
        return False
    if saved.get("index_crc32") is not None and current.get("index_crc32") is not None:
        return saved["index_crc32"] == current["index_crc32"]
    return saved.get("generation") == current.get("generation")


def _refreshed(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two dataset identities are generations of one cache, refreshed in between
    (``mmcache build`` before each run): the same source and options."""
    return saved.get("source") is not None and all(
        saved.get(key) == current.get(key) for key in ("source", "options")
    )


def _show(key: str, value: Any) -> str:
    if key == "dataset" and isinstance(value, dict):
        shown = [f"{value.get('images')} images"]
        if value.get("generation") is not None:
            shown.insert(0, f"cache generation {value['generation']}")
        if value.get("index_crc32") is not None:
            shown.append(f"index CRC-32 {value['index_crc32']:08x}")
        return ", ".join(shown)
    if key == "order" and isinstance(value, dict):
        rest = [f"{k}={v!r}" for k, v in value.items() if k != "sampler"]
        return ", ".join([value.get("sampler") or "no sampler", *rest])
    return repr(value)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _layout(data_source: Sized) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(data file, record offsets, record byte sizes) of a MemmapImageDataset, else None."""
    if not isinstance(data_source, MemmapImageDataset):
        return None
    reader = data_source.reader
    return str(reader.data_path), reader.records.offsets, reader.records.nbytes


def _default_block_size(n: int, layout: tuple[str, np.ndarray, np.ndarray] | None) -> int:
    if layout is None or n == 0:
        return DEFAULT_BLOCK_SIZE
    mean = max(1, int(layout[2].sum()) // n)
    return max(1, BLOCK_BYTES // mean)


class ReadAhead:
    """Reads an epoch's buffers ahead of consumption, one buffer ahead, and (for a cache larger
    than the RAM available) drops the buffers consumed.

    ``reached(position)`` says that consumption has got to ``position`` of the order: the
    buffer holding it and the next are then read, each once, in file order, as runs of
    consecutive records in pieces of ``READ_PIECE``: long sequential reads. When the RAM
    available cannot hold both, only the current buffer is read (or, if it does not fit
    either, nothing). ``wait(position)`` then returns once the buffer holding ``position`` is
    read: a reader that went on would ask the disk for its records one at a time, and on a
    slow disk those small reads, not the buffer's large ones, would set the pace.

    When the data file is larger than the RAM available, the buffers before the previous one
    are dropped (``POSIX_FADV_DONTNEED``), except the epoch's last ones that fit beside the
    buffers in use: those are what the next epoch can find in RAM. Left to itself the kernel
    evicts the oldest pages, and in an order that visits every record once an epoch, the next
    epoch's reads push out most of what one epoch leaves before they reach it; read twice
    (ahead, then by the loader), this epoch's records would also count as in use and crowd out
    the buffer read ahead. The previous buffer is kept because a DataLoader's workers, or the
    loader's other threads, may still be reading it.

    The reads run in one thread, a piece after the other, so the page cache fills as fast as
    the disk delivers and no faster. Thread-safe; ``close`` (or ``with``) stops the thread
    between pieces and releases any ``wait``.
    """

    def __init__(
        self,
        path: str,
        offsets: np.ndarray,
        sizes: np.ndarray,
        order: np.ndarray,
        starts: np.ndarray,
        fill: Callable[[np.ndarray, Callable[[], bool]], None] | None = None,
    ) -> None:
        self.offsets, self.sizes, self.order = offsets, sizes, order
        self.fill = fill  # fills a buffer's empty records first (a sparse copy's fetches)
        self.starts = starts.tolist()
        self.bytes = np.add.reduceat(sizes[order], starts).tolist() if len(order) else []
        self.requested = 0  # buffers before this one are requested (or passed over)
        self.read = 0  # buffers before this one are read (or will not be)
        self.dropped = 0  # buffers before this one are dropped (or kept)
        self.keep_from = 0  # buffers from this one on are never dropped
        available = memory().available
        if len(order) and int((offsets + sizes).max()) > available:
            # Keep the epoch's tail that fits beside three buffers (the previous, the current
            # and the next): the buffers from keep_from on.
            tail = available * READ_AHEAD_SHARE - 3 * max(self.bytes)
            from_b = np.cumsum(self.bytes[::-1])[::-1]  # bytes of buffers b..last
            fits = np.flatnonzero(from_b <= tail)
            self.keep_from = int(fits[0]) if len(fits) else len(self.starts)
        self.cond = threading.Condition()
        self.requests: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self.stopped = False
        self.warned = False
        try:
            self.fd = open_for_reading(Path(path))
        except OSError:
            self.fd = -1  # a rebuilt cache: the dataset will say so; reading ahead is a hint
        self.thread = None
        if self.fd >= 0 and hasattr(os, "posix_fadvise"):
            self.thread = threading.Thread(target=self._run, name="mmcache-prefetch", daemon=True)
            self.thread.start()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def buffer(self, position: int) -> int:
        """The buffer that holds ``position`` of the order."""
        return bisect.bisect_right(self.starts, position) - 1

    def reached(self, position: int) -> None:
        """Consumption has reached ``position`` of the order: request what it needs next."""
        if self.thread is None:
            return
        k = self.buffer(position)
        with self.cond:
            drop = min(k - 1, self.keep_from)
            for b in range(self.dropped, drop):
                self.requests.put(("drop", b))
            self.dropped = max(self.dropped, drop)
            if k + 1 < self.requested:
                return  # this buffer and the next are requested already
            last = min(k + 1, len(self.starts) - 1)
            room = memory().available * READ_AHEAD_SHARE
            if sum(self.bytes[k : last + 1]) > room:
                last = k if self.bytes[k] <= room else k - 1
                self._warn(room)
            for b in range(max(self.requested, k), last + 1):
                self.requests.put(("read", b))
            self.requested = max(self.requested, last + 1, k)

    def wait(self, position: int) -> None:
        """Return once the buffer holding ``position`` is read, if it was requested."""
        k = self.buffer(position)
        with self.cond:
            while not self.stopped and self.read <= k < self.requested:
                self.cond.wait()

    def _run(self) -> None:
        """The thread: read or drop each requested buffer in turn, until None comes."""
        piece = np.empty(0, np.uint8)
        try:
            while not self.stopped and (request := self.requests.get()) is not None:
                what, b = request
                records = self._records(b)
                if what == "read" and self.fill is not None:
                    self.fill(records, lambda: self.stopped)
                for offset, length in _runs(records, self.offsets, self.sizes):
                    if self.stopped:
                        return
                    if what == "drop":
                        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
                        continue
                    if piece.size == 0:
                        piece = np.empty(READ_PIECE, np.uint8)
                    for at in range(offset, offset + length, READ_PIECE):
                        if self.stopped:
                            return
                        part = piece[: min(READ_PIECE, offset + length - at)]
                        os.preadv(self.fd, [part.data], at)
                if what == "read":
                    with self.cond:
                        self.read = b + 1
                        self.cond.notify_all()
        except OSError:
            pass  # the file went away, or fadvise is unsupported here: reading ahead is a hint
        finally:
            with self.cond:
                self.stopped = True  # nothing more will be read: release the waits
                self.cond.notify_all()

    def _records(self, b: int) -> np.ndarray:
        """Buffer ``b``'s records, sorted."""
        end = self.starts[b + 1] if b + 1 < len(self.starts) else len(self.order)
        return np.sort(self.order[self.starts[b] : end])

    def _warn(self, room: float) -> None:
        if not self.warned:
            self.warned = True
            logger.warning(
                "QuasiRandomSampler: two buffers of %.0f MB do not fit in the %.0f MB of RAM "
                "that reading ahead may use; it reads less ahead. A smaller buffer_blocks or "
                "block_size would let it read the next buffer while this one is used",
                max(self.bytes) / 1e6,
                room / 1e6,
            )

    def close(self) -> None:
        """Stop the thread (between pieces) and release any wait."""
        if self.thread is not None:
            with self.cond:
                self.stopped = True
                self.cond.notify_all()
            self.requests.put(None)
            self.thread.join()
            self.thread = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _runs(records: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int]]:
    """(offset, length) of each run of consecutive record numbers in sorted ``records``."""
    breaks = np.flatnonzero(np.diff(records) != 1) + 1
    firsts = records[np.concatenate([[0], breaks])]
    lasts = records[np.concatenate([breaks - 1, [len(records) - 1]])]
    starts = offsets[firsts]
    ends = offsets[lasts] + sizes[lasts]
    return list(zip(starts.tolist(), (ends - starts).tolist()))
