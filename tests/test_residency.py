"""Residency: info, warm and evict measured with mincore on real files; budgets; the CLI."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
from conftest import make_folder, wait_until

from mmcache import MemmapImageDataset, build_cache, cache_info, evict_cache, warm_cache
from mmcache import format as fmt
from mmcache import residency as res
from mmcache.cli import main

# Pages evicted and brought back, counted resident: not beside a test that drops the page cache
pytestmark = pytest.mark.xdist_group("page-cache")

MiB = 1 << 20


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (longest mount point that prefixes it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, fs = line.split()[:3]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


@pytest.fixture
def cache(tmp_path):
    # 24 images of 128x96x3 (36 KiB each): about 0.9 MiB of data, many pages.
    make_folder(tmp_path / "src", {"a": [(128, 96)] * 12, "b": [(128, 96)] * 12})
    build_cache(tmp_path / "src", tmp_path / "cache", workers=1)
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("on tmpfs a file's pages are the file: they cannot be evicted")
    return tmp_path / "cache"


def _evicted(cache: Path) -> None:
    """Evict until none of the data file is resident (advice the kernel may take a moment
    over: a page still on a per-CPU list or under writeback is skipped by that call)."""
    wait_until(lambda: evict_cache(cache) == 0, "evict_cache to leave no page resident")


def _warmed(cache: Path, max_memory="100%") -> None:
    """Warm until all of the data file is resident, as warm_cache and cache_info both measure."""
    wait_until(
        lambda: (
            warm_cache(cache, max_memory=max_memory).resident_share == 1.0
            and cache_info(cache).resident_share == 1.0
        ),
        "warm_cache to bring every page in",
    )


def test_evict_then_warm_moves_residency_from_none_to_all(cache):
    data = cache_info(cache).data_bytes
    # A file just written is likely all resident: evict first, so warming has work to do.
    _evicted(cache)
    assert cache_info(cache).resident_bytes == 0
    # A budget of all RAM: what other processes on the machine use cannot stop it.
    report = warm_cache(cache, max_memory="100%")
    assert report.resident_before == 0 and not report.stopped_by_budget
    assert report.read_bytes == data  # one piece (16 MiB > 0.9 MiB), read whole
    _warmed(cache)
    # Warming a warm cache reads nothing (a page reclaimed meanwhile is read again, once).
    wait_until(lambda: warm_cache(cache, max_memory="100%").read_bytes == 0, "a warm no-op")
    _evicted(cache)
    assert cache_info(cache).resident_share == 0.0


def _fake_ram(monkeypatch, total: int, used: int) -> None:
    """Pretend the machine has ``total`` bytes of RAM of which processes use ``used``."""

    class VM:
        pass

    vm = VM()
    vm.total, vm.available = total, total - used
    monkeypatch.setattr(res.psutil, "virtual_memory", lambda: vm)
    monkeypatch.setattr(res, "_cgroup_memory", lambda: None)


def test_budget_stops_warming(cache, monkeypatch):
    data = cache_info(cache).data_bytes
    monkeypatch.setattr(res, "CHUNK", 64 << 10)  # pieces small enough to stop within 0.9 MiB
    _evicted(cache)
    _fake_ram(monkeypatch, total=1000 * MiB, used=500 * MiB)
    # 50% of 1000 MiB is already used by processes: nothing may be read.
    report = warm_cache(cache, max_memory="50%")
    assert report.stopped_by_budget and report.read_bytes == 0
    assert report.budget_bytes == 500 * MiB
    # Room for 256 KiB of the cache: four 64 KiB pieces at most.
    report = warm_cache(cache, max_memory=500 * MiB + (256 << 10))
    assert report.stopped_by_budget
    assert 0 < report.read_bytes <= 256 << 10
    assert report.resident_after < data
    # With room for all of it, it all goes in.
    report = warm_cache(cache, max_memory="60%")
    assert not report.stopped_by_budget and report.read_bytes > 0
    _warmed(cache, max_memory="60%")


def test_tiny_budget_from_the_cli(cache, capsys):
    _evicted(cache)
    assert main(["warm", str(cache), "--max-memory", "1K"]) == 0
    out = capsys.readouterr().out
    assert "stopped at the memory budget" in out and "0 B (0%) resident" in out
    assert cache_info(cache).resident_bytes == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90%", 900),
        ("0%", 0),
        ("12.5 %", 125),
        ("8G", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", int(1.5 * (1 << 30))),
        ("4096", 4096),
        ("90", 90),  # a bare number is bytes, not a percentage
        (4096, 4096),
        ("2k", 2048),
    ],
)
def test_parse_memory(text, expected):
    assert res.parse_memory(text, total=1000) == expected


@pytest.mark.parametrize("text", ["", "%", "101%", "8X", "-1G", "lots", -5])
def test_parse_memory_refuses(text):
    with pytest.raises(ValueError):
        res.parse_memory(text, total=1000)


def test_memory_follows_a_smaller_cgroup_limit(monkeypatch):
    _fake_ram(monkeypatch, total=64 << 30, used=1 << 30)
    assert res.memory() == res.Memory(64 << 30, 63 << 30, cgroup_limited=False)
    monkeypatch.setattr(res, "_cgroup_memory", lambda: (4 << 30, 1 << 30))
    assert res.memory() == res.Memory(4 << 30, 3 << 30, cgroup_limited=True)
    monkeypatch.setattr(res, "_cgroup_memory", lambda: (128 << 30, 1 << 30))
    assert not res.memory().cgroup_limited


def test_info_fields(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "c", workers=1)
    info = cache_info(tmp_path / "c")
    assert info.cache == str((tmp_path / "c").absolute())
    assert info.images == info.filled == 12
    assert info.classes == ["cat", "dog", "emu"]
    # small_folder's sizes (w, h): 64x48, 48x64, 40x40, 33x17; shapes are (h, w, c).
    assert info.min_size == (17, 33, 3) and info.max_size == (48, 64, 3)
    assert not info.fixed_size
    assert (
        info.data_bytes == json.loads((tmp_path / "c/manifest.json").read_text())["sizes"]["data"]
    )
    assert info.apparent_bytes > info.data_bytes and info.disk_bytes > 0
    assert info.format_version == fmt.FORMAT_VERSION and info.mode == "build"
    assert info.options["color"] == "rgb" and info.skipped == []
    assert info.stale is None
    assert 0 <= info.resident_bytes <= info.data_bytes
    assert 0 < info.ram_available <= info.ram_total
    # A changed source makes it stale, with the reason.
    img = small_folder / "cat" / "img_000.jpg"
    os.utime(img, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert "changed" in cache_info(tmp_path / "c").stale
    assert cache_info(tmp_path / "c", check_stale=False).stale is None


def test_info_cli_text_and_json(small_folder, tmp_path, capsys):
    build_cache(small_folder, tmp_path / "c", size=(24, 32), workers=1)
    assert main(["info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "12 (12 filled), 3 classes, 0 skipped" in out
    assert (
        "all 24x32x3 (height x width x channels)" in out
        and "resident:" in out
        and "available" in out
    )
    assert main(["info", str(tmp_path / "c"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["images"] == 12 and d["fixed_size"] is True and d["min_size"] == [24, 32, 3]
    assert d["format_version"] == list(fmt.FORMAT_VERSION) and d["stale"] is None
    assert d["options"]["size"] == [24, 32]
    assert d["resident_share"] == d["resident_bytes"] / d["data_bytes"]
    assert {"disk_bytes", "apparent_bytes", "ram_total", "ram_available", "skipped"} <= set(d)


def test_cli_on_a_missing_cache_is_one_line(tmp_path, capsys):
    for verb in ("info", "warm", "evict"):
        assert main([verb, str(tmp_path / "nope")]) == 1
        err = capsys.readouterr().err
        assert err.startswith("mmcache: error: ") and len(err.strip().splitlines()) == 1


def test_evict_cli(cache, capsys):
    _warmed(cache)

    def evicted_by_the_cli() -> bool:
        assert main(["evict", str(cache)]) == 0
        return "none of the data is in the page cache" in capsys.readouterr().out

    wait_until(evicted_by_the_cli, "mmcache evict to leave no page resident")
    assert cache_info(cache).resident_bytes == 0


def test_dataset_warms_in_the_background(cache):
    _evicted(cache)
    ds = MemmapImageDataset(cache, warm="100%")
    report = ds.wait_warm(timeout=60)
    assert report is not None and report.resident_before == 0
    assert report.read_bytes == report.data_bytes and not report.stopped_by_budget
    # warm=True: the same, within the default budget
    default = MemmapImageDataset(cache, warm=True).wait_warm(timeout=60)
    assert default.budget_bytes == res.parse_memory(res.DEFAULT_MAX_MEMORY, default.ram.total)
    # The thread stays behind: a pickled copy (what a worker gets) carries no warming.
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.wait_warm() is None and copy[0][0].shape == (96, 128, 3)
    assert MemmapImageDataset(cache).wait_warm() is None


def test_dataset_refuses_a_bad_warm_budget(cache):
    with pytest.raises(ValueError, match="memory budget"):
        MemmapImageDataset(cache, warm="lots")


def test_resident_bytes_of_a_range(tmp_path):
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("on tmpfs a file's pages cannot be evicted")
    p = tmp_path / "f.bin"
    p.write_bytes(os.urandom(8 * res.PAGE))

    def evicted() -> bool:
        res.evict_file(p)
        return res.resident_bytes(p) == 0

    wait_until(evicted, "evict_file to leave no page resident")
    with open(p, "rb") as f:
        f.seek(2 * res.PAGE)
        f.read(res.PAGE)
    # Readahead may bring neighbours in; the page read is in, and a sub-range is clipped.
    assert res.resident_bytes(p, 2 * res.PAGE, 3 * res.PAGE) == res.PAGE
    assert res.resident_bytes(p, 2 * res.PAGE + 100, 2 * res.PAGE + 200) == 100


def test_a_cache_larger_than_ram_reads_a_record_s_pages_and_no_others(cache, monkeypatch):
    """A page fault that misses the page cache reads around the page (up to the disk's
    read-ahead, 128 KiB by default and 8 MiB on some VMs): for a cache that does not fit in RAM,
    a sample must bring in its own pages only."""
    from conftest import reference

    from mmcache import _records as records_module

    ds = MemmapImageDataset(cache)
    small = res.Memory(total=64 * MiB, available=MiB // 2)  # less than the 0.9 MiB cache
    monkeypatch.setattr(records_module, "memory", lambda: small)
    _evicted(cache)
    data = ds.manifest.file("data")
    i = len(ds) // 2
    img, _ = ds[i]
    path = ds.samples[i][0]
    assert (img == reference(path)).all()  # every page of the record is read
    off, n = int(ds.reader.records.offsets[i]), int(ds.reader.records.nbytes[i])
    first, last = off // 4096, (off + n - 1) // 4096
    assert res.resident_bytes(data) <= (last - first + 1) * 4096
    assert res.resident_bytes(data, first * 4096, (last + 1) * 4096) == (last - first + 1) * 4096


def test_whether_the_cache_fits_is_looked_at_again_every_two_seconds(cache, monkeypatch):
    """A cache that fits in the RAM available keeps the kernel's read-around; one that does not
    is read exactly. The RAM available is looked at again once ``FIT_CHECK_SECONDS`` (2 s) have
    passed since the last look, not at each read (a clock of the test's own: no waiting)."""
    from types import SimpleNamespace

    from mmcache import _records as records_module

    assert records_module.FIT_CHECK_SECONDS == 2.0
    size = MemmapImageDataset(cache).manifest.sizes["data"]
    available = {"now": size + 1}
    monkeypatch.setattr(
        records_module, "memory", lambda: res.Memory(total=1 << 40, available=available["now"])
    )
    clock = {"now": 1000.0}
    monkeypatch.setattr(records_module, "time", SimpleNamespace(monotonic=lambda: clock["now"]))
    reader = MemmapImageDataset(cache).reader
    assert reader.reads_exactly() is False  # it fits
    available["now"] = size - 1
    clock["now"] = 1001.0
    assert reader.reads_exactly() is False  # not looked at again yet
    clock["now"] = 1002.0
    assert reader.reads_exactly() is True  # 2 s later: it no longer fits
    available["now"] = size
    clock["now"] = 1003.5
    assert reader.reads_exactly() is True
    clock["now"] = 1004.0
    assert reader.reads_exactly() is False  # exactly the RAM available: it fits
