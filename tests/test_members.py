"""An archive member read and decoded where its address says it lies: a stored member is the
bytes there, a deflated one inflates to no more than its header declares and must match its
CRC-32, an archive changed since it was listed is never read, and each refusal says why.

The archives here are plain files with a member's bytes at a known offset (a raw deflate
stream for a deflated one, as in a zip): what the readers see of a tar or a zip."""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import write_image

from mmcache import format as fmt
from mmcache.decode import Options
from mmcache.sources import members as mod
from mmcache.sources.members import (
    MemberAddress,
    MemberGone,
    Members,
    decode_member,
    in_memory_file,
    is_member,
    member_file,
    open_archive,
    read_member,
)

DATA = bytes(range(256)) * 8  # 2,048 bytes
HEAD = b"H" * 100  # the member's headers, say
MAX = "268,435,456"  # MAX_INFLATED, 1 << 28, as the messages write it


def _deflated(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)  # a raw deflate stream, a zip's method 8
    return c.compress(data) + c.flush()


def _archive(path: Path, stored: bytes, tail: bytes = b"T" * 50) -> Path:
    path.write_bytes(HEAD + stored + tail)
    return path


def _ref(path: Path, stored: bytes, method: int = 0, crc: int = -1, **changes) -> MemberAddress:
    st = os.stat(path)
    fields = {"archive": str(path), "archive_size": st.st_size, "archive_mtime_ns": st.st_mtime_ns,
              "offset": len(HEAD), "length": len(stored), "method": method, "crc": crc,
              "name": "cat/a.png", **changes}  # fmt: skip
    return MemberAddress(**fields)


def _read(ref: MemberAddress, declared: int) -> bytes | str:
    fd = os.open(ref.archive, os.O_RDONLY)
    try:
        return read_member(fd, ref, declared)
    finally:
        os.close(fd)


def test_a_stored_member_is_the_bytes_at_its_offset(tmp_path):
    path = _archive(tmp_path / "a.tar", DATA)
    assert _read(_ref(path, DATA), 2048) == DATA
    # a stored member is not inflated: a size past what a deflated one may inflate to is no
    # reason to refuse it (its length is what is read)
    assert _read(_ref(path, DATA), (1 << 28) + 1) == DATA


@pytest.mark.parametrize("declared", [2048, 1 << 28])
def test_a_deflated_member_inflates_to_its_bytes_within_what_its_header_declares(
    tmp_path, declared
):
    raw = _deflated(DATA)
    path = _archive(tmp_path / "a.zip", raw)
    assert _read(_ref(path, raw, 8, zlib.crc32(DATA)), declared) == DATA


def test_a_member_with_the_crc_32_it_is_listed_with_is_read_and_one_without_is_not(tmp_path):
    path = _archive(tmp_path / "a.zip", DATA)
    failed = "its bytes fail the zip's CRC-32 check: the archive is damaged"
    assert _read(_ref(path, DATA, crc=zlib.crc32(DATA)), 2048) == DATA
    assert _read(_ref(path, DATA, crc=zlib.crc32(DATA) ^ 1), 2048) == failed
    assert _read(_ref(path, DATA, crc=0), 2048) == failed  # 0 is a CRC-32 like any other
    assert _read(_ref(path, DATA, crc=-1), 2048) == DATA  # -1: none listed (a tar member)


def test_a_deflated_member_that_would_inflate_past_its_header_s_size_is_refused(tmp_path):
    raw = _deflated(DATA)
    path = _archive(tmp_path / "a.zip", raw)
    ref = _ref(path, raw, 8, zlib.crc32(DATA))
    assert _read(ref, 2047) == (
        "it inflates to more than 2,047 bytes (what its header declares, at most "
        f"{MAX}): the archive is damaged or hostile"
    )
    assert _read(ref, 100) == (
        f"it inflates to more than 100 bytes (what its header declares, at most {MAX}): the "
        "archive is damaged or hostile"
    )


def test_a_deflated_member_whose_header_declares_more_than_256_mib_is_never_inflated(tmp_path):
    raw = _deflated(DATA)
    path = _archive(tmp_path / "a.zip", raw)
    assert _read(_ref(path, raw, 8, zlib.crc32(DATA)), (1 << 28) + 1) == (
        f"its header says it inflates to 268,435,457 bytes, more than the {MAX} mmcache "
        "inflates a zip member to"
    )


def test_damaged_compressed_bytes_are_refused_with_zlib_s_words(tmp_path):
    raw = b"\xff" * 32  # block type 3, which deflate does not have
    path = _archive(tmp_path / "a.zip", raw)
    assert _read(_ref(path, raw, 8), 2048) == (
        "its compressed bytes are damaged in the zip (Error -3 while decompressing data: "
        "invalid block type)"
    )


@pytest.mark.parametrize("method", [0, 8])
def test_a_member_that_runs_past_the_archive_s_end_is_truncated(tmp_path, method):
    path = _archive(tmp_path / "a.zip", DATA, tail=b"")
    ref = _ref(path, DATA, method, length=2049)
    assert _read(ref, 4096) == "the archive ends inside this member: it is truncated"


