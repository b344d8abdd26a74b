"""A crop written outside the package plugs into BatchLoader through ``mmcache.Crop`` alone:
its boxes are the ones cropped (checked against numpy's slice and OpenCV's resize, not against
mmcache's own crops), and what is not a crop, or a crop that breaks the protocol, is refused
in one line."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from mmcache import BatchLoader, Crop, MemmapImageDataset, RandomResizedCrop, build_cache


class TopLeftCrop:
    """The top-left quarter of each image (half its height, half its width, at least a pixel),
    resized to ``size`` by OpenCV's bilinear kernel. Inherits from nothing: the protocol's
    four members are all it has."""

    draws = 0  # a fixed box: no random numbers
    kernel = ("bilinear", False)  # OpenCV's INTER_LINEAR, as the reference below resizes

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        hw = np.asarray(shapes)[:, :2].astype(np.int64)
        half = np.maximum(hw // 2, 1)
        return np.column_stack([np.zeros_like(half), half]).astype(np.int64)


class OffsetCrop(TopLeftCrop):
    """Takes one number per box, and gets the box wrong: it starts at its image's bottom edge,
    past the pixels, which the loader must refuse (not read the next record's bytes)."""

    draws = 1

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        boxes = super().boxes(shapes, uniforms)
        boxes[:, 0] = np.asarray(shapes)[:, 0]  # every box starts below its image
        return boxes


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from conftest import make_folder

    root = tmp_path_factory.mktemp("crop_protocol")
    sizes = [(64, 48), (48, 64), (40, 40), (33, 17), (1, 5)]  # (width, height)
    src = make_folder(root / "src", {"a": sizes, "b": sizes})
    build_cache(src, root / "cache", workers=1)
    return root / "cache"


def reference(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The top-left quarter, by numpy's slice, resized by OpenCV."""
    h, w = image.shape[:2]
    box = image[: max(h // 2, 1), : max(w // 2, 1)]
    out = cv2.resize(box, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return out.reshape(*size, image.shape[2])


def test_a_crop_of_ones_own_is_a_crop_and_mmcache_s_are_too():
    assert isinstance(TopLeftCrop((8, 8)), Crop)
    assert isinstance(RandomResizedCrop(8), Crop)
    assert not isinstance(lambda x: x, Crop)


def test_a_crop_of_ones_own_gives_its_boxes_resized(cache):
    ds = MemmapImageDataset(cache)
    size = (12, 10)
    loader = BatchLoader(ds, 3, crop=TopLeftCrop(size), num_threads=2)
    images = torch.cat([batch for batch, _ in loader]).numpy()
    assert images.shape == (len(ds), *size, 3)
    for i in range(len(ds)):
        np.testing.assert_array_equal(images[i], reference(ds[i][0], size), err_msg=f"image {i}")


def test_a_crop_of_ones_own_is_a_view_and_its_size_can_change(cache):
    ds = MemmapImageDataset(cache)
    crop = TopLeftCrop((6, 6))
    loader = BatchLoader(ds, 4, views=[(crop, 1), (RandomResizedCrop(1), 1)], seed=0)
    for views, _ in loader:
        assert [tuple(v.shape[1:3]) for v in views] == [(6, 6), (1, 1)]
    crop.size = (9, 7)  # between epochs: the loader's buffers follow
    views, _ = next(iter(loader))
    assert tuple(views[0].shape[1:3]) == (9, 7)
    np.testing.assert_array_equal(views[0][0].numpy(), reference(ds[0][0], (9, 7)))


@pytest.mark.parametrize("crop", [lambda x: x, object(), "RandomResizedCrop(8)"])
def test_what_is_not_a_crop_is_refused_in_one_line(cache, crop):
    ds = MemmapImageDataset(cache)
    with pytest.raises(ValueError) as caught:
        BatchLoader(ds, 2, crop=crop)
    message = str(caught.value)
    assert message.startswith("crop must be mmcache.RandomResizedCrop or CenterResizedCrop, got ")
    assert "\n" not in message
    with pytest.raises(ValueError, match="views must be"):
        BatchLoader(ds, 2, views=[(crop, 1)])


def test_a_crop_without_a_kernel_is_refused_before_any_batch(cache):
    class NoKernel:  # was accepted, and failed in a filling thread
        draws, size = 0, (4, 4)

        def boxes(self, shapes, uniforms):
            return np.zeros((len(shapes), 4), np.int64)

    with pytest.raises(ValueError, match="crop must be"):
        BatchLoader(MemmapImageDataset(cache), 2, crop=NoKernel())


@pytest.mark.parametrize("draws", [-1, 23, 1.5, True])
def test_a_crop_asking_for_more_numbers_than_a_sample_has_is_refused(cache, draws):
    crop = TopLeftCrop((4, 4))
    crop.draws = draws
    with pytest.raises(ValueError, match=r"draws must be an int from 0 to 22"):
        BatchLoader(MemmapImageDataset(cache), 2, crop=crop)


def test_a_box_outside_its_image_stops_the_iteration_with_its_box(cache):
    loader = BatchLoader(MemmapImageDataset(cache), 2, crop=OffsetCrop((4, 4)))
    with pytest.raises(ValueError, match=r"a box must lie inside its image"):
        for _ in loader:
            pass


class WrongBoxes(TopLeftCrop):
    """Gives what ``make`` makes of the right boxes: another dtype or shape."""

    def __init__(self, size, make) -> None:
        super().__init__(size)
        self.make = make

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        return self.make(super().boxes(shapes, uniforms))


@pytest.mark.parametrize(
    ("make", "found"),
    [
        (lambda b: b.astype(np.float32), "float32 (2, 4)"),  # the right shape, not integers
        (lambda b: b[:, :3], "int64 (2, 3)"),  # integers, not 4 a box
        (lambda b: b[:1], "int64 (1, 4)"),  # a box short
        (lambda b: b.astype(np.float64)[:, :3], "float64 (2, 3)"),  # neither
    ],
)
def test_boxes_that_are_not_an_n_by_4_int_array_stop_the_iteration_in_one_line(cache, make, found):
    crop = WrongBoxes((4, 4), make)
    loader = BatchLoader(MemmapImageDataset(cache), 2, crop=crop, shuffle=False)
    with pytest.raises(ValueError) as refused:
        next(iter(loader))
    assert str(refused.value) == (
        f"{crop!r}.boxes gave an array of {found} for 2 records: it must give an N x 4 int "
        "array (top, left, height, width)"
    )


class FixedBox(TopLeftCrop):
    """Gives every image the box ``make(height, width)``."""

    def __init__(self, size, make) -> None:
        super().__init__(size)
        self.make = make

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        return np.array([self.make(int(h), int(w)) for h, w, _ in shapes], np.int64)


@pytest.mark.parametrize(
    "make",
    [
        lambda h, w: (-1, 0, 1, 1),  # above the image
        lambda h, w: (0, -1, 1, 1),  # left of it
        lambda h, w: (0, 0, 0, 1),  # no rows
        lambda h, w: (0, 0, 1, 0),  # no columns
        lambda h, w: (1, 0, h, 1),  # a row past the bottom
        lambda h, w: (0, 1, 1, w),  # a column past the right edge
    ],
    ids=["top", "left", "height", "width", "bottom", "right"],
)
def test_each_edge_a_box_crosses_stops_the_iteration_with_the_box_and_its_image(cache, make):
    crop = FixedBox((4, 4), make)
    ds = MemmapImageDataset(cache)
    height, width, _ = ds.read(0).shape  # the first record of the first batch
    with pytest.raises(ValueError) as refused:
        next(iter(BatchLoader(ds, 2, crop=crop, shuffle=False)))
    assert str(refused.value) == (
        f"{crop!r}.boxes gave the box (top, left, height, width) {list(make(height, width))} "
        f"for an image of {height} x {width}: a box must lie inside its image, at least 1 x 1"
    )


def test_a_box_on_every_edge_of_its_image_is_inside(cache):
    """The whole image, and a 1 x 1 box in its bottom right corner."""
    ds = MemmapImageDataset(cache)
    for make in (lambda h, w: (0, 0, h, w), lambda h, w: (h - 1, w - 1, 1, 1)):
        images, _ = next(iter(BatchLoader(ds, 2, crop=FixedBox((4, 4), make), shuffle=False)))
        assert images.shape == (2, 4, 4, 3)
