"""A zip source, laid out like an ImageFolder (members stored or deflated), read in place."""

from __future__ import annotations

import calendar
import io
import os
import stat as stat_mod
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SourceError
from .archive import ZIP_SUFFIXES, Table, clean_name, image_folder
from .base import ImageReader
from .listing import IMAGE_EXTENSIONS, Listing
from .members import DEFLATED, STORED, MemberAddress
from .recorded import RecordedMembers
from .tar_headers import broken

if TYPE_CHECKING:
    from ..format import CacheFiles


class Zip:
    """The ``zip`` kind: a ``.zip`` file."""

    kind = "zip"
    path_keys: tuple[str, ...] = ("root",)
    reads_files = False
    images: ImageReader | None = None  # OpenCV decodes its samples
    folder_stamps = False

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        path = Path(os.fspath(source)).expanduser()
        if not path.name.lower().endswith(ZIP_SUFFIXES):
            return False
        return path.is_file() or (label_key is not None and path.exists() and not path.is_dir())

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        root = Path(os.fspath(source)).expanduser().resolve()
        if label_key is not None:
            raise SourceError(f"{root}: a zip is read as an ImageFolder; label_key is for shards")
        return scan_zip(root, IMAGE_EXTENSIONS)

    def recorded(self, files: CacheFiles) -> RecordedMembers:
        return RecordedMembers(files, zip_holds)

    def exists(self, root: str) -> bool:
        return Path(root).exists()


ZIP = Zip()


def scan_zip(root: Path, images: tuple[str, ...]) -> Listing:
    table = Table()
    a = table.add_archive(root)
    try:
        with zipfile.ZipFile(root) as z, open(root, "rb") as f:
            infos = z.infolist()
            size = table.stats[a][0]
            dirs = []
            for info in infos:
                name = clean_name(info.filename, table, root.name)
                if name is None:
                    continue
                if info.is_dir():
                    dirs.append(name)
                    continue
                mode = info.external_attr >> 16
                if mode and stat_mod.S_ISLNK(mode):
                    table.warn(name, f"a link in {root.name}: left out, links in archives are "
                               "not followed")  # fmt: skip
                    continue
                if info.compress_type not in (STORED, DEFLATED):
                    table.warn(name, f"compressed in {root.name} with zip method "
                               f"{info.compress_type}, which mmcache does not read: left out "
                               "(store or deflate it)")  # fmt: skip
                    continue
                offset = zip_data_offset(f, info, root)
                if offset + info.compress_size > size:
                    raise broken(root.name, f"it ends inside member {info.filename!r}")
                mtime = zip_mtime(info)
                row = (a, offset, info.compress_size, info.compress_type, info.CRC,
                       info.file_size, mtime, info.header_offset)  # fmt: skip
                table.add(name, row, root.name)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
        raise broken(root.name, f"it does not read as a zip ({e})") from None
    except SourceError:  # an OSError too: the refusals above, said as they are
        raise
    except OSError as e:
        raise SourceError(f"{root}: cannot read the archive ({e.strerror})") from None
    return image_folder(root, "zip", table, dirs, images)


def zip_data_offset(f: io.BufferedReader, info: zipfile.ZipInfo, root: Path) -> int:
    """Where a member's stored bytes start: after its local header, whose name and extra
    field lengths may differ from the central directory's."""
    head = os.pread(f.fileno(), 30, info.header_offset)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise broken(root.name, f"member {info.filename!r} has no local header where the "
                      "directory says")  # fmt: skip
    name_len = int.from_bytes(head[26:28], "little")
    extra_len = int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def zip_mtime(info: zipfile.ZipInfo) -> int:
    """The member's time in ns, with its CRC-32 in the nanoseconds: a zip's times step by 2 s,
    so a member rewritten within them at the same size still reads as modified."""
    try:
        seconds = calendar.timegm((*info.date_time, 0, 0, 0))
    except (ValueError, OverflowError):
        seconds = 0
    return seconds * 1_000_000_000 + info.CRC % 1_000_000_000


def zip_holds(fd: int, ref: MemberAddress, start: int, size: int, mtime_ns: int) -> bool:
    """Whether the zip's local header at byte ``start`` of ``fd`` describes the member ``ref``
    addresses: its name, method and data offset, and its CRC-32 and sizes (``size`` inflated)
    unless they follow its data (a data descriptor: then a deflated member's stored length
    must be one deflate can give). A ``recorded.Holds``; ``mtime_ns`` is not compared."""
    head = os.pread(fd, 30, start)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return False
    flags, method, name_len, extra_len = (
        int.from_bytes(head[k : k + 2], "little") for k in (6, 8, 26, 28)
    )
    crc, stored, inflated = (int.from_bytes(head[k : k + 4], "little") for k in (14, 18, 22))
    if method != ref.method or start + 30 + name_len + extra_len != ref.offset:
        return False
    raw = os.pread(fd, name_len, start + 30).split(b"\0", 1)[0]  # (zipfile cuts at a NUL)
    name = raw.decode("utf-8" if flags & 0x800 else "cp437", "replace")
    if "/".join(p for p in name.split("/") if p not in ("", ".")) != ref.name:
        return False
    if flags & 0x08 or stored == 0xFFFFFFFF:  # sizes after the data, or in a zip64 field
        # (zlib's deflateBound: at worst 0.03% and 13 bytes more than the input)
        return ref.method == STORED or ref.length <= size + (size >> 10) + 64
    return (stored, inflated) == (ref.length, size) and (ref.crc < 0 or crc == ref.crc)
