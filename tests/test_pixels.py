"""Correct pixels: every record equals OpenCV's own decode plus the recorded preprocessing."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import reference, write_image

from mmcache import MemmapImageDataset, build_cache


def test_every_shared_testimage_matches_opencv(testimages, tmp_path):
    # keep_truncated: truncated_jpeg.jpg kept, as OpenCV decodes it (its missing part grey)
    report = build_cache(testimages, tmp_path / "cache", workers=1, keep_truncated=True)
    ds = MemmapImageDataset(tmp_path / "cache")
    decodable = [p for p in sorted(testimages.iterdir()) if cv2.imread(str(p)) is not None]
    assert len(ds) == len(decodable) == report.images
    for (path, _label), (img, _) in zip(ds.samples, (ds[i] for i in range(len(ds))), strict=True):
        ref = reference(path)
        assert img.shape == ref.shape, path
        assert np.array_equal(img, ref), path
    assert [s["path"] for s in report.skipped] == ["broken.png"]


def test_exif_orientation_is_applied_to_the_real_files(testimages, tmp_path):
    # hopper_orientation_{3,6,8}.jpg are hopper.jpg stored rotated (180 degrees, 90 one way,
    # 90 the other) with an EXIF Orientation saying how to turn it upright: the cache must hold
    # hopper upright. Each lies within 5 levels (mean) of hopper.jpg upright, 74 or more of it
    # turned any other way; hopper.jpg has no Orientation tag.
    build_cache(testimages, tmp_path / "cache", workers=1)
    ds = MemmapImageDataset(tmp_path / "cache")
    served = {Path(p).name: ds[i][0].astype(int) for i, (p, _) in enumerate(ds.samples)}
    upright = cv2.cvtColor(cv2.imread(str(testimages / "hopper.jpg")), cv2.COLOR_BGR2RGB)
    for n in (3, 6, 8):
        img = served[f"hopper_orientation_{n}.jpg"]
        off = [float(np.abs(img - np.rot90(upright.astype(int), k)).mean()) for k in range(4)]
        assert off[0] < 20 and min(off[1:]) > 50, (n, off)


@pytest.mark.parametrize(
    ("orientation", "corner"),
    # where the stored top-left corner shows once the image is turned upright
    [(1, "top left"), (3, "bottom right"), (6, "top right"), (8, "bottom left")],
)
def test_exif_orientation_moves_a_marked_corner(tmp_path, orientation, corner):
    from PIL import Image

    stored = np.zeros((20, 40, 3), np.uint8)  # 40 wide, 20 high, as stored
    stored[:6, :6] = 255  # a white marker in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    (tmp_path / "src").mkdir()
    Image.fromarray(stored).save(tmp_path / "src" / "marked.jpg", quality=95, exif=exif)
    build_cache(tmp_path / "src", tmp_path / "cache", workers=1)
    img = MemmapImageDataset(tmp_path / "cache")[0][0]
    # 6 and 8 turn it by 90 degrees: 20 wide and 40 high
    assert img.shape == ((20, 40, 3) if orientation in (1, 3) else (40, 20, 3))
    h, w = img.shape[:2]
    corners = {
        "top left": img[:3, :3],
        "top right": img[:3, w - 3 :],
        "bottom left": img[h - 3 :, :3],
        "bottom right": img[h - 3 :, w - 3 :],
    }
    for name, pixels in corners.items():
        assert (pixels.min() > 200) if name == corner else (pixels.max() < 60), (name, pixels)


# (width, height) of each test image with --short-side 64, worked out by hand from its size as
# OpenCV decodes it: the short side becomes 64, the other is rounded to the nearest integer;
# a short side already at most 64 is kept.
SHORT_SIDE_64 = {
    "exif_imagemagick_orientation.png": (64, 64),  # 512x512
    "flower.jpg": (85, 64),  # 480x360: 480 * 64 / 360 = 85.33
    "hopper.jpg": (64, 64),  # 128x128, as are the other hoppers
    "hopper.png": (64, 64),
    "hopper_16bit_qtables.jpg": (64, 64),
    "hopper_gray.jpg": (64, 64),
    "hopper_orientation_3.jpg": (64, 64),
    "hopper_orientation_6.jpg": (64, 64),
    "hopper_orientation_8.jpg": (64, 64),
    "junk_jpeg_header.jpg": (85, 64),  # 1024x768: 85.33
    "pil123rgba.png": (69, 64),  # 162x150: 162 * 64 / 150 = 69.12
    "pil_sample_cmyk.jpg": (64, 64),  # 100x100
    "tga__common__200x32_la.png": (200, 32),  # short side 32: kept
    "tiff_16bit_RGB_target.png": (100, 40),  # short side 40: kept
    "truncated_jpeg.jpg": (64, 64),  # 100x100
}


@pytest.mark.parametrize("color", ["rgb", "bgr", "gray"])
def test_testimages_in_every_color_mode(testimages, tmp_path, color):
    build_cache(
        testimages, tmp_path / "cache", color=color, short_side=64, workers=1, keep_truncated=True
    )
    ds = MemmapImageDataset(tmp_path / "cache")
    assert sorted(Path(p).name for p, _ in ds.samples) == sorted(SHORT_SIDE_64)
    for i, (path, _) in enumerate(ds.samples):
        size = SHORT_SIDE_64[Path(path).name]
        ref = reference(path, color=color, size=size, interpolation=cv2.INTER_AREA)
        got = ds[i][0]
        assert (got.shape[1], got.shape[0]) == size, path
        assert got.shape == ref.shape and got.shape[2] == (1 if color == "gray" else 3)
        assert np.array_equal(got, ref), path


# (source width, height), options, expected (width, height), interpolation used
CASES = [
    ((720, 480), {}, (720, 480), None),
    ((720, 480), {"size": (224, 224)}, (224, 224), cv2.INTER_AREA),
    ((100, 60), {"size": (120, 200)}, (200, 120), cv2.INTER_LINEAR),  # enlarging: linear
    ((720, 480), {"max_side": 360}, (360, 240), cv2.INTER_AREA),
    ((480, 720), {"max_side": 100}, (67, 100), cv2.INTER_AREA),
    ((300, 200), {"max_side": 512}, (300, 200), None),  # never upscale
    ((720, 480), {"short_side": 256}, (384, 256), cv2.INTER_AREA),
    ((479, 721), {"short_side": 100}, (100, 151), cv2.INTER_AREA),
    ((100, 80), {"short_side": 256}, (100, 80), None),  # never upscale
    ((150, 100), {"short_side": 25}, (38, 25), cv2.INTER_AREA),  # 37.5: a half rounds up
    ((101, 33), {"max_side": 50}, (50, 16), cv2.INTER_AREA),  # 33 * 50 / 101 = 16.34
    ((3, 1000), {"short_side": 2}, (2, 667), cv2.INTER_AREA),  # 1000 * 2 / 3 = 666.67
    ((1000, 3), {"max_side": 100}, (100, 1), cv2.INTER_AREA),  # 0.3: never less than 1 pixel
    ((720, 480), {"size": (64, 64), "interpolation": "bicubic"}, (64, 64), cv2.INTER_CUBIC),
    ((720, 480), {"size": (64, 64), "interpolation": "nearest"}, (64, 64), cv2.INTER_NEAREST),
    ((720, 480), {"size": (64, 64), "interpolation": "lanczos"}, (64, 64), cv2.INTER_LANCZOS4),
    ((720, 480), {"size": (64, 64), "interpolation": "bilinear"}, (64, 64), cv2.INTER_LINEAR),
]


@pytest.mark.parametrize(("src_size", "options", "expected", "interp"), CASES)
@pytest.mark.parametrize("ext", [".jpg", ".png"])
def test_generated_images_with_each_option(tmp_path, src_size, options, expected, interp, ext):
    path = write_image(tmp_path / "src" / f"a{ext}", *src_size, seed=3)
    build_cache(tmp_path / "src", tmp_path / "cache", workers=1, **options)
    img, label = MemmapImageDataset(tmp_path / "cache")[0]
    assert label == 0
    assert (img.shape[1], img.shape[0]) == expected
    ref = reference(path, size=expected, interpolation=interp)
    assert np.array_equal(img, ref)


def test_parallel_build_equals_single_process_build(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "one", workers=1, max_side=40)
    build_cache(small_folder, tmp_path / "two", workers=2, max_side=40)
    a, b = MemmapImageDataset(tmp_path / "one"), MemmapImageDataset(tmp_path / "two")
    assert len(a) == len(b) == 12
    for i in range(len(a)):
        assert np.array_equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]


def test_reduced_decode_is_explicit_recorded_and_close_to_the_reference(tmp_path):
    from mmcache import Options
    from mmcache.sample_data import make_image_folder

    src = make_image_folder(tmp_path / "src", classes=1, per_class=3, size=(480, 720))
    write_image(src / "class_00" / "lossless.png", 720, 480, seed=5)
    build_cache(src, tmp_path / "exact", max_side=180, workers=1)
    build_cache(src, tmp_path / "fast", max_side=180, reduced_decode=True, workers=1)
    exact, fast = MemmapImageDataset(tmp_path / "exact"), MemmapImageDataset(tmp_path / "fast")
    assert fast.manifest.options["reduced_decode"] is True
    assert exact.manifest.options["reduced_decode"] is False
    assert exact.manifest.fingerprints["options"] != fast.manifest.fingerprints["options"]
    assert Options(reduced_decode=True).fingerprint() != Options().fingerprint()
    for i, (path, _) in enumerate(fast.samples):
        a, b = exact[i][0], fast[i][0]
        assert a.shape == b.shape == (120, 180, 3)
        if path.endswith(".png"):
            assert np.array_equal(a, b)  # only JPEGs are decoded at reduced scale
            continue
        # the DCT-domain 1/4 decode, then the same resize and conversion
        reduced = cv2.imread(path, cv2.IMREAD_REDUCED_COLOR_4)
        assert reduced.shape[:2] == (120, 180)
        assert np.array_equal(b, cv2.cvtColor(reduced, cv2.COLOR_BGR2RGB))
        diff = np.abs(a.astype(int) - b.astype(int))
        assert 0 < diff.max() <= 40 and diff.mean() < 3  # close to the reference, not equal


def test_reduced_decode_picks_the_largest_factor_that_keeps_the_output_size(tmp_path):
    path = write_image(tmp_path / "src" / "a.jpg", 720, 480, seed=9)
    build_cache(tmp_path / "src", tmp_path / "c", size=(200, 300), reduced_decode=True, workers=1)
    img = MemmapImageDataset(tmp_path / "c")[0][0]
    # 720/2 = 360 >= 300 but 720/4 = 180 < 300: read at 1/2, then resized with INTER_AREA
    half = cv2.imread(str(path), cv2.IMREAD_REDUCED_COLOR_2)
    ref = cv2.cvtColor(
        cv2.resize(half, (300, 200), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB
    )
    assert np.array_equal(img, ref)
