"""The training pipeline: BatchLoader with crops and flips over caches of mixed shapes, the
DataLoader transforms, reproducible batches, progressive resizing, mid-epoch resume."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import local_ranks, make_folder
from torch.utils.data import DataLoader

from mmcache import (
    BatchLoader,
    CenterResizedCrop,
    Compose,
    MemmapImageDataset,
    MixedShapesError,
    MultiCrop,
    QuasiRandomSampler,
    RandomHorizontalFlip,
    RandomResizedCrop,
    StateMismatchError,
    build_cache,
    cli,
    copy_cache,
)
from mmcache.transforms import resized_crop

SIZES = [(96, 64), (64, 96), (80, 80), (120, 60), (50, 70)]  # (width, height), mixed


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    src = make_folder(root / "src", {c: SIZES * 4 for c in ("ant", "bee", "cow")})
    build_cache(src, root / "cache", workers=1)
    return root / "cache"


@pytest.fixture
def ds(cache):
    return MemmapImageDataset(cache)


def epoch(loader):
    return [(images.clone(), labels.clone()) for images, labels in loader]


def expected_batch(ds, loader, k):
    """Batch k as resized_crop and a flip of each record make it, from the loader's plan."""
    idx, boxes, flips = loader.draw_batch(k)
    images = []
    for j, i in enumerate(idx):
        interpolation, antialias = loader.crop.kernel
        img = resized_crop(
            ds.read(int(i)), boxes[j], loader.crop.size, interpolation, antialias=antialias
        )
        images.append(img[:, ::-1] if flips is not None and flips[j] else img)
    return np.stack(images), ds.reader.records.labels[idx]


def test_a_mixed_size_cache_is_covered_once_per_epoch_with_its_labels(ds):
    loader = BatchLoader(ds, 7, shuffle=True, seed=3, crop=RandomResizedCrop(32), flip=True)
    seen = []
    for k, (images, labels) in enumerate(loader):
        assert images.shape[1:] == (32, 32, 3) and images.dtype == torch.uint8
        idx = loader.draw_batch(k)[0]
        assert labels.tolist() == ds.reader.records.labels[idx].tolist()
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(ds)))  # every record once, of every shape


def test_each_image_is_its_box_resized_and_flipped_as_planned(ds):
    loader = BatchLoader(ds, 8, shuffle=True, seed=1, crop=RandomResizedCrop(40), flip=True)
    flipped = 0
    for k, (images, labels) in enumerate(loader):
        want_images, want_labels = expected_batch(ds, loader, k)
        assert np.array_equal(images.numpy(), want_images)
        assert np.array_equal(labels.numpy(), want_labels)
        flipped += int(loader.draw_batch(k)[2].sum())
    assert 0 < flipped < len(ds)  # flips happen, about half the time


@pytest.mark.parametrize(("interpolation", "antialias"), [("bilinear", False), ("bicubic", True)])
def test_the_batch_path_resizes_with_the_crop_s_interpolation(ds, interpolation, antialias):
    crop = CenterResizedCrop(40, interpolation=interpolation, antialias=antialias)
    loader = BatchLoader(ds, 8, crop=crop)
    for k, (images, _) in enumerate(loader):
        assert np.array_equal(images.numpy(), expected_batch(ds, loader, k)[0])


