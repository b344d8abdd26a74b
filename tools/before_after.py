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
"""

from __future__ import annotations

import argparse
import json
import os
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the other checkout (a git archive)")
    p.add_argument("--after", default=str(REPO), help="this checkout (default: this repo)")
    p.add_argument("--source", required=True, help="an image folder")
    p.add_argument("--runs", type=int, default=5, help="runs of each (default 5)")
    p.add_argument("--what", default="build,lazy",
                   help="what to time: build, lazy, loader (default build,lazy)")  # fmt: skip
    args = p.parse_args(argv)
    whats = args.what.split(",")
    codes = {"before": Path(args.before).absolute(), "after": Path(args.after).absolute()}
    times: dict[tuple[str, str], list[float]] = {}
    work = Path(tempfile.mkdtemp(prefix="mmcache-before-after-"))
    try:
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
    print("reproduce: python tools/before_after.py " + " ".join(sys.argv[1:] if argv is None
                                                              else argv))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
