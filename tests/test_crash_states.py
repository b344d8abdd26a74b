"""Power cuts: the crash-state explorer's quick mode (tools/crash_states.py), and the lazy fill's
lost fills found and filled again after a reboot."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import reference, write_image

import mmcache._filler
from mmcache import MemmapImageDataset, build_cache, create_lazy_cache, verify_cache
from mmcache import format as fmt

TOOL = Path(__file__).resolve().parents[1] / "tools" / "crash_states.py"


def _tool():
    spec = importlib.util.spec_from_file_location("crash_states", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["crash_states"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _can_reboot() -> bool:
    if shutil.which("strace") is None or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_reboot(), reason="needs strace and user namespaces (unshare -rm)")
def test_a_lazy_fill_by_two_processes_gives_no_wrong_pixel_in_any_crash_state(tmp_path):
    # The tool's quick mode. Without the filling- files it fails: a state whose FILLED states
    # reached the disk before the pixels served those records as zeros, and the next build
    # kept them.
    run = subprocess.run(
        [sys.executable, str(TOOL), "--ops", "lazy", "--quick", "--seed", "7"],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no wrong pixel, crash, hang or failed rebuild" in run.stdout
    found = re.findall(r"(ordered|weak): \d+ states \((\d+) distinct", run.stdout)
    assert [m for m, _ in found] == ["ordered", "weak"], run.stdout
    assert all(int(n) > 10 for _, n in found), run.stdout


def test_the_models_keep_what_was_synced_and_may_lose_the_rest():
    crash_states = _tool()
    Op = crash_states.Op
    ops = [
        Op("create", ino=0, path="/c/a"),
        Op("write", ino=0, offset=0, data=b"x" * 5000),  # two 4 KiB blocks
        Op("fsync", ino=0),
        Op("write", ino=0, offset=0, data=b"y" * 5000),
        Op("rename", path="/c/a", dest="/c/b"),
    ]
    initial = crash_states.FS(["/c"], {"/c"})

    for model in ("ordered", "weak"):
        plans, _ = crash_states.plans(ops, model, 64, random.Random(0))
        trees = [crash_states.materialize(initial, ops, p) for p in plans if p.cut == len(ops)]
        contents = {t.get("/c/b", t.get("/c/a")) for t in trees}
        assert {b"x" * 5000, b"y" * 5000} <= contents  # the synced write is never lost
        assert all(c is not None and len(c) == 5000 and c[:1] in b"xy" for c in contents)
        names = {tuple(sorted(k for k in t if k != "/c")) for t in trees}
        # the rename had no folder fsync after it: only the weak model may undo it
        assert names == ({("/c/b",)} if model == "ordered" else {("/c/a",), ("/c/b",)})


def test_fills_that_a_power_cut_lost_are_filled_again_after_the_reboot(tmp_path, monkeypatch):
    src = tmp_path / "src"
    for i in range(4):
        write_image(src / f"c{i % 2}" / f"{i}.png", 16, 12, seed=i)
    cache, disk = tmp_path / "cache", tmp_path / "after-the-power-cut"
    create_lazy_cache(src, cache)
    ds = MemmapImageDataset(cache)
    for i in range(len(ds)):
        ds[i]
    markers = [n for n in os.listdir(cache) if fmt.is_fill_marker_name(n)]
    assert len(markers) == 1  # this process fills: its file is there until it closes
    # The disk after a power cut now: every state reached it, the pixels of record 1 did not.
    shutil.copytree(cache, disk)
    files = fmt.open_cache(disk)
    off, n = int(files.index[1]["offset"]), int(fmt.record_nbytes(files.index, "rgb")[1])
    with open(files.manifest.file("data"), "r+b") as f:
        f.seek(off)
        f.write(bytes(n))
    assert files.state["state"][1] == fmt.FILLED
    ds._reader.filler.close()  # flushed: the file goes
    assert not any(fmt.is_fill_marker_name(n) for n in os.listdir(cache))

    monkeypatch.setattr(mmcache._filler, "boot_id", lambda: "another-boot")
    # BatchLoader copies the records the reader calls filled straight out of the mapping:
    # none is, until this reader checked it.
    assert not MemmapImageDataset(disk).reader.filled(np.arange(4)).any()
    report = verify_cache(disk)  # names the lost fill, and says what becomes of it
    assert [b.index for b in report.bad] == [1] and "power cut" in report.bad[0].what
    for verify in (None, "first-read"):
        reopened = MemmapImageDataset(disk, verify=verify)
        for i, (path, _) in enumerate(reopened.samples):
            assert np.array_equal(reopened[i][0], reference(path)), (verify, path)
        if reopened._reader.filler is not None:
            reopened._reader.filler.close()
    # A build (a writer) checks every fill, marks the lost ones EMPTY, and fills them; the
    # other boot's file is then gone.
    (disk / markers[0]).write_text("another-boot-before")
    with open(files.manifest.file("data"), "r+b") as f:
        f.seek(off)
        f.write(bytes(n))
    build_cache(src, disk, workers=0)
    assert not any(fmt.is_fill_marker_name(n) for n in os.listdir(disk))
    built = MemmapImageDataset(disk, verify="first-read")
    for i, (path, _) in enumerate(built.samples):
        assert np.array_equal(built[i][0], reference(path)), path


def test_without_a_boot_id_every_filler_file_counts_as_another_boot_s(tmp_path, monkeypatch):
    # A machine without /proc/sys/kernel/random/boot_id writes "" into its filler files: the
    # next boot reads "" too, so an empty id cannot tell a reboot; every fill is checked.
    src = tmp_path / "src"
    for i in range(2):
        write_image(src / f"c{i}" / f"{i}.png", 8, 6, seed=i)
    create_lazy_cache(src, tmp_path / "cache")
    ds = MemmapImageDataset(tmp_path / "cache")
    for i in range(len(ds)):
        ds[i]
    ds._reader.filler.close()
    assert MemmapImageDataset(tmp_path / "cache").reader.filled(np.arange(2)).all()
    monkeypatch.setattr(mmcache._filler, "boot_id", lambda: "")
    (tmp_path / "cache" / "filling-0123456789abcdef").write_bytes(b"")
    assert not MemmapImageDataset(tmp_path / "cache").reader.filled(np.arange(2)).any()
