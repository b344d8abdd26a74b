"""A build and a lazy epoch one, timed with two checkouts of mmcache side by side, in turns.

    git archive 47ba7c8 | tar -x -C /tmp/before
    python tools/before_after.py --before /tmp/before --source data/train --runs 5
    python tools/before_after.py --before /tmp/before --source data/train --what loader

Each run is a fresh Python process with ``PYTHONPATH`` at one checkout (its decode workers
inherit it): ``build_cache(source, cache, short_side=256)`` into an empty folder, then
``MemmapImageDataset(cache, source=source, short_side=256)`` read once in a shuffled DataLoader
of 2 workers (epoch one of a lazy cache: every record decoded and stored as it is read). The
checkouts alternate run by run and the medians are printed with their ratio: how much a change
costs the two paths every user pays. ``--what loader`` times instead the training loop of
``BatchLoader`` (RandomResizedCrop(224) + flip, batch 256, 2 threads, each batch dropped at the
next step) over a cache built once beforehand with ``short_side=256``: the median of epochs 2
to 5 of each run.

``--what bench`` runs each checkout's own ``tools/bench.py`` with the arguments of ``--bench``
(its sizes, parts and rows), in turns as above, and prints every row's images per second of
each run, the medians of each checkout's runs, and the median of the runs' after / before
ratios (each pair measured one after the other, so a load that drifts over the runs moves both):

    python tools/before_after.py --before /tmp/before --what bench --runs 4 \
        --bench "--parts training,multicrop,segmentation --training-images 400"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEP = r"""
import json, shutil, sys, time
import mmcache
from torch.utils.data import DataLoader
source, cache, what = sys.argv[1:4]
if what == "loader":
    ds = mmcache.MemmapImageDataset(cache)
    crop = mmcache.RandomResizedCrop(224)
    loader = mmcache.BatchLoader(ds, 256, shuffle=True, seed=0, crop=crop, flip=True)
    epochs = []
    for epoch in range(5):
        loader.set_epoch(epoch)
        start = time.perf_counter()
        for images, labels in loader:
            pass
        epochs.append(time.perf_counter() - start)
    print(json.dumps(sorted(epochs[1:])[len(epochs[1:]) // 2]))
    sys.exit(0)
shutil.rmtree(cache, ignore_errors=True)
start = time.perf_counter()
if what == "build":
    mmcache.build_cache(source, cache, short_side=256)
else:
    ds = mmcache.MemmapImageDataset(cache, source=source, short_side=256)
    for _ in DataLoader(ds, batch_size=64, shuffle=True, num_workers=2):
        pass
print(json.dumps(time.perf_counter() - start))
"""


def timed(code: Path, source: str, cache: Path, what: str) -> float:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", STEP, source, str(cache), what], env=env,
                         cwd=code, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_rates(code: Path, bench_args: list[str], out: Path) -> dict[str, float]:
    """One run of ``code``'s own tools/bench.py: each row's steady images per second, keyed
    part/row (rows it skipped, FFCV's without FFCV, left out)."""
    env = {**os.environ, "PYTHONPATH": str(code)}
    command = [sys.executable, str(code / "tools" / "bench.py"), *bench_args, "--out", str(out),
               "--workdir", str(out / "work")]  # fmt: skip
    subprocess.run(command, env=env, cwd=code, capture_output=True, text=True, check=True)
    results = json.loads((out / "results.json").read_text())
    shutil.rmtree(out / "work", ignore_errors=True)
    return {f"{part}/{row['key']}": row["steady_images_per_second"]
            for part, report in results.items() for row in report["rows"]
            if not row["skipped"]}  # fmt: skip


def compare_benches(codes: dict[str, Path], bench_args: list[str], runs: int, work: Path) -> None:
    """Run both checkouts' bench in turns ``runs`` times; print each run, then the medians."""
    rates: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for run in range(runs):
        for name in ["before", "after"] if run % 2 == 0 else ["after", "before"]:
            rates[name].append(bench_rates(codes[name], bench_args, work / f"{name}-{run}"))
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            print(
                f"run {run + 1} {name} (load average {load}): "
                + ", ".join(f"{row} {rate:,.0f}" for row, rate in rates[name][-1].items()),
                flush=True,
            )
    print("row: before img/s, after img/s (medians), median of the runs' after / before")
    for row in rates["before"][0]:
        before = [r[row] for r in rates["before"]]
        after = [r[row] for r in rates["after"]]
        paired = statistics.median(a / b for a, b in zip(after, before, strict=True))
        print(f"  {row}: {statistics.median(before):,.0f}, {statistics.median(after):,.0f}, "
              f"{paired:.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout (a git archive)")
    p.add_argument("--after", default=str(REPO), help="this checkout (default: this repo)")
    p.add_argument("--source", help="an image folder (for build, lazy and loader)")
    p.add_argument("--runs", type=int, default=5, help="runs of each (default 5)")
    p.add_argument("--what", default="build,lazy",
                   help="build, lazy, loader; or bench alone (default build,lazy)")  # fmt: skip
    p.add_argument("--bench", default="", help="for --what bench: tools/bench.py's arguments")
    args = p.parse_args(argv)
    whats = args.what.split(",")
    if "bench" in whats and whats != ["bench"]:
        p.error("--what bench runs alone")
    if whats != ["bench"] and args.source is None:
        p.error(f"--what {args.what} needs --source")
    codes = {"before": Path(args.before).absolute(), "after": Path(args.after).absolute()}
    times: dict[tuple[str, str], list[float]] = {}
    work = Path(tempfile.mkdtemp(prefix="mmcache-before-after-"))
    try:
        if whats == ["bench"]:
            compare_benches(codes, args.bench.split(), args.runs, work)
            whats = []  # nothing else to time
        if "loader" in whats:  # one cache, read by every loader run
            sys.path.insert(0, str(codes["after"]))
            import mmcache

            mmcache.build_cache(args.source, work / "built", short_side=256)
        for run in range(args.runs):
            for what in whats:
                order = ["before", "after"] if run % 2 == 0 else ["after", "before"]
                for name in order:
                    cache = work / ("built" if what == "loader" else "cache")
                    seconds = timed(codes[name], args.source, cache, what)
                    times.setdefault((name, what), []).append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    labels = {"build": "build", "lazy": "lazy epoch one", "loader": "BatchLoader epoch"}
    for what in whats:
        label = labels[what]
        before = statistics.median(times["before", what])
        after = statistics.median(times["after", what])
        print(f"{label}: before {before:.3f} s, after {after:.3f} s, after / before "
              f"{after / before:.3f} (median of {args.runs} runs in turns)")  # fmt: skip
    # (quoted: --bench's value is several words)
    print("reproduce: python tools/before_after.py " + shlex.join(sys.argv[1:] if argv is None
                                                                  else argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
