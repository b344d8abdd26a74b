"""BatchLoader: every record once per epoch, exact pixels, the buffer contract, threads, errors."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_folder
from torch.utils.data import DistributedSampler, RandomSampler

from mmcache import (
    BatchLoader,
    CacheFormatError,
    DecodeError,
    MemmapImageDataset,
    MixedShapesError,
    build_cache,
)
from mmcache import format as fmt
from mmcache.residency import Memory

N = 24


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """24 images of 32x24 in two classes, each image's pixels distinct (seeded noise)."""
    root = tmp_path_factory.mktemp("loader")
    src = make_folder(root / "src", {"a": [(32, 24)] * 14, "b": [(32, 24)] * 10})
    build_cache(src, root / "cache", workers=1)
    return root / "cache"


@pytest.fixture
def ds(cache):
    return MemmapImageDataset(cache)


def _which(ds):
    """Record index by pixel bytes: finds out which record each yielded row is."""
    return {ds[i][0].tobytes(): i for i in range(len(ds))}


def _collect(loader, ds):
    """Indices of the rows yielded, in order; checks each row's pixels and label on the way."""
    which = _which(ds)
    seen, sizes = [], []
    for images, labels in loader:
        assert images.dtype == torch.uint8 and labels.dtype == torch.int64
        assert images.shape[1:] == (24, 32, 3) and len(images) == len(labels)
        sizes.append(len(images))
        for row, label in zip(images, labels.tolist(), strict=True):
            i = which[row.numpy().tobytes()]
            assert label == ds.targets[i]
            seen.append(i)
    return seen, sizes


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_every_record_once_per_epoch(ds, shuffle, num_threads):
    loader = BatchLoader(ds, batch_size=5, shuffle=shuffle, num_threads=num_threads, seed=1)
    seen, sizes = _collect(loader, ds)
    assert sorted(seen) == list(range(N))
    assert sizes == [5, 5, 5, 5, 4] and len(loader) == 5  # the last, partial batch is kept
    if not shuffle:
        assert seen == list(range(N))


def test_drop_last(ds):
    loader = BatchLoader(ds, batch_size=5, shuffle=True, drop_last=True)
    seen, sizes = _collect(loader, ds)
    assert sizes == [5, 5, 5, 5] and len(loader) == 4
    assert len(set(seen)) == 20


@pytest.mark.parametrize("read", ["auto", "mmap", "pread"])
def test_pixels_equal_the_dataset_in_order(ds, read):
    batches = [(x.clone(), y.clone()) for x, y in BatchLoader(ds, 7, num_threads=2, read=read)]
    images, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    for i in range(N):
        assert np.array_equal(images[i].numpy(), ds[i][0])
    assert labels.tolist() == ds.targets


def test_channels_last_without_normalize_gives_the_uint8_images_as_an_nchw_view(ds):
    images, labels = next(iter(BatchLoader(ds, 5, channels_last=True)))
    assert images.dtype == torch.uint8 and images.shape == (5, 3, 24, 32)
    assert images.is_contiguous(memory_format=torch.channels_last)  # a view: no copy
    for j in range(5):
        assert np.array_equal(images[j].permute(1, 2, 0).numpy(), ds[j][0])
    assert labels.tolist() == ds.targets[:5]


def test_seeded_shuffle_is_repeatable_and_changes_with_the_epoch(ds):
    def order(epoch, seed=3):
        loader = BatchLoader(ds, 8, shuffle=True, seed=seed)
        loader.set_epoch(epoch)
        return _collect(loader, ds)[0]

    assert order(0) == order(0) != order(1)
    assert sorted(order(1)) == list(range(N))


def test_any_iterable_of_indices_as_sampler(ds):
    picks = [5, 3, 3, 23, 0]
    seen, sizes = _collect(BatchLoader(ds, 2, sampler=picks), ds)
    assert seen == picks and sizes == [2, 2, 1]
    seen, _ = _collect(BatchLoader(ds, 4, sampler=RandomSampler(ds)), ds)
    assert sorted(seen) == list(range(N))


