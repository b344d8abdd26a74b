"""``mmcache evict``: drop a cache's pages from the page cache, and say what stays resident."""

from __future__ import annotations

import argparse

from .._feedback import human_bytes
from ..residency import evict_cache
from ._shared import Commands, one_line


def add(cmds: Commands) -> None:
    cmds.cache_command("evict", run, "drop a cache's pages from the page cache")


def run(args: argparse.Namespace) -> int:

    after = evict_cache(args.cache)
    if after is None:
        status = "evicted (how much stays resident is unknown here: no mincore)"
    elif after == 0:
        status = "evicted, none of the data is in the page cache"
    else:
        status = f"{human_bytes(after)} of the data stays resident (mapped by a running process?)"
    if not args.quiet:
        print(f"{one_line(args.cache)}: {status}")
    return 0
