"""The members file (``members-<generation>.bin``) as ``mmcache.format`` specifies it: written
from a listing's ``Members`` record by record, carried to a new generation as it is, and refused
when its size, CRC-32 or any record disagrees with the manifest, word for word.

Every expected byte is packed here by hand from the spec's layout, not with ``MEMBER_DTYPE``."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from mmcache.errors import CacheFormatError
from mmcache.sources.member_table import (
    carry_member_table,
    read_member_table,
    write_member_table,
)
from mmcache.sources.members import Members

GEN, NEW = "0123456789abcdef", "fedcba9876543210"
# The spec's record: offset u8, length u8, archive u4, header u4, crc32 u4, method u2, flags u2,
# little-endian and packed: 32 bytes.
RECORD = struct.Struct("<QQIIIHH")
SPEC_DTYPE = [["offset", "<u8"], ["length", "<u8"], ["archive", "<u4"], ["header", "<u4"],
              ["crc32", "<u4"], ["method", "<u2"], ["flags", "<u2"]]  # fmt: skip
ARCHIVES = [["/data/a.tar", 10240, 111], ["/data/b.zip", 5000, 222]]


def _members(header: list[int] | None = None) -> Members:
    """Three listed members: a tar member (no CRC), a deflated zip member, and a stored zip
    member whose CRC-32 is 0 (a CRC all the same)."""
    return Members(
        archives=["/data/a.tar", "/data/b.zip"],
        stats=[(10240, 111), (5000, 222)],
        names=["cat/a.jpg", "dog/b.png", "dog/c.png"],
        archive=np.array([0, 1, 1], np.int32),
        offset=np.array([1536, 4000, 39], np.int64),
        length=np.array([700, 300, 20], np.int64),
        method=np.array([0, 8, 0], np.uint8),
        crc=np.array([-1, 0xDEADBEEF, 0], np.int64),
        header=np.array(header or [1024, 3950, 0], np.int64),
    )


# The three members' records as the spec lays them out: header is offset - where headers start.
TAR_A = RECORD.pack(1536, 700, 0, 512, 0, 0, 0)
ZIP_B = RECORD.pack(4000, 300, 1, 50, 0xDEADBEEF, 8, 1)
ZIP_C = RECORD.pack(39, 20, 1, 39, 0, 0, 1)


def _entry(blob: bytes, generation: str = GEN) -> dict:
    return {"file": f"members-{generation}.bin", "size": len(blob), "crc32": zlib.crc32(blob),
            "dtype": SPEC_DTYPE, "archives": ARCHIVES}  # fmt: skip


def test_the_members_file_holds_the_kept_members_in_the_spec_s_layout_in_their_order(tmp_path):
    entry = write_member_table(tmp_path, GEN, _members(), np.array([2, 0, 1]))
    blob = ZIP_C + TAR_A + ZIP_B
    assert (tmp_path / f"members-{GEN}.bin").read_bytes() == blob
    assert entry == _entry(blob)


def test_a_generation_s_members_file_is_never_written_over(tmp_path):
    (tmp_path / f"members-{GEN}.bin").write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        write_member_table(tmp_path, GEN, _members(), np.array([0]))
    assert (tmp_path / f"members-{GEN}.bin").read_bytes() == b"another writer's"


def test_no_kept_members_make_an_empty_members_file(tmp_path):
    entry = write_member_table(tmp_path, GEN, _members(), np.array([], np.int64))
    assert (tmp_path / f"members-{GEN}.bin").read_bytes() == b""
    assert entry == _entry(b"")


def test_what_is_not_a_listing_s_members_has_no_members_file(tmp_path):
    assert write_member_table(tmp_path, GEN, ["cat/a.jpg"], np.array([0])) is None
    assert write_member_table(tmp_path, GEN, None, np.array([0])) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("start", [1, (1 << 32) - 1])
def test_headers_1_to_2_32_minus_1_bytes_before_the_member_are_recorded(tmp_path, start):
    entry = write_member_table(tmp_path, GEN, _members([1536 - start, 3950, 0]), np.arange(3))
    assert entry is not None
    blob = (tmp_path / f"members-{GEN}.bin").read_bytes()
    assert RECORD.unpack(blob[:32])[3] == start and blob[32:] == ZIP_B + ZIP_C


@pytest.mark.parametrize("start", [0, 1 << 32, -1])
def test_a_member_whose_headers_the_field_cannot_hold_leaves_no_members_file(tmp_path, start):
    # One such member among good ones: the members are listed again instead, for all of them.
    for first in (True, False):
        header = [1024, 3950, 39 - start] if first else [1536 - start, 3950, 0]
        assert write_member_table(tmp_path, GEN, _members(header), np.arange(3)) is None
    assert list(tmp_path.iterdir()) == []


class _Cache:
    """What the members file's readers take of a cache (its ``CacheFiles``): the manifest's
    folder, generation, ``members`` entry and ``file``, and the index's source sizes."""

    def __init__(self, folder: Path, entry: dict | None, sizes: list[int]) -> None:
        self.path, self.generation, self.members = folder, GEN, entry
        self.manifest = self
        self.index = {"source_size": np.array(sizes, np.uint64)}

    def file(self, kind: str) -> Path:
        return self.path / f"{kind}-{self.generation}.bin"


