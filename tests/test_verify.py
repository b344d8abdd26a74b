"""Verification: verify_cache and `mmcache verify` name each bad record; verify="first-read"."""

from __future__ import annotations

import json
import os
import re
import shlex
import zlib

import numpy as np
import pytest

from mmcache import (
    CacheFormatError,
    MemmapImageDataset,
    build_cache,
    copy_cache,
    decode_image,
    repair_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache.cli import main


@pytest.fixture
def cache(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    return tmp_path / "cache"


def _record(cache, i):
    files = fmt.open_cache(cache)
    r = files.index[i]
    return files, int(r["offset"]), int(r["height"]) * int(r["width"]) * int(r["channels"])


def _flip(path, pos, bit=0):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def test_a_sound_cache_verifies(cache):
    report = verify_cache(cache)
    files = fmt.open_cache(cache)
    sizes = [int(r["height"]) * int(r["width"]) * int(r["channels"]) for r in files.index]
    assert report.ok and report.records == report.checked == 12
    assert report.bytes == sum(sizes) and report.bad == []


def test_a_damaged_record_is_named_by_verify_the_cli_and_first_read(cache, capsys):
    files, off, n = _record(cache, 5)
    _flip(files.manifest.file("data"), off + n // 2, bit=3)
    report = verify_cache(cache)
    assert [(b.index, b.path) for b in report.bad] == [(5, files.path(5))]
    assert "checksum" in report.bad[0].what
    assert main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"bad record 5 {files.path(5)}" in out and "1 BAD" in out
    ds = MemmapImageDataset(cache, verify="first-read")
    for i in (0, 4, 6, 11):
        ds[i]  # the others read fine
    with pytest.raises(CacheFormatError, match=r"record 5 \(.*img_005.jpg\).*checksum"):
        ds[5]
    MemmapImageDataset(cache)[5]  # without verify the damage goes unnoticed: hence the option


def test_first_read_checks_once_per_process(cache):
    ds = MemmapImageDataset(cache, verify="first-read")
    ds[3]
    files, off, n = _record(cache, 3)
    _flip(files.manifest.file("data"), off, bit=0)  # the shared mapping sees this at once
    ds[3]  # already checked in this process: not again
    copy = MemmapImageDataset(cache, verify="first-read")
    with pytest.raises(CacheFormatError, match="record 3"):
        copy[3]  # a new dataset (as in a new worker) checks again


def test_verify_option_is_checked(cache):
    with pytest.raises(ValueError, match="verify must be"):
        MemmapImageDataset(cache, verify="always")
    with pytest.raises(ValueError, match="source must be"):
        verify_cache(cache, source="some")


def test_source_comparison_catches_what_a_checksum_cannot(cache, capsys):
    # A record written wrong with a matching checksum (as a buggy writer would): only
    # decoding the source again finds it.
    files, off, n = _record(cache, 7)
    data = files.manifest.file("data")
    with open(data, "r+b") as f:
        f.seek(off)
        f.write(bytes(n))
    state = np.fromfile(files.manifest.file("state"), fmt.STATE_DTYPE)
    state["crc32"][7] = zlib.crc32(bytes(n))
    state.tofile(files.manifest.file("state"))
    assert verify_cache(cache).ok
    report = verify_cache(cache, source="all")
    assert report.source_compared == 12
    assert [b.index for b in report.bad] == [7] and "differ from the decoded source" in (
        report.bad[0].what
    )
    assert main(["verify", str(cache), "--source", "all"]) == 1
    assert "bad record 7" in capsys.readouterr().out


def test_a_sample_of_at_least_20(tmp_path):
    from conftest import make_folder

    src = make_folder(tmp_path / "s", {"a": [(8, 8)] * 30})
    build_cache(src, tmp_path / "c", workers=1)
    assert verify_cache(tmp_path / "c", source="sample", seed=1).source_compared == 20
    assert verify_cache(tmp_path / "c", source=True).source_compared == 20


def test_a_changed_or_missing_source_is_not_damage(cache, small_folder, capsys):
    (small_folder / "cat" / "img_000.jpg").unlink()
    os.utime(small_folder / "dog" / "img_004.jpg", ns=(1, 1))
    report = verify_cache(cache, source="all")
    assert report.ok and (report.source_compared, report.source_unavailable) == (10, 2)
    assert main(["verify", str(cache), "--source"]) == 0
    assert "2 source files missing or changed" in capsys.readouterr().out


def test_structural_damage_is_an_error_not_a_report(cache, capsys):
    m = json.loads((cache / "manifest.json").read_text())
    os.truncate(cache / m["files"]["index"], 10)
    with pytest.raises(CacheFormatError, match="truncated"):
        verify_cache(cache)
    assert main(["verify", str(cache)]) == 1
    assert "mmcache: error:" in capsys.readouterr().err


def test_a_record_marked_bad_in_a_built_cache_is_named(cache):
    files = fmt.open_cache(cache)
    state = np.fromfile(files.manifest.file("state"), fmt.STATE_DTYPE)
    state["state"][2] = fmt.BAD_SOURCE_CHANGED
    state.tofile(files.manifest.file("state"))
    report = verify_cache(cache)
    assert [(b.index, b.path) for b in report.bad] == [(2, files.path(2))]
    assert report.checked == 11 and "in a built cache" in report.bad[0].what
    state["state"][2] = fmt.EMPTY  # never written by a build: refused at open
    state.tofile(files.manifest.file("state"))
    with pytest.raises(CacheFormatError, match="record 2: empty in a built cache"):
        verify_cache(cache)


def test_a_sample_is_1_percent_of_a_large_cache(tmp_path, capsys):
    # docs/reliability.md: "verify --source: decode 1% of the source (at least 20 files)". 3,000
    # records: 30 files decoded and compared.
    from conftest import write_image

    one = write_image(tmp_path / "one.png", 4, 4)
    for k in range(3000):  # links to one small file: a large listing, quick to build
        (tmp_path / "s" / "a").mkdir(parents=True, exist_ok=True)
        os.link(one, tmp_path / "s" / "a" / f"{k:04d}.png")
    build_cache(tmp_path / "s", tmp_path / "c", workers=1)
    assert verify_cache(tmp_path / "c", source="sample", seed=3).source_compared == 30
    assert main(["verify", str(tmp_path / "c"), "--source"]) == 0
    assert "30 compared with the source" in capsys.readouterr().out


def _damage(cache, i):
    """Flip one byte in the middle of record ``i``'s pixels; returns the opened files."""
    files, off, n = _record(cache, i)
    _flip(files.manifest.file("data"), off + n // 2, bit=3)
    return files


def test_a_flipped_byte_is_repaired_by_verify_repair(cache, small_folder, capsys):
    before = _damage(cache, 5)
    assert main(["verify", str(cache), "--repair", "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "bad record 5" in out and "1 bad record repaired" in out
    assert verify_cache(cache).ok
    after = fmt.open_cache(cache)
    assert after.manifest.generation != before.manifest.generation
    # only record 5 moved (appended, as a refresh appends); the others stay where they were
    moved = np.flatnonzero(after.index["offset"] != before.index["offset"])
    assert moved.tolist() == [5]
    ds = MemmapImageDataset(cache, verify="first-read")
    for i in range(len(ds)):
        assert np.array_equal(ds.read(i), decode_image(small_folder / after.path(i)))
    # and a build finds it current
    assert build_cache(small_folder, cache, workers=1).up_to_date


def test_the_messages_name_the_repair_command_and_it_is_accepted(cache, capsys):
    _damage(cache, 3)
    with pytest.raises(CacheFormatError) as e:
        MemmapImageDataset(cache, verify="first-read")[3]
    command = re.search(r"`(mmcache verify [^`]*--repair)`", str(e.value)).group(1)
    assert main(["verify", str(cache)]) == 1
    assert f"`{command}`" in capsys.readouterr().out
    assert main(shlex.split(command)[1:]) == 0
    assert verify_cache(cache).ok


def test_one_bad_record_counts_once_when_compared_with_the_source(cache, capsys):
    _damage(cache, 4)
    report = verify_cache(cache, source="all")
    assert [b.index for b in report.bad] == [4]
    assert main(["verify", str(cache), "--source", "all"]) == 1
    assert ": 1 BAD" in capsys.readouterr().out
    repair = repair_cache(cache, source="all", workers=0)
    assert [b.index for b in repair.repaired] == [4] and repair.ok


def test_a_record_whose_source_vanished_or_changed_is_left_as_it_was(cache, small_folder, capsys):
    files = _damage(cache, 1)
    _damage(cache, 2)
    (small_folder / files.path(1)).unlink()
    os.utime(small_folder / files.path(2), ns=(1, 1))
    generation = files.manifest.generation
    assert main(["verify", str(cache), "--repair", "--workers", "0"]) == 1
    out = capsys.readouterr().out
    assert "not repaired: record 1" in out and "vanished since it was listed" in out
    assert "not repaired: record 2" in out and "changed since it was listed" in out
    assert f"`mmcache build {small_folder} {cache}`" in out
    assert fmt.read_manifest(cache).generation == generation  # nothing published
    assert [b.index for b in verify_cache(cache).bad] == [1, 2]
    # one of two repairable: the other is repaired, this one stays as it was
    _damage(cache, 6)
    kept = [MemmapImageDataset(cache, on_stale="ignore").read(i).copy() for i in (1, 2)]
    report = repair_cache(cache, workers=0)
    assert [b.index for b in report.repaired] == [6] and not report.ok
    assert [b.index for b in report.unrepaired] == [1, 2]
    # their bytes where they were, not the zeros of the space appended for them
    ds = MemmapImageDataset(cache, on_stale="ignore")
    assert all(np.array_equal(ds.read(i), k) for i, k in zip((1, 2), kept, strict=True))
    assert [b.index for b in verify_cache(cache).bad] == [1, 2]
    # and a build from the source refreshes them, as the message says
    build_cache(small_folder, cache, workers=1)
    assert verify_cache(cache).ok


def test_a_failed_copy_leaves_nothing_new_behind(cache, tmp_path):
    _damage(cache, 0)
    with pytest.raises(CacheFormatError, match="does not match its CRC-32"):
        copy_cache(cache, tmp_path / "new" / "copy")
    assert not (tmp_path / "new" / "copy").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheFormatError):
        copy_cache(cache, tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []
