"""``mmcache build``: decode a source into a cache, and print what the build did."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .._feedback import count, human_bytes
from .._session import COMPACT_AT, DIST_TIMEOUT
from ..build import build_cache
from ..decode import TRUNCATED
from ..errors import DistributedBuildError
from ..options import OPTION_FLAGS
from ..reports import BuildReport
from ._shared import (
    Commands,
    Progress,
    add_option,
    add_preprocessing,
    add_source,
    first_few,
    garbage,
    non_negative,
    one_line,
    positive_seconds,
    preprocessing_kwargs,
    share_arg,
    skipped_lines,
    source_of,
)
from .plan import run as run_plan


def add(cmds: Commands) -> None:
    b = cmds.command("build", "decode a source folder or list into a cache", parents=[cmds.quiet])
    add_source(b)
    b.add_argument("cache", help="cache folder to create or update")
    add_preprocessing(b)
    b.add_argument(
        "--workers",
        type=non_negative,
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
        type=share_arg,
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
    add_option(b, next(spec for spec in OPTION_FLAGS if spec.name == "mask"))
    b.add_argument(
        "--coco",
        metavar="JSON",
        help="COCO detection annotations (instances.json): each image's boxes, labels and "
        "crowd flags, stored in the stored image's pixels",
    )
    b.add_argument(
        "--dist-timeout",
        type=positive_seconds,
        default=DIST_TIMEOUT,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for the others before the build fails "
        f"(default {DIST_TIMEOUT:g})",
    )
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return run_plan(args)
    # torchrun sets WORLD_SIZE and RANK: then every rank runs this and they build together.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ..distributed import torchrun_process_group

        rank = int(os.environ.get("RANK", "0"))
        with torchrun_process_group(args.dist_timeout), _sigterm_fails(rank):
            return _run_build(args, rank, "decoding (rank 0's share)")
    return _run_build(args, 0, "decoding")


def _run_build(args: argparse.Namespace, rank: int, desc: str) -> int:
    # One bar: several ranks' bars would garble the terminal.
    bar = Progress(desc, quiet=args.quiet) if rank == 0 else None
    try:
        settings = (
            "workers", "strict", "force", "trust_decoder", "replace", "source_moved", "compact_at",
        )  # fmt: skip
        report = build_cache(
            source_of(args),
            args.cache,
            progress=bar,
            masks=args.masks,
            coco=args.coco,
            **{name: getattr(args, name) for name in (*settings, "dist_timeout")},
            **preprocessing_kwargs(args),
            **({"mask": args.mask} if args.mask else {}),
        )
    finally:
        if bar is not None:
            bar.close()
    if rank == 0 and not args.quiet:
        print_build(report, print)
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


def print_build(report: BuildReport, out: Callable[[str], None]) -> None:
    for folder in report.ignored:
        out(f"  ignored {one_line(folder)}/ in the source: it holds an mmcache cache")
    if report.other_files:
        out(f"  {_ignored_files(report.other_files)}")
    images = count(report.images, "image")
    pending = f", {count(report.pending, 'record')} to fill on first read" if report.pending else ""
    if report.up_to_date:
        # What the build that made it skipped, it said: counted here, listed by `mmcache info`.
        left = f"; {len(report.skipped):,} skipped, see `mmcache info`" if report.skipped else ""
        out(f"{one_line(report.cache)}: up to date ({images}{pending}; nothing decoded{left})")
    else:
        out(
            f"{one_line(report.cache)}: {images} in {count(report.classes, 'class', 'classes')}, "
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
            wrote += f"; {garbage(report.garbage_bytes, report.bytes)}"
        out(wrote)
    if report.compaction_deferred:
        out(f"  not compacted: {report.compaction_deferred}")
    if not report.up_to_date:
        for line in skipped_lines(report.skipped):
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
        out(f"  warning {one_line(w['path'])}: {one_line(w['reason'])}")
    if len(report.warnings) > 5:
        out(f"  ... {len(report.warnings) - 5:,} more warnings (see manifest.json)")


def _ignored_files(by_extension: dict[str, int], most: int = 5) -> str:
    """``"5 files ignored (not images): .txt (3), .xml (2)"``, the commonest extensions."""
    shown = [f"{ext or '(no extension)'} ({n})" for ext, n in list(by_extension.items())[:most]]
    more = ", ..." if len(by_extension) > most else ""
    total = count(sum(by_extension.values()), "file")
    return f"{total} ignored (not images by their extension): {', '.join(shown)}{more}"


def _unpaired_lines(report: BuildReport) -> list[str]:
    """What of the COCO file a build left out for want of its image, one line each."""
    lines = []
    if report.coco_missing:
        lines.append(
            f"{count(len(report.coco_missing), 'image')} of the COCO file not in the source, "
            f"left out: {first_few(report.coco_missing)}"
        )
    if report.coco_orphans:
        lines.append(
            f"{count(report.coco_orphans, 'COCO annotation')} of image ids the file does not "
            f"list, left out: ids {first_few(report.coco_unknown_ids)}"
        )
    return lines
