"""The crops: torchvision's box sampling, its antialiased bilinear resize, the centre crop."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
import torch
from torch.nn.functional import interpolate

from mmcache import CenterResizedCrop, Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.transforms import DRAWS, TRIES, resized_crop


def torchvision_get_params(height, width, scale, ratio, draw):
    """torchvision's RandomResizedCrop.get_params, line by line from its source, with its
    random numbers taken from ``draw(kind, *args)`` (torch's generator, or numbers replayed)."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * draw("uniform", scale[0], scale[1])
        aspect_ratio = math.exp(draw("uniform", log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = draw("randint", 0, height - h + 1)
            j = draw("randint", 0, width - w + 1)
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def torch_draw(kind, a, b):
    if kind == "uniform":
        return torch.empty(1).uniform_(a, b).item()
    return int(torch.randint(a, b, size=(1,)).item())


SHAPES = [(256, 384), (256, 256), (480, 720), (1000, 60), (60, 1000), (7, 5)]


@pytest.mark.parametrize("shape", SHAPES)
def test_boxes_are_torchvision_s_for_the_same_random_numbers(shape):
    """Each try consumes an area and a ratio number, then two position numbers: replaying our
    uniform numbers through torchvision's code gives our box, every time."""
    crop = RandomResizedCrop(224)
    u = np.random.default_rng(0).random((2000, DRAWS))
    ours = crop.boxes(np.array([shape] * len(u)), u[:, : crop.draws])
    for row, box in zip(u, ours, strict=True):
        tries = iter(range(TRIES))
        area_ratio = iter([(row[k], row[TRIES + k]) for k in range(TRIES)])
        pos = iter(row[2 * TRIES : 2 * TRIES + 2])
        pending = []

        def replay(kind, a, b, tries=tries, area_ratio=area_ratio, pos=pos, pending=pending):
            if kind == "uniform":
                if not pending:
                    next(tries)
                    pending.extend(next(area_ratio))
                return a + (b - a) * pending.pop(0)
            return a + math.floor(next(pos) * (b - a))

        expected = torchvision_get_params(*shape, (0.08, 1.0), (3 / 4, 4 / 3), replay)
        assert tuple(box) == expected


def ks_distance(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


@pytest.mark.parametrize("shape", [(256, 384), (1000, 60), (20, 20)])
def test_box_statistics_match_torchvision_s_own_random_draws(shape):
    torch.manual_seed(0)
    n = 20000
    reference = np.array(
        [torchvision_get_params(*shape, (0.08, 1.0), (3 / 4, 4 / 3), torch_draw) for _ in range(n)]
    )
    crop = RandomResizedCrop(224)
    u = np.random.default_rng(1).random((n, DRAWS))
    ours = crop.boxes(np.array([shape] * n), u[:, : crop.draws])
    h, w = shape

    def stats(b):
        area = b[:, 2] * b[:, 3] / (h * w)
        aspect = np.log(b[:, 3] / b[:, 2])
        top = b[:, 0] / np.maximum(1, h - b[:, 2] + 1)
        left = b[:, 1] / np.maximum(1, w - b[:, 3] + 1)
        return area, aspect, top, left

    for ours_s, ref_s in zip(stats(ours), stats(reference), strict=True):
        # two-sample Kolmogorov-Smirnov distance; 0.02 is ~3x its spread at n = 20,000
        assert ks_distance(ours_s, ref_s) < 0.02
    assert (ours[:, 2] <= h).all() and (ours[:, 3] <= w).all()
    assert ((ours[:, 0] + ours[:, 2]) <= h).all() and ((ours[:, 1] + ours[:, 3]) <= w).all()


def _photo(h=256, w=384, seed=0):
    import cv2

    rng = np.random.default_rng(seed)
    img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    return cv2.GaussianBlur(img, (0, 0), 1.5)


def pil_bilinear_antialias(img, out_h, out_w):
    """torchvision's antialiased bilinear resize from its documented algorithm (PIL's
    ImagingResample with the triangle filter): separable, support scaled by the shrink."""

    def weights(n_in, n_out):
        scale = n_in / n_out
        filterscale = max(scale, 1.0)
        m = np.zeros((n_out, n_in))
        for o in range(n_out):
            center = (o + 0.5) * scale
            lo = max(int(center - filterscale + 0.5), 0)
            hi = min(int(center + filterscale + 0.5), n_in)
            x = np.arange(lo, hi)
            wts = np.maximum(0.0, 1.0 - np.abs((x - center + 0.5) / filterscale))
            m[o, lo:hi] = wts / wts.sum()
        return m

    t = np.einsum("oh,hwc->owc", weights(img.shape[0], out_h), img.astype(np.float64))
    t = np.einsum("pw,owc->opc", weights(img.shape[1], out_w), t)
    return np.clip(np.round(t), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("box", [(0, 0, 256, 384), (10, 20, 100, 140), (5, 7, 250, 300)])
def test_bilinear_is_torchvision_s_antialiased_resize(box):
    img = _photo()
    out = resized_crop(img, box, (224, 224))
    top, left, h, w = box
    crop = np.ascontiguousarray(img[top : top + h, left : left + w])
    torch_u8 = interpolate(
        torch.from_numpy(crop).permute(2, 0, 1)[None],
        size=(224, 224),
        mode="bilinear",
        antialias=True,
        align_corners=False,
    )[0].permute(1, 2, 0)
    assert np.array_equal(out, torch_u8.numpy())  # the very kernel torchvision runs on uint8
    reference = pil_bilinear_antialias(crop, 224, 224)
    assert np.abs(out.astype(int) - reference).max() <= 1  # the documented algorithm


def test_a_whole_image_box_is_a_plain_resize_and_opencv_filters_are_opencv_s():
    import cv2

    img = _photo()
    whole = (0, 0, 256, 384)
    for name, flag in (("bilinear", cv2.INTER_LINEAR), ("bicubic", cv2.INTER_CUBIC)):
        out = resized_crop(img, whole, (160, 200), name, antialias=False)
        assert np.array_equal(out, cv2.resize(img, (200, 160), interpolation=flag))
    for name, flag in (("area", cv2.INTER_AREA), ("nearest", cv2.INTER_NEAREST)):
        out = resized_crop(img, whole, (160, 200), name)  # never antialiased, as torchvision's
        assert np.array_equal(out, cv2.resize(img, (200, 160), interpolation=flag))
    # a box of the output's size is copied, not resampled
    assert np.array_equal(resized_crop(img, (3, 4, 224, 224), (224, 224)), img[3:227, 4:228])


def test_gray_records_stay_one_channel():
    img = _photo()[:, :, :1].copy()
    out = RandomResizedCrop(64)(img)
    assert out.shape == (64, 64, 1) and out.dtype == np.uint8


def test_center_crop_is_resize_256_then_center_crop_224_on_a_short_side_256_image():
    img = _photo(256, 384)
    out = CenterResizedCrop(224)(img)
    assert np.array_equal(out, img[16:240, 80:304])  # torchvision: round((256-224)/2) = 16
    portrait = _photo(341, 256, seed=3)
    assert np.array_equal(CenterResizedCrop(224)(portrait), portrait[58:282, 16:240])
    # on another size the box is 224/256 of the shorter side, then resized
    big = _photo(480, 720)
    box = CenterResizedCrop(224).boxes(np.array([[480, 720]]))[0]
    assert tuple(box) == (30, 150, 420, 420)
    assert np.array_equal(CenterResizedCrop(224)(big), resized_crop(big, box, (224, 224)))


@pytest.mark.parametrize("margin", range(12))
def test_the_centre_box_rounds_its_margin_as_torchvision_s_center_crop(margin):
    # torchvision's CenterCrop: crop_top = int(round((image_height - crop_height) / 2.0)),
    # Python's round, half to even: margins 4k + 3 round up (3 -> 2), 4k + 1 down (5 -> 2).
    offset = int(round(margin / 2.0))
    img = _photo(8, 8 + margin, seed=margin)
    assert np.array_equal(CenterResizedCrop(8, ratio=1.0)(img), img[:, offset : offset + 8])
    tall = np.ascontiguousarray(img.transpose(1, 0, 2))
    assert np.array_equal(CenterResizedCrop(8, ratio=1.0)(tall), tall[offset : offset + 8])


def test_a_crop_larger_than_the_image_warns_once_per_size_naming_the_short_side_to_build():
    small = _photo(128, 170)
    crop = CenterResizedCrop(224)
    with pytest.warns(UserWarning) as caught:
        crop(small)
    assert len(caught) == 1 and str(caught[0].message) == (
        "CenterResizedCrop(224x224): an image of shorter side 128, under 256, is upscaled to "
        "224x224 (2x)"
    )
    crop(small)  # once per size: no second warning (pytest makes warnings errors)
    crop.size = 160
    with pytest.warns(UserWarning, match=r"CenterResizedCrop\(160x160\): .* under 183"):
        crop(small)
    random = RandomResizedCrop((100, 140))
    with pytest.warns(UserWarning, match=r"side 64, under 100, is upscaled to 100x140 \(1.56x\)"):
        random(_photo(64, 90))
    # an image that holds the largest box the crop takes is not upscaled: no warning
    CenterResizedCrop(224)(_photo(256, 300))
    RandomResizedCrop(224)(_photo(224, 300))


def test_per_sample_transforms_use_torch_s_generator_and_pickle():
    img = _photo()
    crop = Compose([RandomResizedCrop((100, 120)), RandomHorizontalFlip()])
    torch.manual_seed(5)
    a = crop(img)
    torch.manual_seed(5)
    b = pickle.loads(pickle.dumps(crop))(img)
    assert a.shape == (100, 120, 3) and np.array_equal(a, b)
    torch.manual_seed(6)
    assert not np.array_equal(crop(img), a)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: RandomResizedCrop(0), "size must be"),
        (lambda: RandomResizedCrop(224, scale=(0.5, 0.1)), "scale must be"),
        (lambda: RandomResizedCrop(224, ratio=(0, 1)), "ratio must be"),
        (lambda: RandomResizedCrop(224, interpolation="hamming"), "interpolation must be"),
        (lambda: CenterResizedCrop(224, ratio=1.5), "ratio must be"),
    ],
)
def test_bad_arguments_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bicubic_is_torch_s_antialiased_bicubic():
    img = _photo()
    out = resized_crop(img, (10, 20, 200, 300), (100, 120), "bicubic")
    crop = torch.from_numpy(np.ascontiguousarray(img[10:210, 20:320])).permute(2, 0, 1)[None]
    floats = interpolate(crop.float(), size=(100, 120), mode="bicubic", antialias=True)
    reference = floats[0].permute(1, 2, 0).round().clamp(0, 255).numpy()
    assert np.abs(out.astype(int) - reference).max() <= 1  # torchvision's float path, rounded


@pytest.mark.parametrize("old", ["linear", "cubic"])
def test_opencv_s_names_are_not_interpolations(old):
    with pytest.raises(ValueError, match=f"interpolation must be one of .*, got '{old}'"):
        RandomResizedCrop(100, interpolation=old)
