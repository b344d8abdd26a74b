"""probe_size must agree with cv2.imread(path, cv2.IMREAD_COLOR).shape[:2], or answer None.

The reference is always OpenCV itself, run on the same file: real-world files, files written by
OpenCV and Pillow in every supported format, EXIF orientations 1..8, hand-built edge cases, and
malformed or hostile files (which must give None or the right answer, and never raise).
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import TESTIMAGES
from PIL import Image

from mmcache.probe import probe_size

SIZES = [(37, 53), (53, 37), (1, 1), (17, 200), (96, 128)]  # (height, width), mostly non-square


def cv2_shape(path: Path) -> tuple[int, int] | None:
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    return None if img is None else img.shape[:2]


def assert_matches(path: Path) -> None:
    """Strict: the probe gives exactly what OpenCV gives, None included."""
    assert probe_size(path) == cv2_shape(path)


def assert_agrees(path: Path) -> None:
    """Lenient: the probe may say None (unsure), but a size it gives must be OpenCV's."""
    got = probe_size(path)
    assert got is None or got == cv2_shape(path)


def pixels(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (height, width, channels) if channels > 1 else (height, width)
    return rng.integers(0, 256, shape, dtype=np.uint8)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def pil_bytes(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def pil_exif(orientation: int) -> Image.Exif:
    """EXIF for Pillow's save(exif=...), holding just an Orientation tag."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


# --- builders for hand-made files ---------------------------------------------------------------


def exif_tiff(orientation: int | None, order: str = "<", before: tuple = ()) -> bytes:
    """A TIFF-structured EXIF blob: IFD0 holding `before` entries, then Orientation (SHORT)."""
    entries = [
        struct.pack(order + "HHI", tag, kind, count) + value for tag, kind, count, value in before
    ]
    if orientation is not None:
        entries.append(struct.pack(order + "HHIHH", 0x0112, 3, 1, orientation, 0))
    mark = b"II" if order == "<" else b"MM"
    return (
        mark
        + struct.pack(order + "HIH", 42, 8, len(entries))
        + b"".join(entries)
        + b"\x00\x00\x00\x00"
    )


def jpeg_segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload


def jpeg_segments(data: bytes) -> list[tuple[int, bytes]]:
    """The marker segments of a well-formed JPEG up to SOS; the rest as one (None, bytes) item."""
    out, pos = [], 2
    while True:
        marker = data[pos + 1]
        (length,) = struct.unpack_from(">H", data, pos + 2)
        out.append((marker, data[pos : pos + 2 + length]))
        pos += 2 + length
        if marker == 0xDA:
            out.append((None, data[pos:]))
            return out


def jpeg_with(base: bytes, insert: bytes = b"", before: int | None = None, edit=None) -> bytes:
    """base with `insert` before the first `before` marker (after SOI if None), segments edited."""
    out = b"\xff\xd8" + (insert if before is None else b"")
    done = before is None
    for marker, seg in jpeg_segments(base):
        if not done and marker == before:
            out += insert
            done = True
        out += edit(marker, seg) if edit else seg
    return out


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload)
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_with(base: bytes, pre: tuple = (), post: tuple = ()) -> bytes:
    """base with chunks inserted before the first IDAT and before IEND."""
    out, pos, placed = base[:8], 8, False
    while pos < len(base):
        (length,) = struct.unpack_from(">I", base, pos)
        kind = base[pos + 4 : pos + 8]
        if kind == b"IDAT" and not placed:
            out += b"".join(pre)
            placed = True
        if kind == b"IEND":
            out += b"".join(post)
        out += base[pos : pos + 12 + length]
        pos += 12 + length
    return out


def webp_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    out, pos = [], 12
    while pos + 8 <= len(data):
        kind, length = struct.unpack_from("<4sI", data, pos)
        out.append((kind, data[pos + 8 : pos + 8 + length]))
        pos += 8 + length + (length & 1)
    return out


def webp_chunk(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("<I", len(payload)) + payload + b"\x00" * (len(payload) & 1)


def webp_riff(chunks: list[bytes]) -> bytes:
    body = b"WEBP" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def vp8x(flags: int, width: int, height: int) -> bytes:
    dims = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return webp_chunk(b"VP8X", struct.pack("<I", flags) + dims)


def tiff_file(
    height: int,
    width: int,
    channels: int = 1,
    order: str = "<",
    dim_type: int = 3,
    orientation: int | None = None,
) -> bytes:
    """An uncompressed single-strip TIFF, either byte order, sizes as SHORT (3) or LONG (4)."""
    pix = pixels(height, width, channels).tobytes()
    n_entries = 9 + (orientation is not None)
    bps_at = 8 + 2 + 12 * n_entries + 4
    data_at = bps_at + 8

    def entry(tag: int, kind: int, count: int, value: int) -> bytes:
        inline_short = kind == 3 and count == 1  # otherwise a LONG value or offset
        field = struct.pack(
            order + ("HH" if inline_short else "I"), *((value, 0) if inline_short else (value,))
        )
        return struct.pack(order + "HHI", tag, kind, count) + field

    entries = [
        entry(256, dim_type, 1, width),
        entry(257, dim_type, 1, height),
        entry(258, 3, 1, 8) if channels == 1 else entry(258, 3, 3, bps_at),
        entry(259, 3, 1, 1),
        entry(262, 3, 1, 1 if channels == 1 else 2),
        entry(273, 4, 1, data_at),
        entry(277, 3, 1, channels),
        entry(278, 4, 1, height),
        entry(279, 4, 1, len(pix)),
    ]
    if orientation is not None:
        entries.insert(5, entry(0x0112, 3, 1, orientation))
    head = (b"II*\x00" if order == "<" else b"MM\x00*") + struct.pack(order + "I", 8)
    ifd = struct.pack(order + "H", len(entries)) + b"".join(entries) + b"\x00" * 4
    return head + ifd + struct.pack(order + "HHHH", 8, 8, 8, 0) + pix


# --- real-world files ---------------------------------------------------------------------------

_NAMES = sorted(p.name for p in TESTIMAGES.iterdir())


@pytest.mark.parametrize("name", _NAMES)
def test_testimages_match_cv2(name: str) -> None:
    path = TESTIMAGES / name
    expected = cv2_shape(path)
    got = probe_size(path)
    if expected is not None:
        assert got == expected
    else:  # broken.png, README.md, ...: any answer, as long as nothing is raised
        assert got is None or (isinstance(got, tuple) and len(got) == 2)


def test_testimages_probed_without_decoding() -> None:
    # The tricky ones are answered from headers, not by falling back to None.
    assert probe_size(TESTIMAGES / "junk_jpeg_header.jpg") == (768, 1024)
    assert probe_size(TESTIMAGES / "truncated_jpeg.jpg") == (100, 100)
    assert probe_size(TESTIMAGES / "pil_sample_cmyk.jpg") == (100, 100)


# --- generated files of every format ------------------------------------------------------------


@pytest.mark.parametrize("ext", [".jpg", ".png", ".bmp", ".webp", ".tif"])
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("size", SIZES)
def test_opencv_written_files(tmp_path: Path, ext: str, channels: int, size) -> None:
    path = tmp_path / f"img{ext}"
    assert cv2.imwrite(str(path), pixels(*size, channels))
    assert probe_size(path) == cv2_shape(path) == size


_PILLOW_WRITES = [  # (format, save options, modes Pillow can write in it)
    ("JPEG", {}, ["L", "RGB", "CMYK", "1"]),
    ("JPEG", {"progressive": True}, ["L", "RGB", "CMYK"]),
    ("PNG", {}, ["L", "RGB", "RGBA", "P", "1", "I;16"]),
    ("BMP", {}, ["L", "RGB", "RGBA", "P", "1"]),
    ("WEBP", {}, ["L", "RGB", "RGBA", "P"]),
    ("WEBP", {"lossless": True}, ["RGB", "RGBA"]),
    ("TIFF", {}, ["L", "RGB", "RGBA", "P", "1", "CMYK", "I;16"]),
    ("TIFF", {"compression": "tiff_lzw"}, ["L", "RGB"]),
]


@pytest.mark.parametrize(
    "fmt, kwargs, mode",
    [(fmt, kwargs, mode) for fmt, kwargs, modes in _PILLOW_WRITES for mode in modes],
)
def test_pillow_written_files(tmp_path: Path, fmt: str, kwargs: dict, mode: str) -> None:
    if mode == "I;16":
        img = Image.fromarray(pixels(37, 53, 1).astype(np.uint16) * 257)
    else:
        img = Image.fromarray(pixels(37, 53)).convert(mode)
    path = write(tmp_path / "img", pil_bytes(img, fmt, **kwargs))
    assert probe_size(path) == cv2_shape(path) == (37, 53)


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("dim_type", [3, 4])
@pytest.mark.parametrize("channels", [1, 3])
def test_tiff_byte_orders_and_field_types(
    tmp_path: Path, order: str, dim_type: int, channels: int
) -> None:
    path = write(tmp_path / "img.tif", tiff_file(37, 53, channels, order, dim_type))
    assert probe_size(path) == cv2_shape(path) == (37, 53)


def test_top_down_bmp(tmp_path: Path) -> None:
    data = bytearray(pil_bytes(Image.fromarray(pixels(37, 53)), "BMP"))
    data[22:26] = struct.pack("<i", -37)  # negative height: rows stored top-down
    path = write(tmp_path / "img.bmp", bytes(data))
    assert probe_size(path) == cv2_shape(path) == (37, 53)


def test_sixteen_bit_png(tmp_path: Path) -> None:
    path = tmp_path / "img.png"
    assert cv2.imwrite(str(path), pixels(37, 53).astype(np.uint16) * 257)
    assert probe_size(path) == cv2_shape(path) == (37, 53)


def test_extension_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path / "really_a_png.jpg", pil_bytes(Image.fromarray(pixels(37, 53)), "PNG"))
    assert probe_size(path) == cv2_shape(path) == (37, 53)
    assert probe_size(str(path)) == (37, 53)


# --- EXIF orientation ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_honoured(tmp_path: Path, fmt: str, orientation: int) -> None:
    data = pil_bytes(Image.fromarray(pixels(37, 53)), fmt, exif=pil_exif(orientation))
    path = write(tmp_path / "img", data)
    swapped = orientation in (5, 6, 7, 8)
    assert probe_size(path) == cv2_shape(path) == ((53, 37) if swapped else (37, 53))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_tiff_orientation(tmp_path: Path, orientation: int) -> None:
    # This OpenCV build reads 1..4 unrotated and fails on 5..8: the probe must not promise a size.
    for data in (
        tiff_file(37, 53, 3, "<", 3, orientation),
        tiff_file(37, 53, 1, ">", 4, orientation),
        pil_bytes(Image.fromarray(pixels(37, 53)), "TIFF", exif=pil_exif(orientation)),
    ):
        path = write(tmp_path / "img.tif", data)
        assert probe_size(path) == cv2_shape(path)
        assert probe_size(path) == (None if orientation >= 5 else (37, 53))


@pytest.mark.parametrize("order", ["<", ">"])
@pytest.mark.parametrize("orientation", [1, 3, 5, 6, 8])
def test_exif_both_byte_orders(tmp_path: Path, order: str, orientation: int) -> None:
    blob = exif_tiff(orientation, order)
    img = Image.fromarray(pixels(37, 53))
    jpeg = jpeg_with(pil_bytes(img, "JPEG"), jpeg_segment(0xE1, b"Exif\x00\x00" + blob))
    png = png_with(pil_bytes(img, "PNG"), pre=[png_chunk(b"eXIf", blob)])
    lossless = webp_chunks(pil_bytes(img, "WEBP", lossless=True))[-1]
    webp = webp_riff([vp8x(0x08, 53, 37), webp_chunk(*lossless), webp_chunk(b"EXIF", blob)])
    for name, data in (("a.jpg", jpeg), ("a.png", png), ("a.webp", webp)):
        path = write(tmp_path / name, data)
        assert probe_size(path) == cv2_shape(path), name
        assert probe_size(path) == ((53, 37) if orientation >= 5 else (37, 53)), name


def _jpeg_cases() -> dict[str, tuple[bytes, bool]]:
    """JPEG edge cases: name -> (file, strict). Strict cases must match cv2 exactly."""
    base = pil_bytes(Image.fromarray(pixels(37, 53)), "JPEG")
    exif = {o: jpeg_segment(0xE1, b"Exif\x00\x00" + exif_tiff(o)) for o in (1, 6)}
    no_orientation = jpeg_segment(0xE1, b"Exif\x00\x00" + exif_tiff(None))
    xmp = jpeg_segment(0xE1, b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta/>")
    bad_make = (0x010F, 2, 100, struct.pack("<I", 5000))  # string data past the blob's end
    unknown_tag = (0x0100, 4, 100, struct.pack("<I", 5000))  # OpenCV does not read tag 0x100

    def sof(**fields):
        def edit(marker, seg):
            if marker != 0xC0:
                return seg
            seg = bytearray(seg)
            for key, at, fmt in (("precision", 4, ">B"), ("height", 5, ">H"), ("width", 7, ">H")):
                if key in fields:
                    struct.pack_into(fmt, seg, at, fields[key])
            if "marker" in fields:
                seg[1] = fields["marker"]
            return bytes(seg)

        return edit

    cut_at_sos = len(base) - len(jpeg_segments(base)[-1][1])
    return {
        "fill_bytes": (jpeg_with(base, b"\xff\xff\xff", before=0xC0), True),
        "junk_before_marker": (jpeg_with(base, b"hello", before=0xC0), True),
        "stuffed_zero": (jpeg_with(base, b"\xff\x00", before=0xC0), True),
        "junk_with_ff_inside": (jpeg_with(base, b"ab\xffcd", before=0xC0), True),
        "rst_and_tem": (jpeg_with(base, b"\xff\xd0\xff\x01", before=0xC0), True),
        "unknown_marker": (jpeg_with(base, jpeg_segment(0x02, b"abcd"), before=0xC0), True),
        "jpg_marker": (jpeg_with(base, jpeg_segment(0xC8, b"abcd"), before=0xC0), True),
        "dnl": (jpeg_with(base, jpeg_segment(0xDC, b"\x00\x25"), before=0xC0), True),
        "com_length_0": (jpeg_with(base, b"\xff\xfe\x00\x00", before=0xC0), True),
        "app1_length_1": (jpeg_with(base, b"\xff\xe1\x00\x01", before=0xC0), True),
        "duplicate_sof": (
            jpeg_with(base, dict(jpeg_segments(base))[0xC0], before=0xDA),
            True,
        ),
        "second_soi": (jpeg_with(base, b"\xff\xd8", before=0xC0), True),
        "eoi_before_sos": (jpeg_with(base, b"\xff\xd9", before=0xDA), True),
        "exif_after_sof": (jpeg_with(base, exif[6], before=0xDA), True),
        "exif_after_scan": (base[:-2] + exif[6] + b"\xff\xd9", True),
        "exif_1_then_6": (jpeg_with(base, exif[1] + exif[6]), True),
        "exif_6_then_1": (jpeg_with(base, exif[6] + exif[1]), True),
        "exif_without_orientation_then_6": (jpeg_with(base, no_orientation + exif[6]), True),
        "xmp_then_exif_6": (jpeg_with(base, xmp + exif[6]), True),
        "exif_bad_signature": (
            jpeg_with(base, jpeg_segment(0xE1, b"Exif\x00\xff" + exif_tiff(6))),
            True,
        ),
        "exif_garbage_byte_order": (
            jpeg_with(base, jpeg_segment(0xE1, b"Exif\x00\x00XY" + exif_tiff(6, ">")[2:])),
            False,  # OpenCV 5.1 reads it as big-endian; None is right too
        ),
        "exif_in_app0": (jpeg_with(base, jpeg_segment(0xE0, b"Exif\x00\x00" + exif_tiff(6))), True),
        "exif_orientation_9": (
            jpeg_with(base, jpeg_segment(0xE1, b"Exif\x00\x00" + exif_tiff(9))),
            True,
        ),
        "exif_unread_tag_bad_offset": (
            jpeg_with(
                base, jpeg_segment(0xE1, b"Exif\x00\x00" + exif_tiff(6, before=(unknown_tag,)))
            ),
            True,
        ),
        "exif_make_bad_offset": (
            jpeg_with(base, jpeg_segment(0xE1, b"Exif\x00\x00" + exif_tiff(6, before=(bad_make,)))),
            False,  # OpenCV stops at the bad Make tag; another build might not: None is right
        ),
        "precision_12": (jpeg_with(base, edit=sof(precision=12)), True),
        "height_0": (jpeg_with(base, edit=sof(height=0)), True),
        "width_65535": (jpeg_with(base, edit=sof(width=65535)), True),
        "taller_than_data": (jpeg_with(base, edit=sof(height=60000)), True),
        "sof1_extended": (jpeg_with(base, edit=sof(marker=0xC1)), True),
        "sof3_lossless": (jpeg_with(base, edit=sof(marker=0xC3)), True),
        "sof5_hierarchical": (jpeg_with(base, edit=sof(marker=0xC5)), True),
        "cut_before_sos": (base[: cut_at_sos - 14], True),
        "cut_inside_sos_header": (base[: cut_at_sos - 3], False),
        "cut_right_after_sos": (base[:cut_at_sos], True),
        "no_ff_after_soi": (b"\xff\xd8\x00" + base[2:], True),
    }


_JPEG_CASES = _jpeg_cases()


@pytest.mark.parametrize("name", sorted(_JPEG_CASES))
def test_jpeg_edge_cases(tmp_path: Path, name: str) -> None:
    data, strict = _JPEG_CASES[name]
    path = write(tmp_path / "img.jpg", data)
    if strict:
        assert_matches(path)
    else:
        assert_agrees(path)


def _png_cases() -> dict[str, bytes]:
    base = pil_bytes(Image.fromarray(pixels(37, 53)), "PNG")
    blob = {o: png_chunk(b"eXIf", exif_tiff(o)) for o in (1, 6)}

    def corrupt(chunk: bytes) -> bytes:
        return chunk[:-1] + bytes([chunk[-1] ^ 1])

    idat_at = base.index(b"IDAT") - 4
    profile = b"Exif\x00\x00" + exif_tiff(6)
    raw_profile = b"Raw profile type exif\x00\nexif\n%8d\n%s\n" % (
        len(profile),
        profile.hex().encode(),
    )
    return {
        "exif_before_idat": png_with(base, pre=[blob[6]]),
        "exif_after_idat": png_with(base, post=[blob[6]]),
        "exif_1_then_6": png_with(base, pre=[blob[1], blob[6]]),
        "exif_6_then_1": png_with(base, pre=[blob[6], blob[1]]),
        "exif_before_1_after_6": png_with(base, pre=[blob[1]], post=[blob[6]]),
        "exif_bad_crc_then_6": png_with(base, pre=[corrupt(blob[1]), blob[6]]),
        "exif_prefixed_then_6": png_with(
            base, pre=[png_chunk(b"eXIf", b"Exif\x00\x00" + exif_tiff(1)), blob[6]]
        ),
        "exif_too_short_then_6": png_with(base, pre=[png_chunk(b"eXIf", b"II"), blob[6]]),
        "exif_empty_ifd_then_6": png_with(base, pre=[png_chunk(b"eXIf", exif_tiff(None)), blob[6]]),
        # ImageMagick's way of storing EXIF; this OpenCV build ignores it.
        "raw_profile_text": png_with(base, pre=[png_chunk(b"tEXt", raw_profile)]),
        "unknown_ancillary": png_with(base, pre=[png_chunk(b"abCd", b"x")]),
        "unknown_critical": png_with(base, pre=[png_chunk(b"ABCD", b"x")]),
        "unknown_critical_after_idat": png_with(base, post=[png_chunk(b"ABCD", b"x")]),
        "bad_chunk_name": png_with(base, pre=[png_chunk(b"ab1d", b"x")]),
        "idat_split_by_text": base[:idat_at]
        + png_chunk(b"IDAT", base[idat_at + 8 : idat_at + 18])
        + png_chunk(b"tEXt", b"a\x00b")
        + png_chunk(b"IDAT", base[idat_at + 18 : base.index(b"IEND") - 8])
        + base[base.index(b"IEND") - 4 :],
        "no_iend": base[: base.index(b"IEND") - 4],
        "iend_bad_crc": corrupt(base),
        "trailing_garbage": base + b"garbage",
        "ihdr_bad_crc": base[:29] + b"\x00\x00\x00\x00" + base[33:],
        "animated": png_with(base, pre=[png_chunk(b"acTL", struct.pack(">II", 1, 0))]),
    }


_PNG_CASES = _png_cases()


@pytest.mark.parametrize("name", sorted(_PNG_CASES))
def test_png_edge_cases(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "img.png", _PNG_CASES[name])
    if name == "animated":
        assert_agrees(path)
    else:
        assert_matches(path)


def _webp_cases() -> dict[str, bytes]:
    img = Image.fromarray(pixels(37, 53))
    cases = {}
    for lossless in (False, True):
        kind, payload = webp_chunks(pil_bytes(img, "WEBP", lossless=lossless))[-1]
        image = webp_chunk(kind, payload)
        exif = {o: webp_chunk(b"EXIF", exif_tiff(o)) for o in (1, 6)}
        tag = "lossless" if lossless else "lossy"
        cases.update(
            {
                f"{tag}_simple": webp_riff([image]),
                f"{tag}_exif_after_image": webp_riff([vp8x(0x08, 53, 37), image, exif[6]]),
                f"{tag}_exif_before_image": webp_riff([vp8x(0x08, 53, 37), exif[6], image]),
                f"{tag}_exif_flag_unset": webp_riff([vp8x(0, 53, 37), image, exif[6]]),
                f"{tag}_exif_in_simple_file": webp_riff([image, exif[6]]),
                f"{tag}_exif_1_then_6": webp_riff([vp8x(8, 53, 37), image, exif[1], exif[6]]),
                f"{tag}_exif_prefixed": webp_riff(
                    [vp8x(8, 53, 37), image, webp_chunk(b"EXIF", b"Exif\x00\x00" + exif_tiff(6))]
                ),
                f"{tag}_canvas_mismatch": webp_riff([vp8x(0, 60, 40), image]),
                f"{tag}_animation_flag": webp_riff([vp8x(0x02, 53, 37), image]),
                f"{tag}_unknown_chunk": webp_riff(
                    [vp8x(8, 53, 37), webp_chunk(b"ABCD", b"xyz"), image, exif[6]]
                ),
                f"{tag}_riff_size_past_eof": webp_riff([image])[:-4],
                f"{tag}_trailing_garbage": webp_riff([vp8x(8, 53, 37), image, exif[6]]) + b"junk",
            }
        )
    return cases


_WEBP_CASES = _webp_cases()


@pytest.mark.parametrize("name", sorted(_WEBP_CASES))
def test_webp_edge_cases(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "img.webp", _WEBP_CASES[name])
    assert_matches(path)


# --- malformed and hostile files ----------------------------------------------------------------


def _malformed() -> dict[str, bytes]:
    rgb = Image.fromarray(pixels(37, 53))
    jpeg, png = pil_bytes(rgb, "JPEG"), pil_bytes(rgb, "PNG")
    bmp, webp = pil_bytes(rgb, "BMP"), pil_bytes(rgb, "WEBP")
    tif = tiff_file(37, 53, 3)
    rng = np.random.default_rng(7)

    def ihdr(width: int, height: int, length: int = 13) -> bytes:
        body = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        head = struct.pack(">I", length) + body + struct.pack(">I", zlib.crc32(body))
        return b"\x89PNG\r\n\x1a\n" + head + png[33:]

    def patched(data: bytes, at: int, fmt: str, *values) -> bytes:
        out = bytearray(data)
        struct.pack_into(fmt, out, at, *values)
        return bytes(out)

    sof_at = jpeg.index(b"\xff\xc0")
    app0_len_at = 4
    return {
        "empty": b"",
        "jpeg_magic_only": b"\xff\xd8\xff",
        "jpeg_soi_app0_cut": jpeg[:10],
        "png_magic_only": png[:8],
        "png_ihdr_cut": png[:20],
        "bmp_magic_only": b"BM",
        "bmp_headers_only": bmp[:54],
        "webp_magic_only": webp[:12],
        "tiff_magic_only": b"II*\x00",
        "tiff_ifd_cut": tif[:30],
        "jpeg_segment_past_eof": patched(jpeg, app0_len_at, ">H", 0xFFFF)[:2000],
        "jpeg_segment_past_eof_end": jpeg[:sof_at] + b"\xff\xe2\xff\xff" + b"x" * 100,
        "png_ihdr_length_14": ihdr(53, 37, length=14),
        "png_ihdr_length_0": ihdr(53, 37, length=0),
        "png_huge_width": ihdr(0x7FFFFFFF, 1),
        "png_width_over_libpng_limit": ihdr(1_000_001, 1),
        "png_zero_height": ihdr(53, 0),
        "jpeg_huge_sof": patched(jpeg, sof_at + 5, ">HH", 65535, 65535),
        "jpeg_zero_width": patched(jpeg, sof_at + 7, ">H", 0),
        "bmp_huge_width": patched(bmp, 18, "<i", 0x7FFFFFFF),
        "bmp_min_height": patched(bmp, 22, "<i", -(2**31)),
        "bmp_negative_offset": patched(bmp, 10, "<i", -1),
        "bmp_huge_header_size": patched(bmp, 14, "<I", 0xFFFFFFF0),
        "bmp_many_colours": patched(pil_bytes(rgb.convert("P"), "BMP"), 46, "<i", 100_000),
        "tiff_huge_width": patched(tiff_file(37, 53, 3, "<", 4), 18, "<I", 2**32 - 1),
        "tiff_ifd_past_eof": patched(tif, 4, "<I", 2**32 - 1),
        "tiff_strip_past_eof": tif[:-1],
        "tiff_ifd_65535_entries": patched(tif, 8, "<H", 65535),
        "webp_huge_canvas": webp_riff([vp8x(0, 2**24, 2**24), webp_chunk(*webp_chunks(webp)[-1])]),
        "webp_riff_size_huge": patched(webp, 4, "<I", 0xFFFFFFFF),
        "webp_chunk_size_huge": patched(webp, 16, "<I", 0xFFFFFFF0),
        "random_bytes": rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "random_after_jpeg_magic": b"\xff\xd8\xff"
        + rng.integers(0, 256, 4096).astype(np.uint8).tobytes(),
        "random_after_png_magic": png[:8] + rng.integers(0, 256, 4096).astype(np.uint8).tobytes(),
        "random_after_tiff_magic": b"MM\x00*"
        + rng.integers(0, 256, 4096).astype(np.uint8).tobytes(),
        "jpeg_all_fill_bytes": b"\xff\xd8" + b"\xff" * 200_000,
        "jpeg_all_junk": b"\xff\xd8\xff" + b"\x00" * 200_000,
        "jpeg_many_segments": b"\xff\xd8" + b"\xff\xfe\x00\x02" * 5000 + jpeg[2:],
        "png_many_chunks": png[:33] + png_chunk(b"teSt", b"") * 30_000 + png[33:],
        "exif_ifd_65535_entries": jpeg[:2]
        + jpeg_segment(0xE1, b"Exif\x00\x00II*\x00\x08\x00\x00\x00\xff\xff" + b"\x00" * 12 * 2000)
        + jpeg[2:],
    }


_MALFORMED = _malformed()


@pytest.mark.parametrize("name", sorted(_MALFORMED))
def test_malformed_inputs_never_raise(tmp_path: Path, name: str) -> None:
    path = write(tmp_path / "img", _MALFORMED[name])
    assert_agrees(path)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP", "TIFF"])
def test_every_truncation_agrees(tmp_path: Path, fmt: str) -> None:
    kwargs = {} if fmt == "BMP" else {"exif": pil_exif(6)}  # BMP has no EXIF
    data = pil_bytes(Image.fromarray(pixels(37, 53)), fmt, **kwargs)
    path = write(tmp_path / "img", data)
    cuts = set(range(min(len(data), 400))) | set(range(400, len(data), 97))
    for cut in sorted(cuts, reverse=True):
        os.truncate(path, cut)  # far cheaper than rewriting the file each time
        assert_agrees(path)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "WEBP", "TIFF"])
def test_random_corruption_never_raises(tmp_path: Path, fmt: str) -> None:
    kwargs = {} if fmt == "BMP" else {"exif": pil_exif(6)}
    data = pil_bytes(Image.fromarray(pixels(37, 53)), fmt, **kwargs)
    rng = np.random.default_rng(11)
    path = write(tmp_path / "img", data)
    head = min(len(data), 512)  # the headers: where corruption matters to the probe
    with open(path, "r+b") as f:  # rewrite only the head in place: cheaper than new files
        for _ in range(300):
            mutated = bytearray(data[:head])
            for at in rng.integers(0, head, int(rng.integers(1, 6))):
                mutated[at] = int(rng.integers(0, 256))
            f.seek(0)
            f.write(mutated)
            f.flush()
            got = probe_size(path)
            if got is not None:
                assert isinstance(got, tuple) and len(got) == 2
                assert all(isinstance(v, int) and v > 0 for v in got)
                # A header it reads must give OpenCV's size, when OpenCV decodes the file (one
                # it cannot decode, a corrupt scan under a sound header, the build finds bad).
                try:
                    expected = cv2_shape(path)
                except cv2.error:  # OpenCV refuses some hostile headers by raising
                    expected = None
                assert expected is None or got == expected, bytes(mutated).hex()


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        probe_size(tmp_path / "nope.jpg")


def test_directory_is_not_an_image(tmp_path: Path) -> None:
    assert probe_size(tmp_path) is None
    assert cv2_shape(tmp_path) is None
