"""mmcache side by side with what users would use instead, in one run: ``python tools/bench.py``.

Two tables, each its own module in ``tools/benchlib/``: ``--parts loading`` (``run_bench``,
loading.py) times the same shuffled DataLoader epochs over one image folder for each way of
loading it (decode every epoch, a ``Manager().dict()`` cache, an in-RAM array, an mmcache cache,
a lazily filled one, ``BatchLoader``) plus a plain copy loop over the cache's records (the
memory-copy limit), samples the memory of the process tree meanwhile, measures the build rate
against the single-core decode rate and this machine's rate of writing pixels into a new file,
and checks the project's targets; ``--parts training`` (``run_training_bench``, training.py)
times RandomResizedCrop + flip into batches seven ways (five on an RGB cache, two on a
yuv420 cache of the same images); ``--parts segmentation`` (``run_segmentation_bench``,
segmentation.py) crops and flips images with their masks four ways; ``--parts multicrop``
(``run_multicrop_bench``, multicrop.py) times several views of each image (SSL multi-crop) four
ways and profiles them. ``write_report`` writes results.md, results.json and chart.png;
``python tools/bench.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: benchlib and the baselines

from benchlib.loading import METHODS, BenchReport, run_bench  # noqa: E402
from benchlib.machine import fresh_memory_write_rate  # noqa: E402
from benchlib.multicrop import MULTICROP_ROWS, MultiCropReport, run_multicrop_bench  # noqa: E402
from benchlib.report import write_report  # noqa: E402
from benchlib.segmentation import (  # noqa: E402
    SEGMENTATION_ROWS,
    SegmentationReport,
    run_segmentation_bench,
)
from benchlib.training import TRAINING_ROWS, TrainingReport, run_training_bench  # noqa: E402

import mmcache  # noqa: E402

__all__ = [
    "METHODS",
    "SEGMENTATION_ROWS",
    "MULTICROP_ROWS",
    "TRAINING_ROWS",
    "fresh_memory_write_rate",
    "main",
    "run_bench",
    "run_segmentation_bench",
    "run_multicrop_bench",
    "run_training_bench",
    "write_report",
]


def _size(text: str) -> tuple[int, int]:
    try:
        return mmcache.options.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="loading,training,segmentation,multicrop",
                   help="comma-separated: loading (the DataLoader table), training (the "
                   "crop pipeline table), segmentation (images with masks), multicrop (the "
                   "SSL views table); default all four")  # fmt: skip
    p.add_argument("--source", help="image folder to use (default: generate photo-like JPEGs)")
    p.add_argument("--images", type=int, default=2000, help="images to generate (default 2000)")
    p.add_argument("--image-size", type=_size, default=(720, 480), metavar="WxH",
                   help="size of the generated images (default 720x480)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=3, help="epochs per method (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--build-workers", type=int, help="build processes (default: cores)")
    p.add_argument("--size", type=_size, metavar="WxH", help="resize all to WxH (mixed sizes)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each method")
    p.add_argument("--methods", help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--write-pause", type=float, default=5.0, metavar="S",
                   help="seconds idle before timing a write into fresh memory (5)")  # fmt: skip
    g = p.add_argument_group("the training pipeline table")
    g.add_argument("--training-images", type=int, default=1000,
                   help="images to generate for it (default 1000; --source if given)")  # fmt: skip
    g.add_argument("--short-side", type=int, default=256, help="stored shorter side (256)")
    g.add_argument("--crop", type=int, default=224, help="RandomResizedCrop size (224)")
    g.add_argument("--training-batch-size", type=int, default=256, help="batch size (256)")
    g.add_argument(
        "--training-epochs", type=int, default=10,
        help="epochs (10: an epoch of the fast rows is 0.1 s, and their median needs several)",
    )  # fmt: skip
    g.add_argument("--rows", help="comma-separated subset of: " + ", ".join(TRAINING_ROWS))
    g = p.add_argument_group("the segmentation table")
    g.add_argument("--segmentation-images", type=int, default=600,
                   help="images with masks to generate for it (default 600)")  # fmt: skip
    g.add_argument("--segmentation-epochs", type=int, default=6, help="epochs (default 6)")
    g = p.add_argument_group("the multi-crop table")
    g.add_argument("--multicrop-images", type=int, default=1000,
                   help="images to generate for it (default 1000; --source if given)")  # fmt: skip
    g.add_argument("--views", default="2x224,6x96", metavar="GxS,LxS",
                   help="global and local views: count x size (default 2x224,6x96: DINO's)")
    g.add_argument("--multicrop-batch-size", type=int, default=128, help="batch size (128)")
    g.add_argument("--multicrop-epochs", type=int, default=5, help="epochs (5)")
    g.add_argument("--multicrop-rows", help="comma-separated subset of: "
                   + ", ".join(MULTICROP_ROWS))  # fmt: skip
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--workdir", help="keep the images and caches here (default: a temp folder)")
    return p


def _say(line: str) -> None:
    print("  " + line, flush=True)


def _loading(args: argparse.Namespace, workdir: Path) -> BenchReport:
    print(
        f"mmcache bench: {args.source or f'{args.images} generated JPEGs'}, "
        f"{args.epochs} epochs, batch {args.batch_size}, {args.workers} DataLoader "
        "workers, shuffled" + (", cold page cache" if args.cold else ""),
        flush=True,
    )
    return run_bench(
        source=args.source, images=args.images, image_size=args.image_size,
        batch_size=args.batch_size, workers=args.workers, epochs=args.epochs,
        build_workers=args.build_workers, size=args.size, cold=args.cold,
        methods=args.methods.split(",") if args.methods else None,
        write_pause=args.write_pause, workdir=workdir / "loading", on_event=_say,
    )  # fmt: skip


def _training(args: argparse.Namespace, workdir: Path) -> TrainingReport:
    crop = f"RandomResizedCrop({args.crop}) + flip"
    return _crops(args, workdir, "training", "training pipeline", crop, run_training_bench,
                  rows=args.rows, size=args.crop)  # fmt: skip


def _crops(args, workdir, part, title, crops, run, *, rows, **more):
    """Say, then run, the part of the bench that crops photos stored at --short-side
    (``part`` is training or multicrop: its --PART-images, --PART-batch-size, --PART-epochs)."""
    images, batch_size, epochs = (getattr(args, f"{part}_{k}") for k in
                                  ("images", "batch_size", "epochs"))  # fmt: skip
    print(
        f"{title}: {args.source or f'{images} generated JPEGs'} at shorter side "
        f"{args.short_side}, {crops}, batch {batch_size}, {args.workers} workers or threads",
        flush=True,
    )
    return run(
        source=args.source, images=images, image_size=args.image_size,
        short_side=args.short_side, batch_size=batch_size, workers=args.workers,
        epochs=epochs, rows=rows.split(",") if rows else None, workdir=workdir / part,
        on_event=_say, **more,
    )  # fmt: skip


def _segmentation(args: argparse.Namespace, workdir: Path) -> SegmentationReport:
    print(
        f"segmentation: {args.segmentation_images} generated JPEGs with masks, "
        f"RandomResizedCrop({args.crop}) + flip of both, batch {args.batch_size}, "
        f"{args.workers} workers or threads",
        flush=True,
    )
    return run_segmentation_bench(
        workdir=workdir / "segmentation", images=args.segmentation_images, size=args.crop,
        batch_size=args.batch_size, workers=args.workers, epochs=args.segmentation_epochs,
        on_event=_say,
    )  # fmt: skip


def _multicrop(args: argparse.Namespace, workdir: Path) -> MultiCropReport:
    try:
        (gn, gs), (ln, ls) = (tuple(int(v) for v in part.split("x")) for part in
                              args.views.split(","))  # fmt: skip
    except ValueError:
        raise SystemExit(f"--views takes COUNTxSIZE,COUNTxSIZE, got {args.views!r}") from None
    views = f"{gn} x {gs} + {ln} x {ls} views + flips"
    return _crops(args, workdir, "multicrop", "multi-crop", views, run_multicrop_bench,
                  rows=args.multicrop_rows, global_views=gn, global_size=gs, local_views=ln,
                  local_size=ls)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"loading", "training", "segmentation", "multicrop"}:
        p.error(f"--parts takes loading, training, segmentation and multicrop, got {args.parts!r}")
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="mmcache-bench-")
    workdir = Path(args.workdir or tmp)
    try:
        report = _loading(args, workdir) if "loading" in parts else None
        training = _training(args, workdir) if "training" in parts else None
        segmentation = _segmentation(args, workdir) if "segmentation" in parts else None
        multicrop = _multicrop(args, workdir) if "multicrop" in parts else None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    written = write_report(report, args.out, training, segmentation, multicrop)
    if multicrop is not None:
        print("multi-crop profile, one thread, per image:")
        for part in multicrop.profile:
            print(f"  {part['part']}: {part['ms']:.3f} ms, boxes {part['box_mpx']:.3f} Mpx, "
                  f"output {part['out_mpx']:.3f} Mpx")  # fmt: skip
    print("targets:")
    tables = [r for r in (report, training, segmentation, multicrop) if r is not None]
    for t in [t for r in tables for t in r.targets]:
        got, need, result = t.cells()
        print(f"  {result:4}  {t.name}: {got} (needs {need}){'  ' + t.note if t.note else ''}")
    print("reproduce: python tools/bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if report is None or report.pixels_equal is not False else 1


if __name__ == "__main__":
    sys.exit(main())
