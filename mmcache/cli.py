"""The command line, ``mmcache``: the only part of mmcache that prints.

Each subcommand calls one library function and prints its report. A user mistake (a missing
folder, a damaged cache) prints one line, ``mmcache: error: ...``, and exits with status 1;
Ctrl-C exits with 130. Output cut short by its reader (``mmcache plan ... | head -1``) ends
quietly with status 141, as a command killed by SIGPIPE would (128 + 13), so a pipeline under
``set -o pipefail`` still sees that not everything was read. ``main(argv)`` returns the exit
status, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, cast

from ._feedback import count, human_bytes
from ._version import __version__
from ._writer import COMPACT_AT, DIST_TIMEOUT
from .annotations import NO_MASK
from .build import build_cache
from .decode import TRUNCATED
from .errors import CacheError, DistributedBuildError
from .options import (
    OPTION_FLAGS,
    SIZE_POLICIES,
    OptionFlag,
    Options,
    height_width,
    whole_number,
)
from .reports import BuildReport
from .residency import DEFAULT_MAX_MEMORY
from .scan import Listing, scan_source

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = ["main"]


class _Progress:
    """A library ``progress(done, total)`` callback shown on stderr: a tqdm bar on a terminal;
    elsewhere (a log file, a pipe) a plain line every ``LOG_EVERY`` seconds, without the
    carriage returns of a bar; nothing with ``--quiet``."""

    LOG_EVERY = 30.0

    def __init__(
        self,
        desc: str,
        unit: str = "img",
        delay: float = 0.0,
        unit_scale: bool = False,
        quiet: bool = False,
    ) -> None:
        self.desc, self.unit, self.delay = desc, unit, delay
        self.bar: tqdm | None = None
        self.unit_scale, self.quiet = unit_scale, quiet
        self.terminal = sys.stderr.isatty()
        self.logged = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if not self.terminal:
            now = time.monotonic()
            if now - self.logged >= self.LOG_EVERY and done < total:
                self.logged = now
                shown = human_bytes(done) if self.unit_scale else f"{done:,}"
                whole = human_bytes(total) if self.unit_scale else f"{total:,} {self.unit}"
                print(f"mmcache: {self.desc}: {shown} of {whole} ({done / total:.0%})",
                      file=sys.stderr, flush=True)  # fmt: skip
            return
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


@contextmanager
def _notes_shown(quiet: bool) -> Iterator[None]:
    """Print what the library logs at INFO and above (``mmcache: waiting for ...``) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mmcache: %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    logger = logging.getLogger("mmcache")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a library parser: its ValueError's own words, not "invalid value"."""

    def argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return argument


_height_width = _argument_type(height_width)  # demo's --image-size WxH, as --size reads it
_positive = _argument_type(whole_number)


def _positive_seconds(text: str) -> float:
    """argparse type of a duration: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def _share_arg(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"expected a share between 0 and 1 (or 0% to 100%), got {text!r}"
        )
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive whole number, got {text!r}")
    return value


def _option_type(spec: OptionFlag) -> Callable[[str], Any]:
    """argparse type of a preprocessing flag: the table's parser; an old name (interpolation's
    OpenCV names) still works, with a warning."""
    parse = _argument_type(spec.parse or str)

    def argument(text: str) -> Any:
        if text in spec.renamed:
            new = spec.renamed[text]
            print(
                f"mmcache: warning: {spec.flag} {text} is now called {new} (the same "
                f"filter; {text} will stop working in the next major release)",
                file=sys.stderr,
            )
            return new
        return parse(text)

    return argument


def _add_option(p: argparse.ArgumentParser | Any, spec: OptionFlag) -> None:
    """``spec``'s flag, its value kept under the name of its ``Options`` field."""
    assert spec.flag is not None
    if spec.parse is None:  # a switch
        p.add_argument(spec.flag, dest=spec.name, action="store_true", help=spec.help)
        return
    p.add_argument(
        spec.flag,
        dest=spec.name,
        type=_option_type(spec),
        choices=spec.choices,
        default=_DEFAULTS[spec.name],
        metavar=spec.metavar,
        help=spec.help,
    )


