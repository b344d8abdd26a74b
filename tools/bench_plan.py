"""How fast ``mmcache plan`` reads a folder: generate N small JPEGs, plan them, print the times.

Usage:
    python tools/bench_plan.py [--images 10000] [--folder DIR] [--repeat 3]

The first plan after writing the folder reads headers from the page cache (the files were just
written); ``--drop-caches`` (root) empties it first, to time a plan of files on the disk itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache.plan import plan_cache  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--folder", help="use (or fill, if empty) this folder instead of a temp one")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--drop-caches", action="store_true", help="echo 3 > drop_caches before each")
    args = p.parse_args()

    folder = Path(args.folder or tempfile.mkdtemp(prefix="mmcache-bench-plan-"))
    if not folder.exists() or not any(folder.iterdir()):
        t = time.perf_counter()
        make_image_folder(
            folder,
            classes=args.classes,
            per_class=max(1, args.images // args.classes),
            size=(64, 96),
        )
        seconds = time.perf_counter() - t
        print(f"wrote {args.images:,} JPEGs of 96x64 to {folder} in {seconds:.1f} s")
    times = []
    for _ in range(args.repeat):
        if args.drop_caches:
            subprocess.run(["sync"], check=True)
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        t = time.perf_counter()
        plan = plan_cache(folder)
        times.append(time.perf_counter() - t)
    per_file = statistics.median(times) / plan.files * 1e6
    print(
        f"plan of {plan.files:,} files: median {statistics.median(times):.3f} s "
        f"(min {min(times):.3f}, max {max(times):.3f}) = {per_file:.1f} us/file "
        f"(scan + header probe + layout for {1 + len(plan.policies)} policies); "
        f"cpus={os.cpu_count()}, page cache {'dropped' if args.drop_caches else 'warm'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
