"""Verification: verify_cache and `mmcache verify` name each bad record; verify="first-read"."""

from __future__ import annotations

import json
import os
import re
import shlex
import time
import zlib

import numpy as np
import pytest

from mmcache import (
    CacheFormatError,
    MemmapImageDataset,
    build_cache,
    copy_cache,
    create_lazy_cache,
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
    start = time.perf_counter()
    report = verify_cache(cache)
    assert 0 <= report.seconds <= time.perf_counter() - start  # the time it took, not more
    files = fmt.open_cache(cache)
    sizes = [int(r["height"]) * int(r["width"]) * int(r["channels"]) for r in files.index]
    assert report.ok and report.records == report.checked == 12
    assert report.bytes == sum(sizes) and report.bad == []
    # checksums only: no source file decoded, none counted missing, no lazy record empty
    assert (report.source_compared, report.source_unavailable, report.empty) == (0, 0, 0)


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


def _rewrite(cache, records):
    """Write zeros over each of ``records`` with a matching CRC-32 (as a buggy writer would):
    only decoding the source again finds them."""
    files = fmt.open_cache(cache)
    state = np.fromfile(files.manifest.file("state"), fmt.STATE_DTYPE)
    with open(files.manifest.file("data"), "r+b") as f:
        for i in records:
            _, off, n = _record(cache, i)
            f.seek(off)
            f.write(bytes(n))
            state["crc32"][i] = zlib.crc32(bytes(n))
    state.tofile(files.manifest.file("state"))


def test_the_sample_is_20_distinct_records_drawn_by_the_seed_and_repair_draws_the_same(tmp_path):
    from conftest import make_folder

    src = make_folder(tmp_path / "s", {"a": [(8, 8)] * 30})
    cache = tmp_path / "c"
    build_cache(src, cache, workers=0)
    _rewrite(cache, range(30))  # every record wrong: the records found bad are those compared

    def sample(seed):
        report = verify_cache(cache, source="sample", seed=seed)
        assert report.source_compared == len(report.bad)
        return [b.index for b in report.bad]

    drawn = sample(5)
    assert len(drawn) == len(set(drawn)) == 20 and set(drawn) <= set(range(30))
    assert sample(5) == drawn  # the same seed, the same records
    assert sample(6) != drawn  # another seed, another sample (1 chance in 30 million)
    repaired = repair_cache(cache, source="sample", seed=5, workers=0).repaired
    assert [b.index for b in repaired] == drawn
    # "all" compares every record, however many: the 10 the sample left are still wrong
    report = verify_cache(cache, source="all")
    assert report.source_compared == 30
    assert [b.index for b in report.bad] == sorted(set(range(30)) - set(drawn))


def test_progress_counts_records_checked_then_files_decoded(cache):
    calls = []
    verify_cache(cache, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (12, 12) and all(t == 12 for _, t in calls)
    calls.clear()
    verify_cache(cache, source="all", progress=lambda done, total: calls.append((done, total)))
    # 12 checksums, then 12 files decoded: the count goes up one by one to 24
    assert all(t == 24 for _, t in calls)
    assert [d for d, _ in calls if d > 12] == list(range(13, 25))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    # a repair: its verification (12 records), then its decoding (the 1 bad record)
    _damage(cache, 5)
    calls.clear()
    repair_cache(cache, workers=0, progress=lambda done, total: calls.append((done, total)))
    assert calls[0][1] == 12 and (12, 12) in calls and calls[-1] == (1, 1)


def test_a_lazy_cache_s_empty_records_are_counted_not_checked(small_folder, tmp_path):
    create_lazy_cache(small_folder, tmp_path / "lazy")
    ds = MemmapImageDataset(tmp_path / "lazy")
    ds[0], ds[3], ds[7]  # filled by these reads
    report = verify_cache(tmp_path / "lazy")
    assert report.ok and (report.records, report.checked, report.empty) == (12, 3, 9)


def test_a_truncation_between_checksums_and_comparison_is_an_error(cache):
    data = fmt.open_cache(cache).manifest.file("data")

    def cut(done, total):  # the checksums are done: the data file shrinks
        if done == 12:
            os.truncate(data, 0)

    with pytest.raises(
        CacheFormatError, match=re.escape(f"{data}: truncated while it was verified")
    ):
        verify_cache(cache, source="all", progress=cut)


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
    assert report.checked == 11
    assert report.bad[0].what == (
        "marked bad (it changed or vanished since it was listed) in a built cache"
    )
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
    assert [(b.index, b.path) for b in report.unrepaired] == [
        (1, files.path(1)),
        (2, files.path(2)),
    ]
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


def test_repair_checks_checksums_unless_asked_and_names_what_it_published(cache):
    _rewrite(cache, [7])  # a matching checksum: only the source finds it
    report = repair_cache(cache, workers=0)
    assert report.ok and report.repaired == [] and report.generation is None
    assert report.found.source_compared == 0
    start = time.perf_counter()
    report = repair_cache(cache, source="all", workers=0)
    took = time.perf_counter() - start
    assert [b.index for b in report.repaired] == [7] and report.ok
    assert report.generation == fmt.read_manifest(cache).generation
    # the time it took, within the call; verifying is part of the repair
    assert 0 <= report.found.seconds <= report.seconds <= took
    assert verify_cache(cache, source="all").ok


def test_repair_deletes_what_a_killed_writer_left(cache):
    left = cache / "data-0123456789abcdef.bin"  # a generation's data file, never published
    left.write_bytes(b"half written")
    _damage(cache, 2)
    assert [b.index for b in repair_cache(cache, workers=0).repaired] == [2]
    assert not left.exists()


def test_repair_with_no_workers_decodes_in_this_process(cache, monkeypatch):
    # workers=0: a decoder patched in this process is the one used (no worker process)
    import mmcache._workers

    def fails(*args, **kwargs):
        return fmt.BAD_UNDECODABLE, 0, "patched: no decode", None

    monkeypatch.setattr(mmcache._workers, "decode_record", fails)
    _damage(cache, 3)
    report = repair_cache(cache, workers=0)
    assert [(b.index, b.what) for b in report.unrepaired] == [(3, "patched: no decode")]


def _replace_keeping_stat(path, data):
    """Write ``data`` over ``path`` at its size (zero-padded) and with its mtime."""
    st = path.stat()
    assert len(data) <= st.st_size
    path.write_bytes(data + bytes(st.st_size - len(data)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_source_that_no_longer_decodes_or_decodes_to_another_size_is_named(
    cache, small_folder, tmp_path
):
    from conftest import write_image

    files = fmt.open_cache(cache)
    _replace_keeping_stat(small_folder / files.path(1), b"not an image")
    small = write_image(tmp_path / "small.jpg", 8, 6).read_bytes()  # 8 wide, 6 high
    _replace_keeping_stat(small_folder / files.path(4), small)
    h, w, c = (int(files.index[4][k]) for k in ("height", "width", "channels"))
    report = verify_cache(cache, source="all")
    assert [(b.index, b.path, b.what) for b in report.bad] == [
        (1, files.path(1), "its source no longer decodes"),
        (4, files.path(4), f"stored as {(h, w, c)}, the source decodes to (6, 8, 3)"),
    ]
    assert report.source_compared == 11  # the file that no longer decodes is not compared


def test_a_checksum_failure_names_both_crcs_and_in_a_lazy_cache_a_fill_a_power_cut_lost(
    cache, small_folder, tmp_path, monkeypatch
):
    def message(cache, i):
        files, off, n = _record(cache, i)
        data = files.manifest.file("data").read_bytes()[off : off + n]
        stored = int(files.state["crc32"][i])
        return f"pixels fail their checksum (CRC-32 {zlib.crc32(data):08x}, stored {stored:08x})"

    _damage(cache, 5)
    assert [b.what for b in verify_cache(cache).bad] == [message(cache, 5)]
    # a lazy cache: the same words while no fill may have been lost to a power cut
    lazy = tmp_path / "lazy"
    create_lazy_cache(small_folder, lazy)
    ds = MemmapImageDataset(lazy)
    ds[2], ds[5]
    ds._reader.filler.close()
    _damage(lazy, 5)
    assert [b.what for b in verify_cache(lazy).bad] == [message(lazy, 5)]
    # another boot's filler file: the failure may be a fill lost, and says so
    import mmcache._filler

    (lazy / "filling-0123456789abcdef").write_text("another-boot-before")
    monkeypatch.setattr(mmcache._filler, "boot_id", lambda: "another-boot")
    assert [b.what for b in verify_cache(lazy).bad] == [
        message(lazy, 5) + ": a fill lost in a power cut, filled again when read"
    ]


@pytest.mark.parametrize("read_bytes", [1, 5000, 8 << 20])
def test_checksums_read_in_batches_of_any_size_find_the_same(
    small_folder, tmp_path, monkeypatch, read_bytes
):
    # READ_BYTES: how much one read takes (1: a record each; 5000: some records alone, some
    # together). Five records filled of a lazy cache's twelve: an odd count, gaps between them.
    import mmcache.verify

    monkeypatch.setattr(mmcache.verify, "READ_BYTES", read_bytes)
    lazy = tmp_path / "lazy"
    create_lazy_cache(small_folder, lazy)
    ds = MemmapImageDataset(lazy)
    filled = [0, 3, 5, 8, 11]
    for i in filled:
        ds[i]
    ds._reader.filler.close()
    _damage(lazy, 5)
    _damage(lazy, 11)
    calls = []
    report = verify_cache(lazy, progress=lambda done, total: calls.append((done, total)))
    assert [b.index for b in report.bad] == [5, 11]
    assert all(b.what.startswith("pixels fail their checksum") for b in report.bad)
    assert report.checked == 5 and report.bytes == sum(_record(lazy, i)[2] for i in filled)
    assert calls[-1] == (5, 5)
    if read_bytes == 1:  # a read per record: the data file cut inside the last one meanwhile
        files, off, _ = _record(lazy, 11)
        data = files.manifest.file("data")

        def cut(done, total):
            if done == 1:
                os.truncate(data, off + 10)

        with pytest.raises(CacheFormatError, match=re.escape(
            f"{data}: ends at {off + 10} bytes, record 11 needs more: the data file was "
            "truncated while it was verified"
        )):  # fmt: skip
            verify_cache(lazy, progress=cut)
