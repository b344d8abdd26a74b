"""The demo: generate a photo-like image folder, build its cache, and time epochs both ways."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from .build import build_cache
from .dataset import MemmapImageDataset
from .decode import Options, decode_image
from .loader import BatchLoader
from .reports import BuildReport, ProgressFn
from .sample_data import make_image_folder

__all__ = ["DemoReport", "run_demo"]


class DecodingDataset(Dataset):
    """Decode ``samples`` (``(path, label)`` pairs) with OpenCV on every access, then
    ``transform``: what ``ImageFolder`` does, the demo's (and the bench's) baseline."""

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        options: Options | None = None,
        transform: Callable[[np.ndarray], Any] | None = None,
    ):
        self.samples = list(samples)
        self.options = options or Options()
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        img = decode_image(path, self.options)
        return (img if self.transform is None else self.transform(img)), label


@dataclass
class DemoReport:
    """Timings of one demo run: the build, then seconds per epoch for each way of loading.

    ``image_size``: the generated images' (height, width).
    """

    workdir: Path
    images: int
    image_size: tuple[int, int]
    generate_seconds: float
    build: BuildReport
    epochs: dict[str, list[float]] = field(default_factory=dict)
    pixels_equal: bool = False


def time_epochs(
    dataset: Dataset,
    epochs: int,
    *,
    batch_size: int,
    workers: int,
    on_epoch: Callable[[int, float], None] | None = None,
    loader: Iterable | None = None,
) -> list[float]:
    """Seconds per epoch of a shuffled DataLoader over ``dataset`` (workers persist), or of
    the given ``loader``."""
    if loader is None:
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
        )
    times = []
    for epoch in range(epochs):
        start = time.perf_counter()
        for _images, _labels in loader:
            pass
        times.append(time.perf_counter() - start)
        if on_epoch is not None:
            on_epoch(epoch, times[-1])
    return times


def run_demo(
    workdir: str | os.PathLike,
    *,
    images: int = 1000,
    classes: int = 4,
    image_size: tuple[int, int] = (480, 720),
    epochs: int = 3,
    batch_size: int = 64,
    workers: int = 2,
    build_progress: ProgressFn | None = None,
    on_epoch: Callable[[str, int, float], None] | None = None,
) -> DemoReport:
    """Make ``images`` JPEGs under ``workdir/images``, cache them in ``workdir/cache``, then run
    ``epochs`` epochs of each: decoding every image (a DataLoader), the cache in a DataLoader,
    and the cache through ``BatchLoader`` (all images share one size, ``image_size``: (height,
    width)).

    Examples:
        >>> report = run_demo("/tmp/mmcache-demo", images=200)  # doctest: +SKIP
    """
    workdir = Path(workdir)
    start = time.perf_counter()
    per_class = -(-images // classes)
    source = make_image_folder(
        workdir / "images", classes=classes, per_class=per_class, size=image_size
    )
    generated = time.perf_counter() - start
    build = build_cache(source, workdir / "cache", progress=build_progress)
    cached = MemmapImageDataset(workdir / "cache")
    decoding = DecodingDataset(cached.samples)
    report = DemoReport(workdir, len(cached), image_size, generated, build)
    # The point of the cache: the same pixels as decoding, at a fraction of the cost.
    report.pixels_equal = all(
        (decoding[i][0] == cached[i][0]).all() for i in range(0, len(cached), 97)
    )
    batches = BatchLoader(cached, batch_size, shuffle=True, seed=0)
    for name, ds, loader in (
        ("decode every epoch", decoding, None),
        ("mmcache DataLoader", cached, None),
        ("mmcache BatchLoader", cached, batches),
    ):

        def report_epoch(epoch: int, seconds: float, name: str = name) -> None:
            if on_epoch is not None:
                on_epoch(name, epoch, seconds)

        report.epochs[name] = time_epochs(
            ds,
            epochs,
            batch_size=batch_size,
            workers=workers,
            on_epoch=report_epoch,
            loader=loader,
        )
    return report