def test_distributed_sampler_halves_are_disjoint_and_complete(ds):
    halves = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        loader = BatchLoader(ds, 5, sampler=sampler)
        loader.set_epoch(2)  # forwarded to the sampler
        assert sampler.epoch == 2
        halves.append(_collect(loader, ds)[0])
    assert len(halves[0]) == len(halves[1]) == N // 2
    assert not set(halves[0]) & set(halves[1])
    assert sorted(halves[0] + halves[1]) == list(range(N))


def test_quasi_random_sampler_drives_the_batch_loader(ds):
    from mmcache import QuasiRandomSampler

    sampler = QuasiRandomSampler(ds, block_size=4, seed=2, buffer_blocks=2)
    loader = BatchLoader(ds, 5, sampler=sampler)
    first, _ = _collect(loader, ds)
    loader.set_epoch(1)
    second, _ = _collect(loader, ds)
    assert sorted(first) == sorted(second) == list(range(N))
    assert first == list(sampler.__class__(ds, block_size=4, seed=2, buffer_blocks=2))
    assert first != second


def test_a_batch_kept_past_the_ring_stays_as_it_was(ds):
    # prefetch=1: a ring of 3 buffers; batch 3 would be filled into batch 0's buffer.
    it = iter(BatchLoader(ds, 4, prefetch=1, num_threads=2))
    kept, labels = next(it)
    view = kept[1:3].numpy()  # a view of part of it counts as holding it too
    original = [ds[i][0] for i in range(4)]
    for _ in range(3):
        next(it)
    assert all(np.array_equal(kept[j].numpy(), original[j]) for j in range(4))
    assert labels.tolist() == ds.targets[:4]
    del kept, labels
    for _ in range(2):  # the last two batches (6 in all)
        next(it)
    assert np.array_equal(view, np.stack(original[1:3]))
    it.close()


@pytest.fixture
def loader_threads():
    """The BatchLoader copying threads this test started that are still alive: threads named
    mmcache-BatchLoader-*, not there when the test began. Nobody else's threads count (torch's
    queue feeders, a warming thread of another test, come and go on their own schedule)."""

    def named() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("mmcache-BatchLoader-")}

    before = named()
    return lambda: sorted(t.name for t in named() - before if t.is_alive())


def _gone_within(alive, seconds: float = 30) -> bool:
    """Whether ``alive()`` is empty within ``seconds``, collecting garbage meanwhile (a dropped
    iterator is stopped by its finalizer, when the collector reaches it)."""
    deadline = time.monotonic() + seconds
    while alive():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.01)
    return True


def test_threads_stop_on_break_exception_and_garbage_collection(ds, loader_threads):
    loader = BatchLoader(ds, 2, num_threads=3, prefetch=2)
    for _ in loader:
        assert len(loader_threads()) == 3
        break
    # break and an exception end the iteration, and stopping joins the threads before it
    # returns: nothing to wait for
    assert loader_threads() == []

    with pytest.raises(KeyError):
        for _ in loader:
            raise KeyError("in the training step")
    assert loader_threads() == []

    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 3
    del it
    gc.collect()
    assert _gone_within(loader_threads)

    assert sum(len(b[1]) for b in loader) == N  # a full epoch ends its threads too
    assert loader_threads() == []


def test_a_new_iteration_ends_the_previous_one(ds, loader_threads):
    loader = BatchLoader(ds, 4)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(RuntimeError, match="newer iteration"):
        next(first)
    assert sum(len(b[1]) for b in second) == N
    del first, second
    assert _gone_within(loader_threads)


def _mark_bad(cache, record):
    m = json.loads((cache / "manifest.json").read_text())
    state = np.fromfile(cache / m["files"]["state"], dtype=fmt.STATE_DTYPE)
    state["state"][record] = fmt.BAD_UNDECODABLE
    state.tofile(cache / m["files"]["state"])


def test_a_bad_record_raises_the_dataset_error_from_the_thread(tmp_path, loader_threads):
    src = make_folder(tmp_path / "src", {"a": [(16, 8)] * 12})
    build_cache(src, tmp_path / "cache", workers=1)
    _mark_bad(tmp_path / "cache", 9)
    ds = MemmapImageDataset(tmp_path / "cache")
    with pytest.raises(DecodeError, match="img_009.jpg: a damaged or truncated JPEG file"):
        ds[9]
    it = iter(BatchLoader(ds, 4, num_threads=2))
    assert len(next(it)[0]) == 4  # batches before the bad record come through
    with pytest.raises(DecodeError, match="img_009.jpg: a damaged or truncated JPEG file"):
        for _ in it:
            pass
    assert loader_threads() == []  # the error stopped and joined them
    with pytest.raises(RuntimeError, match="stopped on an error"):
        next(it)


