"""Epoch throughput when the cache is larger than RAM: a memory-limited cgroup, four loaders.

Run as root (a memory cgroup is made and torn down)::

    python tools/larger_than_ram.py --workdir /var/tmp/ltr            # 2 GB of 720x480 records
    python tools/larger_than_ram.py --workdir /tmp/ltr --gb 0.4 --epochs 2   # a quick run

It generates photo-like JPEGs (kept in --workdir for the next run), builds a cache of them, then
for each row spawns a measuring process inside a child memory cgroup. The group's limit caps
the processes' own memory and the page cache they fill together, so each row is first run for
a few untimed batches in the group without a limit to learn what its processes hold (Python,
torch, the DataLoader workers and the batches in flight in shared memory: several hundred MB);
the timed run then gets a limit of that plus ``--limit-ratio`` (default half) of the cache
size, which is what is left for the page cache. Before each run the source files and the cache
are evicted from the page cache (and, if allowed, ``/proc/sys/vm/drop_caches`` is written).
Rows:

- ``decode``: decode the JPEGs every epoch (``DecodingDataset``), random order;
- ``random``: mmcache with a random order (``RandomSampler``);
- ``quasi``: mmcache with ``QuasiRandomSampler``;
- ``warm``: ``warm_cache`` inside the group (it stops at the group's limit), then a random order.

It prints a Markdown table of images per second per epoch. cgroup v1
(``/sys/fs/cgroup/memory``) and v2 (``memory.max``) are both handled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mmcache

ROWS = {
    "decode": "decode every epoch",
    "random": "mmcache, random order",
    "quasi": "mmcache, QuasiRandomSampler",
    "warm": "mmcache after `warm`, random order",
    # Not run by default: how much the sampler's read-ahead of the next buffer is worth.
    "quasi-noprefetch": "mmcache, QuasiRandomSampler without prefetch",
}
DEFAULT_ROWS = "decode,random,quasi,warm"


# the measuring process -----------------------------------------------------------------------


def measure(args: argparse.Namespace) -> None:
    """Run the epochs of one row in this (already confined) process; print one JSON line."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from mmcache import BatchLoader, MemmapImageDataset, QuasiRandomSampler, warm_cache
    from mmcache.demo import DecodingDataset

    torch.set_num_threads(1)
    cache = Path(args.workdir) / "cache"
    ds = MemmapImageDataset(cache, on_stale="ignore")
    warm_report = None
    if args.measure == "decode":
        ds = DecodingDataset(ds.samples)
    if args.measure == "warm":
        warm_report = warm_cache(cache)
    if args.measure.startswith("quasi"):
        sampler = QuasiRandomSampler(
            ds,
            block_size=args.block_size,
            buffer_blocks=args.buffer_blocks,
            seed=0,
            prefetch=args.measure == "quasi",
        )
    else:
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    if args.loader == "batch" and args.measure != "decode":
        loader = BatchLoader(ds, args.batch_size, sampler=sampler, num_threads=args.workers)
    else:
        loader = DataLoader(
            ds,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        )
    if args.calibrate:
        # The processes' own memory at its peak over a few batches: rss and shared memory of
        # the group (file pages are what the limit is there to squeeze).
        peak = 0
        for k, _batch in enumerate(loader):
            peak = max(peak, _group_memory())
            if k >= 4 * max(1, args.workers) + 4:
                break
        print(json.dumps({"row": args.measure, "overhead": peak}), flush=True)
        return
    seconds = []
    for epoch in range(args.epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        start = time.perf_counter()
        for _images, _labels in loader:
            pass
        seconds.append(time.perf_counter() - start)
    out = {"row": args.measure, "images": len(ds), "seconds": seconds}
    if isinstance(sampler, QuasiRandomSampler):
        out["block_size"], out["buffer_blocks"] = sampler.block_size, sampler.buffer_blocks
    if warm_report is not None:
        out["warm_share"] = warm_report.resident_share
        out["warm_seconds"] = warm_report.seconds
    print(json.dumps(out), flush=True)


def _group_memory() -> int:
    """rss + shared memory of this process's memory cgroup (v1 or v2), in bytes."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder, keys = Path("/sys/fs/cgroup/memory"), ("total_rss", "total_shmem")
        elif controllers == "":
            folder, keys = Path("/sys/fs/cgroup"), ("anon", "shmem")
        else:
            continue
        stat = folder / path.lstrip("/") / "memory.stat"
        if stat.exists():
            values = dict(ln.split() for ln in stat.read_text().splitlines())
            return sum(int(values.get(k, 0)) for k in keys)
    return 0


# the parent: data, cgroup, rows --------------------------------------------------------------


def prepare(workdir: Path, gb: float, size: tuple[int, int]) -> tuple[Path, int]:
    """Source JPEGs and a cache of about ``gb`` GB of records; reused when already there."""
    from mmcache import build_cache
    from mmcache.sample_data import make_image_folder

    per_image = size[0] * size[1] * 3
    count = max(10, int(gb * 1e9 / per_image))
    classes = 10
    per_class = -(-count // classes)
    src = workdir / "src"
    stamp = workdir / "src.json"
    want = {"classes": classes, "per_class": per_class, "size": list(size)}
    if not stamp.exists() or json.loads(stamp.read_text()) != want:
        print(f"generating {classes * per_class} JPEGs of {size[0]}x{size[1]} ...", flush=True)
        make_image_folder(src, classes=classes, per_class=per_class, size=size)
        stamp.write_text(json.dumps(want))
    report = build_cache(src, workdir / "cache")
    return src, report.bytes


class Cgroup:
    """A child memory cgroup of this process's own group, with a limit; removed on exit."""

    def __init__(self) -> None:
        line = next(
            (
                ln
                for ln in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in ln.split(":")[1].split(",") or ln.startswith("0::")
            ),
            None,
        )
        if line is None:
            sys.exit("no memory cgroup for this process")
        v1 = Path("/sys/fs/cgroup/memory")
        own = line.split(":", 2)[2].lstrip("/")
        if v1.is_dir():
            base, limit_file = v1, "memory.limit_in_bytes"
        else:
            base, limit_file = Path("/sys/fs/cgroup"), "memory.max"
        parent = base / own if (base / own).is_dir() else base
        self.path = parent / f"mmcache-ltr-{os.getpid()}"
        self.limit_file = self.path / limit_file
        self.unlimited = "-1" if v1.is_dir() else "max"
        try:
            self.path.mkdir()
        except OSError as e:
            sys.exit(f"cannot make a memory cgroup at {self.path} ({e}); run as root")
        self.procs = self.path / "cgroup.procs"

    def set_limit(self, limit: int | None) -> None:
        self.limit_file.write_text(self.unlimited if limit is None else str(limit))

    def enter(self) -> None:
        """Move the calling process into the group (a Popen preexec_fn: runs in the child)."""
        self.procs.write_text(str(os.getpid()))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def drop_caches(paths: list[Path]) -> None:
    from mmcache.residency import evict_file

    for p in paths:
        evict_file(p)
    # In a container this is refused: the per-file eviction above is what we have.
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/var/tmp/mmcache-larger-than-ram")
    p.add_argument("--gb", type=float, default=2.0, help="cache size in GB (default 2)")
    p.add_argument("--image-size", default="720x480", metavar="WxH")
    p.add_argument("--limit-ratio", type=float, default=0.5, help="cgroup limit / cache size")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--loader",
        choices=("dataloader", "batch"),
        default="dataloader",
        help="how the mmcache rows read: DataLoader with --workers processes, or BatchLoader "
        "with --workers threads (records of one shape); the decode row always uses DataLoader",
    )
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--block-size", type=int, default=None, help="QuasiRandomSampler's")
    p.add_argument("--buffer-blocks", type=int, default=32, help="QuasiRandomSampler's")
    p.add_argument("--measure", choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(args)
        return

    from mmcache.decode import parse_size

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src, cache_bytes = prepare(workdir, args.gb, parse_size(args.image_size))
    allowance = int(cache_bytes * args.limit_ratio)
    files = [q for q in src.rglob("*") if q.is_file()] + list((workdir / "cache").iterdir())
    group = Cgroup()
    results = []

    def child(row: str, extra: list[str]) -> dict:
        drop_caches(files)
        cmd = [sys.executable, __file__, *sys.argv[1:], "--measure", row, *extra]
        run = subprocess.run(
            cmd, preexec_fn=group.enter, capture_output=True, text=True, check=False
        )
        if run.returncode != 0:
            sys.exit(f"{row} failed (exit status {run.returncode}):\n{run.stderr}")
        return json.loads(run.stdout.strip().splitlines()[-1])

    try:
        for row in args.rows.split(","):
            group.set_limit(None)
            overhead = child(row, ["--calibrate"])["overhead"]
            # 10% + 32 MiB over the peak seen: batches in flight vary a little.
            limit = int(overhead * 1.1) + (32 << 20) + allowance
            group.set_limit(limit)
            results.append(child(row, []) | {"overhead": overhead, "limit": limit})
            print(f"  {row}: {results[-1]}", file=sys.stderr, flush=True)
    finally:
        group.close()

    mb = 1e6
    print(
        f"\ncache {cache_bytes / mb:,.0f} MB ({results[0]['images']} images of "
        f"{args.image_size}); page cache allowed {allowance / mb:,.0f} MB (cgroup limit = "
        f"that + the loader's own memory); batch {args.batch_size}, {args.workers} workers, "
        f"{os.cpu_count()} cores; mmcache rows read by "
        f"{'BatchLoader' if args.loader == 'batch' else 'DataLoader'}\n"
    )
    epochs = args.epochs
    head = " | ".join(f"epoch {e + 1} img/s" for e in range(epochs))
    print(f"| loader | {head} | vs random (last epoch) |")
    print("|---|" + "---:|" * (epochs + 1))
    rate = {r["row"]: [r["images"] / s for s in r["seconds"]] for r in results}
    for r in results:
        rates = rate[r["row"]]
        vs = f"{rates[-1] / rate['random'][-1]:.2f}x" if "random" in rate else "-"
        name = ROWS[r["row"]]
        if "block_size" in r:
            name += f" (blocks of {r['block_size']}, buffer {r['buffer_blocks']})"
        if "warm_share" in r:
            name += f" (warmed {r['warm_share']:.0%} in {r['warm_seconds']:.1f} s)"
        name += f" [own memory {r['overhead'] / mb:,.0f} MB]"
        print(f"| {name} | " + " | ".join(f"{x:,.0f}" for x in rates) + f" | {vs} |")


if __name__ == "__main__":
    main()
