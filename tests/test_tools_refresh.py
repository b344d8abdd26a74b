"""tools/refresh_bench.py runs as its docstring says and its figures add up (a smoke run, no
timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mmcache import format as fmt

ROOT = Path(__file__).resolve().parents[1]


def test_refresh_bench_measures_refreshes_against_a_full_build(tmp_path):
    args = [sys.executable, str(ROOT / "tools" / "refresh_bench.py"), "--workdir", str(tmp_path)]
    args += ["--images", "40", "--image-size", "64x48", "--refreshes", "2", "--share", "0.05"]
    args += ["--write-mb", "8", "--pause", "0", "--json", str(tmp_path / "r.json")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for row in ("full build", "refresh, 1 file replaced", "refresh, 1 file added", "compact"):
        assert f"| {row} |" in out
    assert "targets:" in out and "data file / live bytes over the refreshes" in out
    assert "reproduce: python tools/refresh_bench.py --images 40 --image-size 64x48" in out
    figures = json.loads((tmp_path / "r.json").read_text())
    record = 64 * 48 * 3  # a multiple of 64: no padding between records
    assert figures["record_bytes"] == record and figures["verify_ok"]
    steps, series = figures["steps"], figures["refreshes"]
    assert [r["change"] for r in series] == ["replaced", "added"]
    assert all(r["files"] == 2 and r["decoded"] == 2 for r in series)  # 5% of 41 to 43 files

    # What the tool says is what the files say: one record more per added file, the data file
    # grown by the changed records, nothing else rewritten.
    images = len(list((tmp_path / "src").rglob("*.jpg")))
    files = fmt.read_cache_files(fmt.read_manifest(tmp_path / "cache"))
    assert images == 40 + 1 + 2 == files.manifest.count == steps["compact"]["count"]
    for name in ("refresh, 1 file replaced", "refresh, 1 file added"):
        r = steps[name]
        assert r["decoded"] == 1 and not r["compacted"]
        metadata = sum(r["files"])
        assert r["added"] == record + metadata <= r["bound"] <= r["page_bound"]
    for before, after in zip([steps["refresh, 1 file added"], *series], series, strict=False):
        assert after["data_size"] == before["data_size"] + after["files"] * record
        assert after["ratio"] == after["data_size"] / after["live"]
    assert steps["compact"]["data_size"] == steps["compact"]["live"] == images * record
    assert series[-1]["live"] == images * record

    full = steps["full build"]
    if full["written"]:  # a filesystem that counts its writes (tmpfs counts none)
        assert full["written"] >= full["data_size"]
        for name in ("refresh, 1 file replaced", "refresh, 1 file added"):
            assert record <= steps[name]["written"] < full["written"] / 4
