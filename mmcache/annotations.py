"""Annotations paired with a source's images: segmentation masks, COCO boxes, the user's arrays.

A build given annotations stores them with the images (``mmcache.format``, 4.x): a mask in
each record after its pixels, resized with the image; boxes, their labels and any other
per-image arrays in the generation's ``fields`` file. They come from:

- ``masks=MASKS``: for each image ``IMAGES/rel/name.ext``, the mask ``MASKS/rel/name.*`` (any
  image extension; ``.png`` first), as VOC (``JPEGImages/`` + ``SegmentationClass/``) and
  ADE20K (``images/`` + ``annotations/``) lay them out. A mask is a label map: a single-channel
  8- or 16-bit image of the image's size; a palette PNG (VOC's) is read as its palette
  indices, with Pillow (``pip install pillow``), never as colours. An image without
  its mask, or whose mask is not a label map of its size, is skipped with the reason.
- ``coco=instances.json``: COCO's detection annotations. Each image's boxes (``bbox``, x, y,
  width, height in the JSON's pixels) are stored as ``boxes`` x1, y1, x2, y2 (float32) in the
  stored image's pixels, scaled by the stored size over the JSON's ``width`` and ``height``;
  ``labels``: category ids mapped to 0..K-1 in increasing id order (the names, from
  ``categories``, in the field's ``classes``); ``iscrowd``. An image with no annotation, or
  not in the JSON, has zero boxes. Instance masks (polygons, RLE) are not stored.
- ``fields={name: {relative path: array}}``: the user's own arrays, one per image (an image
  left out has zero rows), all of one dtype (integers or floats) and one shape after the
  first axis, which may vary (keypoints: ``(people, 17, 3)``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from . import format as fmt
from . import pixels as px
from .errors import CacheFormatError, SourceError

__all__ = [
    "Annotations", "MASK_EXTENSIONS", "NO_MASK", "annotate", "read_mask", "recorded_annotations",
]  # fmt: skip

# How the reason of an image skipped for want of its mask starts.
NO_MASK = "no mask for it in"
# A mask's extensions, in the order one is chosen when several share an image's name.
MASK_EXTENSIONS = (".png", ".bmp", ".tif", ".tiff", ".webp", ".jpg", ".jpeg")
# The fields mmcache keeps for itself: each record's mask file and its (size, mtime_ns).
MASK_PATH, MASK_STAT = "_mask_path", "_mask_stat"
# Fields whose rows are one per box: a crop that drops a box drops its rows of these too.
PER_BOX = ("labels", "iscrowd")
# COCO's JSON is read whole: a bound far above COCO's own (448 MB for train2017 instances).
MAX_COCO_BYTES = 4 << 30
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PALETTE = 3  # a PNG's IHDR colour type for palette images


@dataclass
class Annotations:
    """What a source's images are paired with, per listed image (in listing order)."""

    masks_root: Path | None = None
    mask_paths: list[str | None] = field(default_factory=list)  # relative to masks_root
    mask_stats: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    coco: Path | None = None
    coco_digest: str = ""
    # (height, width) each image has in the JSON (0, 0 where none), to scale its boxes from.
    coco_sizes: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    # The JSON's images the source lacks (file names), the image ids of its annotations that
    # are not among its images, and how many such annotations: all left out.
    coco_missing: list[str] = field(default_factory=list)
    coco_unknown_ids: list[int] = field(default_factory=list)
    coco_orphans: int = 0
    # Field name -> (its description in the manifest, one array per listed image).
    arrays: dict[str, tuple[dict[str, Any], list[np.ndarray]]] = field(default_factory=dict)
    user: list[str] = field(default_factory=list)  # the fields the user's arrays gave

    def fingerprints(self) -> dict[str, str]:
        """SHA-256 digests of what a build stores from them: ``"annotations"``, of the masks
        and COCO file (the cache records where they are, so a check can look again), and
        ``"fields"``, of the user's arrays (only a build given them can compare)."""
        h = hashlib.sha256()
        h.update(str(self.masks_root).encode("utf-8", "surrogateescape") + b"\0")
        h.update("\0".join(p or "" for p in self.mask_paths).encode("utf-8", "surrogateescape"))
        h.update(np.ascontiguousarray(self.mask_stats, "<i8").tobytes())
        h.update(self.coco_digest.encode())
        out = {"annotations": h.hexdigest()} if self.source_json() else {}
        if self.user:
            u = hashlib.sha256()
            for name in sorted(self.user):
                spec, arrays = self.arrays[name]
                u.update(json.dumps(spec, sort_keys=True).encode())
                for a in arrays:
                    u.update(np.int64(len(a)).tobytes() + np.ascontiguousarray(a).tobytes())
            out["fields"] = u.hexdigest()
        return out

    def source_json(self) -> dict[str, str]:
        """Where they come from, for the manifest's ``source``: ``masks``, ``coco``."""
        d = {}
        if self.masks_root is not None:
            d["masks"] = str(self.masks_root)
        if self.coco is not None:
            d["coco"] = str(self.coco)
        return d

    def missing_mask(self, i: int) -> str | None:
        """Why listed image ``i`` cannot be stored for want of its mask, or None."""
        if self.masks_root is None or self.mask_paths[i] is not None:
            return None
        return f"{NO_MASK} {self.masks_root} (a file of its relative path and stem)"

    def size_mismatch(self, i: int, native: Sequence[int]) -> str | None:
        """Why listed image ``i``, of ``native`` (height, width) as decoded, cannot take its
        COCO boxes (the JSON gives it another size), or None."""
        if self.coco is None or not self.coco_sizes[i].any() or not native[0]:
            return None
        (jh, jw), (h, w) = (int(v) for v in self.coco_sizes[i]), (int(v) for v in native[:2])
        if (jh, jw) == (h, w):
            return None
        return (
            f"{self.coco} gives it {jw}x{jh} pixels, the image has {w}x{h} (width x height, "
            "EXIF orientation not applied): its boxes would be scaled wrong; correct the JSON's "
            "width and height"
        )

    def mask_file(self, i: int) -> tuple[str, int, int] | None:
        """``(absolute path, size, mtime_ns)`` of image ``i``'s mask as listed, or None."""
        if self.masks_root is None or self.mask_paths[i] is None:
            return None
        rel = self.mask_paths[i]
        assert rel is not None
        size, mtime = (int(v) for v in self.mask_stats[i])
        return os.path.join(self.masks_root, rel), size, mtime

    def specs(self) -> list[dict[str, Any]]:
        """The manifest's ``fields``: each array's description, in the file's order."""
        return [spec for _, (spec, _) in sorted(self.arrays.items())]

    def values(self, records: np.ndarray, shapes: np.ndarray) -> list[list[np.ndarray]]:
        """For each field of ``specs``, the arrays of listed images ``records``, whose stored
        (height, width, ...) are ``shapes``: boxes scaled to the stored image's pixels."""
        out = []
        for name, (_, arrays) in sorted(self.arrays.items()):
            picked = [arrays[i] for i in records.tolist()]
            if name == "boxes" and self.coco is not None:
                picked = [
                    _scaled(b, self.coco_sizes[i], shapes[k])
                    for k, (i, b) in enumerate(zip(records.tolist(), picked))
                ]
            out.append(picked)
        return out


