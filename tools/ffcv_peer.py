"""FFCV's Loader on the very pixels of an mmcache cache: the benchmark's side-by-side peer.

Run it with the FFCV environment's python (``tools/setup_ffcv.sh`` makes ``.venv-ffcv/``), not
with mmcache's: it imports FFCV and never mmcache, and works with numpy 1.x, which FFCV 1.0.2
needs::

    .venv-ffcv/bin/python tools/ffcv_peer.py --cache CACHE --workdir /tmp/ffcv --json ffcv.json
    .venv-ffcv/bin/python tools/ffcv_peer.py --cache CACHE --validate --epochs 0

It reads the cache with plain numpy and json as ``mmcache/format.py`` specifies (manifest.json,
the index in the manifest's ``index_dtype``, the data file as a memmap of H x W x C uint8
records), writes them to ``WORKDIR/ffcv.beton`` as ``RGBImageField(write_mode='raw',
max_resolution=<the cache's longer side>)`` (so no record is resized: both files hold the same
bytes) plus an ``IntField`` label, then times epochs of FFCV's ``Loader`` with the ImageNet
training pipeline: ``RandomResizedCropRGBImageDecoder((size, size))``, ``RandomHorizontalFlip()``,
``ToTensor()`` (N x size x size x 3 uint8 torch tensors, on the CPU), labels ``IntDecoder()``,
``ToTensor()``; random order with a seed, ``os_cache=True``, ``drop_last=False``.

The first epoch includes numba's compilation of the pipeline; the figure is the median of
epochs 2..N. Every batch is consumed: the loop counts its images and labels and sums one byte
of each image, and each epoch's label histogram must equal the cache's.

``--validate`` also checks that the .beton holds the cache's pixels: every record's raw bytes
as FFCV's ``Reader`` and allocation table locate them, its shape, mode and label; on a cache of
one image size, a few records through a ``SimpleRGBImageDecoder`` pipeline of FFCV's Loader.
The JSON goes to ``--json`` (and to stdout without it); exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from importlib.metadata import version
from pathlib import Path

import numpy as np

FILLED = 1  # mmcache/format.py: a record whose pixels are complete
FFCV_RAW = 1  # ffcv/fields/rgb_image.py IMAGE_MODES["raw"]


class Cache:
    """The records of an mmcache cache, read with numpy and json only (see mmcache/format.py)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        if not (self.folder / "manifest.json").is_file():
            raise SystemExit(f"{self.folder}: no manifest.json, so no mmcache cache there")
        m = json.loads((self.folder / "manifest.json").read_text(encoding="utf-8"))
        # RGB records, as numpy reads them; a lazy cache once every record is filled (below).
        needs = set(m.get("requires", [])) - {"layout:rgb", "fill-markers"}
        if m.get("magic") != "mmcache" or m.get("format_version", [None])[0] != 5 or needs:
            raise SystemExit(f"{self.folder}: not an mmcache cache of format 5.x in RGB")
        self.manifest = m
        files = {k: self.folder / v for k, v in m["files"].items()}
        index_dtype = np.dtype([tuple(f) for f in m["index_dtype"]])
        state_dtype = np.dtype([tuple(f) for f in m["state_dtype"]])
        self.index = np.fromfile(files["index"], dtype=index_dtype)
        self.state = np.fromfile(files["state"], dtype=state_dtype)
        n = int(m["count"])
        if len(self.index) != n or len(self.state) != n:
            raise SystemExit(f"{self.folder}: the index or state file does not hold {n} records")
        if n == 0:
            raise SystemExit(f"{self.folder}: the cache holds no image")
        unfilled = int((self.state["state"] != FILLED).sum())
        if unfilled:
            raise SystemExit(
                f"{self.folder}: {unfilled} of {n} records are not filled (a lazy cache?); "
                "fill it first (mmcache warm CACHE)"
            )
        channels = set(self.index["channels"].tolist())
        if channels != {3}:
            raise SystemExit(
                f"{self.folder}: records have {sorted(channels)} channels; FFCV's "
                "RGBImageField holds 3 (build the cache with --color rgb)"
            )
        self.data = np.memmap(files["data"], dtype=np.uint8, mode="r")
        self.labels = self.index["label"].astype(np.int64)
        self.shapes = {(int(h), int(w)) for h, w in zip(self.index["height"], self.index["width"])}
        self.longer_side = int(np.maximum(self.index["height"], self.index["width"]).max())
        self.record_bytes = int(
            (self.index["height"].astype(np.int64) * self.index["width"] * 3).max()
        )

    def __len__(self) -> int:
        return len(self.index)

    def image(self, i: int) -> np.ndarray:
        """Record i as an H x W x 3 uint8 view of the memory map (no copy)."""
        r = self.index[i]
        h, w, c = int(r["height"]), int(r["width"]), int(r["channels"])
        off = int(r["offset"])
        return self.data[off : off + h * w * c].reshape(h, w, c)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        # DatasetWriter's workers call this: (image, label), as the fields are declared.
        return self.image(int(i)), int(self.labels[i])


