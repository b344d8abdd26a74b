"""``mmcache info``: describe a cache and how much of it is in RAM, as text or JSON."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from .. import pixels as px
from .._feedback import count, human_bytes
from .._staleness import SOURCE_CHECKS
from ..remote import is_remote, remote_info
from ..residency import cache_info
from ._shared import Commands, garbage, one_line, share, skipped_lines


def add(cmds: Commands) -> None:
    i = cmds.cache_command(
        "info", run, "describe a cache and how much of it is in RAM", quiet_flag=False
    )
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument(
        "--source-check",
        choices=SOURCE_CHECKS,
        default="quick",
        help="quick (default): the source counts as unchanged while its folders' mtimes are "
        "those of the build (a file rewritten in place is not seen); full: stat every file",
    )


def run(args: argparse.Namespace) -> int:
    if is_remote(args.cache):
        return _remote(args)
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
        source = f"changed: {one_line(info.stale)}"
    elif not info.source_found:
        source = f"not found at {one_line(info.source)}, so not compared"
    else:
        source = f"{one_line(info.source)}, unchanged"
    options = ", ".join(f"{k}={v}" for k, v in info.options.items() if v is not None)
    ram = "cgroup limit" if info.cgroup_limited else "RAM"
    lines = [
        f"cache:      {one_line(info.cache)}",
        f"format:     {info.format_version[0]}.{info.format_version[1]}, {info.mode} mode, "
        f"generation {info.generation}",
        f"pixels:     {_layout_words(info.options.get('pixels', 'rgb'))}",
        *(
            [f"annotated:  {_annotation_words(info.annotations, info.source_paired)}"]
            if info.annotations
            else []
        ),
        *([f"copy of:    {one_line(info.origin)} (records fetched as they are read)"]
          if info.origin else []),  # fmt: skip
        f"images:     {info.images:,} ({info.filled:,} filled), "
        f"{count(len(info.classes), 'class', 'classes')}, {len(info.skipped):,} skipped, "
        f"{count(len(info.warnings), 'warning')}",
        f"sizes:      {sizes}",
        f"options:    {options}",
        f"data:       {human_bytes(info.data_bytes)} ({human_bytes(info.disk_bytes)} on disk, "
        f"{human_bytes(info.apparent_bytes)} apparent, all files)",
        f"live:       {human_bytes(info.live_bytes)} of records; "
        f"{garbage(info.garbage_bytes, info.data_bytes)} (`mmcache compact` drops it)",
        f"resident:   {share(info.resident_bytes, info.data_bytes)} of the data in the page cache",
        f"memory:     {human_bytes(info.ram_total)} {ram}, "
        f"{human_bytes(info.ram_available)} available",
        f"source:     {source}",
    ]
    lines += ["  " + line for line in skipped_lines(info.skipped)]
    lines += [
        f"  warning {one_line(w['path'])}: {one_line(w['reason'])}" for w in info.warnings[:5]
    ]
    if len(info.warnings) > 5:
        lines.append(f"  ... and {len(info.warnings) - 5} more warnings (see manifest.json)")
    print("\n".join(lines))
    return 0


def _remote(args: argparse.Namespace) -> int:
    """``mmcache info URL``: what ``remote.json`` says, without pulling anything."""
    r = remote_info(args.cache)
    if args.json:
        print(_json(r.to_json()))
        return 0
    options = ", ".join(f"{k}={v}" for k, v in r.options.items() if v is not None)
    print(
        f"cache:      {one_line(r.url)} (published)\n"
        f"format:     {r.format_version[0]}.{r.format_version[1]}, {r.mode} mode, "
        f"generation {r.generation}\n"
        f"images:     {r.images:,}, {count(len(r.classes), 'class', 'classes')}, "
        f"{r.skipped:,} skipped\n"
        f"options:    {options}\n"
        f"data:       {human_bytes(r.bytes)} in {count(r.chunks, 'chunk')} of "
        f"{human_bytes(r.chunk_bytes)} and the index files\n"
        f"source:     {one_line(str(r.source.get('root', '')))} (where it was built)"
    )
    return 0


def _annotation_words(annotations: dict[str, Any], paired: dict[str, str]) -> str:
    """What records carry besides pixels, for ``info``: ``mask (uint8, from MASKS); boxes,
    labels (3 classes), iscrowd (from COCO)``."""
    words = []
    if "mask" in annotations:
        where = f", from {one_line(paired['masks'])}" if "masks" in paired else ""
        words.append(f"mask ({annotations['mask']}{where})")
    fields = []
    for name, spec in annotations.items():
        if name != "mask":
            classes = spec.get("classes")
            fields.append(f"{name} ({count(len(classes), 'class', 'classes')})" if classes
                          else name)  # fmt: skip
    if fields:
        where = f" (from {one_line(paired['coco'])})" if "coco" in paired else ""
        words.append(", ".join(fields) + where)
    return "; ".join(words)


def _layout_words(layout: str) -> str:
    """How ``info`` names a record layout."""
    return px.layout_named(layout).words if px.known(layout) else f"{layout} (H x W x C)"


_SURROGATE = re.compile("[\ud800-\udfff]")


def _json(value: object) -> str:
    """``value`` as JSON that stays JSON for any file name. Names are ``os.fsdecode`` strings,
    whose undecodable bytes are lone surrogates (byte 0xfe is U+DCFE): they are written as the
    JSON escape ``\\udcfe``, which every JSON parser accepts, and ``os.fsencode`` of the parsed
    string gives back the name's bytes. Other characters are written as they are (UTF-8)."""
    text = json.dumps(value, indent=1, ensure_ascii=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
