"""The benchmark runs end to end on a tiny folder and reports every method it has (no timings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench import (  # noqa: E402
    METHODS,
    MULTICROP_ROWS,
    TRAINING_ROWS,
    fresh_memory_write_rate,
    main,
    run_bench,
    write_report,
)
from benchlib import training  # noqa: E402
from benchlib.training import alternately, run_training_bench  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    return run_bench(
        images=8,
        image_size=(64, 48),
        batch_size=4,
        workers=0,
        epochs=2,
        build_workers=1,
        workdir=work,
        decode_sample=4,
        write_pause=0.1,
    )


def test_every_method_runs(report):
    # This mmcache has every method's code (BatchLoader, the lazy mode): none may be skipped.
    by_key = {m.key: m for m in report.methods}
    assert list(by_key) == list(METHODS)  # all, in table order
    for key, m in by_key.items():
        assert not m.skipped, (key, m.skipped)
        assert m.images == 8, key
        assert len(m.epoch_seconds) == 2 and all(t > 0 for t in m.epoch_seconds), key
        # The main process alone holds tens of MB (numpy, torch): a zero means no sample.
        assert m.peak_pss > 10e6 and m.peak_uss > 10e6, key
    assert by_key["in_memory"].prepare_seconds > 0
    assert report.pixels_equal is True
    assert report.cache_bytes == 8 * 64 * 48 * 3
    assert report.build_images_per_second > 0 and report.decode_images_per_second > 0
    # the build's rate is the whole build_cache call: at most its decode phase's rate
    assert report.build_images_per_second <= report.build_decode_images_per_second
    # the machine's write rate, measured in the run with the cache's record size
    w = report.write_rate
    assert w.record_bytes == 64 * 48 * 3 and w.nbytes == report.cache_bytes and w.pause == 0.1
    assert w.back_to_back > 0 and w.after_pause > 0


def test_targets_are_computed_from_the_run(report):
    # The targets as docs/bench.md defines them, computed here from the raw epoch times: img/s
    # is the images over the median epoch after the first, with two epochs the second one.
    raw = {m.key: m for m in report.methods}

    def rate(key: str) -> float:
        return raw[key].images / raw[key].epoch_seconds[1]

    decode_epoch = sum(raw["decode"].epoch_seconds) / 2
    # The build target from the raw figures: 8 images over the whole build's seconds, against
    # one core (build_workers=1) that decodes an image in t_decode and writes its 64x48x3 bytes
    # in t_write (into fresh memory).
    build_rate = 8 / raw["mmcache"].prepare_seconds
    t_decode = 1 / report.decode_images_per_second
    t_write = 64 * 48 * 3 / report.write_rate.after_pause
    expected = {
        "MemmapImageDataset / decode every epoch": (rate("mmcache") / rate("decode"), ">=", 2.5),
        "MemmapImageDataset / Manager.dict cache": (
            rate("mmcache") / rate("manager_dict"),
            ">=",
            2.5,
        ),
        "MemmapImageDataset / in-RAM array": (rate("mmcache") / rate("in_memory"), ">=", 0.95),
        "BatchLoader / copy loop (memory limit)": (
            rate("batch_loader") / rate("copy_loop"),
            ">=",
            0.8,
        ),
        "BatchLoader / decode every epoch": (rate("batch_loader") / rate("decode"), ">=", 6.0),
        "build img/s / (cores / (t_decode + t_write))": (
            build_rate * (t_decode + t_write),
            ">=",
            0.85,
        ),
        "lazy epoch 1 / decode-every-epoch epoch": (
            raw["lazy"].epoch_seconds[0] / decode_epoch,
            "<=",
            1.15,
        ),
        "mmcache peak PSS - cache size (MB)": (
            (raw["mmcache"].peak_pss - 8 * 64 * 48 * 3) / 1e6,
            "<=",
            300.0,
        ),
    }
    got = {t.name: t for t in report.targets}
    assert len(got) == 9
    for name, (value, op, threshold) in expected.items():
        target = got[name]
        assert target.value == pytest.approx(value, rel=1e-3), name
        assert target.threshold == threshold, name
        assert target.passed is (value >= threshold if op == ">=" else value <= threshold), name
    assert "into fresh memory alone adds" in got["lazy epoch 1 / decode-every-epoch epoch"].note
    # measured only by comparing two runs: no value, no verdict
    usage = got["worker USS flat from 1k to 4k images (MB)"]
    assert usage.passed is None and "--images 1000 and 4000" in usage.note


def test_the_write_rate_writes_new_files_and_leaves_none(tmp_path):
    rate = fresh_memory_write_rate(tmp_path / "w", 10 * 4096, 4096, pause=0.05)
    assert (rate.nbytes, rate.record_bytes, rate.pause) == (10 * 4096, 4096, 0.05)
    assert rate.back_to_back > 0 and rate.after_pause > 0
    assert list((tmp_path / "w").iterdir()) == []
    assert "MB/s into fresh memory" in rate.describe()


def test_report_files(report, tmp_path):
    written = write_report(report, tmp_path / "out")
    assert {p.name for p in written} >= {"results.md", "results.json"}
    md = (tmp_path / "out" / "results.md").read_text()
    for m in report.methods:
        assert f"| {m.name} |" in md
    assert "## Targets" in md and "cores: " in md and "opencv: " in md
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["key"] for m in data["methods"]] == list(METHODS)
    assert data["settings"]["batch_size"] == 4
    assert data["write_rate"]["after_pause"] > 0 and data["write_rate"]["back_to_back"] > 0
    assert "into fresh memory" in md and "t_decode + t_write" in md
    by_key = {m["key"]: m for m in data["methods"]}
    for key in ("mmcache", "batch_loader", "copy_loop"):  # they read the built cache
        assert 0 <= by_key[key]["cache_resident"] <= 1, key
    assert by_key["decode"]["cache_resident"] is None
    if Path("/sys/module/page_reporting/parameters/reported_kib").exists():
        assert all(m["reported_mib"] >= 0 for m in data["methods"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "out" / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tool_on_a_given_folder(small_folder, tmp_path, capsys):
    # Mixed image sizes, resized to one by the build and the baselines alike.
    out = tmp_path / "out"
    argv = ["--parts", "loading", "--source", str(small_folder), "--epochs", "1", "--workers", "0"]
    argv += ["--size", "32x24", "--batch-size", "4", "--build-workers", "1", "--out", str(out)]
    argv += ["--methods", "decode,in_memory,mmcache,copy_loop", "--workdir", str(tmp_path / "w")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "targets:" in printed and "results.md" in printed
    data = json.loads((out / "results.json").read_text())
    by_key = {m["key"]: m for m in data["methods"]}
    assert set(by_key) == {"decode", "in_memory", "mmcache", "copy_loop"}
    assert by_key["decode"]["images"] == 12 and by_key["mmcache"]["images"] == 12
    assert all(len(m["epoch_seconds"]) == 1 for m in by_key.values())
    assert data["settings"]["resize"] == "32x24"


def test_unknown_method_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        run_bench(methods=["decode", "nope"], workdir=tmp_path)


def test_the_training_table_runs_every_row_and_says_why_ffcv_did_not(
    small_folder, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MMCACHE_FFCV_PYTHON", str(tmp_path / "no-ffcv-here"))
    out = tmp_path / "out"
    argv = ["--parts", "training", "--source", str(small_folder), "--training-epochs", "2"]
    argv += ["--short-side", "40", "--crop", "16", "--training-batch-size", "4", "--workers", "1"]
    assert main([*argv, "--out", str(out), "--workdir", str(tmp_path / "w")]) == 0
    data = json.loads((out / "results.json").read_text())["training"]
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == list(TRAINING_ROWS)
    assert "FFCV environment missing" in rows["ffcv"]["skipped"]
    for key, row in rows.items():
        if key != "ffcv":
            assert len(row["epoch_seconds"]) == 2 and row["images"] == 12, key
    names = [t["name"] for t in data["targets"]]
    assert len(names) == 8 and "BatchLoader(crop) / FFCV Loader" in names
    targets = {t["name"]: t for t in data["targets"]}
    # the yuv420 rows read a second cache of the same images, half the bytes
    assert targets["yuv420 cache bytes / rgb cache bytes"]["passed"] is True
    assert targets["BatchLoader(crop): yuv420 / rgb cache"]["value"] > 0
    ffcv_target = next(t for t in data["targets"] if t["name"].endswith("FFCV Loader"))
    assert ffcv_target["passed"] is None  # not measured, not failed
    md = (out / "results.md").read_text()
    assert "## Training pipeline" in md and "| mmcache BatchLoader(crop=" in md


def test_the_multicrop_table_runs_every_row_with_its_profile_and_targets(
    small_folder, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = ["--parts", "multicrop", "--source", str(small_folder), "--multicrop-epochs", "2"]
    argv += ["--short-side", "40", "--views", "2x16,3x8", "--multicrop-batch-size", "4"]
    argv += ["--workers", "0", "--out", str(out), "--workdir", str(tmp_path / "w")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "multi-crop profile, one thread, per image:" in printed
    data = json.loads((out / "results.json").read_text())["multicrop"]
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == list(MULTICROP_ROWS)
    for key, row in rows.items():
        assert len(row["epoch_seconds"]) == 2 and row["images"] == 12, key
        assert row["output_pixels_per_second"] > 0, key
    # output pixels: all the views of an image, against one crop of the global size
    views, one = rows["batch_loader_views"], rows["batch_loader_one_crop"]
    assert views["output_pixels_per_second"] == pytest.approx(
        views["steady_images_per_second"] * (2 * 16 * 16 + 3 * 8 * 8))
    assert one["output_pixels_per_second"] == pytest.approx(
        one["steady_images_per_second"] * 16 * 16)  # fmt: skip
    names = [t["name"] for t in data["targets"]]
    assert names == ["BatchLoader(views) / decode + MultiCrop in a DataLoader (img/s)",
                     "BatchLoader(views) / BatchLoader(one 16 crop) (output pixels/s)"]
    assert all(t["passed"] in (True, False) for t in data["targets"])
    parts = [p["part"] for p in data["profile"]]
    assert parts[:2] == ["resize 2 views of 16", "resize 3 views of 8"]
    md = (out / "results.md").read_text()
    assert "## Multi-crop (SSL views)" in md and "## Multi-crop targets" in md


def test_the_segmentation_table_runs_every_row_with_its_targets(tmp_path, capsys):
    from benchlib.segmentation import SEGMENTATION_ROWS

    out = tmp_path / "out"
    argv = ["--parts", "segmentation", "--segmentation-images", "8", "--segmentation-epochs", "2"]
    argv += ["--crop", "16", "--batch-size", "4", "--workers", "0", "--out", str(out)]
    assert main([*argv, "--workdir", str(tmp_path / "w")]) == 0
    data = json.loads((out / "results.json").read_text())["segmentation"]
    rows = {r["key"]: r for r in data["rows"]}
    assert list(rows) == list(SEGMENTATION_ROWS)
    for key, row in rows.items():
        assert len(row["epoch_seconds"]) == 2 and row["images"] == 8, key
    assert [t["name"] for t in data["targets"]] == [
        "BatchLoader with masks / decode + joint crop in a DataLoader",
        "BatchLoader with masks / without masks",
        "MemmapImageDataset with masks / decode + joint crop (DataLoaders)",
    ]
    assert "## Segmentation" in (out / "results.md").read_text()


def test_rows_compared_as_a_ratio_run_in_turns_epoch_by_epoch():
    log = []
    runners = {key: (lambda key=key: log.append(key) or 0.5) for key in ("a", "b")}
    times = alternately(4, runners)
    assert log == ["a", "b", "b", "a", "a", "b", "b", "a"]  # who goes first swaps each round
    assert times == {"a": [0.5] * 4, "b": [0.5] * 4}


def test_the_training_bench_runs_the_thread_loop_and_batch_loader_in_turns(
    small_folder, tmp_path, monkeypatch
):
    turns = []

    def spy(epochs, runners):
        turns.append(list(runners))
        return alternately(epochs, runners)

    monkeypatch.setattr(training, "alternately", spy)
    report = run_training_bench(
        source=small_folder, short_side=40, size=16, batch_size=4, workers=1, epochs=2,
        rows=["decode_crop", "thread_loop", "batch_loader_crop"], workdir=tmp_path,
    )  # fmt: skip
    assert turns == [["thread_loop", "batch_loader_crop"]]
    assert [r.key for r in report.rows] == ["decode_crop", "thread_loop", "batch_loader_crop"]
    assert all(len(r.epoch_seconds) == 2 for r in report.rows)
