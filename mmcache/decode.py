"""Decoding and preprocessing: one image file to the exact uint8 pixels a cache stores.

The reference is OpenCV: ``cv2.imread(path, cv2.IMREAD_COLOR)`` (``IMREAD_GRAYSCALE`` for gray),
then ``cv2.resize`` to the size the options give, then ``cv2.cvtColor`` to RGB. OpenCV applies
EXIF orientation, drops alpha, reduces 16-bit to 8-bit and makes CMYK and gray 3-channel; so does
the cache, because it calls the same functions. ``cv2.imread`` is used rather than
``cv2.imdecode``: on a truncated JPEG OpenCV 5 returns the partial image from ``imread`` but
``None`` from ``imdecode``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import cv2
import numpy as np

from .errors import DecodeError
from .probe import probe_size

# Pillow's decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): 1024 * 1024 * 1024 // 4 // 3.
DEFAULT_MAX_PIXELS = 89_478_485

INTERPOLATIONS = {
    "area": cv2.INTER_AREA,
    "linear": cv2.INTER_LINEAR,
    "cubic": cv2.INTER_CUBIC,
    "lanczos": cv2.INTER_LANCZOS4,
    "nearest": cv2.INTER_NEAREST,
}
COLORS = ("rgb", "bgr", "gray")


@dataclass(frozen=True)
class Options:
    """The preprocessing a cache applies, fixed at build time and recorded in its manifest.

    At most one of ``size`` (exact ``(width, height)``), ``max_side`` and ``short_side`` (keep the
    aspect ratio, never upscale) is set; none keeps the native size. ``interpolation`` ``"auto"``
    uses INTER_AREA to shrink and INTER_LINEAR to enlarge. ``color`` is ``"rgb"``, ``"bgr"`` or
    ``"gray"`` (stored H x W x 1). Files with more than ``max_pixels`` pixels are refused.

    ``reduced_decode`` (off by default, an explicit choice): a JPEG that shrinks by 2x or more is
    decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (OpenCV's ``IMREAD_REDUCED_*``), then
    resized to the same output size. 1.2-1.5x faster to decode, but the pixels differ from the
    full decode shrunk with INTER_AREA (by up to 34 levels at 1/2 and 15 at 1/4, measured with
    ``tools/decoders.py``), so it is recorded in the options and the cache's fingerprint.
    """

    size: tuple[int, int] | None = None
    max_side: int | None = None
    short_side: int | None = None
    interpolation: str = "auto"
    color: str = "rgb"
    max_pixels: int = DEFAULT_MAX_PIXELS
    reduced_decode: bool = False

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.size, self.max_side, self.short_side)) > 1:
            raise ValueError("choose at most one of size, max_side and short_side")
        if self.size is not None:
            size = tuple(int(v) for v in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"size must be (width, height) of positive ints, got {self.size}")
            object.__setattr__(self, "size", size)
        for name in ("max_side", "short_side", "max_pixels"):
            v = getattr(self, name)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.interpolation not in ("auto", *INTERPOLATIONS):
            raise ValueError(
                f"interpolation must be auto or one of {', '.join(INTERPOLATIONS)}, "
                f"got {self.interpolation!r}"
            )
        if self.color not in COLORS:
            raise ValueError(f"color must be one of {', '.join(COLORS)}, got {self.color!r}")

    @property
    def channels(self) -> int:
        return 1 if self.color == "gray" else 3

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["size"] = list(self.size) if self.size else None
        if not self.reduced_decode:
            del d["reduced_decode"]  # caches made before the option existed keep their fingerprint
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Options:
        d = dict(d)
        if d.get("size") is not None:
            d["size"] = tuple(d["size"])
        return cls(**d)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def output_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """The stored (H, W, C) of an image whose decoded native size is ``height x width``."""
        h, w = height, width
        if self.size is not None:
            w, h = self.size
        elif self.max_side is not None and max(h, w) > self.max_side:
            h, w = _scale_to(h, w, max(h, w), self.max_side)
        elif self.short_side is not None and min(h, w) > self.short_side:
            h, w = _scale_to(h, w, min(h, w), self.short_side)
        return h, w, self.channels


def _scale_to(h: int, w: int, side: int, target: int) -> tuple[int, int]:
    # Integer rounding, so that planning from headers and resizing after decoding agree exactly.
    return max(1, (h * target + side // 2) // side), max(1, (w * target + side // 2) // side)


def parse_size(text: str) -> tuple[int, int]:
    """``"224x160"`` -> ``(224, 160)`` (width, height)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 224x224), got {text!r}")
    return int(m[1]), int(m[2])


