"""Planning: the header-only size estimate equals what a build writes, for every policy; the
free-space refusal on a real small filesystem; the plan on the command line."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder, tmpfs, write_image

from mmcache import (
    InsufficientSpaceError,
    MemmapImageDataset,
    build_cache,
    check_free_space,
    plan_cache,
)
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.plan import COMMON_POLICIES
from mmcache.space import human_bytes

POLICIES = [*COMMON_POLICIES, {"max_side": 20, "color": "gray"}, {"short_side": 9, "color": "bgr"}]


def _write_exif_rotated(path: Path, width: int, height: int, orientation: int) -> Path:
    """A JPEG stored ``width x height`` whose EXIF says to rotate it (6, 8: a quarter turn)."""
    from PIL import Image

    rng = np.random.default_rng(orientation)
    img = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.save(path, exif=exif, quality=90)
    return path


@pytest.fixture
def mixed_folder(tmp_path: Path) -> Path:
    """Landscape, portrait, square, odd and large-enough-to-shrink sizes; PNG, gray, EXIF."""
    root = make_folder(
        tmp_path / "src",
        {
            "wide": [(600, 300), (64, 48), (33, 17)],
            "tall": [(270, 700), (48, 64), (17, 33)],
            "square": [(520, 520), (40, 40)],
        },
    )
    write_image(root / "square" / "lossless.png", 300, 257, seed=9)
    gray = root / "square" / "gray.png"
    import cv2

    cv2.imwrite(str(gray), np.full((31, 45), 128, np.uint8))
    _write_exif_rotated(root / "tall" / "rotated6.jpg", 530, 270, 6)
    _write_exif_rotated(root / "wide" / "rotated8.jpg", 90, 40, 8)
    return root


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: str(p or "native"))
def test_plan_bytes_equal_the_built_cache(mixed_folder, tmp_path, policy):
    plan = plan_cache(mixed_folder, tmp_path / "cache", **policy)
    assert plan.files == 12 and plan.classes == 3 and plan.unreadable == []
    build_cache(mixed_folder, tmp_path / "cache", workers=1, **policy)
    m = fmt.read_manifest(tmp_path / "cache")
    assert m.skipped == []
    assert plan.build.sizes == m.sizes  # every file, to the byte: alignment included
    assert plan.total_bytes == sum(m.sizes.values())
    # The policy table agrees with the build's own row, where the policy is a common one.
    for p in plan.policies:
        if p.name == plan.build.name:
            assert p.sizes == m.sizes


def test_every_policy_row_equals_its_build(mixed_folder, tmp_path):
    plan = plan_cache(mixed_folder, color="gray")
    for k, p in enumerate(plan.policies):
        opts = p.options
        report = build_cache(
            mixed_folder,
            tmp_path / f"c{k}",
            size=opts.size,
            max_side=opts.max_side,
            short_side=opts.short_side,
            color="gray",
            workers=1,
        )
        assert report.bytes == p.data_bytes, p.name
    # The rows differ, so the comparison above could tell them apart.
    assert len({p.data_bytes for p in plan.policies}) == len(plan.policies)


def test_native_size_distribution(mixed_folder):
    plan = plan_cache(mixed_folder)
    # EXIF orientation 6 turns the stored 530x270 into 270x530 (as cv2.imread does).
    widths = sorted([600, 64, 33, 270, 48, 17, 520, 40, 300, 45, 270, 40])
    assert plan.native.width == (17, widths[(len(widths) - 1) // 2], 600)
    assert plan.native.height[0] == 17 and plan.native.height[2] == 700
    assert plan.native.pixels[2] == 520 * 520
    assert plan.cache is None and plan.free_bytes is None and plan.fits_on_disk is None


@pytest.mark.parametrize("policy", POLICIES[:4], ids=["native", "max512", "short256", "224"])
def test_plan_bytes_on_the_real_test_images(testimages, tmp_path, policy):
    plan = plan_cache(testimages, **policy)
    assert plan.unreadable == ["broken.png"]  # no header: decoded (and here skipped) by the build
    report = build_cache(testimages, tmp_path / "cache", workers=1, **policy)
    # truncated_jpeg.jpg's header is sound: it has a planned record, skipped as "truncated"
    assert [s["path"] for s in report.skipped] == ["broken.png", "truncated_jpeg.jpg"]
    m = fmt.read_manifest(tmp_path / "cache")
    # The plan counted both files' records; the build dropped them from the index, and a file
    # that fails to decode takes no space: the plan without them is the build's size exactly.
    assert plan.build.sizes["index"] == m.sizes["index"] + 2 * fmt.INDEX_DTYPE.itemsize
    (testimages / "truncated_jpeg.jpg").unlink()
    (testimages / "broken.png").unlink()
    assert plan_cache(testimages, **policy).data_bytes == m.sizes["data"] < plan.data_bytes


def test_plan_names_too_large_files_and_an_up_to_date_cache(small_folder, tmp_path):
    plan = plan_cache(small_folder, tmp_path / "cache", max_pixels=40 * 40)
    assert len(plan.too_large) == 6 and plan.images == 6  # 64x48 and 48x64 are over 1,600
    assert not plan.up_to_date and plan.existing_bytes == 0 and plan.fits_on_disk
    build_cache(small_folder, tmp_path / "cache", workers=1, max_pixels=40 * 40)
    again = plan_cache(small_folder, tmp_path / "cache", max_pixels=40 * 40)
    assert again.data_bytes == fmt.read_manifest(tmp_path / "cache").sizes["data"]
    assert again.up_to_date and again.existing_bytes > 0
    assert not plan_cache(small_folder, tmp_path / "cache", max_side=8).up_to_date


def test_plan_progress_reaches_the_total(small_folder):
    calls = []
    plan_cache(small_folder, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (12, 12)


def test_check_free_space_names_both_numbers(tmp_path):
    with pytest.raises(InsufficientSpaceError, match=r"10\.00 TB.*free there.*--force") as e:
        check_free_space(tmp_path / "not" / "yet", 10**13)
    assert isinstance(e.value, OSError) and "\n" not in str(e.value)
    assert check_free_space(tmp_path, 10**13, force=True) == -1
    assert check_free_space(tmp_path / "new", 1) > 0


# --- a real small filesystem -----------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """An 8 MiB tmpfs mounted at tmp_path/fs (needs root), unmounted afterwards."""
    with tmpfs(tmp_path / "fs", "8m") as mnt:
        yield mnt


def test_build_refuses_a_destination_without_space(tiny_fs, tmp_path, capsys):
    # Three 1500x1000 RGB images: 13.5 MB of pixels for an 8 MiB filesystem.
    src = make_folder(tmp_path / "big", {"a": [(1500, 1000)] * 3})
    cache = tiny_fs / "cache"
    build_cache(src, cache, size=(8, 8), workers=1)  # the old cache: 3 x 192 bytes
    before = sorted(os.listdir(cache))
    old_pixels = MemmapImageDataset(cache)[0][0].copy()

    plan = plan_cache(src, cache)
    assert plan.data_bytes > 8 << 20 and plan.fits_on_disk is False
    with pytest.raises(InsufficientSpaceError, match="--force") as e:
        build_cache(src, cache, workers=1, replace=True)
    message = str(e.value)
    assert f"{plan.build.disk_bytes:,} bytes" in message and "are free there" in message
    assert sorted(os.listdir(cache)) == before  # nothing was written
    assert np.array_equal(MemmapImageDataset(cache)[0][0], old_pixels)

    # The CLI says the same in one line.
    assert main(["build", str(src), str(cache), "--workers", "1", "--replace"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mmcache: error: ") and "--force" in err and err.count("\n") == 1

    # Forced, the build starts, meets the full disk, and still leaves the old cache alone.
    with pytest.raises(InsufficientSpaceError, match="disk is full"):
        build_cache(src, cache, workers=1, force=True, replace=True)
    assert sorted(os.listdir(cache)) == before
    assert np.array_equal(MemmapImageDataset(cache)[0][0], old_pixels)


# --- the command line ------------------------------------------------------------------------


def test_cli_plan_prints_the_table(mixed_folder, tmp_path, capsys):
    assert main(["plan", str(mixed_folder), str(tmp_path / "c"), "--short-side", "100"]) == 0
    out = capsys.readouterr().out
    plan = plan_cache(mixed_folder, short_side=100)
    assert "12 files in 3 classes" in out
    for name in ("native", "--max-side 512", "--short-side 256", "--size 224x224"):
        assert f"\n{name} " in out
    this = next(line for line in out.splitlines() if line.endswith("<- this build"))
    assert this.startswith("--short-side 100")
    assert "destination" in out and "fits disk" in out and "memory" in out
    assert human_bytes(plan.data_bytes) in this
    assert not (tmp_path / "c").exists()


def test_cli_build_dry_run_builds_nothing(small_folder, tmp_path, capsys):
    assert main(["build", "--dry-run", str(small_folder), str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "12 files in 3 classes" in out and "<- this build" in out
    assert not (tmp_path / "c").exists()