def _cache(folder: Path, blob: bytes, sizes: list[int], **entry) -> _Cache:
    (folder / f"members-{GEN}.bin").write_bytes(blob)
    return _Cache(folder, {**_entry(blob), **entry}, sizes)


def test_a_members_file_that_agrees_with_its_manifest_is_read_record_by_record(tmp_path):
    table = read_member_table(_cache(tmp_path, TAR_A + ZIP_B + ZIP_C, [700, 9999, 20]))
    assert table is not None and table.tobytes() == TAR_A + ZIP_B + ZIP_C
    assert table["offset"].tolist() == [1536, 4000, 39]
    assert table["header"].tolist() == [512, 50, 39]
    assert table["flags"].tolist() == [0, 1, 1]


def test_a_cache_without_a_members_entry_has_no_table_and_carries_none(tmp_path):
    cache = _Cache(tmp_path, None, [700])
    assert read_member_table(cache) is None
    assert carry_member_table(cache, tmp_path, NEW) is None
    assert list(tmp_path.iterdir()) == []


LIMIT = 10240  # the tar's size as the manifest records it
# (the record, the source size of its record, what the refusal says after "record 0: ")
ACCEPTED = {
    "the last archive": RECORD.pack(39, 20, 1, 39, 0, 0, 0),
    "ending at the archive's end": RECORD.pack(LIMIT - 700, 700, 0, 512, 0, 0, 0),
    "empty, at the archive's end": RECORD.pack(LIMIT, 0, 0, 512, 0, 0, 0),
    "headers from the archive's first byte": RECORD.pack(1536, 700, 0, 1536, 0, 0, 0),
    "deflated, its stored length not the source's size": RECORD.pack(1536, 9, 0, 512, 0, 8, 1),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_a_record_within_its_archive_is_read(tmp_path, case):
    record = ACCEPTED[case]
    size = RECORD.unpack(record)[1] if RECORD.unpack(record)[5] == 0 else 700
    table = read_member_table(_cache(tmp_path, record, [size]))
    assert table is not None and table.tobytes() == record


OUTSIDE = (
    "its member lies outside its archive as recorded (the file was damaged or made to "
    "mislead); rebuild the cache"
)
REFUSED = {
    "an archive past the manifest's": (RECORD.pack(39, 20, 2, 39, 0, 0, 0), 20,
                                       "its archive is not one of the manifest's"),
    "starting past the archive's end": (RECORD.pack(LIMIT + 1, 0, 0, 512, 0, 0, 0), 0, OUTSIDE),
    "one byte past the archive's end": (RECORD.pack(LIMIT - 700, 701, 0, 512, 0, 0, 0), 701,
                                        OUTSIDE),
    "a length that wraps offset + length": (RECORD.pack(1536, (1 << 64) - 1, 0, 512, 0, 8, 0),
                                            700, OUTSIDE),
    "no headers": (RECORD.pack(1536, 700, 0, 0, 0, 0, 0), 700,
                   "its member's headers lie outside its archive"),
    "headers before the archive's start": (RECORD.pack(1536, 700, 0, 1537, 0, 0, 0), 700,
                                           "its member's headers lie outside its archive"),
    "method 1": (RECORD.pack(1536, 700, 0, 512, 0, 1, 0), 700, "unknown compression method"),
    "method 9": (RECORD.pack(1536, 700, 0, 512, 0, 9, 0), 700, "unknown compression method"),
    "flags bit 1": (RECORD.pack(1536, 700, 0, 512, 0, 0, 2), 700, "reserved flags set"),
    "stored, longer than its source": (RECORD.pack(1536, 700, 0, 512, 0, 0, 0), 699,
                                       "a stored member's length is not its source file's size"),
    "stored, shorter than its source": (RECORD.pack(1536, 700, 0, 512, 0, 0, 0), 701,
                                        "a stored member's length is not its source file's size"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_record_the_manifest_contradicts_is_refused_naming_it_and_the_count(tmp_path, case):
    record, size, words = REFUSED[case]
    # Record 0 is good; records 1 and 2 are the bad one: the first is named, both counted.
    cache = _cache(tmp_path, TAR_A + record + record, [700, size, size])
    path = tmp_path / f"members-{GEN}.bin"
    with pytest.raises(CacheFormatError) as e:
        read_member_table(cache)
    assert str(e.value) == f"{path}: record 1: {words} (2 such records)"


def test_a_record_is_checked_to_the_byte_in_an_archive_past_2_53_bytes(tmp_path):
    # Where float64 cannot tell 2**53 + 1 from 2**53: the check is exact unsigned arithmetic.
    big = [["/data/a.tar", (1 << 53) + 1, 111], ARCHIVES[1]]
    at_end = RECORD.pack(1, 1 << 53, 0, 1, 0, 8, 0)
    past = RECORD.pack(1, (1 << 53) + 1, 0, 1, 0, 8, 0)
    table = read_member_table(_cache(tmp_path, at_end, [700], archives=big))
    assert table is not None and table.tobytes() == at_end
    with pytest.raises(CacheFormatError) as e:
        read_member_table(_cache(tmp_path, past, [700], archives=big))
    assert (
        str(e.value) == f"{tmp_path / f'members-{GEN}.bin'}: record 0: {OUTSIDE} (1 such records)"
    )


DAMAGED = "the file is damaged; rebuild the cache"


def test_a_members_file_of_another_size_than_the_manifest_s_is_refused(tmp_path):
    path = tmp_path / f"members-{GEN}.bin"
    cache = _cache(tmp_path, TAR_A + ZIP_B, [700, 300], size=63)
    with pytest.raises(CacheFormatError) as e:
        read_member_table(cache)
    assert str(e.value) == f"{path}: is 64+ bytes, the manifest says 63: {DAMAGED}"
    cache = _cache(tmp_path, TAR_A + ZIP_B, [700, 300], size=1000)
    with pytest.raises(CacheFormatError) as e:
        read_member_table(cache)
    assert str(e.value) == f"{path}: is 64 bytes, the manifest says 1,000: {DAMAGED}"
    # a file far larger is read one byte past the size the manifest says, no further
    cache = _cache(tmp_path, TAR_A + ZIP_B, [700, 300], size=32)
    with pytest.raises(CacheFormatError) as e:
        read_member_table(cache)
    assert str(e.value) == f"{path}: is 33+ bytes, the manifest says 32: {DAMAGED}"


def test_a_members_file_of_another_crc_than_the_manifest_s_is_refused(tmp_path):
    path = tmp_path / f"members-{GEN}.bin"
    blob = TAR_A + ZIP_B
    cache = _cache(tmp_path, blob, [700, 300], crc32=0x0000ABCD)
    with pytest.raises(CacheFormatError) as e:
        read_member_table(cache)
    crc = f"{zlib.crc32(blob):08x}"
    assert str(e.value) == (
        f"{path}: checksum mismatch (CRC-32 {crc}, the manifest says 0000abcd): {DAMAGED}"
    )


def test_a_missing_members_file_is_refused(tmp_path):
    cache = _cache(tmp_path, TAR_A, [700])
    (tmp_path / f"members-{GEN}.bin").unlink()
    for read in (read_member_table, lambda c: carry_member_table(c, tmp_path, NEW)):
        with pytest.raises(CacheFormatError) as e:
            read(cache)
        assert str(e.value) == (
            f"{tmp_path / f'members-{GEN}.bin'}: missing (the cache was rebuilt, or is damaged)"
        )


def test_a_new_generation_carries_the_members_file_byte_for_byte(tmp_path):
    blob = TAR_A + ZIP_B + ZIP_C
    out = tmp_path / "out"
    out.mkdir()
    entry = carry_member_table(_cache(tmp_path, blob, [700, 300, 20]), out, NEW)
    assert (out / f"members-{NEW}.bin").read_bytes() == blob
    assert entry == _entry(blob, NEW)


def test_a_damaged_members_file_is_not_carried(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    cache = _cache(tmp_path, TAR_A, [700], crc32=1)
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        carry_member_table(cache, out, NEW)
    assert list(out.iterdir()) == []
