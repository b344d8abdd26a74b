"""Tests for mmcache.sample_data: layout, determinism, decodability, photo-like JPEG sizes."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np
import pytest

from mmcache.sample_data import make_image_folder, make_photo

Q90 = [cv2.IMWRITE_JPEG_QUALITY, 90]


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_layout(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "imgs", classes=3, per_class=4, size=(24, 32))
    assert root == tmp_path / "imgs"
    assert isinstance(root, Path)
    assert sorted(os.listdir(root)) == ["class_00", "class_01", "class_02"]
    for folder in root.iterdir():
        assert sorted(os.listdir(folder)) == [f"img_{i:05d}.jpg" for i in range(4)]


def test_names_sort_numerically_with_many_classes(tmp_path: Path) -> None:
    make_image_folder(tmp_path, classes=101, per_class=1, size=(8, 8))
    names = sorted(os.listdir(tmp_path))
    assert names == [f"class_{c:03d}" for c in range(101)]


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    kwargs = {"classes": 2, "per_class": 3, "size": (64, 96)}
    a = _files(make_image_folder(tmp_path / "a", seed=7, **kwargs))
    b = _files(make_image_folder(tmp_path / "b", seed=7, **kwargs))
    c = _files(make_image_folder(tmp_path / "c", seed=8, **kwargs))
    assert len(a) == 6
    assert [p.relative_to(tmp_path / "a") for p in a] == [p.relative_to(tmp_path / "b") for p in b]
    assert all(p.read_bytes() == q.read_bytes() for p, q in zip(a, b, strict=True))
    assert all(p.read_bytes() != q.read_bytes() for p, q in zip(a, c, strict=True))
    # Images within one call differ too.
    assert len({p.read_bytes() for p in a}) == len(a)


def test_image_does_not_depend_on_per_class(tmp_path: Path) -> None:
    a = make_image_folder(tmp_path / "a", classes=2, per_class=2, size=(30, 40))
    b = make_image_folder(tmp_path / "b", classes=2, per_class=5, size=(30, 40))
    for p in _files(a):
        assert p.read_bytes() == (b / p.relative_to(a)).read_bytes()


@pytest.mark.parametrize(
    "size", [(1, 1), (8, 8), (7, 13), (13, 7), (40, 1), (48, 64), (199, 301), (1501, 1999)]
)
def test_every_file_decodes_to_the_requested_size(tmp_path: Path, size: tuple[int, int]) -> None:
    per_class = 1 if size[0] > 1000 else 2
    root = make_image_folder(tmp_path, classes=2, per_class=per_class, size=size)
    files = _files(root)
    assert len(files) == 2 * per_class
    for p in files:
        img = cv2.imread(str(p), cv2.IMREAD_COLOR)
        assert img is not None, p
        assert img.shape == (*size, 3)  # size is (height, width)
        assert img.dtype == np.uint8


def test_jpeg_size_is_photo_like(tmp_path: Path) -> None:
    # At 720x480, quality 90, photographs are roughly 80-200 KB; the generator's median is
    # ~118 KB. The band is the point: flat colours and white noise both fall outside it.
    files = _files(make_image_folder(tmp_path, classes=4, per_class=2, quality=90))
    assert len(files) == 8
    sizes = [p.stat().st_size for p in files]
    assert all(40_000 <= s <= 300_000 for s in sizes), sizes
    assert 70_000 <= float(np.median(sizes)) <= 200_000, sizes
    flat = np.full((480, 720, 3), (40, 120, 200), np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (480, 720, 3), dtype=np.uint8)
    assert len(cv2.imencode(".jpg", flat, Q90)[1]) < 40_000
    assert len(cv2.imencode(".jpg", noise, Q90)[1]) > 300_000


def test_quality_changes_size(tmp_path: Path) -> None:
    kwargs = {"classes": 1, "per_class": 2, "size": (120, 160)}
    lo = _files(make_image_folder(tmp_path / "lo", quality=50, **kwargs))
    hi = _files(make_image_folder(tmp_path / "hi", quality=95, **kwargs))
    assert all(p.stat().st_size < q.stat().st_size for p, q in zip(lo, hi, strict=True))


def test_png_holds_the_same_pixels(tmp_path: Path) -> None:
    kwargs = {"classes": 2, "per_class": 2, "size": (48, 72)}
    pngs = _files(make_image_folder(tmp_path / "png", ext=".png", **kwargs))
    jpgs = _files(make_image_folder(tmp_path / "jpg", **kwargs))
    assert [p.name for p in pngs] == [f"img_{i:05d}.png" for i in (0, 1)] * 2
    for png, jpg in zip(pngs, jpgs, strict=True):
        img = cv2.imread(str(png), cv2.IMREAD_COLOR)
        assert img.shape == (48, 72, 3)
        # ext changes only the encoding: the PNG's pixels encode to the JPEG's bytes.
        assert cv2.imencode(".jpg", img, Q90)[1].tobytes() == jpg.read_bytes()


def test_ext_is_case_insensitive(tmp_path: Path) -> None:
    files = _files(make_image_folder(tmp_path, classes=1, per_class=1, size=(16, 16), ext=".JPEG"))
    assert [p.name for p in files] == ["img_00000.jpeg"]
    assert cv2.imread(str(files[0])).shape == (16, 16, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"classes": 0},
        {"per_class": 0},
        {"size": (0, 10)},
        {"size": (10, -1)},
        {"quality": 101},
        {"quality": -1},
        {"seed": -1},
        {"ext": ".gif"},
        {"ext": "jpg"},
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_image_folder(tmp_path, **{"per_class": 1, "size": (8, 8), **kwargs})
    assert not any(tmp_path.iterdir())


def test_classes_have_their_own_hue(tmp_path: Path) -> None:
    # Three classes: hues 0, 120 and 240 degrees, i.e. red, green and blue dominate.
    root = make_image_folder(tmp_path, classes=3, per_class=6, size=(48, 64))
    for c, channel in enumerate((2, 1, 0)):  # BGR index of red, green, blue
        imgs = [cv2.imread(str(p)) for p in _files(root / f"class_{c:02d}")]
        means = np.mean([img.reshape(-1, 3).mean(axis=0) for img in imgs], axis=0)
        assert int(np.argmax(means)) == channel, (c, means)


def test_make_photo() -> None:
    img = make_photo(np.random.default_rng(3), 30, 50)  # height, width
    assert img.shape == (30, 50, 3)
    assert img.dtype == np.uint8
    assert np.array_equal(img, make_photo(np.random.default_rng(3), 30, 50))
    assert not np.array_equal(img, make_photo(np.random.default_rng(4), 30, 50))
    assert img.std() > 5  # not flat
    green = np.mean(
        [make_photo(np.random.default_rng(s), 48, 64, hue=120.0) for s in range(5)], axis=(0, 1, 2)
    )
    assert int(np.argmax(green)) == 1
    with pytest.raises(ValueError):
        make_photo(np.random.default_rng(0), 0, 10)
