"""Decoding and preprocessing: one image file to the exact uint8 pixels a cache stores.

The reference is OpenCV: ``cv2.imread(path, cv2.IMREAD_COLOR)`` (``IMREAD_GRAYSCALE`` for gray),
then ``cv2.resize`` to the size the options give, then ``cv2.cvtColor`` to RGB. OpenCV applies
EXIF orientation, drops alpha, reduces 16-bit to 8-bit and makes CMYK and gray 3-channel; so does
the cache, because it calls the same functions (a build with masks or COCO boxes adds
``cv2.IMREAD_IGNORE_ORIENTATION``: ``Options.exif_orientation``). ``cv2.imread`` is used rather
than ``cv2.imdecode``: on a truncated JPEG OpenCV 5 returns the partial image from ``imread``
but ``None`` from ``imdecode``.

The file is opened here, and ``cv2.imread`` is given ``/proc/self/fd/N``, a name that reaches it
whatever bytes its own name holds: OpenCV crashes (SIGSEGV) on a name that is not valid UTF-8,
which Python passes with surrogate escapes. The descriptor also shows, before any decoder runs,
whether the path is a regular file: a FIFO named ``x.jpg`` would block ``imread`` forever.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import cv2
import numpy as np

from . import format as fmt
from . import pixels as px
from ._interpolation import OPENCV
from .annotations import mask_record
from .errors import DecodeError
from .options import COLORS, DEFAULT_MAX_PIXELS, INTERPOLATIONS, Options
from .probe import declared_size, probe_size, sniff_format

if TYPE_CHECKING:  # (the sources read their bytes through this module)
    from .sources.base import ImageReader

# COLORS, DEFAULT_MAX_PIXELS, INTERPOLATIONS and Options are defined in .options, with the
# table of their flags; this module decodes with them, and its users have always found them here.
__all__ = [
    "COLORS",
    "DEFAULT_MAX_PIXELS",
    "INTERPOLATIONS",
    "Options",
    "decode_image",
    "decoder_versions",
]

# The reason a build gives for a JPEG it skips as cut short (without ``keep_truncated``).
TRUNCATED = fmt.BAD_REASONS[fmt.BAD_TRUNCATED]


def preprocess(
    img: np.ndarray, options: Options, native: tuple[int, int] | None = None
) -> np.ndarray:
    """Resize and convert a ``cv2.imread`` result as ``options`` say: the record, H x W x C
    uint8 (or, for ``pixels="yuv420"``, the planar record of ``mmcache.pixels``).

    ``native``: the image's full (height, width) when ``img`` was decoded at reduced scale.
    """
    h, w = img.shape[:2]
    oh, ow, _ = options.output_shape(*(native or (h, w)))
    if (oh, ow) != (h, w):
        interp = options.interpolation
        if interp == "auto":
            interp = "area" if oh <= h and ow <= w else "bilinear"
        img = cv2.resize(img, (ow, oh), interpolation=OPENCV[interp])
    return px.layout_named(options.pixels).encode(img, options.color, options.channels)


def read_flags(options: Options) -> int:
    """``cv2.imread``'s flags for ``options``: colour or gray, EXIF orientation applied or not."""
    flags = cv2.IMREAD_GRAYSCALE if options.color == "gray" else cv2.IMREAD_COLOR
    return flags if options.exif_orientation else flags | cv2.IMREAD_IGNORE_ORIENTATION


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
    path: str | os.PathLike, options: Options, name: str | None = None
) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    """``cv2.imread`` as ``options`` ask: ``(image or None, native (height, width))``.

    The native size differs from the image's only with ``reduced_decode``, for a JPEG that the
    options shrink by 2x or more: it is then read at the largest scale factor that keeps both
    sides at least the output size. ``name``: the name whose extension says "JPEG", when
    ``path`` has none (an archive member's bytes in a memory file).

    An image whose header declares more than ``options.max_pixels`` is not decoded: the image
    is None and the native size the header's (``too_large``). A header that does not settle
    the size leaves the limit to the decode that follows (docs/reliability.md).
    """
    path = os.fspath(path)
    jpeg = (name or path).lower().endswith((".jpg", ".jpeg"))
    with _imread_name(path) as name:
        if name is None:
            return None, None
        declared = declared_size(name)
        if declared is not None and too_large(declared, options):
            return None, declared  # refused before OpenCV allocates a single pixel
        if options.reduced_decode and jpeg:
            native = probe_size(name, options.exif_orientation)
            if native is not None:
                oh, ow, _ = options.output_shape(*native)
                for factor in (8, 4, 2):
                    if native[0] // factor >= oh and native[1] // factor >= ow:
                        kind = "gray" if options.color == "gray" else "color"
                        flags = _REDUCED_FLAGS[kind][factor]
                        if not options.exif_orientation:
                            flags |= cv2.IMREAD_IGNORE_ORIENTATION
                        img = cv2.imread(name, flags)
                        return img, native
        img = cv2.imread(name, read_flags(options))
    return img, None if img is None else img.shape[:2]


