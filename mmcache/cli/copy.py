"""``mmcache copy``: copy a cache to another disk, verified, and print the copy's report."""

from __future__ import annotations

import argparse

from .._feedback import count, human_bytes
from ..copying import copy_cache
from ._shared import Commands, Progress, one_line


def add(cmds: Commands) -> None:
    c = cmds.command(
        "copy", "copy a cache (to a node's local disk) and verify the copy", parents=[cmds.quiet]
    )
    c.add_argument("cache", help="the cache folder to copy")
    c.add_argument("dest", help="the folder to copy it to (created, or a cache it replaces)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:

    bar = Progress("copying", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        report = copy_cache(args.cache, args.dest, progress=bar)
    finally:
        bar.close()
    if args.quiet:
        return 0
    print(
        f"{one_line(report.dest)}: {count(report.images, 'image')}, {human_bytes(report.bytes)} "
        f"({human_bytes(report.copied)} copied, holes skipped), {report.seconds:.1f} s, "
        f"{human_bytes(report.bytes_per_second)}/s; {report.verified:,} records verified"
    )
    return 0