def test_the_dataloader_transform_gives_the_batch_path_s_pixels(cache, ds):
    # A centre crop has one box per image: both paths must agree on its pixels exactly.
    crop = CenterResizedCrop(40)  # boxes of 44..70 pixels, resized down
    batches = BatchLoader(ds, 6, crop=crop)
    per_sample = MemmapImageDataset(cache, transform=crop)
    loader = DataLoader(per_sample, batch_size=6, num_workers=2, multiprocessing_context="spawn")
    for (a, la), (b, lb) in zip(batches, loader, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    # and a random crop's pixels, for the box it drew, are resized_crop's
    torch.manual_seed(0)
    img = RandomResizedCrop(40)(ds.read(3))
    torch.manual_seed(0)
    box = RandomResizedCrop(40).boxes(
        ds.reader.records.shapes[3:4],
        torch.rand(1, RandomResizedCrop.draws, dtype=torch.float64).numpy(),
    )[0]
    assert np.array_equal(img, resized_crop(ds.read(3), box, (40, 40)))


def test_the_same_seed_gives_the_same_batches_whatever_the_threads_and_runs(ds):
    def run(threads):
        loader = BatchLoader(
            ds, 5, shuffle=True, seed=11, crop=RandomResizedCrop(36), flip=True, num_threads=threads
        )
        loader.set_epoch(2)
        return epoch(loader)

    one, three, again = run(1), run(3), run(1)
    for (a, la), (b, lb), (c, _) in zip(one, three, again, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(la, lb)
    other_epoch = BatchLoader(ds, 5, shuffle=True, seed=11, crop=RandomResizedCrop(36))
    other_epoch.set_epoch(3)
    other = epoch(other_epoch)
    assert not all(torch.equal(a, b) for (a, _), (b, _) in zip(one, other, strict=True))


@pytest.mark.parametrize("seed", [7, None])
def test_resume_after_k_batches_equals_the_uninterrupted_epoch(ds, seed):
    def make():
        loader = BatchLoader(ds, 6, shuffle=True, seed=seed, crop=RandomResizedCrop(32), flip=True)
        loader.set_epoch(4)
        return loader

    first = make()
    it = iter(first)
    head = [next(it)[0].clone() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # plain data, through a checkpoint
    rest_uninterrupted = [images.clone() for images, _ in it]
    assert state["batches"] == 3 and state["epoch"] == 4
    resumed = make()
    resumed.load_state_dict(state)
    rest = [images.clone() for images, _ in resumed]
    assert len(rest) == len(rest_uninterrupted) == len(first) - 3 and len(head) == 3
    assert all(torch.equal(a, b) for a, b in zip(rest, rest_uninterrupted, strict=True))
    # after the resumed epoch, the next iteration is a whole epoch again
    assert len(list(resumed)) == len(first)


def test_a_state_saved_right_after_iter_of_a_resumed_loader_keeps_its_position(ds):
    # The checkpoint of a resumed run, saved before its first batch (a crash right after it
    # restarts), still says where it stands: resuming from it again gives the same rest.
    def make():
        return BatchLoader(ds, 6, shuffle=True, seed=5, crop=RandomResizedCrop(16), flip=True)

    uninterrupted = [images.clone() for images, _ in make()]
    resumed = make()
    resumed.load_state_dict(_saved(make(), batches=4))
    iter(resumed)
    again = json.loads(json.dumps(resumed.state_dict()))
    assert again["batches"] == 4
    last = make()
    last.load_state_dict(again)
    rest = [images.clone() for images, _ in last]
    assert all(torch.equal(a, b) for a, b in zip(rest, uninterrupted[4:], strict=True))


def test_the_draws_of_an_epoch_longer_than_1024_positions_do_not_repeat(ds):
    # Positions are drawn in blocks of 1,024: each block its own numbers, so the record at
    # positions p and p + 1024 gets another box and flip.
    loader = BatchLoader(ds, 550, sampler=[0] * 1100, crop=RandomResizedCrop(8), flip=True, seed=2)
    images = torch.cat([b for b, _ in loader])
    assert len(images) == 1100
    assert not torch.equal(images[:76], images[1024:])
    first, second = loader.draw_batch(0), loader.draw_batch(1)
    assert not np.array_equal(first[1][:76], second[1][474:])
    assert not np.array_equal(first[2][:76], second[2][474:])


def _loader(ds, **kw):
    return BatchLoader(ds, 4, crop=CenterResizedCrop(32), **kw)


def _saved(loader, batches=2):
    """The state of ``loader`` after ``batches`` batches, through JSON as in a checkpoint."""
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return json.loads(json.dumps(loader.state_dict()))


def test_resume_into_another_run_is_refused_naming_what_differs(cache, ds, tmp_path):
    state = _saved(_loader(ds, shuffle=True, seed=3))
    with pytest.raises(StateMismatchError, match=r"another seed \(3\) than this run's \(4\)"):
        _loader(ds, shuffle=True, seed=4).load_state_dict(state)
    with pytest.raises(
        StateMismatchError,
        match=r"another order \(no sampler, shuffle=True\) than this run's \(no sampler, "
        r"shuffle=False\)",
    ):
        _loader(ds, seed=3).load_state_dict(state)
    sampler = QuasiRandomSampler(ds, seed=3, prefetch=False)
    with pytest.raises(StateMismatchError, match=r"than this run's \(QuasiRandomSampler, seed=3"):
        _loader(ds, sampler=sampler, seed=3).load_state_dict(state)
    # another cache: its generation and length are named, the state's and this run's
    src = make_folder(tmp_path / "src", {"ant": SIZES})
    build_cache(src, tmp_path / "other", workers=1)
    other = MemmapImageDataset(tmp_path / "other")
    with pytest.raises(StateMismatchError, match="another dataset") as e:
        _loader(other, shuffle=True, seed=3).load_state_dict(state)
    message = str(e.value)
    assert f"cache generation {ds.generation}, 60 images" in message
    assert f"cache generation {other.generation}, 5 images" in message
    assert isinstance(e.value, ValueError)
    # a copy of the cache is another generation of the same records: it resumes
    copy_cache(cache, tmp_path / "copy")
    copied = MemmapImageDataset(tmp_path / "copy")
    assert copied.generation != ds.generation
    resumed = _loader(copied, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    whole = epoch(_loader(ds, shuffle=True, seed=3))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(epoch(resumed), whole[2:], strict=True))


def test_a_state_that_records_no_dataset_or_order_is_refused(ds):
    state = _saved(_loader(ds, shuffle=True, seed=3))
    del state["dataset"], state["order"]
    with pytest.raises(StateMismatchError, match="records no dataset or order, so it") as e:
        _loader(ds, shuffle=True, seed=3).load_state_dict(state)
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)
    state = _saved(_loader(ds, shuffle=True, seed=3))
    del state["order"]
    with pytest.raises(StateMismatchError, match="BatchLoader.load_state_dict: .* no order,"):
        _loader(ds, shuffle=True, seed=3).load_state_dict(state)
    sampler_state = QuasiRandomSampler(ds, seed=1, block_size=4).state_dict()
    del sampler_state["dataset"]
    with pytest.raises(StateMismatchError, match="QuasiRandomSampler.* records no dataset,"):
        QuasiRandomSampler(ds, seed=1, block_size=4).load_state_dict(sampler_state)


def test_a_quasi_random_sampler_refuses_another_run_s_state(ds):
    state = json.loads(json.dumps(QuasiRandomSampler(ds, seed=1, block_size=4).state_dict()))
    with pytest.raises(StateMismatchError, match=r"another seed \(1\) than this run's \(2\)"):
        QuasiRandomSampler(ds, seed=2, block_size=4).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"another order .*block_size=4.*block_size=8"):
        QuasiRandomSampler(ds, seed=1, block_size=8).load_state_dict(state)
    with pytest.raises(StateMismatchError, match=r"60 images, .*\(59 images\)"):
        QuasiRandomSampler(range(59), seed=1, block_size=4).load_state_dict(state)
    QuasiRandomSampler(ds, seed=1, block_size=4).load_state_dict(state)


def test_resume_with_a_quasi_random_sampler_and_the_dataloader(cache, ds):
    def sampler():
        s = QuasiRandomSampler(ds, seed=5, block_size=4, prefetch=False)
        s.set_epoch(2)
        return s

    cropped = MemmapImageDataset(cache, transform=CenterResizedCrop(32))
    whole = list(DataLoader(cropped, batch_size=4, sampler=sampler()))
    # Without workers, the DataLoader takes from its sampler just the indices of its batches:
    # the sampler's own position is where training is.
    loader = DataLoader(cropped, batch_size=4, sampler=sampler())
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(loader.sampler.state_dict()))
    assert state["start"] == 5 * 4
    del it
    resumed_sampler = QuasiRandomSampler(ds, seed=5, block_size=4, prefetch=False)
    resumed_sampler.load_state_dict(state)
    rest = list(DataLoader(cropped, batch_size=4, sampler=resumed_sampler))
    assert len(rest) == len(whole) - 5
    for (a, la), (b, lb) in zip(rest, whole[5:], strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    # a BatchLoader over the same sampler resumes the same way
    full = epoch(BatchLoader(ds, 4, sampler=sampler(), crop=CenterResizedCrop(32)))
    batch_loader = BatchLoader(ds, 4, sampler=sampler(), crop=CenterResizedCrop(32))
    it = iter(batch_loader)
    for _ in range(5):
        next(it)
    state = batch_loader.state_dict()
    it.close()
    again = BatchLoader(ds, 4, sampler=sampler(), crop=CenterResizedCrop(32))
    again.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(epoch(again), full[5:], strict=True))


