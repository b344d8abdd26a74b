"""Scale-out under torchrun (real processes, gloo): distributed build, DDP example, copy_cache.

The tests of what torchrun itself does (per-rank logs; a rank that fails, dies or hangs stopping
the others) run torchrun; the others start the ranks as torchrun does (conftest.local_ranks).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import local_ranks, make_folder, reseal, write_image

import mmcache._layout
from mmcache import CacheFormatError, build_cache, copy_cache
from mmcache import format as fmt
from mmcache._generation import manifest_json
from mmcache.cli import main

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


def ranks(nproc: int, *args: str, env: dict | None = None):
    """``args`` as ``nproc`` local ranks started as torchrun starts them, without its process."""
    return local_ranks(nproc, *args, env={"PYTHONPATH": str(ROOT), **(env or {})})


def rank_logs(log_dir: Path, stream: str) -> dict[int, str]:
    """What each local rank wrote to ``stream`` (torchrun: <dir>/<run>/attempt_0/<rank>/)."""
    return {int(p.parent.name): p.read_text() for p in log_dir.rglob(f"{stream}.log")}


def records(cache: Path) -> dict:
    """Everything a cache holds except its generation name and creation time."""
    m = fmt.read_manifest(cache)
    files = fmt.read_cache_files(m)
    meta = manifest_json(m)
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


def test_shares_balance_pixels_not_files():
    from mmcache.distributed import balanced_shares

    cost = np.array([400, 100, 100, 100, 100, 0, 100])  # 0: unknown, counts as the mean (150)
    shares = balanced_shares(np.arange(7), cost, 2)
    assert [s.tolist() for s in shares] == [[0, 1], [2, 3, 4, 5, 6]]  # 500 and 550 pixels
    assert [len(s) for s in balanced_shares(np.arange(2), np.ones(2), 3)] in ([1, 1, 0], [1, 0, 1])
    assert [len(s) for s in balanced_shares(np.arange(0), np.ones(0), 3)] == [0, 0, 0]


def test_distributed_true_needs_a_process_group(small_folder, tmp_path):
    with pytest.raises(ValueError, match="init_process_group"):
        build_cache(small_folder, tmp_path / "cache", distributed=True)


def test_two_ranks_build_what_one_process_builds(source, tmp_path):
    run = ranks(2, "-m", "mmcache", "build", str(source), str(tmp_path / "c2"), "--workers", "2")
    assert run.returncode == 0, run.stderr
    assert "41 images in 3 classes" in run.stdout and "1 skipped" in run.stdout
    build_cache(source, tmp_path / "c1", workers=1, distributed=False)
    assert records(tmp_path / "c2") == records(tmp_path / "c1")
    # (ranks finding their cache up to date: the DDP example's resumed run below)


def test_three_ranks_refresh_an_old_cache_as_one_process_does_with_overflow(
    source, tmp_path, monkeypatch
):
    for cache in ("c3", "c1"):
        build_cache(source, tmp_path / cache, workers=1)
    write_image(source / "a" / "img_000.jpg", 30, 20, seed=7)  # modified: decoded again
    write_image(source / "b" / "new.jpg", 20, 30, seed=8)  # added, its header unreadable
    os.unlink(source / "a" / "img_001.jpg")  # removed
    run = ranks(
        3,
        str(HERE / "_torchrun_cli.py"),
        "build",
        str(source),
        str(tmp_path / "c3"),
        "--workers",
        "1",
        env={"UNPROBED": "new.jpg"},
    )
    assert run.returncode == 0, run.stderr
    assert "reused" in run.stdout and "1 removed" in run.stdout

    real_probe = mmcache._layout.probe_size
    monkeypatch.setattr(
        mmcache._layout,
        "probe_size",
        lambda p, *exif: None if p.endswith("new.jpg") else real_probe(p, *exif),
    )
    report = build_cache(source, tmp_path / "c1", workers=1)
    assert report.appended  # the refresh appended to the data file, as the ranks did
    assert records(tmp_path / "c3") == records(tmp_path / "c1")
    files = fmt.read_cache_files(fmt.read_manifest(tmp_path / "c1"))
    new = files.paths().index("b/new.jpg")  # its size came from decoding: appended at the end
    assert int(files.index["offset"][new]) == int(files.index["offset"].max())


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
        "0",
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


def test_a_hung_rank_fails_every_rank_after_the_dist_timeout(source, tmp_path):
    # docs/scaleout.md: "A rank that fails, dies or hangs fails the build on every rank with one
    # line, and the previous cache stays intact"; --dist-timeout: "how long a rank may go silent
    # before the build fails". Rank 1 decodes its share, then hangs for ever instead of sending
    # it: with --dist-timeout 15, rank 0 must give up and say so in one line (a timeout not
    # applied would hang until torchrun's 180 s limit here), and torchrun then stops rank 1,
    # which says why in one line too. (15 s, not less: every step waits that long for the other
    # rank, joining the group included, and on 2 busy cores one rank can start seconds late.)
    cache = tmp_path / "cache"
    build_cache(source, cache, workers=1)
    before, names = records(cache), set(os.listdir(cache))
    write_image(source / "a" / "new.jpg", 20, 20, seed=5)  # so the build has work to do
    logs = tmp_path / "logs"
    args = ["build", str(source), str(cache), "--workers", "1", "--dist-timeout", "15"]
    run = torchrun(2, str(HERE / "_torchrun_cli.py"), *args, env={"FAULT": "hang"}, log_dir=logs)
    assert run.returncode == 1, run.stderr
    assert records(cache) == before and set(os.listdir(cache)) == names
    errors = rank_logs(logs, "stderr")
    assert sorted(errors) == [0, 1]
    for rank, text in errors.items():
        lines = [line for line in text.splitlines() if line.startswith("mmcache: error:")]
        assert len(lines) == 1 and f"rank {rank}" in lines[0], text
        assert "Traceback" not in text and lines[0].count("nothing was published") == 1
    assert "Timed out" in errors[0] or "timed out" in errors[0], errors[0]


PYTHON_BUILD = """
import json, sys
import torch.distributed as dist
import mmcache

