"""QuasiRandomSampler: coverage, ranks, determinism, locality, and use with a DataLoader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_folder, wait_until
from torch.utils.data import DataLoader

from mmcache import MemmapImageDataset, QuasiRandomSampler, build_cache
from mmcache import sampler as sampler_mod


def test_state_dict_records_the_position_the_sampler_reached():
    whole = _order(50, seed=3, block_size=4)
    s = QuasiRandomSampler(range(50), seed=3, block_size=4)
    s.set_epoch(0)
    it = iter(s)
    taken = [next(it) for _ in range(13)]
    state = s.state_dict()  # no argument, as torch's state_dict()
    assert state["start"] == 13 and taken == whole[:13]
    resumed = QuasiRandomSampler(range(50), seed=3, block_size=4)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["start"] == 13  # loaded, not yet iterated
    assert list(resumed) == whole[13:]
    done = resumed.state_dict()  # the epoch is done: iterating again starts the next one
    assert (done["epoch"], done["start"]) == (1, 0)
    resumed.set_epoch(0)
    assert resumed.state_dict()["start"] == 0


def _order(n: int, **kw) -> list[int]:
    return list(QuasiRandomSampler(range(n), **kw))


@pytest.mark.parametrize("n", [0, 1, 7, 64, 1000, 1001])
@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_every_index_once_per_epoch(n, block_size):
    s = QuasiRandomSampler(range(n), block_size=block_size, buffer_blocks=3, seed=1)
    for epoch in range(3):
        s.set_epoch(epoch)
        order = list(s)
        assert len(order) == len(s) == n
        assert sorted(order) == list(range(n))
        assert all(type(i) is int for i in order)


@pytest.mark.parametrize("n", [1000, 1003, 5])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_ranks_pad_to_cover_everything(n, replicas):
    parts = [
        _order(n, block_size=16, num_replicas=replicas, rank=r, seed=3) for r in range(replicas)
    ]
    per = -(-n // replicas)
    assert all(len(p) == per for p in parts)
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n))
    # Padding repeats exactly as many indices as the remainder needs, each once more.
    counts = np.bincount(flat, minlength=n)
    assert (counts >= 1).all() and counts.sum() - n == per * replicas - n
    if n % replicas == 0:
        assert (counts == 1).all()  # disjoint


@pytest.mark.parametrize("n", [1000, 1003, 5])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_ranks_drop_last_are_disjoint(n, replicas):
    parts = [
        _order(n, block_size=16, num_replicas=replicas, rank=r, drop_last=True)
        for r in range(replicas)
    ]
    assert all(len(p) == n // replicas for p in parts)
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat)  # disjoint
    assert len(set(range(n)) - set(flat)) == n % replicas


def test_deterministic_by_seed_and_epoch_and_different_each_epoch():
    a = QuasiRandomSampler(range(5000), block_size=32, seed=7)
    b = QuasiRandomSampler(range(5000), block_size=32, seed=7)
    first = list(a)
    assert list(b) == first
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first
    a.set_epoch(0)
    assert list(a) == first  # an epoch's order depends on nothing else
    assert _order(5000, block_size=32, seed=8) != first


def _sequential_share(order: list[int]) -> float:
    """Share of consecutive picks that land within 64 records of the previous one."""
    o = np.asarray(order)
    return float((np.abs(np.diff(o)) < 64).mean())


def test_reads_stay_local_unlike_a_random_order():
    n = 20_000
    order = _order(n, block_size=64, buffer_blocks=4)
    # Within a buffer of 4 blocks of 64, about a quarter of steps stay in the same block.
    assert _sequential_share(order) > 0.2
    random_order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    assert _sequential_share(random_order) < 0.02
    # Each buffer holds whole blocks: the picks between buffer starts touch at most 4 blocks,
    # also after the short last block (20000 = 312 * 64 + 32).
    _, starts = QuasiRandomSampler(range(n), block_size=64, buffer_blocks=4)._epoch()
    blocks = np.asarray(order) // 64
    bounds = [*starts.tolist(), n]
    assert len(bounds) == -(-313 // 4) + 1
    for a, z in zip(bounds[:-1], bounds[1:], strict=True):
        assert len(set(blocks[a:z].tolist())) <= 4


def test_each_rank_reads_whole_blocks():
    n, replicas = 4096, 4
    for r in range(replicas):
        order = _order(n, block_size=64, num_replicas=replicas, rank=r)
        touched = set((np.asarray(order) // 64).tolist())
        assert len(touched) == n // replicas // 64  # no block is split between ranks


def test_default_block_size_follows_record_bytes(tmp_path, monkeypatch):
    make_folder(tmp_path / "src", {"a": [(64, 32)] * 20})
    build_cache(tmp_path / "src", tmp_path / "c", workers=1)
    ds = MemmapImageDataset(tmp_path / "c")
    monkeypatch.setattr(sampler_mod, "BLOCK_BYTES", 64 * 32 * 3 * 5)
    assert QuasiRandomSampler(ds).block_size == 5
    assert QuasiRandomSampler(list(range(20))).block_size == sampler_mod.DEFAULT_BLOCK_SIZE
    assert QuasiRandomSampler(ds, block_size=3).block_size == 3


@pytest.mark.parametrize(
    "kw",
    [
        {"num_replicas": 0},
        {"num_replicas": 2, "rank": 2},
        {"rank": -1},
        {"block_size": 0},
        {"buffer_blocks": 0},
        {"seed": -1},
    ],
)
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        QuasiRandomSampler(range(10), **kw)


def test_with_a_dataloader_and_workers(tmp_path):
    make_folder(tmp_path / "src", {"a": [(16, 8)] * 30, "b": [(16, 8)] * 30})
    build_cache(tmp_path / "src", tmp_path / "c", workers=1)
    ds = MemmapImageDataset(tmp_path / "c")
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2, seed=5)
    loader = DataLoader(ds, batch_size=8, sampler=s, num_workers=2)
    labels = torch.cat([y for _, y in loader])
    assert len(labels) == 60 and labels.sum() == 30
    # The batches follow the sampler's order (prefetching does not change it).
    expected = torch.tensor([ds.targets[i] for i in s.indices()])
    assert torch.equal(labels, expected)
    # Breaking off an epoch closes the prefetcher cleanly; the next epoch is whole.
    it = iter(s)
    next(it)
    it.close()
    assert sorted(s) == list(range(60))


@pytest.mark.xdist_group("page-cache")  # waits for pages to become resident
def test_prefetch_reads_the_next_buffer(tmp_path):
    from test_residency import _evicted, _fs_type

    from mmcache import cache_info

    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("on tmpfs a file's pages cannot be evicted")
    make_folder(tmp_path / "src", {"a": [(128, 96)] * 64})
    build_cache(tmp_path / "src", tmp_path / "c", workers=1)
    ds = MemmapImageDataset(tmp_path / "c")
    _evicted(tmp_path / "c")
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2)
    it = iter(s)
    next(it)  # starts reading buffers 0 and 1 (16 records) in a thread; no pixels read here
    # Nothing else reads this file, so pages can only come from the sampler's read-ahead.
    wanted = 16 * 128 * 96 * 3
    wait_until(
        lambda: cache_info(tmp_path / "c", check_stale=False).resident_bytes >= wanted,
        "the records read ahead to become resident",
    )
    it.close()


def _spy_reads(monkeypatch, data_path):
    """Record what is asked of the data file through descriptors opened after this call:
    ("read", offset, length) for preadv and WILLNEED, ("drop", offset, length) for DONTNEED."""
    import os

    seen, fds = [], set()
    real_open, real_preadv, real_fadvise = os.open, os.preadv, os.posix_fadvise

    def spy_open(path, *a, **kw):
        fd = real_open(path, *a, **kw)
        # Compared by the descriptor: a cache file is opened by its name relative to a
        # descriptor of its folder (dir_fd), not by its path.
        st, data = os.fstat(fd), os.stat(data_path)
        if (st.st_dev, st.st_ino) == (data.st_dev, data.st_ino):
            fds.add(fd)
        return fd

    def spy_preadv(fd, buffers, offset):
        if fd in fds:
            seen.append(("read", offset, sum(memoryview(b).nbytes for b in buffers)))
        return real_preadv(fd, buffers, offset)

    def spy_fadvise(fd, offset, length, advice):
        if fd in fds and advice in (os.POSIX_FADV_WILLNEED, os.POSIX_FADV_DONTNEED):
            kind = "read" if advice == os.POSIX_FADV_WILLNEED else "drop"
            seen.append((kind, offset, length))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "preadv", spy_preadv)
    monkeypatch.setattr(os, "posix_fadvise", spy_fadvise)
    return seen


def _records_touched(seen, kind, ds) -> set[int]:
    """Records that the ``kind`` requests in ``seen`` cover whole."""
    offsets, sizes = ds.reader.records.offsets, ds.reader.records.nbytes
    touched = set()
    for what, offset, length in list(seen):
        if what == kind:
            inside = (offsets >= offset) & (offsets + sizes <= offset + length)
            touched |= set(np.flatnonzero(inside).tolist())
    return touched


@pytest.fixture
def blocks_cache(tmp_path):
    """64 records of 36 KiB: with blocks of 4 and buffers of 2 blocks, 8 buffers of 8."""
    make_folder(tmp_path / "src", {"a": [(128, 96)] * 64})
    build_cache(tmp_path / "src", tmp_path / "c", workers=1)
    return MemmapImageDataset(tmp_path / "c")


def _buffers(sampler) -> list[set[int]]:
    order, starts = sampler._epoch()
    bounds = [*starts.tolist(), len(order)]
    return [set(order[a:z].tolist()) for a, z in zip(bounds[:-1], bounds[1:], strict=True)]


def test_read_ahead_follows_the_batch_loader_not_the_whole_epoch(blocks_cache, monkeypatch):
    from mmcache import BatchLoader

    ds = blocks_cache
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2, seed=3)
    buffers = _buffers(s)
    seen = _spy_reads(monkeypatch, ds.reader.data_path)
    # read="mmap": the loader's own copies make no request, so every request is read-ahead.
    # One thread, one batch ahead: the first batch fills, the threads stay in buffer 0.
    loader = BatchLoader(ds, 2, sampler=s, num_threads=1, prefetch=1, read="mmap")
    it = iter(loader)
    images, _ = next(it)
    wait_until(lambda: buffers[0] <= _records_touched(seen, "read", ds), "buffer 0 read")
    # BatchLoader takes the epoch's order at once; its read-ahead must still go no further
    # than the buffer after the one the threads are in, not read the whole epoch up front.
    assert _records_touched(seen, "read", ds) <= buffers[0] | buffers[1]
    rest = [x.clone() for x, _ in it]
    assert len(rest) == 31 and images.shape == (2, 96, 128, 3)
    assert _records_touched(seen, "read", ds) == set(range(64))  # every buffer in its turn


def test_a_consumer_waits_for_its_buffer_to_be_read(blocks_cache, monkeypatch):
    import os
    import threading

    from mmcache.sampler import ReadAhead

    ds = blocks_cache
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2, seed=3)
    order, starts = s._epoch()
    release = threading.Event()
    real_preadv = os.preadv

    def slow_preadv(fd, buffers, offset):
        release.wait(60)  # the disk is slow until the test says otherwise
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    records = ds.reader.records
    ahead = ReadAhead(str(ds.reader.data_path), records.offsets, records.nbytes, order, starts)
    waited = threading.Event()

    def consumer():
        ahead.reached(0)
        ahead.wait(0)
        waited.set()

    t = threading.Thread(target=consumer)
    t.start()
    assert not waited.wait(0.5)  # buffer 0 is not read yet: the consumer waits for it
    release.set()
    wait_until(waited.is_set, "the wait to end once buffer 0 is read")
    t.join()
    ahead.wait(starts[-1])  # a buffer never asked for is not waited for
    ahead.close()


@pytest.mark.parametrize("fits", [True, False])
def test_consumed_buffers_are_dropped_only_when_the_cache_does_not_fit(
    blocks_cache, monkeypatch, fits
):
    from mmcache.residency import Memory

    ds = blocks_cache
    data = int(ds.manifest.sizes["data"])  # 64 records of 36,864 bytes: 2.4 MB
    buffer = 8 * 128 * 96 * 3
    # Not fitting: RAM for 7.6 buffers of the 8. Reading ahead may use 80% of it: three
    # buffers in use (the previous, the current, the next) and the epoch's last three, kept.
    available = 10 * data if fits else int(7.6 * buffer)
    monkeypatch.setattr(sampler_mod, "memory", lambda: Memory(2 * available, available))
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2, seed=3)
    buffers = _buffers(s)
    seen = _spy_reads(monkeypatch, ds.reader.data_path)
    it = iter(s)
    order = [next(it) for _ in range(len(s))]  # the whole epoch, the iteration still open
    assert sorted(order) == list(range(64))
    if fits:
        wait_until(lambda: _records_touched(seen, "read", ds) == set(range(64)), "all read")
        assert _records_touched(seen, "drop", ds) == set()
    else:
        assert available < data and 3 * buffer <= 0.8 * available - 3 * buffer < 4 * buffer
        dropped = set().union(*buffers[:5])  # the last three are kept for the next epoch
        wait_until(lambda: _records_touched(seen, "drop", ds) == dropped, "the drops")
        assert not _records_touched(seen, "drop", ds) & set().union(*buffers[5:])
    it.close()


def test_read_ahead_reads_only_the_current_buffer_when_two_do_not_fit(blocks_cache, monkeypatch):
    from mmcache.residency import Memory

    ds = blocks_cache
    buffer = 8 * 128 * 96 * 3
    available = int(1.5 * buffer / 0.8)  # reading ahead may use 1.5 buffers of it
    monkeypatch.setattr(sampler_mod, "memory", lambda: Memory(10 * available, available))
    s = QuasiRandomSampler(ds, block_size=4, buffer_blocks=2, seed=3)
    buffers = _buffers(s)
    seen = _spy_reads(monkeypatch, ds.reader.data_path)
    it = iter(s)
    next(it)
    wait_until(lambda: buffers[0] <= _records_touched(seen, "read", ds), "buffer 0 read")
    assert _records_touched(seen, "read", ds) == buffers[0]  # not the next: it would not fit
    it.close()
