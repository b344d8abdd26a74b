"""``mmcache push``: publish a cache under an object-store prefix, and print what was sent."""

from __future__ import annotations

import argparse

from .._feedback import count, human_bytes
from ..remote import push_cache
from ._shared import Commands, Progress, one_line


def add(cmds: Commands) -> None:
    c = cmds.command(
        "push", "publish a cache in object storage (only what changed is sent)",
        parents=[cmds.quiet],
    )  # fmt: skip
    c.add_argument("cache", help="the cache folder to publish")
    c.add_argument("url", help="where: s3://bucket/prefix or file:///folder")
    c.add_argument("--concurrency", type=int, default=8, help="uploads in flight (default 8)")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bar = Progress("pushing", unit="B", unit_scale=True, quiet=args.quiet)
    try:
        r = push_cache(args.cache, args.url, progress=bar, concurrency=args.concurrency)
    finally:
        bar.close()
    if not args.quiet:
        print(
            f"{one_line(r.url)}: {count(r.images, 'image')}, {human_bytes(r.bytes)}; "
            f"{human_bytes(r.uploaded)} sent in {count(r.objects_uploaded, 'object')} "
            f"({r.objects_kept:,} already there), {r.seconds:.1f} s"
        )
    return 0
