"""The training table: RandomResizedCrop + flip into batches, seven ways on the same images.

Decode + crop in a DataLoader (what ImageFolder users run), the cache with the same per-sample
crop in a DataLoader, FFCV's Loader (in its own environment), a plain loop of threads that
resize each crop box into one reused buffer, and ``BatchLoader(crop)``; then the DataLoader and
``BatchLoader`` rows again from a second cache of the same images stored as YUV 4:2:0.
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

import mmcache
from mmcache import MemmapImageDataset, build_cache
from mmcache.demo import DecodingDataset, time_epochs

from .results import EventFn, MethodResult, RunSettings, TableReport, Target, check_keys
from .results import steady_rate as rate_of

TRAINING_ROWS = {
    "decode_crop": "decode + RandomResizedCrop in a DataLoader (what ImageFolder users run)",
    "mmcache_crop": "MemmapImageDataset + the same per-sample crop in a DataLoader",
    "ffcv": "FFCV Loader, RAW records, RandomResizedCropRGBImageDecoder + flip + ToTensor",
    "thread_loop": "a plain loop in 2 threads: resize each crop box into one reused buffer",
    "batch_loader_crop": "mmcache BatchLoader(crop=RandomResizedCrop, flip=True)",
    "mmcache_crop_yuv420": "MemmapImageDataset + per-sample crop in a DataLoader, yuv420 cache",
    "batch_loader_crop_yuv420": "mmcache BatchLoader(crop, flip) from a yuv420 cache",
}
# Run in turns, epoch by epoch, since their ratios are targets.
ALTERNATED_ROWS = ("thread_loop", "batch_loader_crop", "batch_loader_crop_yuv420")
# The rows that read the second cache, built with pixels="yuv420" from the same images.
YUV420_ROWS = ("mmcache_crop_yuv420", "batch_loader_crop_yuv420")


@dataclass
class TrainingReport(TableReport):
    """The training-pipeline table: the same crops of the same images, seven ways."""

    ffcv: dict | None = None

    def to_markdown(self) -> str:
        s = self.settings
        lines = self.rate_table()
        out = [
            "## Training pipeline",
            "",
            f"{s['images']:,} images stored at shorter side {s['short_side']}, "
            f"RandomResizedCrop({s['size']}) + flip, batch {s['batch_size']}, "
            f"{s['workers']} workers or threads, {s['epochs']} epochs; the plain thread loop "
            "and the BatchLoader(crop) rows run in turns, epoch by epoch.",
            *(
                [f"Cache bytes: yuv420 {s['yuv420_bytes']:,}, rgb {s['rgb_bytes']:,}."]
                if "yuv420_bytes" in s
                else []
            ),
            "",
            *lines,
        ]
        return "\n".join(out) + "\n"


@dataclass
class TrainingSettings(RunSettings):
    """What ``run_training_bench`` was asked for (see its arguments)."""

    images: int = 1000
    batch_size: int = 256
    epochs: int = 10
    short_side: int = 256
    size: int = 224


def run_training_bench(
    *,
    workdir: str | os.PathLike,
    rows: list[str] | None = None,
    on_event: EventFn | None = None,
    **settings,
) -> TrainingReport:
    """Time RandomResizedCrop + flip into batches seven ways on the same images, in one run.

    The images (``source``, or ``images`` generated JPEGs of ``image_size``) are cached at
    shorter side ``short_side``; every row crops ``size`` x ``size`` boxes with torchvision's
    box sampling and antialiased bilinear resize (FFCV: its own crop decoder), flips half, and
    is timed over ``epochs`` epochs of ``batch_size``, with ``workers`` DataLoader workers or
    threads. FFCV runs in its own environment (tools/setup_ffcv.sh), on the cache's pixels.
    The plain thread loop and the ``BatchLoader(crop)`` rows, whose ratios are targets, run in
    turns. The yuv420 rows read a second cache of the same images built with
    ``pixels="yuv420"``. ``settings`` are the fields of ``TrainingSettings``; ``rows`` keys of
    ``TRAINING_ROWS``.
    """
    rows = list(TRAINING_ROWS) if rows is None else rows
    check_keys(rows, TRAINING_ROWS, "row")
    run = TrainingRun(TrainingSettings(**settings), Path(workdir), on_event or (lambda _: None))
    return run.run(rows)


class TrainingRun:
    """One run of the training table over a cache built at the stored shorter side."""

    def __init__(self, settings: TrainingSettings, workdir: Path, say: EventFn) -> None:
        self.s, self.workdir, self.say = settings, workdir, say
        source = settings.source
        if source is None:
            source = settings.generate(workdir / "training-images", settings.seed + 1)
        self.source = source
        self.cache = workdir / f"cache-short-{settings.short_side}"
        self.rgb_bytes = build_cache(
            source, self.cache, short_side=settings.short_side, replace=True
        ).bytes
        self.ds = MemmapImageDataset(self.cache, on_stale="ignore")
        self._yuv_ds: MemmapImageDataset | None = None
        self.crop = mmcache.RandomResizedCrop(settings.size)
        self.per_sample = mmcache.Compose([self.crop, mmcache.RandomHorizontalFlip()])
        self.threads = max(1, settings.workers)  # the thread rows' counterpart of the workers
        first_shape = self.ds.reader.records.shapes[0]
        stored = "x".join(str(v) for v in first_shape[1::-1]) + " (first record)"
        s = settings
        self.report = TrainingReport(settings={
            "images": len(self.ds), "short_side": s.short_side, "size": s.size,
            "batch_size": s.batch_size, "workers": s.workers, "epochs": s.epochs,
            "stored": stored,
        })  # fmt: skip

    @property
    def yuv_cache(self) -> Path:
        return self.workdir / f"cache-short-{self.s.short_side}-yuv420"

    @property
    def yuv_ds(self) -> MemmapImageDataset:
        """The same images cached as YUV 4:2:0, built on first use."""
        if self._yuv_ds is None:
            built = build_cache(self.source, self.yuv_cache, short_side=self.s.short_side,
                                pixels="yuv420", replace=True)  # fmt: skip
            self.report.settings.update(yuv420_bytes=built.bytes, rgb_bytes=self.rgb_bytes)
            self._yuv_ds = MemmapImageDataset(self.yuv_cache, on_stale="ignore")
        return self._yuv_ds

    def run(self, rows: list[str]) -> TrainingReport:
        results: dict[str, MethodResult] = {}
        for key in rows:
            if key in results:  # ran in turns with an earlier row
                continue
            gc.collect()
            if key in ALTERNATED_ROWS:
                results.update(self._in_turns([k for k in rows if k in ALTERNATED_ROWS]))
            else:
                results[key] = self._one_row(key)
                self.say(results[key].describe())
        self.report.rows = [results[key] for key in rows]
        self.report.targets = training_targets(self.report)
        return self.report

    def _dataloader(self, dataset) -> list[float]:
        s = self.s
        return time_epochs(dataset, s.epochs, batch_size=s.batch_size, workers=s.workers)

    def _one_row(self, key: str) -> MethodResult:
        row = MethodResult(key, TRAINING_ROWS[key], images=len(self.ds))
        if key == "decode_crop":
            dataset = DecodingDataset(self.ds.samples, transform=self.per_sample)
            row.epoch_seconds = self._dataloader(dataset)
        elif key in ("mmcache_crop", "mmcache_crop_yuv420"):
            cache = self.cache if key == "mmcache_crop" else self.yuv_ds and self.yuv_cache
            dataset = MemmapImageDataset(cache, transform=self.per_sample)
            row.epoch_seconds = self._dataloader(dataset)
        else:
            from ffcv_bench import run_ffcv_peer

            s = self.s
            result = run_ffcv_peer(self.cache, s.batch_size, s.workers, s.epochs, s.size,
                                   self.workdir / "ffcv")  # fmt: skip
            if isinstance(result, str):
                row.skipped = result
            else:
                row.epoch_seconds, self.report.ffcv = result["epoch_seconds"], result
        return row

    def _in_turns(self, turns: list[str]) -> dict[str, MethodResult]:
        # The in-process rows whose ratio is a target run in turns, epoch by epoch: run one
        # after the other, each met this VM's memory in a different state.
        s, ds = self.s, self.ds
        with ThreadPoolExecutor(self.threads) as pool:
            runners = {key: self._epoch_runner(key, pool) for key in turns}
            times = alternately(s.epochs, runners)
        results = {}
        for key in turns:
            results[key] = MethodResult(key, TRAINING_ROWS[key], epoch_seconds=times[key],
                                        images=len(ds))  # fmt: skip
            self.say(results[key].describe())
        return results

    def _epoch_runner(self, key: str, pool: ThreadPoolExecutor) -> Callable[[], float]:
        s = self.s
        ds = self.yuv_ds if key in YUV420_ROWS else self.ds
        if key == "thread_loop":
            return crop_thread_loop(ds, self.crop, s.batch_size, pool, self.threads, s.seed)
        loader = mmcache.BatchLoader(ds, s.batch_size, shuffle=True, seed=s.seed, crop=self.crop,
                                     flip=True, num_threads=self.threads)  # fmt: skip
        return lambda: time_epochs(ds, 1, batch_size=s.batch_size, workers=0, loader=loader)[0]


def crop_thread_loop(
    ds, crop, batch_size: int, pool: ThreadPoolExecutor, threads: int, seed: int
) -> Callable[[], float]:
    """An epoch per call of the bare work, returning its seconds: each record's crop box, a
    view of the mapping, resized (and half of them flipped) into one reused batch buffer by
    the ``pool``'s threads."""
    from mmcache.transforms import resize_into

    records = ds.reader.records
    with warnings.catch_warnings():  # torch cannot mark the read-only mapping read-only
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(ds.reader.mapping())
    h, w = crop.size
    batch = torch.empty((batch_size, h, w, records.shapes[0][2]), dtype=torch.uint8)
    rng = np.random.default_rng(seed)

    def fill(part):
        for j, i, (top, left, bh, bw), flip in part:
            rh, rw, rc = (int(v) for v in records.shapes[i])
            off = int(records.offsets[i])
            src = data[off : off + rh * rw * rc].view(rh, rw, rc)[top : top + bh, left : left + bw]
            resize_into(src, batch[j])
            if flip:
                out = batch[j].numpy()
                cv2.flip(out, 1, dst=out)

    def epoch() -> float:
        order = rng.permutation(len(ds))
        start = time.perf_counter()
        for k in range(0, len(order), batch_size):
            idx = order[k : k + batch_size]
            boxes = crop.boxes(records.shapes[idx], rng.random((len(idx), crop.draws)))
            jobs = list(zip(range(len(idx)), idx.tolist(), boxes.tolist(),
                            (rng.random(len(idx)) < 0.5).tolist()))  # fmt: skip
            list(pool.map(fill, [jobs[t::threads] for t in range(threads)]))
        return time.perf_counter() - start

    return epoch