def sample_size(reader: ImageReader, path: str) -> tuple[int, int] | None:
    """``reader.size(path)`` (a kind's ``Source.images``), or None when it fails or gives no
    two positive integers: a header its reader cannot parse leaves the size to the decode."""
    try:
        size = reader.size(path)
        if size is None:
            return None
        height, width = (int(v) for v in size)
    except Exception:  # the kind's own code, whatever it raises: the decode says why
        return None
    return (height, width) if height > 0 and width > 0 else None


def read_sample(
    reader: ImageReader, path: str, options: Options
) -> tuple[np.ndarray | None, tuple[int, int] | None, str]:
    """``read_image`` for a file that its kind's ``reader`` reads (``Source.images``), with
    why it failed: ``(image as cv2.imread gives it, native (height, width), reason)``.

    A sample whose ``reader.size`` declares more than ``options.max_pixels`` is not read.
    """
    declared = sample_size(reader, path)
    if declared is not None and too_large(declared, options):
        return None, declared, ""
    try:
        img = np.ascontiguousarray(reader.read(path))
    except Exception as e:  # the kind's own code: its message is the skip reason
        return None, None, f"its kind's reader failed on it ({type(e).__name__}: {e})"
    image = img.ndim == 2 or (img.ndim == 3 and img.shape[2] == 3)
    if not image or img.dtype != np.uint8 or img.size == 0:
        got = f"a {img.dtype} array of shape {img.shape}"
        return None, None, f"its kind's reader gave {got}, not an H x W x 3 or H x W uint8 image"
    if options.color == "gray":  # as IMREAD_GRAYSCALE reads it
        img = img if img.ndim == 2 else cv2.cvtColor(img, cv2.COLOR_RGB2GRAY)
    else:  # as IMREAD_COLOR reads it: 3 channels, BGR
        img = cv2.cvtColor(img, cv2.COLOR_GRAY2BGR if img.ndim == 2 else cv2.COLOR_RGB2BGR)
    return img, (int(img.shape[0]), int(img.shape[1])), ""


# Where this OS names a process's open descriptors (Linux; /dev/fd on BSD and macOS).
_FD_DIR = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@contextmanager
def _imread_name(path: str) -> Iterator[str | None]:
    """A name ``cv2.imread`` can open for ``path`` (see the module docstring), or None when
    ``path`` is missing or not a regular file."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:
        yield None
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield None
        elif _FD_DIR is not None:
            yield f"{_FD_DIR}/{fd}"
        else:  # no descriptor names here: the path itself, if OpenCV can take it
            yield path if _utf8(path) else None
    finally:
        os.close(fd)


def _utf8(path: str) -> bool:
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_FILE_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def undecodable_reason(path: str | os.PathLike, decoder_message: str = "") -> str:
    """What a file that the decoder returned nothing for is, in words a user can act on.

    ``decoder_message``: what the decoder printed while it failed, added to the reason.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if os.path.islink(path) and not os.path.exists(path):
            return broken_link_reason(path)
        return f"cannot be opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        for is_kind, kind in _FILE_KINDS:
            if is_kind(st.st_mode):
                return f"not a regular file: {kind}"
        head = os.pread(fd, 512, 0)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    finally:
        os.close(fd)
    if st.st_size == 0:
        return "an empty file (0 bytes)"
    if head.startswith(_LFS_POINTER):
        return "a Git LFS pointer, not the image itself (fetch the images with `git lfs pull`)"
    image_format = sniff_format(head)
    detail = f" ({decoder_message})" if decoder_message else ""
    if image_format is not None:
        return f"a damaged or truncated {image_format} file: the decoder cannot read it{detail}"
    if b"\x00" not in head and _is_text(head):
        what = "an HTML page" if head.lstrip()[:1] == b"<" else "a text file"
        return f"{what}, not an image ({st.st_size:,} bytes){detail}"
    return (
        f"not an image: its first bytes ({head[:8].hex(' ')}) are those of no JPEG, PNG, BMP, "
        f"WebP or TIFF file{detail}"
    )


