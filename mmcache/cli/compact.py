"""``mmcache compact``: drop the garbage refreshes left in a cache's data file."""

from __future__ import annotations

import argparse

from .._feedback import count, human_bytes
from ..build import compact_cache
from ._shared import Commands, one_line


def add(cmds: Commands) -> None:
    cmds.cache_command("compact", run, "drop the garbage refreshes left in a cache's data file")


def run(args: argparse.Namespace) -> int:

    report = compact_cache(args.cache)
    if not args.quiet:
        print(
            f"{one_line(report.cache)}: compacted in {report.seconds:.1f} s: "
            f"{human_bytes(report.dropped_garbage)} of garbage dropped, the data file is now "
            f"{human_bytes(report.bytes)} ({count(report.images, 'image')})"
        )
    return 0