def alternately(epochs: int, runners: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Seconds per epoch of each runner, run in turns: epoch k of every runner before epoch
    k + 1 of any, who goes first swapping each round."""
    times: dict[str, list[float]] = {key: [] for key in runners}
    keys = list(runners)
    for k in range(epochs):
        for key in keys if k % 2 == 0 else keys[::-1]:
            times[key].append(runners[key]())
    return times


def training_targets(report: TrainingReport) -> list[Target]:
    """The training pipeline's targets, as ratios of this run's figures."""

    def rate(key: str) -> float:
        return rate_of(report.rows, key)

    bl, ffcv, decode = rate("batch_loader_crop"), rate("ffcv"), rate("decode_crop")
    yuv = rate("batch_loader_crop_yuv420")
    s = report.settings
    return [
        Target(
            "yuv420 cache bytes / rgb cache bytes",
            s.get("yuv420_bytes", math.nan) / s.get("rgb_bytes", math.nan),
            0.52,
            higher_is_better=False,
        ),
        Target("BatchLoader(crop): yuv420 / rgb cache", yuv / bl, 0.8),
        Target("BatchLoader(crop) from yuv420 / FFCV Loader", yuv / ffcv, 1.5),
        Target(
            "MemmapImageDataset + crop: yuv420 / rgb cache (DataLoaders)",
            rate("mmcache_crop_yuv420") / rate("mmcache_crop"),
            0.8,
        ),
        Target("BatchLoader(crop) / FFCV Loader", bl / ffcv, 1.5),
        Target("BatchLoader(crop) / decode + crop in a DataLoader", bl / decode, 10.0),
        Target("BatchLoader(crop) / the plain thread loop", bl / rate("thread_loop"), 0.9),
        Target(
            "MemmapImageDataset + crop / decode + crop (DataLoaders)",
            rate("mmcache_crop") / decode,
            5.0,
        ),  # fmt: skip
    ]
