"""Build throughput with 1, 2, ... processes on one machine: plain `mmcache build` vs torchrun.

    python tools/bench_dist_build.py --images 2000 --procs 1 2
    python tools/bench_dist_build.py --source data/train --short-side 256 --procs 1 2 4

Generates photo-like JPEGs (or takes ``--source``), then for each process count builds a fresh
cache: 1 runs ``mmcache build`` (all cores in one rank), k > 1 runs ``torchrun --standalone
--nproc-per-node k -m mmcache build`` (each rank takes cores / k decode workers, so the machine
does the same work with more coordination). Prints each build's wall time (including torchrun's
and torch's start, a few seconds), the build's own time and images per second as mmcache reports
them, and checks that every cache holds the same bytes as the first. Take figures on a quiet
machine; on one machine k ranks cannot beat one rank by much: the point is the overhead, which
decides the N-node arithmetic in docs/scaleout.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmcache import format as fmt  # noqa: E402
from mmcache.options import parse_size  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402


def digest(cache: Path) -> str:
    """SHA-256 over the index, state, paths and data files (what 'the same cache' means)."""
    m = fmt.read_manifest(cache)
    h = hashlib.sha256()
    for kind in fmt.FILE_KINDS:
        with open(m.file(kind), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", type=Path, help="an image folder (default: generate one)")
    p.add_argument("--images", type=int, default=2000, help="images to generate")
    p.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--short-side", type=int, help="passed to mmcache build")
    p.add_argument("--workdir", type=Path, help="where caches go (default: a temp folder)")
    args = p.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="mmcache-bench-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    source = args.source
    if source is None:
        source = work / "src"
        per_class = max(1, args.images // 10)
        print(f"generating {per_class * 10} images of {args.image_size[0]}x{args.image_size[1]}")
        make_image_folder(source, classes=10, per_class=per_class, size=args.image_size[::-1])
    extra = ["--short-side", str(args.short_side)] if args.short_side else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    print(f"{os.cpu_count()} cores; source {source}")
    print(f"{'procs':>5} {'wall s':>8} {'build s':>8} {'img/s':>8} {'vs 1':>6}  same bytes")
    first, base = None, None
    for k in args.procs:
        cache = work / f"cache-{k}"
        shutil.rmtree(cache, ignore_errors=True)
        build = ["-m", "mmcache", "build", str(source), str(cache), *extra]
        if k == 1:
            cmd = [sys.executable, *build]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc-per-node={k}", *build]
        start = time.perf_counter()
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if run.returncode != 0:
            sys.exit(f"{k} process(es) failed:\n{run.stderr[-3000:]}")
        # The build's summary: "CACHE: N images in K classes, SIZE, in S s", then "D decoded".
        seconds = float(re.search(r", in ([\d.]+) s$", run.stdout, re.M).group(1))
        decoded = int(re.search(r"^  ([\d,]+) decoded", run.stdout, re.M).group(1).replace(",", ""))
        rate = decoded / seconds
        base = base or rate
        same = digest(cache)
        first = first or same
        print(
            f"{k:>5} {wall:>8.1f} {seconds:>8.1f} {rate:>8,.0f} {rate / base:>5.2f}x  "
            f"{'yes' if same == first else 'NO'}",
            flush=True,
        )
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
