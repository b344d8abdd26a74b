"""A zip source's listing, read against zips written here byte by byte after the format's
specification (PKWARE's APPNOTE.TXT): each member's bytes where its own local header ends, its
time from the DOS date and time fields, what is left out and what is refused, word for word."""

from __future__ import annotations

import errno
import os
import stat
import struct
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from mmcache import scan_source
from mmcache.errors import SourceError
from mmcache.sources import zip_archive
from mmcache.sources.zip_archive import ZIP

REGULAR = (stat.S_IFREG | 0o644) << 16  # a file's Unix mode, as zip -X writes it
LINK = (stat.S_IFLNK | 0o777) << 16


def dos_date(year: int, month: int, day: int) -> int:
    """APPNOTE 4.4.6: bits 15-9 the year since 1980, 8-5 the month, 4-0 the day."""
    return (year - 1980) << 9 | month << 5 | day


def dos_time(hour: int, minute: int, second: int) -> int:
    """APPNOTE 4.4.6: bits 15-11 the hour, 10-5 the minute, 4-0 the seconds halved."""
    return hour << 11 | minute << 5 | second // 2


def local_header(m: dict) -> bytes:
    """APPNOTE 4.3.7: signature, version needed, flags, method, time, date, CRC-32, stored
    and inflated sizes, name and extra field lengths (30 bytes), the name, the extra field."""
    fixed = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, m["method"], m["time"],
                        m["date"], m["crc"], len(m["data"]), m["size"], len(m["name"]),
                        len(m["extra"]))  # fmt: skip
    return fixed + m["name"] + m["extra"]


def central_header(m: dict, at: int) -> bytes:
    """APPNOTE 4.3.12: 46 bytes (the local header's fields, a comment length, disk, internal
    and external attributes, where the local header is), then the name; no extra field."""
    fixed = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0x0314, 20, 0, m["method"],
                        m["time"], m["date"], m["crc"], m.get("stored", len(m["data"])),
                        m["size"], len(m["name"]), 0, 0, 0, 0, m["mode"],
                        m.get("header_at", at))  # fmt: skip
    return fixed + m["name"]


def end_record(count: int, directory: int, at: int, comment: bytes = b"") -> bytes:
    """APPNOTE 4.3.16: 22 bytes (disk numbers, entry counts, the directory's size and place,
    the comment's length), then the comment."""
    return struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, count, count, directory, at,
                       len(comment)) + comment  # fmt: skip


def member(name: str, data: bytes = b"image bytes", **fields) -> dict:
    """A member stored as ``data``: 1980-01-01 00:00:00, a regular file, no local extra."""
    return {"name": name.encode(), "data": data, "method": 0, "time": 0,
            "date": dos_date(1980, 1, 1), "crc": 0x12345678, "size": len(data), "extra": b"",
            "mode": REGULAR, **fields}  # fmt: skip


def write_zip(path: Path, members: list[dict], comment: bytes = b"") -> list[int]:
    """The zip of ``members`` in order, then its directory and end record; where each
    member's local header starts."""
    blob, starts = b"", []
    for m in members:
        starts.append(len(blob))
        blob += local_header(m) + m["data"]
    directory = b"".join(central_header(m, at) for m, at in zip(members, starts, strict=True))
    path.write_bytes(blob + directory + end_record(len(members), len(directory), len(blob),
                                                   comment))  # fmt: skip
    return starts


def refusal(path: Path, what: str) -> str:
    return (f"{path.name}: a damaged or truncated archive: {what}. Nothing was built from it; "
            "download or create it again")  # fmt: skip