calls = []
for name in ("scatter_object_list", "gather_object", "broadcast_object_list"):
    real = getattr(dist, name)
    setattr(dist, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
dist.init_process_group("gloo")
report = mmcache.build_cache(sys.argv[1], sys.argv[2], workers=1)
# one write of the whole line: the ranks share a stdout (print writes the newline apart)
line = {"rank": dist.get_rank(), "images": report.images, "calls": calls}
sys.stdout.write(json.dumps(line) + "\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""


def test_build_cache_from_python_under_a_process_group_builds_with_every_rank(source, tmp_path):
    # docs/scaleout.md: "From Python, build_cache does the same when a process group is
    # initialised": each rank calls build_cache alone; together they build, with the three
    # collective steps, the cache one process builds, and each rank gets the same report.
    script = tmp_path / "train.py"
    script.write_text(PYTHON_BUILD)
    run = ranks(2, str(script), str(source), str(tmp_path / "c2"))  # one line each, one write
    assert run.returncode == 0, run.stderr
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    lines = {r["rank"]: r for r in reports}
    assert sorted(lines) == [0, 1] and len(reports) == 2
    for rank, r in lines.items():
        assert r["rank"] == rank and r["images"] == 41
        assert r["calls"] == ["scatter_object_list", "gather_object", "broadcast_object_list"]
    build_cache(source, tmp_path / "c1", workers=1, distributed=False)
    assert records(tmp_path / "c2") == records(tmp_path / "c1")


def test_the_ddp_example_builds_together_then_trains_and_resumes(tmp_path):
    args = ["--workdir", str(tmp_path / "work"), "--images", "32", "--epochs", "1"]
    args += ["--size", "32", "--batch-size", "4", "--checkpoint", str(tmp_path / "ckpt.pt")]
    script = str(ROOT / "tools" / "train_ddp.py")
    # (ranks started as torchrun starts them: its own process, torch imported once more, is
    # the other tests' here)
    run = ranks(2, script, *args, "--save-every", "2", "--stop-after", "3")
    assert run.returncode == 0, run.stderr
    assert "train_ddp: 2 ranks (gloo, cpu), 4 batches of 4 per rank and epoch" in run.stdout
    assert "stopped after step 3" in run.stdout
    resumed = ranks(2, script, *args, "--resume", "--json", str(tmp_path / "r.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at epoch 1, batch 2" in resumed.stdout and "up to date" in resumed.stdout
    loss, rate = re.search(r"epoch 1: loss ([\d.]+), .* ([\d,]+) img/s", resumed.stdout).groups()
    assert 0 < float(loss) < 10 and int(rate.replace(",", "")) > 0
    whole = ranks(2, script, *args[:-2], "--json", str(tmp_path / "w.json"))
    assert whole.returncode == 0, whole.stderr
    # the interrupted and resumed run ends with the weights of the uninterrupted one
    ends = [json.loads((tmp_path / f).read_text())["weights_sum"] for f in ("r.json", "w.json")]
    assert ends[0] == ends[1]


def test_copy_cache_equals_the_source_and_replaces_an_old_copy(small_folder, tmp_path, capsys):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    dest = tmp_path / "node" / "cache"
    seen = []
    report = copy_cache(tmp_path / "cache", dest, progress=lambda done, total: seen.append(done))
    assert records(dest) == records(tmp_path / "cache")
    assert (report.images, report.verified) == (12, 12) and seen[-1] == report.copied
    first = fmt.read_manifest(dest).generation
    assert main(["copy", str(tmp_path / "cache"), str(dest)]) == 0  # a new generation replaces it
    assert "12 records verified" in capsys.readouterr().out
    m = fmt.read_manifest(dest)
    assert m.generation != first and records(dest) == records(tmp_path / "cache")
    assert set(os.listdir(dest)) == {"manifest.json", "lock", *manifest_json(m)["files"].values()}


def test_copy_keeps_a_sparse_data_file_sparse(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(256, 192)] * 4})
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=1)
    # Make it a lazy cache with only record 0 filled: records 1-3 are holes (~440 KB).
    m = fmt.read_manifest(cache)
    files = fmt.read_cache_files(m)
    record0 = m.file("data").read_bytes()[: 256 * 192 * 3]
    os.unlink(m.file("data"))
    with open(m.file("data"), "wb") as f:
        f.truncate(m.sizes["data"])
        f.write(record0)
    state = files.state.copy()
    state[1:] = (0, fmt.EMPTY)
    state.tofile(m.file("state"))
    manifest = cache / "manifest.json"
    forged = json.loads(manifest.read_text())
    forged["mode"] = "lazy"
    forged["requires"] = sorted([*forged["requires"], "fill-markers"])
    manifest.write_text(json.dumps(forged))
    reseal(cache)
    assert fmt.read_manifest(cache).mode == "lazy"

    report = copy_cache(cache, tmp_path / "copy")
    assert records(tmp_path / "copy") == records(cache)
    assert report.verified == 1 and report.copied < m.sizes["data"] // 2
    copied = fmt.read_manifest(tmp_path / "copy").file("data").stat()
    assert copied.st_size == m.sizes["data"]
    assert copied.st_blocks * 512 < m.sizes["data"] // 2  # the holes stayed holes


def test_a_corrupted_copy_is_detected_and_not_published(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    dest = tmp_path / "copy"
    copy_cache(tmp_path / "cache", dest)
    before, names = records(dest), set(os.listdir(dest))

    def corrupt_when_copied(done: int, total: int) -> None:
        if done == total:  # flip one byte of record 5 in the new, unpublished data file
            current = fmt.read_manifest(dest).file("data").name
            (new,) = [p for p in dest.glob("data-*.bin") if p.name != current]
            offset = int(fmt.read_cache_files(fmt.read_manifest(dest)).index["offset"][5])
            with open(new, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.raises(CacheFormatError, match=r"record 5 .* CRC-32"):
        copy_cache(tmp_path / "cache", dest, progress=corrupt_when_copied)
    assert records(dest) == before and set(os.listdir(dest)) == names


def test_two_ranks_refuse_another_source_as_one_process_does(source, tmp_path):
    cache = tmp_path / "cache"
    train = make_folder(tmp_path / "train", {"a": [(8, 8)], "b": [(8, 8)]})
    build_cache(train, cache, workers=1)
    before = records(cache)
    logs = tmp_path / "logs"
    run = torchrun(2, "-m", "mmcache", "build", str(source), str(cache), log_dir=logs)
    assert run.returncode != 0
    assert records(cache) == before
    errors = rank_logs(logs, "stderr")
    assert sorted(errors) == [0, 1]
    for text in errors.values():  # every rank says the same one line, naming both sources
        lines = [line for line in text.splitlines() if line.startswith("mmcache: error:")]
        assert len(lines) == 1, text
        assert f"made from {train.resolve()}; this build's source is {source.resolve()}" in lines[0]
        assert "--source-moved" in lines[0] and "Traceback" not in text
