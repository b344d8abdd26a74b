"""The multi-crop table: several views of each image per step (SSL), four ways on the same images.

Decode + ``MultiCrop`` in a DataLoader (what ImageFolder users run), the cache with the same
per-sample ``MultiCrop`` in a DataLoader, ``BatchLoader(views=...)``, and ``BatchLoader`` with
one 224 crop (the reference for output pixels per second); then a one-thread profile of where a
step's time goes (each kind of view's resizes and flips), which says why the pixel rates differ.
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

import mmcache
from mmcache import MemmapImageDataset, build_cache
from mmcache.demo import DecodingDataset, time_epochs
from mmcache.transforms import resize_into

from .results import (
    EventFn,
    MethodResult,
    RunSettings,
    TableReport,
    Target,
    check_keys,
    epochs_table,
    pick,
)
from .training import alternately

MULTICROP_ROWS = {
    "decode_multicrop": "decode + MultiCrop in a DataLoader (what ImageFolder users run)",
    "mmcache_multicrop": "MemmapImageDataset + the same MultiCrop in a DataLoader",
    "batch_loader_views": "mmcache BatchLoader(views=..., flip=True)",
    "batch_loader_one_crop": "mmcache BatchLoader(crop=RandomResizedCrop, flip=True): one crop "
    "of the global views' size",
}
# Records the profile times each resize over, and its rounds.
PROFILE_RECORDS = 200
PROFILE_ROUNDS = 5


@dataclass
class MultiCropSettings(RunSettings):
    """What ``run_multicrop_bench`` was asked for (see its arguments)."""

    images: int = 1000
    batch_size: int = 128
    epochs: int = 5
    short_side: int = 256
    global_size: int = 224
    global_views: int = 2
    local_size: int = 96
    local_views: int = 6


@dataclass
class MultiCropReport(TableReport):
    """The multi-crop table: the same views of the same images, four ways, and a profile."""

    profile: list[dict] = field(default_factory=list)

    def pixels_per_image(self, key: str) -> int:
        s = self.settings
        if key == "batch_loader_one_crop":
            return s["global_size"] ** 2
        return s["global_views"] * s["global_size"] ** 2 + s["local_views"] * s["local_size"] ** 2

    def pixel_rate(self, key: str) -> float:
        """Output pixels per second of row ``key`` (NaN if it did not run)."""
        row = pick(self.rows, key)
        return row.steady_images_per_second * self.pixels_per_image(key) if row else math.nan

    def to_markdown(self) -> str:
        s = self.settings
        lines = epochs_table(
            self.rows, ["method"], ["img/s (median 2..)", "output Mpx/s"],
            lambda r: ([r.name], [f"{r.steady_images_per_second:,.0f}",
                                  f"{self.pixel_rate(r.key) / 1e6:,.1f}"]),
        )  # fmt: skip
        profile = [
            "| one thread, per image | ms | box Mpx read | output Mpx | box Mpx/s | "
            "output Mpx/s |",
            "|---|---|---|---|---|---|",
            *(
                f"| {p['part']} | {p['ms']:.3f} | {p['box_mpx']:.3f} | {p['out_mpx']:.3f} | "
                f"{rate(p['box_mpx'], p['ms'])} | {rate(p['out_mpx'], p['ms'])} |"
                for p in self.profile
            ),
        ]
        bound = (
            f"At {s['workers']} threads these resizes alone bound BatchLoader(views) to "
            f"{s['workers'] / self.profile[-1]['ms'] * 1e3:,.0f} img/s."
            if self.profile and self.profile[-1]["ms"] else ""
        )
        views = (
            f"{s['global_views']} x {s['global_size']} (scale 0.32-1) + {s['local_views']} x "
            f"{s['local_size']} (scale 0.05-0.32)"
        )
        out = [
            "## Multi-crop (SSL views)",
            "",
            f"{s['images']:,} images stored at shorter side {s['short_side']}, views {views}, "
            f"each flipped at random, batch {s['batch_size']}, {s['workers']} workers or "
            f"threads, {s['epochs']} epochs; the rows run in turns, epoch by epoch. Output "
            "pixels: those of all the views of an image.",
            "",
            *lines,
            "",
            f"Profile: each part's resizes of {s['profile_records']} records' boxes in one thread "
            f"(antialiased bilinear, as the rows), per image, the fastest of {PROFILE_ROUNDS} "
            "rounds run in turns.",
            "",
            *profile,
            "",
            bound,
        ]
        return "\n".join(out) + "\n"


def rate(mpx: float, ms: float) -> str:
    """Megapixels per second, as text ("" for what has no pixels)."""
    return f"{mpx / ms * 1e3:,.0f}" if mpx and ms else ""


def run_multicrop_bench(
    *,
    workdir: str | os.PathLike,
    rows: list[str] | None = None,
    on_event: EventFn | None = None,
    **settings,
) -> MultiCropReport:
    """Time several views of each image into batches four ways on the same images, in one run.

    The images (``source``, or ``images`` generated JPEGs of ``image_size``) are cached at
    shorter side ``short_side``; the views are DINO's: ``global_views`` crops of
    ``global_size`` (scale 0.32-1) and ``local_views`` of ``local_size`` (scale 0.05-0.32),
    each flipped at random, timed over ``epochs`` epochs of ``batch_size`` with ``workers``
    DataLoader workers or threads. ``settings`` are the fields of ``MultiCropSettings``;
    ``rows`` keys of ``MULTICROP_ROWS``.
    """
    rows = list(MULTICROP_ROWS) if rows is None else rows
    check_keys(rows, MULTICROP_ROWS, "row")
    s = MultiCropSettings(**settings)
    workdir, say = Path(workdir), on_event or (lambda _: None)
    source = s.source if s.source is not None else s.generate(workdir / "images", s.seed + 2)
    cache = workdir / f"cache-short-{s.short_side}"
    build_cache(source, cache, short_side=s.short_side, replace=True)
    ds = MemmapImageDataset(cache, on_stale="ignore")
    views = [
        (mmcache.RandomResizedCrop(s.global_size, scale=(0.32, 1.0)), s.global_views),
        (mmcache.RandomResizedCrop(s.local_size, scale=(0.05, 0.32)), s.local_views),
    ]
    one = mmcache.RandomResizedCrop(s.global_size)
    report = MultiCropReport(settings={
        "images": len(ds), "short_side": s.short_side, "batch_size": s.batch_size,
        "workers": s.workers, "epochs": s.epochs, "global_size": s.global_size,
        "global_views": s.global_views, "local_size": s.local_size,
        "local_views": s.local_views, "profile_records": min(PROFILE_RECORDS, len(ds)),
    })  # fmt: skip
    threads = max(1, s.workers)
    transform = mmcache.MultiCrop(views, flip=True)

    def loader(key: str):
        if key == "batch_loader_views":
            return mmcache.BatchLoader(ds, s.batch_size, shuffle=True, seed=s.seed, views=views,
                                       flip=True, num_threads=threads)  # fmt: skip
        if key == "batch_loader_one_crop":
            return mmcache.BatchLoader(ds, s.batch_size, shuffle=True, seed=s.seed, crop=one,
                                       flip=True, num_threads=threads)  # fmt: skip
        dataset = (
            DecodingDataset(ds.samples, transform=transform)
            if key == "decode_multicrop"
            else MemmapImageDataset(cache, transform=transform, on_stale="ignore")
        )
        # persistent workers: started once, they wait while the other rows run
        return DataLoader(dataset, batch_size=s.batch_size, shuffle=True,
                          num_workers=s.workers, persistent_workers=s.workers > 0)  # fmt: skip

    def runner(it) -> Callable[[], float]:
        return lambda: time_epochs(ds, 1, batch_size=s.batch_size, workers=0, loader=it)[0]

    # Every row in turns, epoch by epoch, since their ratios are the targets: on a machine
    # shared with other work, rows run one after the other met different loads.
    gc.collect()
    loaders = {key: loader(key) for key in rows}
    times = alternately(s.epochs, {key: runner(it) for key, it in loaders.items()})
    del loaders  # the DataLoaders' workers end here
    results = {}
    for key in rows:
        results[key] = MethodResult(key, MULTICROP_ROWS[key], epoch_seconds=times[key],
                                    images=len(ds))  # fmt: skip
        say(results[key].describe())
    report.rows = [results[key] for key in rows]
    report.profile = profile(ds, views, one, s.seed)
    report.targets = multicrop_targets(report)
    return report


def profile(ds: MemmapImageDataset, views, one, seed: int) -> list[dict]:
    """Milliseconds per image, in one thread, of each part of the work: each kind of view's
    resizes (boxes drawn as the loader draws them) and the flips, against one crop's."""
    records = ds.reader.records
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(ds))[:PROFILE_RECORDS]
    with warnings.catch_warnings():  # torch cannot mark the read-only mapping read-only
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(ds.reader.mapping())

    def record(i: int) -> torch.Tensor:
        h, w, c = (int(v) for v in records.shapes[i])
        off = int(records.offsets[i])
        return data[off : off + h * w * c].view(h, w, c)

    parts = [(f"{n} views of {crop.size[0]}", crop, n) for crop, n in views]
    parts.append((f"one crop of {one.size[0]} (the reference)", one, 1))
    work = []
    for _name, crop, n in parts:
        boxes = [crop.boxes(records.shapes[idx], rng.random((len(idx), crop.draws)))
                 for _ in range(n)]  # fmt: skip
        work.append((torch.empty((*crop.size, 3), dtype=torch.uint8), boxes, crop.kernel))

    def resizes(part: int) -> tuple[float, int]:
        """Seconds and box pixels of part ``part``'s resizes of every record."""
        dst, boxes, kernel = work[part]
        start, area = time.perf_counter(), 0
        for k, i in enumerate(idx.tolist()):
            src = record(i)
            for b in boxes:
                top, left, bh, bw = (int(v) for v in b[k])
                resize_into(src[top : top + bh, left : left + bw], dst, *kernel)
                area += bh * bw
        return time.perf_counter() - start, area

    flips = sum(n for _, n in views)
    image = np.zeros((*views[0][0].size, 3), np.uint8)

    def flipping() -> float:
        start = time.perf_counter()
        for _ in range(len(idx) * (flips // 2)):  # half the views are mirrored
            cv2.flip(image, 1, dst=image)
        return time.perf_counter() - start

    # The parts in turns, PROFILE_ROUNDS times, each part's fastest round kept: a machine
    # shared with other work slows a round, never speeds one. (The first round also maps the
    # records' pages.)
    best = [math.inf] * (len(parts) + 1)
    areas = [0] * len(parts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: torch's resize kernel would otherwise use its pool
    try:
        for _round in range(PROFILE_ROUNDS):
            for part in range(len(parts)):
                seconds, areas[part] = resizes(part)
                best[part] = min(best[part], seconds)
            best[-1] = min(best[-1], flipping())
    finally:
        torch.set_num_threads(threads)
    out = [{"part": f"resize {name}", "ms": best[p] / len(idx) * 1e3,
            "box_mpx": areas[p] / len(idx) / 1e6,
            "out_mpx": n * crop.size[0] * crop.size[1] / 1e6}
           for p, (name, crop, n) in enumerate(parts)]  # fmt: skip
    out.append({"part": f"flip half of the {flips} views (all at the largest size: a bound)",
                "ms": best[-1] / len(idx) * 1e3, "box_mpx": 0.0, "out_mpx": 0.0})
    views_ms = sum(p["ms"] for p in out[:-2]) + out[-1]["ms"]
    out.append({"part": "all the views' resizes and flips", "ms": views_ms,
                "box_mpx": sum(p["box_mpx"] for p in out[:-2]),
                "out_mpx": sum(p["out_mpx"] for p in out[:-2])})  # fmt: skip
    return out


def multicrop_targets(report: MultiCropReport) -> list[Target]:
    """The multi-crop targets, as ratios of this run's figures."""
    rows, size = report.rows, report.settings["global_size"]

    def rate(key: str) -> float:
        row = pick(rows, key)
        return row.steady_images_per_second if row else math.nan

    return [
        Target("BatchLoader(views) / decode + MultiCrop in a DataLoader (img/s)",
               rate("batch_loader_views") / rate("decode_multicrop"), 8.0),
        Target(f"BatchLoader(views) / BatchLoader(one {size} crop) (output pixels/s)",
               report.pixel_rate("batch_loader_views")
               / report.pixel_rate("batch_loader_one_crop"), 0.8),
    ]  # fmt: skip