def preprocess(
    img: np.ndarray, options: Options, native: tuple[int, int] | None = None
) -> np.ndarray:
    """Resize and convert a ``cv2.imread`` result as ``options`` say; returns H x W x C uint8.

    ``native``: the image's full (height, width) when ``img`` was decoded at reduced scale.
    """
    h, w = img.shape[:2]
    oh, ow, _ = options.output_shape(*(native or (h, w)))
    if (oh, ow) != (h, w):
        interp = options.interpolation
        if interp == "auto":
            interp = "area" if oh <= h and ow <= w else "linear"
        img = cv2.resize(img, (ow, oh), interpolation=INTERPOLATIONS[interp])
    if options.color == "rgb":
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return img.reshape(oh, ow, options.channels)


def read_flags(options: Options) -> int:
    return cv2.IMREAD_GRAYSCALE if options.color == "gray" else cv2.IMREAD_COLOR


_REDUCED_FLAGS = {
    "color": {
        2: cv2.IMREAD_REDUCED_COLOR_2,
        4: cv2.IMREAD_REDUCED_COLOR_4,
        8: cv2.IMREAD_REDUCED_COLOR_8,
    },
    "gray": {
        2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
        4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
        8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
    },
}


def read_image(
    path: str | os.PathLike, options: Options
) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """``cv2.imread`` as ``options`` ask: ``(image or None, native (height, width))``.

    The native size differs from the image's only with ``reduced_decode``, for a JPEG that the
    options shrink by 2x or more: it is then read at the largest scale factor that keeps both
    sides at least the output size.
    """
    path = os.fspath(path)
    if options.reduced_decode and path.lower().endswith((".jpg", ".jpeg")):
        native = probe_size(path)
        if native is not None:
            oh, ow, _ = options.output_shape(*native)
            for factor in (8, 4, 2):
                if native[0] // factor >= oh and native[1] // factor >= ow:
                    kind = "gray" if options.color == "gray" else "color"
                    img = cv2.imread(path, _REDUCED_FLAGS[kind][factor])
                    return img, native
    img = cv2.imread(path, read_flags(options))
    return img, None if img is None else img.shape[:2]


def decode_image(path: str | os.PathLike, options: Options | None = None) -> np.ndarray:
    """The pixels a cache stores for ``path``: ``cv2.imread`` then ``preprocess``.

    Example:
        >>> img = decode_image("cat.jpg", Options(short_side=256))  # doctest: +SKIP

    Raises:
        DecodeError: OpenCV cannot decode the file.
    """
    options = options or Options()
    img, native = read_image(path, options)
    if img is None:
        raise DecodeError(f"{path}: OpenCV cannot decode this file")
    return preprocess(img, options, native)


class StderrCapture:
    """Collects what C libraries (libjpeg, libpng, OpenCV's logger) print while decoding.

    They write straight to file descriptor 2, out of Python's reach, so the descriptor is pointed
    at a temporary file for the duration. Costs a few microseconds per use. Not thread-safe:
    use it in single-threaded decode workers.
    """

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the capture)
        self._saved: int | None = None

    def __enter__(self) -> StderrCapture:
        self._file.seek(0)
        self._file.truncate()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def close(self) -> None:
        self._file.close()

    def text(self) -> str:
        self._file.seek(0)
        raw = self._file.read(4096).decode("utf-8", "replace")
        # One line per distinct message, in order (libjpeg repeats itself).
        lines = [re.sub(r"^\[\s*\w+:\d+@[\d.]+\]\s*", "", ln).strip() for ln in raw.splitlines()]
        return "; ".join(dict.fromkeys(ln for ln in lines if ln))


# Decoders the build calls besides OpenCV, as name -> function returning its version. Whoever
# routes a format through another library (say simplejpeg for JPEGs) adds it here, e.g.
# ``"simplejpeg": lambda: simplejpeg.__version__``, so that decoder_versions() names it and a
# cache filled by another version of it counts as stale. Empty: OpenCV decodes everything.
EXTRA_DECODERS: dict[str, Callable[[], str]] = {}


def decoder_versions() -> dict[str, str]:
    """The decoder libraries in use, with versions: part of a cache's fingerprint."""
    info = cv2.getBuildInformation()
    versions = {"opencv": cv2.__version__}
    for fmt in ("JPEG", "PNG", "TIFF", "WEBP"):
        m = re.search(rf"^\s*{fmt}:\s*(.+)$", info, re.MULTILINE)
        if m:
            versions[fmt.lower()] = m[1].strip()
    for name, version in EXTRA_DECODERS.items():
        versions[name] = str(version())
    return versions


def decoder_fingerprint(versions: dict[str, str] | None = None) -> str:
    versions = decoder_versions() if versions is None else versions
    return hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()


def decoder_accepted(recorded: str | None, trusted: Any = None) -> bool:
    """Whether this machine's decoder may read a cache's pixels as its own.

    Args:
        recorded: the manifest's ``fingerprints["decoder"]`` (the decoder that wrote it).
        trusted: the manifest's ``"trusted_decoder"`` (``{"versions", "fingerprint", ...}``),
            a decoder a user declared equivalent with ``--trust-decoder``, if any.
    """
    current = decoder_fingerprint()
    return recorded == current or (
        isinstance(trusted, dict) and trusted.get("fingerprint") == current
    )
