"""``mmcache verify``: check a cache's records (and repair them), and print what was found."""

from __future__ import annotations

import argparse

from .._feedback import count, human_bytes
from ..verify import SOURCE_MODES, repair_cache, verify_cache
from ._shared import Commands, Progress, non_negative, one_line


def add(cmds: Commands) -> None:
    v = cmds.cache_command(
        "verify", run, "check every record's checksum (and pixels vs the source)"
    )
    v.add_argument(
        "--source",
        nargs="?",
        const="sample",
        choices=[mode for mode in SOURCE_MODES if mode],
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
        type=non_negative,
        default=None,
        metavar="N",
        help="with --repair: decode processes (default: one per core)",
    )


def run(args: argparse.Namespace) -> int:

    bar = Progress("verifying", unit="rec", quiet=args.quiet)
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
        print(f"  bad record {b.index} {one_line(b.path)}: {one_line(b.what)}")
    if len(report.bad) > 50:
        print(f"  ... and {len(report.bad) - 50} more bad records")
    print(
        f"{one_line(report.cache)}: {report.checked:,} of {report.records:,} records checked "
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
            f"  `mmcache verify {one_line(report.cache)} --repair` decodes the bad records again "
            "from the source the cache was built from"
        )
    return 0 if report.ok else 1


def _print_repair(report) -> int:
    """``report`` (a ``mmcache.verify.RepairReport``) after the verification lines; the exit
    status: 0 when the cache is sound now."""
    for b in report.unrepaired[:50]:
        print(f"  not repaired: record {b.index} {one_line(b.path)}: {one_line(b.what)}")
    if report.repaired:
        print(
            f"{one_line(report.cache)}: {count(len(report.repaired), 'bad record')} repaired: "
            f"decoded again from {one_line(report.source)}, published as generation "
            f"{report.generation}"
        )
    if report.unrepaired:
        print(
            f"{one_line(report.cache)}: {count(len(report.unrepaired), 'bad record')} left as "
            "they were: their source files vanished, changed since the build or no longer "
            f"decode. `mmcache build {one_line(report.source)} {one_line(report.cache)}` with "
            "the options the cache was made with refreshes changed and vanished files; else "
            "delete and rebuild it"
        )
    return 0 if report.ok else 1
