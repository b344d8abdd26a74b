"""What the first fill of one record of a lazy cache of a large tar costs, in a fresh process.

Writes a tar of --members tiny JPEGs (an ImageFolder of 10 classes) in a temporary folder,
makes a lazy cache of it, then, --repeat times, starts a fresh Python that opens the cache and
reads one record not filled yet (a different one each time): the first fill of a process, which
finds the record's member in the tar. With --trees, each mmcache source tree given (a checkout
before and after a change) makes its own cache and the trees take turns, on the same records.
The tar is in the page cache (it was just written): the figures are CPU, not disk. Usage:

    python tools/member_fill.py [--members 100000] [--repeat 5] [--trees BEFORE AFTER]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

import mmcache

# The child: open the cache, time the first read of record ``i`` (a fill), print JSON.
CHILD = """
import json, sys, time
start = time.perf_counter()
import mmcache
from mmcache import MemmapImageDataset
ds = MemmapImageDataset(sys.argv[1], on_stale="ignore")
opened = time.perf_counter()
image = ds.read(int(sys.argv[2]))
done = time.perf_counter()
print(json.dumps({"fill": done - opened, "process": done - start, "from": mmcache.__file__}))
"""


def write_tar(path: Path, members: int, side: int) -> None:
    """``members`` JPEGs of ``side`` x ``side`` (256 distinct ones, repeated) in 10 classes."""
    rng = np.random.default_rng(0)
    jpegs = []
    for _ in range(256):
        image = rng.integers(0, 256, (side, side, 3), np.uint8)
        jpegs.append(cv2.imencode(".jpg", image)[1].tobytes())
    with tarfile.open(path, "w") as t:
        for k in range(members):
            info = tarfile.TarInfo(f"c{k % 10}/img_{k:07d}.jpg")
            data = jpegs[k % 256]
            info.size, info.mtime = len(data), 1_700_000_000
            t.addfile(info, io.BytesIO(data))


def in_tree(tree: str, code: str, *args: str) -> str:
    """Run ``code`` in a fresh Python that imports mmcache from the source tree ``tree``."""
    env = {**os.environ, "PYTHONPATH": tree}
    # From the root folder: ``python -c`` puts its working folder first on sys.path, where a
    # checkout would shadow ``tree``.
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd="/",
                         capture_output=True, text=True, check=False)  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"the child failed:\n{run.stderr[-3000:]}")
    return run.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=100_000)
    p.add_argument("--side", type=int, default=32, help="each JPEG's width and height")
    p.add_argument("--repeat", type=int, default=5, help="fresh processes per tree")
    p.add_argument("--trees", nargs="+", metavar="DIR", help="mmcache source trees to compare")
    args = p.parse_args()
    here = str(Path(mmcache.__file__).resolve().parents[1])  # the mmcache this Python imports
    trees = [str(Path(t).resolve()) for t in args.trees or [here]]
    with tempfile.TemporaryDirectory(prefix="mmcache-member-fill-") as tmp:
        tar = Path(tmp) / "train.tar"
        start = time.perf_counter()
        write_tar(tar, args.members, args.side)
        print(f"tar: {args.members:,} members of {args.side}x{args.side}, "
              f"{tar.stat().st_size / 1e6:,.1f} MB, written in "
              f"{time.perf_counter() - start:.1f} s")  # fmt: skip
        caches = []
        for k, tree in enumerate(trees):
            cache = Path(tmp) / f"lazy{k}"
            make = "import sys; from mmcache import create_lazy_cache as c; c(*sys.argv[1:])"
            start = time.perf_counter()
            in_tree(tree, make, str(tar), str(cache))
            print(f"lazy cache {k} ({tree}): made in "
                  f"{time.perf_counter() - start:.1f} s")  # fmt: skip
            caches.append(cache)
        records = np.random.default_rng(1).choice(args.members, args.repeat, replace=False)
        times: list[list[dict]] = [[] for _ in trees]
        for i in records.tolist():  # the trees take turns, on the same record
            for k, tree in enumerate(trees):
                run = json.loads(in_tree(tree, CHILD, str(caches[k]), str(i)))
                if not run["from"].startswith(tree + os.sep):
                    raise SystemExit(f"the child imported {run['from']}, not mmcache of {tree}")
                times[k].append(run)
    print(f"{'tree':<40} {'first fill ms':>14} {'process ms':>11}  (median of {args.repeat})")
    medians = []
    for tree, runs in zip(trees, times):
        fill = statistics.median(r["fill"] for r in runs) * 1e3
        whole = statistics.median(r["process"] for r in runs) * 1e3
        medians.append(fill)
        print(f"{tree:<40} {fill:>14.2f} {whole:>11.1f}")
    if len(medians) > 1:
        print(f"first fill, first tree / last tree: {medians[0] / medians[-1]:,.1f}x")


if __name__ == "__main__":
    main()
