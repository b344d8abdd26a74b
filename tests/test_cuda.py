"""Every CUDA path of ``BatchLoader(device=...)``, each against the CPU path and reference math.

Each test runs over a ``device`` parameter: ``"cpu"`` (runs everywhere: the CPU path against
reference math, the CPU half) and ``"cuda"`` (marked ``needs_cuda``: skips without a device; on
one it checks the device batches against the same reference and against the CPU path's
batches). The comparison is exact everywhere: the device only copies uint8 pixels, labels,
masks and boxes that the CPU threads made, and the one float path, ``normalize``, is one
subtraction then one division, each rounded to ``dtype`` (torch computes float16 and bfloat16
in float32 and rounds, on both devices), which ``normalized`` below models step by step.
A mismatch names the largest difference, so a run on a GPU says how far apart they were.
The one tolerance is ``yuv420_to_rgb`` on torch tensors (float arithmetic, rounded): within
two levels of OpenCV's conversion, within one of itself on the CPU (see that test).

``python tools/cuda_check.py`` runs the ``needs_cuda`` tests and a short GPU bench.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_folder, wait_until

import mmcache
from mmcache import BatchLoader, MemmapImageDataset, MultiCrop, RandomResizedCrop, build_cache
from mmcache._targets import flip_target, resized_target
from mmcache.sample_data import make_detection_set, make_segmentation_set
from mmcache.transforms import resize_into

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA = [pytest.mark.needs_cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
CUDA = pytest.param("cuda", marks=NEEDS_CUDA)
DEVICES = ["cpu", CUDA]

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
SIZES = [(64, 48), (48, 64), (40, 40), (33, 17), (50, 30)]


# --- the caches ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> MemmapImageDataset:
    """Eleven RGB records of five shapes (the crop path)."""
    root = tmp_path_factory.mktemp("mixed")
    make_folder(root / "src", {"a": SIZES, "b": SIZES[:3], "c": SIZES[2:]})
    build_cache(root / "src", root / "c", workers=0)
    return MemmapImageDataset(root / "c")


@pytest.fixture(scope="module")
def uniform(tmp_path_factory) -> MemmapImageDataset:
    """Ten RGB records of one shape (whole records batch without a crop)."""
    root = tmp_path_factory.mktemp("same")
    make_folder(root / "src", {"a": SIZES, "b": SIZES})
    build_cache(root / "src", root / "c", size=(24, 20), workers=0)
    return MemmapImageDataset(root / "c")


@pytest.fixture(scope="module")
def i420(tmp_path_factory) -> MemmapImageDataset:
    """The mixed records stored as I420 (converted by the filling threads)."""
    root = tmp_path_factory.mktemp("i420")
    make_folder(root / "src", {"a": SIZES, "b": SIZES[1:]})
    build_cache(root / "src", root / "c", workers=0, pixels="yuv420")
    return MemmapImageDataset(root / "c")


def annotated(tmp_path_factory, make: Any, option: str) -> MemmapImageDataset:
    """A cache of seven generated images with their annotations (``option``: masks or coco)."""
    root = tmp_path_factory.mktemp(option)
    images, annotations = make(root / "src", images=7, size=(36, 48))
    build_cache(images, root / "c", workers=0, **{option: annotations})
    return MemmapImageDataset(root / "c")


@pytest.fixture(scope="module")
def masked(tmp_path_factory) -> MemmapImageDataset:
    return annotated(tmp_path_factory, make_segmentation_set, "masks")


@pytest.fixture(scope="module")
def boxed(tmp_path_factory) -> MemmapImageDataset:
    return annotated(tmp_path_factory, make_detection_set, "coco")


# --- the shared comparison ----------------------------------------------------------------


def host(x: Any) -> Any:
    """A batch (tensors, or lists, tuples and dicts of them) on the CPU, kept past the loader's
    next turn: device tensors copied back, CPU ones (views of the ring) cloned. Both keep the
    memory layout, so ``same`` compares it."""
    if isinstance(x, torch.Tensor):
        return x.cpu() if x.device.type != "cpu" else x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(host(v) for v in x)
    if isinstance(x, dict):
        return {k: host(v) for k, v in x.items()}
    return x


def devices_of(x: Any) -> set[torch.device]:
    if isinstance(x, torch.Tensor):
        return {x.device}
    if isinstance(x, (list, tuple)):
        return set().union(*(devices_of(v) for v in x)) if x else set()
    if isinstance(x, dict):
        return set().union(*(devices_of(v) for v in x.values())) if x else set()
    return set()


def layout(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that say a tensor's memory layout: those of its dimensions longer than 1
    (torch picks any stride for a dimension of one, and none matter in an empty tensor)."""
    if t.numel() == 0:
        return ()
    return tuple(s for s, n in zip(t.stride(), t.shape, strict=True) if n > 1)