def test_crops_larger_than_the_stored_images_warn_once_and_the_advice_works(cache, tmp_path):
    loader = BatchLoader(MemmapImageDataset(cache), 8, crop=RandomResizedCrop(64))
    with pytest.warns(UserWarning) as caught:
        list(loader)
    assert [str(w.message) for w in caught] == [
        "RandomResizedCrop(64x64): 24 of 60 stored images have a shorter side under 64 (the "
        "smallest: 50): upscaled to 64x64, up to 1.28x; the cache holds the source images' "
        "sizes: they are that small in the source (crop smaller, or accept the upscaling)"
    ]
    list(loader)  # once: the next epoch says nothing (pytest makes warnings errors)
    # a cache built too small: the warning gives the command that rebuilds it, which works
    src, small = cache.parent / "src", tmp_path / "small"
    assert cli.main(["build", str(src), str(small), "--short-side", "40"]) == 0
    with pytest.warns(UserWarning) as caught:
        list(BatchLoader(MemmapImageDataset(small), 8, crop=CenterResizedCrop(42)))
    command = f"mmcache build {src} {small} --short-side 48 --replace"
    assert str(caught[0].message) == (
        "CenterResizedCrop(42x42): 60 of 60 stored images have a shorter side under 48 (the "
        "smallest: 40): upscaled to 42x42, up to 1.2x; 60 of them the cache's --short-side 40 "
        f"made that small: rebuild it with `{command}`, or crop smaller"
    )
    assert cli.main(command.split()[1:]) == 0
    list(BatchLoader(MemmapImageDataset(small), 8, crop=CenterResizedCrop(42)))