def _is_text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # a multi-byte character cut at the end of the read
    return True


def decode_image(path: str | os.PathLike, options: Options | None = None) -> np.ndarray:
    """The pixels a cache stores for ``path``: ``cv2.imread`` then ``preprocess``.

    Examples:
        >>> img = decode_image("cat.jpg", Options(short_side=256))  # doctest: +SKIP

    Raises:
        DecodeError: OpenCV cannot decode the file.
    """
    options = options or Options()
    img, native = read_image(path, options)
    if img is None and native is not None:
        assert options.max_pixels is not None  # Options replaces None with the default
        raise DecodeError(f"{path}: {too_large_reason(*native, options.max_pixels)}")
    if img is None:
        raise DecodeError(f"{path}: OpenCV cannot decode this file")
    return preprocess(img, options, native)


def decode_record(
    path: str,
    size: int,
    mtime_ns: int,
    opts: Options,
    capture: StderrCapture | None = None,
    mask: tuple[str, int, int] | None = None,
    name: str | None = None,
    reader: ImageReader | None = None,
) -> tuple[int, int, str, np.ndarray | None]:
    """Decode one listed file for a record: ``(state code, crc32, message, pixels)``.

    ``mask``: the ``(path, size, mtime_ns)`` of its mask as listed, for a cache whose records
    carry masks (``opts.mask``): the record is then the pixels with the mask
    (``annotations.mask_record``), or ``BAD_MASK`` with the reason.

    The file must have the size and mtime it was listed with, before and after decoding, or it
    is ``BAD_SOURCE_CHANGED``: pixels of a file replaced mid-way are never stored. ``pixels``
    is None unless the code is ``FILLED``; ``message`` is what the decoder printed (collected
    only with a ``capture``) or why the file is bad. ``name``: as ``read_image``'s.
    ``reader``: its kind's ``Source.images``, which reads the file instead of OpenCV.
    """
    try:
        before = os.stat(path)
    except OSError:
        if os.path.islink(path):  # listed, yet it leads nowhere: a link to fix, not a change
            return fmt.BAD_UNDECODABLE, 0, broken_link_reason(path), None
        return fmt.BAD_SOURCE_CHANGED, 0, "vanished since it was listed", None
    if (before.st_size, before.st_mtime_ns) != (size, mtime_ns):
        return fmt.BAD_SOURCE_CHANGED, 0, "changed since it was listed", None
    # A JPEG cut short in its image data, which libjpeg would decode saying "Premature end of
    # JPEG file" on the stderr of a process that fills records lazily (no capture there), is
    # refused before it is read: the refusal's reason says it. (Not a file a kind reads itself.)
    check_jpeg = reader is None and not opts.keep_truncated
    if check_jpeg and jpeg_end(path) == "scan":
        if _stat_key(path) != (size, mtime_ns):  # still being written, say
            return fmt.BAD_SOURCE_CHANGED, 0, "changed while it was decoded", None
        return fmt.BAD_TRUNCATED, 0, TRUNCATED, None
    img, native, message = _read(path, opts, capture, name, reader)
    if img is None and native is not None:  # its header declares more than max_pixels
        assert opts.max_pixels is not None  # Options replaces None with the default
        return fmt.BAD_TOO_LARGE, 0, too_large_reason(*native, opts.max_pixels), None
    if img is None:
        if _stat_key(path) != (size, mtime_ns):  # gone or rewritten while read: not its fault
            return fmt.BAD_SOURCE_CHANGED, 0, "changed or vanished while it was decoded", None
        why = undecodable_reason(path, message) if reader is None else message
        return fmt.BAD_UNDECODABLE, 0, why, None
    assert native is not None  # read_image gives the size of every image it read
    assert opts.max_pixels is not None  # Options replaces None with the default
    if too_large(native, opts):
        return fmt.BAD_TOO_LARGE, 0, too_large_reason(native[0], native[1], opts.max_pixels), None
    truncated = check_jpeg and jpeg_truncated(path)
    # np.require keeps a 0-d (I420) record as it is.
    pixels = None if truncated else np.require(preprocess(img, opts, native), requirements="C")
    # After the decode and the truncation check: a file still being written reads truncated.
    if _stat_key(path) != (size, mtime_ns):
        return fmt.BAD_SOURCE_CHANGED, 0, "changed while it was decoded", None
    if pixels is None:  # truncated
        return fmt.BAD_TRUNCATED, 0, TRUNCATED, None
    if mask is not None and opts.mask is not None:
        record = mask_record(pixels, mask, native, opts.mask)
        if isinstance(record, tuple):
            return record[0], 0, record[1], None
        pixels = record
    return fmt.FILLED, zlib.crc32(pixels.data), message, pixels


