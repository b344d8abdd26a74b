"""A sample's target (mask, boxes, per-box rows) cropped, resized and flipped with its image."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The keys whose values have one row per box: when a crop drops boxes, these drop the same
# rows, as torchvision v2's SanitizeBoundingBoxes drops its labels_getter's. Their values are
# not otherwise changed: "area" (COCO's, the instance's area in source pixels) is not
# recomputed, as torchvision leaves it. Keypoints are not among them: a crop would have to move
# them, and nothing here does.
PER_BOX_KEYS = ("labels", "iscrowd", "area")


def resized_target(
    target: Any, box: Sequence[int], image_hw: tuple[int, int], size: tuple[int, int]
) -> Any:
    """``target`` (a dict, see ``transforms``) of an image of ``image_hw`` (height, width)
    cropped to ``box`` ``(top, left, height, width)`` and resized to ``size`` (height, width),
    as ``resized_crop`` moves the image's pixels: a new dict; the caller's and its arrays are
    left as they are. A target that is not a mapping (a class index) is returned as it is.

    Raises:
        ValueError: a mask of another height and width than the image, boxes not (N, 4), or
            a ``PER_BOX_KEYS`` value without one row per box.
    """
    if not isinstance(target, Mapping):
        return target
    out = dict(target)
    if "mask" in target:
        out["mask"] = resized_mask(_checked_mask(target["mask"], image_hw), box, size)
    if "boxes" in target:
        top, left, bh, bw = (int(v) for v in box)
        oh, ow = size
        boxes = _checked_boxes(target["boxes"]).astype(np.float64)
        # A box pixel's edge x maps to (x - left) * ow / bw: the output pixel edges the resize
        # maps there (it maps pixel centres the same way, align_corners=False).
        boxes -= (left, top, left, top)
        boxes *= (ow / bw, oh / bh, ow / bw, oh / bh)
        np.clip(boxes, 0, (ow, oh, ow, oh), out=boxes)
        _keep(out, target, boxes.astype(np.float32))
    return out


def flip_target(target: Any, width: int) -> Any:
    """``target`` (a dict, see ``transforms``) of an image ``width`` pixels wide mirrored left
    to right with it: a new dict, the mask mirrored, each box's ``x1, x2`` made ``width - x2,
    width - x1``. A target that is not a mapping is returned as it is."""
    if not isinstance(target, Mapping):
        return target
    out = dict(target)
    if "mask" in target:
        mask = np.asarray(target["mask"])
        if mask.ndim < 2 or mask.shape[1] != width:
            raise ValueError(
                f"the target's mask is {mask.shape[:2]} (height, width), its image {width} wide"
            )
        out["mask"] = np.ascontiguousarray(mask[:, ::-1])
    if "boxes" in target:
        boxes = _checked_boxes(target["boxes"]).astype(np.float32)  # a copy
        boxes[:, [0, 2]] = width - boxes[:, [2, 0]]
        out["boxes"] = boxes
    return out


def resized_mask(
    mask: np.ndarray,
    box: Sequence[int],
    size: tuple[int, int],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The ``box`` ``(top, left, height, width)`` of an H x W (x ...) label map resized to
    ``size`` (height, width) by nearest neighbour, with the geometry of the image's resize:
    output pixel ``i`` takes the box pixel under its centre, ``floor((i + 0.5) * height /
    size[0])``, as torch's ``"nearest-exact"`` and OpenCV's ``INTER_NEAREST_EXACT`` do (OpenCV's
    ``INTER_NEAREST`` takes ``floor(i * height / size[0])``, half a box pixel off the image's
    bilinear resize). Any dtype; ``out``: a ``size`` array of the mask's dtype to write into."""
    top, left, bh, bw = (int(v) for v in box)
    rows = top + nearest_sources(bh, size[0])
    cols = left + nearest_sources(bw, size[1])
    # mode="clip": the indices are within the box by construction, and take's bounds check
    # (mode="raise") costs more than the gather itself (142 against 64 us for 224 x 224).
    return np.take(np.take(mask, rows, axis=0), cols, axis=1, out=out, mode="clip")


def nearest_sources(length: int, out_length: int) -> np.ndarray:
    """For each of ``out_length`` pixels resized from ``length``, the source pixel under its
    centre, ``floor((i + 0.5) * length / out_length)``, in integers (no rounding to doubt)."""
    return (np.arange(out_length, dtype=np.int64) * 2 + 1) * length // (2 * out_length)


def _checked_mask(mask: Any, image_hw: tuple[int, int]) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.ndim < 2 or tuple(mask.shape[:2]) != tuple(image_hw):
        raise ValueError(
            f"the target's mask is {mask.shape[:2]} (height, width), its image "
            f"{tuple(image_hw)}: a mask must be aligned with its image"
        )
    return mask


def _checked_boxes(boxes: Any) -> np.ndarray:
    boxes = np.asarray(boxes)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise ValueError(f"the target's boxes must be (N, 4) x1, y1, x2, y2, got {boxes.shape}")
    return boxes


def _keep(out: dict[str, Any], target: Mapping[str, Any], boxes: np.ndarray) -> None:
    """Put in ``out`` the ``boxes`` (clipped) that still have an area, and the rows of
    ``PER_BOX_KEYS`` that go with them."""
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    out["boxes"] = boxes[keep]
    for key in PER_BOX_KEYS:
        if key not in target:
            continue
        value = target[key]
        if len(value) != len(keep):
            raise ValueError(
                f"the target's {key!r} has {len(value)} rows for {len(keep)} boxes: each of "
                f"{PER_BOX_KEYS} holds one row per box"
            )
        if isinstance(value, list | tuple):
            out[key] = type(value)(v for v, k in zip(value, keep.tolist()) if k)
        else:
            out[key] = value[keep]