def test_the_upscale_warning_blames_small_sources_not_the_cache_and_says_it_once(tmp_path, capfd):
    # a --short-side 256 cache whose small sources (90, 100 px) upscale: the cause is the
    # source, and rebuilding at --short-side 112 (shrinking every image) or 256 (the option the
    # cache already has) would not help, so no command is advised
    sizes = [(300, 280), (90, 100), (400, 300), (260, 600), (100, 120)]
    src = make_folder(tmp_path / "src", {"a": sizes})
    build_cache(src, tmp_path / "c", short_side=256, workers=1)
    for crop, needed in [(RandomResizedCrop(112), 112), (CenterResizedCrop(224), 256)]:
        with pytest.warns(UserWarning) as caught:
            MemmapImageDataset(tmp_path / "c", transform=Compose([crop]))
        assert [str(w.message) for w in caught] == [
            f"{type(crop).__name__}({crop.size[0]}x{crop.size[1]}): 2 of 5 stored images have a "
            f"shorter side under {needed} (the smallest: 90): upscaled to "
            f"{crop.size[0]}x{crop.size[1]}, up to {needed / 90:.3g}x; 2 of them are that small "
            "in the source (--short-side 256 never enlarges; a rebuild would not change them)"
        ]
    # a crop larger than the cache's side: the 3 images it shrank can be rebuilt larger
    with pytest.warns(UserWarning) as caught:
        MemmapImageDataset(tmp_path / "c", transform=CenterResizedCrop(280))
    command = f"mmcache build {src} {tmp_path / 'c'} --short-side 320 --replace"
    assert str(caught[0].message).endswith(
        f"3 of them the cache's --short-side 256 made that small: rebuild it with `{command}`, "
        "or crop smaller; 2 of them are that small in the source (--short-side 256 never "
        "enlarges; a rebuild would not change them)"
    )
    # warned in the parent as the dataset is made; its DataLoader workers, forked or spawned,
    # say nothing more (a forked worker inherits pytest's warnings-are-errors; a spawned one
    # would print it to the stderr it shares)
    with pytest.warns(UserWarning, match="upscaled"):
        ds = MemmapImageDataset(tmp_path / "c", transform=RandomResizedCrop(112))
    for context in ("fork", "spawn"):
        loader = DataLoader(ds, batch_size=5, num_workers=1, multiprocessing_context=context)
        assert next(iter(loader))[0].shape == (5, 112, 112, 3)
        assert "upscaled" not in capfd.readouterr().err


