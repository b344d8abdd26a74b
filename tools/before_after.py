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

``--what cpu`` times instead the CPU that each loading path spends per image (the process's
CPU time, every thread's, of epochs 2 and 3; one torch thread, one filling thread): less moved
by other jobs on a shared machine than wall-clock rates. Each checkout builds its own caches of
``--source`` (shorter side 256; RGB, YUV 4:2:0, and with ``--masks`` its masks) in its first
run: a cache of one checkout's format need not be one the other reads.
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
from collections.abc import Callable
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


CPU_STEP = r"""
import json, os, sys, time
import torch
import mmcache
torch.set_num_threads(1)
source, masks, work = sys.argv[1:4]
RRC = mmcache.RandomResizedCrop
if not os.path.exists(os.path.join(work, "done")):
    mmcache.build_cache(source, os.path.join(work, "rgb"), short_side=256, replace=True)
    mmcache.build_cache(source, os.path.join(work, "yuv420"), short_side=256, pixels="yuv420",
                        replace=True)
    if masks:
        mmcache.build_cache(source, os.path.join(work, "masks"), short_side=256, masks=masks,
                            replace=True)
    open(os.path.join(work, "done"), "w").close()
figures = {}
def timed(name, epoch):
    epoch()  # epoch 1: the page cache and the ring warmed
    start = time.process_time()
    n = epoch() + epoch()
    figures[name] = (time.process_time() - start) / n * 1e6
def loader(cache, **kw):
    ds = mmcache.MemmapImageDataset(os.path.join(work, cache))
    batches = mmcache.BatchLoader(ds, 64, shuffle=True, seed=0, flip=True, num_threads=1, **kw)
    return lambda: sum(len(batch[0]) for batch in batches)
flip = mmcache.RandomHorizontalFlip()
ds = mmcache.MemmapImageDataset(os.path.join(work, "rgb"),
                                transform=mmcache.Compose([RRC(224), flip]))
timed("dataset_crop", lambda: sum(1 for i in range(len(ds)) if ds[i] is not None))
timed("batch_loader_crop", loader("rgb", crop=RRC(224)))
views = [(RRC(224, scale=(0.32, 1.0)), 2), (RRC(96, scale=(0.05, 0.32)), 6)]
timed("batch_loader_views", loader("rgb", views=views))
timed("batch_loader_crop_yuv420", loader("yuv420", crop=RRC(224)))
if masks:
    timed("batch_loader_crop_masks", loader("masks", crop=RRC(224)))
print(json.dumps(figures))
"""


def cpu_figures(code: Path, source: str, masks: str, work: Path) -> dict[str, float]:
    """One run of ``CPU_STEP`` in ``code``: each loading path's CPU microseconds per image."""
    work.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, "-c", CPU_STEP, source, masks, str(work)], env=env,
                         cwd=code, capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def in_turns(measure: Callable[[str, int], dict[str, float]], runs: int, unit: str) -> None:
    """``measure(name, run)`` of before and after in turns, ``runs`` times (each a figure by
    row); print each run with the load average, then each row's medians and the median of the
    runs' after / before (each pair measured one after the other, so a drifting load moves
    both)."""
    figures: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for run in range(runs):
        for name in ["before", "after"] if run % 2 == 0 else ["after", "before"]:
            figures[name].append(measure(name, run))
            load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
            print(
                f"run {run + 1} {name} (load average {load}): "
                + ", ".join(f"{row} {value:,.0f}" for row, value in figures[name][-1].items()),
                flush=True,
            )
    print(f"row: before {unit}, after {unit} (medians), median of the runs' after / before")
    for row in figures["before"][0]:
        before = [r[row] for r in figures["before"]]
        after = [r[row] for r in figures["after"]]
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
                   help="build, lazy, loader; bench or cpu alone (default build,lazy)")  # fmt: skip
    p.add_argument("--bench", default="", help="for --what bench: tools/bench.py's arguments")
    p.add_argument("--masks", default="", help="for --what cpu: --source's masks (optional)")
    args = p.parse_args(argv)
    whats = args.what.split(",")
    alone = [w for w in whats if w in ("bench", "cpu")]
    if alone and len(whats) > 1:
        p.error(f"--what {alone[0]} runs alone")
    if whats != ["bench"] and args.source is None:
        p.error(f"--what {args.what} needs --source")
    codes = {"before": Path(args.before).absolute(), "after": Path(args.after).absolute()}
    times: dict[tuple[str, str], list[float]] = {}
    work = Path(tempfile.mkdtemp(prefix="mmcache-before-after-"))
    try:
        if whats == ["bench"]:
            bench = args.bench.split()
            in_turns(lambda name, run: bench_rates(codes[name], bench, work / f"{name}-{run}"),
                     args.runs, "img/s")  # fmt: skip
            whats = []  # nothing else to time
        if whats == ["cpu"]:

            def cpu(name: str, run: int) -> dict[str, float]:
                return cpu_figures(codes[name], args.source, args.masks, work / name)

            in_turns(cpu, args.runs, "CPU us per image")
            whats = []
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
