"""Reading tar headers: each member's name, kind, data offset, size and mtime, never its data.

``read_headers`` parses the 512-byte headers itself (ustar, GNU long names and links, pax
``path``/``linkpath``/``size``/``mtime``): ``tarfile`` spends ~50 us on each header, a minute
for ImageNet's 1.28 M members. Headers of other kinds (sparse files, multi-volume archives)
raise ``OtherHeaders``, and ``read_by_tarfile`` reads such a tar with ``tarfile``. Both check
that what follows the last member is the end-of-archive blocks: a tar cut short, or a header
that fails its checksum, is a ``SourceError`` (``broken``), never a shorter listing.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import SourceError

if TYPE_CHECKING:  # (members.py reads member bytes with this module's pread_all)
    from .members import MemberAddress


def broken(where: str, what: str) -> SourceError:
    """The error of a damaged or truncated archive ``where``: ``what`` is wrong with it."""
    return SourceError(
        f"{where}: a damaged or truncated archive: {what}. Nothing was built from it; "
        "download or create it again"
    )


class _Window(io.RawIOBase):
    """Bytes ``[start, start + size)`` of a file, as a file: an inner tar inside the outer one."""

    def __init__(self, f: io.BufferedReader, start: int, size: int) -> None:
        self._f, self._start, self._size, self._pos = f, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        data = os.pread(self._f.fileno(), n, self._start + self._pos) if n else b""
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class TarMember:
    """One tar member: its name, kind (file, dir, link, other), data offset, size, mtime, and
    where its headers start (a long name's or pax header's before its own, as ``tarfile``'s
    ``TarInfo.offset``)."""

    name: str
    kind: str
    offset: int  # of its data, from the start of the tar
    size: int
    mtime_ns: int
    linkname: str = ""
    header: int = 0  # of its first header, from the start of the tar


class OtherHeaders(Exception):
    """A tar header of a kind ``read_headers`` leaves to ``tarfile`` (sparse, multi-volume)."""


_KINDS = {b"0": "file", b"\0": "file", b"7": "file", b"5": "dir", b"1": "link", b"2": "link",
          b"3": "other", b"4": "other", b"6": "other"}  # fmt: skip
_READ = 8192  # bytes read at once: the header and, for small images, the next few headers
# The most bytes a long-name, long-link or pax header may hold: a path is at most 4,096 bytes
# on Linux, so 1 MiB leaves room for any honest pax header and refuses one sized to fill memory.
MAX_HEADER_DATA = 1 << 20
_HEADER_NAMES = {b"L": "GNU long-name", b"K": "GNU long-link", b"x": "pax", b"g": "pax global"}


def read_headers(fd: int, start: int, size: int, where: str) -> Iterator[TarMember]:
    """The members of the tar at ``[start, start + size)`` of ``fd``, from their headers: ustar,
    GNU (long names and links) and pax (path, linkpath, size, mtime) headers.

    Raises:
        SourceError: truncated, or a header that fails its checksum.
        OtherHeaders: a header of another kind.
    """
    buf, buf_at = b"", 0
    pos, count, first = 0, 0, 0  # first: where the next member's headers start
    long_name = long_link = None
    pax: dict[str, str] = {}
    while True:
        if pos + 512 > size:
            raise broken(where, f"it ends at byte {size:,}, after {count:,} members, without "
                          "the end-of-archive blocks: it is truncated")  # fmt: skip
        if not (buf_at <= pos and pos + 512 <= buf_at + len(buf)):
            buf, buf_at = os.pread(fd, min(_READ, size - pos), start + pos), pos
            if len(buf) < 512:
                raise broken(where, f"it ends inside the header at byte {pos:,}")
        block = buf[pos - buf_at : pos - buf_at + 512]
        if block == _ZERO_BLOCK:
            return  # the end-of-archive blocks
        stored = _number(block[148:156], where, pos)
        if stored != _checksum(block) and stored != _checksum(block, signed=True):
            raise broken(where, f"a damaged header at byte {pos:,}, after {count:,} members "
                          "(its checksum fails)")  # fmt: skip
        kind = block[156:157]
        length = _number(block[124:136], where, pos)
        if "size" in pax:
            length = _pax_int(pax, "size", where, pos)
        data = pos + 512
        if length < 0:
            # GNU base-256 can say -1: the next header would be this one again, forever.
            raise broken(where, f"the header at byte {pos:,} gives its member a negative size "
                          f"({length:,} bytes)")  # fmt: skip
        if data + length > size:
            raise broken(where, f"the header at byte {pos:,} gives its member {length:,} "
                          f"bytes, but the archive ends {size - data:,} bytes after it: it is "
                          "truncated")  # fmt: skip
        pos = data + (length + 511) // 512 * 512
        if kind in (b"L", b"K", b"x", b"g"):  # this header's data describes the next member
            if length > MAX_HEADER_DATA:
                raise broken(where, f"the {_HEADER_NAMES[kind]} header at byte {data - 512:,} "
                              f"holds {length:,} bytes, more than the {MAX_HEADER_DATA:,} a "
                              "name or pax header may")  # fmt: skip
            payload = pread_all(fd, length, start + data)
            if kind == b"L":
                long_name = payload.split(b"\0", 1)[0]
            elif kind == b"K":
                long_link = payload.split(b"\0", 1)[0]
            elif kind == b"x":
                pax = _pax(payload, where, data)
            elif kind == b"g":  # (describes the whole archive, not the next member)
                first = pos
            continue
        if kind not in _KINDS:
            raise OtherHeaders
        count += 1
        text, link_text, mtime_ns = _described(block, long_name, long_link, pax, where, data - 512)
        yield TarMember(text, _KINDS[kind], data, length, mtime_ns, link_text, first)
        long_name = long_link = None
        pax = {}
        first = pos


def _described(
    block: bytes,
    long_name: bytes | None,
    long_link: bytes | None,
    pax: dict[str, str],
    where: str,
    pos: int,
) -> tuple[str, str, int]:
    """A member's name, link target and mtime: from its header ``block`` at ``pos``, unless a
    GNU long-name or long-link header or a pax header before it gives them."""
    name = block[:100].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0":  # POSIX ustar: a prefix holds the name's start
        prefix = block[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    link = block[157:257].split(b"\0", 1)[0]
    text = _text(long_name or name)
    link_text = _text(long_link or link)
    mtime_ns = _number(block[136:148], where, pos) * 1_000_000_000
    if "path" in pax:
        text = pax["path"]
    if "linkpath" in pax:
        link_text = pax["linkpath"]
    if "mtime" in pax:
        try:
            mtime_ns = round(float(pax["mtime"]) * 1e9)
        except ValueError:
            raise broken(where, f"a bad pax mtime at byte {pos:,}") from None
    return text, link_text, mtime_ns


def member_at(fd: int, start: int, offset: int, size: int) -> TarMember | None:
    """The regular member whose headers start at byte ``start`` of ``fd`` (an archive, or the
    outer tar holding it) and whose data is bytes ``[offset, offset + size)``, read from its
    headers; None if no such member is there (other headers, damaged ones, another member).

    Reads only the headers, within ``[start, offset + size)``: a cache records where its
    members lie, and this checks that a recorded place holds the member before its bytes are
    read (``recorded``).
    """
    if not 0 <= start < offset or size < 0:
        return None
    try:
        m = next(read_headers(fd, start, offset - start + size, ""), None)
    except (SourceError, OtherHeaders, OSError):
        return None
    if m is None or m.kind != "file" or (m.header, start + m.offset, m.size) != (0, offset, size):
        return None
    return m


def tar_holds(fd: int, ref: MemberAddress, start: int, size: int, mtime_ns: int) -> bool:
    """Whether the tar headers at byte ``start`` of ``fd`` describe the member ``ref``
    addresses: a regular file named as the end of its path (after ``cls/`` or ``shard/``),
    its ``size`` bytes at ``ref.offset`` and its mtime ``mtime_ns`` (a ``recorded.Holds``)."""
    m = member_at(fd, start, ref.offset, ref.length)
    if m is None or (m.size, m.mtime_ns) != (size, mtime_ns):
        return False
    name = "/".join(p for p in m.name.split("/") if p not in ("", "."))
    return bool(name) and (ref.name == name or ref.name.endswith("/" + name))


_ZERO_BLOCK = bytes(512)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # as tarfile and the file system decode names


def _checksum(block: bytes, signed: bool = False) -> int:
    """The header's checksum, its checksum field counted as spaces (tar's rule); ``signed``:
    the bytes read as signed, as some old tars summed them."""
    total = sum(block) - sum(block[148:156]) + 8 * 32
    if signed:
        total -= 256 * sum(1 for b in block[:148] + block[156:] if b > 127)
    return total


def _number(field: bytes, where: str, pos: int) -> int:
    """A header's number: octal text, or GNU base-256 (first byte 0x80 or 0xff)."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - (1 << (8 * len(field) - 8)) if field[:1] == b"\xff" else value
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise broken(where, f"a damaged header at byte {pos:,} ({field!r} is no number)") from None


