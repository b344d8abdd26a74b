"""Refreshes that cost what changed: records appended to the data file, the rest kept in place,
garbage compacted past a threshold or on demand, readers of earlier generations undisturbed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder, reference, write_image

from mmcache import (
    CacheFormatError,
    MemmapImageDataset,
    build_cache,
    compact_cache,
    create_lazy_cache,
)
from mmcache import format as fmt
from mmcache._generation import garbage_bytes
from mmcache._layout import aligned
from mmcache.cli import main


@pytest.fixture
def src(tmp_path):
    return make_folder(tmp_path / "src", {"a": [(40, 30)] * 30, "b": [(30, 40)] * 30})


def files_of(cache):
    return fmt.read_cache_files(fmt.read_manifest(cache))


def pixels_of(files):
    data = files.manifest.file("data").read_bytes()
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels)
    return {
        files.path(i): data[int(o) : int(o) + int(n)]
        for i, (o, n) in enumerate(zip(files.index["offset"], nbytes, strict=True))
    }


def assert_serves_the_source(cache, src):
    ds = MemmapImageDataset(cache)
    for i, (path, _) in enumerate(ds.samples):
        assert np.array_equal(ds[i][0], reference(path)), path


def test_a_refresh_appends_what_changed_and_keeps_the_rest_in_place(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    before = files_of(cache)
    data = before.manifest.file("data")
    inode, size = data.stat().st_ino, before.manifest.sizes["data"]
    write_image(src / "a" / "img_003.jpg", 40, 30, seed=1234)  # one of 60 replaced
    report = build_cache(src, cache, workers=0)
    after = files_of(cache)
    assert report.appended and (report.decoded, report.reused) == (1, 59)
    assert after.manifest.file("data") == data and data.stat().st_ino == inode  # the same file
    # only the new record and the index, state and paths were written
    record = 40 * 30 * 3
    metadata = sum(v for k, v in after.manifest.sizes.items() if k != "data")
    assert report.written_bytes == record + metadata
    assert after.manifest.sizes["data"] == aligned(size) + record
    # the kept records did not move; the replaced one's bytes (and its padding) are now garbage
    moved = {
        after.path(i)
        for i in range(after.manifest.count)
        if int(after.index["offset"][i]) != int(before.index["offset"][i])
    }
    assert moved == {"a/img_003.jpg"}
    assert report.garbage_bytes == garbage_bytes(after) == aligned(record)
    assert_serves_the_source(cache, src)


def test_padding_between_records_is_not_garbage(src, tmp_path, capsys):
    """A first build and a compaction leave no garbage: the bytes that align each record (40 x
    30 x 3 = 3,600 bytes, padded to 3,648) belong to it; only a replaced record is garbage."""
    cache = tmp_path / "cache"
    assert main(["build", str(src), str(cache), "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "garbage" not in out  # a first build says nothing of garbage
    files = files_of(cache)
    pixels = int(fmt.record_nbytes(files.index, files.manifest.pixels).sum())
    assert files.manifest.sizes["data"] > pixels  # padding
    assert garbage_bytes(files) == 0
    assert main(["info", str(cache)]) == 0
    assert "0 B of the data file (0.0%) is garbage" in capsys.readouterr().out
    write_image(src / "b" / "img_040.jpg", 30, 40, seed=4321)
    assert main(["build", str(src), str(cache), "--workers", "0"]) == 0
    assert "3.65 KB of the data file (1.6%) is garbage" in capsys.readouterr().out
    report = compact_cache(cache)
    assert (report.dropped_garbage, report.garbage_bytes) == (3648, 0)
    assert garbage_bytes(files_of(cache)) == 0


def test_a_reader_of_the_previous_generation_keeps_its_pixels_through_refreshes(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    old = MemmapImageDataset(cache)
    expected = [old[i][0].copy() for i in range(len(old))]  # (and maps the data file)
    for k in range(4):
        write_image(src / "a" / f"img_{k:03d}.jpg", 40, 30, seed=500 + k)
        write_image(src / "b" / f"new_{k}.jpg", 30, 40, seed=600 + k)
        os.unlink(src / "b" / f"img_{30 + k:03d}.jpg")
        build_cache(src, cache, workers=0)
    compact_cache(cache)
    build_cache(src, cache, workers=0, compact_at=0.0)  # and a refresh that compacts
    assert all(np.array_equal(old[i][0], expected[i]) for i in range(len(old)))
    assert_serves_the_source(cache, src)


@pytest.mark.parametrize("compact_at", [0.25, 0.1])
def test_garbage_never_passes_the_threshold_over_many_refreshes(tmp_path, compact_at):
    src = make_folder(tmp_path / "src", {"a": [(20, 16)] * 100})
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    appended = compacted = 0
    for k in range(30):  # each refresh replaces 1% of the files, or adds 1%
        if k % 2:
            write_image(src / "a" / f"img_{k:03d}.jpg", 20, 16, seed=1000 + k)
        else:
            write_image(src / "a" / f"zz_{k:03d}.jpg", 20, 16, seed=2000 + k)
        report = build_cache(src, cache, workers=0, compact_at=compact_at)
        appended += report.appended
        compacted += not report.appended
        files = files_of(cache)
        live = int(fmt.record_nbytes(files.index, files.manifest.pixels).sum())
        # at most compact_at of the file is garbage (and less than a record of alignment)
        assert files.manifest.sizes["data"] <= live / (1 - compact_at) + 64 * len(files.index)
        assert files.manifest.sizes["data"] <= 1.35 * live  # the refresh target
    if compact_at == 0.25:  # 15 of 115 records replaced: 13% garbage, no compaction yet
        assert (appended, compacted) == (30, 0)
    else:  # past 10%, a refresh compacts, and appends again after
        assert appended > compacted > 0
    assert_serves_the_source(cache, src)


def test_compact_drops_the_garbage_and_keeps_every_record(src, tmp_path, capsys):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    for k in range(5):
        write_image(src / "a" / f"img_{k:03d}.jpg", 40, 30, seed=700 + k)
    build_cache(src, cache, workers=0)
    before = files_of(cache)
    pixels_before = pixels_of(before)
    garbage = garbage_bytes(before)
    assert garbage == 5 * aligned(40 * 30 * 3)
    assert main(["info", str(cache)]) == 0
    assert "is garbage (`mmcache compact` drops it)" in capsys.readouterr().out
    assert main(["compact", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "compacted" in out and "of garbage dropped" in out
    after = files_of(cache)
    assert garbage_bytes(after) == 0
    assert not after.manifest.shares_data and not before.manifest.file("data").exists()
    assert pixels_of(after) == pixels_before
    assert np.array_equal(after.state, before.state)
    assert build_cache(src, cache, workers=0).up_to_date  # compaction changed no record
    assert_serves_the_source(cache, src)


def test_a_lazy_refresh_appends_empty_records_and_keeps_filled_ones(src, tmp_path):
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    for i in range(0, 60, 2):
        ds[i]
    before = files_of(cache)
    write_image(src / "b" / "extra.jpg", 30, 40, seed=9)
    report = create_lazy_cache(src, cache)
    after = files_of(cache)
    assert report.appended and report.reused == 30 and report.pending == 31
    assert after.manifest.file("data") == before.manifest.file("data")
    new = after.paths().index("b/extra.jpg")
    assert int(after.index["offset"][new]) >= before.manifest.sizes["data"]
    assert after.state["state"][new] == fmt.EMPTY
    assert_serves_the_source(cache, src)


FORMAT_1_1 = Path(__file__).resolve().parent / "data" / "format-1.1"


def test_a_cache_of_a_development_version_is_refused_with_the_rebuild_line(tmp_path):
    """A cache made by an early development version (format 1.1, committed in tests/data) is
    refused in one line that gives the command rebuilding it; a build there rebuilds it."""
    old = shutil.copytree(FORMAT_1_1 / "cache", tmp_path / "cache")
    src = shutil.copytree(FORMAT_1_1 / "source", tmp_path / "source")
    for read in (fmt.read_manifest, MemmapImageDataset):
        with pytest.raises(CacheFormatError) as e:
            read(old)
        assert str(e.value) == (
            f"{old / fmt.MANIFEST_NAME}: written by a development version of mmcache (format "
            f"1.1), which this one does not read; rebuild it: mmcache build /tmp/f11/source {old}"
        )
    report = build_cache(src, old, workers=0)
    assert report.decoded == 4 and fmt.read_manifest(old).format_version == fmt.FORMAT_VERSION
    assert_serves_the_source(old, src)


def test_a_refresh_with_no_room_to_compact_appends_and_says_so(tmp_path, capsys):
    """Past compact_at a refresh writes a compact data file beside the old one; when the disk
    lacks room for that but not for the appended records, it appends and says why."""
    from conftest import tmpfs

    src = make_folder(tmp_path / "src", {"a": [(320, 240)] * 20})  # 230 KB records, 4.6 MB
    with tmpfs(tmp_path / "disk", "8m") as disk:
        cache = disk / "cache"
        build_cache(src, cache, workers=0)
        for k in range(8):  # 40% replaced: past the default 25%
            write_image(src / "a" / f"img_{k:03d}.jpg", 320, 240, seed=500 + k)
        # 3.4 MB free: the 1.8 MB appended fit, a compact 4.6 MB data file does not
        assert main(["build", str(src), str(cache), "--workers", "0"]) == 0
        out = capsys.readouterr().out
        files = files_of(cache)
        assert files.manifest.shares_data  # appended to the first data file
        assert "not compacted: the garbage passed compact_at=0.25, but a compact data" in out
        assert "run `mmcache compact`" in out
        assert garbage_bytes(files) == 8 * aligned(320 * 240 * 3)
        assert_serves_the_source(cache, src)
