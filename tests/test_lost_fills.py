"""Fills a power cut may have lost: this boot's id, which ``filling-`` files another boot left,
and what a writer's scrub makes of them (the whole story, with a power cut simulated, is in
test_crash_states.py; here each piece is stated on its own, in process)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import write_image

import mmcache._filler as filler
from mmcache import MemmapImageDataset, build_cache, create_lazy_cache
from mmcache import format as fmt

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def marker(folder: Path, token: str, content: bytes) -> Path:
    path = folder / f"filling-{token}"
    path.write_bytes(content)
    return path


@pytest.mark.skipif(not BOOT_ID.exists(), reason="Linux's boot id")
def test_the_boot_id_is_the_kernel_s_without_its_newline():
    assert filler.boot_id() == BOOT_ID.read_text().strip()
    assert len(filler.boot_id()) == 36


def test_without_a_readable_boot_id_it_is_empty(monkeypatch):
    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", unreadable)
    assert filler.boot_id() == ""


def test_a_boot_id_that_is_not_ascii_is_empty(monkeypatch, tmp_path):
    fake = tmp_path / "boot_id"
    fake.write_bytes(b"\xff\xfe-not-ascii\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: real_open(fake, mode))
    assert filler.boot_id() == ""


def test_the_filler_files_of_another_boot_are_the_lost_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    folder = tmp_path / "cache"
    folder.mkdir()
    mine = marker(folder, "0" * 16, b"this-boot")
    other = marker(folder, "1" * 16, b"another-boot")
    longer = marker(folder, "2" * 16, b"this-boot-and-more")
    garbled = marker(folder, "3" * 16, b"\xffthis-boot")
    (folder / "filling-notatoken").write_bytes(b"another-boot")  # not a filler file's name
    (folder / "index-0123456789abcdef.bin").write_bytes(b"another-boot")
    (folder / ("filling-" + "4" * 16)).symlink_to(mine)  # refused to open: counted lost
    lost = filler.lost_fill_markers(folder)
    assert sorted(lost) == sorted([other, longer, garbled, folder / ("filling-" + "4" * 16)])
    assert all(isinstance(p, Path) for p in lost)


def test_a_folder_of_this_boot_s_filler_files_or_none_has_none_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    folder = tmp_path / "cache"
    folder.mkdir()
    assert filler.lost_fill_markers(folder) == []
    assert filler.lost_fill_markers(tmp_path / "gone") == []
    marker(folder, "0" * 16, b"this-boot")
    assert filler.lost_fill_markers(folder) == []
    monkeypatch.setattr(filler, "boot_id", lambda: "")  # no id: no boot can be told apart
    assert filler.lost_fill_markers(folder) == [folder / ("filling-" + "0" * 16)]


def test_a_filler_file_gone_while_looked_at_is_not_lost(tmp_path, monkeypatch):
    """Its filler finished between the listing and the read: its fills are on disk."""
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    folder = tmp_path / "cache"
    folder.mkdir()
    gone = marker(folder, "0" * 16, b"another-boot")
    other = marker(folder, "1" * 16, b"another-boot")
    opened = filler.open_for_reading

    def finishing(path):
        if path == gone:
            path.unlink()
        return opened(path)

    monkeypatch.setattr(filler, "open_for_reading", finishing)
    listdir = os.listdir  # the gone one listed first, whatever the file system's order
    monkeypatch.setattr(filler.os, "listdir", lambda path: sorted(listdir(path)))
    assert filler.lost_fill_markers(folder) == [other]


def _lazy_filled(tmp_path: Path, count: int = 4) -> Path:
    src = tmp_path / "src"
    for i in range(count):
        write_image(src / f"c{i % 2}" / f"{i}.png", 8 + i, 6, seed=i)
    cache = tmp_path / "cache"
    create_lazy_cache(src, cache)
    ds = MemmapImageDataset(cache)
    for i in range(len(ds)):
        ds[i]
    ds.reader.filler.close()
    return cache


def _zero_record(files: fmt.CacheFiles, i: int) -> None:
    """Record ``i``'s pixels lost: zeros where they were (its state still says FILLED)."""
    m = files.manifest
    off = int(files.index[i]["offset"])
    n = int(fmt.record_nbytes(files.index, m.pixels, m.mask)[i])
    with open(m.file("data"), "r+b") as f:
        f.seek(off)
        f.write(bytes(n))


