"""mmcache's tar header parser, read against tars written here block by block after POSIX's
ustar layout (and GNU's and pax's extensions): each member's name, kind, data offset, size,
mtime and first header, the refusals word for word, and the check that a recorded place holds
its member."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmcache.errors import SourceError
from mmcache.sources.members import MemberAddress
from mmcache.sources.tar_headers import TarMember, member_at, read_headers, tar_holds

END = bytes(1024)  # the two zero blocks that end an archive


def header(name: bytes, size: int = 0, kind: bytes = b"0", mtime: int = 0, **fields) -> bytes:
    """A 512-byte ustar header: name at 0 (100 bytes), mode at 100, size at 124 and mtime at
    136 (12 octal digits each), checksum at 148 (8 bytes, summed with itself as spaces), kind
    at 156, link at 157, ``ustar\\0`` and ``00`` at 257, prefix at 345 (155 bytes)."""
    b = bytearray(512)
    b[0 : len(name)] = name
    b[100:108] = b"0000644\0"
    b[124:136] = fields.get("size_field", b"%011o\0" % size)
    b[136:148] = fields.get("mtime_field", b"%011o\0" % mtime)
    b[156:157] = kind
    link = fields.get("link", b"")
    b[157 : 157 + len(link)] = link
    b[257:265] = b"ustar\x0000"
    prefix = fields.get("prefix", b"")
    b[345 : 345 + len(prefix)] = prefix
    pad = fields.get("pad", b"")  # the 12 unused bytes after the prefix
    b[500 : 500 + len(pad)] = pad
    b[148:156] = b" " * 8
    if fields.get("signed"):  # the sum of the bytes read as signed (-128 to 127), as old tars
        b[148:156] = b"%06o\0 " % sum(x - 256 if x > 127 else x for x in b)
    else:
        b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def blocks(data: bytes) -> bytes:
    """``data`` padded with zeros to a whole number of 512-byte blocks."""
    return data + bytes(-len(data) % 512)


def pax(**records: str) -> bytes:
    """A pax header's ``"%d key=value\\n"`` records, each length counting itself."""
    out = b""
    for key, value in records.items():
        body = f" {key}={value}\n".encode()
        n = len(body) + 1
        n = len(body) + len(str(n))
        out += str(n).encode() + body
    return out


def headers(path: Path, start: int = 0, size: int | None = None) -> list[TarMember]:
    with open(path, "rb") as f:
        end = path.stat().st_size - start if size is None else size
        return list(read_headers(f.fileno(), start, end, "t.tar"))


def test_each_member_is_read_from_its_own_headers(tmp_path):
    long_name = b"cat/" + b"n" * 150 + b".jpg"
    records = pax(path="cat/é.jpg", mtime="1700000000.5", size="3")
    tar = (
        header(b"a.jpg", 5, mtime=0o1234, prefix=b"cat/deep")  # at 0, data at 512
        + blocks(b"AAAAA")
        + header(b"cat/", kind=b"5")  # at 1024
        + header(b"cat/s.jpg", kind=b"2", link=b"a.jpg")  # at 1536
        + header(b"cat/h.jpg", kind=b"1", link=b"cat/deep/a.jpg")  # at 2048
        + header(b"././@LongLink", len(long_name) + 1, b"L")  # at 2560, its data at 3072
        + blocks(long_name + b"\0")
        + header(b"short.jpg", 600, b"\0")  # at 3584, data at 4096 (2 blocks)
        + blocks(b"B" * 600)
        + header(b"PaxHeaders/x", len(records), b"x")  # at 5120, records at 5632
        + blocks(records)
        + header(b"cat/x.jpg", 999, b"7", mtime=5)  # at 6144: pax gives name, size, mtime
        + blocks(b"CCC")
        + header(b"pax_global_header", 12, b"g")  # at 7168, its data at 7680
        + blocks(b"12 a=b\n")
        + header(b"cat/fifo", kind=b"6", mtime=7)  # at 8192
        + END
    )
    path = tmp_path / "t.tar"
    path.write_bytes(tar)
    assert headers(path) == [
        TarMember("cat/deep/a.jpg", "file", 512, 5, 0o1234 * 10**9, "", 0),
        TarMember("cat/", "dir", 1536, 0, 0, "", 1024),
        TarMember("cat/s.jpg", "link", 2048, 0, 0, "a.jpg", 1536),
        TarMember("cat/h.jpg", "link", 2560, 0, 0, "cat/deep/a.jpg", 2048),
        TarMember(long_name.decode(), "file", 4096, 600, 0, "", 2560),
        TarMember("cat/é.jpg", "file", 6656, 3, 1_700_000_000_500_000_000, "", 5120),
        TarMember("cat/fifo", "other", 8704, 0, 7 * 10**9, "", 8192),
    ]
    # the same tar inside another, 1,536 bytes in: offsets from the inner tar's start
    outer = tmp_path / "outer.tar"
    outer.write_bytes(bytes(1536) + tar + b"junk after it")
    assert headers(outer, 1536, len(tar)) == headers(path)


