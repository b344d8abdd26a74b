"""BatchLoader: batches the caller keeps stay theirs; each iter() without set_epoch is the next
epoch; resuming is exact in both modes, and after a refresh of the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_folder, write_image

from mmcache import (
    BatchLoader,
    CenterResizedCrop,
    MemmapImageDataset,
    QuasiRandomSampler,
    RandomResizedCrop,
    build_cache,
)
from mmcache.sample_data import make_segmentation_set


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Mixed-shape RGB and yuv420 caches of 20 images in two classes, and a masked cache."""
    root = tmp_path_factory.mktemp("own")
    src = make_folder(root / "src", {"a": [(40, 32), (36, 44)] * 5, "b": [(32, 40)] * 10})
    build_cache(src, root / "rgb", workers=0)
    build_cache(src, root / "yuv420", workers=0, pixels="yuv420")
    images, masks = make_segmentation_set(root / "seg", images=8, size=(32, 40))
    build_cache(images, root / "masks", masks=masks, workers=0)
    return root


def _cloned(batch):
    """A deep copy of a batch (tensors, lists and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _cloned(v) for k, v in batch.items()}
    return [_cloned(v) for v in batch]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


RECIPES = {  # the README's and docs' loaders, on tiny images
    "crop": ("rgb", dict(crop=RandomResizedCrop(16), flip=True)),
    "normalized": (
        "rgb",
        dict(crop=RandomResizedCrop(16), normalize=((0.5,) * 3, (0.2,) * 3), channels_last=True),
    ),  # fmt: skip
    "views": (
        "rgb",
        dict(
            views=[(RandomResizedCrop(16), 2), (RandomResizedCrop(8), 2)],
            flip=True,
            return_params=True,
        ),
    ),  # fmt: skip
    "masks": ("masks", dict(crop=RandomResizedCrop(16), flip=True)),
    "yuv420": ("yuv420", dict(crop=RandomResizedCrop(16), flip=True)),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_batches_kept_in_a_list_stay_as_they_were(caches, recipe):
    name, kwargs = RECIPES[recipe]
    loader = BatchLoader(MemmapImageDataset(caches / name), 2, shuffle=True, seed=0,
                         prefetch=1, **kwargs)  # fmt: skip
    copies = [_cloned(batch) for batch in loader]  # each cloned while it is the newest
    loader.set_epoch(0)
    kept = list(loader)
    assert len(kept) == len(copies) >= 4
    assert all(_same(k, c) for k, c in zip(kept, copies, strict=True))


def test_a_validation_loop_that_accumulates_labels_gets_the_right_ones(caches):
    ds = MemmapImageDataset(caches / "rgb")
    val = BatchLoader(ds, 3, crop=CenterResizedCrop(16), prefetch=1)
    labels = [y for _, y in val]  # images dropped, labels kept: the usual accuracy loop
    assert torch.cat(labels).tolist() == ds.targets


FLOATS = ((0.5,) * 3, (0.2,) * 3)


@pytest.mark.parametrize(
    "normalize, channels_last",
    [(None, False), (FLOATS, False), (FLOATS, True)],
    ids=["uint8", "floats", "floats-channels-last"],
)
def test_a_loop_that_drops_each_batch_reuses_the_ring(caches, normalize, channels_last):
    loader = BatchLoader(MemmapImageDataset(caches / "rgb"), 2, crop=RandomResizedCrop(16),
                         normalize=normalize, channels_last=channels_last)  # fmt: skip
    pointers = {images.data_ptr() for images, _ in loader}
    assert len(pointers) <= loader.prefetch + 2  # no buffer made per batch


def test_a_torch_that_cannot_count_a_storage_s_users_gets_a_new_buffer_per_batch(
    caches, monkeypatch
):
    # (torch builds before 2.5 without CUDA lack the count: every slot is taken for in use)
    import mmcache._batches

    monkeypatch.setattr(mmcache._batches, "_UNUSED", None)
    loader = BatchLoader(MemmapImageDataset(caches / "rgb"), 2, seed=0, crop=RandomResizedCrop(16))
    copies = [_cloned(batch) for batch in loader]
    loader.set_epoch(0)
    batches = list(loader)
    assert len({images.data_ptr() for images, _ in batches}) == len(batches)
    assert all(_same(k, c) for k, c in zip(batches, copies, strict=True))


def _epoch(loader):
    return [(x.clone(), y.clone()) for x, y in loader]


def test_each_iteration_without_set_epoch_is_the_next_epoch(caches):
    ds = MemmapImageDataset(caches / "rgb")
    loader = BatchLoader(ds, 4, shuffle=True, seed=0, crop=RandomResizedCrop(16), flip=True)
    first, second = _epoch(loader), _epoch(loader)
    assert loader.epoch == 1
    assert not _same(first, second)  # another order, other crops
    loader.set_epoch(0)
    assert _same(_epoch(loader), first)
    loader.set_epoch(0)
    assert _same(_epoch(loader), first) and _same(_epoch(loader), second)


def test_a_quasi_random_sampler_iterated_directly_advances_too(caches):
    sampler = QuasiRandomSampler(MemmapImageDataset(caches / "rgb"), block_size=2, seed=0)
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(first) == sorted(second) and sampler.epoch == 1
    sampler.set_epoch(0)
    assert list(sampler) == first
    sampler.set_epoch(0)
    assert list(sampler) == first


@pytest.mark.parametrize("set_epoch", [False, True])
@pytest.mark.parametrize("stop", [2, 5, None])  # batches into epoch 0 (of 5), or after its loop
def test_resume_is_exact_with_and_without_set_epoch(caches, set_epoch, stop):
    ds = MemmapImageDataset(caches / "rgb")

    def make():
        return BatchLoader(ds, 4, shuffle=True, seed=0, crop=RandomResizedCrop(16), flip=True)

    def run(loader, epochs, checkpoint=None, resumed=False):
        """Batches of ``epochs`` epochs; with ``checkpoint``, stop at ``stop`` and save there
        the loader's state and the epoch to go on with, as a training loop does. A resumed
        run goes on with the epoch it stopped in (no set_epoch for that one)."""
        got = []
        for epoch in epochs:
            if set_epoch and not (resumed and epoch == epochs[0]):
                loader.set_epoch(epoch)
            for x, y in loader:
                got.append((x.clone(), y.clone()))
                if checkpoint is not None and len(got) == stop:
                    checkpoint.update(loader=loader.state_dict(), epoch=epoch)
                    return got
            if checkpoint is not None and stop is None:
                checkpoint.update(loader=loader.state_dict(), epoch=epoch + 1)
                return got
        return got

    whole = run(make(), range(2))
    checkpoint: dict = {}
    head = run(make(), range(2), checkpoint)
    resumed = make()
    resumed.load_state_dict(checkpoint["loader"])
    tail = run(resumed, range(checkpoint["epoch"], 2), resumed=True)
    assert _same(head + tail, whole)


def test_resume_after_a_refresh_that_added_a_file_goes_on(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(32, 24)] * 6, "b": [(32, 24)] * 6})
    build_cache(src, tmp_path / "cache", workers=0)
    loader = BatchLoader(MemmapImageDataset(tmp_path / "cache"), 4, shuffle=True, seed=0)
    it = iter(loader)
    seen = torch.cat([next(it)[1], next(it)[1]]).tolist()
    state = loader.state_dict()
    it.close()
    write_image(src / "a" / "new.jpg", 32, 24, seed=99)
    assert not build_cache(src, tmp_path / "cache", workers=0).up_to_date  # the routine
    ds = MemmapImageDataset(tmp_path / "cache")
    resumed = BatchLoader(ds, 4, shuffle=True, seed=0)
    with pytest.warns(UserWarning, match="refreshed"):
        resumed.load_state_dict(state)
    rest = [y for _, y in resumed]
    assert len(rest) == len(resumed) - 2  # the epoch goes on from its third batch
    assert len(seen) + sum(len(y) for y in rest) == len(ds)
