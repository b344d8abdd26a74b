"""The header parsers behind ``mmcache.probe``, one per format, and the bounded reader they share.

Each parser takes a ``Reader`` over a file (or an archive member) whose format ``sniff_format``
recognised and returns the ``(height, width)`` OpenCV's ``imread`` would, or ``None``; it raises
``Unsure`` where the headers do not settle the answer. The rules, format by format, mirror what
OpenCV 5.1 (libjpeg-turbo 3.1, libpng 1.6, libwebp, libtiff 4.7) was observed to do.
"""

from __future__ import annotations

import os
import struct
import zlib

# --- limits -------------------------------------------------------------------------------------


def _env_limit(name: str, default: int) -> int:
    # OpenCV reads these at start-up and refuses larger images; honour a plain integer override so
    # the probe never promises a size that imread would reject.
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


_MAX_WIDTH = _env_limit("OPENCV_IO_MAX_IMAGE_WIDTH", 1 << 20)
_MAX_HEIGHT = _env_limit("OPENCV_IO_MAX_IMAGE_HEIGHT", 1 << 20)
_MAX_PIXELS = _env_limit("OPENCV_IO_MAX_IMAGE_PIXELS", 1 << 30)

_BLOCK = 4096  # one read serves the headers of almost every file
_MAX_READ = 1 << 16  # no single read is larger, whatever a length field says
_MAX_JPEG_SEGMENTS = 1000  # real files have < 100 segments before the first SOS
_MAX_JPEG_JUNK = 1 << 16  # bytes libjpeg-style marker resynchronisation may skip in total
_MAX_PNG_CHUNKS = 20_000  # ~160 MB of 8 KiB IDAT chunks
_MAX_PNG_ANCILLARY = 1 << 22  # larger ancillary chunks are near libpng's 8 MB malloc limit
_MAX_PNG_EXIF = 1 << 15  # larger eXIf chunks are not read and checked: the answer is "unsure"
_MAX_WEBP_CHUNKS = 64
_MAX_IFD_ENTRIES = 1024
_MAX_TIFF_ARRAY = 1 << 16  # bytes of StripOffsets/StripByteCounts we read

_SWAPPING = frozenset((5, 6, 7, 8))  # EXIF orientations that transpose the image


class Unsure(Exception):
    """Raised internally when the headers do not settle the answer."""


if hasattr(os, "pread"):
    _pread = os.pread
else:  # pragma: no cover - Windows

    def _pread(fd: int, n: int, offset: int) -> bytes:
        os.lseek(fd, offset, os.SEEK_SET)
        return os.read(fd, n)


class Reader:
    """Random access to a file through at most two cached blocks.

    The first block stays cached because EXIF data near the start of a JPEG is parsed after the
    segment walk has moved on; the second block follows wherever the walk seeks.
    """

    __slots__ = ("_base", "_fd", "_win", "_win_at", "exif", "head", "size")

    def __init__(self, fd: int, size: int, base: int = 0, exif: bool = True) -> None:
        self._fd = fd
        self.exif = exif  # whether the decoder applies EXIF orientation (else it reads none)
        self._base = base  # where the image starts in the file (a member of an archive)
        self.size = size
        self.head = _pread(fd, min(_BLOCK, size), base)
        self._win = b""
        self._win_at = 0

    def read(self, offset: int, n: int) -> bytes:
        """Return up to ``n`` bytes at ``offset``; fewer only at end of file."""
        if n > _MAX_READ or offset < 0:
            raise Unsure  # never allocate from an unchecked length field
        end = offset + n
        if end <= len(self.head):
            return self.head[offset:end]
        at = self._win_at
        if at <= offset and end <= at + len(self._win):
            return self._win[offset - at : end - at]
        if n <= 0 or offset >= self.size:
            return b""
        data = _pread(self._fd, min(max(n, _BLOCK), self.size - offset), self._base + offset)
        self._win = data
        self._win_at = offset
        return data[:n]

    def byte(self, offset: int) -> int:
        """Return the byte at ``offset``, or -1 at end of file."""
        data = self.read(offset, 1)
        return data[0] if data else -1


def _checked(height: int, width: int, swap: bool) -> tuple[int, int] | None:
    # OpenCV validates the decoder's (pre-rotation) size before reading pixels.
    if not (0 < width <= _MAX_WIDTH and 0 < height <= _MAX_HEIGHT):
        return None
    if width * height > _MAX_PIXELS:
        return None
    return (width, height) if swap else (height, width)