# The preprocessing flags of build and plan; the mask's dtype is given beside --masks (build).
_PREPROCESSING = [spec for spec in OPTION_FLAGS if spec.flag and spec.name != "mask"]
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}


def _add_preprocessing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preprocessing (fixed at build time, recorded in the cache)")
    size = g.add_mutually_exclusive_group()
    for spec in _PREPROCESSING:
        _add_option(size if spec.name in SIZE_POLICIES else g, spec)


def _preprocessing_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``Options`` (``build_cache``, ``plan_cache``) the flags give."""
    return {spec.name: getattr(args, spec.name) for spec in _PREPROCESSING}


def _ignored_files(by_extension: dict[str, int], most: int = 5) -> str:
    """``"5 files ignored (not images): .txt (3), .xml (2)"``, the commonest extensions."""
    shown = [f"{ext or '(no extension)'} ({n})" for ext, n in list(by_extension.items())[:most]]
    more = ", ..." if len(by_extension) > most else ""
    total = count(sum(by_extension.values()), "file")
    return f"{total} ignored (not images by their extension): {', '.join(shown)}{more}"


def _print_build(report: BuildReport, out: Callable[[str], None]) -> None:
    for folder in report.ignored:
        out(f"  ignored {_one_line(folder)}/ in the source: it holds an mmcache cache")
    if report.other_files:
        out(f"  {_ignored_files(report.other_files)}")
    images = count(report.images, "image")
    pending = f", {count(report.pending, 'record')} to fill on first read" if report.pending else ""
    if report.up_to_date:
        # What the build that made it skipped, it said: counted here, listed by `mmcache info`.
        left = f"; {len(report.skipped):,} skipped, see `mmcache info`" if report.skipped else ""
        out(f"{_one_line(report.cache)}: up to date ({images}{pending}; nothing decoded{left})")
    else:
        out(
            f"{_one_line(report.cache)}: {images} in {count(report.classes, 'class', 'classes')}, "
            f"{human_bytes(report.bytes)}, in {report.seconds:.1f} s"
        )
        new = report.decoded - report.changed
        which = []
        if report.reused or report.changed:  # a refresh: say which files were decoded
            which = [f"{new:,} new"] if new else []
            which += [f"{report.changed:,} changed since the last build"] if report.changed else []
        if report.decode_seconds >= 1:  # a rate over less than a second says nothing
            which.append(f"{report.images_per_second:,.0f} img/s")
        done = [f"{report.decoded:,} decoded" + (f" ({', '.join(which)})" if which else "")]
        if report.reused:
            done.append(f"{report.reused:,} reused")
        if report.removed:
            done.append(f"{report.removed:,} removed (gone from the source)")
        out("  " + ", ".join(done) + pending + f"; {len(report.skipped):,} skipped")
        where = (
            "appended to the data file, the kept records where they were"
            if report.appended
            else "a new data file"
        )
        wrote = f"  wrote {human_bytes(report.written_bytes)} ({where})"
        # Garbage is what refreshes leave (replaced and removed records): a first build or a
        # compaction has none, and then the line says only what was written.
        if report.garbage_bytes:
            wrote += f"; {_garbage(report.garbage_bytes, report.bytes)}"
        out(wrote)
    if report.compaction_deferred:
        out(f"  not compacted: {report.compaction_deferred}")
    if not report.up_to_date:
        for line in _skipped_lines(report.skipped):
            out("  " + line)
        for line in _unpaired_lines(report):
            out("  " + line)
    truncated = sum(s["reason"] == TRUNCATED for s in report.skipped)
    if truncated:
        out(
            f"  {count(truncated, 'truncated JPEG')} skipped (`--keep-truncated --replace` "
            "rebuilds the cache keeping them, their missing part grey)"
        )
    for w in report.warnings[:5]:
        out(f"  warning {_one_line(w['path'])}: {_one_line(w['reason'])}")
    if len(report.warnings) > 5:
        out(f"  ... {len(report.warnings) - 5:,} more warnings (see manifest.json)")


def _skipped_lines(skipped: list[dict[str, Any]]) -> list[str]:
    """One line per skipped file, but one line for the files of a reason more than three share
    (VOC's images without a mask: most of JPEGImages), with their count and first few names;
    20 lines at most."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s["reason"], []).append(s["path"])
    lines = []
    for reason, paths in by_reason.items():
        if len(paths) <= 3:
            lines += [f"skipped {_one_line(p)}: {_one_line(reason)}" for p in paths]
            continue
        lines.append(f"{len(paths):,} skipped, {_one_line(reason)}: {_first_few(paths)}")
        if reason.startswith(NO_MASK):
            lines[-1] += (
                " (a `path,label` list of the images with a mask, as the source, builds "
                "them alone: docs/annotations.md)"
            )
    if len(lines) > 20:
        lines[20:] = [f"... and {len(lines) - 20:,} more lines (see manifest.json)"]
    return lines


def _first_few(names: Sequence[object]) -> str:
    """``a.jpg, b.jpg, c.jpg, ...``: the first three of ``names``, one line each."""
    more = ", ..." if len(names) > 3 else ""
    return ", ".join(_one_line(str(n)) for n in names[:3]) + more


def _unpaired_lines(report: BuildReport) -> list[str]:
    """What of the COCO file a build left out for want of its image, one line each."""
    lines = []
    if report.coco_missing:
        lines.append(
            f"{count(len(report.coco_missing), 'image')} of the COCO file not in the source, "
            f"left out: {_first_few(report.coco_missing)}"
        )
    if report.coco_orphans:
        lines.append(
            f"{count(report.coco_orphans, 'COCO annotation')} of image ids the file does not "
            f"list, left out: ids {_first_few(report.coco_unknown_ids)}"
        )
    return lines


def _annotation_words(annotations: dict[str, Any], paired: dict[str, str]) -> str:
    """What records carry besides pixels, for ``info``: ``mask (uint8, from MASKS); boxes,
    labels (3 classes), iscrowd (from COCO)``."""
    words = []
    if "mask" in annotations:
        where = f", from {_one_line(paired['masks'])}" if "masks" in paired else ""
        words.append(f"mask ({annotations['mask']}{where})")
    fields = []
    for name, spec in annotations.items():
        if name != "mask":
            classes = spec.get("classes")
            fields.append(f"{name} ({count(len(classes), 'class', 'classes')})" if classes
                          else name)  # fmt: skip
    if fields:
        where = f" (from {_one_line(paired['coco'])})" if "coco" in paired else ""
        words.append(", ".join(fields) + where)
    return "; ".join(words)


def _garbage(garbage: int, data: int) -> str:
    share = garbage / data if data else 0.0
    return f"{human_bytes(garbage)} of the data file ({share:.1%}) is garbage"


def _cmd_compact(args: argparse.Namespace) -> int:
    from .build import compact_cache

    report = compact_cache(args.cache)
    if not args.quiet:
        print(
            f"{_one_line(report.cache)}: compacted in {report.seconds:.1f} s: "
            f"{human_bytes(report.dropped_garbage)} of garbage dropped, the data file is now "
            f"{human_bytes(report.bytes)} ({count(report.images, 'image')})"
        )
    return 0


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
    # One bar: several ranks' bars would garble the terminal.
    bar = _Progress(desc, quiet=args.quiet) if rank == 0 else None
    try:
        settings = (
            "workers", "strict", "force", "trust_decoder", "replace", "source_moved", "compact_at",
        )  # fmt: skip
        report = build_cache(
            _source(args),
            args.cache,
            progress=bar,
            masks=args.masks,
            coco=args.coco,
            **{name: getattr(args, name) for name in (*settings, "dist_timeout")},
            **_preprocessing_kwargs(args),
            **({"mask": args.mask} if args.mask else {}),
        )
    finally:
        if bar is not None:
            bar.close()
    if rank == 0 and not args.quiet:
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

    bar = _Progress("copying", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        report = copy_cache(args.cache, args.dest, progress=bar)
    finally:
        bar.close()
    if args.quiet:
        return 0
    print(
        f"{_one_line(report.dest)}: {count(report.images, 'image')}, {human_bytes(report.bytes)} "
        f"({human_bytes(report.copied)} copied, holes skipped), {report.seconds:.1f} s, "
        f"{human_bytes(report.bytes_per_second)}/s; {report.verified:,} records verified"
    )
    return 0


def _print_plan(plan, out: Callable[[str], None]) -> None:
    """``plan`` (a ``mmcache.plan.CachePlan``) as a table a person reads before building."""
    out(f"source       {_one_line(plan.source)}")
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
    asked = plan.build.options.pixels
    other = [name for name in plan.build.layout_bytes if name != asked]  # none for gray
    out(
        f"{'policy (' + plan.build.options.color + ', ' + asked + ')':<20} {'data':>10} "
        f"{'total':>10} {'in RAM':>7}"
        + (f" {'fits disk':>9}" if disk else "")
        + "".join(f" {'data as ' + name:>14}" for name in other)
    )
    for p in policies:
        fits = "" if not disk else " yes" if plan.free_bytes >= p.disk_bytes else " NO"
        out(
            f"{p.name:<20} {human_bytes(p.data_bytes):>10} {human_bytes(p.total_bytes):>10} "
            f"{plan.ram_fraction(p):>7.0%}{fits:>10}"
            + "".join(f" {human_bytes(p.layout_bytes[name]):>14}" for name in other)
            + ("  <- this build" if p.name == plan.build.name else "")
        )
    out("")
    if plan.cache is not None:
        out(
            f"destination  {_one_line(plan.cache)}: {human_bytes(plan.free_bytes)} free on the "
            f"filesystem of {_one_line(plan.destination)}; this build needs "
            f"{human_bytes(plan.build.disk_bytes)}"
        )
        if plan.up_to_date:
            out("             the cache there is up to date: a build would do nothing")
        elif plan.existing_bytes:
            out(
                f"             the cache there ({human_bytes(plan.existing_bytes)}) stays "
                "until the new one is published, then is deleted"
            )
        if not plan.fits_on_disk:
            out("             NOT ENOUGH SPACE: a build would refuse to start (--force overrides)")
    out(
        f"memory       {human_bytes(plan.ram_total)} RAM, {human_bytes(plan.ram_available)} "
        f"available: {plan.ram_fraction():.0%} of this build's pixels fit in the page cache"
    )


def _layout_words(layout: str) -> str:
    """How ``info`` names a record layout."""
    if layout == "yuv420":
        return "yuv420 (planar I420, BT.601 full range; read back as RGB)"
    return f"{layout} (H x W x C)"


def _source(args: argparse.Namespace) -> str | Listing:
    """The source to build or plan: its path, or, with ``--label-key``, its listing."""
    if args.label_key is None:
        return str(args.source)
    return scan_source(args.source, label_key=args.label_key)


def _add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="image folder (class subfolders or flat), path,label list, or an archive: a .tar "
        "(of class folders, or of one tar per class), a .zip, WebDataset shards (a folder of "
        ".tar, or a pattern such as 'train-{0000..0146}.tar')",
    )
    p.add_argument(
        "--label-key",
        metavar="FIELD",
        help="WebDataset shards: take each sample's label from this field of its .json member "
        "(default: its .cls member)",
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_cache

    bar = _Progress("reading headers", unit="file", delay=0.5)
    try:
        # build --dry-run --masks: records with masks (their bytes counted; not checked here)
        masked = getattr(args, "masks", None) is not None
        mask = {"mask": args.mask or "uint8"} if masked else {}
        plan = plan_cache(
            _source(args), args.cache, progress=bar, **_preprocessing_kwargs(args), **mask
        )
    finally:
        bar.close()
    _print_plan(plan, print)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    workdir = args.workdir or tempfile.mkdtemp(prefix="mmcache-demo-")
    print(
        f"mmcache demo: {args.images} photo-like JPEGs of {args.image_size[1]}x"
        f"{args.image_size[0]} in {_one_line(workdir)}, {args.epochs} epochs, "
        f"batch {args.batch_size}, {args.workers} DataLoader workers"
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
    print(f"generated the {count(report.images, 'image')} in {report.generate_seconds:.1f} s")
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
    from .verify import repair_cache, verify_cache

    bar = _Progress("verifying", unit="rec", quiet=args.quiet)
    try:
        if args.repair:
            repair = repair_cache(
                args.cache, source=args.source or False, progress=bar, workers=args.workers
            )
            report = repair.found
        else:
            report = verify_cache(args.cache, source=args.source or False, progress=bar)
    finally:
        bar.close()
    if args.quiet and report.ok:
        return 0
    for b in report.bad[:50]:
        print(f"  bad record {b.index} {_one_line(b.path)}: {_one_line(b.what)}")
    if len(report.bad) > 50:
        print(f"  ... and {len(report.bad) - 50} more bad records")
    print(
        f"{_one_line(report.cache)}: {report.checked:,} of {report.records:,} records checked "
        f"({human_bytes(report.bytes)}, {report.seconds:.1f} s)"
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
    if args.repair:
        return _print_repair(repair)
    if not report.ok:
        print(
            f"  `mmcache verify {_one_line(report.cache)} --repair` decodes the bad records again "
            "from the source the cache was built from"
        )
    return 0 if report.ok else 1


def _print_repair(report) -> int:
    """``report`` (a ``mmcache.verify.RepairReport``) after the verification lines; the exit
    status: 0 when the cache is sound now."""
    for b in report.unrepaired[:50]:
        print(f"  not repaired: record {b.index} {_one_line(b.path)}: {_one_line(b.what)}")
    if report.repaired:
        print(
            f"{_one_line(report.cache)}: {count(len(report.repaired), 'bad record')} repaired: "
            f"decoded again from {_one_line(report.source)}, published as generation "
            f"{report.generation}"
        )
    if report.unrepaired:
        print(
            f"{_one_line(report.cache)}: {count(len(report.unrepaired), 'bad record')} left as "
            "they were: their source files vanished, changed since the build or no longer "
            f"decode. `mmcache build {_one_line(report.source)} {_one_line(report.cache)}` with "
            "the options the cache was made with refreshes changed and vanished files; else "
            "delete and rebuild it"
        )
    return 0 if report.ok else 1


def _share(part: int | None, whole: int) -> str:
    if part is None:
        return "unknown (no mincore here)"
    return f"{human_bytes(part)} ({part / whole if whole else 1.0:.0%})"


def _cmd_info(args: argparse.Namespace) -> int:
    from .residency import cache_info

    info = cache_info(args.cache, source_check=args.source_check)
    if args.json:
        print(_json(info.to_json()))
        return 0

    def shape(s: tuple[int, int, int]) -> str:  # as the arrays and --json give it
        return f"{s[0]}x{s[1]}x{s[2]}"

    if info.min_size is None or info.max_size is None:  # (both, or neither)
        sizes = "none"
    elif info.fixed_size:
        sizes = f"all {shape(info.min_size)} (height x width x channels)"
    else:
        sizes = (
            f"{shape(info.min_size)} to {shape(info.max_size)} (height x width x channels, "
            "smallest and largest)"
        )
    if info.stale:
        source = f"changed: {_one_line(info.stale)}"
    elif not info.source_found:
        source = f"not found at {_one_line(info.source)}, so not compared"
    else:
        source = f"{_one_line(info.source)}, unchanged"
    options = ", ".join(f"{k}={v}" for k, v in info.options.items() if v is not None)
    ram = "cgroup limit" if info.cgroup_limited else "RAM"
    lines = [
        f"cache:      {_one_line(info.cache)}",
        f"format:     {info.format_version[0]}.{info.format_version[1]}, {info.mode} mode, "
        f"generation {info.generation}",
        f"pixels:     {_layout_words(info.options.get('pixels', 'rgb'))}",
        *([f"annotated:  {_annotation_words(info.annotations, info.source_paired)}"]
          if info.annotations else []),
        f"images:     {info.images:,} ({info.filled:,} filled), "
        f"{count(len(info.classes), 'class', 'classes')}, {len(info.skipped):,} skipped, "
        f"{count(len(info.warnings), 'warning')}",
        f"sizes:      {sizes}",
        f"options:    {options}",
        f"data:       {human_bytes(info.data_bytes)} ({human_bytes(info.disk_bytes)} on disk, "
        f"{human_bytes(info.apparent_bytes)} apparent, all files)",
        f"live:       {human_bytes(info.live_bytes)} of records; "
        f"{_garbage(info.garbage_bytes, info.data_bytes)} (`mmcache compact` drops it)",
        f"resident:   {_share(info.resident_bytes, info.data_bytes)} of the data in the page cache",
        f"memory:     {human_bytes(info.ram_total)} {ram}, "
        f"{human_bytes(info.ram_available)} available",
        f"source:     {source}",
    ]
    lines += ["  " + line for line in _skipped_lines(info.skipped)]
    lines += [
        f"  warning {_one_line(w['path'])}: {_one_line(w['reason'])}" for w in info.warnings[:5]
    ]
    if len(info.warnings) > 5:
        lines.append(f"  ... and {len(info.warnings) - 5} more warnings (see manifest.json)")
    print("\n".join(lines))
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    from .residency import warm_cache

    bar = _Progress("warming", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        report = warm_cache(args.cache, max_memory=args.max_memory, progress=bar)
    finally:
        bar.close()
    if args.quiet:
        return 0
    print(
        f"{_one_line(report.cache)}: {_share(report.resident_after, report.data_bytes)} resident "
        f"(was {_share(report.resident_before, report.data_bytes)}), "
        f"{human_bytes(report.read_bytes)} read in {report.seconds:.1f} s"
        + (
            f"; stopped at the memory budget of {human_bytes(report.budget_bytes)}"
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
        status = f"{human_bytes(after)} of the data stays resident (mapped by a running process?)"
    if not args.quiet:
        print(f"{_one_line(args.cache)}: {status}")
    return 0


def _budget(text: str) -> str:
    """argparse type of ``--max-memory``: a share of RAM or a size, checked now."""
    from .residency import parse_memory

    try:
        parse_memory(text, 1 << 40)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in mmcache's one-line form (exit status 2, as argparse's)."""

    def error(self, message: str):
        self.exit(2, f"mmcache: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mmcache",
        description="Decode images once into a memory-mapped cache; train from it with PyTorch.",
    )
    p.add_argument("--version", action="version", version=f"mmcache {__version__}")
    cmds = _Commands(p.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    _add_build(cmds)
    _add_verify(cmds)
    _add_copy_and_plan(cmds)
    _add_demo(cmds)
    _add_cache_tools(cmds)
    return p


class _Commands:
    """Adds the subcommands to the parser: each with its help, some with the shared ``-q``."""

    def __init__(self, sub: Any) -> None:  # (argparse's type for it is private)
        self.sub = sub
        self.quiet = argparse.ArgumentParser(add_help=False)
        self.quiet.add_argument(
            "-q", "--quiet", action="store_true", help="print nothing but errors (no progress bars)"
        )

    def command(self, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand; its one-line help in the list is also the first line of its --help."""
        description = f"{help[0].upper()}{help[1:]}."
        return self.sub.add_parser(name, help=help, description=description, **kwargs)

    def cache_command(
        self,
        name: str,
        func: Callable[[argparse.Namespace], int],
        help: str,
        quiet_flag: bool = True,
    ) -> argparse.ArgumentParser:
        """A subcommand whose first argument is a cache folder."""
        cmd = self.command(name, help, parents=[self.quiet] if quiet_flag else [])
        cmd.add_argument("cache", help="the cache folder")
        cmd.set_defaults(func=func, quiet=False)
        return cmd


def _add_build(cmds: _Commands) -> None:
    b = cmds.command("build", "decode a source folder or list into a cache", parents=[cmds.quiet])
    _add_source(b)
    b.add_argument("cache", help="cache folder to create or update")
    _add_preprocessing(b)
    b.add_argument(
        "--workers",
        type=_non_negative,
        default=None,
        metavar="N",
        help="decode processes (default: one per core; 0 decodes in this process)",
    )
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
        "--replace",
        action="store_true",
        help="rebuild a cache made from another source or with other preprocessing options "
        "(else refused)",
    )
    b.add_argument(
        "--source-moved",
        action="store_true",
        help="the cache's images moved to SOURCE: record the new place, keeping the records of "
        "unchanged files (another source is otherwise refused)",
    )
    b.add_argument(
        "--compact-at",
        type=_share_arg,
        default=COMPACT_AT,
        metavar="SHARE",
        help="write a compact data file when a refresh would leave more than this share of it "
        f"to replaced records (default {COMPACT_AT})",
    )
    b.add_argument(
        "--trust-decoder",
        action="store_true",
        help="keep a cache made by another decoder version instead of decoding it again",
    )
    b.add_argument(
        "--masks",
        metavar="MASKS",
        help="segmentation masks: a folder with a label map per image at the same relative "
        "path and stem (VOC, ADE20K), stored with each image and resized with it",
    )
    _add_option(b, next(spec for spec in OPTION_FLAGS if spec.name == "mask"))
    b.add_argument(
        "--coco",
        metavar="JSON",
        help="COCO detection annotations (instances.json): each image's boxes, labels and "
        "crowd flags, stored in the stored image's pixels",
    )
    b.add_argument(
        "--dist-timeout",
        type=_positive_seconds,
        default=DIST_TIMEOUT,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for the others before the build fails "
        f"(default {DIST_TIMEOUT:g})",
    )
    b.set_defaults(func=_cmd_build)


def _add_verify(cmds: _Commands) -> None:
    v = cmds.cache_command(
        "verify", _cmd_verify, "check every record's checksum (and pixels vs the source)"
    )
    v.add_argument(
        "--source",
        nargs="?",
        const="sample",
        choices=["sample", "all"],
        help="also decode the source again and compare: a 1%% sample, at least 20 files "
        "(default), or all",
    )
    v.add_argument(
        "--repair",
        action="store_true",
        help="decode the bad records again from the source the cache was built from and "
        "publish them (atomically, as a build does)",
    )
    v.add_argument(
        "--workers",
        type=_non_negative,
        default=None,
        metavar="N",
        help="with --repair: decode processes (default: one per core)",
    )


def _add_copy_and_plan(cmds: _Commands) -> None:
    c = cmds.command(
        "copy", "copy a cache (to a node's local disk) and verify the copy", parents=[cmds.quiet]
    )
    c.add_argument("cache", help="the cache folder to copy")
    c.add_argument("dest", help="the folder to copy it to (created, or a cache it replaces)")
    c.set_defaults(func=_cmd_copy)

    pl = cmds.command(
        "plan", "how big a cache would be under each resize policy (reads headers only)"
    )
    _add_source(pl)
    pl.add_argument("cache", nargs="?", help="cache folder a build would write (for free space)")
    _add_preprocessing(pl)
    pl.set_defaults(func=_cmd_plan, quiet=False)


def _add_demo(cmds: _Commands) -> None:
    d = cmds.command("demo", "generate images, build a cache, compare epoch times")
    d.add_argument(
        "--images", type=_positive, default=1000, help="images to generate (default 1000)"
    )
    d.add_argument(
        "--image-size",
        type=_height_width,
        default=(480, 720),  # (height, width), as run_demo takes it
        metavar="WxH",
        help="their size (default 720x480)",
    )
    d.add_argument("--epochs", type=_positive, default=3, help="epochs per method (default 3)")
    d.add_argument("--batch-size", type=_positive, default=64, help="batch size (default 64)")
    d.add_argument(
        "--workers", type=_non_negative, default=2, help="DataLoader workers (default 2)"
    )
    d.add_argument("--workdir", help="keep the images and cache here (default: a temp folder)")
    d.set_defaults(func=_cmd_demo, quiet=False)


def _add_cache_tools(cmds: _Commands) -> None:
    i = cmds.cache_command(
        "info", _cmd_info, "describe a cache and how much of it is in RAM", quiet_flag=False
    )
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument(
        "--source-check",
        choices=("quick", "full"),
        default="quick",
        help="quick (default): the source counts as unchanged while its folders' mtimes are "
        "those of the build (a file rewritten in place is not seen); full: stat every file",
    )

    w = cmds.cache_command(
        "warm", _cmd_warm, "read a cache into the page cache, within a memory budget"
    )
    w.add_argument(
        "--max-memory",
        type=_budget,
        default=DEFAULT_MAX_MEMORY,
        metavar="BUDGET",
        help="stop before memory used by processes plus the cache would pass this: a share "
        "of RAM (90%%) or a size (8G) (default " + DEFAULT_MAX_MEMORY.replace("%", "%%") + ")",
    )
    cmds.cache_command(
        "compact", _cmd_compact, "drop the garbage refreshes left in a cache's data file"
    )
    cmds.cache_command("evict", _cmd_evict, "drop a cache's pages from the page cache")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    for stream in (sys.stdout, sys.stderr):
        # A file name that is not UTF-8 (its bytes kept as surrogate escapes) prints as \xNN.
        with suppress(AttributeError, ValueError):
            # a TextIOWrapper unless replaced: one without reconfigure raises AttributeError
            cast(io.TextIOWrapper, stream).reconfigure(errors=_ESCAPE)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "mask", None) and not args.masks:
        print("mmcache: error: --mask-dtype needs --masks MASKS", file=sys.stderr)
        return 2
    if getattr(args, "pixels", "rgb") != "rgb" and getattr(args, "color", None) == "gray":
        print(
            f"mmcache: error: --pixels {args.pixels} stores colour (luma and half-size chroma) "
            "and --color gray has none: build gray caches without --pixels",
            file=sys.stderr,
        )
        return 2
    try:
        with _notes_shown(args.quiet):
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        # The Python documentation's recipe (library/signal, "Note on SIGPIPE"): point stdout
        # at devnull, so the interpreter's own flush at exit finds nothing to complain about.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except CacheError as e:
        print(f"mmcache: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mmcache: interrupted", file=sys.stderr)
        return 130


# Control characters (C0, DEL, C1) as a Python string literal writes them: \n, \t, \x1b.
_CONTROL = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}


def _one_line(text: object) -> str:
    """A path (or other text from outside: a decoder's reason, an error) as it is printed for a
    person: on one line, a newline or escape sequence in a file name shown as ``\\n`` or
    ``\\x1b`` rather than acted on. Undecodable bytes are left to the stream, which writes them
    as ``\\xNN`` (``_escape_bytes``)."""
    return str(text).translate(_CONTROL)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _json(value: object) -> str:
    """``value`` as JSON that stays JSON for any file name. Names are ``os.fsdecode`` strings,
    whose undecodable bytes are lone surrogates (byte 0xfe is U+DCFE): they are written as the
    JSON escape ``\\udcfe``, which every JSON parser accepts, and ``os.fsencode`` of the parsed
    string gives back the name's bytes. Other characters are written as they are (UTF-8)."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _escape_bytes(error: UnicodeError) -> tuple[str, int]:
    """Write a surrogate-escaped byte as ``\\xNN``, any other unencodable character as
    ``\\uNNNN``."""
    if not isinstance(error, UnicodeEncodeError):  # registered for the output streams only
        raise error
    chars = error.object[error.start : error.end]
    text = "".join(
        f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"\\u{ord(c):04x}"
        for c in chars
    )
    return text, error.end


_ESCAPE = "mmcache-escape"
codecs.register_error(_ESCAPE, _escape_bytes)
