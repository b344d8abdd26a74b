"""The command line, ``mmcache``: the only part of mmcache that prints.

Each subcommand calls one library function and prints its report. A user mistake (a missing
folder, a damaged cache) prints one line, ``mmcache: error: ...``, and exits with status 1;
Ctrl-C exits with 130. ``main(argv)`` returns the exit status, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from ._version import __version__
from .build import BuildReport, build_cache
from .decode import DEFAULT_MAX_PIXELS, INTERPOLATIONS, parse_size
from .errors import CacheError, DistributedBuildError
from .space import human_bytes as _human_bytes

# The bench's method keys, spelled here so that --help does not import torch (mmcache.bench).
_BENCH_METHODS = (
    "decode",
    "manager_dict",
    "in_memory",
    "mmcache",
    "lazy",
    "batch_loader",
    "copy_loop",
)


class _Progress:
    """A tqdm bar fed by a library ``progress(done, total)`` callback."""

    def __init__(
        self, desc: str, unit: str = "img", delay: float = 0.0, unit_scale: bool = False
    ) -> None:
        self.desc, self.unit, self.delay, self.bar = desc, unit, delay, None
        self.unit_scale = unit_scale

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=self.desc,
                unit=self.unit,
                unit_scale=self.unit_scale,
                delay=self.delay,
                file=sys.stderr,
            )
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
    g.add_argument(
        "--reduced-decode",
        action="store_true",
        help="decode JPEGs shrunk 2x or more at 1/2, 1/4 or 1/8 scale: faster, pixels differ "
        "slightly from the full decode (recorded in the cache)",
    )


def _preprocessing_kwargs(args: argparse.Namespace) -> dict:
    return {
        "size": args.size,
        "max_side": args.max_side,
        "short_side": args.short_side,
        "interpolation": args.interpolation,
        "color": args.color,
        "max_pixels": args.max_pixels,
        "reduced_decode": args.reduced_decode,
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
    if args.dry_run:
        return _cmd_plan(args)
    # torchrun sets WORLD_SIZE and RANK: then every rank runs this and they build together.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from .distributed import torchrun_process_group

        rank = int(os.environ.get("RANK", "0"))
        with torchrun_process_group(args.dist_timeout), _sigterm_fails(rank):
            return _run_build(args, rank, "decoding (rank 0's share)")
    return _run_build(args, 0, "decoding")


def _run_build(args: argparse.Namespace, rank: int, desc: str) -> int:
    bar = _Progress(desc) if rank == 0 else None  # one bar: several would garble the terminal
    try:
        report = build_cache(
            args.source,
            args.cache,
            workers=args.workers,
            strict=args.strict,
            progress=bar,
            force=args.force,
            trust_decoder=args.trust_decoder,
            dist_timeout=args.dist_timeout,
            **_preprocessing_kwargs(args),
        )
    finally:
        if bar is not None:
            bar.close()
    if rank == 0:
        _print_build(report, print)
        if report.trusted_decoder:
            print("  kept pixels decoded by another decoder version (--trust-decoder, recorded)")
    return 0


@contextmanager
def _sigterm_fails(rank: int) -> Iterator[None]:
    """Turn SIGTERM into an error, so a rank stopped by torchrun cleans up and says why."""

    def handler(signum: int, frame: object) -> None:
        raise DistributedBuildError(
            f"rank {rank}: stopped by SIGTERM (torchrun stops every rank when one fails); "
            "nothing was published"
        )

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except BaseException:
        # The error is on its way to being printed: a SIGTERM now (torchrun stopping the ranks
        # left once one died) must not kill this rank before it has said why the build failed.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise
    signal.signal(signal.SIGTERM, old)


def _cmd_copy(args: argparse.Namespace) -> int:
    from .copying import copy_cache

    bar = _Progress("copying", unit="B", unit_scale=True)
    try:
        report = copy_cache(args.cache, args.dest, progress=bar)
    finally:
        bar.close()
    print(
        f"{report.dest}: {report.images:,} images, {_human_bytes(report.bytes)} "
        f"({_human_bytes(report.copied)} copied, holes skipped), {report.seconds:.1f} s, "
        f"{_human_bytes(report.bytes_per_second)}/s; {report.verified:,} records verified"
    )
    return 0


def _print_plan(plan, out: Callable[[str], None]) -> None:
    """``plan`` (a ``mmcache.plan.CachePlan``) as a table a person reads before building."""
    out(f"source       {plan.source}")
    out(
        f"images       {plan.files:,} files in {plan.classes:,} "
        f"{'class' if plan.classes == 1 else 'classes'} (headers read in {plan.seconds:.2f} s)"
    )
    if plan.unreadable:
        names = ", ".join(plan.unreadable[:3]) + (" ..." if len(plan.unreadable) > 3 else "")
        out(
            f"             {len(plan.unreadable):,} without a readable header ({names}): the "
            "build decodes them to learn their size, or skips them; not counted below"
        )
    if plan.too_large:
        out(f"             {len(plan.too_large):,} over the pixel limit: the build skips them")
    if plan.native is not None:
        n = plan.native
        out(f"native size  {'min':>10} {'median':>10} {'max':>10}")
        for name, (lo, mid, hi) in (("width", n.width), ("height", n.height)):
            out(f"  {name:<10} {lo:>10,} {mid:>10,} {hi:>10,}")
        lo, mid, hi = (v / 1e6 for v in n.pixels)
        out(f"  {'megapixels':<10} {lo:>10.2f} {mid:>10.2f} {hi:>10.2f}")
    out("")
    policies = plan.policies
    if all(p.name != plan.build.name for p in policies):
        policies = [plan.build, *policies]
    disk = plan.free_bytes is not None
    out(
        f"{'policy (' + plan.build.options.color + ')':<20} {'data':>10} {'total':>10} "
        f"{'in RAM':>7}" + (f" {'fits disk':>9}" if disk else "")
    )
    for p in policies:
        fits = "" if not disk else " yes" if plan.free_bytes >= p.disk_bytes else " NO"
        out(
            f"{p.name:<20} {_human_bytes(p.data_bytes):>10} {_human_bytes(p.total_bytes):>10} "
            f"{plan.ram_fraction(p):>7.0%}{fits:>10}"
            + ("  <- this build" if p.name == plan.build.name else "")
        )
    out("")
    if plan.cache is not None:
        out(
            f"destination  {plan.cache}: {_human_bytes(plan.free_bytes)} free on the filesystem "
            f"of {plan.destination}; this build needs {_human_bytes(plan.build.disk_bytes)}"
        )
        if plan.up_to_date:
            out("             the cache there is up to date: a build would do nothing")
        elif plan.existing_bytes:
            out(
                f"             the cache there ({_human_bytes(plan.existing_bytes)}) stays "
                "until the new one is published, then is deleted"
            )
        if not plan.fits_on_disk:
            out("             NOT ENOUGH SPACE: a build would refuse to start (--force overrides)")
    out(
        f"memory       {_human_bytes(plan.ram_total)} RAM, {_human_bytes(plan.ram_available)} "
        f"available: {plan.ram_fraction():.0%} of this build's pixels fit in the page cache"
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_cache

    bar = _Progress("reading headers", unit="file", delay=0.5)
    try:
        plan = plan_cache(args.source, args.cache, progress=bar, **_preprocessing_kwargs(args))
    finally:
        bar.close()
    _print_plan(plan, print)
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
    print(f"pixels identical to decoding: {'yes' if report.pixels_equal else 'NO'}")
    decode = min(report.epochs["decode every epoch"])
    for name, times in report.epochs.items():
        best = min(times)
        print(
            f"best epoch, {name:<20} {best:6.2f} s {report.images / best:8,.0f} img/s "
            f"({decode / best:.1f}x decoding)"
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


def _share(part: int | None, whole: int) -> str:
    if part is None:
        return "unknown (no mincore here)"
    return f"{_human_bytes(part)} ({part / whole if whole else 1.0:.0%})"


def _cmd_info(args: argparse.Namespace) -> int:
    from .residency import cache_info

    info = cache_info(args.cache)
    if args.json:
        print(json.dumps(info.to_json(), indent=1, ensure_ascii=False))
        return 0

    def shape(s: tuple[int, int, int]) -> str:
        return f"{s[1]}x{s[0]}x{s[2]}"

    if info.min_size is None:
        sizes = "none"
    elif info.fixed_size:
        sizes = f"all {shape(info.min_size)} (WxHxC)"
    else:
        sizes = f"{shape(info.min_size)} to {shape(info.max_size)} (WxHxC, by pixels)"
    options = ", ".join(f"{k}={v}" for k, v in info.options.items() if v is not None)
    ram = "cgroup limit" if info.cgroup_limited else "RAM"
    lines = [
        f"cache:      {info.cache}",
        f"format:     {info.format_version[0]}.{info.format_version[1]}, {info.mode} mode, "
        f"generation {info.generation}",
        f"images:     {info.images:,} ({info.filled:,} filled), {len(info.classes)} classes, "
        f"{len(info.skipped)} skipped",
        f"sizes:      {sizes}",
        f"options:    {options}",
        f"data:       {_human_bytes(info.data_bytes)} ({_human_bytes(info.disk_bytes)} on disk, "
        f"{_human_bytes(info.apparent_bytes)} apparent, all files)",
        f"resident:   {_share(info.resident_bytes, info.data_bytes)} of the data in the page cache",
        f"memory:     {_human_bytes(info.ram_total)} {ram}, "
        f"{_human_bytes(info.ram_available)} available",
        f"source:     {'changed: ' + info.stale if info.stale else 'unchanged (or not there)'}",
    ]
    lines += [f"  skipped {s['path']}: {s['reason']}" for s in info.skipped[:20]]
    if len(info.skipped) > 20:
        lines.append(f"  ... and {len(info.skipped) - 20} more (see manifest.json)")
    print("\n".join(lines))
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    from .residency import warm_cache

    bar = _Progress("warming", unit="B", unit_scale=True)
    try:
        report = warm_cache(args.cache, max_memory=args.max_memory, progress=bar)
    finally:
        bar.close()
    print(
        f"{report.cache}: {_share(report.resident_after, report.data_bytes)} resident "
        f"(was {_share(report.resident_before, report.data_bytes)}), "
        f"{_human_bytes(report.read_bytes)} read in {report.seconds:.1f} s"
        + (
            f"; stopped at the memory budget of {_human_bytes(report.budget_bytes)}"
            if report.stopped_by_budget
            else ""
        )
    )
    return 0


def _cmd_evict(args: argparse.Namespace) -> int:
    from .residency import evict_cache

    after = evict_cache(args.cache)
    if after is None:
        status = "evicted (how much stays resident is unknown here: no mincore)"
    elif after == 0:
        status = "evicted, none of the data is in the page cache"
    else:
        status = f"{_human_bytes(after)} of the data stays resident (mapped by a running process?)"
    print(f"{args.cache}: {status}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import METHODS, run_bench, write_report

    methods = args.methods.split(",") if args.methods else list(METHODS)
    print(
        f"mmcache bench: {args.source or f'{args.images} generated JPEGs'}, {args.epochs} "
        f"epochs, batch {args.batch_size}, {args.workers} DataLoader workers, shuffled"
        + (", cold page cache" if args.cold else ""),
        flush=True,
    )
    report = run_bench(
        source=args.source,
        images=args.images,
        image_size=args.image_size,
        batch_size=args.batch_size,
        workers=args.workers,
        epochs=args.epochs,
        build_workers=args.build_workers,
        size=args.size,
        cold=args.cold,
        methods=methods,
        workdir=args.workdir,
        on_event=lambda line: print("  " + line, flush=True),
    )
    written = write_report(report, args.out)
    print("targets (issue 5):")
    for t in report.targets:
        got = "n/a" if t.passed is None and t.value != t.value else f"{t.value:.2f}"
        need = (">=" if t.higher_is_better else "<=") + f" {t.threshold:g}"
        result = {True: "pass", False: "FAIL", None: "n/a"}[t.passed]
        print(f"  {result:4}  {t.name}: {got} (needs {need}){'  ' + t.note if t.note else ''}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if report.pixels_equal is not False else 1


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
    b.add_argument(
        "--dry-run", action="store_true", help="print the plan (sizes, space) and build nothing"
    )
    b.add_argument(
        "--force", action="store_true", help="build even if the disk seems to lack the space"
    )
    b.add_argument(
        "--trust-decoder",
        action="store_true",
        help="keep a cache made by another decoder version instead of decoding it again",
    )
    b.add_argument(
        "--dist-timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for the others before the build fails "
        "(default 1800)",
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

    c = sub.add_parser("copy", help="copy a cache (to a node's local disk) and verify the copy")
    c.add_argument("cache", help="the cache folder to copy")
    c.add_argument("dest", help="the folder to copy it to (created, or a cache it replaces)")
    c.set_defaults(func=_cmd_copy)

    pl = sub.add_parser(
        "plan", help="how big a cache would be under each resize policy (reads headers only)"
    )
    pl.add_argument("source", help="image folder (class subfolders or flat) or path,label list")
    pl.add_argument("cache", nargs="?", help="cache folder a build would write (for free space)")
    _add_preprocessing(pl)
    pl.set_defaults(func=_cmd_plan)

    d = sub.add_parser("demo", help="generate images, build a cache, compare epoch times")
    d.add_argument("--images", type=int, default=1000)
    d.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    d.add_argument("--epochs", type=int, default=3)
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    d.add_argument("--workdir", help="keep the images and cache here (default: a temp folder)")
    d.set_defaults(func=_cmd_demo)

    i = sub.add_parser("info", help="describe a cache and how much of it is in RAM")
    i.add_argument("cache")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.set_defaults(func=_cmd_info)

    w = sub.add_parser("warm", help="read a cache into the page cache, within a memory budget")
    w.add_argument("cache")
    w.add_argument(
        "--max-memory",
        default="90%",
        metavar="BUDGET",
        help="stop before memory used by processes plus the cache would pass this: a share "
        "of RAM (90%%) or a size (8G) (default 90%%)",
    )
    w.set_defaults(func=_cmd_warm)

    e = sub.add_parser("evict", help="drop a cache's pages from the page cache")
    e.add_argument("cache")
    e.set_defaults(func=_cmd_evict)

    n = sub.add_parser("bench", help="time mmcache against the alternatives, one run, all methods")
    n.add_argument("--source", help="image folder to use (default: generate photo-like JPEGs)")
    n.add_argument("--images", type=int, default=2000, help="images to generate (default 2000)")
    n.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    n.add_argument("--epochs", type=int, default=3)
    n.add_argument("--batch-size", type=int, default=64)
    n.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    n.add_argument(
        "--build-workers", type=int, default=None, help="build processes (default: cores)"
    )
    n.add_argument(
        "--size", type=parse_size, metavar="WxH", help="resize all to WxH (mixed-size folders)"
    )
    n.add_argument("--cold", action="store_true", help="drop the page cache before each method")
    n.add_argument("--methods", help="comma-separated subset of: " + ", ".join(_BENCH_METHODS))
    n.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    n.add_argument("--workdir", help="keep the images and caches here (default: a temp folder)")
    n.set_defaults(func=_cmd_bench)
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
