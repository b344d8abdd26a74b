"""Decode workers: a decoder that crashes or hangs on a file, workers that cannot start, file
names that are not UTF-8, FIFOs. Builds run in a subprocess whose decoder is sabotaged on
chosen files by a ``sitecustomize`` module, which every Python process of it (the forkserver
and each decode worker) imports at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import TESTIMAGES, make_folder, reference
from torch.utils.data import DataLoader

from mmcache import MemmapImageDataset, build_cache
from mmcache import format as fmt

# Every subprocess gets this long; a build that hangs fails the test instead of the suite.
DEADLINE = 180

SABOTAGE = """
import os, signal, time
import cv2

_imread = cv2.imread
def imread(name, *args):
    target = os.readlink(name) if name.startswith("/proc/self/fd/") else name
    base = os.path.basename(target)
    if base.startswith("crash"):
        os.kill(os.getpid(), signal.SIGSEGV)
    if base.startswith("hang"):
        time.sleep(3600)
    if base.startswith("die"):
        os._exit(9)
    return _imread(name, *args)
cv2.imread = imread
if os.environ.get("WORKERS_CANNOT_START"):
    cv2.setNumThreads = lambda n: os._exit(7)  # the first thing a decode worker does
"""


def run_build(tmp_path: Path, src: Path, cache: Path, *args: str, env=None, timeout=None):
    """``mmcache build`` in a subprocess with the sabotaged decoder (``-c`` code may patch the
    parent first through ``PATCH``)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SABOTAGE)
    code = textwrap.dedent(
        """
        import os, sys
        import mmcache._workers as workers
        workers.DECODE_TIMEOUT = float(os.environ.get("DECODE_TIMEOUT", workers.DECODE_TIMEOUT))
        from mmcache.cli import main
        sys.exit(main(sys.argv[1:]))
        """
    )
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-c", code, "build", str(src), str(cache), *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout or DEADLINE,
    )


def forty_one(tmp_path: Path, bad_name: str) -> Path:
    """40 good JPEGs in 2 classes, and one whose decode is sabotaged, in the middle."""
    src = make_folder(tmp_path / "src", {"a": [(40, 30)] * 20, "b": [(30, 40)] * 20})
    shutil.copy(src / "a" / "img_000.jpg", src / "a" / bad_name)
    return src


def assert_good_records(cache: Path, expected: int) -> None:
    ds = MemmapImageDataset(cache)
    assert len(ds) == expected
    for i, (path, label) in enumerate(ds.samples):
        image, target = ds[i]
        assert target == label == ds.class_to_idx[Path(path).parent.name]
        assert np.array_equal(image, reference(path))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_decoder_crash_on_one_file_skips_it_and_the_build_goes_on(tmp_path, workers):
    src = forty_one(tmp_path, "crash.jpg")
    run = run_build(tmp_path, src, tmp_path / "cache", "--workers", workers)
    assert run.returncode == 0, run.stderr
    assert "40 images in 2 classes" in run.stdout and "1 skipped" in run.stdout
    assert (
        "skipped a/crash.jpg: the decoder crashed on it: its process was killed by SIGSEGV, "
        "on both tries" in run.stdout
    )
    assert "Traceback" not in run.stderr
    skipped = fmt.read_manifest(tmp_path / "cache").skipped
    assert [(s["path"], s["state"]) for s in skipped] == [("a/crash.jpg", fmt.BAD_UNDECODABLE)]
    assert_good_records(tmp_path / "cache", 40)
    # The next build keeps skipping the unchanged file, without crashing a worker again.
    again = run_build(tmp_path, src, tmp_path / "cache", "--workers", workers)
    assert again.returncode == 0 and "up to date" in again.stdout, again.stderr


def test_a_decoder_that_hangs_on_a_file_is_stopped_and_the_file_skipped(tmp_path):
    src = forty_one(tmp_path, "hang.jpg")
    run = run_build(
        tmp_path, src, tmp_path / "cache", "--workers", "2", env={"DECODE_TIMEOUT": "3"}
    )
    assert run.returncode == 0, run.stderr
    assert "skipped a/hang.jpg: the decoder crashed on it: its process gave no result in 3 s" in (
        run.stdout
    )
    assert_good_records(tmp_path / "cache", 40)


def test_a_worker_that_exits_mid_file_is_replaced(tmp_path):
    src = forty_one(tmp_path, "die.jpg")
    run = run_build(tmp_path, src, tmp_path / "cache", "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "skipped a/die.jpg: the decoder crashed on it: its process exited with status 9" in (
        run.stdout
    )
    assert_good_records(tmp_path / "cache", 40)