def _png(path: Path, width: int, height: int) -> bytes:
    return write_image(path, width, height, seed=3).read_bytes()


def test_a_member_decodes_to_the_pixels_of_its_file_extracted(tmp_path):
    png = _png(tmp_path / "x.png", 7, 5)
    path = _archive(tmp_path / "a.tar", png)
    state, crc, message, pixels = decode_member(_ref(path, png), len(png), 0, Options())
    expected = cv2.cvtColor(cv2.imread(str(tmp_path / "x.png")), cv2.COLOR_BGR2RGB)
    assert (state, message) == (fmt.FILLED, "") and pixels is not None
    assert np.array_equal(pixels, expected) and crc == zlib.crc32(expected.tobytes())


def test_a_deflated_member_decodes_to_the_pixels_of_its_file_extracted(tmp_path):
    png = _png(tmp_path / "x.png", 7, 5)
    raw = _deflated(png)
    path = _archive(tmp_path / "a.zip", raw)
    state, _, _, pixels = decode_member(_ref(path, raw, 8, zlib.crc32(png)), len(png), 0, Options())
    expected = cv2.cvtColor(cv2.imread(str(tmp_path / "x.png")), cv2.COLOR_BGR2RGB)
    assert state == fmt.FILLED and np.array_equal(pixels, expected)


def test_a_member_that_cannot_be_read_as_listed_is_a_changed_source_saying_why(tmp_path):
    png = _png(tmp_path / "x.png", 7, 5)
    path = _archive(tmp_path / "a.tar", png)
    ref = _ref(path, png)
    changed = (fmt.BAD_SOURCE_CHANGED, 0, "its archive changed since it was listed", None)
    opts = Options()
    assert decode_member(MemberGone("no longer in its archive"), len(png), 0, opts) == (
        fmt.BAD_SOURCE_CHANGED, 0, "no longer in its archive", None
    )  # fmt: skip
    assert decode_member(_ref(path, png, archive_size=ref.archive_size + 1), 1, 0, opts) == changed
    assert decode_member(_ref(path, png, archive_mtime_ns=1), len(png), 0, opts) == changed
    path.unlink()
    assert decode_member(ref, len(png), 0, opts) == (
        fmt.BAD_SOURCE_CHANGED, 0, "its archive vanished since it was listed", None
    )  # fmt: skip


def test_an_archive_rewritten_while_its_member_is_read_stores_nothing(tmp_path, monkeypatch):
    png = _png(tmp_path / "x.png", 7, 5)
    path = _archive(tmp_path / "a.tar", png)
    real = mod.read_member

    def rewritten(fd, ref, declared):
        data = real(fd, ref, declared)
        with open(path, "ab") as f:
            f.write(b"appended")
        return data

    monkeypatch.setattr(mod, "read_member", rewritten)
    assert decode_member(_ref(path, png), len(png), 0, Options()) == (
        fmt.BAD_SOURCE_CHANGED, 0, "its archive changed while it was read", None
    )  # fmt: skip


def test_a_member_whose_bytes_are_bad_is_undecodable_saying_why(tmp_path):
    png = _png(tmp_path / "x.png", 7, 5)
    path = _archive(tmp_path / "a.zip", png)
    assert decode_member(_ref(path, png, crc=1), len(png), 0, Options()) == (
        fmt.BAD_UNDECODABLE, 0, "its bytes fail the zip's CRC-32 check: the archive is damaged",
        None,
    )  # fmt: skip
    # stored bytes of another length than the member's size as listed
    assert decode_member(_ref(path, png), len(png) + 1, 0, Options()) == (
        fmt.BAD_UNDECODABLE, 0, f"holds {len(png):,} bytes, its header says {len(png) + 1:,}",
        None,
    )  # fmt: skip


def test_a_member_file_holds_the_member_s_bytes_or_is_none(tmp_path):
    raw = _deflated(DATA)
    path = _archive(tmp_path / "a.zip", raw)
    ref = _ref(path, raw, 8, zlib.crc32(DATA))
    with member_file(ref) as name:
        assert name is not None and Path(name).read_bytes() == DATA
    for bad in (
        MemberGone("no longer in its archive"),
        _ref(path, raw, 8, zlib.crc32(DATA) ^ 1),  # its CRC-32 fails
        _ref(path, raw, 8, zlib.crc32(DATA), archive_size=1),  # its archive changed
        _ref(path, raw, 8, zlib.crc32(DATA), archive_mtime_ns=1),
        _ref(path, raw, 8, zlib.crc32(DATA), archive=str(tmp_path / "gone.zip")),
    ):
        with member_file(bad) as name:
            assert name is None, bad


def test_an_in_memory_file_holds_the_bytes_and_is_not_inherited(tmp_path):
    with in_memory_file(DATA) as name:
        assert Path(name).read_bytes() == DATA
        fd = int(Path(name).name)
        assert os.readlink(name) == "/memfd:mmcache-member (deleted)"
        assert not os.get_inheritable(fd)


