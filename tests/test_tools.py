"""The measuring tools in tools/ run end to end at tiny sizes (smoke runs; no timings checked).

The tools parse mmcache's output and call its functions; a change to either breaks them
silently unless they run. Larger tools have tests of their own (test_bench.py,
test_crash_states.py, test_tools_train.py, test_tools_ffcv.py, test_distributed.py for
train_ddp.py).
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"

# tool, its arguments at a tiny size, a line its report must print
SMOKE = [
    ("bench_dist_build.py", ["--images", "10", "--image-size", "64x48", "--procs", "1"],
     "same bytes"),
    ("bench_plan.py", ["--images", "20", "--classes", "2", "--repeat", "1"], "us/file"),
    ("compare_builds.py", ["--before", "HEAD", "--after", "HEAD"], "no options: identical"),
    ("cuda_check.py", ["--without-device"], "no GPU result is claimed"),
    ("crop_closeness.py", ["--crops", "5", "--images", "2", "--size", "32"], "reproduce:"),
    ("decoders.py", ["--images", "4", "--repeat", "1"], "cv2.imdecode"),
    ("lazy_epochs.py", ["--images", "8", "--image-size", "64x48", "--epochs", "2",
                        "--batch-size", "4", "--workers", "0"], "lazy epoch one / decoding epoch"),
    ("loader_bench.py", ["--images", "8", "--size", "64x48", "--batch-size", "4",
                         "--workers", "0", "--epochs", "2"], "BatchLoader / copy loop"),
    ("member_fill.py", ["--members", "300", "--repeat", "1"], "first fill ms"),
    # (the spawn step runs the fork step's lines, in 3 more processes that import torch)
    ("scale.py", ["--images", "40", "--classes", "4", "--skip", "first batch, 2 spawn workers"],
     "build from the tar of tars / from the"),
    ("verify_cost.py", ["--images", "8", "--size", "64x48", "--repeat", "1"], "mmcache verify"),
    ("yuv_closeness.py", ["--photos", "2", "--photo-size", "64x48", "--short-side", "32",
                          "--crop", "16", "--worst", "2"], "reproduce:"),
]  # fmt: skip


@pytest.mark.parametrize("tool, args, expected", SMOKE, ids=[s[0] for s in SMOKE])
def test_the_tool_runs_at_a_tiny_size(tool, args, expected, tmp_path, monkeypatch, capfd):
    # As ``python tools/TOOL ARGS`` from another folder, in this process: runpy runs the file as
    # __main__, so what the tool does when started is what runs, without a second interpreter
    # importing torch (docs/architecture.md, the tests row). What a tool changes in the
    # process is put back: the working folder, the environment, torch's thread count.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setattr(sys, "argv", [str(TOOLS / tool), *args])
    monkeypatch.setattr(sys, "path", [str(TOOLS), *sys.path])
    environ, threads = dict(os.environ), torch.get_num_threads()
    try:
        runpy.run_path(str(TOOLS / tool), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    out, err = capfd.readouterr()
    assert code == 0, out[-2000:] + err[-3000:]
    assert expected in out, out[-3000:]


def test_scale_refuses_to_leave_out_a_build_its_last_line_compares(tmp_path, capsys):
    sys.path.insert(0, str(TOOLS))
    import scale

    for step in ("build", "build from the tar of tars", "no such step"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(sys, "argv", ["scale.py", "--workdir", str(tmp_path), "--skip", step])
            with pytest.raises(SystemExit) as exit:
                scale.main()
        assert exit.value.code == 2
        assert f"--skip {step!r}: not a step that can be left out" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before making anything


def test_every_tool_is_run_by_some_test():
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    untested = [p.name for p in sorted(TOOLS.glob("*.py")) if p.stem not in tests]
    assert untested == []


def test_train_ssl_runs_dino_steps_on_views_and_resumes_mid_epoch(tmp_path, capsys):
    # In-process, three tiny runs: one whole epoch, one stopped after 2 of its 4 steps, and its
    # resumption, which must end with the whole run's weights (the same views, augmentations).
    sys.path.insert(0, str(TOOLS))
    import train_ssl

    base = ["--workdir", str(tmp_path / "w"), "--images", "8", "--short-side", "48",
            "--global-size", "32", "--local-size", "16", "--local-views", "2",
            "--batch-size", "2", "--epochs", "1"]  # fmt: skip
    assert train_ssl.main([*base, "--json", str(tmp_path / "whole.json")]) == 0
    checkpoint = ["--checkpoint", str(tmp_path / "ssl.pt")]
    assert train_ssl.main([*base, *checkpoint, "--save-every", "2", "--stop-after", "2"]) == 0
    assert train_ssl.main([*base, *checkpoint, "--resume",
                           "--json", str(tmp_path / "resumed.json")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "views 2 x 32 + 2 x 16" in out and "resumed at epoch 1, batch 2" in out
    assert "epoch 1: loss" in out and "img/s" in out
    whole, resumed = (json.loads((tmp_path / f"{name}.json").read_text())
                      for name in ("whole", "resumed"))  # fmt: skip
    assert whole["step"] == resumed["step"] == 4
    assert math.isfinite(whole["loss"]) and whole["weights_sum"] == resumed["weights_sum"]


def test_before_after_times_both_checkouts_in_turns(tmp_path):
    from mmcache.sample_data import make_image_folder

    make_image_folder(tmp_path / "src", classes=2, per_class=2, size=(48, 64))
    repo = str(TOOLS.parent)
    run = subprocess.run(
        [sys.executable, str(TOOLS / "before_after.py"), "--before", repo, "--after", repo,
         "--source", str(tmp_path / "src"), "--runs", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "build: before" in run.stdout and "lazy epoch one: before" in run.stdout


def test_before_after_runs_both_checkouts_bench_in_turns(tmp_path):
    repo = str(TOOLS.parent)
    bench = "--parts segmentation --segmentation-images 4 --segmentation-epochs 2 --workers 0"
    run = subprocess.run(
        [sys.executable, str(TOOLS / "before_after.py"), "--before", repo, "--after", repo,
         "--what", "bench", "--runs", "1", "--bench", bench],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines[:2]] == ["run 1 before", "run 1 after"]
    assert "segmentation/batch_loader_masks" in lines[0] and "load average" in lines[0]
    rows = [line for line in lines if line.startswith("  segmentation/")]
    assert len(rows) == 4 and all(float(row.rsplit(", ", 1)[1]) > 0 for row in rows)


def test_before_after_times_each_path_s_cpu_per_image_over_each_checkout_s_caches(tmp_path):
    from mmcache.sample_data import make_segmentation_set

    images, masks = make_segmentation_set(tmp_path / "seg", images=4, size=(48, 64))
    repo = str(TOOLS.parent)
    run = subprocess.run(
        [sys.executable, str(TOOLS / "before_after.py"), "--before", repo, "--after", repo,
         "--what", "cpu", "--runs", "1", "--source", str(images), "--masks", str(masks)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines[:2]] == ["run 1 before", "run 1 after"]
    rows = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert rows == ["dataset_crop", "batch_loader_crop", "batch_loader_views",
                    "batch_loader_crop_yuv420", "batch_loader_crop_masks"]  # fmt: skip


def test_before_after_alternates_which_checkout_goes_first_and_pairs_the_runs(capsys):
    # (in-process, with made-up figures: the runs above are one each, to keep the suite small)
    sys.path.insert(0, str(TOOLS))
    import before_after

    figures = {("before", 0): 10.0, ("after", 0): 5.0, ("before", 1): 30.0, ("after", 1): 30.0}
    calls = []

    def measure(name: str, run: int) -> dict[str, float]:
        calls.append((name, run))
        return {"row": figures[name, run]}

    before_after.in_turns(measure, 2, "us")
    assert calls == [("before", 0), ("after", 0), ("after", 1), ("before", 1)]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines[:4]] == [
        "run 1 before", "run 1 after", "run 2 after", "run 2 before"
    ]  # fmt: skip
    # medians 20 and 17.5; the runs' after / before 0.5 and 1.0, their median 0.75
    assert lines[-1] == "  row: 20, 18, 0.750"


def test_the_mutation_tool_mutates_the_named_module_alone_under_its_tests():
    # (mutmut itself is the optional mutation extra, and its runs take minutes: not run here)
    tomllib = pytest.importorskip("tomllib")
    sys.path.insert(0, str(TOOLS))
    import mutation

    table = tomllib.loads(mutation.config("_tar", ["tests/test_archives.py"]))["tool"]["mutmut"]
    assert table["only_mutate"] == ["mmcache/_tar.py"]
    assert table["pytest_add_cli_args_test_selection"] == ["tests/test_archives.py"]
    env = mutation.environment(Path("/scratch"))
    assert env["PYTHONPATH"] == "/scratch" and env["OMP_NUM_THREADS"] == "1"


def test_the_delay_line_forwards_both_ways_after_its_delay(tmp_path):
    """tools/_helpers/delay_line.py, remote_bench.py's link delay where the kernel has no
    netem: bytes arrive whole and in order, each way at least its one-way delay later."""
    import socket
    import threading
    import time

    echo = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = subprocess.Popen(
        [sys.executable, str(TOOLS / "_helpers" / "delay_line.py"), str(port), "127.0.0.1",
         str(echo.getsockname()[1]), "50"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert line.stdout.readline().strip() == "ready"
        payload = bytes(range(256)) * 4096  # 1 MiB, in many chunks
        with socket.create_connection(("127.0.0.1", port)) as c:
            start = time.monotonic()
            c.sendall(payload)
            got = bytearray()
            while len(got) < len(payload):
                got += c.recv(1 << 16)
            elapsed = time.monotonic() - start
        assert bytes(got) == payload
        assert elapsed >= 0.1  # out and back: two one-way delays of 50 ms
    finally:
        line.kill()
        line.communicate()
        echo.close()
