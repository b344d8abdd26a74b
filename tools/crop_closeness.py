"""How close each crop interpolation is to torchvision's resize, and how fast it runs.

Usage: ``python tools/crop_closeness.py [--crops N]``.

Draws RandomResizedCrop(224) boxes (torchvision's sampling) on photo-like images stored at
shorter side 256 (384x256), resizes each box with every interpolation mmcache offers, and
compares the result with two references of torchvision's ``resized_crop(antialias=True)``:
torch's ``interpolate(mode="bilinear", antialias=True)`` on uint8 (what torchvision runs on
uint8 tensors) and a float64 implementation written from the documented algorithm (PIL's
ImagingResample with the triangle filter). Prints mean and max absolute differences in levels
(0-255), the share of pixels off by more than 1, and the time per crop on one core; FFCV's
``RandomResizedCropRGBImageDecoder`` resizes with OpenCV's INTER_AREA, the "area" row.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.nn.functional import interpolate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache.sample_data import make_photo  # noqa: E402
from mmcache.transforms import DRAWS, RandomResizedCrop, resized_crop  # noqa: E402

# (interpolation, antialias): every kernel a crop offers (antialias matters to these two only).
KERNELS = [
    ("bilinear", True),
    ("bilinear", False),
    ("area", True),
    ("bicubic", True),
    ("bicubic", False),
    ("lanczos", True),
    ("nearest", True),
]


def documented_reference(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """torchvision's antialiased bilinear resize from its documented algorithm, in float64."""

    def weights(n_in: int, n_out: int) -> np.ndarray:
        scale = n_in / n_out
        support = max(scale, 1.0)
        m = np.zeros((n_out, n_in))
        for o in range(n_out):
            center = (o + 0.5) * scale
            lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
            x = np.arange(lo, hi)
            w = np.maximum(0.0, 1.0 - np.abs((x - center + 0.5) / support))
            m[o, lo:hi] = w / w.sum()
        return m

    t = np.einsum("oh,hwc->owc", weights(img.shape[0], out_h), img.astype(np.float64))
    t = np.einsum("pw,owc->opc", weights(img.shape[1], out_w), t)
    return np.clip(np.round(t), 0, 255).astype(np.uint8)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--crops", type=int, default=300, help="boxes to compare (default 300)")
    p.add_argument("--images", type=int, default=20, help="photos to crop from (default 20)")
    p.add_argument("--size", type=int, default=224, help="output side (default 224)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    photos = [
        cv2.cvtColor(cv2.resize(make_photo(rng, 480, 720), (384, 256),
                                interpolation=cv2.INTER_AREA), cv2.COLOR_BGR2RGB)
        for _ in range(args.images)
    ]  # fmt: skip
    crop = RandomResizedCrop(args.size)
    boxes = crop.boxes(np.array([[256, 384]] * args.crops), rng.random((args.crops, DRAWS)))
    size = (args.size, args.size)
    refs = []
    for k, (top, left, h, w) in enumerate(boxes):
        box = np.ascontiguousarray(photos[k % len(photos)][top : top + h, left : left + w])
        chw = torch.from_numpy(box).permute(2, 0, 1)[None]
        kernel = interpolate(chw, size=size, mode="bilinear", antialias=True)
        kernel = kernel[0].permute(1, 2, 0).numpy()
        refs.append((kernel.astype(np.int16), documented_reference(box, *size).astype(np.int16)))
    print(f"{args.crops} RandomResizedCrop({args.size}) boxes of 384x256 photos; levels 0-255")
    print(f"{'interpolation':<16} {'vs torch kernel: mean':>22} {'max':>5} {'>1':>7}   "
          f"{'vs documented: mean':>20} {'max':>5} {'>1':>7}   {'us/crop':>8}")  # fmt: skip
    for name, antialias in KERNELS:
        out = np.empty((*size, 3), np.uint8)
        diffs = [[], []]
        seconds = 0.0
        for k, box in enumerate(boxes):
            start = time.perf_counter()
            resized_crop(photos[k % len(photos)], box, size, name, out, antialias=antialias)
            seconds += time.perf_counter() - start
            for d, ref in zip(diffs, refs[k]):
                d.append(np.abs(out.astype(np.int16) - ref))
        cells = []
        for d in diffs:
            a = np.stack(d)
            cells += [f"{a.mean():.3f}", f"{a.max()}", f"{(a > 1).mean():.2%}"]
        label = name if antialias or name not in ("bilinear", "bicubic") else f"{name}, no aa"
        print(f"{label:<16} {cells[0]:>22} {cells[1]:>5} {cells[2]:>7}   {cells[3]:>20} "
              f"{cells[4]:>5} {cells[5]:>7}   {seconds / len(boxes) * 1e6:>8.0f}")  # fmt: skip
    print("reproduce: python tools/crop_closeness.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
