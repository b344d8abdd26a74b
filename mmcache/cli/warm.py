"""``mmcache warm``: read a cache into the page cache within a memory budget, and say how much."""

from __future__ import annotations

import argparse

from .._feedback import human_bytes
from ..residency import DEFAULT_MAX_MEMORY, parse_memory, warm_cache
from ._shared import Commands, Progress, one_line, share


def add(cmds: Commands) -> None:
    w = cmds.cache_command("warm", run, "read a cache into the page cache, within a memory budget")
    w.add_argument(
        "--max-memory",
        type=_budget,
        default=DEFAULT_MAX_MEMORY,
        metavar="BUDGET",
        help="stop before memory used by processes plus the cache would pass this: a share "
        "of RAM (90%%) or a size (8G) (default " + DEFAULT_MAX_MEMORY.replace("%", "%%") + ")",
    )


def _budget(text: str) -> str:
    """argparse type of ``--max-memory``: a share of RAM or a size, checked now."""

    try:
        parse_memory(text, 1 << 40)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def run(args: argparse.Namespace) -> int:

    bar = Progress("warming", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        report = warm_cache(args.cache, max_memory=args.max_memory, progress=bar)
    finally:
        bar.close()
    if args.quiet:
        return 0
    print(
        f"{one_line(report.cache)}: {share(report.resident_after, report.data_bytes)} resident "
        f"(was {share(report.resident_before, report.data_bytes)}), "
        f"{human_bytes(report.read_bytes)} read in {report.seconds:.1f} s"
        + (
            f"; stopped at the memory budget of {human_bytes(report.budget_bytes)}"
            if report.stopped_by_budget
            else ""
        )
    )
    return 0