def test_each_member_s_bytes_start_where_its_own_local_header_ends(tmp_path):
    # The local extra fields (7 and 300 bytes) are not in the directory, whose headers have
    # none: the data starts 30 + name + local extra bytes after the local header.
    a = member("cat/a.jpg", b"A" * 50, extra=b"\x01" * 7, crc=3_000_000_001)
    b = member("dog/b.png", b"deflated!", method=8, size=4096, extra=b"\x02" * 300, crc=17)
    path = tmp_path / "t.zip"
    first, second = write_zip(path, [a, b])
    assert (first, second) == (0, 30 + 9 + 7 + 50)
    listing = scan_source(path)
    assert (listing.kind, listing.classes, listing.paths) == (
        "zip",
        ["cat", "dog"],
        ["cat/a.jpg", "dog/b.png"],
    )
    assert listing.labels.tolist() == [0, 1]
    m = listing.members
    assert m.archives == [str(path)] and m.archive.tolist() == [0, 0]
    assert m.stats == [(path.stat().st_size, path.stat().st_mtime_ns)]
    assert m.offset.tolist() == [30 + 9 + 7, second + 30 + 9 + 300]
    assert m.length.tolist() == [50, 9]
    assert m.method.tolist() == [0, 8]
    assert m.crc.tolist() == [3_000_000_001, 17]
    assert m.header.tolist() == [0, second]
    assert listing.sizes.tolist() == [50, 4096]  # as inflated
    raw = path.read_bytes()
    assert [raw[o : o + n] for o, n in zip(m.offset, m.length, strict=True)] == [
        b"A" * 50,
        b"deflated!",
    ]


# (the DOS date and time fields, the CRC-32, the member's time in ns: its seconds since
# 1970 in UTC, and the CRC-32's last nine decimal digits in the nanoseconds)
ZIP_TIMES = {
    "2020-03-04 05:06:08": (
        (2020, 3, 4),
        (5, 6, 8),
        3_123_456_789,
        int(datetime(2020, 3, 4, 5, 6, 8, tzinfo=timezone.utc).timestamp()) * 10**9 + 123_456_789,
    ),
    "odd seconds step down to even": (
        (2107, 12, 31),
        (23, 59, 59),
        999_999_999,
        int(datetime(2107, 12, 31, 23, 59, 58, tzinfo=timezone.utc).timestamp()) * 10**9
        + 999_999_999,
    ),
    "1980-01-01, the first DOS date": ((1980, 1, 1), (0, 0, 0), 1, 315_532_800 * 10**9 + 1),
    "a month 0 is time 0": ((2020, 0, 1), (12, 0, 0), 4_000_000_123, 123),
    "a month 15 is time 0": ((2020, 15, 1), (0, 0, 0), 2_500_000_007, 500_000_007),
}


@pytest.mark.parametrize("case", list(ZIP_TIMES))
def test_a_member_s_time_is_its_dos_date_and_time_in_utc_with_its_crc_in_the_ns(tmp_path, case):
    day, clock, crc, expected = ZIP_TIMES[case]
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/a.jpg", date=dos_date(*day), time=dos_time(*clock), crc=crc)])
    assert scan_source(path).mtimes.tolist() == [expected]


def test_members_that_are_not_images_to_read_are_left_out_and_said(tmp_path):
    # each left out before a member that is listed: the scan goes on past it
    path = tmp_path / "t.zip"
    write_zip(path, [
        member("/abs.jpg"),
        member("cat/../../up.jpg"),
        member("cat/link.jpg", mode=LINK),
        member("cat/bz.jpg", method=12),
        member("cat/twice.jpg"),
        member("cat/twice.jpg", b"second"),
        member("cat/a.jpg"),
    ])  # fmt: skip
    listing = scan_source(path)
    assert listing.paths == ["cat/a.jpg", "cat/twice.jpg"]
    assert listing.members.length.tolist() == [11, 6]  # the last copy of the twice
    assert listing.warnings == [
        {"path": "/abs.jpg", "reason": "an absolute name in t.zip: left out (where it belongs is "
         "unclear: tar extracts it with its leading '/' removed, under a folder of that name, "
         "which a source would read as a class)"},
        {"path": "cat/../../up.jpg", "reason": "a name in t.zip that climbs out with '..': left "
         "out (extraction refuses it)"},
        {"path": "cat/link.jpg", "reason": "a link in t.zip: left out, links in archives are not "
         "followed"},
        {"path": "cat/bz.jpg", "reason": "compressed in t.zip with zip method 12, which mmcache "
         "does not read: left out (store or deflate it)"},
        {"path": "cat/twice.jpg", "reason": "appears more than once in t.zip: the last copy is "
         "used, as extraction keeps it"},
    ]  # fmt: skip


@pytest.mark.parametrize("mode", [0, REGULAR, (stat.S_IFREG | 0o777) << 16 | 0x20])
def test_a_member_without_a_link_s_mode_is_listed(tmp_path, mode):
    # 0: a zip made on another system than Unix records no mode; 0x20: MS-DOS's archive bit
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/a.jpg", mode=mode)])
    listing = scan_source(path)
    assert (listing.paths, listing.warnings) == (["cat/a.jpg"], [])


