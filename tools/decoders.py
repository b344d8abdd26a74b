"""Decoder speed and exactness on this machine: which JPEG decoder should the build use?

Measures, on one core, the images per second of cv2.imread, cv2.imdecode, simplejpeg, Pillow
and OpenCV's DCT-domain reduced decoding (IMREAD_REDUCED_COLOR_2/4) on generated photo-like
720x480 JPEGs (quality 90), and whether each gives pixels identical to the reference,
``cv2.imread(path, IMREAD_COLOR)`` then BGR->RGB. A reduced decode is compared with the
reference shrunk by INTER_AREA to the same size (what a build with that size stores), and its
largest absolute difference is printed.

Usage: python tools/decoders.py [--images 200] [--source FOLDER] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mmcache.sample_data import make_image_folder  # noqa: E402


def _reference(path: str) -> np.ndarray:
    return cv2.cvtColor(cv2.imread(path, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def _decoders() -> dict:
    """name -> (decode(path) -> RGB array, reduction factor)."""
    out = {
        "cv2.imread": (lambda p: cv2.cvtColor(cv2.imread(p), cv2.COLOR_BGR2RGB), 1),
        "cv2.imdecode": (
            lambda p: cv2.cvtColor(
                cv2.imdecode(np.fromfile(p, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB
            ),
            1,
        ),
        "cv2.imread REDUCED_2": (
            lambda p: cv2.cvtColor(cv2.imread(p, cv2.IMREAD_REDUCED_COLOR_2), cv2.COLOR_BGR2RGB),
            2,
        ),
        "cv2.imread REDUCED_4": (
            lambda p: cv2.cvtColor(cv2.imread(p, cv2.IMREAD_REDUCED_COLOR_4), cv2.COLOR_BGR2RGB),
            4,
        ),
    }
    try:
        import simplejpeg

        out["simplejpeg"] = (
            lambda p: simplejpeg.decode_jpeg(Path(p).read_bytes(), colorspace="RGB"),
            1,
        )
        out["simplejpeg fastdct+fastupsample"] = (
            lambda p: simplejpeg.decode_jpeg(
                Path(p).read_bytes(), colorspace="RGB", fastdct=True, fastupsample=True
            ),
            1,
        )
    except ImportError:
        pass
    try:
        from PIL import Image, ImageOps

        def pil(p):
            with Image.open(p) as im:
                return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))

        def pil_draft(p):
            with Image.open(p) as im:
                im.draft("RGB", (im.width // 2, im.height // 2))
                return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))

        out["Pillow"] = (pil, 1)
        out["Pillow draft 1/2"] = (pil_draft, 2)
    except ImportError:
        pass
    return out


def measure(paths: list[str], repeat: int = 3) -> list[dict]:
    """Per decoder: img/s (best of ``repeat`` passes; decoders that take bytes read the file
    in the timed loop, as a build would), identical-to-reference count and max abs difference."""
    cv2.setNumThreads(1)
    refs = [_reference(p) for p in paths]
    decoders = _decoders()
    # Passes interleaved round-robin, best kept: on a shared machine, load that comes and goes
    # then hits every decoder alike instead of whichever ran during it.
    best = dict.fromkeys(decoders, float("inf"))
    for _ in range(repeat):
        for name, (fn, _factor) in decoders.items():
            start = time.perf_counter()
            for p in paths:
                fn(p)
            best[name] = min(best[name], time.perf_counter() - start)
    rows = []
    for name, (fn, factor) in decoders.items():
        identical, maxdiff = 0, 0
        for p, ref in zip(paths, refs):
            got = fn(p)
            if factor > 1:
                h, w = got.shape[:2]
                ref = cv2.resize(ref, (w, h), interpolation=cv2.INTER_AREA)
            if got.shape == ref.shape:
                d = int(np.abs(got.astype(np.int16) - ref).max())
                identical += d == 0
                maxdiff = max(maxdiff, d)
            else:
                maxdiff = 255
        rows.append(
            {
                "decoder": name,
                "img_per_s": len(paths) / best[name],
                "identical": identical,
                "images": len(paths),
                "max_abs_diff": maxdiff,
                "reduction": factor,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", help="a folder of JPEGs (default: generate 720x480 ones)")
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mmcache-decoders-") as tmp:
        root = (
            Path(args.source)
            if args.source
            else make_image_folder(Path(tmp) / "img", classes=1, per_class=args.images)
        )
        paths = sorted(str(q) for q in root.rglob("*") if q.suffix.lower() in (".jpg", ".jpeg"))[
            : args.images
        ]
        rows = measure(paths, args.repeat)
    base = rows[0]["img_per_s"]
    print(f"{len(paths)} JPEGs, one core (cv2.setNumThreads(1)), best of {args.repeat}")
    print(f"{'decoder':34} {'img/s':>8} {'vs imread':>9}  identical  max|diff|")
    for r in rows:
        note = "" if r["reduction"] == 1 else f" (vs reference area-shrunk 1/{r['reduction']})"
        print(
            f"{r['decoder']:34} {r['img_per_s']:8.0f} {r['img_per_s'] / base:8.2f}x  "
            f"{r['identical']:4}/{r['images']:<4}  {r['max_abs_diff']:5}{note}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
