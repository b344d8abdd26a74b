"""The segmentation table: images with their masks, RandomResizedCrop + flip of both, four ways.

Decode image + mask and crop both in a DataLoader (what segmentation users run), the cache with
the same joint crop in a DataLoader, ``BatchLoader`` with masks, and ``BatchLoader`` over a
cache of the same images without masks (the cost the masks add).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import cv2
from torch.utils.data import Dataset

import mmcache
from mmcache import MemmapImageDataset, build_cache
from mmcache.annotations import read_mask
from mmcache.demo import time_epochs
from mmcache.sample_data import make_segmentation_set

from .results import EventFn, MethodResult, TableReport, Target, check_keys
from .results import steady_rate as rate_of
from .training import alternately

SEGMENTATION_ROWS = {
    "decode_joint": "decode image + mask, RandomResizedCrop + flip of both, in a DataLoader",
    "mmcache_joint": "MemmapImageDataset with masks + the same joint crop in a DataLoader",
    "batch_loader_masks": "mmcache BatchLoader(crop, flip) with masks",
    "batch_loader_plain": "mmcache BatchLoader(crop, flip), the same images without masks",
}
# In-process rows whose ratio is a target: run in turns, epoch by epoch.
ALTERNATED = ("batch_loader_masks", "batch_loader_plain")


@dataclass
class SegmentationReport(TableReport):
    """The segmentation table: the same crops of the same images and masks, four ways."""

    def to_markdown(self) -> str:
        s = self.settings
        lines = self.rate_table()
        return "\n".join([
            "## Segmentation",
            "",
            f"{s['images']:,} generated JPEGs of about {s['image_size'][1]}x"
            f"{s['image_size'][0]} with 8-bit PNG masks, RandomResizedCrop({s['size']}) + flip "
            f"of image and mask, batch {s['batch_size']}, {s['workers']} workers or threads, "
            f"{s['epochs']} epochs; the two BatchLoader rows run in turns.",
            "",
            *lines,
        ]) + "\n"  # fmt: skip


class DecodingPairs(Dataset):
    """Decode each image (``cv2.imread``, RGB) and its mask on every access, then ``transform``
    the pair: a segmentation dataset as users write it."""

    def __init__(self, pairs: list[tuple[str, str]], transform: Callable) -> None:
        self.pairs, self.transform = pairs, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        image_path, mask_path = self.pairs[i]
        img = cv2.cvtColor(cv2.imread(image_path), cv2.COLOR_BGR2RGB)
        mask = read_mask(mask_path, "uint8")
        assert not isinstance(mask, str), mask
        return self.transform((img, {"mask": mask}))


def run_segmentation_bench(
    *,
    workdir: str | os.PathLike,
    images: int = 600,
    image_size: tuple[int, int] = (375, 500),
    size: int = 224,
    batch_size: int = 64,
    workers: int = 2,
    epochs: int = 6,
    seed: int = 0,
    rows: list[str] | None = None,
    on_event: EventFn | None = None,
) -> SegmentationReport:
    """Time RandomResizedCrop(``size``) + flip of images and their masks into batches, four
    ways, in one run, over ``images`` generated photo-like JPEGs of about ``image_size``
    (height, width) with their masks, cached at their own size; ``rows``: keys of
    ``SEGMENTATION_ROWS``."""
    rows = list(SEGMENTATION_ROWS) if rows is None else rows
    check_keys(rows, SEGMENTATION_ROWS, "row")
    say = on_event or (lambda _: None)
    workdir = Path(workdir)
    image_dir, mask_dir = make_segmentation_set(
        workdir / "segmentation", images=images, size=image_size, seed=seed, ext=".jpg",
        texture=True,
    )  # fmt: skip
    masked, plain = workdir / "cache-masks", workdir / "cache-plain"
    build_cache(image_dir, masked, masks=mask_dir, replace=True)
    build_cache(image_dir, plain, replace=True)
    report = SegmentationReport(settings={
        "images": images, "image_size": list(image_size), "size": size,
        "batch_size": batch_size, "workers": workers, "epochs": epochs,
    })  # fmt: skip
    joint = mmcache.Compose([mmcache.RandomResizedCrop(size), mmcache.RandomHorizontalFlip()])
    results: dict[str, MethodResult] = {}
    for key in rows:
        if key in results:
            continue
        gc.collect()
        if key in ALTERNATED:
            turns = [k for k in rows if k in ALTERNATED]
            runners = {}
            for k in turns:
                ds = MemmapImageDataset(masked if k == "batch_loader_masks" else plain)
                loader = mmcache.BatchLoader(
                    ds, batch_size, shuffle=True, seed=seed, crop=mmcache.RandomResizedCrop(size),
                    flip=True, num_threads=max(1, workers),
                )  # fmt: skip
                runners[k] = _epoch_runner(ds, loader, batch_size)
            times = alternately(epochs, runners)
            for k in turns:
                results[k] = MethodResult(k, SEGMENTATION_ROWS[k], epoch_seconds=times[k],
                                          images=images)  # fmt: skip
                say(results[k].describe())
            continue
        if key == "decode_joint":
            ds_masked = MemmapImageDataset(masked)
            pairs = [
                (os.path.join(image_dir, p), os.path.join(mask_dir, Path(p).stem + ".png"))
                for p, _ in ds_masked.samples
            ]
            dataset: Dataset = DecodingPairs([(str(i), str(m)) for i, m in pairs], joint)
        else:
            dataset = MemmapImageDataset(masked, transform=joint)
        row = MethodResult(key, SEGMENTATION_ROWS[key], images=images)
        row.epoch_seconds = time_epochs(dataset, epochs, batch_size=batch_size, workers=workers)
        results[key] = row
        say(row.describe())
    report.rows = [results[k] for k in rows]
    report.targets = segmentation_targets(report)
    return report


def _epoch_runner(ds, loader, batch_size: int) -> Callable[[], float]:
    return lambda: time_epochs(ds, 1, batch_size=batch_size, workers=0, loader=loader)[0]


def segmentation_targets(report: SegmentationReport) -> list[Target]:
    """The segmentation table's targets, as ratios of this run's figures."""

    def rate(key: str) -> float:
        return rate_of(report.rows, key)

    decode = rate("decode_joint")
    masks = rate("batch_loader_masks")
    return [
        Target("BatchLoader with masks / decode + joint crop in a DataLoader", masks / decode, 8.0),
        Target("BatchLoader with masks / without masks", masks / rate("batch_loader_plain"), 0.7),
        Target("MemmapImageDataset with masks / decode + joint crop (DataLoaders)",
               rate("mmcache_joint") / decode, 4.0),
    ]  # fmt: skip
