"""The interpolation names the build and the crops share: torchvision's, with OpenCV's kernels."""

from __future__ import annotations

import cv2

# torchvision's InterpolationMode values (and torch's "area") -> the OpenCV kernel of that name:
# what a build resizes with, and what a crop resizes with when it does not antialias.
OPENCV = {
    "nearest": cv2.INTER_NEAREST,
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "area": cv2.INTER_AREA,
    "lanczos": cv2.INTER_LANCZOS4,
}
NAMES = tuple(OPENCV)


def interpolation_name(name: str, extra: tuple[str, ...] = ()) -> str:
    """``name``, checked to be one of ``NAMES`` or ``extra`` (further names the caller takes)."""
    if name not in (*extra, *NAMES):
        known = ", ".join((*extra, *NAMES))
        raise ValueError(f"interpolation must be one of {known}, got {name!r}")
    return name