def _states(files: fmt.CacheFiles) -> list[tuple[int, int]]:
    """The state file as it is on disk now, read without mmcache's reader."""
    state = np.fromfile(files.manifest.file("state"), fmt.STATE_DTYPE)
    return [(int(c), int(s)) for c, s in zip(state["crc32"], state["state"], strict=True)]


def test_a_scrub_empties_the_lost_fills_of_a_lazy_cache_and_deletes_the_filler_files(
    tmp_path, monkeypatch
):
    cache = _lazy_filled(tmp_path)
    files = fmt.open_cache(cache)
    before = _states(files)
    _zero_record(files, 1)
    _zero_record(files, 3)
    lost = marker(cache, "0" * 16, b"another-boot")
    kept = cache / "filling-notatoken"
    kept.write_bytes(b"another-boot")
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    scrubbed = filler.scrub_lost_fills(files)
    expected = [before[0], (0, fmt.EMPTY), before[2], (0, fmt.EMPTY)]
    assert _states(files) == expected  # on disk
    assert [(int(c), int(s)) for c, s in scrubbed.state.tolist()] == expected
    assert [(int(c), int(s)) for c, s in files.state.tolist()] == before  # the caller's copy
    assert scrubbed.index is files.index and scrubbed.manifest is files.manifest
    assert not lost.exists() and kept.exists()
    assert [s for _, s in before] == [fmt.FILLED] * 4


def test_a_scrub_leaves_empty_and_bad_records_alone_and_deletes_files_of_no_loss(
    tmp_path, monkeypatch
):
    cache = _lazy_filled(tmp_path)
    files = fmt.open_cache(cache)
    state = files.manifest.file("state")
    with open(state, "r+b") as f:  # record 0 never filled, record 2 bad: neither checked
        f.seek(0)
        f.write(np.array([(0, fmt.EMPTY)], fmt.STATE_DTYPE).tobytes())
        f.seek(2 * fmt.STATE_DTYPE.itemsize)
        f.write(np.array([(0, fmt.BAD_UNDECODABLE)], fmt.STATE_DTYPE).tobytes())
    files = fmt.open_cache(cache)
    _zero_record(files, 0)
    _zero_record(files, 2)
    before = _states(files)
    lost = marker(cache, "0" * 16, b"another-boot")
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    scrubbed = filler.scrub_lost_fills(files)
    assert _states(files) == before
    assert [(int(c), int(s)) for c, s in scrubbed.state.tolist()] == before
    assert not lost.exists()


def test_a_scrub_of_a_data_file_cut_short_empties_the_records_past_its_end(tmp_path, monkeypatch):
    cache = _lazy_filled(tmp_path)
    files = fmt.open_cache(cache)
    before = _states(files)
    last = int(files.index[3]["offset"])
    os.truncate(files.manifest.file("data"), last + 1)
    marker(cache, "0" * 16, b"another-boot")
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    filler.scrub_lost_fills(files)
    assert _states(files) == [*before[:3], (0, fmt.EMPTY)]


def test_without_another_boot_s_filler_file_a_scrub_changes_nothing(tmp_path, monkeypatch):
    cache = _lazy_filled(tmp_path)
    files = fmt.open_cache(cache)
    _zero_record(files, 1)
    before = _states(files)
    mine = marker(cache, "0" * 16, b"this-boot")
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    assert filler.scrub_lost_fills(files) is files
    assert _states(files) == before and mine.exists()


def test_a_built_cache_s_lost_fills_are_left_for_verify_with_their_filler_files(
    tmp_path, monkeypatch
):
    """A built cache has no EMPTY state: a fill lost there (by a repair) stays FILLED and
    named by verify; its filler file stays until none is lost."""
    src = tmp_path / "src"
    for i in range(3):
        write_image(src / "c" / f"{i}.png", 8, 6, seed=i)
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    files = fmt.open_cache(cache)
    before = _states(files)
    _zero_record(files, 1)
    lost = marker(cache, "0" * 16, b"another-boot")
    monkeypatch.setattr(filler, "boot_id", lambda: "this-boot")
    scrubbed = filler.scrub_lost_fills(files)
    assert _states(files) == before
    assert [(int(c), int(s)) for c, s in scrubbed.state.tolist()] == before
    assert lost.exists()
    build_cache(src, tmp_path / "other", workers=0)  # the same pixels: none lost now
    with (
        open(files.manifest.file("data"), "r+b") as f,
        open(fmt.open_cache(tmp_path / "other").manifest.file("data"), "rb") as good,
    ):
        f.write(good.read())
    filler.scrub_lost_fills(fmt.open_cache(cache))
    assert not lost.exists()
