"""One BatchLoader iteration (``mmcache._iteration``): its length is the batches left, it starts
no more threads than batches, ends them and what it opened, hands out the first failing batch's
error, and reads a shuffled order through a descriptor advised for random reads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_folder, wait_until

from mmcache import BatchLoader, DecodeError, MemmapImageDataset, RandomResizedCrop, build_cache
from mmcache import format as fmt
from mmcache._iteration import random_reader


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """10 images of 8 x 8: batches of 4 are 4, 4 and 2 images."""
    root = tmp_path_factory.mktemp("iteration")
    build_cache(make_folder(root / "src", {"a": [(8, 8)] * 10}), root / "cache", workers=0)
    return root / "cache"


@pytest.fixture
def ds(cache: Path) -> MemmapImageDataset:
    return MemmapImageDataset(cache)


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_an_iteration_s_length_is_the_batches_it_has_left_to_hand_out(ds):
    it = iter(BatchLoader(ds, 4, num_threads=2))
    assert len(it) == 3
    for left in (2, 1, 0):
        next(it)
        assert len(it) == left
    for _ in range(2):  # over, and it stays over
        with pytest.raises(StopIteration):
            next(it)


def test_a_resumed_iteration_hands_out_the_batches_after_the_state_s(ds):
    loader = BatchLoader(ds, 4)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batches"] == 1
    state = loader.state_dict()
    it.close()
    resumed = BatchLoader(MemmapImageDataset(ds.cache), 4)
    resumed.load_state_dict(state)
    rest = iter(resumed)
    assert len(rest) == 2
    sizes = [len(images) for images, _ in rest]
    assert sizes == [4, 2]
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batches"] == 0


def test_a_state_past_the_epoch_s_end_resumes_an_empty_iteration(ds):
    loader = BatchLoader(ds, 4)
    state = {**loader.state_dict(), "batches": 7}
    loader.load_state_dict(state)
    it = iter(loader)
    assert len(it) == 0
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("threads, batches, started", [(8, 3, 3), (2, 3, 2), (4, 0, 1)])
def test_an_iteration_starts_no_more_threads_than_batches_to_fill(
    ds, monkeypatch, threads, batches, started
):
    import mmcache._iteration as iteration

    made = []
    monkeypatch.setattr(iteration.threading, "Thread", _recording(iteration.threading, made))
    sampler = list(range(min(batches * 4, 10)))
    it = iter(BatchLoader(ds, 4, num_threads=threads, sampler=sampler))
    assert [t.name for t in made] == [f"mmcache-BatchLoader-{k}" for k in range(started)]
    assert all(t.daemon for t in made)  # none keeps the process from exiting
    assert sum(len(labels) for _, labels in it) == len(sampler)
    assert not any(t.is_alive() for t in made)  # the end of the iteration joined them


def test_the_end_of_a_shuffled_iteration_closes_its_own_descriptor(ds):
    loader = BatchLoader(ds, 4, shuffle=True, seed=0, read="pread")
    assert sum(len(labels) for _, labels in loader) == 10  # the dataset's own files opened
    before = _descriptors()
    it = iter(loader)
    (own,) = _descriptors() - before  # advised for random reads
    assert os.readlink(f"/proc/self/fd/{own}") == str(ds.reader.data_path)
    assert sum(len(labels) for _, labels in it) == 10
    assert _descriptors() == before
    it = iter(loader)
    next(it)
    it.close()
    assert _descriptors() == before


def test_a_closed_iteration_raises_the_reason_it_was_closed_for(ds):
    it = iter(BatchLoader(ds, 4))
    next(it)
    it.close("closed for a reason of the test's")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="^closed for a reason of the test's$"):
            next(it)
    plain = iter(BatchLoader(ds, 4))
    plain.close()  # without a reason: what is left is not handed out, nor an error
    assert len(plain) == 3


def _mark_bad(cache: Path, records: list[int]) -> None:
    m = fmt.read_manifest(cache)
    state = np.fromfile(m.file("state"), dtype=fmt.STATE_DTYPE)
    state["state"][records] = fmt.BAD_UNDECODABLE
    state.tofile(m.file("state"))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_of_two_failing_batches_the_first_one_s_error_is_raised_after_the_batches_before(
    tmp_path, threads
):
    cache = tmp_path / "cache"
    build_cache(make_folder(tmp_path / "src", {"a": [(8, 8)] * 12}), cache, workers=0)
    _mark_bad(cache, [5, 9])  # in batches 1 and 2 of 4 images each
    it = iter(BatchLoader(MemmapImageDataset(cache), 4, num_threads=threads))
    assert len(next(it)[1]) == 4
    with pytest.raises(DecodeError, match="img_005.jpg"):
        next(it)
    with pytest.raises(RuntimeError, match="^BatchLoader: this iteration stopped on an error$"):
        next(it)


def test_with_views_and_params_each_batch_hands_out_each_view_s_boxes_and_flips(ds):
    views = [(RandomResizedCrop(4), 1), (RandomResizedCrop(2), 1)]
    loader = BatchLoader(ds, 4, views=views, flip=True, return_params=True, seed=0)
    shapes = []
    for images, params, labels in loader:
        shapes.append(([tuple(v.shape) for v in images], [tuple(p.shape) for p in params],
                       len(labels)))  # fmt: skip
        for top, left, height, width, flip in torch.cat(params).tolist():
            assert 0 <= top < top + height <= 8 and 0 <= left < left + width <= 8
            assert flip in (0, 1)
    assert shapes == [([(n, 4, 4, 3), (n, 2, 2, 3)], [(n, 5), (n, 5)], n) for n in (4, 4, 2)]


class _Reader:
    def __init__(self, path: Path) -> None:
        self.data_path = path


# (the order, whether it is read as a random one: fewer than half its steps forward by 1 to 8)
ORDERS = {
    "in order": (np.arange(20), False),
    "a stride of 8": (np.arange(0, 160, 8), False),
    "a stride of 9": (np.arange(0, 180, 9), True),
    "backwards": (np.arange(20)[::-1], True),
    "the same record again and again": (np.zeros(10, np.int64), True),
    "half its 10 steps forward": (np.array([1, 0] * 5 + [1]), False),
    "4 of its 9 steps forward": (np.array([1, 0] * 5), True),
    "two records backwards": (np.array([1, 0]), True),
    "one record": (np.array([3]), False),
    "no record": (np.array([], np.int64), False),
}


@pytest.mark.parametrize("case", list(ORDERS))
def test_only_an_order_mostly_not_forward_is_read_through_a_random_access_descriptor(
    tmp_path, monkeypatch, case
):
    order, random = ORDERS[case]
    data = tmp_path / "data.bin"
    data.write_bytes(b"d" * 64)
    advised, real = [], os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda *a: (advised.append(a[1:]), real(*a))[1])
    before = _descriptors()
    fd = random_reader(_Reader(data), order)
    if not random:
        assert fd == -1 and advised == [] and _descriptors() == before
        return
    try:
        assert os.readlink(f"/proc/self/fd/{fd}") == str(data)
        assert advised == [(0, 0, os.POSIX_FADV_RANDOM)]
        assert os.pread(fd, 4, 0) == b"dddd"
    finally:
        os.close(fd)


def test_without_the_advice_or_the_data_file_a_shuffled_order_uses_the_reader_s(
    tmp_path, monkeypatch
):
    data = tmp_path / "data.bin"
    data.write_bytes(b"d" * 64)
    order = np.arange(20)[::-1]
    before = _descriptors()
    assert random_reader(_Reader(tmp_path / "gone.bin"), order) == -1

    def refused(*args):
        raise OSError(22, "not on this file system")

    monkeypatch.setattr(os, "posix_fadvise", refused)
    assert random_reader(_Reader(data), order) == -1
    assert _descriptors() == before  # the descriptor it opened was closed
    monkeypatch.delattr(os, "posix_fadvise")
    assert random_reader(_Reader(data), order) == -1
    assert _descriptors() == before


def test_a_resumed_iteration_starts_no_more_threads_than_the_batches_it_has_left(ds, monkeypatch):
    import mmcache._iteration as iteration

    made = []
    monkeypatch.setattr(iteration.threading, "Thread", _recording(iteration.threading, made))
    loader = BatchLoader(ds, 4, num_threads=4)
    loader.load_state_dict({**loader.state_dict(), "batches": 2})  # of 3: one left
    assert [len(labels) for _, labels in loader] == [2]
    assert [t.name for t in made] == ["mmcache-BatchLoader-0"]


def _recording(threading, made: list):
    """A Thread class that appends each thread it makes to ``made``."""

    class Recorded(threading.Thread):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    return Recorded


def test_while_batch_0_is_held_the_threads_fill_the_prefetch_batches_after_it(ds, monkeypatch):
    # prefetch=3: batches 1 to 3 are filled ahead of the one held, and no more until the
    # consumer asks for the next; then one more each time.
    import mmcache._iteration as iteration

    filled = []
    real_fill = iteration.fill
    monkeypatch.setattr(iteration, "fill", lambda job, slot, number, *a: filled.append(number)
                        or real_fill(job, slot, number, *a))  # fmt: skip
    it = iter(BatchLoader(ds, 1, num_threads=2, prefetch=3))
    next(it)
    wait_until(lambda: len(filled) >= 4, "batches 0 to 3 filled")
    assert sorted(filled) == [0, 1, 2, 3]
    next(it)
    wait_until(lambda: len(filled) >= 5, "batch 4 filled")
    assert sorted(filled) == [0, 1, 2, 3, 4]
    assert len(list(it)) == 8 and sorted(filled) == list(range(10))


def test_an_error_before_a_thread_takes_a_batch_is_raised_by_the_first_next(ds, monkeypatch):
    import mmcache._iteration as iteration

    def no_scratch():
        raise MemoryError("no scratch buffers")

    monkeypatch.setattr(iteration, "Scratch", no_scratch)
    it = iter(BatchLoader(ds, 4, num_threads=1))
    raised: list[BaseException] = []

    def consume():
        try:
            next(it)
        except BaseException as e:
            raised.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(60)  # (it would wait for ever for batch 0 if the error were not its)
    assert [type(e) for e in raised] == [MemoryError] and str(raised[0]) == "no scratch buffers"


def test_stop_run_by_a_filling_thread_joins_the_others_but_not_itself():
    # The finalizer that stops an iteration runs wherever the garbage collector finds it
    # unreachable: possibly in one of its own filling threads.
    from types import SimpleNamespace

    from mmcache._iteration import Shared, stop

    shared = Shared(0)
    other = threading.Thread(target=lambda: None)
    other.start()
    errors = []

    def in_a_filling_thread():
        try:
            job = SimpleNamespace(read_ahead=None, fd=-1)
            stop(shared, [threading.current_thread(), other], job)
        except BaseException as e:
            errors.append(e)

    me = threading.Thread(target=in_a_filling_thread)
    me.start()
    me.join(60)
    assert errors == [] and shared.stop and not other.is_alive()


def test_a_sampler_s_read_ahead_is_told_each_batch_s_first_and_last_position(ds):
    calls = []

    class ReadAhead:
        def reached(self, position):
            calls.append(("reached", position))

        def wait(self, position):
            calls.append(("wait", position))

        def close(self):
            calls.append(("close",))

    class Sampler:
        order = [9, 0, 8, 1, 7, 2, 6, 3, 5, 4]

        def __len__(self):
            return len(self.order)

        def __iter__(self):
            return iter(self.order)

        def take_epoch(self):
            return self.order, ReadAhead()

    loader = BatchLoader(ds, 4, num_threads=1, sampler=Sampler())
    assert [labels.tolist() for _, labels in loader] == [[0] * 4, [0] * 4, [0] * 2]
    told = [(what, position) for what, position in calls[:-1]]
    # batch k: its first position reached and waited for, then its last
    assert told == [(what, p) for first, last in ((0, 3), (4, 7), (8, 9)) for p in (first, last)
                    for what in ("reached", "wait")]  # fmt: skip
    assert calls[-1] == ("close",)  # once, when the iteration ends