def test_workers_that_die_at_start_fail_the_build_in_one_line_and_publish_nothing(tmp_path):
    src = forty_one(tmp_path, "fine.jpg")
    build_cache(src, tmp_path / "cache", workers=0)
    before = sorted(os.listdir(tmp_path / "cache"))
    (src / "a" / "new.jpg").write_bytes((src / "a" / "img_001.jpg").read_bytes())
    run = run_build(
        tmp_path, src, tmp_path / "cache", "--workers", "2", env={"WORKERS_CANNOT_START": "1"}
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("mmcache: error: ") and "Traceback" not in run.stderr
    assert (
        "decode worker processes die as they start (exited with status 7), 3 in a row"
        in (lines[-1])
    )
    assert sorted(os.listdir(tmp_path / "cache")) == before  # the old cache, untouched


def test_a_decoder_that_crashes_on_every_file_fails_the_build(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(12):
        shutil.copy(TESTIMAGES / "hopper.jpg", src / f"crash_{k:02d}.jpg")
    run = run_build(tmp_path, src, tmp_path / "cache", "--workers", "2")
    assert run.returncode == 1
    assert "the decoder crashed 8 times and decoded no image" in run.stderr
    assert not (tmp_path / "cache").exists()


# --- names that are not UTF-8, and files that are not files ---------------------------------

NAMES = [b"bad\xff\xfename.jpg", b"caf\xe9.jpg"]  # invalid UTF-8; Latin-1 as old filesystems


def _non_utf8_folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for cls in (b"ok", b"\xe9t\xe9"):  # a class folder whose name is not UTF-8 either
        folder = os.path.join(os.fsencode(src), cls)
        os.makedirs(folder)
        for name, image in zip(NAMES, ("hopper.jpg", "flower.jpg"), strict=True):
            shutil.copy(TESTIMAGES / image, os.path.join(folder, name))
        shutil.copy(TESTIMAGES / "hopper.png", os.path.join(folder, b"plain.png"))
        shutil.copy(TESTIMAGES / "broken.png", os.path.join(folder, b"br\xfcken.png"))
    return src


def _reference_of(path: str, tmp_path: Path) -> np.ndarray:
    """The reference pixels of ``path``, decoded from a copy under an ASCII name."""
    plain = tmp_path / "plain" / ("copy" + os.path.splitext(path)[1])
    plain.parent.mkdir(exist_ok=True)
    shutil.copy(path, plain)
    return reference(plain)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_names_that_are_not_utf8_build_and_read_through_the_dataloader(tmp_path, context):
    src = _non_utf8_folder(tmp_path)
    report = build_cache(src, tmp_path / "cache", workers=2)
    assert report.images == 6 and len(report.skipped) == 2
    assert {os.fsencode(s["path"]).split(b"/")[-1] for s in report.skipped} == {b"br\xfcken.png"}
    ds = MemmapImageDataset(tmp_path / "cache")
    assert sorted(os.fsencode(c) for c in ds.classes) == [b"ok", b"\xe9t\xe9"]
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    seen = 0
    for (path, label), (img, target) in zip(ds.samples, loader, strict=True):
        assert os.path.exists(path) and target == label
        assert np.array_equal(img.numpy(), _reference_of(path, tmp_path))
        seen += 1
    assert seen == 6


def test_a_lazy_fill_of_a_name_that_is_not_utf8_does_not_crash_the_process(tmp_path):
    src = _non_utf8_folder(tmp_path)
    code = textwrap.dedent(
        """
        import sys
        from mmcache import MemmapImageDataset
        ds = MemmapImageDataset(sys.argv[1], source=sys.argv[2], on_bad="substitute")
        print(sum(ds[i][0].size > 0 for i in range(len(ds))))
        """
    )
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, str(tmp_path / "cache"), str(src)],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert run.returncode == 0, run.stderr  # -11 before: OpenCV segfaulted on the name
    assert run.stdout.strip() == "6"  # the broken PNGs, without a header, are left out
    ds = MemmapImageDataset(tmp_path / "cache")
    good = [(i, p) for i, (p, _) in enumerate(ds.samples) if not p.endswith("ken.png")]
    assert len(good) == 6 and any(b"\xff\xfe" in os.fsencode(p) for _, p in good)
    for i, path in good:
        assert np.array_equal(ds.read(i), _reference_of(path, tmp_path))


def test_the_cli_prints_names_that_are_not_utf8_as_escaped_bytes(tmp_path):
    src = _non_utf8_folder(tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "mmcache", "build", str(src), str(tmp_path / "cache")],
        capture_output=True,
        timeout=DEADLINE,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout.decode("utf-8")  # valid UTF-8 output, whatever the names
    assert "skipped \\xe9t\\xe9/br\\xfcken.png: a damaged or truncated PNG file" in out
    # The manifest stays ASCII JSON and gives the names back byte for byte.
    raw = (tmp_path / "cache" / "manifest.json").read_bytes()
    assert raw.isascii()
    skipped = fmt.read_manifest(tmp_path / "cache").skipped
    assert sorted(os.fsencode(s["path"]) for s in skipped) == [
        b"ok/br\xfcken.png",
        b"\xe9t\xe9/br\xfcken.png",
    ]


def test_a_fifo_named_like_an_image_is_skipped_never_waited_on(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 20), (21, 21)]})
    os.mkfifo(src / "a" / "pipe.jpg")
    run = subprocess.run(
        [sys.executable, "-m", "mmcache", "build", str(src), str(tmp_path / "c"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert run.returncode == 0, run.stderr
    assert "skipped a/pipe.jpg: not a regular file: a named pipe (FIFO)" in run.stdout
    assert len(MemmapImageDataset(tmp_path / "c")) == 2


def test_a_process_forked_after_a_build_builds_with_workers_of_its_own(tmp_path):
    # The parent's build started multiprocessing's forkserver; a forked child (a launcher
    # that forks its ranks, a fork-mode DataLoader worker) cannot ask whether that server, not
    # its own child, still runs (CPython gh-86354): every worker start failed there.
    make_folder(tmp_path / "src", {"a": [(40, 30), (30, 40)], "b": [(50, 20), (20, 50)]})
    code = textwrap.dedent(
        """
        import os, sys
        from mmcache import build_cache
        root = sys.argv[1]
        build_cache(root + "/src", root + "/parent", workers=1)
        pid = os.fork()
        if pid == 0:
            try:
                build_cache(root + "/src", root + "/child", workers=1)
            except BaseException as e:
                print(repr(e), file=sys.stderr, flush=True)
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        sys.exit(os.waitstatus_to_exitcode(status))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
        timeout=DEADLINE,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    child = MemmapImageDataset(tmp_path / "child")
    assert len(child) == 4
    for i in range(len(child)):
        assert np.array_equal(child.read(i), MemmapImageDataset(tmp_path / "parent").read(i))