def test_progressive_resizing_remakes_the_buffers_only_when_the_size_changes(ds):
    crop = RandomResizedCrop(24)
    loader = BatchLoader(ds, 8, shuffle=True, seed=0, crop=crop)
    pointers = []
    for e, size in enumerate([24, 24, 32, 32, 24]):
        crop.size = size
        loader.set_epoch(e)
        for images, _ in loader:  # dropped each step: the ring's buffers are reused
            assert images.shape[1:3] == (size, size)
        slot = loader._ring.images[0]
        pointers.append((slot.data_ptr(), tuple(slot.shape[1:3])))
        del slot  # (a reference kept would make the slot count as in use: renewed)
    assert pointers[0] == pointers[1] and pointers[2] == pointers[3]
    # remade at the new size (its address may be the old one's: the allocator reuses memory)
    assert [shape for _, shape in pointers] == [(24, 24)] * 2 + [(32, 32)] * 2 + [(24, 24)]


def test_no_pixel_buffer_is_allocated_per_batch(ds):
    loader = BatchLoader(ds, 4, shuffle=True, seed=0, crop=RandomResizedCrop(48), flip=True)
    list(loader)  # the ring and the threads' scratch buffers are made in the first epoch
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        pointers = set()
        for images, _ in loader:
            pointers.add(images.data_ptr())
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(pointers) <= loader.prefetch + 2  # the ring's slots, over and over
    grown = sum(s.size_diff for s in after.compare_to(before, "filename") if s.size_diff > 0)
    batch_bytes = 4 * 64 * 64 * 3
    assert grown < batch_bytes  # bookkeeping only, never a batch's worth of pixels


@pytest.mark.parametrize(
    ("first", "n", "spanned"),
    [(0, 5, [0]), (5110, 10, [4]), (5115, 10, [4, 5]), (3000, 2049, [2, 3, 4])],
)
def test_a_batch_s_numbers_are_its_positions_rows_of_its_blocks_draws_and_no_others(
    first, n, spanned
):
    """Each block of 1,024 positions has a generator of its own, keyed (seed, epoch, rank,
    block): a batch's numbers are its positions' rows of its blocks' draws (numpy's generator
    here, not the loader's code), and a batch late in an epoch draws only the blocks it spans,
    not the epoch before it."""
    from mmcache import _batches
    from mmcache.transforms import DRAWS

    key = (7, 3, 1)
    blocks = [np.random.default_rng([*key, b]).random((1024, DRAWS)) for b in spanned]
    want = np.concatenate(blocks)[first - spanned[0] * 1024 :][:n]
    scratch = _batches.Scratch()
    assert np.array_equal(_batches.uniforms(key, first, n, scratch), want)
    assert sum(b.nbytes for b in scratch.buffers.values()) == len(spanned) * 1024 * DRAWS * 8