BOX_FIELDS = ("boxes", *PER_BOX)


def _scaled(boxes: np.ndarray, json_hw: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """COCO boxes (x1, y1, x2, y2 in the JSON's pixels) in the stored image's, clipped to it."""
    if not len(boxes):
        return boxes
    h, w = int(stored[0]), int(stored[1])
    jh, jw = int(json_hw[0]) or h, int(json_hw[1]) or w
    out = boxes * np.array([w / jw, h / jh, w / jw, h / jh], np.float64)
    return np.clip(out, 0, [w, h, w, h]).astype(np.float32)


def annotate(
    listing: Any,
    masks: str | os.PathLike | None = None,
    coco: str | os.PathLike | None = None,
    fields: Mapping[str, Mapping[str, Any]] | None = None,
) -> Annotations | None:
    """The annotations of ``listing``'s images from ``masks``, ``coco`` and ``fields`` (see the
    module docstring); None when none is given.

    Raises:
        SourceError: a masks folder or COCO file that is missing or malformed, or fields that
            are not arrays of one dtype and row shape.
    """
    if masks is None and coco is None and not fields:
        return None
    a = Annotations()
    n = len(listing.paths)
    if masks is not None and getattr(listing, "members", None) is not None:
        raise SourceError(
            f"{listing.root}: masks pair with images in a folder, not in an archive; extract "
            "the images (or build without --masks)"
        )
    if masks is not None:
        a.masks_root = Path(masks).expanduser().absolute()
        a.mask_paths, a.mask_stats = _pair_masks(listing.paths, a.masks_root)
        a.arrays[MASK_PATH] = (
            {"name": MASK_PATH, "dtype": "|u1", "shape": [-1]},
            [np.frombuffer(p.encode("utf-8", "surrogateescape") if p else b"", np.uint8)
             for p in a.mask_paths],
        )  # fmt: skip
        a.arrays[MASK_STAT] = (
            {"name": MASK_STAT, "dtype": "<i8", "shape": [1, 2]},
            [a.mask_stats[i : i + 1] for i in range(n)],
        )
    if coco is not None:
        a.coco = Path(coco).expanduser().absolute()
        a.coco_digest, a.coco_sizes, coco_arrays, unmatched = _read_coco(a.coco, listing.paths)
        a.arrays.update(coco_arrays)
        a.coco_missing, a.coco_unknown_ids, a.coco_orphans = unmatched
    for name, by_path in (fields or {}).items():
        if name in a.arrays or name.startswith("_"):
            raise SourceError(f"fields: {name!r} is taken (mmcache's own, or COCO's)")
        a.arrays[name] = _user_field(name, by_path, listing.paths)
        a.user.append(name)
    return a


def _pair_masks(paths: list[str], root: Path) -> tuple[list[str | None], np.ndarray]:
    """Each image's mask (relative to ``root``) and its (size, mtime_ns), found by one walk."""
    if not root.is_dir():
        raise SourceError(f"{root}: masks folder not found (--masks names a folder of label maps)")
    rank = {ext: k for k, ext in enumerate(MASK_EXTENSIONS)}
    found: dict[str, tuple[int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            stem, ext = os.path.splitext(name)
            k = rank.get(ext.lower())
            if k is None or name.startswith("."):
                continue
            key = stem if rel_dir == "." else f"{rel_dir}/{stem}".replace(os.sep, "/")
            if key not in found or k < found[key][0]:
                found[key] = (k, name if rel_dir == "." else f"{rel_dir}/{name}")
    mask_paths: list[str | None] = []
    stats = np.zeros((len(paths), 2), np.int64)
    for i, rel in enumerate(paths):
        hit = found.get(os.path.splitext(rel)[0])
        rel_mask = hit[1].replace(os.sep, "/") if hit else None
        if rel_mask is not None:
            try:
                st = os.stat(root / rel_mask)
                stats[i] = st.st_size, st.st_mtime_ns
            except OSError:
                rel_mask = None
        mask_paths.append(rel_mask)
    return mask_paths, stats


def _read_coco(
    path: Path, paths: list[str]
) -> tuple[
    str,
    np.ndarray,
    dict[str, tuple[dict[str, Any], list[np.ndarray]]],
    tuple[list[str], list[int], int],
]:
    """COCO's annotations for the listed images: the file's digest, each image's JSON size,
    the ``boxes``, ``labels`` and ``iscrowd`` arrays (boxes still in the JSON's pixels), and
    what pairs with nothing: the JSON's images not listed, the unknown image ids of
    annotations, and how many annotations have one."""
    raw, images, anns, by_name, ids, names = _load_coco(path)
    label_of = {cid: k for k, cid in enumerate(ids)}
    classes = [names[cid] or str(cid) for cid in ids]
    if len(set(classes)) != len(classes):
        classes = [f"{names[cid]} ({cid})" for cid in ids]  # repeated names: made unique
    record_of = {}
    for i, rel in enumerate(paths):
        im = by_name.get(rel) or by_name.get(os.path.basename(rel))
        if im is not None:
            record_of[im.get("id")] = i
    image_ids = {im.get("id") for im in images}
    listed = set(paths) | {os.path.basename(rel) for rel in paths}  # as by_name is looked up
    missing = [name for name in map(str, by_name) if name not in listed]
    unknown: dict[Any, None] = {}
    orphans = 0
    n = len(paths)
    sizes = np.zeros((n, 2), np.int64)
    for i in record_of.values():
        im = by_name.get(paths[i]) or by_name[os.path.basename(paths[i])]
        sizes[i] = int(im.get("height") or 0), int(im.get("width") or 0)
    boxes: list[list[list[float]]] = [[] for _ in range(n)]
    labels: list[list[int]] = [[] for _ in range(n)]
    crowd: list[list[int]] = [[] for _ in range(n)]
    for k, ann in enumerate(anns):
        try:
            record = record_of.get(ann["image_id"])
            if record is None:
                if ann["image_id"] not in image_ids:
                    unknown[ann["image_id"]] = None
                    orphans += 1
                continue
            i = record
            x, y, w, h = (float(v) for v in ann["bbox"])
            label = label_of[int(ann["category_id"])]
            is_crowd = int(ann.get("iscrowd", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise SourceError(
                f"{path}: annotation {k}: bad bbox, category_id or iscrowd ({e!r})"
            ) from None
        if not (np.isfinite([x, y, w, h]).all() and w >= 0 and h >= 0):
            raise SourceError(f"{path}: annotation {k}: bbox {ann['bbox']!r} is not x, y, w, h")
        boxes[i].append([x, y, x + w, y + h])
        labels[i].append(label)
        crowd[i].append(is_crowd)
    arrays = _coco_arrays(boxes, labels, crowd, classes)
    unknown_ids = sorted(unknown, key=str)
    return hashlib.sha256(raw).hexdigest(), sizes, arrays, (missing, unknown_ids, orphans)


def _load_coco(
    path: Path,
) -> tuple[bytes, list[Any], list[Any], dict[str, Any], list[int], dict[int, str]]:
    """A COCO file's bytes and what ``_read_coco`` takes from them: its images, annotations,
    images by file name, category ids (sorted) and names; ``SourceError`` if it is no COCO."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_COCO_BYTES + 1)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the COCO annotations ({e.strerror})") from None
    if len(raw) > MAX_COCO_BYTES:
        raise SourceError(f"{path}: larger than {MAX_COCO_BYTES >> 30} GiB; not a COCO file")
    try:
        doc = json.loads(raw)
        images, anns, cats = doc["images"], doc.get("annotations", []), doc["categories"]
        by_name = {str(im["file_name"]): im for im in images}
        ids = sorted({int(c["id"]) for c in cats})
        names = {int(c["id"]): str(c["name"]) for c in cats}
    except (ValueError, KeyError, TypeError) as e:
        raise SourceError(
            f"{path}: not COCO detection annotations ({type(e).__name__}: {e}); expected "
            "an object with images, annotations and categories"
        ) from None
    return raw, images, anns, by_name, ids, names


def _coco_arrays(
    boxes: list[list[list[float]]],
    labels: list[list[int]],
    crowd: list[list[int]],
    classes: list[str],
) -> dict[str, tuple[dict[str, Any], list[np.ndarray]]]:
    """The ``boxes``, ``labels`` and ``iscrowd`` fields: each one's description and arrays."""
    return {
        "boxes": (
            {"name": "boxes", "dtype": "<f4", "shape": [-1, 4]},
            [np.asarray(b, np.float32).reshape(-1, 4) for b in boxes],
        ),
        "labels": (
            {"name": "labels", "dtype": "<i8", "shape": [-1], "classes": classes},
            [np.asarray(v, np.int64) for v in labels],
        ),
        "iscrowd": (
            {"name": "iscrowd", "dtype": "|u1", "shape": [-1]},
            [np.asarray(v, np.uint8) for v in crowd],
        ),
    }


def _user_field(
    name: str, by_path: Mapping[str, Any], paths: list[str]
) -> tuple[dict[str, Any], list[np.ndarray]]:
    """A field of the user's arrays, checked: one dtype and row shape for all."""
    if not (name.isascii() and name.replace("_", "a").isalnum() and len(name) <= 64):
        raise SourceError(f"fields: name {name!r} must be letters, digits and _")
    unknown = set(by_path) - set(paths)
    if unknown:
        raise SourceError(
            f"fields[{name!r}]: {len(unknown)} path(s) not in the source, e.g. "
            f"{sorted(unknown)[0]!r} (keys are paths relative to the source)"
        )
    arrays = {p: np.asarray(v) for p, v in by_path.items()}
    if not arrays:
        raise SourceError(f"fields[{name!r}]: no arrays")
    first = next(iter(arrays.values()))
    dtype = first.dtype.newbyteorder("<") if first.dtype.itemsize > 1 else first.dtype
    if dtype.str not in fmt.FIELD_DTYPES or first.ndim < 1:
        raise SourceError(
            f"fields[{name!r}]: arrays must be integers or floats with at least one axis "
            f"(rows), got {first.dtype} of shape {first.shape}"
        )
    tail = first.shape[1:]
    for p, a in arrays.items():
        if a.dtype != first.dtype or a.shape[1:] != tail:
            raise SourceError(
                f"fields[{name!r}][{p!r}]: {a.dtype} {a.shape}, but the first is "
                f"{first.dtype} {first.shape}: one dtype and one shape after the first axis"
            )
    empty = np.zeros((0, *tail), dtype)
    spec = {"name": name, "dtype": dtype.str, "shape": [-1, *tail]}
    return spec, [arrays.get(p, empty).astype(dtype) for p in paths]


def read_mask(path: str | os.PathLike, dtype: str) -> np.ndarray | str:
    """The label map in the file at ``path`` as an H x W array of ``dtype``, or why it is not
    one: a palette PNG is read as its indices (with Pillow), any other as it is stored
    (``cv2.IMREAD_UNCHANGED``), and it must have one channel and values that fit ``dtype``."""
    try:
        raw = np.fromfile(os.fspath(path), np.uint8)
    except OSError as e:
        return f"its mask {os.fspath(path)!r} cannot be read ({e.strerror})"
    head = raw[:26].tobytes()
    mask: np.ndarray | None
    if head[:8] == _PNG_SIGNATURE and len(head) == 26 and head[25] == _PALETTE:
        indices = _palette_indices(raw.tobytes())
        if isinstance(indices, str):
            return f"its mask {os.fspath(path)!r}: {indices}"
        mask = indices
    else:
        mask = cv2.imdecode(raw, cv2.IMREAD_UNCHANGED) if raw.size else None
    if mask is None:
        return f"its mask {os.fspath(path)!r} cannot be decoded"
    if mask.ndim != 2:
        return (
            f"its mask {os.fspath(path)!r} has {mask.shape[2]} channels: a mask is a label "
            "map of one channel (or a palette PNG)"
        )
    if mask.dtype.kind not in "ui":
        return f"its mask {os.fspath(path)!r} holds {mask.dtype} values, not class numbers"
    limit = np.iinfo(np.dtype(dtype)).max
    if mask.size and (int(mask.max()) > limit or int(mask.min()) < 0):
        return (
            f"its mask {os.fspath(path)!r} holds values up to {int(mask.max())}, more than "
            f"{dtype} stores: build with --mask-dtype uint16"
        )
    return mask.astype(dtype, copy=False)


def _palette_indices(data: bytes) -> np.ndarray | str:
    """A palette PNG's indices, with Pillow (which reads them; OpenCV gives colours)."""
    try:
        from PIL import Image
    except ImportError:
        return (
            "a palette PNG, whose class numbers only Pillow reads: pip install pillow (or, in "
            'a checkout of mmcache, pip install -e ".[masks]")'
        )
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.mode != "P":
                return f"a PNG of mode {im.mode}, not a palette"
            return np.asarray(im)
    except (OSError, ValueError, SyntaxError) as e:
        return f"a palette PNG Pillow cannot read ({e})"


def mask_record(
    pixels: np.ndarray, mask_file: tuple[str, int, int], native: tuple[int, int], dtype: str
) -> np.ndarray | tuple[int, str]:
    """The record of decoded ``pixels`` with the mask of ``mask_file`` (path, size and mtime
    as listed), resized to them with nearest-neighbour from the image's ``native`` size; or
    ``(BAD_* code, reason)``."""
    path, size, mtime = mask_file
    try:
        st = os.stat(path)
    except OSError:
        return fmt.BAD_SOURCE_CHANGED, "its mask vanished since it was listed"
    if (st.st_size, st.st_mtime_ns) != (size, mtime):
        return fmt.BAD_SOURCE_CHANGED, "its mask changed since it was listed"
    mask = read_mask(path, dtype)
    if isinstance(mask, str):
        return fmt.BAD_MASK, mask
    if mask.shape != tuple(native):
        return fmt.BAD_MASK, (
            f"its mask {path!r} is {mask.shape[1]}x{mask.shape[0]}, the image "
            f"{native[1]}x{native[0]} (width x height): they must be the same size"
        )
    h, w = px.image_shape(pixels)[:2]
    if (h, w) != mask.shape:
        # Nearest by pixel centres (INTER_NEAREST_EXACT), the geometry the image's resize has.
        mask = cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST_EXACT)
    return px.with_mask(pixels, mask, dtype)


def user_fields(m: fmt.Manifest) -> list[dict[str, Any]]:
    """The descriptions of the fields of cache ``m`` that the user's arrays gave (not
    mmcache's own, not COCO's)."""
    coco = BOX_FIELDS if m.source.get("coco") else ()
    return [f for f in m.fields if not f["name"].startswith("_") and f["name"] not in coco]


def carry_user_fields(previous: fmt.CacheFiles, listing: Any) -> None:
    """Give ``listing`` the user's arrays of cache ``previous`` (a build not given them
    again): each listed path keeps its rows, a new path has none."""
    specs = user_fields(previous.manifest)
    if not specs:
        return
    a = listing.annotations = listing.annotations or Annotations()
    row = {previous.path(i): i for i in range(len(previous.index))}
    for spec in specs:
        name = spec["name"]
        empty = np.zeros((0, *spec["shape"][1:]), spec["dtype"])
        a.arrays[name] = (
            spec,
            [
                previous.field_rows(name, row[p]) if p in row else empty
                for p in listing.paths
            ],
        )
        a.user.append(name)


def recorded_mask(files: fmt.CacheFiles, i: int) -> tuple[str, int, int] | None:
    """Record ``i``'s mask ``(path relative to the masks folder, size, mtime_ns)`` as the
    cache recorded it, or None for a cache whose records carry no mask.

    Raises:
        CacheFormatError: the recorded mask path could lead outside the masks folder.
    """
    if files.manifest.mask is None or not files.manifest.source.get("masks"):
        return None
    if MASK_PATH not in files.fields:
        return None
    rel = files.field_rows(MASK_PATH, i).tobytes().decode("utf-8", "surrogateescape")
    if fmt.check_relative_path(rel) is not None:
        raise CacheFormatError(f"{files.manifest.path}: unsafe mask path {rel!r}")
    size, mtime = (int(v) for v in files.field_rows(MASK_STAT, i).reshape(2))
    return rel, size, mtime


def recorded_mask_file(files: fmt.CacheFiles, i: int) -> tuple[str, int, int] | None:
    """``recorded_mask`` with the path joined to the recorded masks folder: the file to read."""
    mask = recorded_mask(files, i)
    if mask is None:
        return None
    rel, size, mtime = mask
    return os.path.join(files.manifest.source["masks"], rel), size, mtime


def recorded_annotations(files: fmt.CacheFiles) -> Annotations | None:
    """The annotations a cache's records carry, as its manifest and ``fields`` file record
    them (boxes already in the stored images' pixels); None if it has none."""
    m = files.manifest
    if not m.annotated:
        return None
    n = len(files.index)
    a = Annotations()
    for spec in m.fields:
        name = spec["name"]
        a.arrays[name] = (spec, [files.field_rows(name, i) for i in range(n)])
    masks = [recorded_mask(files, i) for i in range(n)]
    if any(masks):
        a.masks_root = Path(m.source["masks"])
        a.mask_paths = [None if k is None else k[0] for k in masks]
        a.mask_stats = np.array([k[1:] if k else (0, 0) for k in masks], np.int64).reshape(n, 2)
    return a