def test_an_unexpected_error_in_a_thread_reaches_the_consumer(ds, loader_threads):
    class Boom(Exception):
        pass

    def explode():
        raise Boom("from the copying thread")

    loader = BatchLoader(ds, 4, sampler=(explode() if i == 9 else i for i in range(N)))
    with pytest.raises(Boom):  # raised while the order is drawn, in the caller
        iter(loader)

    ds2 = MemmapImageDataset(ds.cache)
    broken = BatchLoader(ds2, 4)
    # breaks the copy inside the threads, not the construction
    ds2.reader.records = dataclasses.replace(ds2.reader.records, offsets=None)
    with pytest.raises(TypeError):
        list(broken)
    assert loader_threads() == []


def test_arguments_after_batch_size_are_keyword_only(ds):
    with pytest.raises(TypeError, match="positional"):
        BatchLoader(ds, 4, True)  # shuffle? sampler? a reader cannot tell
    assert BatchLoader(ds, 4, shuffle=True).shuffle


def test_a_cache_of_several_shapes_is_refused(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "mixed", workers=1)
    found = r"one shape \(H x W x C\), found 4: 17x33x3 \(3 images\), "
    with pytest.raises(MixedShapesError, match=found) as e:
        BatchLoader(MemmapImageDataset(tmp_path / "mixed"), 4)
    assert "64x48x3 (3 images)" in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("available, preads", [(10**12, 0), (1000, N)])
def test_auto_reads_with_pread_only_when_the_cache_does_not_fit_in_ram(
    ds, monkeypatch, available, preads
):
    import mmcache.loader

    calls = []
    real_preadv = os.preadv

    def counting_preadv(fd, buffers, offset):
        calls.append(offset)
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(mmcache.loader, "memory", lambda: Memory(2 * available, available))
    monkeypatch.setattr(os, "preadv", counting_preadv)
    batches = [x.clone() for x, _ in BatchLoader(ds, 5, read="auto")]
    assert len(calls) == preads  # the data file is 55 KB: it "fits" in 10**12 bytes, not 1000
    monkeypatch.undo()
    assert all(np.array_equal(torch.cat(batches)[i].numpy(), ds[i][0]) for i in range(N))


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_shuffled_order_is_read_without_the_kernel_s_read_ahead(ds, monkeypatch, shuffle):
    # The kernel takes a read whose preceding record is cached for a sequential stream and
    # reads ahead records a shuffled order does not want yet; a sequential order wants them.
    advised, real_fadvise = [], os.posix_fadvise

    def spy(fd, offset, length, advice):
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), advice))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    loader = BatchLoader(ds, 5, shuffle=shuffle, seed=0, read="pread")
    seen, _ = _collect(loader, ds)
    monkeypatch.undo()
    assert sorted(seen) == list(range(N))  # the right pixels, read either way
    random_reads = [path for path, advice in advised if advice == os.POSIX_FADV_RANDOM]
    assert random_reads == ([str(ds.reader.data_path)] if shuffle else [])


@pytest.mark.parametrize("shuffle", [False, True])  # True: through a descriptor of its own
def test_a_data_file_truncated_under_a_pread_loader_is_a_clear_error(cache, tmp_path, shuffle):
    shutil.copytree(cache, tmp_path / "cache")
    ds = MemmapImageDataset(tmp_path / "cache")
    ds[0]  # opens and maps the data file
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    data = tmp_path / "cache" / m["files"]["data"]
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CacheFormatError, match="is cut short: the file was truncated") as e:
        list(BatchLoader(ds, 4, read="pread", shuffle=shuffle, seed=0))
    assert str(data) in str(e.value)


