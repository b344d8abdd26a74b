"""The interpolation names the build and the crops share: torchvision's, with OpenCV's kernels."""

from __future__ import annotations

import warnings

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
# The names mmcache 2 took from OpenCV: still accepted for one release, with a FutureWarning.
# Manifests keep them (a cache's recorded options, hence its fingerprint, do not change).
RENAMED = {"linear": "bilinear", "cubic": "bicubic"}
STORED = {new: old for old, new in RENAMED.items()}


def interpolation_name(
    name: str, what: str, extra: tuple[str, ...] = (), stacklevel: int = 2
) -> str:
    """``name`` in this vocabulary: itself, or the new name of an old name (with a
    ``FutureWarning`` naming ``what`` took it); ``extra``: further names ``what`` accepts."""
    if name in RENAMED:
        warnings.warn(
            f"{what}: interpolation {name!r} is now called {RENAMED[name]!r} (torchvision's "
            f"name); {name!r} will stop working in the next major release",
            FutureWarning,
            stacklevel=stacklevel + 1,
        )
        return RENAMED[name]
    if name not in (*extra, *NAMES):
        known = ", ".join((*extra, *NAMES))
        raise ValueError(f"interpolation must be one of {known}, got {name!r}")
    return name


def from_stored(name: str) -> str:
    """The name of a manifest's recorded interpolation (old names included), without warning."""
    return RENAMED.get(name, name)


def to_stored(name: str) -> str:
    """The name a manifest records for ``name``: the old one where there is one, so that a
    cache built before the renaming keeps its fingerprint and stays current."""
    return STORED.get(name, name)