# --- EXIF ---------------------------------------------------------------------------------------

# IFD0 tags OpenCV's ExifReader decodes, with where their data lies. A bad offset in one of them
# makes OpenCV stop reading the IFD (entries read so far are kept), so an Orientation after it
# may or may not be seen depending on the OpenCV version: that is "unsure".
_EXIF_STRING_TAGS = frozenset((0x010E, 0x010F, 0x0110, 0x0131, 0x0132, 0x8298))
_EXIF_RATIONAL_TAGS = {0x011A: 1, 0x011B: 1, 0x013E: 2, 0x013F: 6, 0x0211: 3, 0x0214: 6}
_ORIENTATION = 0x0112


def _exif_orientation(r: Reader, base: int, size: int) -> tuple[int, bool] | None:
    """First IFD0 Orientation OpenCV's ExifReader would see in a TIFF-structured EXIF blob.

    Args:
        r: The file.
        base: Offset of the blob (its ``II``/``MM`` byte-order mark) in the file.
        size: Length of the blob; nothing past it is read.

    Returns:
        ``(value, certain)``, where ``certain`` is False when a malformed entry before the
        Orientation tag could stop OpenCV short of it; ``None`` when OpenCV sees no Orientation.
    """
    if size < 8:
        return None
    header = r.read(base, 8)
    if len(header) < 8:
        return None
    # OpenCV reads little-endian after "II" and big-endian after anything else, "MM" or garbage;
    # garbage there is malformed enough that another OpenCV version may well reject it.
    bo = "<" if header[:2] == b"II" else ">"
    certain = header[:2] in (b"II", b"MM")
    mark, ifd = struct.unpack(bo + "HI", header[2:])
    if mark != 42 or ifd + 2 > size:
        return None
    field = r.read(base + ifd, 2)
    if len(field) < 2:
        return None  # the file shrank since it was opened
    (count,) = struct.unpack(bo + "H", field)
    walked = min(count, _MAX_IFD_ENTRIES)
    # Entries past the blob's end are cut off by the clipping, exactly where OpenCV would throw.
    data = r.read(base + ifd + 2, min(12 * walked, size - ifd - 2))
    for e in range(0, 12 * walked, 12):
        if e + 2 > len(data):
            return None
        (tag,) = struct.unpack_from(bo + "H", data, e)
        if tag == _ORIENTATION:
            if e + 10 > len(data):
                return None
            # OpenCV reads a 16-bit value at the value field whatever the declared type/count.
            return struct.unpack_from(bo + "H", data, e + 8)[0], certain
        if tag in _EXIF_STRING_TAGS or tag in _EXIF_RATIONAL_TAGS:
            if e + 12 > len(data):
                return None
            _, n, value = struct.unpack_from(bo + "HII", data, e + 2)
            if tag in _EXIF_STRING_TAGS:
                # OpenCV quirk: a string of <= 4 bytes is read from blob offset 8.
                ok = (8 + n <= size) if n <= 4 else (value + n <= size)
            else:
                ok = value + 8 * _EXIF_RATIONAL_TAGS[tag] <= size
            if not ok:
                certain = False
    if count > walked:
        raise Unsure  # an absurdly long IFD; do not walk it
    return None


def _swaps(results: list[tuple[int, bool] | None]) -> bool:
    """Whether OpenCV transposes the image, given the EXIF blobs it reads, in its order.

    OpenCV keeps the first Orientation it finds. An uncertain one may or may not be seen, so
    every outcome still possible is collected; more than one means unsure.
    """
    possible = set()
    for result in results:
        if result is None:
            continue
        value, certain = result
        possible.add(value in _SWAPPING)
        if certain:
            break
    else:
        possible.add(False)
    if len(possible) != 1:
        raise Unsure
    return possible.pop()


# --- JPEG ---------------------------------------------------------------------------------------