def test_long_links_pax_links_and_fields_filled_to_their_last_byte_are_read(tmp_path):
    target = b"cat/" + b"t" * 120 + b".jpg"  # 128 bytes: too long for the 100-byte link field
    full_name, full_prefix = b"n" * 96 + b".jpg", b"cat/" + b"p" * 151  # 100 and 155 bytes
    full_link = b"cat/" + b"h" * 92 + b".jpg"  # 100 bytes: no NUL ends it
    records = pax(linkpath="cat/é/a.jpg")
    tar = (
        # GNU long link: its data is the target, ended by its first NUL (padded with more)
        header(b"././@LongLink", len(target) + 4, b"K")  # at 0, its data at 512
        + blocks(target + bytes(4))
        + header(b"cat/l.jpg", kind=b"2", link=target[:100])  # at 1024
        + header(b"PaxHeaders/m", len(records), b"x")  # at 1536, records at 2048
        + blocks(records)
        + header(b"cat/m.jpg", kind=b"2", link=b"cat/a.jpg")  # at 2560: pax gives its link
        # the name and prefix fields full, the 12 unused bytes after the prefix not zero
        + header(full_name, 3, prefix=full_prefix, pad=b"X" * 12)  # at 3072
        + blocks(b"abc")
        + header(b"cat/h.jpg", kind=b"1", link=full_link)  # at 4096
        # GNU base-256: 0x80, then the size in 11 big-endian bytes
        + header(b"cat/b.jpg", size_field=b"\x80" + (3).to_bytes(11, "big"))  # at 4608
        + blocks(b"def")
        + header("cat/ü.jpg".encode(), signed=True)  # at 5632: its checksum summed signed
        + END
    )
    path = tmp_path / "t.tar"
    path.write_bytes(tar)
    assert headers(path) == [
        TarMember("cat/l.jpg", "link", 1536, 0, 0, target.decode(), 0),
        TarMember("cat/m.jpg", "link", 3072, 0, 0, "cat/é/a.jpg", 1536),
        TarMember((full_prefix + b"/" + full_name).decode(), "file", 3584, 3, 0, "", 3072),
        TarMember("cat/h.jpg", "link", 4608, 0, 0, full_link.decode(), 4096),
        TarMember("cat/b.jpg", "file", 5120, 3, 0, "", 4608),
        TarMember("cat/ü.jpg", "file", 6144, 0, 0, "", 5632),
    ]


def test_a_long_name_header_of_exactly_1_mib_is_read_up_to_its_first_nul(tmp_path):
    # 1 MiB is the most a long-name or pax header may hold; this one is the name, then NULs
    payload = b"cat/a.jpg" + bytes((1 << 20) - 9)
    path = tmp_path / "t.tar"
    path.write_bytes(header(b"././@LongLink", 1 << 20, b"L") + payload + header(b"x", 0) + END)
    assert headers(path) == [TarMember("cat/a.jpg", "file", (1 << 20) + 1024, 0, 0, "", 0)]