def write_beton(cache: Cache, path: Path, workers: int) -> dict:
    """Write the cache's records to an FFCV .beton, RAW at the cache's longer side."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    # A sample must fit in one of the writer's pages (a power of 2, 2 MiB at least): a worker
    # that fails to allocate dies, and the writer then waits for it forever.
    page_size = 1 << 23  # DatasetWriter's default, 8 MiB
    while page_size < cache.record_bytes:
        page_size <<= 1
    fields = {
        "image": RGBImageField(write_mode="raw", max_resolution=cache.longer_side),
        "label": IntField(),
    }
    path.unlink(missing_ok=True)
    writer = DatasetWriter(str(path), fields, page_size=page_size, num_workers=workers)
    start = time.perf_counter()
    writer.from_indexed_dataset(cache)
    # Flushed, as mmcache's build flushes its files: otherwise the first timed epochs run while
    # the kernel writes the new file back (300 MB at the bench's settings), and run slower.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return {
        "write_seconds": time.perf_counter() - start,
        "beton_bytes": path.stat().st_size,
        "page_size": page_size,
        "max_resolution": cache.longer_side,
    }


def train_loader(beton: Path, args: argparse.Namespace):
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor

    return Loader(
        str(beton),
        batch_size=args.batch_size,
        num_workers=args.workers,
        order=OrderOption.RANDOM,
        os_cache=True,
        drop_last=False,
        seed=args.seed,
        pipelines={
            "image": [
                RandomResizedCropRGBImageDecoder((args.size, args.size)),
                RandomHorizontalFlip(),
                ToTensor(),
            ],
            "label": [IntDecoder(), ToTensor()],
        },
    )


def time_epochs(cache: Cache, beton: Path, args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    loader = train_loader(beton, args)
    loader_seconds = time.perf_counter() - start
    expected = np.bincount(cache.labels, minlength=int(cache.labels.max()) + 1)
    seconds, cpu, yielded, labels_ok, batch = [], [], [], [], None
    for _ in range(args.epochs):
        counts = np.zeros_like(expected)
        n = 0
        touched = 0
        start, cpu_start = time.perf_counter(), time.process_time()
        for images, labels in loader:
            # Consume the batch: its size, one byte of each image, and every label.
            n += images.shape[0]
            touched += int(images[:, 0, 0, 0].sum())
            lab = labels.numpy().reshape(-1)
            if len(lab) != images.shape[0]:
                raise SystemExit(f"a batch of {images.shape[0]} images had {len(lab)} labels")
            counts += np.bincount(lab, minlength=len(counts))[: len(counts)]
            if batch is None:
                batch = {
                    "images": {
                        "type": f"{type(images).__module__}.{type(images).__name__}",
                        "shape": list(images.shape),
                        "dtype": str(images.dtype),
                    },
                    "labels": {"shape": list(labels.shape), "dtype": str(labels.dtype)},
                }
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        yielded.append(n)
        labels_ok.append(bool((counts == expected).all()))
    timed, timed_cpu = seconds[1:] or seconds, cpu[1:] or cpu
    return {
        "loader_seconds": loader_seconds,
        "epoch_seconds": seconds,
        # FFCV's threads are this process's: its CPU time is theirs, steadier on a busy machine.
        "cpu_seconds_per_epoch": cpu,
        "cpu_ms_per_img": 1000 * statistics.median(timed_cpu) / len(cache) if timed else None,
        "yielded_per_epoch": yielded,
        "labels_match_per_epoch": labels_ok,
        "img_per_s": len(cache) / statistics.median(timed) if timed else None,
        "img_per_s_of": "median of epochs 2..N" if len(seconds) > 1 else "epoch 1 (JIT included)",
        "batch": batch,
    }


def validate(cache: Cache, beton: Path, args: argparse.Namespace) -> dict:
    """Check the .beton holds the cache's pixels and labels, record by record."""
    from ffcv.reader import Reader

    reader = Reader(str(beton))
    report: dict = {"records": len(cache), "problems": []}
    problems = report["problems"]
    if int(reader.num_samples) != len(cache):
        problems.append(f"the .beton has {reader.num_samples} samples, the cache {len(cache)}")
        return report
    names = list(reader.field_names)
    meta = reader.metadata
    image_meta = meta[meta.dtype.names[names.index("image")]]
    label_meta = meta[meta.dtype.names[names.index("label")]]
    if not (image_meta["mode"] == FFCV_RAW).all():
        problems.append("some records are not stored RAW")
    if (
        not (image_meta["height"] == cache.index["height"]).all()
        or not (image_meta["width"] == cache.index["width"]).all()
    ):
        problems.append("record shapes differ (resized by max_resolution?)")
    if not (label_meta.astype(np.int64) == cache.labels).all():
        problems.append("labels differ")
    # FFCV's OS-cache reader: a record is the bytes at data_ptr, as long as its allocation.
    table = reader.alloc_table
    sizes = dict(zip(table["ptr"].tolist(), table["size"].tolist()))
    mm = np.memmap(str(beton), dtype=np.uint8, mode="r")
    bad_pixels, bad_crc = [], []
    for i in range(len(cache)):
        img = cache.image(i)
        if zlib.crc32(img) != int(cache.state["crc32"][i]):
            bad_crc.append(i)
        ptr = int(image_meta["data_ptr"][i])
        size = sizes.get(ptr, -1)
        if size != img.nbytes or not np.array_equal(mm[ptr : ptr + size], img.reshape(-1)):
            bad_pixels.append(i)
    report["raw_records_equal"] = len(cache) - len(bad_pixels)
    if bad_crc:
        problems.append(f"{len(bad_crc)} cache records fail their CRC-32, first {bad_crc[:5]}")
    if bad_pixels:
        problems.append(f"{len(bad_pixels)} records' bytes differ, first {bad_pixels[:5]}")
    report["decoded"] = decoded_check(cache, beton, args, problems)
    return report


