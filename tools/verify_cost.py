"""What verify="first-read" costs: an epoch read with and without it, and `mmcache verify`.

Builds a cache of photo-like JPEGs in a temporary folder (or uses --cache), then reads every
record through MemmapImageDataset twice per setting (the first epoch checks each record's CRC-32,
the second finds them checked), copying each image as collate does, with the pages already in the
page cache (the worst case for the check: no disk time to hide it), and prints seconds and GB/s.
Timings on a shared machine are under contention: say so when quoting them. Usage:

    PYTHONPATH=. python tools/verify_cost.py [--images 2000] [--size 224x224] [--cache DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mmcache import MemmapImageDataset, build_cache, verify_cache
from mmcache.options import parse_size
from mmcache.sample_data import make_image_folder


def _epoch(ds: MemmapImageDataset) -> float:
    start = time.perf_counter()
    for i in range(len(ds)):
        ds.read(i).copy()  # as collate copies each image into its batch
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--size", type=parse_size, default=(224, 224), metavar="WxH")
    p.add_argument("--cache", type=Path, help="measure this cache instead of building one")
    p.add_argument("--repeat", type=int, default=3, help="best of N")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmcache-verify-cost-") as tmp:
        cache = args.cache
        if cache is None:
            src = make_image_folder(
                Path(tmp) / "src",
                classes=4,
                per_class=args.images // 4,
                size=args.size[::-1],  # (height, width)
            )
            cache = Path(tmp) / "cache"
            build_cache(src, cache)
        nbytes = MemmapImageDataset(cache, on_stale="ignore").manifest.sizes["data"]
        _epoch(MemmapImageDataset(cache, on_stale="ignore"))  # warm the page cache
        rows = []
        for verify in (None, "first-read"):
            first, later = [], []
            for _ in range(args.repeat):
                ds = MemmapImageDataset(cache, on_stale="ignore", verify=verify)
                first.append(_epoch(ds))
                later.append(_epoch(ds))
            rows.append((str(verify), min(first), min(later)))
        full = min(verify_cache(cache).seconds for _ in range(args.repeat))
    print(f"cache: {len(ds):,} records, {nbytes / 1e6:,.1f} MB of pixels, in the page cache")
    print(f"{'verify':<12} {'epoch 1 s':>10} {'epoch 2 s':>10} {'epoch 1 GB/s':>13}")
    for name, first, later in rows:
        print(f"{name:<12} {first:>10.3f} {later:>10.3f} {nbytes / first / 1e9:>13.2f}")
    extra = rows[1][1] - rows[0][1]
    print(
        f"first-read adds {extra:.3f} s to epoch 1 ({extra / rows[0][1] * 100:.0f}% of reading "
        f"and copying the pixels), {extra / len(ds) * 1e6:.1f} us per record; later epochs "
        f"{rows[1][2] - rows[0][2]:+.3f} s"
    )
    print(f"mmcache verify (all checksums): {full:.3f} s, {nbytes / full / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
