"""Several views of each image (SSL multi-crop): BatchLoader(views=...) and the MultiCrop
transform, on RGB and yuv420 caches of mixed shapes."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch
from conftest import make_folder
from torch.utils.data import DataLoader

from mmcache import BatchLoader, MemmapImageDataset, MultiCrop, RandomResizedCrop, build_cache

SIZES = [(48, 40), (40, 52), (44, 44)]  # (width, height), mixed
N = 12


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("views")
    src = make_folder(root / "src", {c: SIZES * 2 for c in ("ant", "bee")})
    build_cache(src, root / "rgb", workers=0)
    build_cache(src, root / "yuv420", workers=0, pixels="yuv420")
    return root


def views_of():
    """Two global views and three local ones, each a crop of its own size."""
    return [(RandomResizedCrop(24, scale=(0.3, 1.0)), 2),
            (RandomResizedCrop(12, scale=(0.05, 0.3)), 3)]  # fmt: skip


def epoch(loader):
    out = []
    for step in loader:
        out.append([[v.clone() for v in part] if isinstance(part, list) else part.clone()
                    for part in step])  # fmt: skip
    return out


def same(a, b):
    """Whether two epochs hold the same tensors."""
    flat = [[*s[0], *(s[1] if len(s) == 3 else []), s[-1]] for s in a]
    other = [[*s[0], *(s[1] if len(s) == 3 else []), s[-1]] for s in b]
    return len(flat) == len(other) and all(
        len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(flat, other, strict=True)
    )


def test_views_come_in_order_with_their_shapes_and_the_labels(caches):
    ds = MemmapImageDataset(caches / "rgb")
    loader = BatchLoader(ds, 5, shuffle=True, seed=0, views=views_of(), flip=True)
    steps = list(loader)
    assert len(steps) == 3
    for views, labels in steps:
        n = len(labels)
        assert [tuple(v.shape) for v in views] == [(n, 24, 24, 3)] * 2 + [(n, 12, 12, 3)] * 3
    # normalize and channels_last apply to every view
    floats = BatchLoader(ds, 4, views=views_of(), normalize=((0.5,) * 3, (0.25,) * 3),
                         channels_last=True, seed=0)  # fmt: skip
    views, _ = next(iter(floats))
    assert [tuple(v.shape) for v in views] == [(4, 3, 24, 24)] * 2 + [(4, 3, 12, 12)] * 3
    assert all(v.dtype == torch.float32 and v.is_contiguous(memory_format=torch.channels_last)
               for v in views)  # fmt: skip


@pytest.mark.parametrize("pixels,read", [("rgb", "mmap"), ("rgb", "pread"),
                                         ("yuv420", "mmap"), ("yuv420", "pread")])  # fmt: skip
def test_each_view_is_its_returned_box_and_flip_of_the_record(caches, pixels, read):
    # The parameters returned reproduce every view from its record (MultiCrop.apply, the
    # DataLoader transform's own resize), so each view is a crop of its sample, and the views
    # of one sample have boxes of their own.
    ds = MemmapImageDataset(caches / pixels)
    views = views_of()
    loader = BatchLoader(ds, 5, sampler=range(N), views=views, flip=True, seed=3, read=read,
                         return_params=True)  # fmt: skip
    transform = MultiCrop(views)
    flipped = 0
    for step, (images, params, labels) in enumerate(loader):
        assert len(images) == len(params) == 5
        assert all(p.shape == (len(labels), 5) and p.dtype == torch.int64 for p in params)
        for j in range(len(labels)):
            i = step * 5 + j
            assert labels[j] == ds.targets[i]
            record = ds.read(i)
            rows = [p[j].tolist() for p in params]
            assert len({tuple(r[:4]) for r in rows}) == 5  # five different boxes
            for (top, left, h, w, _), crop in zip(rows, transform.crops, strict=True):
                assert top + h <= record.shape[0] and left + w <= record.shape[1]
                assert h * w >= crop.scale[0] * record.shape[0] * record.shape[1] * 0.9
            flipped += sum(r[4] for r in rows)
            for got, want in zip(images, transform.apply(record, rows), strict=True):
                assert np.array_equal(got[j].numpy(), want)
            assert not torch.equal(images[0][j], images[1][j])
    assert 0 < flipped < 5 * N  # each view's flip is drawn


def test_without_flips_each_view_s_returned_flip_is_0_and_its_pixels_are_unmirrored(caches):
    ds = MemmapImageDataset(caches / "rgb")
    views = views_of()
    loader = BatchLoader(ds, 4, sampler=range(N), views=views, flip=False, seed=3,
                         return_params=True)  # fmt: skip
    transform = MultiCrop(views)
    for step, (images, params, labels) in enumerate(loader):
        assert all(p[:, 4].tolist() == [0] * len(labels) for p in params)
        for j in range(len(labels)):
            rows = [p[j].tolist() for p in params]
            for got, want in zip(images, transform.apply(ds.read(step * 4 + j), rows), strict=True):
                assert np.array_equal(got[j].numpy(), want)


def test_multicrop_draws_flips_only_when_asked_and_returns_params_only_when_asked():
    img = np.random.default_rng(0).integers(0, 256, (40, 48, 3), np.uint8)
    torch.manual_seed(0)
    flipping = MultiCrop(views_of(), return_params=True)
    flips = [int(p[4]) for _ in range(20) for p in flipping(img)[1]]
    assert 0.25 < sum(flips) / len(flips) < 0.75  # each view's own coin
    steady = MultiCrop(views_of(), flip=False, return_params=True)
    assert all(int(p[4]) == 0 for _ in range(10) for p in steady(img)[1])
    views = MultiCrop(views_of())(img)
    assert isinstance(views, list) and len(views) == 5
    assert all(isinstance(v, np.ndarray) for v in views)


def test_multicrop_resizes_each_view_with_its_crop_s_kernel_and_mirrors_it():
    # whole-image boxes: a plain resize, which OpenCV's own resize gives independently
    img = np.random.default_rng(1).integers(0, 256, (40, 48, 3), np.uint8)
    views = [(RandomResizedCrop(16, interpolation="nearest"), 1),
             (RandomResizedCrop((16, 20), antialias=False), 1)]  # fmt: skip
    whole = [[0, 0, 40, 48, 0], [0, 0, 40, 48, 1]]
    nearest, linear = MultiCrop(views).apply(img, whole)
    assert np.array_equal(nearest, cv2.resize(img, (16, 16), interpolation=cv2.INTER_NEAREST))
    want = cv2.resize(img, (20, 16), interpolation=cv2.INTER_LINEAR)[:, ::-1]
    assert np.array_equal(linear, want)


def test_multicrop_refuses_targets_and_params_of_another_count():
    img = np.zeros((40, 48, 3), np.uint8)
    refusal = r"^MultiCrop takes an image, not an \(image, target\) pair: .* masks or boxes"
    with pytest.raises(ValueError, match=refusal):
        MultiCrop(views_of())((img, {"mask": np.zeros((40, 48), np.uint8)}))
    with pytest.raises(ValueError, match="5 views need 5 rows of params, got 4"):
        MultiCrop(views_of()).apply(img, [[0, 0, 40, 48, 0]] * 4)


def test_the_same_seed_gives_the_same_views_at_1_and_2_threads(caches):
    ds = MemmapImageDataset(caches / "rgb")

    def run(threads):
        loader = BatchLoader(ds, 4, shuffle=True, seed=7, views=views_of(), flip=True,
                             num_threads=threads, return_params=True)  # fmt: skip
        loader.set_epoch(1)
        return epoch(loader)

    one = run(1)
    assert same(one, run(2))
    other = BatchLoader(ds, 4, shuffle=True, seed=8, views=views_of(), flip=True)
    other.set_epoch(1)
    assert not same([s[::2] for s in one], epoch(other))


def test_two_threads_kept_params_are_those_of_their_own_views(caches):
    # Each thread replaces only its own slot's parameter buffers when they are kept: a thread
    # that replaced another's while that one was filling it handed out unwritten boxes.
    ds = MemmapImageDataset(caches / "rgb")

    def run(threads, keep):
        loader = BatchLoader(ds, 1, shuffle=True, seed=9, views=views_of(), flip=True,
                             num_threads=threads, prefetch=4, return_params=True)  # fmt: skip
        out = []
        for e in range(6):
            loader.set_epoch(e)
            out += list(loader) if keep else epoch(loader)
        return out

    assert same(run(2, keep=True), run(1, keep=False))


def test_resume_after_k_steps_equals_the_uninterrupted_epoch(caches):
    ds = MemmapImageDataset(caches / "yuv420")
    whole = BatchLoader(ds, 3, shuffle=True, seed=5, views=views_of(), flip=True)
    whole.set_epoch(2)
    expected = epoch(whole)
    first = BatchLoader(ds, 3, shuffle=True, seed=5, views=views_of(), flip=True)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(2):
        next(it)
    state = first.state_dict()
    it.close()
    resumed = BatchLoader(ds, 3, shuffle=True, seed=5, views=views_of(), flip=True)
    resumed.load_state_dict(state)
    assert same(expected[2:], epoch(resumed))


def test_a_view_s_size_changes_between_epochs_and_resumes(caches):
    ds = MemmapImageDataset(caches / "rgb")
    views = views_of()
    loader = BatchLoader(ds, 6, seed=0, views=views)
    views[1][0].size = 16  # progressive resizing of the local views
    it = iter(loader)
    images, _ = next(it)
    assert [v.shape[1] for v in images] == [24, 24, 16, 16, 16]
    state = loader.state_dict()
    it.close()
    again = views_of()
    resumed = BatchLoader(ds, 6, seed=0, views=again)
    resumed.load_state_dict(state)
    assert again[1][0].size == (16, 16)


def test_the_dataloader_transform_gives_views_and_their_params(caches):
    torch.manual_seed(0)
    transform = MultiCrop(views_of(), return_params=True)
    ds = MemmapImageDataset(caches / "rgb", transform=transform)
    views, params = ds[4][0]
    assert [v.shape for v in views] == [(24, 24, 3)] * 2 + [(12, 12, 3)] * 3
    again = transform.apply(ds.read(4), params)
    assert all(np.array_equal(a, b) for a, b in zip(views, again, strict=True))
    (batch, batch_params), labels = next(iter(DataLoader(ds, batch_size=4)))
    assert [tuple(v.shape) for v in batch] == [(4, 24, 24, 3)] * 2 + [(4, 12, 12, 3)] * 3
    assert [tuple(p.shape) for p in batch_params] == [(4, 5)] * 5 and len(labels) == 4
    plain = MultiCrop([(RandomResizedCrop(8), 2)], flip=False)
    assert len(plain(ds.read(0))) == 2


def test_bad_views_are_refused(caches):
    ds = MemmapImageDataset(caches / "rgb")
    with pytest.raises(ValueError, match="crop= or views="):
        BatchLoader(ds, 2, crop=RandomResizedCrop(8), views=views_of())
    with pytest.raises(ValueError, match="return_params"):
        BatchLoader(ds, 2, crop=RandomResizedCrop(8), return_params=True)
    for bad in ([], [(RandomResizedCrop(8), 0)], [("crop", 1)], [RandomResizedCrop(8)]):
        with pytest.raises(ValueError, match="views"):
            BatchLoader(ds, 2, views=bad)
    with pytest.raises(ValueError, match="return_params=True"):
        BatchLoader(ds, 2, views=views_of(), seed=0).draw_batch(0)


@pytest.mark.parametrize("pixels,reads", [("rgb", 1), ("yuv420", 3)])
def test_a_record_is_read_once_per_step_for_all_its_views(caches, monkeypatch, pixels, reads):
    # With pread, one read of the rows all the boxes span (a yuv420 record: one per plane),
    # not one per view.
    ds = MemmapImageDataset(caches / pixels)
    calls = []
    real = ds.reader.read_into

    def read_into(i, out, start=0):
        calls.append(i)
        return real(i, out, start)

    monkeypatch.setattr(ds.reader, "read_into", read_into)
    loader = BatchLoader(ds, 4, sampler=range(N), views=views_of(), read="pread", seed=0)
    for _ in loader:
        pass
    assert sorted(calls) == sorted(list(range(N)) * reads)