TRUNCATE_SCRIPT = """
import os, shutil, sys, time
from mmcache import BatchLoader, CacheFormatError, CenterResizedCrop, MemmapImageDataset
cache, work, read = sys.argv[1:]
for case in ("during", "new iteration"):
    for crop in (None, CenterResizedCrop(16)):
        copy = os.path.join(work, f"{case}-{crop is not None}")
        shutil.copytree(cache, copy)
        ds = MemmapImageDataset(copy)
        loader = BatchLoader(ds, 2, read=read, crop=crop, num_threads=1, prefetch=1)
        it = iter(loader)
        next(it)  # the data file is mapped and read
        # Truncate between batches: while the thread copies one (here batch 1, prefetched),
        # a truncation is still SIGBUS (BatchLoader's docstring: read=), which this test is not.
        deadline = time.monotonic() + 60
        while 1 not in it._shared.ready:
            assert time.monotonic() < deadline, "batch 1 was never prefetched"
            time.sleep(0.01)
        os.truncate(ds.reader.data_path, 0)
        if case == "new iteration":
            it = iter(loader)
        done = 0
        try:
            for _ in it:
                done += 1
        except CacheFormatError as e:
            assert str(ds.reader.data_path) in str(e) and "cut short" in str(e), e
        else:
            raise AssertionError(f"{case}, crop {crop}: no error")
        assert done <= 1, (case, crop, done)  # at most the batch filled before the truncation
print("ok")
"""


@pytest.mark.parametrize("read", ["auto", "mmap"])
def test_a_data_file_truncated_under_a_mapped_loader_is_an_error_not_sigbus(cache, tmp_path, read):
    # In a child process: a SIGBUS kills the process running the loader.
    script = tmp_path / "truncate.py"
    script.write_text(TRUNCATE_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), str(cache), str(tmp_path), read],
        capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert run.returncode == 0, (run.returncode, run.stderr)
    assert run.stdout.strip() == "ok"


def test_bad_arguments(ds):
    with pytest.raises(ValueError, match="read must be 'auto', 'mmap' or 'pread'"):
        BatchLoader(ds, 4, read="mapped")
    with pytest.raises(ValueError, match="mutually exclusive"):
        BatchLoader(ds, 4, shuffle=True, sampler=range(3))
    with pytest.raises(ValueError, match=">= 1"):
        BatchLoader(ds, 0)
    with pytest.raises(ValueError, match="transform"):
        BatchLoader(MemmapImageDataset(ds.cache, transform=np.flipud), 4)
    with pytest.raises(IndexError, match="index 24, outside 0..23"):
        iter(BatchLoader(ds, 4, sampler=[0, 24]))


@pytest.mark.without_cuda
@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the fallback without CUDA")
def test_pin_memory_without_cuda_falls_back_to_pageable_buffers(ds):
    with pytest.warns(UserWarning, match="pin_memory=True but CUDA is not available"):
        loader = BatchLoader(ds, 8, pin_memory=True)
    assert loader.pin_memory is False
    images, _ = next(iter(loader))
    assert not images.is_pinned() and np.array_equal(images[0].numpy(), ds[0][0])
    with pytest.raises(ValueError, match="CUDA is not available"):
        BatchLoader(ds, 8, device="cuda")


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory, a GPU)")
def test_pinned_buffers_and_asynchronous_copy_to_cuda(ds):
    images, _ = next(iter(BatchLoader(ds, 8, pin_memory=True)))
    assert images.is_pinned()
    loader = BatchLoader(ds, 5, shuffle=True, device="cuda", num_threads=2)
    kept = []
    for images, labels in loader:
        assert images.is_cuda and labels.is_cuda
        kept.append((images, labels))  # device batches are fresh tensors: keeping them is safe
    images = torch.cat([k[0] for k in kept]).cpu()
    labels = torch.cat([k[1] for k in kept]).cpu()
    which = _which(ds)
    seen = [which[row.numpy().tobytes()] for row in images]
    assert sorted(seen) == list(range(N))
    assert labels.tolist() == [ds.targets[i] for i in seen]


def test_counter_of_records_with_threads_and_prefetch(ds):
    # Many small batches, several threads, a deep and a shallow ring: still each record once.
    for prefetch in (1, 4):
        seen, _ = _collect(BatchLoader(ds, 1, shuffle=True, num_threads=4, prefetch=prefetch), ds)
        assert Counter(seen) == Counter(range(N))