def test_a_folder_member_makes_a_class_even_without_images(tmp_path):
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/", b""), member("cat/a.jpg")])
    assert scan_source(path).paths == ["cat/a.jpg"]  # listed after its folder
    write_zip(path, [member("cat/a.jpg"), member("empty/", b"")])
    with pytest.raises(SourceError) as caught:
        scan_source(path)
    assert str(caught.value) == (
        f"{path}: 1 class folder(s) without images ('empty'), which would be classes no "
        "sample has (torchvision's ImageFolder refuses them too)"
    )


def _damaged(path: Path, case: str) -> None:
    a = member("cat/a.jpg", b"A" * 40)
    if case == "no local header there":
        write_zip(path, [{**a, "header_at": 5}])
    elif case == "a local header cut short":
        # the directory points into the zip's comment, 14 bytes from the end of the file,
        # which begins as a local header does
        comment = b"PK\x03\x04" + b"\0" * 10
        at = 30 + 9 + 40 + 46 + 9 + 22
        write_zip(path, [{**a, "header_at": at}], comment)
    elif case == "a member past the end":
        write_zip(path, [{**a, "stored": 40 + 46 + 9 + 22 + 1}])
    elif case == "not a zip":
        path.write_bytes(b"PK\x03\x04" + b"\0" * 100)


ZIP_REFUSALS = {
    "no local header there": "member 'cat/a.jpg' has no local header where the directory says",
    "a local header cut short": "member 'cat/a.jpg' has no local header where the directory says",
    "a member past the end": "it ends inside member 'cat/a.jpg'",
    "not a zip": "it does not read as a zip (File is not a zip file)",
}


@pytest.mark.parametrize("case", list(ZIP_REFUSALS))
def test_a_damaged_zip_is_refused_saying_where(tmp_path, case):
    path = tmp_path / "t.zip"
    _damaged(path, case)
    with pytest.raises(SourceError) as caught:
        scan_source(path)
    assert str(caught.value) == refusal(path, ZIP_REFUSALS[case])


def test_a_member_said_to_run_to_the_archive_s_last_byte_is_not_refused(tmp_path):
    # its stored length as the directory gives it takes in the directory and end record
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/a.jpg", b"A" * 40, stored=40 + 46 + 9 + 22)])
    assert scan_source(path).members.length.tolist() == [40 + 46 + 9 + 22]


def test_a_read_error_names_the_archive_and_the_system_s_words(tmp_path, monkeypatch):
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/a.jpg")])

    def failing(fd: int, n: int, at: int) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(zip_archive.os, "pread", failing)
    with pytest.raises(SourceError) as caught:
        scan_source(path)
    assert str(caught.value) == f"{path}: cannot read the archive (Input/output error)"


def test_a_zip_is_named_by_its_suffix_in_any_case_and_must_be_a_file(tmp_path, monkeypatch):
    write_zip(tmp_path / "a.ZIP", [member("cat/a.jpg")])
    (tmp_path / "d.zip").mkdir()
    os.mkfifo(tmp_path / "f.zip")
    (tmp_path / "a.zip.txt").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path))
    claimed = {
        (name, key): ZIP.claims(tmp_path / name, key)
        for name in ("a.ZIP", "d.zip", "f.zip", "m.zip", "a.zip.txt")
        for key in (None, "cls")
    }
    assert claimed == {
        ("a.ZIP", None): True, ("a.ZIP", "cls"): True,
        ("d.zip", None): False, ("d.zip", "cls"): False,
        # a FIFO given a label key: claimed, so that the zip's refusal of the key is said
        ("f.zip", None): False, ("f.zip", "cls"): True,
        ("m.zip", None): False, ("m.zip", "cls"): False,
        ("a.zip.txt", None): False, ("a.zip.txt", "cls"): False,
    }  # fmt: skip
    assert ZIP.claims("~/a.ZIP", None) and ZIP.claims("~/f.zip", "cls")
    assert np.array_equal(scan_source("~/a.ZIP").sizes, [11])


def test_a_zip_refuses_a_label_key(tmp_path):
    path = tmp_path / "t.zip"
    write_zip(path, [member("cat/a.jpg")])
    with pytest.raises(SourceError) as caught:
        scan_source(path, label_key="cls")
    assert str(caught.value) == f"{path}: a zip is read as an ImageFolder; label_key is for shards"
