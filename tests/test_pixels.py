"""Correct pixels: every record equals OpenCV's own decode plus the recorded preprocessing."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from conftest import reference, write_image

from mmcache import MemmapImageDataset, build_cache


def test_every_shared_testimage_matches_opencv(testimages, tmp_path):
    report = build_cache(testimages, tmp_path / "cache", workers=1)
    ds = MemmapImageDataset(tmp_path / "cache")
    decodable = [p for p in sorted(testimages.iterdir()) if cv2.imread(str(p)) is not None]
    assert len(ds) == len(decodable) == report.images
    for (path, _label), (img, _) in zip(ds.samples, (ds[i] for i in range(len(ds)))):
        ref = reference(path)
        assert img.shape == ref.shape, path
        assert np.array_equal(img, ref), path
    # EXIF orientation 6 and 8 are stored rotated: OpenCV turns them upright, so must we.
    assert [s for s in report.skipped if s["path"] == "broken.png"]


@pytest.mark.parametrize("color", ["rgb", "bgr", "gray"])
def test_testimages_in_every_color_mode(testimages, tmp_path, color):
    build_cache(testimages, tmp_path / "cache", color=color, short_side=64, workers=1)
    ds = MemmapImageDataset(tmp_path / "cache")
    for i, (path, _) in enumerate(ds.samples):
        img = cv2.imread(path, cv2.IMREAD_GRAYSCALE if color == "gray" else cv2.IMREAD_COLOR)
        h, w = img.shape[:2]
        if min(h, w) > 64:
            s = (
                max(1, (w * 64 + min(h, w) // 2) // min(h, w)),
                max(1, (h * 64 + min(h, w) // 2) // min(h, w)),
            )
        else:
            s = (w, h)
        ref = reference(path, color=color, size=s, interpolation=cv2.INTER_AREA)
        got = ds[i][0]
        assert got.shape == ref.shape and got.shape[2] == (1 if color == "gray" else 3)
        assert np.array_equal(got, ref), path


# (source width, height), options, expected (width, height), interpolation used
CASES = [
    ((720, 480), {}, (720, 480), None),
    ((720, 480), {"size": (224, 224)}, (224, 224), cv2.INTER_AREA),
    ((100, 60), {"size": (200, 120)}, (200, 120), cv2.INTER_LINEAR),  # enlarging: linear
    ((720, 480), {"max_side": 360}, (360, 240), cv2.INTER_AREA),
    ((480, 720), {"max_side": 100}, (67, 100), cv2.INTER_AREA),
    ((300, 200), {"max_side": 512}, (300, 200), None),  # never upscale
    ((720, 480), {"short_side": 256}, (384, 256), cv2.INTER_AREA),
    ((479, 721), {"short_side": 100}, (100, 151), cv2.INTER_AREA),
    ((100, 80), {"short_side": 256}, (100, 80), None),  # never upscale
    ((720, 480), {"size": (64, 64), "interpolation": "cubic"}, (64, 64), cv2.INTER_CUBIC),
    ((720, 480), {"size": (64, 64), "interpolation": "nearest"}, (64, 64), cv2.INTER_NEAREST),
    ((720, 480), {"size": (64, 64), "interpolation": "lanczos"}, (64, 64), cv2.INTER_LANCZOS4),
    ((720, 480), {"size": (64, 64), "interpolation": "linear"}, (64, 64), cv2.INTER_LINEAR),
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

    src = make_image_folder(tmp_path / "src", classes=1, per_class=3, size=(720, 480))
    write_image(src / "class_00" / "lossless.png", 720, 480, seed=5)
    build_cache(src, tmp_path / "exact", max_side=180, workers=1)
    build_cache(src, tmp_path / "fast", max_side=180, reduced_decode=True, workers=1)
    exact, fast = MemmapImageDataset(tmp_path / "exact"), MemmapImageDataset(tmp_path / "fast")
    assert fast.manifest.options["reduced_decode"] is True
    assert "reduced_decode" not in exact.manifest.options  # older caches keep their fingerprint
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
    build_cache(tmp_path / "src", tmp_path / "c", size=(300, 200), reduced_decode=True, workers=1)
    img = MemmapImageDataset(tmp_path / "c")[0][0]
    # 720/2 = 360 >= 300 but 720/4 = 180 < 300: read at 1/2, then resized with INTER_AREA
    half = cv2.imread(str(path), cv2.IMREAD_REDUCED_COLOR_2)
    ref = cv2.cvtColor(
        cv2.resize(half, (300, 200), interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB
    )
    assert np.array_equal(img, ref)
