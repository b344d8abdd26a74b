"""BatchLoader's one fill path: each record, of either layout, with its mask, in one view or
several, equals the crop of the image cv2 decodes, spelled out here with cv2 and numpy."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import make_folder, reference, write_image

from mmcache import BatchLoader, MemmapImageDataset, RandomResizedCrop, build_cache
from mmcache.sample_data import make_segmentation_set

# Odd and even sides: an I420 record's last chroma row or column then covers one pixel.
SIZES = {"a": [(64, 48), (61, 47), (40, 33)], "b": [(33, 20), (50, 37), (48, 64)]}
OUT = (24, 20)


def _crop(size: tuple[int, int] = OUT) -> RandomResizedCrop:
    # OpenCV's bilinear (no antialiasing): the reference below is one cv2.resize
    return RandomResizedCrop(size, scale=(0.2, 1.0), interpolation="bilinear", antialias=False)


def _image(path: Path, pixels: str) -> np.ndarray:
    """What a record of ``path`` reads back as: cv2's decode (RGB), or for I420 its planes as
    the stated rule makes them (JFIF YCrCb, the 2 x 2 means of an edge-replicated image), the
    chroma upsampled 2x bilinearly and converted back."""
    if pixels == "rgb":
        return reference(path)
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
    h, w = bgr.shape[:2]
    ch, cw = (h + 1) // 2, (w + 1) // 2
    ycc = cv2.cvtColor(bgr, cv2.COLOR_BGR2YCrCb)
    padded = cv2.copyMakeBorder(ycc, 0, 2 * ch - h, 0, 2 * cw - w, cv2.BORDER_REPLICATE)
    half = cv2.resize(padded, (cw, ch), interpolation=cv2.INTER_AREA)
    up = cv2.resize(half, (2 * cw, 2 * ch), interpolation=cv2.INTER_LINEAR)[:h, :w]
    merged = np.ascontiguousarray(np.dstack([ycc[..., 0], up[..., 1], up[..., 2]]))
    return cv2.cvtColor(merged, cv2.COLOR_YCrCb2RGB)


def _cropped(img: np.ndarray, box, flipped: bool, size: tuple[int, int] = OUT) -> np.ndarray:
    top, left, height, width = (int(v) for v in box)
    out = cv2.resize(np.ascontiguousarray(img[top : top + height, left : left + width]),
                     size[::-1], interpolation=cv2.INTER_LINEAR)  # fmt: skip
    return out[:, ::-1] if flipped else out


def _nearest(mask: np.ndarray, box, flipped: bool, size: tuple[int, int] = OUT) -> np.ndarray:
    """A mask's box resized by the pixel under each output pixel's centre (nearest-exact)."""
    top, left, height, width = (int(v) for v in box)
    rows = top + np.floor((np.arange(size[0]) + 0.5) * height / size[0]).astype(int)
    cols = left + np.floor((np.arange(size[1]) + 0.5) * width / size[1]).astype(int)
    out = mask[np.ix_(rows, cols)]
    return out[:, ::-1] if flipped else out


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("fill") / "src", SIZES)


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> tuple[Path, Path]:
    return make_segmentation_set(tmp_path_factory.mktemp("seg"), images=5, size=(47, 61))


def _open(tmp_path: Path, source: Path, pixels: str, lazy: bool, **kw) -> MemmapImageDataset:
    """A cache of ``source``: built, or lazy (every record read the first time through the
    reader, which fills it)."""
    if lazy:
        return MemmapImageDataset(tmp_path / "c", source=source, pixels=pixels, **kw)
    build_cache(source, tmp_path / "c", workers=0, pixels=pixels, **kw)
    return MemmapImageDataset(tmp_path / "c")


@pytest.mark.parametrize("pixels", ["rgb", "yuv420"])
@pytest.mark.parametrize("read,lazy", [("mmap", False), ("pread", False), ("mmap", True)])
def test_a_cropped_record_and_its_mask_equal_cv2_s_crop(seg, tmp_path, pixels, read, lazy):
    images, masks = seg
    ds = _open(tmp_path, images, pixels, lazy, masks=masks)
    loader = BatchLoader(ds, 2, shuffle=True, seed=5, crop=_crop(), flip=True, read=read)
    for b, (got, target) in enumerate(loader):
        idx, boxes, flips = loader.draw_batch(b)
        for k, i in enumerate(idx):
            path = ds.samples[int(i)][0]
            want = _cropped(_image(Path(path), pixels), boxes[k], bool(flips[k]))
            np.testing.assert_array_equal(got[k].numpy(), want, err_msg=f"{path} {pixels}")
            mask = cv2.imread(str(masks / (Path(path).stem + ".png")), cv2.IMREAD_UNCHANGED)
            want = _nearest(mask, boxes[k], bool(flips[k]))
            np.testing.assert_array_equal(target["mask"][k].numpy(), want, err_msg=path)


@pytest.mark.parametrize("pixels", ["rgb", "yuv420"])
@pytest.mark.parametrize("read,lazy", [("mmap", False), ("pread", False), ("mmap", True)])
def test_every_view_of_a_record_equals_cv2_s_crop(src, tmp_path, pixels, read, lazy):
    ds = _open(tmp_path, src, pixels, lazy)
    sizes = [OUT, (16, 16), (16, 16)]
    # In order (no shuffle): sample k of batch b is record 4 b + k.
    loader = BatchLoader(ds, 4, seed=2, flip=True, read=read, return_params=True,
                         views=[(_crop(sizes[0]), 1), (_crop(sizes[1]), 2)])  # fmt: skip
    for b, (views, params, labels) in enumerate(loader):
        assert [tuple(v.shape[1:3]) for v in views] == sizes
        for view, view_params, size in zip(views, params, sizes, strict=True):
            for k, row in enumerate(view_params.tolist()):
                path, label = ds.samples[4 * b + k]
                assert int(labels[k]) == label
                want = _cropped(_image(Path(path), pixels), row[:4], bool(row[4]), size)
                np.testing.assert_array_equal(view[k].numpy(), want, err_msg=f"{path} {pixels}")


@pytest.mark.parametrize("pixels", ["rgb", "yuv420"])
@pytest.mark.parametrize("read", ["mmap", "pread"])
def test_a_whole_record_equals_cv2_s_image(tmp_path, pixels, read):
    # Records of one shape (odd sides), each with a mask of its own.
    images, masks = tmp_path / "images", tmp_path / "masks"
    masks.mkdir()
    for k in range(5):
        write_image(images / f"img_{k}.jpg", 61, 47, seed=k)
        labels = (np.arange(47)[:, None] // 8 + np.arange(61)[None] // (5 + k)) % 4
        cv2.imwrite(str(masks / f"img_{k}.png"), labels.astype(np.uint8))
    ds = _open(tmp_path, images, pixels, False, masks=masks)
    loader = BatchLoader(ds, 2, shuffle=True, seed=1, flip=True, read=read)
    for b, (got, target) in enumerate(loader):
        idx, boxes, flips = loader.draw_batch(b)
        assert boxes is None
        for k, i in enumerate(idx):
            path = Path(ds.samples[int(i)][0])
            want = _image(path, pixels)
            mask = cv2.imread(str(masks / (path.stem + ".png")), cv2.IMREAD_UNCHANGED)
            if flips[k]:
                want, mask = want[:, ::-1], mask[:, ::-1]
            np.testing.assert_array_equal(got[k].numpy(), want, err_msg=f"{path} {pixels}")
            np.testing.assert_array_equal(target["mask"][k].numpy(), mask, err_msg=str(path))
