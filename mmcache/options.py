"""The preprocessing a cache records (``Options``), and the one table of its flags.

``OPTION_FLAGS`` lists each field of ``Options`` once: the flag that gives it on the command
line, how the flag's text is read and written back, its choices and its help. The CLI adds its
flags from it, its parsed values are ``Options``' keyword arguments (``build_cache(**kw)``), and
``Options.flags()`` writes a cache's recorded options back as those flags.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import pixels as px
from ._interpolation import NAMES, interpolation_name

__all__ = [
    "COLORS",
    "DEFAULT_MAX_PIXELS",
    "INTERPOLATIONS",
    "OPTION_FLAGS",
    "OptionFlag",
    "Options",
    "SIZE_POLICIES",
    "parse_size",
]

# Pillow's decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): 1024 * 1024 * 1024 // 4 // 3.
DEFAULT_MAX_PIXELS = 89_478_485

INTERPOLATIONS = ("auto", *NAMES)  # what ``Options.interpolation`` takes
COLORS = ("rgb", "bgr", "gray")


@dataclass(frozen=True)
class Options:
    """The preprocessing a cache applies, fixed at build time and recorded in its manifest.

    At most one of ``size`` (exact ``(height, width)``, as torchvision's and the crops' sizes;
    the command line's ``--size WxH`` gives width first), ``max_side`` and ``short_side`` (keep
    the aspect ratio, never upscale) is set; none keeps the native size. ``interpolation``: the
    crops' names (``"bilinear"``, ``"bicubic"``, ``"nearest"``, ``"area"``, ``"lanczos"``), each
    OpenCV's kernel (``"bilinear"``: INTER_LINEAR, which does not antialias), or ``"auto"``:
    INTER_AREA to shrink and INTER_LINEAR to enlarge. ``color`` is ``"rgb"``, ``"bgr"`` or
    ``"gray"`` (stored H x W x 1). Files with more than ``max_pixels`` pixels are refused
    (``None``: ``DEFAULT_MAX_PIXELS``, Pillow's decompression-bomb limit).

    ``reduced_decode`` (off by default, an explicit choice): a JPEG that shrinks by 2x or more is
    decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (OpenCV's ``IMREAD_REDUCED_*``), then
    resized to the same output size. Faster to decode, but the pixels differ from the full decode
    shrunk with INTER_AREA (docs/bench.md gives both, measured with ``tools/decoders.py``), so it
    is recorded in the options and the cache's fingerprint.

    ``pixels``: the record layout (``mmcache.pixels``): ``"rgb"`` (H x W x C) or ``"yuv420"``
    (planar I420, BT.601 full range, half the bytes of RGB; readers still return RGB, or BGR
    for ``color="bgr"``). ``"yuv420"`` needs colour: ``color="gray"`` is refused with it.
    ``keep_truncated`` (off by default): a JPEG that ends before its image data does (a download
    or copy cut short) decodes without error, the missing part grey, so by default it is refused
    as ``"truncated"``; this keeps it, as its decoded pixels. Other formats cut short do not
    decode at all.
    ``mask``: the dtype each record's segmentation mask is stored in (``"uint8"`` or
    ``"uint16"``), set by a build with masks (``masks=``); None: records carry no mask.
    ``exif_orientation`` (on by default, as ``cv2.imread``): the EXIF orientation is applied;
    off, the pixels are read as the file stores them (``cv2.IMREAD_IGNORE_ORIENTATION``), as
    PIL and torchvision read them and as masks and boxes are drawn on them: a build with
    masks or COCO boxes sets it off (recorded in the manifest's options as
    ``"exif_orientation": false``), so that each annotation lines up with its pixels.
    """

    size: tuple[int, int] | None = None
    max_side: int | None = None
    short_side: int | None = None
    interpolation: str = "auto"
    color: str = "rgb"
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    reduced_decode: bool = False
    pixels: str = "rgb"
    keep_truncated: bool = False
    mask: str | None = None
    exif_orientation: bool = True

    def __post_init__(self) -> None:
        if self.max_pixels is None:
            object.__setattr__(self, "max_pixels", DEFAULT_MAX_PIXELS)
        if sum(getattr(self, name) is not None for name in SIZE_POLICIES) > 1:
            raise ValueError("choose at most one of size, max_side and short_side")
        if isinstance(self.size, int | np.integer):  # a square? or the shorter side?
            n = int(self.size)
            raise TypeError(
                f"size must be (height, width) of positive ints, got {n}: for a square write "
                f"size=({n}, {n}), to keep the aspect ratio use short_side={n}"
            )
        if self.size is not None:
            size = tuple(int(v) for v in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"size must be (height, width) of positive ints, got {self.size}")
            object.__setattr__(self, "size", size)
        for name in ("max_side", "short_side", "max_pixels"):
            v = getattr(self, name)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        interpolation_name(self.interpolation, ("auto",))
        if self.color not in COLORS:
            raise ValueError(f"color must be one of {', '.join(COLORS)}, got {self.color!r}")
        px.check_layout(self.pixels)
        px.check_mask(self.mask)
        if px.layout_named(self.pixels).colour_only and self.color == "gray":
            raise ValueError(
                f"pixels={self.pixels!r} stores colour (luma and half-size chroma) and "
                "color='gray' has none: build gray caches with the default pixels='rgb'"
            )

    @property
    def channels(self) -> int:
        return 1 if self.color == "gray" else 3

    def to_json(self) -> dict[str, Any]:
        """Every option, as the manifest records it (``size`` as a list, ``[height, width]``)."""
        d = asdict(self)
        d["size"] = list(self.size) if self.size else None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Options:
        """The options a manifest records (``to_json``'s form).

        Raises:
            ValueError: ``d`` is not such a record (a damaged or forged manifest): an unknown
                option, or a value of another type or range than ``to_json`` writes.
        """
        specs = {spec.name: spec for spec in OPTION_FLAGS}
        for name, value in d.items():
            if name not in specs:
                raise ValueError(f"unknown option {name!r}")
            if not specs[name].stored(value):
                raise ValueError(f"{name} {value!r} is not an option value")
        return cls(**d)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def flags(self) -> str:
        """The command-line flags that give these options (``"--short-side 256 --color
        gray"``); empty for the defaults. Written from ``OPTION_FLAGS``, as the CLI reads them."""
        default = Options()
        words = []
        for spec in OPTION_FLAGS:
            value = getattr(self, spec.name)
            if spec.flag is None or value in (getattr(default, spec.name), *spec.implied):
                continue
            words.append(spec.flag if spec.parse is None else f"{spec.flag} {spec.show(value)}")
        return " ".join(words)

    def describe(self) -> str:
        """``flags()``, or ``"the defaults (native size, RGB)"``: for messages."""
        words = self.flags() or "the defaults (native size, RGB)"
        # No flag of its own: --masks and --coco imply it.
        return words if self.exif_orientation else words + ", EXIF orientation not applied"

    def output_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """The stored (H, W, C) of an image whose decoded native size is ``height x width``."""
        h, w = height, width
        if self.size is not None:
            h, w = self.size
        elif self.max_side is not None and max(h, w) > self.max_side:
            h, w = _scale_to(h, w, max(h, w), self.max_side)
        elif self.short_side is not None and min(h, w) > self.short_side:
            h, w = _scale_to(h, w, min(h, w), self.short_side)
        return h, w, self.channels


def _scale_to(h: int, w: int, side: int, target: int) -> tuple[int, int]:
    # Integer rounding, so that planning from headers and resizing after decoding agree exactly.
    return max(1, (h * target + side // 2) // side), max(1, (w * target + side // 2) // side)


def parse_size(text: str) -> tuple[int, int]:
    """``"224x160"`` -> ``(224, 160)``: (width, height), the text's order (``Options.size`` is
    (height, width): the command line swaps them)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 224x224), got {text!r}")
    return int(m[1]), int(m[2])


def whole_number(text: str) -> int:
    """A flag's positive whole number: ``"256"`` -> 256; ValueError otherwise."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"expected a positive whole number, got {text!r}")
    return value


def height_width(text: str) -> tuple[int, int]:
    """A flag's ``WxH`` as (height, width), the order of ``Options.size`` and the crops."""
    try:
        width, height = parse_size(text)
    except ValueError as e:
        hint = ""
        if text.strip().isdigit():
            n = text.strip()
            hint = f"; for a square write {n}x{n}, to keep the aspect ratio use --short-side {n}"
        raise ValueError(f"{e}{hint}") from None
    return height, width


def _positive_int(v: Any) -> bool:
    return type(v) is int and v >= 1


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _pair_of_positive_ints(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(map(_positive_int, v))


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _wxh(size: tuple[int, int]) -> str:
    return f"{size[1]}x{size[0]}"


@dataclass(frozen=True)
class OptionFlag:
    """How one field of ``Options`` is given on the command line and written back."""

    name: str  # the field, and the keyword argument of build_cache and plan_cache
    flag: str | None  # None: no flag of its own
    help: str = ""
    # The flag's text to the field's value (ValueError if bad); None: a switch, without a value.
    parse: Callable[[str], Any] | None = str
    show: Callable[[Any], str] = str  # the value as the flag's text, for Options.flags()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    implied: tuple[Any, ...] = ()  # values, besides the default, that flags() need not write
    # The JSON type of the value as to_json writes it (ranges and names are Options' to check):
    # what from_json accepts from a manifest, so that a forged value is refused by name rather
    # than failing later with a KeyError or TypeError far from its cause.
    stored: Callable[[Any], bool] = _is_str


# The fields of which at most one is set: each keeps or sets the size its own way.
SIZE_POLICIES = ("size", "max_side", "short_side")

OPTION_FLAGS = (
    OptionFlag(
        "size", "--size", "resize to exactly WxH (width x height)", height_width, _wxh,
        metavar="WxH", stored=_optional(_pair_of_positive_ints),
    ),
    OptionFlag(
        "max_side", "--max-side", "shrink so the longer side is at most N", whole_number,
        metavar="N", stored=_optional(_positive_int),
    ),
    OptionFlag(
        "short_side", "--short-side", "shrink so the shorter side is at most N", whole_number,
        metavar="N", stored=_optional(_positive_int),
    ),
    OptionFlag(
        "interpolation", "--interpolation",
        "resize filter, OpenCV's kernel of that name (default auto: area to shrink, bilinear "
        "to enlarge)",
        choices=INTERPOLATIONS,
    ),
    OptionFlag(
        "color", "--color",
        "channels stored: rgb (default), bgr (OpenCV's order) or gray (H x W x 1)",
        choices=COLORS,
    ),
    OptionFlag(
        "max_pixels", "--max-pixels",
        f"refuse larger images without decoding them (default {DEFAULT_MAX_PIXELS:,})",
        whole_number, metavar="N", stored=_optional(_positive_int),
    ),
    OptionFlag(
        "reduced_decode", "--reduced-decode",
        "decode JPEGs shrunk 2x or more at 1/2, 1/4 or 1/8 scale: faster, pixels differ "
        "slightly from the full decode (recorded in the cache)",
        None, stored=_is_bool,
    ),
    OptionFlag(
        "pixels", "--pixels",
        "record layout: rgb (default) or yuv420 (planar I420, half the bytes; read back as "
        "RGB, see docs/pixels.md)",
        choices=px.LAYOUTS,
    ),
    OptionFlag(
        "keep_truncated", "--keep-truncated",
        "keep JPEGs cut short, their missing part grey (default: skip them as truncated)",
        None, stored=_is_bool,
    ),
    # uint8 is what --masks stores by default: flags() leaves it out.
    OptionFlag(
        "mask", "--mask-dtype",
        "how masks are stored (default uint8; uint16 for over 256 classes)",
        choices=px.MASKS, implied=("uint8",), stored=_optional(_is_str),
    ),
    # No flag: --masks and --coco turn it off, so that annotations line up with the pixels.
    OptionFlag("exif_orientation", None, parse=None, stored=_is_bool),
)  # fmt: skip
