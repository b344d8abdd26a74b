"""Targets through the crops and the flip: masks and boxes move with their images' pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.functional import interpolate

from mmcache import (
    CenterResizedCrop,
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
)
from mmcache import pixels as px
from mmcache._targets import flip_target, resized_mask
from mmcache.transforms import resized_crop

# Four corners of the RGB cube that make a regular tetrahedron: of any weighted mean of them
# (what a bilinear or antialiased resize makes of neighbouring pixels), the nearest is the one
# of the largest weight, so a pixel's class reads back from its colour.
COLOURS = np.array([(0, 0, 0), (255, 255, 0), (255, 0, 255), (0, 255, 255)], np.uint8)
SEEDS = range(60)
# The per-sample crops warn of upscaling small images, which these tests mean to do.
pytestmark = pytest.mark.filterwarnings("ignore:.*upscaled to:UserWarning")


def classes_of(img: np.ndarray) -> np.ndarray:
    """Each pixel's class: the index of its nearest colour."""
    d = img[..., None, :].astype(np.int32) - COLOURS.astype(np.int32)
    return np.argmin((d * d).sum(-1), axis=-1)


def class_image(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """An image of random cells of the four class colours, and its class map: cells at least
    12 pixels across, wider than any resize here takes into one output pixel's filter."""

    def borders(n: int) -> np.ndarray:
        edges = np.cumsum(rng.integers(12, 40, n))
        return edges[edges < n - 12]

    h, w = (int(v) for v in rng.integers(40, 160, 2))
    rows = np.searchsorted(borders(h), np.arange(h), side="right")
    cols = np.searchsorted(borders(w), np.arange(w), side="right")
    cells = rng.integers(0, 4, (rows.max() + 1, cols.max() + 1))
    mask = cells[rows][:, cols].astype(np.uint16 if rng.random() < 0.5 else np.uint8)
    return COLOURS[mask], mask


def read_only(target: dict) -> dict:
    """``target`` with its arrays made read-only: a transform that writes into one fails."""
    for v in target.values():
        if isinstance(v, np.ndarray):
            v.flags.writeable = False
    return target


CROPS = [
    lambda: RandomResizedCrop((40, 56)),
    lambda: CenterResizedCrop((40, 56), ratio=0.8),
    lambda: RandomResizedCrop(24, scale=(0.5, 1.0)),  # downscaling, the antialiased filter
]


@pytest.mark.parametrize("make", CROPS)
def test_the_mask_is_the_class_read_from_the_image_s_own_pixels_after_crop_and_flip(make):
    transform = Compose([make(), RandomHorizontalFlip()])
    rng = np.random.default_rng(0)
    compared = total = 0
    for seed in SEEDS:
        img, mask = class_image(rng)
        torch.manual_seed(seed)
        out, target = transform((img, read_only({"mask": mask})))
        got = target["mask"]
        assert got.shape == out.shape[:2] and got.dtype == mask.dtype
        # Away from a class border (the 3 x 3 neighbourhood of one class), the two agree.
        padded = np.pad(got, 1, mode="edge")
        windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3))
        inner = (windows == got[..., None, None]).all(axis=(-1, -2))
        assert np.array_equal(classes_of(out)[inner], got[inner]), seed
        compared += int(inner.sum())
        total += got.size
    assert compared > total / 2  # the borders did not take most of the pixels


@pytest.mark.parametrize("out_hw", [(7, 5), (40, 56), (90, 33)])
def test_the_mask_takes_the_label_under_each_output_pixel_s_centre(out_hw):
    """torch's nearest-exact (pixel centres mapped as the image's resize maps them), not
    OpenCV's INTER_NEAREST (half a source pixel off)."""
    mask = np.random.default_rng(1).integers(0, 60000, (50, 70)).astype(np.uint16)
    for box in [(0, 0, 50, 70), (3, 5, 20, 31), (10, 2, 7, 9), (49, 69, 1, 1)]:
        top, left, bh, bw = box
        src = torch.from_numpy(mask[top : top + bh, left : left + bw].astype(np.float64))
        expected = interpolate(src[None, None], size=out_hw, mode="nearest-exact")[0, 0]
        got = resized_mask(mask, box, out_hw)
        assert np.array_equal(got, expected.numpy().astype(np.uint16))
        into = np.empty(out_hw, np.uint16)
        assert resized_mask(mask, box, out_hw, out=into) is into and np.array_equal(into, got)