def _read(
    path: str,
    opts: Options,
    capture: StderrCapture | None,
    name: str | None,
    reader: ImageReader | None,
) -> tuple[np.ndarray | None, tuple[int, int] | None, str]:
    """``(image, native size, message)`` of ``path``: ``read_image`` and what the decoder
    printed (collected only with a ``capture``), or its kind's ``reader`` (``read_sample``)
    and why it failed."""
    if reader is not None:
        return read_sample(reader, path, opts)
    if capture is None:
        return (*read_image(path, opts, name), "")
    with capture:
        img, native = read_image(path, opts, name)
    return img, native, capture.text()


def too_large(native: tuple[int, int], opts: Options) -> bool:
    """Whether an image of ``native`` (height, width) has more pixels than ``opts`` allow."""
    assert opts.max_pixels is not None  # Options replaces None with the default
    return native[0] * native[1] > opts.max_pixels


def too_large_reason(height: int, width: int, max_pixels: int) -> str:
    """Why an image of ``height x width`` is refused under the pixel limit ``max_pixels``."""
    return (
        f"{width}x{height} pixels ({width * height:,}), more than the --max-pixels "
        f"(max_pixels) limit of {max_pixels:,}"
    )


def broken_link_reason(path: str | os.PathLike[str]) -> str:
    """What a symbolic link whose target is missing is, naming the target."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return f"a broken symbolic link: it points to {target}, which does not exist"


_JPEG_SOI = b"\xff\xd8\xff"
# In entropy-coded data a FF is followed by 00 (a stuffed byte), a restart marker D0-D7 or more
# fill FFs: the next other byte after a FF starts a marker.
_NEXT_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")


def jpeg_truncated(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a JPEG cut short: its segments end before the end-of-image marker
    (``jpeg_end`` says where)."""
    return jpeg_end(path) is not None


def jpeg_end(path: str | os.PathLike) -> str | None:
    """Where the JPEG ``path`` is cut short: ``"scan"`` in a scan's image data, ``"header"``
    in a segment before one, None if it is not (or not a JPEG, see below).

    libjpeg decodes such a file without error ("Premature end of JPEG file"), the rest of the
    image grey. The segments are walked from the start of the file, their lengths skipping
    their payloads (an EXIF thumbnail's own markers are inside one) and each scan's data
    skipped to the next marker, so bytes after the end-of-image marker (a phone's appended
    video, a vendor's trailer) are never read as the image's. None for other formats, for
    files whose markers do not parse, and for unreadable files (the decoder judged those).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)  # non-blocking: a FIFO put in its place never hangs
        try:
            data = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if not data.startswith(_JPEG_SOI):
        return None
    pos, size = 2, len(data)
    while pos + 2 <= size:
        if data[pos] != 0xFF:
            return None  # not where a marker belongs: malformed, the decoder's to judge
        marker = data[pos + 1]
        if marker == 0xD9:
            return None  # the end of the image
        if marker == 0xFF or 0xD0 <= marker <= 0xD7 or marker == 0x01:
            pos += 1 if marker == 0xFF else 2  # a fill byte, or a marker without a length
            continue
        if pos + 4 > size:
            return "header"
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xDA:  # a scan: its entropy-coded data runs to the next marker
            found = _NEXT_MARKER.search(data, pos)
            if found is None:
                return "scan"
            pos = found.start()
    return "header"


def _stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


_OPENCV_LOG_PREFIX = re.compile(r"^\[\s*\w+:\d+@[\d.]+\]\s*(global\s+\S+:\d+\s+\S+\s+)?")


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
        assert self._saved is not None  # set by __enter__
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def close(self) -> None:
        self._file.close()

    def text(self) -> str:
        self._file.seek(0)
        raw = self._file.read(4096).decode("utf-8", "replace")
        # One line per distinct message, in order (libjpeg repeats itself).
        # "[ WARN:0@0.012] global grfmt_png.cpp:855 read_chunk user chunk data is too large":
        # the message is what follows OpenCV's level, time and source location.
        lines = [_OPENCV_LOG_PREFIX.sub("", ln).strip() for ln in raw.splitlines()]
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
    for library in ("JPEG", "PNG", "TIFF", "WEBP"):
        m = re.search(rf"^\s*{library}:\s*(.+)$", info, re.MULTILINE)
        if m:
            versions[library.lower()] = m[1].strip()
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
