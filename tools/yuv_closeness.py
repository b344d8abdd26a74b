"""How close images read from a ``--pixels yuv420`` cache are to those of an RGB cache.

Usage: ``python tools/yuv_closeness.py [--photos N] [--short-side 256] [--crop 224]``.

Builds an RGB cache and an I420 cache of the same folder, with the same options, for two sets:
generated photo-like JPEGs (``mmcache.sample_data``) and every image in tests/data/testimages
(real-world files: camera JPEGs, PNGs, gray, CMYK, EXIF-rotated, 16-bit). For each image it
compares (a) the whole record as ``MemmapImageDataset`` returns it and (b) the output of
``BatchLoader`` with RandomResizedCrop and with CenterResizedCrop (the same seed, so the same
boxes, on both caches). Prints each set's cache sizes, then, per set and per kind, the median
and worst PSNR (dB, of the 8-bit image) and the largest per-pixel difference (levels, 0-255),
then the worst images. An image identical in both is given a PSNR of 99 dB.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mmcache  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

TESTIMAGES = Path(__file__).resolve().parents[1] / "tests" / "data" / "testimages"
INF = 99.0  # PSNR of identical images, for medians


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return INF if mse == 0 else 10 * np.log10(255.0**2 / mse)


def compare(
    src: Path, work: Path, short_side: int | None, crop: int, seed: int
) -> tuple[dict[str, list[tuple[float, int, str]]], list[int]]:
    """Per kind, a list of (psnr, max difference, image name) over the images of ``src``; and
    the two caches' data bytes (rgb, yuv420)."""
    opts = {"short_side": short_side} if short_side else {}
    caches = {}
    for layout in ("rgb", "yuv420"):
        cache = work / f"{src.name}-{layout}"
        mmcache.build_cache(src, cache, workers=0, pixels=layout, **opts)
        caches[layout] = mmcache.MemmapImageDataset(cache, on_stale="ignore")
    rgb, yuv = caches["rgb"], caches["yuv420"]
    sizes = [sum(ds.manifest.sizes.values()) for ds in (rgb, yuv)]
    names = [Path(p).name for p, _ in rgb.samples]
    rows: dict[str, list[tuple[float, int, str]]] = {"whole record": []}
    for i, name in enumerate(names):
        a, b = rgb[i][0], yuv[i][0]
        rows["whole record"].append((psnr(a, b), int(np.abs(a.astype(int) - b).max()), name))
    for kind, make in (
        (f"RandomResizedCrop({crop})", lambda: mmcache.RandomResizedCrop(crop)),
        (f"CenterResizedCrop({crop})", lambda: mmcache.CenterResizedCrop(crop)),
    ):
        rows[kind] = []
        batches = [
            mmcache.BatchLoader(ds, 16, shuffle=False, seed=seed, crop=make(), num_threads=1)
            for ds in (rgb, yuv)
        ]
        k = 0
        with warnings.catch_warnings():
            # tests/data/testimages are small (32 to 128 pixels): upscaled on purpose, to
            # compare the layouts on every real file
            warnings.filterwarnings("ignore", "RandomResizedCrop|CenterResizedCrop", UserWarning)
            for (a, _), (b, _) in zip(*batches):  # each batch is read before the next fills
                for x, y in zip(a.numpy(), b.numpy()):
                    diff = int(np.abs(x.astype(int) - y).max())
                    rows[kind].append((psnr(x, y), diff, names[k]))
                    k += 1
    return rows, sizes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", type=int, default=64, help="generated photos (default 64)")
    p.add_argument("--photo-size", default="500x375", help="their size (default 500x375)")
    p.add_argument("--short-side", type=int, default=256, help="build option (default 256)")
    p.add_argument("--crop", type=int, default=224, help="crop output side (default 224)")
    p.add_argument("--worst", type=int, default=5, help="worst images listed (default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    w, h = (int(v) for v in args.photo_size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        photos = make_image_folder(
            work / "photos", classes=1, per_class=args.photos, size=(h, w), seed=args.seed
        )
        sets = {
            f"generated photos ({args.photos}, {w}x{h} JPEG q90)": photos,
            "tests/data/testimages": _copy_testimages(work / "testimages"),
        }
        print(
            f"yuv420 cache vs rgb cache, --short-side {args.short_side}; PSNR in dB, "
            "max difference in levels (0-255)"
        )
        print(f"{'set / kind':<44} {'images':>6} {'median':>7} {'worst':>7} {'max diff':>8}")
        worst_all = []
        for title, src in sets.items():
            rows, (rgb_bytes, yuv_bytes) = compare(src, work, args.short_side, args.crop, args.seed)
            print(
                f"{title}: cache {yuv_bytes:,} bytes against {rgb_bytes:,} "
                f"({yuv_bytes / rgb_bytes:.3f}x)"
            )
            for kind, values in rows.items():
                ps = np.array([v[0] for v in values])
                print(
                    f"  {kind:<42} {len(values):>6} {np.median(ps):>7.1f} {ps.min():>7.1f} "
                    f"{max(v[1] for v in values):>8}"
                )
                worst_all += [(v[0], v[1], kind, v[2], title) for v in values]
        print(f"worst {args.worst} (PSNR, max diff, kind, image):")
        for ps, diff, kind, name, title in sorted(worst_all)[: args.worst]:
            print(f"  {ps:6.1f} dB {diff:4} levels  {kind:<24} {name} ({title.split(' (')[0]})")
    print(
        f"reproduce: python tools/yuv_closeness.py --photos {args.photos} --photo-size "
        f"{args.photo_size} --short-side {args.short_side} --crop {args.crop} --seed {args.seed}"
    )
    return 0


def _copy_testimages(dst: Path) -> Path:
    """The test images as a one-class folder (an ImageFolder needs a class folder)."""
    folder = dst / "all"
    folder.mkdir(parents=True)
    for path in sorted(TESTIMAGES.iterdir()):
        if path.suffix.lower() in (".jpg", ".jpeg", ".png"):
            (folder / path.name).write_bytes(path.read_bytes())
    return dst


if __name__ == "__main__":
    sys.exit(main())