def _pax(payload: bytes, where: str, pos: int) -> dict[str, str]:
    """A pax header's ``"%d %s=%s\\n"`` records (the keys mmcache uses)."""
    found: dict[str, str] = {}
    i = 0
    while i < len(payload) and payload[i : i + 1] != b"\0":
        space = payload.find(b" ", i)
        try:
            n = int(payload[i:space])
        except ValueError:
            raise broken(where, f"a damaged pax header at byte {pos:,}") from None
        record = payload[space + 1 : i + n - 1]
        if n <= 0 or b"=" not in record:
            raise broken(where, f"a damaged pax header at byte {pos:,}")
        key, value = record.split(b"=", 1)
        if key in (b"path", b"linkpath", b"size", b"mtime"):
            found[key.decode()] = value.decode("utf-8", "surrogateescape")
        i += n
    return found


def _pax_int(pax: dict[str, str], key: str, where: str, pos: int) -> int:
    try:
        return int(pax[key])
    except ValueError:
        raise broken(where, f"a bad pax {key} at byte {pos:,}") from None


def read_by_tarfile(
    raw: io.BufferedReader, start: int, size: int, where: str
) -> Iterator[TarMember]:
    """``_headers`` by ``tarfile``, for the kinds of header that only it reads."""
    f = io.BufferedReader(_Window(raw, start, size), 64 * 1024)
    try:
        tf = tarfile.open(fileobj=f, mode="r:", errors="surrogateescape")  # noqa: SIM115
    except tarfile.ReadError as e:
        raise broken(where, f"it does not read as a tar ({e})") from None
    count = 0
    with tf:
        while True:
            try:
                m = tf.next()
            except tarfile.ReadError as e:
                raise broken(where, f"{e} after {count:,} members") from None
            if m is None:
                break
            # tarfile keeps every header it read: 1.28 M of them would cost ~1 GB.
            tf.members.clear()  # type: ignore[attr-defined]
            if m.size < 0 or m.offset_data + m.size > size:
                # A negative size would make tarfile read this header again, forever.
                raise broken(where, f"the header at byte {m.offset:,} gives its member "
                              f"{m.size:,} bytes, which the archive cannot hold")  # fmt: skip
            count += 1
            kind = "dir" if m.isdir() else "link" if m.issym() or m.islnk() else "other"
            kind = "file" if m.isreg() else kind
            mtime = int(round(float(m.mtime) * 1e9))
            yield TarMember(m.name, kind, m.offset_data, m.size, mtime, m.linkname, m.offset)
        end = tf.offset
    tail = os.pread(raw.fileno(), 512, start + end) if end < size else b""
    # tarfile stops quietly at a header cut short or failing its checksum past the first one:
    # what follows the last member must be the end-of-archive blocks (zeros).
    if len(tail) < 512:
        raise broken(where, f"it ends at byte {size:,}, after {count:,} members, without the "
                      "end-of-archive blocks: it is truncated")  # fmt: skip
    if tail.strip(b"\0"):
        raise broken(where, f"a damaged header at byte {end:,}, after {count:,} members")


def pread_all(fd: int, n: int, offset: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