def test_without_memory_files_the_bytes_are_in_a_temporary_file_removed_after(monkeypatch):
    monkeypatch.delattr(os, "memfd_create")
    with in_memory_file(DATA) as name:
        assert Path(name).read_bytes() == DATA and Path(name).name.startswith("mmcache-member-")
    assert not Path(name).exists()


def _descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_an_archive_is_opened_read_only_without_blocking(tmp_path):
    path = _archive(tmp_path / "a.tar", DATA)
    fd = open_archive(path)
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert flags & os.O_ACCMODE == os.O_RDONLY and flags & os.O_NONBLOCK
        assert os.pread(fd, 4, 0) == b"HHHH"
    finally:
        os.close(fd)


def test_what_is_no_regular_file_is_refused_as_an_archive_and_left_closed(tmp_path):
    fifo = tmp_path / "a.tar"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # (so that even a blocking open would return)
    try:
        for path in (fifo, tmp_path):
            before = _descriptors()
            with pytest.raises(OSError) as e:
                open_archive(path)
            assert e.value.errno == errno.ENXIO
            assert e.value.strerror == "not a regular file (a FIFO, device or folder)"
            assert _descriptors() == before
    finally:
        os.close(writer)
    with pytest.raises(FileNotFoundError):
        open_archive(tmp_path / "gone.tar")


def _members(path: Path, stored: bytes, method: int, crc: int) -> Members:
    st = os.stat(path)
    return Members(
        archives=["/elsewhere.tar", str(path)],
        stats=[(1, 1), (st.st_size, st.st_mtime_ns)],
        names=["cat/x.png", "cat/a.png"],
        archive=np.array([0, 1], np.int32),
        offset=np.array([0, len(HEAD)], np.int64),
        length=np.array([1, len(stored)], np.int64),
        method=np.array([0, method], np.uint8),
        crc=np.array([-1, crc], np.int64),
        header=np.array([0, 0], np.int64),
    )


def test_a_listed_member_s_address_is_its_row_of_the_listing(tmp_path):
    path = _archive(tmp_path / "a.zip", DATA)
    ref = _members(path, DATA, 8, 0xDEADBEEF).ref(1)
    st = os.stat(path)
    assert ref == MemberAddress(str(path), st.st_size, st.st_mtime_ns, 100, 2048, 8,
                                0xDEADBEEF, "cat/a.png")  # fmt: skip
    assert all(type(v) is int for v in (ref.offset, ref.length, ref.method, ref.crc))
    assert is_member(ref) and is_member(MemberGone("gone"))
    assert not is_member(str(path)) and not is_member(path)


@pytest.mark.parametrize("method", [0, 8])
def test_a_listed_member_s_size_is_read_from_its_header(tmp_path, method):
    png = _png(tmp_path / "x.png", 7, 5)
    stored = _deflated(png) if method else png
    path = _archive(tmp_path / "a.zip", stored)
    assert _members(path, stored, method, zlib.crc32(png)).probe(1, len(png)) == (5, 7)
    # its bytes damaged, or its archive gone: no size
    assert _members(path, stored, method, zlib.crc32(png) ^ 1).probe(1, len(png)) == (
        None if method else (5, 7)  # a stored member's header is read in place, unchecked
    )
    assert _members(path, stored, method, -1).probe(0, 1) is None  # in /elsewhere.tar


def _rotated_jpeg(path: Path) -> bytes:
    """A JPEG stored 7 wide and 5 high with an EXIF block whose one tag is orientation 6
    (rotate 90 degrees clockwise to view): 5 wide and 7 high as viewed."""
    jpeg = write_image(path, 7, 5, seed=3).read_bytes()
    tiff = (
        b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
        + struct.pack("<HHIHH", 0x0112, 3, 1, 6, 0) + struct.pack("<I", 0)
    )  # fmt: skip
    payload = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


@pytest.mark.parametrize("method", [0, 8])
def test_a_listed_member_s_size_is_as_viewed_or_as_stored_as_asked(tmp_path, method):
    jpeg = _rotated_jpeg(tmp_path / "x.jpg")
    stored = _deflated(jpeg) if method else jpeg
    members = _members(_archive(tmp_path / "a.zip", stored), stored, method, zlib.crc32(jpeg))
    assert members.probe(1, len(jpeg)) == (7, 5)
    assert members.probe(1, len(jpeg), exif=True) == (7, 5)
    assert members.probe(1, len(jpeg), exif=False) == (5, 7)


class _Capture:
    """A stand-in for ``decode.StderrCapture``: says what it collected while entered."""

    def __init__(self) -> None:
        self.entered = 0

    def __enter__(self) -> _Capture:
        self.entered += 1
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def text(self) -> str:
        return "libpng warning: as the capture collected it"


def test_what_the_decoder_printed_while_a_member_decoded_is_its_record_s_message(tmp_path):
    png = _png(tmp_path / "x.png", 7, 5)
    path = _archive(tmp_path / "a.tar", png)
    capture = _Capture()
    state, _, message, _ = decode_member(_ref(path, png), len(png), 0, Options(), capture)
    assert (state, message, capture.entered) == (
        fmt.FILLED, "libpng warning: as the capture collected it", 1
    )  # fmt: skip