def test_a_tar_ending_at_its_one_end_block_is_read(tmp_path):
    # tarfile reads a single zero block as the end as well; here it is the file's last 512
    # bytes, so the parser's read there is exactly one block long
    path = tmp_path / "t.tar"
    path.write_bytes(header(b"cat/a.jpg", 3) + blocks(b"abc") + bytes(512))
    assert headers(path) == [TarMember("cat/a.jpg", "file", 512, 3, 0, "", 0)]


def _two_members() -> bytes:
    return header(b"cat/a.jpg", 3) + blocks(b"abc") + header(b"cat/b.jpg", 3) + blocks(b"def")


def refusal(what: str) -> str:
    return (f"t.tar: a damaged or truncated archive: {what}. Nothing was built from it; download "
            "or create it again")  # fmt: skip


# (the tar's bytes, the size read, what is wrong with it as the refusal says)
TAR_REFUSALS = {
    "no end blocks": (
        lambda: _two_members(),
        None,
        "it ends at byte 2,048, after 2 members, without the end-of-archive blocks: it is "
        "truncated",
    ),
    "its data past the end": (
        lambda: header(b"cat/a.jpg", 1000) + bytes(512),
        None,
        "the header at byte 0 gives its member 1,000 bytes, but the archive ends 512 bytes "
        "after it: it is truncated",
    ),
    "a file shorter than the tar it should hold": (
        lambda: _two_members(),
        4096,
        "it ends inside the header at byte 2,048",
    ),
    "a checksum that fails": (
        lambda: _two_members()[:1024] + header(b"cat/b.jpg", 3)[:-1] + b"!" + END,
        None,
        "a damaged header at byte 1,024, after 1 members (its checksum fails)",
    ),
    "a checksum that is no number": (
        lambda: header(b"cat/a.jpg")[:148] + b"nonsense" + header(b"cat/a.jpg")[156:] + END,
        None,
        "a damaged header at byte 0 (b'nonsense' is no number)",
    ),
    "an mtime that is no number": (
        lambda: header(b"x") + header(b"cat/a.jpg", mtime_field=b"later!\0\0\0\0\0\0") + END,
        None,
        "a damaged header at byte 512 (b'later!\\x00\\x00\\x00\\x00\\x00\\x00' is no number)",
    ),
    "a size that is no number": (
        lambda: header(b"x") + header(b"cat/a.jpg", size_field=b"three\0\0\0\0\0\0\0") + END,
        None,
        "a damaged header at byte 512 (b'three\\x00\\x00\\x00\\x00\\x00\\x00\\x00' is no number)",
    ),
    "a negative size": (  # GNU base-256: 0xff, then 11 bytes of two's complement: -1
        lambda: header(b"x") + header(b"cat/a.jpg", size_field=b"\xff" * 12) + END,
        None,
        "the header at byte 512 gives its member a negative size (-1 bytes)",
    ),
    "a pax size that is no number": (
        lambda: header(b"p", 13, b"x") + blocks(pax(size="many")) + header(b"cat/a.jpg") + END,
        None,
        "a bad pax size at byte 1,024",
    ),
    "a pax record whose length is no number": (
        lambda: header(b"p", 11, b"x") + blocks(b"ten path=a\n") + header(b"cat/a.jpg") + END,
        None,
        "a damaged pax header at byte 512",
    ),
    "a long name over 1 MiB": (
        lambda: (
            header(b"x")
            + header(b"././@LongLink", (1 << 20) + 1, b"L")
            + blocks(bytes((1 << 20) + 1))
            + header(b"cat/a.jpg")
            + END
        ),
        None,
        "the GNU long-name header at byte 512 holds 1,048,577 bytes, more than the 1,048,576 "
        "a name or pax header may",
    ),
    "a pax mtime that is no number": (
        lambda: header(b"p", 14, b"x") + blocks(pax(mtime="soon")) + header(b"cat/a.jpg") + END,
        None,
        "a bad pax mtime at byte 1,024",
    ),
}