# JPEG: libjpeg's marker walk up to the first SOS. The frame (SOF) gives the size; every APP1
# starting "Exif\0\0" before SOS is parsed and the first IFD0 Orientation found wins.
# Baseline, extended, progressive and arithmetic frames; lossless (C3, CB), hierarchical and JPG
# (C5-C8, CD-CF) frames are refused, or may be, by libjpeg, so they answer None.
_JPEG_SOF_SUPPORTED = frozenset((0xC0, 0xC1, 0xC2, 0xC9, 0xCA))
_JPEG_TABLES = frozenset((0xC4, 0xCC, 0xDB, 0xDD))  # DHT, DAC, DQT, DRI
_JPEG_SKIPPABLE = frozenset(range(0xE0, 0xF0)) | {0xFE, 0xDC}  # APPn, COM, DNL
_JPEG_MAX_DIMENSION = 65500  # libjpeg's JPEG_MAX_DIMENSION


def _jpeg_next_marker(r: Reader, pos: int, budget: list[int]) -> tuple[int, int]:
    """libjpeg's next_marker(): skip junk and 0xFF fill bytes; return (marker, offset after it).

    ``budget`` holds the bytes that may still be skipped, shared over the file, so a file of
    junk costs a bounded amount of work.
    """
    while True:
        c = r.byte(pos)
        pos += 1
        while c != 0xFF:  # garbage before a marker: libjpeg warns and skips it
            if c < 0:
                raise Unsure
            budget[0] -= 1
            if budget[0] < 0:
                raise Unsure
            c = r.byte(pos)
            pos += 1
        c = r.byte(pos)
        pos += 1
        while c == 0xFF:  # fill bytes
            budget[0] -= 1
            if budget[0] < 0:
                raise Unsure
            c = r.byte(pos)
            pos += 1
        if c < 0:
            raise Unsure
        if c != 0:
            return c, pos
        budget[0] -= 2  # FF 00 is stuffed entropy data, not a marker: keep looking
        if budget[0] < 0:
            raise Unsure


def _jpeg(r: Reader) -> tuple[int, int] | None:
    pos = 2  # after SOI
    size: tuple[int, int] | None = None
    exif_blobs: list[tuple[int, int]] = []
    budget = [_MAX_JPEG_JUNK]
    for _ in range(_MAX_JPEG_SEGMENTS):
        field = r.read(pos, 4)
        if len(field) == 4 and field[0] == 0xFF and field[1] not in (0x00, 0xFF):
            # Fast path, the well-formed case: marker and length read at once.
            marker = field[1]
            pos += 2
            field = field[2:]
        else:
            marker, pos = _jpeg_next_marker(r, pos, budget)
            field = r.read(pos, 2)
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue  # TEM, RSTn: no length field
        if marker in (0xD8, 0xD9):
            return None  # second SOI, or EOI before any scan: libjpeg errors out
        if not (
            marker in _JPEG_SOF_SUPPORTED
            or marker in _JPEG_TABLES
            or marker in _JPEG_SKIPPABLE
            or marker == 0xDA
        ):
            return None  # unsupported SOF or unknown marker: libjpeg errors out
        if len(field) < 2:
            return None
        (length,) = struct.unpack(">H", field)
        if length < 2:
            if marker in _JPEG_SKIPPABLE:
                pos += 2  # libjpeg treats a bogus length as an empty segment
                continue
            return None
        if pos + length > r.size:
            return None  # segment runs past EOF: libjpeg never reaches SOS
        if marker == 0xDA:
            if size is None:
                return None  # SOS before SOF
            ns = r.byte(pos + 2)
            if not (1 <= ns <= 4 and length == 6 + 2 * ns):
                return None
            break
        if marker in _JPEG_SOF_SUPPORTED:
            if size is not None:
                return None  # duplicate SOF
            frame = r.read(pos, min(length, 8 + 3 * 255))
            if len(frame) < 8:
                return None
            precision, height, width, nc = struct.unpack_from(">BHHB", frame, 2)
            if precision != 8 or nc not in (1, 3, 4) or length != 8 + 3 * nc:
                return None  # 12-bit, 2-component, inconsistent length: not read as 8-bit BGR
            if height > _JPEG_MAX_DIMENSION or width > _JPEG_MAX_DIMENSION:
                return None
            for i in range(nc):
                sampling = frame[8 + 3 * i + 1]
                if not (1 <= sampling >> 4 <= 4 and 1 <= sampling & 15 <= 4):
                    return None
            size = (height, width)
        elif marker == 0xDD and length != 4:
            return None  # DRI has a fixed length
        elif marker == 0xE1 and length - 2 > 6 and r.read(pos + 2, 6) == b"Exif\x00\x00":
            exif_blobs.append((pos + 8, length - 8))
        pos += length
    else:
        return None
    swap = r.exif and _swaps([_exif_orientation(r, base, n) for base, n in exif_blobs])
    return _checked(size[0], size[1], swap)


