"""Distributed build under torchrun (real processes, gloo): equal to one process, fails cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_folder, write_image

import mmcache.build
from mmcache import build_cache
from mmcache import format as fmt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def torchrun(nproc: int, *args: str, env: dict | None = None, log_dir: Path | None = None):
    """Run ``args`` (a script or ``-m module`` with its arguments) as ``nproc`` local ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}"]
    if log_dir is not None:  # each rank's stdout and stderr in files of their own
        cmd += ["--log-dir", str(log_dir), "--redirects", "3"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        cmd + list(args), env=environ, capture_output=True, text=True, timeout=180
    )


def rank_logs(log_dir: Path, stream: str) -> dict[int, str]:
    """What each local rank wrote to ``stream`` (torchrun: <dir>/<run>/attempt_0/<rank>/)."""
    return {int(p.parent.name): p.read_text() for p in log_dir.rglob(f"{stream}.log")}


def records(cache: Path) -> dict:
    """Everything a cache holds except its generation name and creation time."""
    m = fmt.read_manifest(cache)
    files = fmt.read_cache_files(m)
    meta = m.to_json()
    for key in ("generation", "files", "created"):
        meta.pop(key)
    return {
        "manifest": meta,
        "index": files.index.tobytes(),
        "state": files.state.tobytes(),
        "paths": files.paths_blob,
        "data": m.file("data").read_bytes(),
    }


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """40 small images of uneven sizes (so shares by pixels differ from shares by count),
    an undecodable file, and big.png, which the tests make unprobed (an overflow record)."""
    sizes = [(24, 16), (16, 24), (40, 30), (9, 7), (64, 48)]
    src = make_folder(tmp_path / "src", {"a": sizes * 4, "b": sizes * 3, "c": sizes})
    (src / "b" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    write_image(src / "c" / "big.png", 50, 20, seed=99)
    return src


def test_two_ranks_build_what_one_process_builds(source, tmp_path):
    run = torchrun(2, "-m", "mmcache", "build", str(source), str(tmp_path / "c2"), "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "41 images, 3 classes" in run.stdout and "1 skipped" in run.stdout
    build_cache(source, tmp_path / "c1", workers=1, distributed=False)
    assert records(tmp_path / "c2") == records(tmp_path / "c1")

    again = torchrun(2, "-m", "mmcache", "build", str(source), str(tmp_path / "c2"))
    assert again.returncode == 0, again.stderr
    assert "up to date" in again.stdout


def test_three_ranks_refresh_an_old_cache_with_overflow(source, tmp_path, monkeypatch):
    build_cache(source, tmp_path / "c3", workers=1)
    write_image(source / "a" / "img_000.jpg", 30, 20, seed=7)  # modified: decoded again
    write_image(source / "b" / "new.jpg", 20, 30, seed=8)  # added
    os.unlink(source / "a" / "img_001.jpg")  # removed
    run = torchrun(
        3,
        str(HERE / "_torchrun_cli.py"),
        "build",
        str(source),
        str(tmp_path / "c3"),
        "--workers",
        "1",
        env={"UNPROBED": "big.png"},
    )
    assert run.returncode == 0, run.stderr
    assert "reused" in run.stdout

    real_probe = mmcache.build.probe_size
    monkeypatch.setattr(
        mmcache.build, "probe_size", lambda p: None if p.endswith("big.png") else real_probe(p)
    )
    build_cache(source, tmp_path / "c1", workers=1)
    assert records(tmp_path / "c3") == records(tmp_path / "c1")
    files = fmt.read_cache_files(fmt.read_manifest(tmp_path / "c1"))
    big = files.paths().index("c/big.png")  # its size came from decoding: appended at the end
    assert int(files.index["offset"][big]) == int(files.index["offset"].max())


@pytest.mark.parametrize("fault", ["raise", "die"])
def test_a_failing_rank_fails_every_rank_and_keeps_the_old_cache(source, tmp_path, fault):
    cache = tmp_path / "cache"
    build_cache(source, cache, workers=1)
    before = records(cache)
    names = set(os.listdir(cache))
    write_image(source / "a" / "new.jpg", 20, 20, seed=5)  # so the build has work to do
    logs = tmp_path / "logs"
    run = torchrun(
        2,
        str(HERE / "_torchrun_cli.py"),
        "build",
        str(source),
        str(cache),
        "--workers",
        "1",
        env={"FAULT": fault},
        log_dir=logs,
    )
    assert run.returncode != 0
    assert records(cache) == before
    assert set(os.listdir(cache)) == names  # the new generation's files are gone
    errors = rank_logs(logs, "stderr")
    if fault == "raise":  # every rank says the same one line, no traceback
        assert sorted(errors) == [0, 1]
        for text in errors.values():
            lines = [line for line in text.splitlines() if line.startswith("mmcache: error:")]
            assert len(lines) == 1, text
            assert "rank 1" in lines[0] and "injected failure" in lines[0]
            assert "nothing was published" in lines[0]
            assert "Traceback" not in text
    else:  # rank 1 vanished: rank 0 says it lost contact (or was stopped by torchrun)
        line = [x for x in errors[0].splitlines() if x.startswith("mmcache: error:")]
        assert len(line) == 1 and "rank 0" in line[0], errors[0]
        assert "Traceback" not in errors[0]