def rectangle_image(rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """A black image with three solid rectangles of the other class colours, and their boxes
    (label k: colour k): apart or touching, some of them at the image's edges, in three
    strips across the image (down it when ``transpose``)."""
    h, w = (int(v) for v in rng.integers(40, 160, 2))
    transpose = rng.random() < 0.5
    if transpose:
        h, w = w, h
    img = np.zeros((h, w, 3), np.uint8)
    strips = [0, *np.sort(rng.choice(np.arange(1, w), 2, replace=False)), w]
    boxes = []
    for k in (1, 2, 3):
        x1, x2 = np.sort(rng.choice(np.arange(strips[k - 1], strips[k] + 1), 2, replace=False))
        y1, y2 = np.sort(rng.choice(h + 1, 2, replace=False))
        img[y1:y2, x1:x2] = COLOURS[k]
        boxes.append((x1, y1, x2, y2) if not transpose else (y1, x1, y2, x2))
    if transpose:
        img = np.ascontiguousarray(img.transpose(1, 0, 2))
    labels = np.array([1, 2, 3], np.int64)
    target = {
        "boxes": np.array(boxes, np.float32).reshape(-1, 4),
        "labels": labels,
        "iscrowd": (labels == 2).astype(np.uint8),
        "image_id": 7,
    }
    return img, target


@pytest.mark.parametrize("make", CROPS)
def test_boxes_still_bound_their_rectangles_after_crop_and_flip(make):
    transform = Compose([make(), RandomHorizontalFlip()])
    rng = np.random.default_rng(2)
    for seed in SEEDS:
        img, target = rectangle_image(rng)
        torch.manual_seed(seed)
        out, moved = transform((img, read_only(target)))
        classes = classes_of(out)
        boxes, labels = moved["boxes"], moved["labels"]
        assert boxes.dtype == np.float32 and boxes.shape == (len(labels), 4)
        assert np.array_equal(moved["iscrowd"], (labels == 2).astype(np.uint8))
        assert moved["image_id"] == 7
        assert (boxes[:, 2:] > boxes[:, :2]).all()
        assert (boxes >= 0).all() and (boxes[:, [2, 3]] <= (out.shape[1], out.shape[0])).all()
        for k in (1, 2, 3):
            seen = np.argwhere(classes == k)
            if k not in labels:  # cut away: none of its pixels show
                assert not len(seen), seed
                continue
            x1, y1, x2, y2 = boxes[list(labels).index(k)]
            if not len(seen):  # a sliver under a pixel: no pixel of its colour
                assert min(x2 - x1, y2 - y1) < 1.5, seed
                continue
            (top, left), (bottom, right) = seen.min(axis=0), seen.max(axis=0) + 1
            assert np.allclose((left, top, right, bottom), (x1, y1, x2, y2), atol=1.0), (seed, k)


def test_boxes_cut_away_are_dropped_with_their_rows_and_the_rest_moved_exactly():
    # the centre crop of a 60 x 200 image is its columns 70 to 130, resized 60 -> 30
    img = np.zeros((60, 200, 3), np.uint8)
    target = read_only(
        {
            "boxes": np.array(
                [[5, 10, 30, 50], [90, 0, 140, 30], [170, 20, 195, 40], [60, 5, 70, 9]],
                np.float32,
            ),
            "labels": np.array([7, 8, 9, 10]),
            "iscrowd": np.array([0, 1, 0, 0], np.uint8),
            "area": np.array([1000.0, 1500.0, 500.0, 40.0], np.float32),
            "keypoints": np.zeros((4, 2, 3), np.float32),  # not a per-box key: passed through
            "names": ["a", "b", "c", "d"],
        }
    )
    crop = CenterResizedCrop(30, ratio=1.0)
    _, moved = crop((img, target))
    # the second box: x (90 - 70) / 2 = 10 to (140 - 70) / 2 = 35, clipped to 30; y halved.
    # the fourth ends at the box's left edge: no width left.
    assert np.array_equal(moved["boxes"], np.array([[10, 0, 30, 15]], np.float32))
    assert moved["labels"].tolist() == [8] and moved["iscrowd"].tolist() == [1]
    assert moved["area"].tolist() == [1500.0]  # the rows kept, not recomputed
    assert moved["keypoints"] is target["keypoints"] and moved["names"] is target["names"]
    _, flipped = RandomHorizontalFlip(p=1.0)((img, target))
    assert flipped["boxes"][:, [0, 2]].tolist() == [[170, 195], [60, 110], [5, 30], [130, 140]]
    assert flipped["labels"] is target["labels"]
    assert flip_target({"boxes": np.zeros((0, 4), np.float32)}, 9)["boxes"].shape == (0, 4)


def test_the_image_is_cropped_as_without_a_target_from_the_same_draws():
    """The image-only call is the one it was (a box from ``draws`` of torch's float64
    numbers, a flip from one more); a target changes neither the draws nor the pixels."""
    img, mask = class_image(np.random.default_rng(3))
    for make in CROPS:
        crop, flip = make(), RandomHorizontalFlip()
        for seed in range(5):
            torch.manual_seed(seed)
            u = torch.rand(crop.draws, dtype=torch.float64).tolist() if crop.draws else ()
            box = crop.box(*img.shape[:2], u)
            flips = torch.rand(1).item() < 0.5
            expected = resized_crop(img, box, crop.size)
            expected = expected[:, ::-1] if flips else expected
            torch.manual_seed(seed)
            alone = flip(crop(img))
            torch.manual_seed(seed)
            paired, target = Compose([crop, flip])((img, {"mask": mask}))
            assert np.array_equal(alone, expected) and np.array_equal(paired, expected)
            assert target["mask"].shape == crop.size


def test_targets_are_new_dicts_and_other_targets_pass_through():
    img, mask = class_image(np.random.default_rng(4))
    target = read_only({"mask": mask, "boxes": np.array([[1, 1, 9, 9]], np.float32)})
    before = dict(target)
    for t in [RandomResizedCrop(16), CenterResizedCrop(16)]:
        _, moved = t((img, target))
        assert moved is not target and target == before
    _, moved = RandomHorizontalFlip(p=1.0)((img, target))
    assert moved is not target and target == before
    assert moved["mask"].flags.c_contiguous
    # a class index, or None, passes through untouched
    assert RandomResizedCrop(16)((img, 3))[1] == 3
    assert RandomHorizontalFlip(p=1.0)((img, None))[1] is None


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_an_i420_record_s_crop_takes_a_given_box_and_its_target_moves_with_it(interpolation):
    """What the dataset does for a YUV record: draw the box, convert only it (in the crop's
    interpolation, in RGB or BGR), move the target."""
    rng = np.random.default_rng(6)
    h, w = 61, 90
    y = rng.integers(0, 256, (h, w), np.uint8)
    cb, cr = (rng.integers(0, 256, ((h + 1) // 2, (w + 1) // 2), np.uint8) for _ in range(2))
    mask = rng.integers(0, 5, (h, w), np.uint8)
    rgb = px.yuv420_to_rgb(y, cb, cr)
    crop = RandomResizedCrop((30, 40), interpolation=interpolation)
    torch.manual_seed(0)
    drawn = crop.crop_planes(y, cb, cr)
    torch.manual_seed(0)
    box = crop.draw(h, w)
    given = crop.crop_planes(y, cb, cr, box=box)
    moved = crop.crop_target(box, (h, w), {"mask": mask})
    torch.manual_seed(0)
    img, target = crop((rgb, {"mask": mask}))
    assert np.array_equal(given, drawn) and np.array_equal(given, img)
    assert np.array_equal(moved["mask"], target["mask"])
    assert np.array_equal(crop.crop_planes(y, cb, cr, "bgr", box=box), given[..., ::-1])


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ((np.zeros((8, 8, 3), np.uint8), {"mask": np.zeros((8, 7), np.uint8)}), "mask is"),
        ((np.zeros((8, 8, 3), np.uint8), {"boxes": np.zeros((2, 3))}), r"\(N, 4\)"),
        (
            (np.zeros((8, 8, 3), np.uint8), {"boxes": np.zeros((2, 4)), "labels": [1]}),
            "'labels' has 1 rows for 2 boxes",
        ),
        ((np.zeros((8, 8, 3), np.uint8), {}, 3), "a tuple of 3"),
    ],
)
def test_malformed_targets_are_refused(sample, message):
    with pytest.raises(ValueError, match=message):
        RandomResizedCrop(4)(sample)


@pytest.mark.parametrize("rows", [list, tuple])
def test_per_box_rows_in_lists_and_tuples_drop_with_their_boxes(rows):
    # the crop keeps box 1 only (as above); a target without "labels" still filters the rest
    img = np.zeros((60, 200, 3), np.uint8)
    boxes = np.array([[5, 10, 30, 50], [90, 0, 140, 30], [170, 20, 195, 40]], np.float32)
    target = {"boxes": boxes, "iscrowd": rows([0, 1, 0]), "area": rows([1.0, 2.0, 3.0])}
    _, moved = CenterResizedCrop(30, ratio=1.0)((img, target))
    assert moved["iscrowd"] == rows([1]) and moved["area"] == rows([2.0])
    assert type(moved["iscrowd"]) is rows and target["iscrowd"] == rows([0, 1, 0])


def test_a_mask_of_several_planes_moves_with_its_image_and_its_size_is_checked():
    # an H x W x K mask (one plane per instance): each plane moved as a 2-D mask is
    rng = np.random.default_rng(5)
    planes = rng.integers(0, 4, (40, 48, 2), dtype=np.uint8)
    img = np.zeros((40, 48, 3), np.uint8)
    _, moved = CenterResizedCrop(16)((img, {"mask": planes}))
    for k in range(2):
        _, alone = CenterResizedCrop(16)((img, {"mask": planes[..., k]}))
        assert np.array_equal(moved["mask"][..., k], alone["mask"])
    wrong = np.zeros((40, 47, 2), np.uint8)
    with pytest.raises(
        ValueError, match=r"mask is \(40, 47\) \(height, width\), its image \(40, 48\)"
    ):
        CenterResizedCrop(16)((img, {"mask": wrong}))


def test_the_flip_refuses_a_mask_of_another_width():
    target = {"mask": np.zeros((8, 7, 2), np.uint8)}
    with pytest.raises(ValueError, match=r"mask is \(8, 7\) \(height, width\), its image 8 wide"):
        flip_target(target, 8)
    assert flip_target({"mask": np.arange(8).reshape(1, 8)}, 8)["mask"].tolist() == [
        list(range(7, -1, -1))
    ]