# --- PNG ----------------------------------------------------------------------------------------
# IHDR gives the size. The first eXIf chunk libpng accepts (length >= 4, good CRC, starting
# "II*\0" or "MM\0*"), before or after the image data, gives the orientation; later ones are
# ignored as duplicates, and so are ImageMagick's tEXt "Raw profile type exif" chunks.


_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_PNG_USER_MAX = 1_000_000  # libpng's default user width/height limit


def _png(r: Reader) -> tuple[int, int] | None:
    ihdr = r.read(8, 25)
    if len(ihdr) < 25 or ihdr[:8] != b"\x00\x00\x00\x0dIHDR":
        return None  # IHDR must come first with length 13
    if zlib.crc32(ihdr[4:21]) != struct.unpack_from(">I", ihdr, 21)[0]:
        return None  # libpng errors on a bad CRC in a critical chunk
    width, height, depth, color, compression, filtering, interlace = struct.unpack_from(
        ">IIBBBBB", ihdr, 8
    )
    if depth not in _PNG_DEPTHS.get(color, ()) or compression or filtering or interlace > 1:
        return None
    if not (0 < width <= _PNG_USER_MAX and 0 < height <= _PNG_USER_MAX):
        return None
    # Walk every chunk to IEND: imread fails without IEND (png_read_end), and an eXIf after the
    # image data still counts.
    pos = 33
    seen_idat = idat_done = have_plte = False
    exif: tuple[int, bool] | None = None
    exif_accepted = False
    for _ in range(_MAX_PNG_CHUNKS):
        header = r.read(pos, 8)
        if len(header) < 8:
            return None  # truncated: no IEND
        length, kind = struct.unpack(">I4s", header)
        if length > 0x7FFFFFFF or not kind.isalpha():  # bytes.isalpha: ASCII letters only
            return None
        end = pos + 12 + length
        if end > r.size:
            return None
        if kind == b"IDAT":
            if idat_done or (color == 3 and not have_plte):
                return None  # split image data, or palette image without PLTE
            seen_idat = True
        else:
            idat_done = seen_idat
            if kind == b"IEND":
                if not seen_idat:
                    return None
                break
            if kind == b"PLTE" and not seen_idat:
                if have_plte:
                    return None  # duplicate PLTE
                have_plte = True
            elif kind[0] < 0x61:  # upper case: critical chunk libpng does not know (or a 2nd IHDR)
                return None
            elif kind == b"acTL":
                return None  # animated PNG: another code path in OpenCV
            elif length > _MAX_PNG_ANCILLARY:
                return None
            elif kind == b"eXIf" and not exif_accepted and length >= 4:
                if length > _MAX_PNG_EXIF:
                    raise Unsure
                body = r.read(pos + 4, length + 8)  # type, data, CRC
                if (
                    len(body) == length + 8
                    and zlib.crc32(body[:-4]) == struct.unpack(">I", body[-4:])[0]
                    and body[4:8] in (b"II*\x00", b"MM\x00*")
                ):
                    # libpng keeps the first valid eXIf and ignores later ones as duplicates.
                    exif_accepted = True
                    exif = _exif_orientation(r, pos + 8, length)
        pos = end
    else:
        return None
    return _checked(height, width, r.exif and _swaps([exif]))


# --- BMP ----------------------------------------------------------------------------------------
# The info header gives the size (a negative height means top-down rows); no orientation.


