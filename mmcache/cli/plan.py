"""``mmcache plan``: a cache's size under each resize policy, printed as a table."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .._feedback import human_bytes
from ..plan import plan_cache
from ._shared import (
    Commands,
    Progress,
    add_preprocessing,
    add_source,
    one_line,
    preprocessing_kwargs,
    source_of,
)


def add(cmds: Commands) -> None:
    pl = cmds.command(
        "plan", "how big a cache would be under each resize policy (reads headers only)"
    )
    add_source(pl)
    pl.add_argument("cache", nargs="?", help="cache folder a build would write (for free space)")
    add_preprocessing(pl)
    pl.set_defaults(func=run, quiet=False)


def run(args: argparse.Namespace) -> int:

    bar = Progress("reading headers", unit="file", delay=0.5)
    try:
        # build --dry-run --masks: records with masks (their bytes counted; not checked here)
        masked = getattr(args, "masks", None) is not None
        mask = {"mask": args.mask or "uint8"} if masked else {}
        plan = plan_cache(
            source_of(args), args.cache, progress=bar, **preprocessing_kwargs(args), **mask
        )
    finally:
        bar.close()
    _print_plan(plan, print)
    return 0


def _print_plan(plan, out: Callable[[str], None]) -> None:
    """``plan`` (a ``mmcache.plan.CachePlan``) as a table a person reads before building."""
    out(f"source       {one_line(plan.source)}")
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
            f"destination  {one_line(plan.cache)}: {human_bytes(plan.free_bytes)} free on the "
            f"filesystem of {one_line(plan.destination)}; this build needs "
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
