"""Time epoch one and two of a lazy mmcache dataset against decoding every epoch.

Generates a folder of photo-like JPEGs (mmcache.sample_data), then runs the same shuffled
DataLoader (persistent workers) over

- ``decode every epoch``: ``mmcache.demo.DecodingDataset`` (what ImageFolder does);
- ``mmcache lazy``: ``MemmapImageDataset(cache, source=...)`` on a cache that does not exist
  yet, so epoch one decodes and fills it and epoch two reads it;

and prints seconds and images per second per epoch. The project's target: lazy epoch one within
15% of a decoding epoch. Nothing is written anywhere but the work folder.

    PYTHONPATH=. python tools/lazy_epochs.py --images 2000 --workers 4
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from mmcache.dataset import MemmapImageDataset
from mmcache.demo import DecodingDataset, time_epochs
from mmcache.options import parse_size
from mmcache.sample_data import make_image_folder


def measure(
    workdir: str | Path,
    *,
    images: int = 1000,
    classes: int = 4,
    image_size: tuple[int, int] = (720, 480),
    epochs: int = 2,
    batch_size: int = 64,
    workers: int = 2,
) -> dict[str, list[float]]:
    """Seconds per epoch for ``decode every epoch`` and ``mmcache lazy`` (fresh cache)."""
    workdir = Path(workdir)
    source = make_image_folder(
        workdir / "images", classes=classes, per_class=-(-images // classes), size=image_size[::-1]
    )
    cache = workdir / "lazy-cache"
    shutil.rmtree(cache, ignore_errors=True)  # epoch one must find an empty cache
    start = time.perf_counter()
    lazy = MemmapImageDataset(cache, source=source)
    created = time.perf_counter() - start
    decoding = DecodingDataset(lazy.samples)
    results = {"lazy cache creation (scan + headers)": [created]}
    for name, ds in (("decode every epoch", decoding), ("mmcache lazy", lazy)):
        results[name] = time_epochs(ds, epochs, batch_size=batch_size, workers=workers)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1000)
    p.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    p.add_argument("--workdir", help="keep the images here (default: a temporary folder)")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mmcache-lazy-"))
    try:
        results = measure(
            workdir,
            images=args.images,
            image_size=args.image_size,
            epochs=args.epochs,
            batch_size=args.batch_size,
            workers=args.workers,
        )
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    n = -(-args.images // 4) * 4
    print(
        f"{n} JPEGs of {args.image_size[0]}x{args.image_size[1]}, batch {args.batch_size}, "
        f"{args.workers} DataLoader workers"
    )
    creation = results.pop("lazy cache creation (scan + headers)")[0]
    print(f"lazy cache creation (scan + headers, no decoding): {creation:.2f} s")
    print(f"{'':<20}" + "".join(f"{f'epoch {e + 1}':>22}" for e in range(args.epochs)))
    for name, times in results.items():
        print(f"{name:<20}" + "".join(f"{t:8.2f} s {n / t:8,.0f} img/s" for t in times))
    ratio = results["mmcache lazy"][0] / results["decode every epoch"][0]
    print(f"lazy epoch one / decoding epoch: {ratio:.2f} (target: at most 1.15)")


if __name__ == "__main__":
    main()