def decoded_check(cache: Cache, beton: Path, args: argparse.Namespace, problems: list) -> str:
    """A few records through FFCV's own Loader and decoder, against the cache's pixels."""
    if len(cache.shapes) != 1:
        return "skipped: SimpleRGBImageDecoder needs one image size"
    from ffcv.fields.basics import IntDecoder
    from ffcv.fields.rgb_image import SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import ToTensor

    rng = np.random.default_rng(args.seed)
    picks = sorted({0, len(cache) - 1, *rng.integers(0, len(cache), 6).tolist()})
    loader = Loader(
        str(beton),
        batch_size=len(picks),
        num_workers=1,
        order=OrderOption.SEQUENTIAL,
        indices=picks,
        drop_last=False,
        pipelines={
            "image": [SimpleRGBImageDecoder(), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        },
    )
    got = []
    for images, labels in loader:
        got.extend(zip(images.numpy(), labels.numpy().reshape(-1)))
    if len(got) != len(picks):
        problems.append(f"the decoded check yielded {len(got)} of {len(picks)} records")
        return "failed"
    bad = [
        i
        for i, (img, lab) in zip(picks, got)
        if not np.array_equal(img, cache.image(i)) or int(lab) != cache.labels[i]
    ]
    if bad:
        problems.append(f"records {bad} decode to other pixels or labels")
        return "failed"
    return f"records {picks} decode to the cache's pixels and labels"


def versions() -> dict:
    import cv2

    out = {"python": platform.python_version()}
    for name in ("ffcv", "numba", "llvmlite", "numpy", "torch", "opencv-python"):
        try:
            out[name] = version(name)
        except Exception:  # a distribution of another name: not worth failing a bench over
            out[name] = None
    out["cv2"] = cv2.__version__
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", required=True, help="an mmcache cache folder")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="FFCV's threads (and writer processes)")
    p.add_argument("--epochs", type=int, default=4, help="timed epochs; 0 with --validate")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop output side")
    p.add_argument("--seed", type=int, default=0, help="FFCV's order seed")
    p.add_argument("--workdir", help="where ffcv.beton goes (default: a temporary folder)")
    p.add_argument("--json", help="write the result here (default: stdout)")
    p.add_argument("--validate", action="store_true", help="check the .beton's pixels too")
    args = p.parse_args(argv)

    cache = Cache(args.cache)
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="ffcv-peer-")
    workdir = Path(args.workdir or tmp)
    workdir.mkdir(parents=True, exist_ok=True)
    beton = workdir / "ffcv.beton"
    try:
        result = {
            "method": "FFCV Loader, RAW, RandomResizedCropRGBImageDecoder + flip + ToTensor",
            "cache": str(cache.folder),
            "images": len(cache),
            "image_sizes": sorted(f"{w}x{h}" for h, w in cache.shapes)[:10],
            "color": cache.manifest.get("options", {}).get("color"),
            "settings": {
                "batch_size": args.batch_size,
                "workers": args.workers,
                "epochs": args.epochs,
                "size": args.size,
                "seed": args.seed,
                "order": "RANDOM",
                "os_cache": True,
                "drop_last": False,
            },
            "versions": versions(),
            "beton": str(beton),
        }
        result.update(write_beton(cache, beton, args.workers))
        if args.validate:
            result["validate"] = validate(cache, beton, args)
        if args.epochs > 0:
            result.update(time_epochs(cache, beton, args))
        problems = list(result.get("validate", {}).get("problems", []))
        for e, n in enumerate(result.get("yielded_per_epoch", []), 1):
            if n != len(cache):
                problems.append(f"epoch {e} yielded {n} images, the cache holds {len(cache)}")
        for e, ok in enumerate(result.get("labels_match_per_epoch", []), 1):
            if not ok:
                problems.append(f"epoch {e}'s labels are not the cache's")
        result["ok"] = not problems
        result["problems"] = problems
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    for problem in problems:
        print(f"ffcv_peer: {problem}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
