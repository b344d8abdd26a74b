"""Crops and flips with torchvision's names and box sampling, on HWC arrays and their targets.

``RandomResizedCrop`` draws its boxes with torchvision's algorithm exactly (up to 10 tries of an
area fraction uniform in ``scale`` and an aspect ratio log-uniform in ``ratio``, each kept if it
fits; then the fallback: the centre crop of the whole image clamped to ``ratio``).
``CenterResizedCrop(size, ratio=224/256)`` resizes the centre square of ``ratio`` times the
shorter side to ``size``, which on images stored at shorter side 256 is torchvision's
``Resize(256)`` + ``CenterCrop(224)`` (FFCV's ``CenterCropRGBImageDecoder`` means the same;
torchvision's ``CenterCrop(224)`` alone cuts 224 pixels and resizes nothing).
``RandomHorizontalFlip`` and ``Compose`` complete the usual pipelines. ``MultiCrop`` gives
several views of each image (the multi-crop of SimCLR and DINO), each with its own box and flip.

Each crop works two ways, with the same pixels for the same box: as a per-sample transform of
``MemmapImageDataset`` in a standard DataLoader (an H x W x C uint8 array in, ``size`` x C out;
random draws from torch's generator, which the DataLoader seeds per worker, as torchvision's
transforms do), and inside ``BatchLoader(crop=...)``, which draws boxes for a whole batch from
uniform numbers that are a function of its seed, the epoch and each sample's position, and
resizes each box of the record straight into its slot of a reused batch buffer.

The crops, the flip and ``Compose`` also take an ``(image, target)`` pair, as torchvision's
transforms v2 take a detection or segmentation sample, and return ``(image, target)``: the
image as they return it alone (from the same random draws: a seeded run crops an image
identically with or without its target), and the target moved with it, a new dict (the
caller's dict and arrays are left as they are) of

- ``"mask"``: an H x W integer label map (uint8, uint16, ...) aligned with the image: cut to
  the same box and resized by nearest neighbour with the image's geometry (each output pixel
  takes the label under its centre, as torch's ``"nearest-exact"``), mirrored with it;
- ``"boxes"``: (N, 4) float32 ``x1, y1, x2, y2`` in the image's pixels, continuous (the image
  spans [0, W] x [0, H]): shifted and scaled as the box is resized, clipped to the output, and
  dropped when no width or height is left; mirrored, ``x1, x2`` become ``W - x2, W - x1``;
- the values of ``PER_BOX_KEYS`` (``"labels"``, ``"iscrowd"``, ``"area"``), one row per box:
  a dropped box's row goes with it, as torchvision v2's ``SanitizeBoundingBoxes`` drops its
  ``labels_getter``'s (``"area"`` is not recomputed);
- anything else as it was (keypoints among them: nothing here moves them).

A target that is not a dict (a class index) passes through as it is.

Interpolations have torchvision's names, the build's too (``"nearest"``, ``"bilinear"``,
``"bicubic"``, plus ``"area"`` and ``"lanczos"``), and resizing is torchvision's by default
(``interpolation="bilinear", antialias=True``): its antialiased bilinear filter, computed by the
very kernel torchvision's ``resize`` runs on uint8 tensors (torch's ``_upsample_bilinear2d_aa``),
writing straight into the output; ``"bicubic"`` antialiased is torch's ``_upsample_bicubic2d_aa``.
With ``antialias=False``, or for the other names (which torchvision never antialiases), each
name is OpenCV's kernel, the one a build with ``--interpolation`` of that name stores with
(``"bilinear"``: ``INTER_LINEAR``). docs/training.md gives how far each is from torchvision's,
and how fast.

A crop whose output is larger than the largest box it can take of a stored image (the whole
image for ``RandomResizedCrop``, ``ratio`` times its shorter side for ``CenterResizedCrop``)
upscales that image: part of what the crop means, but over a whole cache possibly a cache
built too small (``--short-side 128`` cropped to 224). Each crop warns once per output size
(``UserWarning``): which images, by how much, and, over a cache (``UpscaleCause``), whether its
size option or the source made them small, with a rebuild command only for the former
(docs/training.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import cv2
import numpy as np
import torch

from . import pixels as px
from ._interpolation import interpolation_name
from ._resize import resize_into, resized_crop
from ._targets import PER_BOX_KEYS as PER_BOX_KEYS  # (named in the module docstring)
from ._targets import flip_target, resized_target

__all__ = [
    "CenterResizedCrop",
    "Compose",
    "Crop",
    "MultiCrop",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "resized_crop",
]

# torchvision's RandomResizedCrop tries this many boxes before its fallback.
TRIES = 10
# Uniform numbers one sample's box and flip are drawn from: an area and a ratio per try, the
# two corners' positions, and the flip.
DRAWS = 2 * TRIES + 3
# Those a crop's box may take: all but the flip's (the last).
MAX_DRAWS = DRAWS - 1


@runtime_checkable
class Crop(Protocol):
    """What ``BatchLoader(crop=...)`` and ``BatchLoader(views=...)`` need of a crop: the one
    definition of a crop, which the loader checks with ``isinstance`` (members present).

    ``RandomResizedCrop`` and ``CenterResizedCrop`` are crops; a class of one's own with these
    four members is one too, inheriting from nothing (docs/architecture.md, "Adding a crop").
    The loader draws each sample's ``draws`` uniform numbers from its seed, the epoch and the
    sample's position (so a seeded run's boxes repeat), asks ``boxes`` for a batch's boxes,
    and resizes each box of the stored record into its slot with ``kernel``; it mirrors with
    ``flip=`` itself. ``MemmapImageDataset(transform=...)`` and ``MultiCrop`` need more
    (a box drawn per image from torch's generator, the crop of an array): mmcache's crops only.

    Attributes:
        size: the output ``(height, width)``; the loader sets it on ``load_state_dict``, and
            a new value between epochs changes the batches' shape (progressive resizing).
        draws: how many uniform numbers in [0, 1) each box takes, 0 to ``MAX_DRAWS`` (22);
            0 for a crop that draws nothing (a fixed box).
        kernel: ``(interpolation, antialias)``, as ``resize_into`` takes them
            (``("bilinear", True)`` is torchvision's resize).
    """

    size: tuple[int, int]
    draws: int

    @property
    def kernel(self) -> tuple[str, bool]: ...

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """The box ``(top, left, height, width)`` of each of N images of ``shapes`` (rows of
        height, width, ...) from the rows of ``uniforms`` (N x ``draws`` floats in [0, 1)):
        an N x 4 int array, each box inside its image and at least 1 x 1."""
        ...


def _size_pair(size: int | Sequence[int]) -> tuple[int, int]:
    """torchvision's convention: an int is a square, a pair is (height, width)."""
    what = f"size must be an int or (height, width) of positive ints, got {size!r}"
    if isinstance(size, int | np.integer):
        pair: tuple[int, ...] = (int(size), int(size))
    elif isinstance(size, Sequence) and all(isinstance(v, int | np.integer) for v in size):
        pair = tuple(int(v) for v in size)
    else:
        raise TypeError(what)
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(what)
    return pair[0], pair[1]


def _kernel(interpolation: str, antialias: bool) -> tuple[str, bool]:
    """``(interpolation, antialias)``, the name checked."""
    return interpolation_name(interpolation), bool(antialias)


@dataclass(frozen=True)
class UpscaleCause:
    """What a cache's size option did to its images, for the upscale warning."""

    sized: np.ndarray  # per record: True where the option set its stored size (shrank it)
    flags: str  # the option, as ``mmcache build`` flags ("--short-side 256"), or ""
    rebuild: Callable[[int], str]  # how to make the cache again at a shorter side


def _upscale_cause(small: np.ndarray, needed: int, cache: UpscaleCause | None) -> str:
    """Why the ``small`` images (a mask over the records) are small, and what would help."""
    if cache is None:  # an image alone: nothing is known of where it comes from
        return ""
    if not cache.flags:
        return (
            "the cache holds the source images' sizes: they are that small in the source "
            "(crop smaller, or accept the upscaling)"
        )
    by_cache = int(np.count_nonzero(small & cache.sized))
    by_source = int(np.count_nonzero(small)) - by_cache
    parts = []
    if by_cache:
        parts.append(
            f"{by_cache} of them the cache's {cache.flags} made that small: "
            f"{cache.rebuild(needed)}, or crop smaller"
        )
    if by_source:
        parts.append(
            f"{by_source} of them are that small in the source ({cache.flags} never enlarges; "
            "a rebuild would not change them)"
        )
    return "; ".join(parts)


class _Crop:
    """What the crops share: an output size (settable between epochs) and an interpolation.
    Each is a ``Crop`` (what ``BatchLoader`` needs), and a per-sample transform besides."""

    draws = 0  # uniform numbers a box takes (a deterministic crop takes none)

    def __init__(self, size: int | Sequence[int], interpolation: str, antialias: bool) -> None:
        self.size = size
        self.interpolation, self.antialias = _kernel(interpolation, antialias)
        self._upscale_warned: tuple[int, int] | None = None  # the size it last warned of

    def short_side_needed(self) -> int:
        """The shortest stored shorter side this crop takes without upscaling."""
        return min(self.size)

    def warn_if_upscaling(
        self, shapes: np.ndarray, cache: UpscaleCause | None = None, stacklevel: int = 2
    ) -> None:
        """Warn (``UserWarning``, once per output size) if any of the images of ``shapes``
        (rows of height, width, ...) is too small for this crop's output: which, by how much,
        and (given ``cache``, what the cache's size option did to them) whether the cache or
        the source is the cause, with a rebuild command only where a rebuild helps. See the
        module docstring. ``MemmapImageDataset`` and ``BatchLoader`` call it with their cache."""
        if self._upscale_warned == self.size or not len(shapes):
            return
        shorter = np.asarray(shapes)[:, :2].min(axis=1)
        needed = self.short_side_needed()
        small = shorter < needed
        if not small.any():
            return
        self._upscale_warned = self.size
        h, w = self.size
        smallest = int(shorter.min())
        factor = f"{needed / smallest:.3g}x"
        if len(shorter) == 1:
            facts = (
                f"an image of shorter side {smallest}, under {needed}, is upscaled to {h}x{w} "
                f"({factor})"
            )
        else:
            facts = (
                f"{int(small.sum())} of {len(shorter)} stored images have a shorter side under "
                f"{needed} (the smallest: {smallest}): upscaled to {h}x{w}, up to {factor}"
            )
        cause = _upscale_cause(small, needed, cache)
        warnings.warn(
            f"{type(self).__name__}({h}x{w}): {facts}" + (f"; {cause}" if cause else ""),
            UserWarning,
            stacklevel=stacklevel + 1,
        )

    def __repr__(self) -> str:
        # torchvision's form: the class and the arguments that make it again.
        args = {"size": self.size, **self._arguments(), "interpolation": self.interpolation,
                "antialias": self.antialias}  # fmt: skip
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in args.items())})"

    def _arguments(self) -> dict[str, Any]:
        """The arguments particular to this crop, for ``__repr__``."""
        return {}

    @property
    def kernel(self) -> tuple[str, bool]:
        """``(interpolation, antialias)``: ``resize_into``'s last two arguments."""
        return self.interpolation, self.antialias

    @property
    def size(self) -> tuple[int, int]:
        """The output ``(height, width)``. Set it (an int or a pair) to change the output size,
        between epochs of a ``BatchLoader`` for progressive resizing."""
        return self._size

    @size.setter
    def size(self, value: int | Sequence[int]) -> None:
        self._size = _size_pair(value)

    def box(self, height: int, width: int, u: Sequence[float] = ()) -> tuple[int, int, int, int]:
        """The crop box ``(top, left, height, width)`` of an image of ``height`` x ``width``,
        from ``u``, ``draws`` uniform numbers in [0, 1) (none for a deterministic crop)."""
        raise NotImplementedError

    def boxes(self, shapes: np.ndarray, uniforms: np.ndarray | None = None) -> np.ndarray:
        """``box`` of each of N records of ``shapes`` (rows of height, width, ...), with the
        rows of ``uniforms``: an (N, 4) int64 array."""
        rows = np.asarray(shapes)[:, :2].tolist()
        u = [()] * len(rows) if uniforms is None else np.asarray(uniforms).tolist()
        return np.array([self.box(h, w, v) for (h, w), v in zip(rows, u)], np.int64).reshape(-1, 4)

    def draw(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The box of one image of ``height`` x ``width``, drawn from torch's generator as
        ``__call__`` draws it (warning as it warns of upscaling)."""
        if min(height, width) < self.short_side_needed():  # (the check alone, per sample)
            self.warn_if_upscaling(np.array([[height, width]]), stacklevel=4)
        u = torch.rand(self.draws, dtype=torch.float64).tolist() if self.draws else ()
        return self.box(height, width, u)

    def __call__(self, sample: Any) -> Any:
        """The crop of one H x W x C array, resized to ``size`` (a new array); of an
        ``(image, target)`` pair, ``(that crop, the target moved with it)`` (see the module
        docstring), from the same random draws."""
        img, target = _unpaired(sample)
        box = self.draw(*img.shape[:2])
        out = resized_crop(img, box, self.size, self.interpolation, antialias=self.antialias)
        if target is _NO_TARGET:
            return out
        return out, self.crop_target(box, img.shape[:2], target)

    def crop_target(self, box: Sequence[int], image_hw: tuple[int, int], target: Any) -> Any:
        """``target`` (a dict: see the module docstring) of an image of ``image_hw``
        (height, width) moved as this crop moves the image's pixels to the ``box``
        ``(top, left, height, width)`` (one ``draw`` returned) resized to ``size``: a new
        dict. A target that is not a dict (a class index) is returned as it is."""
        return resized_target(target, box, image_hw, self.size)

    def crop_planes(
        self,
        y: np.ndarray,
        cb: np.ndarray,
        cr: np.ndarray,
        color: str = "rgb",
        box: Sequence[int] | None = None,
    ) -> np.ndarray:
        """What ``__call__`` returns for the image of I420 planes (``pixels``), in ``color``,
        converting only the box: the same pixels, drawn the same way. ``box``: the box to
        take (one ``draw`` returned, to move a target with ``crop_target``), else drawn."""
        height, width = y.shape
        if box is None:
            box = self.draw(height, width)
        out = np.empty((*self.size, 3), np.uint8)

        def resize(src: np.ndarray, dst: np.ndarray) -> None:
            resize_into(torch.from_numpy(src), torch.from_numpy(dst), *self.kernel)

        px.crop_into(y, cb, cr, box, (height, width), out, resize, px.thread_buffer, color)
        return out


class RandomResizedCrop(_Crop):
    """A random box of random area and aspect ratio, resized to ``size``: torchvision's
    ``RandomResizedCrop``.

    Args:
        size: output size: an int (square) or ``(height, width)``.
        scale: bounds of the box's area, as fractions of the image's.
        ratio: bounds of the box's aspect ratio (width / height), drawn log-uniformly.
        interpolation: ``"bilinear"``, ``"bicubic"``, ``"nearest"``, ``"area"`` or
            ``"lanczos"`` (see the module docstring).
        antialias: for ``"bilinear"`` and ``"bicubic"``, torchvision's antialiased kernels
            (torch's); ``False``: OpenCV's, as the build resizes. Other names ignore it.

    Examples:
        >>> crop = RandomResizedCrop(224)
        >>> ds = MemmapImageDataset("cache/train", transform=crop)  # doctest: +SKIP
        >>> image, target = crop((image, {"mask": mask, "boxes": boxes}))  # doctest: +SKIP
        >>> batches = BatchLoader(plain, 256, shuffle=True, crop=crop, flip=True)  # doctest: +SKIP
    """

    draws = DRAWS - 1  # the flip's number is the loader's

    def __init__(
        self,
        size: int | Sequence[int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        interpolation: str = "bilinear",
        antialias: bool = True,
    ) -> None:
        super().__init__(size, interpolation, antialias)
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must be (low, high) with 0 < low <= high, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must be (low, high) with 0 < low <= high, got {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))

    def _arguments(self) -> dict[str, Any]:
        return {"scale": self.scale, "ratio": tuple(round(r, 4) for r in self.ratio)}

    def box(self, height: int, width: int, u: Sequence[float] = ()) -> tuple[int, int, int, int]:
        # torchvision's get_params, try by try, with the try's two numbers in u[k] and
        # u[TRIES + k] and the corner's two in u[2 * TRIES] and u[2 * TRIES + 1].
        area = height * width
        lo, hi = self.scale
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for k in range(TRIES):
            target = area * (lo + (hi - lo) * u[k])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[TRIES + k])
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                # randint(0, height - h + 1), likewise the left
                top = math.floor(u[2 * TRIES] * (height - h + 1))
                left = math.floor(u[2 * TRIES + 1] * (width - w + 1))
                return top, left, h, w
        # The fallback: the whole image, cut to the nearest bound of ratio, centred.
        in_ratio = width / height
        w, h = width, height
        if in_ratio < self.ratio[0]:
            h = round(width / self.ratio[0])
        elif in_ratio > self.ratio[1]:
            w = round(height * self.ratio[1])
        return (height - h) // 2, (width - w) // 2, h, w


class CenterResizedCrop(_Crop):
    """The centre box of ``ratio`` times the image's shorter side, square, resized to ``size``.

    With images stored at shorter side 256 (``mmcache build --short-side 256``) and the default
    ``ratio=224/256``, ``CenterResizedCrop(224)`` is torchvision's ``Resize(256)`` +
    ``CenterCrop(224)`` for validation, without the resize (the box is already 224 pixels wide).

    Args:
        size: output size: an int (square) or ``(height, width)``.
        ratio: the box's side as a fraction of the image's shorter side.
        interpolation: as for ``RandomResizedCrop``.
        antialias: as for ``RandomResizedCrop``.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        ratio: float = 224 / 256,
        interpolation: str = "bilinear",
        antialias: bool = True,
    ) -> None:
        super().__init__(size, interpolation, antialias)
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be within (0, 1], got {ratio}")
        self.ratio = float(ratio)

    def _arguments(self) -> dict[str, Any]:
        return {"ratio": self.ratio}

    def short_side_needed(self) -> int:
        return math.ceil(min(self.size) / self.ratio - 1e-9)  # a quotient a hair above an int

    def box(self, height: int, width: int, u: Sequence[float] = ()) -> tuple[int, int, int, int]:
        side = max(1, round(min(height, width) * self.ratio))
        # torchvision's centre: int(round((height - side) / 2)), likewise the left
        return round((height - side) / 2), round((width - side) / 2), side, side


class RandomHorizontalFlip:
    """Mirror an H x W x C array, or an ``(image, target)`` pair (see the module docstring),
    left to right with probability ``p`` (torch's generator, one number per call)."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"p must be within [0, 1], got {p!r}")
        self.p = float(p)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"

    def __call__(self, sample: Any) -> Any:
        img, target = _unpaired(sample)
        if torch.rand(1).item() < self.p:
            if target is not _NO_TARGET:
                target = flip_target(target, img.shape[1])
            img = cv2.flip(img, 1).reshape(img.shape)  # (cv2 drops a single channel's axis)
        return img if target is _NO_TARGET else (img, target)


class Compose:
    """Apply ``transforms`` in order (picklable, so it crosses to spawned DataLoader workers).
    Each receives what the one before returned: an image, or an ``(image, target)`` pair,
    which mmcache's crops and flip take, and a function of the image alone does not."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __repr__(self) -> str:
        # torchvision's form: one transform a line
        lines = "".join(f"\n    {t!r}" for t in self.transforms)
        return f"{type(self).__name__}({lines}\n)"

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


# What ``_unpaired`` says of a sample that is an image alone (None may be a target).
_NO_TARGET: Any = object()


def _unpaired(sample: Any) -> tuple[np.ndarray, Any]:
    """``(image, target)`` of an ``(image, target)`` tuple, ``(image, _NO_TARGET)`` of an image.

    Raises:
        TypeError: the image is not an H x W x C numpy array (a PIL image, a tensor).
    """
    if not isinstance(sample, tuple):
        return _image(sample), _NO_TARGET
    if len(sample) != 2:
        raise ValueError(
            f"a transform takes an image or an (image, target) pair, got a tuple of {len(sample)}"
        )
    return _image(sample[0]), sample[1]


def _image(img: Any) -> np.ndarray:
    """``img`` if it is what the transforms take, an H x W (x C) numpy array, else TypeError
    saying how to give it (the transforms run before any ToTensor, on the stored arrays)."""
    if isinstance(img, np.ndarray) and img.ndim in (2, 3):
        return img
    expected = "mmcache's transforms take an H x W x C numpy array (what MemmapImageDataset reads)"
    if type(img).__module__.startswith("PIL."):
        found = "a PIL image: np.asarray(image) gives the array"
    elif isinstance(img, torch.Tensor):
        found = (
            f"a torch.Tensor of shape {tuple(img.shape)}: apply them before ToTensor, or give "
            "tensor.permute(1, 2, 0).numpy() for a C x H x W one"
        )
    else:
        found = f"{type(img).__name__} of shape {getattr(img, 'shape', None)}"
    raise TypeError(f"{expected}, got {found}")


# A view's parameters, as ``MultiCrop(return_params=True)`` and ``BatchLoader(return_params=True)``
# give them: its box in the stored image's pixels, and 1 if it was mirrored.
PARAMS = ("top", "left", "height", "width", "flip")


def expand_views(views: Sequence[tuple[Crop, int]]) -> list[Crop]:
    """The crop of each view of ``[(crop, count), ...]``, counts expanded (a crop given with
    count 2 is the crop of two views: setting its ``size`` resizes both).

    Raises:
        ValueError: no views, a count under 1, or a crop that is not a ``Crop``.
    """
    crops: list[Crop] = []
    for item in views:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(f"views must be (crop, count) pairs, got {item!r}")
        crop, n = item
        if not isinstance(crop, Crop) or not isinstance(n, int | np.integer) or n < 1:
            raise ValueError(
                "views must be (crop, count) pairs of mmcache.RandomResizedCrop or "
                f"CenterResizedCrop and a count >= 1, got {item!r}"
            )
        check_draws(crop)
        crops += [crop] * int(n)
    if not crops:
        raise ValueError("views must name at least one (crop, count) pair")
    return crops


def check_draws(crop: Crop) -> None:
    """Refuse a crop whose boxes would take more uniform numbers than a sample has: the
    loader would hand it fewer columns than it asked for, silently.

    Raises:
        ValueError: ``crop.draws`` is not an int from 0 to ``MAX_DRAWS``.
    """
    draws = crop.draws
    if isinstance(draws, bool) or not isinstance(draws, int | np.integer):
        draws = -1  # (refused below, as out of range)
    if not 0 <= draws <= MAX_DRAWS:
        raise ValueError(
            f"{type(crop).__name__}.draws must be an int from 0 to {MAX_DRAWS} (the uniform "
            f"numbers BatchLoader draws for each box), got {crop.draws!r}"
        )


class MultiCrop:
    """Several views of one H x W x C array, each its own crop and flip: the multi-crop of
    SimCLR and DINO as a per-sample transform (torchvision style), for a ``DataLoader``.

    ``BatchLoader(views=...)`` gathers the same views straight into batches; for the same
    boxes and flips both give the same pixels (``apply`` takes the ones a loader returned).

    Args:
        views: ``[(crop, count), ...]``: ``count`` views cropped by each crop, in this order.
        flip: mirror each view left to right with probability 1/2, each drawn on its own.
        return_params: return ``(views, params)``: ``params`` one int64 array per view of
            ``PARAMS`` (top, left, height, width of its box in the image's pixels, and 1 if
            it was mirrored).

    Examples:
        >>> from mmcache import RandomResizedCrop
        >>> dino = MultiCrop([(RandomResizedCrop(224, scale=(0.32, 1.0)), 2),
        ...                   (RandomResizedCrop(96, scale=(0.05, 0.32)), 6)])
        >>> ds = MemmapImageDataset("cache/train", transform=dino)  # doctest: +SKIP
        >>> views, label = ds[0]  # 2 arrays 224 x 224 x 3, 6 of 96 x 96 x 3  # doctest: +SKIP
    """

    def __init__(
        self,
        views: Sequence[tuple[RandomResizedCrop | CenterResizedCrop, int]],
        flip: bool = True,
        return_params: bool = False,
    ) -> None:
        crops = expand_views(views)  # checks them
        # A per-sample transform draws each box from torch's generator and warns per image
        # (``draw``): mmcache's crops do; a Crop of one's own has only what BatchLoader needs.
        self.crops = [crop for crop in crops if isinstance(crop, _Crop)]
        if len(self.crops) != len(crops):
            other = next(crop for crop in crops if not isinstance(crop, _Crop))
            raise ValueError(
                "MultiCrop's views must be mmcache.RandomResizedCrop or CenterResizedCrop "
                f"(BatchLoader(views=...) takes any mmcache.Crop), got {other!r}"
            )
        self.views = [(crop, int(n)) for crop, n in views]
        self.flip, self.return_params = bool(flip), bool(return_params)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(views={self.views!r}, flip={self.flip}, "
                f"return_params={self.return_params})")  # fmt: skip

    def __call__(self, img: np.ndarray) -> Any:
        """The views of ``img`` (a list of new arrays), with ``return_params`` and their
        parameters; boxes and flips drawn from torch's generator.

        Raises:
            ValueError: an ``(image, target)`` pair (a cache with masks or boxes), whose
                target the views would have to move each their own way.
        """
        if isinstance(img, tuple):
            raise ValueError(
                "MultiCrop takes an image, not an (image, target) pair: views of a cache with "
                "masks or boxes are not supported"
            )
        img = _image(img)
        params = []
        for crop in self.crops:
            top, left, height, width = crop.draw(*img.shape[:2])
            flipped = self.flip and bool(torch.rand(1).item() < 0.5)
            params.append(np.array([top, left, height, width, int(flipped)], np.int64))
        views = self.apply(img, params)
        return (views, params) if self.return_params else views

    def apply(self, img: np.ndarray, params: Sequence[Any]) -> list[np.ndarray]:
        """The views of ``img`` with the given parameters (a row of ``PARAMS`` per view, as
        ``__call__`` or ``BatchLoader(return_params=True)`` give them): each box resized to
        its crop's size as ``BatchLoader`` resizes it, then mirrored if its flip is 1."""
        if len(params) != len(self.crops):
            raise ValueError(f"{len(self.crops)} views need {len(self.crops)} rows of params, "
                             f"got {len(params)}")  # fmt: skip
        views = []
        for crop, row in zip(self.crops, params):
            top, left, height, width, flipped = (int(v) for v in row)
            out = resized_crop(img, (top, left, height, width), crop.size, crop.interpolation,
                               antialias=crop.antialias)  # fmt: skip
            if flipped:
                cv2.flip(out, 1, dst=out)
            views.append(out)
        return views


def crops_in(transform: object) -> list[_Crop]:
    """This module's crops that ``transform`` applies: itself, those of a ``Compose`` (nested
    too), a ``MultiCrop``'s views. Not any ``Crop``: these are the ones with an upscale
    warning (``warn_if_upscaling``), which a crop of one's own need not have."""
    if isinstance(transform, _Crop):
        return [transform]
    if isinstance(transform, MultiCrop):
        return list(dict.fromkeys(transform.crops))
    if isinstance(transform, Compose):
        return [crop for t in transform.transforms for crop in crops_in(t)]
    return []


def leading_crop(
    transform: Callable[[Any], Any] | None,
) -> tuple[_Crop | None, Callable[[Any], Any] | None]:
    """``(crop, the rest)`` when ``transform`` is, or is a ``Compose`` beginning with, one of
    this module's crops, else ``(None, transform)``: a dataset of I420 records then converts
    only the crop's box (``crop_planes``), not the whole image. Not any ``Crop``: a per-sample
    crop of planes needs this module's ``draw``, ``crop_planes`` and ``crop_target``."""
    if isinstance(transform, _Crop):
        return transform, None
    if isinstance(transform, Compose) and transform.transforms:
        first, *rest = transform.transforms
        if isinstance(first, _Crop):
            return first, Compose(rest) if rest else None
    return None, transform