def test_normalised_batches_on_the_cpu(ds):
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    plain = BatchLoader(ds, 5, seed=0, shuffle=True, crop=CenterResizedCrop(32))
    for dtype, channels_last in ((torch.float32, True), (torch.float16, False)):
        normed = BatchLoader(
            ds, 5, seed=0, shuffle=True, crop=CenterResizedCrop(32), normalize=(mean, std),
            dtype=dtype, channels_last=channels_last,
        )  # fmt: skip
        plain.set_epoch(0)
        for (u8, _), (x, _) in zip(epoch(plain), epoch(normed), strict=True):
            assert x.dtype == dtype and x.shape == (len(u8), 3, 32, 32)
            assert x.is_contiguous(memory_format=torch.channels_last) == channels_last
            want = u8.permute(0, 3, 1, 2).double() / 255 - torch.tensor(mean).view(1, 3, 1, 1)
            want = want / torch.tensor(std).view(1, 3, 1, 1)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(x.double(), want, atol=tolerance)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_normalised_batches_are_bit_for_bit_the_formula_in_their_dtype(ds, dtype, channels_last):
    """``(x - 255 mean) / (255 std)`` in the batch's dtype, the constants scaled in float64 and
    rounded to it once, against numpy; mean and std given in any shape of 3 values (a (1, 3)
    float32 array, a (3, 1, 1) tensor as torchvision code keeps them)."""
    mean = np.array([[0.485, 0.456, 0.406]], np.float32)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    crop = CenterResizedCrop(32)
    plain = BatchLoader(ds, 5, shuffle=False, crop=crop)
    normed = BatchLoader(ds, 5, shuffle=False, crop=crop, normalize=(mean, std), dtype=dtype,
                         channels_last=channels_last)  # fmt: skip
    as_np = np.float32 if dtype == torch.float32 else np.float64
    m = (mean.astype(np.float64).reshape(1, 3, 1, 1) * 255).astype(as_np)
    s = (std.numpy().astype(np.float64).reshape(1, 3, 1, 1) * 255).astype(as_np)
    for (u8, _), (x, _) in zip(epoch(plain), epoch(normed), strict=True):
        want = (u8.numpy().transpose(0, 3, 1, 2).astype(as_np) - m) / s
        assert x.dtype == dtype and np.array_equal(x.numpy(), want)
        assert x.is_contiguous(memory_format=torch.channels_last if channels_last else
                               torch.contiguous_format)  # fmt: skip


THREE = (0.5, 0.5, 0.5)


@pytest.mark.parametrize(
    ("mean", "std"),
    [((0.5, 0.5), THREE), (THREE, (0.5, 0.5)), (THREE, (0.5, 0.0, 0.5)), (THREE, (0.5, 0.5, -1.0))],
)
def test_a_normalisation_other_than_3_means_and_3_positive_stds_is_refused(ds, mean, std):
    with pytest.raises(ValueError) as refused:
        BatchLoader(ds, 5, normalize=(mean, std))
    assert str(refused.value) == (
        f"normalize must be (mean, std) of 3 values each, std > 0, got {(mean, std)!r}"
    )


def test_a_normalisation_into_integers_is_refused(ds):
    with pytest.raises(ValueError, match=r"^dtype must be a float type, got torch\.int32$"):
        BatchLoader(ds, 5, normalize=(THREE, THREE), dtype=torch.int32)