def _bmp(r: Reader) -> tuple[int, int] | None:
    header = r.read(0, 54)
    if len(header) < 26:
        return None
    offset, info_size = struct.unpack_from("<iI", header, 10)
    if info_size == 12:  # OS/2 BITMAPCOREHEADER: unsigned 16-bit sizes, always bottom-up
        width, height, _, bpp = struct.unpack_from("<HHHH", header, 18)
        if bpp not in (1, 4, 8, 24, 32):
            return None
        palette_end = 26 + (3 << bpp if bpp <= 8 else 0)
    elif 36 <= info_size < 0x80000000:  # BITMAPINFOHEADER and its V2..V5 extensions
        if len(header) < 50:
            return None
        width, height, _, bpp, compression = struct.unpack_from("<iiHHi", header, 18)
        (colors_used,) = struct.unpack_from("<i", header, 46)
        if compression == 0:
            if bpp not in (1, 4, 8, 16, 24, 32):
                return None
        elif compression == 3:
            if bpp not in (16, 32):
                return None
        else:
            return None  # RLE: only decoding tells whether the data is complete
        palette_end = 14 + info_size
        if bpp <= 8:
            if not 0 <= colors_used <= 256:
                return None
            palette_end += 4 * (colors_used or 1 << bpp)
        elif bpp == 16 and compression == 3:
            # OpenCV reads the masks right after the info header, accepting only 555 and 565.
            masks = r.read(palette_end, 12)
            palette_end += 12
            if len(masks) < 12 or struct.unpack("<iii", masks) not in (
                (0x7C00, 0x3E0, 0x1F),
                (0xF800, 0x7E0, 0x1F),
            ):
                return None
        height = abs(height)  # negative height: rows stored top-down, same shape
    else:
        return None
    if width <= 0 or height == 0 or offset < 0 or palette_end > r.size:
        return None
    pitch = ((width * bpp + 7) // 8 + 3) & ~3
    if offset + pitch * height > r.size:
        return None  # OpenCV fails on a short pixel array rather than returning part of it
    return _checked(height, width, False)


# --- WebP ---------------------------------------------------------------------------------------
# The VP8/VP8L frame header gives the size. Only an extended (VP8X) file whose EXIF flag is set
# has its first EXIF chunk read; an EXIF chunk elsewhere is ignored.


def _webp_bitstream(r: Reader, kind: bytes, pos: int, length: int) -> tuple[int, int] | None:
    """(height, width) from a VP8 or VP8L chunk's frame header, checked as libwebp does."""
    data = r.read(pos, 10)
    if kind == b"VP8 ":
        if length < 10 or len(data) < 10 or data[3:6] != b"\x9d\x01\x2a":
            return None
        bits = data[0] | data[1] << 8 | data[2] << 16
        # key frame, known profile, shown, first partition inside the chunk
        if bits & 1 or (bits >> 1) & 7 > 3 or not (bits >> 4) & 1 or bits >> 5 >= length:
            return None
        width, height = struct.unpack_from("<HH", data, 6)
        width &= 0x3FFF
        height &= 0x3FFF
    elif kind == b"VP8L":
        if length < 5 or len(data) < 5 or data[0] != 0x2F:
            return None
        (bits,) = struct.unpack_from("<I", data, 1)
        if bits >> 29:
            return None  # unknown version
        width = (bits & 0x3FFF) + 1
        height = ((bits >> 14) & 0x3FFF) + 1
    else:
        return None
    if width == 0 or height == 0:
        return None
    return height, width


def _webp(r: Reader) -> tuple[int, int] | None:
    if r.size < 32:
        return None  # shorter than OpenCV's WebP signature check reads
    (riff_size,) = struct.unpack_from("<I", r.head, 4)
    riff_end = 8 + riff_size
    if riff_end > r.size or riff_size < 12:
        return None  # libwebp wants the whole RIFF; trailing bytes past it are ignored
    first = r.read(12, 18)
    if len(first) < 8:
        return None
    kind, length = struct.unpack_from("<4sI", first)
    if 20 + length > riff_end:
        return None
    if kind != b"VP8X":
        size = _webp_bitstream(r, kind, 20, length)
        return None if size is None else _checked(size[0], size[1], False)
    if length != 10 or len(first) < 18:
        return None
    flags = first[8]
    canvas_w = int.from_bytes(first[12:15], "little") + 1
    canvas_h = int.from_bytes(first[15:18], "little") + 1
    if flags & 0x02:
        return None  # animation
    size = None
    exif = None
    pos = 30
    for _ in range(_MAX_WEBP_CHUNKS):
        if pos + 8 > riff_end:
            break
        header = r.read(pos, 8)
        if len(header) < 8:
            return None  # the file shrank since it was opened
        kind, length = struct.unpack("<4sI", header)
        if pos + 8 + length > riff_end:
            return None
        if kind in (b"VP8 ", b"VP8L") and size is None:
            size = _webp_bitstream(r, kind, pos + 8, length)
            if size is None:
                return None
        elif kind == b"EXIF" and flags & 0x08 and exif is None:
            # The first EXIF chunk is the one libwebpdemux hands to OpenCV.
            exif = (pos + 8, length)
        pos += 8 + length + (length & 1)
    else:
        return None
    if size is None or size != (canvas_h, canvas_w):
        return None  # libwebp rejects a canvas that differs from the still image
    swap = _swaps([_exif_orientation(r, *exif)]) if exif and r.exif else False
    return _checked(size[0], size[1], swap)


# --- TIFF ---------------------------------------------------------------------------------------
# The first IFD gives the size. This OpenCV build fails to read a TIFF whose Orientation is
# 5..8 (imread returns None), so those answer None; 1..4 keep the stored shape.

# Bytes per value of each TIFF field type (BYTE, ASCII, SHORT, LONG, RATIONAL, ..., IFD).
_TIFF_TYPE_SIZES = dict(zip(range(1, 14), (1, 1, 2, 4, 8, 1, 1, 2, 4, 8, 4, 8, 4), strict=True))


def _tiff_array(r: Reader, bo: str, entry: tuple[int, int, bytes]) -> list[int]:
    """Values of a SHORT/LONG array entry (StripOffsets and the like)."""
    kind, count, field = entry
    if kind not in (3, 4) or count == 0:
        raise Unsure
    nbytes = count * _TIFF_TYPE_SIZES[kind]
    if nbytes <= 4:
        data = field[:nbytes]
    else:
        if nbytes > _MAX_TIFF_ARRAY:
            raise Unsure
        data = r.read(struct.unpack(bo + "I", field)[0], nbytes)
        if len(data) < nbytes:
            raise Unsure
    return list(struct.unpack(bo + ("H" if kind == 3 else "I") * count, data))


def _tiff(r: Reader) -> tuple[int, int] | None:
    bo = "<" if r.head[:2] == b"II" else ">"
    field = r.read(4, 4)
    if len(field) < 4:
        return None
    (ifd,) = struct.unpack(bo + "I", field)
    if ifd < 8:
        return None
    field = r.read(ifd, 2)
    if len(field) < 2:
        return None
    (count,) = struct.unpack(bo + "H", field)
    if count == 0 or count > _MAX_IFD_ENTRIES:
        return None
    data = r.read(ifd + 2, 12 * count)
    if len(data) < 12 * count:
        return None
    entries: dict[int, tuple[int, int, bytes]] = {}
    for e in range(0, 12 * count, 12):
        tag, kind, n = struct.unpack_from(bo + "HHI", data, e)
        field = data[e + 8 : e + 12]
        if tag in entries:
            return None  # duplicate tag: which one libtiff keeps is not worth guessing
        item_size = _TIFF_TYPE_SIZES.get(kind)
        if item_size and n * item_size > 4:
            (value_at,) = struct.unpack(bo + "I", field)
            if value_at + n * item_size > r.size:
                return None  # out-of-line value past EOF: the file is truncated
        entries[tag] = (kind, n, field)

    def scalar(tag: int) -> int | None:
        if tag not in entries:
            return None
        kind, n, field = entries[tag]
        if n != 1 or kind not in (3, 4):
            raise Unsure
        return struct.unpack(bo + ("H" if kind == 3 else "I"), field[: 2 if kind == 3 else 4])[0]

    width = scalar(256)
    height = scalar(257)
    orientation = scalar(0x0112)
    if not width or not height or 262 not in entries or scalar(278) == 0:
        return None  # no size, no PhotometricInterpretation, or RowsPerStrip 0: OpenCV fails
    if orientation is not None and not 1 <= orientation <= 4:
        return None  # 5..8: this OpenCV build fails on them; others are invalid for libtiff
    # The image data must be in the file: libtiff fails on a truncated strip or tile.
    if 273 in entries:
        offsets, counts = 273, 279
    elif 324 in entries:
        offsets, counts = 324, 325
    else:
        return None
    if counts not in entries:
        return None
    starts = _tiff_array(r, bo, entries[offsets])
    lengths = _tiff_array(r, bo, entries[counts])
    if len(starts) != len(lengths):
        return None
    if max(s + n for s, n in zip(starts, lengths, strict=True)) > r.size:
        return None
    return _checked(height, width, False)


PARSERS = {"JPEG": _jpeg, "PNG": _png, "BMP": _bmp, "WebP": _webp, "TIFF": _tiff}
