"""Prove BatchLoader's CUDA path in one command: the ``needs_cuda`` tests, then a short GPU bench.

With a CUDA device it:

1. runs every test marked ``needs_cuda`` (``pytest -m needs_cuda tests``: tests/test_cuda.py
   compares every CUDA path of ``BatchLoader(device=...)`` with the CPU path and reference math);
2. makes a small photo-like data set (``mmcache.sample_data``) in a temporary folder and builds
   two caches of it: one of a single shape (whole records) and one for crops;
3. measures, after checking that each loader's first batch equals the CPU path's:
   the host-to-device bytes/s of ``BatchLoader(device="cuda")`` against a bare loop copying one
   pinned batch to the device; the img/s of ``BatchLoader(device="cuda")`` with
   ``RandomResizedCrop(224)`` and a flip against the CPU path (CPU batches, then ``.to(cuda)``)
   and against decoding and cropping in a ``DataLoader``; a tiny CNN's training step time with
   the batch already on the device and with the loader in the way;
4. prints one markdown table, with the machine and the tests' outcome, and writes it to
   ``--out``. The whole run takes a few minutes on a 16-core machine with one GPU.

Without a CUDA device (or with ``--without-device``) it says so and only checks that it would
run: the tests of tests/test_cuda.py run (their CPU halves pass; the CUDA halves skip, named,
unless there is a device after all), and every part of the bench runs on the CPU at a tiny
size, with its comparisons. It measures nothing then, prints no figure and writes no table:
no GPU result is claimed.

Usage:
    PYTHONPATH=. python tools/cuda_check.py --out docs/cuda_check.md
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from benchlib.machine import machine_description  # noqa: E402

from mmcache import (  # noqa: E402
    BatchLoader,
    Compose,
    MemmapImageDataset,
    RandomHorizontalFlip,
    RandomResizedCrop,
    build_cache,
)
from mmcache.demo import DecodingDataset  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def run_tests(device: bool) -> tuple[bool, str]:
    """Whether the tests passed, and pytest's summary with its skips named: with a device
    every ``needs_cuda`` test of the suite, without one tests/test_cuda.py (its CPU halves).
    In this process: a second one would import torch again, seconds on a busy machine."""
    which = ["-m", "needs_cuda", str(ROOT / "tests")] if device else [
        str(ROOT / "tests" / "test_cuda.py")]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # -n 0: in this process, as the docstring says (the suite's addopts spread it over
        # worker processes, each importing torch again)
        code = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "-n", "0", "--rootdir",
                            str(ROOT), *which])  # fmt: skip
    text = out.getvalue()
    lines = text.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else f"pytest exited with {code}"
    if code != 0:
        print(text[-8000:])
    skipped: dict[str, int] = {}  # reason -> tests, from -rs's "SKIPPED [n] where: reason"
    for n, reason in re.findall(r"^SKIPPED \[(\d+)\] [^ ]+: (.*)$", text, re.M):
        skipped[reason] = skipped.get(reason, 0) + int(n)
    named = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))
    return code == 0, summary + (f" (skipped: {named})" if named else "")


def make_caches(
    workdir: Path, images: int, size: tuple[int, int], crop: int, workers: int
) -> tuple[Path, MemmapImageDataset, MemmapImageDataset]:
    """A photo-like ImageFolder of ``images`` (height, width) ``size`` JPEGs, and two caches of
    it: ``whole`` (every record ``crop`` x ``crop``, for copies) and ``crops`` (short side
    8/7 of ``crop``: 256 for 224, as ImageNet's are often kept)."""
    src = make_image_folder(workdir / "src", classes=4, per_class=max(images // 4, 1), size=size)
    build_cache(src, workdir / "whole", size=(crop, crop), workers=workers)
    build_cache(src, workdir / "crops", short_side=crop * 8 // 7, workers=workers)
    return src, MemmapImageDataset(workdir / "whole"), MemmapImageDataset(workdir / "crops")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(epoch: Callable[[], int], device: torch.device, repeat: int) -> float:
    """Items per second of ``epoch()`` (which returns how many it handled): the median of
    ``repeat`` runs after one warm-up run (page cache, allocator, cuDNN)."""
    epoch()
    rates = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        count = epoch()
        synchronize(device)
        rates.append(count / (time.perf_counter() - start))
    return statistics.median(rates)


def first_batch_matches(loader: BatchLoader, cpu: BatchLoader) -> None:
    """The loader's first batch equals the CPU path's (uint8 copies are exact; see
    tests/test_cuda.py), or AssertionError: a bench of wrong batches means nothing."""
    (got, got_labels), (want, want_labels) = next(iter(loader)), next(iter(cpu))
    if not (torch.equal(got.cpu(), want) and torch.equal(got_labels.cpu(), want_labels)):
        raise AssertionError(f"the first batch on {loader.device} differs from the CPU path's")


def copy_rates(ds: MemmapImageDataset, device: torch.device, batch: int, repeat: int) -> dict:
    """Host-to-device bytes/s: BatchLoader's whole records, and (CUDA only) a bare loop copying
    one pinned batch of the same bytes to the device on a side stream."""
    loader = BatchLoader(ds, batch, shuffle=True, seed=0, device=device)
    first_batch_matches(loader, BatchLoader(ds, batch, shuffle=True, seed=0))
    nbytes = batch * int(ds.reader.records.nbytes[0])

    def epoch() -> int:
        return sum(images.nbytes for images, _ in loader)

    rates = {"loader": timed(epoch, device, repeat)}
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)

        def bare() -> int:
            with torch.cuda.stream(stream):
                for _ in range(len(loader)):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
            return nbytes * len(loader)

        rates["bare"] = timed(bare, device, repeat)
    return rates


def crop_rates(
    ds: MemmapImageDataset, src: Path, device: torch.device, args: argparse.Namespace
) -> dict:
    """img/s of RandomResizedCrop(``args.crop``) and a flip, to batches on ``device``:
    BatchLoader there, the CPU path then ``.to(device)``, and decoding and cropping in a
    DataLoader of ``args.workers`` workers."""
    batch, workers, repeat = args.batch_size, args.workers, args.repeat
    kw: dict[str, Any] = {"shuffle": True, "seed": 0, "crop": RandomResizedCrop(args.crop),
                          "flip": True}  # fmt: skip
    loader = BatchLoader(ds, batch, device=device, **kw)
    cpu = BatchLoader(ds, batch, **kw)
    first_batch_matches(loader, cpu)

    def count(batches: Iterable[Any], move: bool = False, pinned: bool = False) -> int:
        n = 0
        for images, labels in batches:
            if move:  # not asynchronously from the CPU path's ring (its buffers are reused)
                images = images.to(device, non_blocking=pinned)
            n += len(labels)
        return n

    samples = [(str(p), k) for k, p in enumerate(sorted(src.rglob("*.jpg")))]
    decoding = DecodingDataset(samples, transform=Compose([RandomResizedCrop(args.crop),
                                                           RandomHorizontalFlip()]))  # fmt: skip
    dataloader = DataLoader(decoding, batch, shuffle=True, num_workers=workers,
                            pin_memory=device.type == "cuda", persistent_workers=workers > 0,
                            collate_fn=collate)  # fmt: skip
    return {
        "loader": timed(lambda: count(loader), device, repeat),
        "cpu path": timed(lambda: count(cpu, move=True), device, repeat),
        "dataloader": timed(lambda: count(dataloader, True, device.type == "cuda"), device, repeat),
    }


def collate(samples: list[tuple[Any, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 N x H x W x C images and int64 labels, as BatchLoader gives them."""
    images = torch.stack([torch.from_numpy(img) for img, _ in samples])
    return images, torch.tensor([label for _, label in samples])


def tiny_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes),
    )  # fmt: skip


def step_times(
    ds: MemmapImageDataset, device: torch.device, batch: int, crop: int, repeat: int
) -> dict:
    """ms per training step of a tiny CNN on RandomResizedCrop(``crop``) batches: fed by
    ``BatchLoader(device=...)`` (normalised there, channels_last), and on one batch already on
    the device (no loader in the way)."""
    model = tiny_cnn(4).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = BatchLoader(ds, batch, shuffle=True, seed=0, crop=RandomResizedCrop(crop), flip=True,
                         device=device, normalize=IMAGENET, channels_last=True)  # fmt: skip
    fixed = [t.clone() for t in next(iter(loader))]  # kept: a CPU batch's buffer is reused

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(model(images), labels.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def with_loader() -> int:
        steps = 0
        for images, labels in loader:
            step(images, labels)
            steps += 1
        return steps

    def without() -> int:
        for _ in range(len(loader)):
            step(*fixed)
        return len(loader)

    return {"loader": 1000 / timed(with_loader, device, repeat),
            "fixed": 1000 / timed(without, device, repeat)}  # fmt: skip


def table(results: dict, tests: str, args: argparse.Namespace, device: torch.device) -> str:
    m = machine_description()
    gpu = torch.cuda.get_device_name(device)
    copy, crop, train = results["copy"], results["crop"], results["train"]
    gb, c = 1e9, args.crop
    rows = [
        ("needs_cuda tests", tests),
        ("H2D, bare pinned copy loop (one batch, side stream)", f"{copy['bare'] / gb:.2f} GB/s"),
        (f"H2D, BatchLoader(device=\"cuda\"), whole {c}x{c} records",
         f"{copy['loader'] / gb:.2f} GB/s ({copy['loader'] / copy['bare']:.0%} of the bare loop)"),
        (f"RandomResizedCrop({c}) + flip, BatchLoader(device=\"cuda\")",
         f"{crop['loader']:.0f} img/s"),
        ("the same, BatchLoader CPU path then .to(\"cuda\")", f"{crop['cpu path']:.0f} img/s"),
        (f"the same, decode + crop in a DataLoader ({args.workers} workers)",
         f"{crop['dataloader']:.0f} img/s"),
        (f"tiny CNN step at {c // 2}x{c // 2}, batch already on the GPU",
         f"{train['fixed']:.2f} ms"),
        ("tiny CNN step, fed by BatchLoader(device=\"cuda\")", f"{train['loader']:.2f} ms"),
    ]  # fmt: skip
    lines = [
        f"GPU: {gpu}; CPU: {m['cpu']}, {m['cores']} cores, {m['ram']}; torch {m['torch']} "
        f"(CUDA {torch.version.cuda}); mmcache {m['mmcache']}.",
        f"{args.images} photo-like {args.size} JPEGs, batch {args.batch_size}, median of "
        f"{args.repeat} epochs after a warm-up. Command: `python tools/cuda_check.py "
        f"--images {args.images} --size {args.size} --crop {c} --batch-size "
        f"{args.batch_size}`.",
        "",
        "| measurement | result |",
        "|---|---|",
        *(f"| {what} | {result} |" for what, result in rows),
    ]
    return "\n".join(lines) + "\n"


def bench(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict:
    size = tuple(int(v) for v in args.size.split("x"))[::-1]  # WxH -> (height, width)
    src, whole, crops = make_caches(workdir, args.images, size, args.crop, args.workers)
    return {
        "copy": copy_rates(whole, device, args.batch_size, args.repeat),
        "crop": crop_rates(crops, src, device, args),
        "train": step_times(crops, device, args.batch_size, args.crop // 2, args.repeat),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table here too (markdown)")
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--size", default="500x375", help="generated images' WxH")
    parser.add_argument("--crop", type=int, default=224, help="RandomResizedCrop's size")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timed epochs of each")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--without-device", action="store_true",
                        help="check that it would run, as without a GPU")  # fmt: skip
    args = parser.parse_args(argv)
    has_device = torch.cuda.is_available() and not args.without_device
    if not has_device:
        why = "--without-device" if args.without_device else "no CUDA device here"
        print(f"{why}: nothing is measured on a GPU and no GPU result is claimed; checking "
              "that the check would run.")  # fmt: skip
        passed, summary = run_tests(device=False)
        print(f"tests/test_cuda.py without a device: {summary}")
        torch.set_num_threads(1)  # a check, not a measure: no thread pool spinning on a busy CPU
        with tempfile.TemporaryDirectory(prefix="mmcache-cuda-check-") as tmp:
            tiny = argparse.Namespace(images=8, size="64x48", crop=32, batch_size=4, repeat=1,
                                      workers=0)  # fmt: skip
            bench(tiny, torch.device("cpu"), Path(tmp))
        print("the bench's parts ran on the CPU at a tiny size, their first batches equal to "
              "the CPU path's (no figure taken).")  # fmt: skip
        if not passed:
            return 1
        if args.out is not None:
            print(f"no table written to {args.out}: there is no GPU figure to give")
        print("would run: `python tools/cuda_check.py` on a machine with a GPU measures it")
        return 0
    device = torch.device("cuda")
    passed, summary = run_tests(device=True)
    print(f"needs_cuda tests: {summary}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mmcache-cuda-check-") as tmp:
        results = bench(args, device, Path(tmp))
    report = table(results, summary, args, device)
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
