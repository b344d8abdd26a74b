"""The command line, ``mmcache``: the only part of mmcache that prints.

Each subcommand calls one library function and prints its report. A user mistake (a missing
folder, a damaged cache) prints one line, ``mmcache: error: ...``, and exits with status 1;
Ctrl-C exits with 130. ``main(argv)`` returns the exit status, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence

from ._version import __version__
from .build import BuildReport, build_cache
from .decode import DEFAULT_MAX_PIXELS, INTERPOLATIONS, parse_size
from .errors import CacheError


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class _Progress:
    """A tqdm bar fed by a library ``progress(done, total)`` callback."""

    def __init__(self, desc: str, unit: str = "img") -> None:
        self.desc, self.unit, self.bar = desc, unit, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr)
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _add_preprocessing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preprocessing (fixed at build time, recorded in the cache)")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--size", type=parse_size, metavar="WxH", help="resize to exactly WxH")
    size.add_argument(
        "--max-side", type=int, metavar="N", help="shrink so the longer side is at most N"
    )
    size.add_argument(
        "--short-side", type=int, metavar="N", help="shrink so the shorter side is at most N"
    )
    g.add_argument(
        "--interpolation",
        choices=["auto", *INTERPOLATIONS],
        default="auto",
        help="resize filter (default auto: area to shrink, linear to enlarge)",
    )
    g.add_argument("--color", choices=["rgb", "bgr", "gray"], default="rgb")
    g.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        metavar="N",
        help=f"refuse larger images without decoding them (default {DEFAULT_MAX_PIXELS:,})",
    )


def _preprocessing_kwargs(args: argparse.Namespace) -> dict:
    return {
        "size": args.size,
        "max_side": args.max_side,
        "short_side": args.short_side,
        "interpolation": args.interpolation,
        "color": args.color,
        "max_pixels": args.max_pixels,
    }


def _print_build(report: BuildReport, out: Callable[[str], None]) -> None:
    if report.up_to_date:
        out(f"{report.cache}: up to date ({report.images:,} images, nothing decoded)")
        return
    out(
        f"{report.cache}: {report.images:,} images, {report.classes} classes, "
        f"{_human_bytes(report.bytes)}, {report.seconds:.1f} s, "
        f"{report.images_per_second:,.0f} img/s decoded"
        + (f", {report.reused:,} reused, {report.dropped:,} dropped" if report.reused else "")
        + f", {len(report.skipped)} skipped"
    )
    for s in report.skipped[:20]:
        out(f"  skipped {s['path']}: {s['reason']}")
    if len(report.skipped) > 20:
        out(f"  ... and {len(report.skipped) - 20} more (see manifest.json)")
    for w in report.warnings[:5]:
        out(f"  warning {w['path']}: {w['reason']}")
    if len(report.warnings) > 5:
        out(f"  ... {len(report.warnings) - 5} more decoder warnings (see manifest.json)")


def _cmd_build(args: argparse.Namespace) -> int:
    bar = _Progress("decoding")
    try:
        report = build_cache(
            args.source,
            args.cache,
            workers=args.workers,
            strict=args.strict,
            progress=bar,
            **_preprocessing_kwargs(args),
        )
    finally:
        bar.close()
    _print_build(report, print)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    workdir = args.workdir or tempfile.mkdtemp(prefix="mmcache-demo-")
    print(
        f"mmcache demo: {args.images} photo-like JPEGs of {args.image_size[0]}x"
        f"{args.image_size[1]} in {workdir}, {args.epochs} epochs, batch {args.batch_size}, "
        f"{args.workers} DataLoader workers"
    )
    bar = _Progress("building cache")

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
    _print_build(report.build, lambda s: print("build: " + s))
    decode = min(report.epochs["decode every epoch"])
    cached = min(report.epochs["mmcache"])
    print(f"pixels identical to decoding: {'yes' if report.pixels_equal else 'NO'}")
    print(
        f"best epoch: decoding {decode:.2f} s, mmcache {cached:.2f} s "
        f"({decode / cached:.1f}x faster)"
    )
    return 0 if report.pixels_equal else 1


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify import verify_cache

    bar = _Progress("verifying", unit="rec")
    try:
        report = verify_cache(args.cache, source=args.source or False, progress=bar)
    finally:
        bar.close()
    for b in report.bad[:50]:
        path = b.path.encode("utf-8", "backslashreplace").decode("utf-8")
        print(f"  bad record {b.index} {path}: {b.what}")
    if len(report.bad) > 50:
        print(f"  ... and {len(report.bad) - 50} more bad records")
    print(
        f"{report.cache}: {report.checked:,} of {report.records:,} records checked "
        f"({_human_bytes(report.bytes)}, {report.seconds:.1f} s)"
        + (f", {report.empty:,} not filled yet" if report.empty else "")
        + (
            f", {report.source_compared:,} compared with the source"
            + (
                f" ({report.source_unavailable:,} source files missing or changed)"
                if report.source_unavailable
                else ""
            )
            if args.source
            else ""
        )
        + (f": {len(report.bad):,} BAD" if report.bad else ": all good")
    )
    return 0 if report.ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmcache",
        description="Decode images once into a memory-mapped cache; train from it with PyTorch.",
    )
    p.add_argument("--version", action="version", version=f"mmcache {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser("build", help="decode a source folder or list into a cache")
    b.add_argument("source", help="image folder (class subfolders or flat) or path,label list")
    b.add_argument("cache", help="cache folder to create or update")
    _add_preprocessing(b)
    b.add_argument("--workers", type=int, default=None, help="decode processes (default: cores)")
    b.add_argument(
        "--strict", action="store_true", help="fail, publishing nothing, if any file is bad"
    )
    b.set_defaults(func=_cmd_build)

    v = sub.add_parser("verify", help="check every record's checksum (and pixels vs the source)")
    v.add_argument("cache", help="cache folder")
    v.add_argument(
        "--source",
        nargs="?",
        const="sample",
        choices=["sample", "all"],
        help="also decode the source again and compare: a 1%% sample (default) or all",
    )
    v.set_defaults(func=_cmd_verify)

    d = sub.add_parser("demo", help="generate images, build a cache, compare epoch times")
    d.add_argument("--images", type=int, default=1000)
    d.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    d.add_argument("--epochs", type=int, default=3)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    d.add_argument("--workdir", help="keep the images and cache here (default: a temp folder)")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except CacheError as e:
        print(f"mmcache: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad option values (Options validates them)
        print(f"mmcache: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmcache: interrupted", file=sys.stderr)
        return 130
