"""Throughput of the ways to read batches from a cache, against the memory-copy limit.

On a generated cache of photo-like JPEGs (720x480 by default), in one run and in the same
shuffled order for all:

- ``copy loop``: records copied from the memmap into one reused batch buffer by a plain loop
  in this thread: the memory-copy limit that a loader can approach;
- ``BatchLoader``, with 1 and with 2 threads;
- ``MemmapImageDataset`` in a standard DataLoader (``--workers`` workers);
- ``InMemoryDataset`` in the same DataLoader: every image in one numpy array preloaded before
  the workers fork (the in-RAM bound of the DataLoader path);
- with ``--decode``, ``DecodingDataset`` (decode every epoch) in the same DataLoader.

Each is run for ``--epochs`` epochs; the first warms the page cache and is not counted, the
table gives the median of the others, in images per second and in CPU milliseconds per image
(this process and its DataLoader workers together: the steadier figure on a busy machine).

Usage:
    PYTHONPATH=. python tools/loader_bench.py --images 2000 --workdir /tmp/mmcache-loader-bench
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines import InMemoryDataset  # noqa: E402

from mmcache import BatchLoader, MemmapImageDataset, build_cache  # noqa: E402
from mmcache import format as fmt  # noqa: E402
from mmcache.demo import DecodingDataset  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have exited (DataLoader workers)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _time_epochs(
    make_epoch: Callable[[int], Iterable], epochs: int
) -> list[tuple[int, float, float]]:
    """(images, seconds, CPU seconds) of each epoch; ``make_epoch(e)`` gives epoch e's batches."""
    out = []
    for epoch in range(epochs):
        start, cpu = time.perf_counter(), _cpu_seconds()
        count = 0
        for _images, labels in make_epoch(epoch):
            count += len(labels)
        out.append((count, time.perf_counter() - start, _cpu_seconds() - cpu))
    return out


def copy_loop(ds: MemmapImageDataset, batch_size: int, order_of: Callable[[int], np.ndarray]):
    """The memory-copy limit: a reused buffer filled record by record, as BatchLoader does."""
    data = ds.reader.mapping()
    nbytes = int(ds.reader.records.nbytes[0])
    buf = np.empty((batch_size, nbytes), np.uint8)
    labels = np.empty(batch_size, np.int64)
    offsets = ds.reader.records.offsets

    def epoch(e: int):
        order = order_of(e)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            for j, off in enumerate(offsets[idx].tolist()):
                buf[j] = data[off : off + nbytes]
            np.take(ds.reader.records.labels, idx, out=labels[: len(idx)])
            yield buf[: len(idx)], labels[: len(idx)]

    return epoch


def prepare(workdir: Path, images: int, size: tuple[int, int]) -> Path:
    """The cache of ``images`` generated JPEGs under workdir, made or reused."""
    cache = workdir / f"cache-{images}-{size[0]}x{size[1]}"
    try:
        if fmt.read_manifest(cache).count == images:
            return cache
    except Exception:  # no cache there yet, or not the one wanted: build it
        pass
    classes = 4
    per_class = -(-images // classes)
    src = make_image_folder(
        workdir / f"src-{size[0]}x{size[1]}", classes=classes, per_class=per_class, size=size[::-1]
    )
    build_cache(src, cache)
    assert fmt.read_manifest(cache).count == images, "the source folder holds other images"
    return cache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2000, help="a multiple of 4 (default 2000)")
    p.add_argument("--size", default="720x480", help="WIDTHxHEIGHT (default 720x480)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/mmcache-loader-bench"))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--epochs", type=int, default=4, help="per method; the first is not counted")
    p.add_argument("--decode", action="store_true", help="also time decode-every-epoch")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    width, height = (int(v) for v in args.size.lower().split("x"))
    if args.epochs < 2:
        p.error("--epochs must be at least 2 (the first one warms the page cache)")

    args.workdir.mkdir(parents=True, exist_ok=True)
    cache = prepare(args.workdir, args.images, (width, height))
    ds = MemmapImageDataset(cache, on_stale="ignore")
    n, bs, workers = len(ds), args.batch_size, args.workers
    machine = f"{platform.node()}: {os.cpu_count()} CPUs, {platform.platform()}"
    print(f"# {machine}, torch {torch.__version__}")
    print(
        f"# {n} images {width}x{height}, batch {bs}, shuffled, DataLoader workers {workers}, "
        f"{args.epochs} epochs (the first not counted)"
    )

    def order_of(e: int) -> np.ndarray:
        return np.random.default_rng([args.seed, e]).permutation(n)

    def dataloader(dataset):
        loader = DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=workers)
        return lambda e: loader

    methods: dict[str, Callable[[int], Iterable]] = {
        "copy loop (1 thread)": copy_loop(ds, bs, order_of)
    }
    for threads in (1, 2):
        loader = BatchLoader(ds, bs, shuffle=True, seed=args.seed, num_threads=threads)

        def epoch(e: int, loader=loader):
            loader.set_epoch(e)
            return loader

        methods[f"BatchLoader ({threads} thread{'s' * (threads > 1)})"] = epoch
    methods[f"MemmapImageDataset, DataLoader ({workers} workers)"] = dataloader(ds)
    start = time.perf_counter()
    in_ram = InMemoryDataset(ds.samples)
    preload = time.perf_counter() - start
    methods[f"InMemoryDataset, DataLoader ({workers} workers)"] = dataloader(in_ram)
    if args.decode:
        methods[f"DecodingDataset, DataLoader ({workers} workers)"] = dataloader(
            DecodingDataset(ds.samples)
        )

    rows = []
    for name, make_epoch in methods.items():
        epochs = _time_epochs(make_epoch, args.epochs)[1:]
        rate = statistics.median(c / s for c, s, _ in epochs)
        cpu_ms = statistics.median(cpu / c * 1e3 for c, _, cpu in epochs)
        rows.append((name, rate, cpu_ms))
        print(
            f"#   {name}: " + ", ".join(f"{c / s:.0f}" for c, s, _ in epochs) + " img/s", flush=True
        )
    del in_ram

    limit = rows[0][1]
    print()
    print("| method | img/s | CPU ms/img | x copy loop |")
    print("|---|---:|---:|---:|")
    for name, rate, cpu_ms in rows:
        print(f"| {name} | {rate:.0f} | {cpu_ms:.2f} | {rate / limit:.2f} |")
    by = {name.split(",")[0].split(" (")[0]: rate for name, rate, _ in rows}
    print()
    print(f"InMemoryDataset preload: {preload:.1f} s")
    best_bl = max(rate for name, rate, _ in rows if name.startswith("BatchLoader"))
    print(f"BatchLoader / copy loop: {best_bl / limit:.2f} (target >= 0.8)")
    memmap = by["MemmapImageDataset"]
    in_ram_rate = by["InMemoryDataset"]
    print(f"MemmapImageDataset / InMemoryDataset: {memmap / in_ram_rate:.2f} (target >= 1.0)")
    if args.decode:
        decode = by["DecodingDataset"]
        print(f"MemmapImageDataset / DecodingDataset: {memmap / decode:.2f} (target >= 2.5)")
        print(f"BatchLoader / DecodingDataset: {best_bl / decode:.2f} (target >= 6)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
