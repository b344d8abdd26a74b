"""``mmcache demo``: generate images, build a cache, and print epoch times against decoding."""

from __future__ import annotations

import argparse
import shutil
import tempfile

from .._feedback import count
from ..options import height_width, whole_number
from ._shared import Commands, Progress, argument_type, non_negative, one_line
from .build import print_build

# demo's own argument types: a count, and --image-size WxH as (height, width), as --size reads it
positive = argument_type(whole_number)
image_size = argument_type(height_width)


def add(cmds: Commands) -> None:
    d = cmds.command("demo", "generate images, build a cache, compare epoch times")
    d.add_argument(
        "--images", type=positive, default=1000, help="images to generate (default 1000)"
    )
    d.add_argument(
        "--image-size",
        type=image_size,
        default=(480, 720),  # (height, width), as run_demo takes it
        metavar="WxH",
        help="their size (default 720x480)",
    )
    d.add_argument("--epochs", type=positive, default=3, help="epochs per method (default 3)")
    d.add_argument("--batch-size", type=positive, default=64, help="batch size (default 64)")
    d.add_argument("--workers", type=non_negative, default=2, help="DataLoader workers (default 2)")
    d.add_argument("--workdir", help="keep the images and cache here (default: a temp folder)")
    d.set_defaults(func=run, quiet=False)


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo  # here: the demo trains with torch; other commands need none

    workdir = args.workdir or tempfile.mkdtemp(prefix="mmcache-demo-")
    print(
        f"mmcache demo: {args.images} photo-like JPEGs of {args.image_size[1]}x"
        f"{args.image_size[0]} in {one_line(workdir)}, {args.epochs} epochs, "
        f"batch {args.batch_size}, {args.workers} DataLoader workers"
    )
    bar = Progress("building cache")

    def on_epoch(name: str, epoch: int, seconds: float) -> None:
        print(
            f"  {name:<20} epoch {epoch + 1}: {seconds:6.2f} s  "
            f"{args.images / seconds:8,.0f} img/s",
            flush=True,
        )

    try:
        report = run_demo(
            workdir,
            images=args.images,
            image_size=args.image_size,
            epochs=args.epochs,
            batch_size=args.batch_size,
            workers=args.workers,
            build_progress=bar,
            on_epoch=on_epoch,
        )
    finally:
        bar.close()
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"generated the {count(report.images, 'image')} in {report.generate_seconds:.1f} s")
    print_build(report.build, lambda s: print("build: " + s))
    print(f"pixels identical to decoding: {'yes' if report.pixels_equal else 'NO'}")
    decode = min(report.epochs["decode every epoch"])
    for name, times in report.epochs.items():
        best = min(times)
        print(
            f"best epoch, {name:<20} {best:6.2f} s {report.images / best:8,.0f} img/s "
            f"({decode / best:.1f}x decoding)"
        )
    return 0 if report.pixels_equal else 1