def same(got: Any, want: Any, where: str = "batches") -> None:
    """``got`` equals ``want`` exactly: structure, dtype, shape, layout and every value."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), (
            f"{where}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
        )
        assert layout(got) == layout(want), f"{where}: strides {got.stride()} {want.stride()}"
        if not torch.equal(got, want):
            diff = (got.double() - want.double()).abs()
            raise AssertionError(
                f"{where}: {int((diff > 0).sum())} values differ, by at most {diff.max().item()}"
            )
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: keys differ"
        for k in want:
            same(got[k], want[k], f"{where}[{k!r}]")
        return
    assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: lengths differ"
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        same(g, w, f"{where}[{k}]")


def run(ds: MemmapImageDataset, device: str, batch_size: int = 4, **kw: Any) -> list[Any]:
    """Every batch of an epoch of ``BatchLoader(ds, batch_size, device=device, **kw)`` on the
    CPU, after checking that each was on ``device``."""
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:  # "cuda" is the current device
        where = torch.device("cuda", torch.cuda.current_device())
    out = []
    for batch in BatchLoader(ds, batch_size, device=device, **kw):
        assert devices_of(batch) == {where}, devices_of(batch)
        out.append(host(batch))
    return out


def check(
    ds: MemmapImageDataset,
    device: str,
    expect: Any = None,
    batch_size: int = 4,
    **kw: Any,
) -> None:
    """The batches of ``BatchLoader(ds, batch_size, device=device, **kw)`` equal the reference
    math (``reference``'s uint8 batches, through ``expect`` if given); on a GPU they also equal
    the CPU path's, so a failure says which of the two paths moved."""
    want = reference(BatchLoader(ds, batch_size, **kw))
    if expect is not None:
        want = [expect(*batch) for batch in want]
    got = run(ds, device, batch_size, **kw)
    if device != "cpu":
        same(got, run(ds, "cpu", batch_size, **kw), f"{device} batches against the CPU path's")
    same(got, want, f"{device} batches against the reference")


# --- the reference math -------------------------------------------------------------------


def reference(loader: BatchLoader) -> list[Any]:
    """The uint8 N x H x W x C batches (and labels or targets) of ``loader``'s current epoch,
    built from ``draw_batch``'s indices, boxes and flips and each record as the dataset reads
    it: the box resized as ``crop`` resizes, then mirrored (its target moved alike)."""
    if loader.seed is None:
        iter(loader)  # draws the iteration's seed
    ds, crop = loader.dataset, loader.crop
    batches = []
    for b in range(len(loader)):
        idx, boxes, flips = loader.draw_batch(b)
        images, targets = [], []
        for k, i in enumerate(idx.tolist()):
            img, target = ds[i]
            size = img.shape[:2]
            if crop is not None:
                top, left, height, width = boxes[k]
                out = torch.empty((*crop.size, img.shape[2]), dtype=torch.uint8)
                box = img[top : top + height, left : left + width]
                resize_into(torch.from_numpy(np.ascontiguousarray(box)), out, *crop.kernel)
                img = out.numpy()
                if isinstance(target, dict):
                    target = resized_target(target, boxes[k], size, crop.size)
                size = crop.size
            if flips is not None and flips[k]:
                img = img[:, ::-1]
                if isinstance(target, dict):
                    target = flip_target(target, size[1])
            images.append(torch.from_numpy(np.ascontiguousarray(img)))
            targets.append(target)
        batches.append((torch.stack(images), collate(targets)))
    return batches


def collate(targets: list[Any]) -> Any:
    """Labels as an int64 tensor; targets as the loader gives them: the masks stacked, each
    field a list of the samples' rows."""
    if not isinstance(targets[0], dict):
        return torch.tensor(targets, dtype=torch.int64)
    return {
        k: torch.stack([torch.from_numpy(np.ascontiguousarray(t[k])) for t in targets])
        if k == "mask"
        else [torch.from_numpy(np.ascontiguousarray(t[k])) for t in targets]
        for k in targets[0]
    }


def normalized(
    images: torch.Tensor, norm: tuple[Any, Any], dtype: torch.dtype, channels_last: bool
) -> torch.Tensor:
    """uint8 N x H x W x C ``images`` normalised as the loader promises, in float64 with each
    rounding to ``dtype`` made explicit: 255 * mean and 255 * std rounded to ``dtype``, then
    ``x - mean`` rounded, then ``/ std`` rounded (a float32 step between float64 and a 16-bit
    type is harmless: 24 bits >= 2 x 11 + 2, so rounding twice gives the one rounding)."""
    mean, std = (torch.tensor(np.asarray(v, np.float64) * 255, dtype=dtype).double()
                 .view(1, -1, 1, 1) for v in norm)  # fmt: skip
    x = images.permute(0, 3, 1, 2).double()
    out = ((x - mean).to(dtype).double() / std).to(dtype)
    return out.contiguous(memory_format=torch.channels_last if channels_last else
                          torch.contiguous_format)  # fmt: skip


def normalized_batches(batches: list[Any], dtype: torch.dtype, channels_last: bool) -> list[Any]:
    return [(normalized(images, IMAGENET, dtype, channels_last), labels)
            for images, labels in batches]  # fmt: skip


# --- the paths ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_whole_records_and_labels_are_copied_exactly(uniform, device):
    check(uniform, device, shuffle=True, seed=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_normalize_rounds_as_the_reference_in_every_dtype(uniform, device, dtype, channels_last):
    kw = {"shuffle": True, "seed": 4, "crop": RandomResizedCrop((12, 16)), "flip": True}

    def expect(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return normalized(images, IMAGENET, dtype, channels_last), labels

    check(uniform, device, expect, normalize=IMAGENET, dtype=dtype, channels_last=channels_last,
          **kw)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_channels_last_without_normalize_is_an_nchw_view_of_the_pixels(uniform, device):
    check(uniform, device, lambda images, labels: (images.permute(0, 3, 1, 2), labels),
          channels_last=True)  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_crops_and_flips_of_records_of_any_shape(mixed, device):
    kw = {"shuffle": True, "seed": 5, "crop": RandomResizedCrop((12, 16)), "flip": True}
    check(mixed, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("read", ["mmap", "pread"])
def test_i420_records_crop_as_their_rgb_reading(i420, device, read):
    kw = {"shuffle": True, "seed": 6, "crop": RandomResizedCrop(16), "flip": True, "read": read}
    check(i420, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_i420_planes_convert_with_torch_on_the_device(i420, device):
    # pixels.yuv420_to_rgb on tensors: bilinear upsampling and the matrix in float32, rounded,
    # against OpenCV's fixed-point conversion, which the dataset gives: up to two levels apart
    # (measured on the CPU; its docstring says one). Torch on the GPU and on the CPU compute
    # alike but the GPU may fuse a multiply and an add, so a rounding at a half level may go
    # the other way: one level apart at most.
    for i in range(3):
        planes = [torch.from_numpy(np.ascontiguousarray(p)).to(device) for p in i420.planes(i)]
        rgb = mmcache.yuv420_to_rgb(*planes)
        assert rgb.device.type == device and rgb.dtype == torch.uint8
        want = i420[i][0].astype(int)
        assert np.abs(rgb.cpu().numpy().astype(int) - want).max() <= 2
        if device != "cpu":
            on_cpu = mmcache.yuv420_to_rgb(*(p.cpu() for p in planes))
            assert (rgb.cpu().int() - on_cpu.int()).abs().max() <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_views_and_their_params_make_the_views_of_multicrop_apply(mixed, device):
    views = [(RandomResizedCrop(16), 2), (RandomResizedCrop((8, 12), scale=(0.1, 0.5)), 1)]
    kw = {"shuffle": True, "seed": 7, "flip": True, "views": views, "return_params": True}
    got = run(mixed, device, **kw)
    multicrop = MultiCrop(views)
    order = BatchLoader(mixed, 4, shuffle=True, seed=7, crop=RandomResizedCrop(16))
    position = 0
    for b, (images, params, labels) in enumerate(got):
        idx = order.draw_batch(b)[0]
        assert labels.tolist() == [mixed.targets[i] for i in idx]
        for k, i in enumerate(idx.tolist()):
            want = multicrop.apply(mixed[i][0], [p[k] for p in params])
            for v, view in enumerate(want):
                same(images[v][k], torch.from_numpy(view), f"sample {position + k} view {v}")
        position += len(idx)
    assert position == len(mixed)
    if device != "cpu":
        same(got, run(mixed, "cpu", **kw), f"{device} views against the CPU path's")


@pytest.mark.parametrize("device", DEVICES)
def test_masks_are_cropped_flipped_and_copied_with_their_images(masked, device):
    kw = {"shuffle": True, "seed": 8, "crop": RandomResizedCrop((20, 24)), "flip": True}
    check(masked, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_boxes_and_their_fields_move_and_copy_with_their_images(boxed, device):
    kw = {"shuffle": True, "seed": 9, "crop": RandomResizedCrop(24, scale=(0.3, 1)),
          "flip": True}  # fmt: skip
    check(boxed, device, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_several_threads_give_the_batches_of_one(mixed, device):
    kw = {"shuffle": True, "seed": 10, "crop": RandomResizedCrop(16), "flip": True}
    want = reference(BatchLoader(mixed, 2, **kw))  # one thread's
    same(run(mixed, device, 2, num_threads=3, prefetch=1, **kw), want, "three threads")


@pytest.mark.parametrize("device", DEVICES)
def test_an_epoch_resumes_on_the_device_from_a_state_dict(mixed, device):
    def make() -> BatchLoader:
        return BatchLoader(mixed, 3, device=device, shuffle=True, crop=RandomResizedCrop(16),
                           flip=True, normalize=IMAGENET)  # fmt: skip

    first = make()  # seed=None: the state carries the iteration's seed
    first.set_epoch(2)
    it = iter(first)
    next(it)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    got = [host(batch) for batch in resumed]
    same(got, [host(batch) for batch in it], "the resumed batches against the epoch's rest")
    replay = BatchLoader(mixed, 3, shuffle=True, seed=state["seed"], crop=RandomResizedCrop(16),
                         flip=True)  # fmt: skip
    replay.set_epoch(2)
    same(got, normalized_batches(reference(replay), torch.float32, False)[1:], "reference")


@pytest.mark.parametrize("device", DEVICES)
def test_progressive_resizing_changes_the_device_batches_size(mixed, device):
    crop = RandomResizedCrop(16)
    loader = BatchLoader(mixed, 4, device=device, seed=11, crop=crop, flip=True,
                         normalize=IMAGENET, channels_last=True)  # fmt: skip
    for epoch, size in enumerate([(16, 16), (10, 14), (20, 12)]):
        crop.size = size
        loader.set_epoch(epoch)
        got = [host(batch) for batch in loader]
        want = normalized_batches(reference(loader), torch.float32, True)
        same(got, want, f"epoch {epoch} at {size}")


@pytest.mark.parametrize("device", DEVICES)
def test_batches_are_filled_and_copied_ahead_while_one_is_held(mixed, device):
    # The copy of a batch to the device runs on its filling thread's own side stream while
    # the other thread fills the next batch: with batch 0 held (no next() called), batches 1
    # and 2 are filled, copied and their copies done, without the consumer waiting for any.
    loader = BatchLoader(mixed, 2, device=device, seed=16, crop=RandomResizedCrop(16),
                         num_threads=2, prefetch=2)  # fmt: skip
    it = iter(loader)
    held = host(next(it))  # a copy: the CPU batch is a view of a buffer refilled later
    ready = it._shared.ready  # the batches the threads published, by number
    wait_until(lambda: {1, 2} <= set(ready), "batches 1 and 2 ready while batch 0 is held")
    for number in (1, 2):
        batch = ready[number]
        assert batch.images.device.type == device
        if device != "cpu":
            assert batch.copied is not None and batch.copied.query()  # its copy is over
    assert 3 not in ready  # prefetch bounds how far ahead they go
    rest = [host(batch) for batch in it]
    same([held, *rest], reference(loader), "the batches after waiting")


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_batch_stays_as_it_was_while_the_loader_goes_on(mixed, device):
    # CUDA batches are fresh device tensors: kept as they are. CPU batches are views of the
    # ring, kept by cloning them (the contract): the same check holds for both.
    loader = BatchLoader(mixed, 2, device=device, shuffle=True, seed=12,
                         crop=RandomResizedCrop(16), flip=True, normalize=IMAGENET)  # fmt: skip
    kept = [batch if device != "cpu" else host(batch) for batch in loader]
    want = normalized_batches(reference(loader), torch.float32, False)
    loader.set_epoch(1)
    for _ in range(2):  # two more passes refill every buffer and reuse freed device memory
        for images, labels in loader:
            images.mul_(0)  # the consumer writes into its batches in place, as training may
            labels.mul_(0)
    same(host(kept), want, "the kept batches")


@pytest.mark.parametrize("device", [CUDA])
def test_pinned_buffers_without_a_device_give_the_same_batches(mixed, device):
    kw = {"shuffle": True, "seed": 13, "crop": RandomResizedCrop(16), "flip": True}
    pinned = BatchLoader(mixed, 4, pin_memory=True, **kw)
    got = []
    for images, labels in pinned:
        assert images.is_pinned() and labels.is_pinned()
        got.append(host((images, labels)))
    same(got, reference(pinned))


@pytest.mark.parametrize("device", [CUDA])
def test_a_batch_freed_while_the_gpu_reads_it_is_not_reused_under_it(mixed, device):
    # The caching allocator hands a freed block to the next allocation on the stream it was
    # allocated on (the loader's side stream) at once, unless the block was recorded as used
    # by another stream: BatchLoader records each batch on the consumer's stream. Here the
    # consumer queues a read of each batch behind a long sleep and drops the batch before the
    # read runs; the side stream's next copy must not land in that memory meanwhile.
    loader = BatchLoader(mixed, 2, device=device, shuffle=True, seed=14,
                         crop=RandomResizedCrop(16), flip=True, num_threads=1,
                         prefetch=1)  # fmt: skip
    copies = []
    for images, labels in loader:
        torch.cuda._sleep(50_000_000)  # some 25 ms of the current stream
        copies.append((images.clone(), labels.clone()))  # queued behind the sleep
        del images, labels  # freed before the clone has read them
    torch.cuda.synchronize()
    same(host(copies), reference(loader), "the copies read after the batches were freed")


@pytest.mark.parametrize("device", [
    pytest.param("cuda:1", marks=[*NEEDS_CUDA, pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="needs a second GPU")]),
])  # fmt: skip
def test_a_second_gpu_gets_its_batches_and_their_stream_order(mixed, device):
    kw = {"shuffle": True, "seed": 15, "crop": RandomResizedCrop(16), "flip": True,
          "normalize": IMAGENET}  # fmt: skip
    with torch.cuda.device(0):  # the current device is another: the loader must not care
        got = run(mixed, device, **kw)
    # "cuda" is the current device of the thread that makes the loader (a DDP rank's, after
    # torch.cuda.set_device), not that of the filling threads, which start on the first GPU.
    with torch.cuda.device(1):
        current = run(mixed, "cuda", **kw)  # run checks that they are on cuda:1
    loader = BatchLoader(mixed, 4, **kw)
    want = normalized_batches(reference(loader), torch.float32, False)
    same(got, want, device)
    same(current, want, "device='cuda' under torch.cuda.device(1)")
