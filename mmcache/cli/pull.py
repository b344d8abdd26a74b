"""``mmcache pull``: copy a cache from object storage to a local folder, every record checked."""

from __future__ import annotations

import argparse

from .._feedback import count, human_bytes
from ..remote import pull_cache
from ._shared import Commands, Progress, one_line


def add(cmds: Commands) -> None:
    c = cmds.command(
        "pull", "copy a cache from object storage to a local folder, every record checked",
        parents=[cmds.quiet],
    )  # fmt: skip
    c.add_argument("url", help="where it was pushed: s3://bucket/prefix or file:///folder")
    c.add_argument("cache", help="the local folder (created, or a cache it replaces)")
    c.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bar = Progress("pulling", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        r = pull_cache(args.url, args.cache, progress=bar, concurrency=args.concurrency)
    finally:
        bar.close()
    if args.quiet:
        return 0
    head = f"{one_line(r.dest)}: {count(r.images, 'image')}, {human_bytes(r.bytes)}"
    if r.up_to_date:
        print(f"{head}; up to date with {one_line(r.url)}")
    else:
        print(
            f"{head}; {human_bytes(r.fetched)} fetched ({count(r.fetched_records, 'record')}, "
            f"{r.present:,} already here), {r.seconds:.1f} s, "
            f"{human_bytes(r.bytes_per_second)}/s; every record checked"
        )
    return 0
