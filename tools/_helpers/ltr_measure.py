"""The measuring side of tools/larger_than_ram.py: one row's epochs, or the throttle check.

These run in a child process the parent started inside its memory and blkio cgroups
(``larger_than_ram.py --measure ROW`` or ``--check-file FILE``); each prints one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path


def cache_name(loader: str, yuv420: bool = False) -> str:
    """The folder, in --workdir, of the cache that ``loader``'s rows read."""
    return ("cache-256" if loader == "crop" else "cache-224") + ("-yuv420" if yuv420 else "")


def measure(args: argparse.Namespace) -> None:
    """Run one row's epochs in this (already confined) process; print one JSON line."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from mmcache import (
        BatchLoader,
        Compose,
        MemmapImageDataset,
        Options,
        QuasiRandomSampler,
        RandomHorizontalFlip,
        RandomResizedCrop,
        warm_cache,
    )
    from mmcache.demo import DecodingDataset
    from mmcache.residency import memory, resident_bytes

    torch.set_num_threads(1)
    row, kind = args.measure, args.loader
    cache = Path(args.workdir) / cache_name(kind, yuv420=row == "yuv420")
    ds = MemmapImageDataset(cache, on_stale="ignore")
    out: dict = {"row": row, "loader": kind, "images": len(ds)}
    if row == "warm":
        report = warm_cache(cache)
        out["warm_share"], out["warm_seconds"] = report.resident_share, report.seconds
    sampler = None
    if row.startswith("quasi"):
        sampler = QuasiRandomSampler(
            ds,
            block_size=args.block_size,
            buffer_blocks=args.buffer_blocks,
            seed=0,
            prefetch=row == "quasi",
        )
        out["block_size"], out["buffer_blocks"] = sampler.block_size, sampler.buffer_blocks
    if row == "decode":
        if kind == "crop":
            crop = Compose([RandomResizedCrop(224), RandomHorizontalFlip()])
            ds = DecodingDataset(ds.samples, transform=crop)
        else:
            ds = DecodingDataset(ds.samples, Options(size=(224, 224)))
    if kind == "dataloader" or row == "decode":
        if sampler is None:
            sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(0))
        loader = DataLoader(
            ds,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        )
    else:
        crop = {"crop": RandomResizedCrop(224), "flip": True} if kind == "crop" else {}
        loader = BatchLoader(
            ds,
            args.batch_size,
            shuffle=sampler is None,
            sampler=sampler,
            seed=0,
            num_threads=args.workers,
            read=args.read,
            **crop,
        )
        out["read"] = args.read
        out["available"] = memory().available
        out["data_bytes"] = ds.manifest.sizes["data"]
    if args.calibrate:
        # The processes' own memory at its peak over a few batches: anonymous and shared memory
        # of the group (file pages are what the limit is there to squeeze).
        peak = 0
        for k, _batch in enumerate(loader):
            peak = max(peak, _group_memory())
            if k >= 4 * max(1, args.workers) + 4:
                break
        print(json.dumps({"overhead": peak}), flush=True)
        return
    # The cache's bytes in RAM as each epoch starts: what the epoch can find there.
    ds_data = None if row == "decode" else ds.reader.data_path
    epochs = []
    for epoch in range(args.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)  # BatchLoader: forwarded to its sampler
        elif hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        resident = resident_bytes(ds_data) or 0 if ds_data else 0
        before = _counters(args.blkio_group)
        start = time.perf_counter()
        done, partial = 0, False
        for _images, labels in loader:
            done += len(labels)
            # Decoding rows run whole: they are the baseline every ratio is taken against.
            if row != "decode" and time.perf_counter() - start > args.max_epoch_seconds:
                partial = True
                break
        seconds = time.perf_counter() - start
        after = _counters(args.blkio_group)
        epochs.append(
            {
                "seconds": seconds,
                "images": done,
                "partial": partial,
                **{k: after[k] - before[k] for k in ("read_bytes", "reads", "cpu")},
                "resident_at_start": resident,
            }
        )
    print(json.dumps(out | {"epochs": epochs}), flush=True)


def group_folder(controller: str) -> Path | None:
    """This process's cgroup v1 folder of ``controller``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    return None


def _group_memory() -> int:
    """Anonymous and shared memory of this process's memory cgroup (v1), in bytes."""
    folder = group_folder("memory")
    stat = folder / "memory.stat" if folder else None
    if stat is None or not stat.exists():
        return 0
    values = dict(ln.split() for ln in stat.read_text().splitlines())
    return sum(int(values.get(k, 0)) for k in ("total_rss", "total_shmem"))


def _counters(blkio_group: str | None) -> dict[str, float]:
    """Bytes and reads the disk served to the blkio group, and CPU seconds of the memory
    group's processes (all of the row's processes: the loader's workers too)."""
    read_bytes = reads = 0
    if blkio_group:
        read_bytes = _blkio_reads(Path(blkio_group), "blkio.throttle.io_service_bytes")
        reads = _blkio_reads(Path(blkio_group), "blkio.throttle.io_serviced")
    cpu = 0.0
    folder = group_folder("memory")
    tick = os.sysconf("SC_CLK_TCK")
    for pid in (folder / "cgroup.procs").read_text().split() if folder else []:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return {"read_bytes": read_bytes, "reads": reads, "cpu": cpu}


def _blkio_reads(group: Path, name: str) -> int:
    total = 0
    for line in (group / name).read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "Read":
            total += int(parts[2])
    return total


def throttle_check(args: argparse.Namespace) -> None:
    """Read the (evicted) data file under the throttle: sequentially, then 4 KB at random."""
    import random

    path = args.check_file
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    seq = min(size // 2, 200 << 20)
    start = time.perf_counter()
    pos = 0
    while pos < seq:
        pos += len(os.pread(fd, 1 << 20, pos))
    seq_seconds = time.perf_counter() - start
    # Random single pages from the second half, which the sequential read left cold: each is
    # one read of the disk. About 2 s of them at the IOPS limit.
    rng = random.Random(0)
    count = 2 * (args.iops or 1000)
    cold = range((size // 2) // 4096 + 1, size // 4096)
    pages = rng.sample(cold, min(count, len(cold)))
    start = time.perf_counter()
    for page in pages:
        os.pread(fd, 4096, page * 4096)
    rand_seconds = time.perf_counter() - start
    os.close(fd)
    print(
        json.dumps(
            {
                "seq_bytes": pos,
                "seq_seconds": seq_seconds,
                "rand_reads": len(pages),
                "rand_seconds": rand_seconds,
            }
        ),
        flush=True,
    )
