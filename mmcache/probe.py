"""Image sizes from file headers, without decoding: what cv2.imread would return, in microseconds.

``probe_size`` reads a few kilobytes of a JPEG, PNG, BMP, WebP or TIFF file and returns the
``(height, width)`` that ``cv2.imread(path, cv2.IMREAD_COLOR)`` would return, EXIF orientation
included (``exif=False``: as ``IMREAD_IGNORE_ORIENTATION`` returns it), or ``None`` when the
headers do not settle it: another format, malformed or truncated headers, a size OpenCV
refuses, EXIF that OpenCV builds could read differently. ``None`` is always safe, as the caller
then decodes. The rules, format by format (``mmcache._headers``), mirror what OpenCV 5.1
(libjpeg-turbo 3.1, libpng 1.6, libwebp, libtiff 4.7) was observed to do. Only ``OSError`` from
reading the file propagates.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

from ._headers import PARSERS, Reader, Unsure

__all__ = ["declared_size", "probe_size", "sniff_format"]

_S_IFMT = 0o170000
_S_IFREG = 0o100000
# O_NONBLOCK: opening a FIFO must not hang a scan; O_BINARY: Windows.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)


def probe_region(fd: int, start: int, size: int, exif: bool = True) -> tuple[int, int] | None:
    """``probe_size`` of the image whose ``size`` bytes start at ``start`` of the open file
    ``fd`` (a member of an uncompressed archive); reads nothing outside them."""
    try:
        return _probe(Reader(fd, size, start, exif))
    except (Unsure, struct.error, IndexError, ValueError, OverflowError):
        return None


def probe_size(path: str | os.PathLike, exif: bool = True) -> tuple[int, int] | None:
    """(height, width) cv2.imread(path, cv2.IMREAD_COLOR) would return, from headers; else None.

    Args:
        path: The image file. Its format is recognised from its first bytes, as OpenCV does, not
            from its extension.
        exif: whether the size is after EXIF orientation (``cv2.IMREAD_COLOR``), or as stored
            (``cv2.IMREAD_IGNORE_ORIENTATION``, as annotated builds decode).

    Returns:
        ``(height, width)`` after EXIF orientation, or ``None`` when the format is not one of
        JPEG, PNG, BMP, WebP, TIFF, or the headers are malformed, truncated, describe an image
        OpenCV would refuse, or leave the orientation ambiguous.

    Raises:
        OSError: The file cannot be opened or read (e.g. ``FileNotFoundError``).
    """
    return _probe_file(path, _probe, exif)


def declared_size(path: str | os.PathLike) -> tuple[int, int] | None:
    """The (height, width) an image's header declares, before any pixel is decoded; else None.

    Unlike ``probe_size`` it does not promise what ``imread`` returns, only how many pixels a
    decode would allocate (``max_pixels`` is checked on it before decoding): orientation aside,
    and for a PNG from its IHDR alone, which libpng reads first whatever chunks follow (a 5 MiB
    text chunk leaves ``probe_size`` unsure, not this).

    Raises:
        OSError: The file cannot be opened or read.
    """
    return _probe_file(path, _declared)


def _declared(r: Reader) -> tuple[int, int] | None:
    ihdr = r.head[8:24]
    if sniff_format(r.head) == "PNG" and ihdr[:8] == b"\x00\x00\x00\x0dIHDR":
        width, height = struct.unpack_from(">II", ihdr, 8)
        return height, width
    return _probe(r)


def _probe_file(
    path: str | os.PathLike,
    probe: Callable[[Reader], tuple[int, int] | None],
    exif: bool = True,
) -> tuple[int, int] | None:
    """``probe`` of the regular file ``path``; None for any other kind of file, or a header
    that does not settle the size."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_mode & _S_IFMT != _S_IFREG:
            return None  # directories, FIFOs, devices: imread reads none of them
        reader = Reader(fd, st.st_size, exif=exif)
        try:
            return probe(reader)
        except (Unsure, struct.error, IndexError, ValueError, OverflowError):
            # struct/Index/Value/OverflowError are defence in depth: the parsers check bounds
            # first, but a hostile file must degrade to "unsure", never crash a dataset scan.
            return None
    finally:
        os.close(fd)


def sniff_format(head: bytes) -> str | None:
    """The image format a file's first 12 bytes announce (``"JPEG"``, ``"PNG"``, ``"BMP"``,
    ``"WebP"``, ``"TIFF"``), as OpenCV recognises it, or None."""
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:2] == b"BM":
        return "BMP"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    return None


def _probe(r: Reader) -> tuple[int, int] | None:
    kind = sniff_format(r.head)
    parser = None if kind is None else PARSERS.get(kind)
    return None if parser is None else parser(r)