@pytest.mark.parametrize("case", list(TAR_REFUSALS))
def test_a_damaged_or_truncated_tar_is_refused_saying_where(tmp_path, case):
    make, size, what = TAR_REFUSALS[case]
    path = tmp_path / "t.tar"
    path.write_bytes(make())
    with pytest.raises(SourceError) as caught:
        headers(path, size=size)
    assert str(caught.value) == refusal(what)


def _place(path: Path, tar: bytes) -> int:
    """``tar`` written 1,024 bytes into ``path``; where it starts."""
    path.write_bytes(b"\xab" * 1024 + tar)
    return 1024


# (the tar at the place, the data offset and size asked, from 1,024: whether it is there)
TAR_PLACES = {
    "the member": (header(b"cat/a.jpg", 3) + blocks(b"abc") + END, 512, 3, True),
    "an empty member": (header(b"cat/e.jpg") + END, 512, 0, True),
    "another size": (header(b"cat/a.jpg", 3) + blocks(b"abc") + END, 512, 2, False),
    "another data offset": (header(b"cat/a.jpg", 3) + blocks(b"abc") + END, 1024, 3, False),
    "a folder": (header(b"cat/", kind=b"5") + END, 512, 0, False),
    "a link": (header(b"cat/l.jpg", kind=b"2", link=b"a.jpg") + END, 512, 0, False),
    "the end blocks": (END, 512, 0, False),
    "after its long name's header": (
        header(b"././@LongLink", 10, b"L")
        + blocks(b"cat/a.jpg\0")
        + header(b"x", 3)
        + blocks(b"abc")
        + END,
        1536,
        3,
        True,
    ),  # fmt: skip
    "after a global pax header": (
        header(b"pax_global_header", 6, b"g")
        + blocks(b"6 a=b\n")
        + header(b"cat/a.jpg", 3)
        + blocks(b"abc")
        + END,
        1536,
        3,
        False,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(TAR_PLACES))
def test_a_regular_member_is_found_only_where_its_own_header_is(tmp_path, case):
    tar, offset, size, there = TAR_PLACES[case]
    path = tmp_path / "a.tar"
    start = _place(path, tar)
    with open(path, "rb") as f:
        found = member_at(f.fileno(), start, start + offset, size)
    assert (found is not None) is there
    if there:
        assert (found.offset, found.size, found.header) == (offset, size, 0)


# (the member's name in its header, the path it is recorded as, its size and mtime asked)
TAR_HOLDS = {
    "its name": (b"cat/a.jpg", "cat/a.jpg", 3, 60 * 10**9, True),
    "its name with ./ and //": (b"./cat//a.jpg", "cat/a.jpg", 3, 60 * 10**9, True),
    "the end of its path (a tar of tars)": (b"./a.jpg", "cat/a.jpg", 3, 60 * 10**9, True),
    "another name": (b"cat/b.jpg", "cat/a.jpg", 3, 60 * 10**9, False),
    "a name that only ends as the path": (b"at/a.jpg", "cat/a.jpg", 3, 60 * 10**9, False),
    "no name": (b"./", "cat/a.jpg", 3, 60 * 10**9, False),
    "another size recorded": (b"cat/a.jpg", "cat/a.jpg", 4, 60 * 10**9, False),
    "another mtime recorded": (b"cat/a.jpg", "cat/a.jpg", 3, 61 * 10**9, False),
}


@pytest.mark.parametrize("case", list(TAR_HOLDS))
def test_a_tar_place_holds_the_member_its_header_describes(tmp_path, case):
    name, recorded, size, mtime_ns, expected = TAR_HOLDS[case]
    path = tmp_path / "a.tar"
    start = _place(path, header(name, 3, mtime=60) + blocks(b"abc") + END)
    ref = MemberAddress(str(path), 0, 0, start + 512, 3, 0, -1, recorded)
    with open(path, "rb") as f:
        assert tar_holds(f.fileno(), ref, start, size, mtime_ns) is expected
