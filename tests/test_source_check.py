"""The quick open-time source check (folder mtimes, an archive's size and mtime) against the
full one (every file's size and mtime): what each sees, and that every build sees it all."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import time

import cv2
import numpy as np
import pytest
from conftest import make_folder, reseal, write_image

from mmcache import (
    CacheStaleError,
    MemmapImageDataset,
    SourceChangedError,
    StaleCacheWarning,
    build_cache,
    cache_info,
    plan_cache,
)
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.sample_data import make_detection_set, make_segmentation_set

LONG_AGO = time.time_ns() - 3600 * 10**9


def aged(root):
    """The source's folders last changed an hour ago (a build stamps only folders older than
    its scan by a second: one changed since might have changed after the scan saw it)."""
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(d, ns=(LONG_AGO, LONG_AGO))
    return root


@pytest.fixture
def built(tmp_path):
    src = aged(make_folder(tmp_path / "src", {"a": [(20, 16)] * 3, "b": [(16, 20)] * 3}))
    build_cache(src, tmp_path / "cache", workers=0)
    return src, tmp_path / "cache"


def test_the_quick_check_sees_files_added_removed_or_renamed(built):
    src, cache = built
    assert cache_info(cache).stale is None
    MemmapImageDataset(cache, on_stale="error")  # unchanged: no scan, no error
    (src / "a" / "img_000.jpg").rename(src / "a" / "renamed.jpg")
    with pytest.warns(StaleCacheWarning, match="1 added"):
        MemmapImageDataset(cache)
    assert "1 removed" in cache_info(cache).stale


def test_a_file_rewritten_in_place_is_seen_by_the_full_check_and_every_build(built):
    src, cache = built
    path = src / "b" / "img_004.jpg"
    write_image(path, 16, 20, seed=99)  # rewritten in place: its folder's mtime is unchanged
    assert os.stat(src / "b").st_mtime_ns == LONG_AGO
    MemmapImageDataset(cache, on_stale="error")  # the quick check cannot see it
    assert cache_info(cache).stale is None
    with pytest.raises(Exception, match=r"1 modified \(b/img_004.jpg\)"):
        MemmapImageDataset(cache, on_stale="error", source_check="full")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info", str(cache), "--source-check", "full"]) == 0
    assert "modified" in out.getvalue()
    report = build_cache(src, cache, workers=0)  # a build always lists every file
    assert (report.up_to_date, report.decoded) == (False, 1)


def test_a_folder_changed_during_the_build_is_always_checked_in_full(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2})  # its folders are new
    build_cache(src, tmp_path / "cache", workers=0)
    stamps = fmt.read_manifest(tmp_path / "cache").extra["source_stamps"]["folders"]
    assert set(stamps.values()) == {-1}  # (changed within a second of the scan: unknown)
    write_image(src / "a" / "img_000.jpg", 16, 16, seed=5)
    with pytest.warns(StaleCacheWarning, match="1 modified"):
        MemmapImageDataset(tmp_path / "cache")


def test_an_archive_is_checked_by_its_size_and_mtime(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2})
    tar = tmp_path / "t.tar"
    with tarfile.open(tar, "w") as t:
        t.add(src, ".")
    os.utime(tar, ns=(LONG_AGO, LONG_AGO))
    build_cache(tar, tmp_path / "cache", workers=0)
    MemmapImageDataset(tmp_path / "cache", on_stale="error")
    with tarfile.open(tar, "a") as t:
        t.add(write_image(tmp_path / "n.jpg", 16, 16, seed=3), "a/new.jpg")
    with pytest.warns(StaleCacheWarning, match="1 added"):
        MemmapImageDataset(tmp_path / "cache")


def test_an_unchanged_build_renews_the_stamps_a_refresh_could_not_take(tmp_path):
    src = aged(make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2}))
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    write_image(src / "a" / "new.jpg", 16, 16, seed=4)  # a refresh just after: "a" unknown
    build_cache(src, cache, workers=0)
    assert fmt.read_manifest(cache).extra["source_stamps"]["folders"]["a"] == -1
    aged(src)  # (time passes)
    assert build_cache(src, cache, workers=0).up_to_date
    assert fmt.read_manifest(cache).extra["source_stamps"]["folders"]["a"] == LONG_AGO


def test_the_quick_check_sees_a_subfolder_added_two_levels_down(tmp_path):
    # A new src/a/w changes the mtime of src/a alone, a folder that holds no file itself:
    # every folder above a listed file is stamped, not only the files' own folders.
    src = tmp_path / "src"
    make_folder(src / "a", {"x": [(20, 16)] * 2, "y": [(16, 20)]})
    make_folder(src / "b", {"z": [(16, 16)]})
    build_cache(aged(src), tmp_path / "cache", workers=0)
    MemmapImageDataset(tmp_path / "cache", on_stale="error")  # unchanged: no error
    make_folder(src / "a", {"w": [(16, 16)]})
    with pytest.warns(StaleCacheWarning, match="1 added"):
        MemmapImageDataset(tmp_path / "cache")


def _stale_message(cache) -> str:
    with pytest.raises(CacheStaleError) as e:
        MemmapImageDataset(cache, on_stale="error")
    return str(e.value)


def test_a_changed_source_is_summarised_with_a_skipped_file_as_it_was(tmp_path):
    # A skipped file is compared by the size and mtime the manifest recorded for it, and its
    # label (none) is not a relabelling: only the file added is news.
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    (src / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    assert [s["path"] for s in fmt.read_manifest(cache).skipped] == ["b/broken.jpg"]
    write_image(src / "a" / "new.jpg", 20, 16, seed=5)
    message = _stale_message(cache)
    assert message == (
        f"{cache}: the cache is stale: the source changed: 1 added (a/new.jpg); it was built "
        f"with the default options; `mmcache build {src} {cache}` updates it"
    )


def test_the_advice_of_a_stale_lazy_cache_repeats_its_options(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(40, 32)] * 2, "b": [(32, 40)] * 2})
    cache = tmp_path / "cache"
    MemmapImageDataset(cache, source=src, short_side=24)
    write_image(src / "b" / "new.jpg", 40, 32, seed=6)
    assert _stale_message(cache).endswith(
        "the source changed: 1 added (b/new.jpg); it was made with --short-side 24; "
        f"`mmcache build {src} {cache} --short-side 24` updates it"
    )


def test_a_cache_said_to_be_retried_is_never_current(tmp_path):
    # A file that changed while it was decoded is skipped and marked so; the next build tries
    # it again even when it reads as when it was listed (restored with its mtime).
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    (src / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    assert build_cache(src, cache, workers=0).up_to_date
    assert plan_cache(src, cache).up_to_date
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    m["skipped"][0]["state"] = fmt.BAD_SOURCE_CHANGED
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    reseal(cache)
    assert not plan_cache(src, cache).up_to_date
    assert not build_cache(src, cache, workers=0).up_to_date


def test_a_lazy_cache_with_records_to_fill_is_not_what_a_build_would_leave(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    cache = tmp_path / "cache"
    MemmapImageDataset(cache, source=src)
    assert not plan_cache(src, cache).up_to_date  # a build would fill its four records
    assert build_cache(src, cache, workers=0).decoded == 4
    assert plan_cache(src, cache).up_to_date


def test_a_build_from_another_list_file_names_both_lists(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    lines = "".join(f"{p},{p.parent.name}\n" for p in sorted(src.rglob("*.jpg")))
    first, second = tmp_path / "first.csv", tmp_path / "second.csv"
    first.write_text(lines)
    second.write_text(lines)
    build_cache(first, tmp_path / "cache", workers=0)
    names = f"made from {first}; this build's source is {second},"
    with pytest.raises(SourceChangedError, match=names):
        build_cache(second, tmp_path / "cache", workers=0)


def test_a_skipped_file_recorded_without_its_stat_counts_as_modified(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    (src / "b" / "broken.jpg").write_bytes(b"not a jpeg at all")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    del m["skipped"][0]["size"], m["skipped"][0]["mtime_ns"]  # optional in the format
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    reseal(cache)
    write_image(src / "a" / "new.jpg", 20, 16, seed=5)
    assert "the source changed: 1 added (a/new.jpg); 1 modified (b/broken.jpg);" in (
        _stale_message(cache)
    )


def test_a_relabelled_file_of_a_list_is_named(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 2, "b": [(16, 20)] * 2})
    files = sorted(src.rglob("*.jpg"))
    listed = tmp_path / "train.csv"
    listed.write_text("".join(f"{p},{p.parent.name}\n" for p in files))
    cache = tmp_path / "cache"
    build_cache(listed, cache, workers=0)
    listed.write_text("".join(f"{p},{'b' if p == files[0] else p.parent.name}\n" for p in files))
    assert "the source changed: 1 relabeled (a/img_000.jpg);" in _stale_message(cache)


def test_the_advice_of_a_stale_annotated_cache_names_its_masks_and_coco_file(tmp_path):
    images, masks = make_segmentation_set(tmp_path / "voc", images=3, size=(24, 32))
    build_cache(images, tmp_path / "voc_cache", masks=masks, workers=0)
    coco_images, coco = make_detection_set(tmp_path / "coco", images=3, size=(24, 32))
    build_cache(coco_images, tmp_path / "coco_cache", coco=coco, workers=0)
    both = tmp_path / "both_masks"  # masks for the COCO images too: a cache with both
    both.mkdir()
    for image in coco_images.iterdir():
        if image.suffix != ".json":
            h, w = cv2.imread(str(image)).shape[:2]
            cv2.imwrite(str(both / f"{image.stem}.png"), np.zeros((h, w), np.uint8))
    build_cache(coco_images, tmp_path / "both_cache", masks=both, coco=coco, workers=0)
    for folder in (images, coco_images):
        min(p for p in folder.iterdir() if p.suffix != ".json").unlink()
    assert _stale_message(tmp_path / "voc_cache").endswith(
        f"`mmcache build {images} {tmp_path / 'voc_cache'} --masks {masks}` updates it"
    )
    assert _stale_message(tmp_path / "coco_cache").endswith(
        f"`mmcache build {coco_images} {tmp_path / 'coco_cache'} --coco {coco}` updates it"
    )
    assert _stale_message(tmp_path / "both_cache").endswith(
        f"{tmp_path / 'both_cache'} --masks {both} --coco {coco}` updates it"
    )