@pytest.mark.parametrize("channels_last", [False, True])
def test_device_batches_are_normalised_as_the_cpu_ring_s(channels_last):
    """A CUDA batch is normalised into a new tensor, a CPU one into the ring's buffer: the same
    numbers and memory format either way (checked on the CPU, which runs the same code)."""
    from mmcache._batches import Normalize, output

    norm = Normalize(((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), 3, torch.float32)
    images = torch.randint(0, 256, (4, 6, 5, 3), dtype=torch.uint8)
    buffer = torch.empty((4, 6, 5, 3)).permute(0, 3, 1, 2) if channels_last else None
    buffer = torch.empty((4, 3, 6, 5)) if buffer is None else buffer
    into_ring = output(images, norm, channels_last, buffer)
    new = output(images, norm, channels_last)
    assert into_ring.data_ptr() == buffer.data_ptr() and torch.equal(new, into_ring)
    for x in (new, into_ring):
        assert x.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert x.is_contiguous() != channels_last


def test_without_crop_mixed_shapes_are_refused_with_the_way_out(ds):
    with pytest.raises(MixedShapesError, match="pass crop=mmcache.RandomResizedCrop"):
        BatchLoader(ds, 4)


def test_a_crop_reads_only_the_box_s_rows_with_pread(ds):
    mapped = BatchLoader(ds, 6, shuffle=True, seed=2, crop=RandomResizedCrop(30), read="mmap")
    pread = BatchLoader(ds, 6, shuffle=True, seed=2, crop=RandomResizedCrop(30), read="pread")
    pairs = zip(epoch(mapped), epoch(pread), strict=True)
    assert all(torch.equal(a, b) for (a, _), (b, _) in pairs)


RANK_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from mmcache import BatchLoader, MemmapImageDataset, QuasiRandomSampler, RandomResizedCrop
dist.init_process_group("gloo")
ds = MemmapImageDataset(sys.argv[1])
def loader():
    b = BatchLoader(ds, 4, sampler=QuasiRandomSampler(ds, seed=3, block_size=4),
                    crop=RandomResizedCrop(28), flip=True, seed=9)
    b.set_epoch(1)
    return b
whole = [x.clone() for x, _ in loader()]
first = loader()
it = iter(first)
next(it); next(it)
state = json.loads(json.dumps(first.state_dict()))
del it
again = loader()
again.load_state_dict(state)
rest = [x.clone() for x, _ in again]
ok = len(rest) == len(whole) - 2 and all(torch.equal(a, b) for a, b in zip(rest, whole[2:]))
# One file per rank: two ranks printing to one pipe can interleave their lines.
result = {"rank": dist.get_rank(), "ok": ok, "first": whole[0].sum().item()}
out = os.path.join(sys.argv[2], f"rank{dist.get_rank()}.json")
with open(out + ".part", "w") as f:
    json.dump(result, f)
os.replace(out + ".part", out)
dist.destroy_process_group()
"""


def test_resume_works_per_rank_under_torch_distributed(cache, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    run = local_ranks(2, str(script), str(cache), str(tmp_path))  # as torchrun starts them
    assert run.returncode == 0, run.stderr
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["ok"] for r in results)
    assert results[0]["first"] != results[1]["first"]  # each rank has its own share and crops


def test_the_dataset_the_loader_and_the_transforms_say_what_they_are(cache):
    crop = RandomResizedCrop(32)
    assert repr(crop) == (
        "RandomResizedCrop(size=(32, 32), scale=(0.08, 1.0), ratio=(0.75, 1.3333), "
        "interpolation='bilinear', antialias=True)"
    )
    assert repr(CenterResizedCrop((24, 32), antialias=False)) == (
        "CenterResizedCrop(size=(24, 32), ratio=0.875, interpolation='bilinear', antialias=False)"
    )
    flip = RandomHorizontalFlip()
    assert repr(Compose([crop, flip])) == f"Compose(\n    {crop!r}\n    {flip!r}\n)"
    assert repr(flip) == "RandomHorizontalFlip(p=0.5)"
    assert repr(MultiCrop([(crop, 2)])) == (
        f"MultiCrop(views=[({crop!r}, 2)], flip=True, return_params=False)"
    )
    ds = MemmapImageDataset(cache, transform=Compose([crop]))
    assert repr(ds) == (
        f"MemmapImageDataset\n    Number of images: 60\n    Classes: 3\n    Cache: {cache} (built)"
        f"\n    Transform: Compose(\n        {crop!r}\n    )"
    )
    loader = BatchLoader(MemmapImageDataset(cache), 8, shuffle=True, crop=crop)
    assert repr(loader) == (
        f"BatchLoader(cache={str(cache)!r}, batch_size=8, shuffle=True, crop={crop!r}, "
        "flip=False, device='cpu', num_threads=2)"
    )
