"""What archive sources share: listing members in place, ImageFolder classes, refusals.

Archives as sources: tar, tar of tars, WebDataset shards and zip, listed and read in place.

Nothing is extracted. The scan walks the archive's headers (``tar_headers``, ``zipfile``)
and lists every image member with where its bytes lie; the decode workers read
those bytes with ``pread`` and decode them; the cache records member names as paths. Four
layouts, decided by what the source is:

- ``x.tar`` laid out like an ImageFolder: each first-level folder inside it is a class, images
  are found below it; classes, labels and order are those of a build from the extracted folder;
- ``x.tar`` whose members are tars (ImageNet's ``ILSVRC2012_img_train.tar``): each inner tar is
  a class named after its stem, its images below it (the path ``n01440764/n01440764_18.JPEG``),
  as if each inner tar were extracted into a folder of that name;
- WebDataset shards: a folder of ``.tar`` files (no images, no subfolders), a brace pattern
  such as ``train-{0000..0146}.tar``, or a tar with ``.cls`` members (or given a
  ``label_key``). Members are grouped by key (the name up to the first ``.`` of its base
  name); each group's image member is the sample, its label the integer in its ``.cls`` member
  or, with ``label_key``, that field of its ``.json`` member. Paths are ``shard/member``;
- ``x.zip`` laid out like an ImageFolder (members stored or deflated).

Compressed tars (``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``, ``.tar.zst``, or a ``.tar``
that is compressed) are refused, naming the fix: such a file reads only front to back, and
the workers read each image by its offset, so it is decompressed once first (the images stay
inside the tar).

What is not built from an archive, in the words of ``Listing.warnings``: members whose name is
absolute or climbs out with ``..`` (extraction would refuse or misplace them), links (tar
symbolic and hard links: never followed), zip members compressed other than stored or deflated,
and every copy of a name but the last (extraction keeps the last). A truncated or damaged
archive (headers that end or fail their checksum before the end-of-archive blocks, a member
whose data runs past the end of the file) is a ``SourceError`` naming the archive and where it
breaks, never a partial listing. A member whose bytes do not decode is skipped by the build as
any bad file is, with its reason; a zip member that fails its CRC-32 is skipped as damaged.

A listed member's address travels to the decode workers as a ``members.MemberAddress``. It
carries the archive's size and mtime as listed: a worker that finds the archive changed
stores nothing for the member (``BAD_SOURCE_CHANGED``), as for a file changed since it was
listed. The member's bytes are put in an anonymous in-memory file and decoded through
``decode.decode_record``, so the pixels, truncation check and reasons are exactly those of
the same bytes in a file.
"""

from __future__ import annotations

import os
import posixpath
import re
import shlex
import stat as stat_mod
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import SourceError
from .listing import Listing
from .members import STORED, Members, open_archive
from .tar_headers import OtherHeaders, broken, read_by_tarfile, read_headers

TAR_SUFFIXES = (".tar",)
ZIP_SUFFIXES = (".zip",)
COMPRESSED_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
# First bytes of the compressors a .tar may hide: gzip, bzip2, xz, zstd.
# The tool of each (``gzip``): ``-dc`` writes what it decompresses to stdout.
COMPRESSED_MAGIC = {
    b"\x1f\x8b": ("gzip", "gzip"),
    b"BZh": ("bzip2", "bzip2"),
    b"\xfd7zXZ\x00": ("xz", "xz"),
    b"\x28\xb5\x2f\xfd": ("zstd", "zstd"),
}
# What decompresses a compressed tar named by its suffix into the .tar beside it, kept.
DECOMPRESS_BY_SUFFIX = {
    ".tar.gz": "gunzip -k", ".tgz": "gunzip -k", ".tar.bz2": "bunzip2 -k",
    ".tbz2": "bunzip2 -k", ".tar.xz": "unxz -k", ".txz": "unxz -k", ".tar.zst": "zstd -d",
}  # fmt: skip
# A member as the scan keeps it: (archive, offset, stored length, method, crc, size, mtime_ns,
# where its headers start).
Row = tuple[int, int, int, int, int, int, int, int]


class Table:
    """Members found so far, with the archive each lies in."""

    def __init__(self) -> None:
        self.archives: list[str] = []
        self.stats: list[tuple[int, int]] = []
        self.rows: dict[str, Row] = {}  # path -> member
        self.warnings: list[dict[str, str]] = []

    def add_archive(self, path: Path) -> int:
        st = path.stat()
        if not stat_mod.S_ISREG(st.st_mode):
            raise SourceError(f"{path}: not a regular file (a FIFO, device or folder), so not "
                              "an archive mmcache reads")  # fmt: skip
        self.archives.append(str(path))
        self.stats.append((st.st_size, st.st_mtime_ns))
        return len(self.archives) - 1

    def add(self, name: str, row: Row, where: str) -> None:
        """Member ``name``: a ``Row``."""
        if name in self.rows:  # extraction keeps the last copy of a name
            del self.rows[name]
            self.warn(name, f"appears more than once in {where}: the last copy is used, as "
                      "extraction keeps it")  # fmt: skip
        self.rows[name] = row

    def warn(self, name: str, reason: str) -> None:
        self.warnings.append({"path": name, "reason": reason})

    def members(self, paths: list[str]) -> Members:
        rows = np.array([self.rows[p] for p in paths], np.int64).reshape(-1, 8)
        return Members(
            archives=self.archives,
            stats=self.stats,
            names=paths,
            archive=rows[:, 0].astype(np.int32),
            offset=rows[:, 1].copy(),
            length=rows[:, 2].copy(),
            method=rows[:, 3].astype(np.uint8),
            crc=rows[:, 4].copy(),
            header=rows[:, 7].copy(),
        )



def compressed(path: Path, what: str, how: str) -> SourceError:
    return SourceError(
        f"{path}: a {what} tar reads only front to back, and mmcache reads each image by its "
        f"offset: {how} once (the images stay inside the .tar, nothing is extracted), then "
        "build from that .tar"
    )



def refuse_compressed(path: Path) -> None:
    try:
        fd = open_archive(path)
        try:
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the archive ({e.strerror})") from None
    for magic, (name, tool) in COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            out = path.with_name(f"{path.stem}.decompressed.tar")
            how = f"run `{tool} -dc {shlex.quote(str(path))} > {shlex.quote(str(out))}`"
            raise compressed(path, f"{name}-compressed", how)


def clean_name(name: str, table: Table, where: str) -> str | None:
    """The member name as extraction would place it (``./a//b`` -> ``a/b``), or None, noted in
    the table's warnings, when it is absolute or climbs out with ``..``."""
    if name.startswith("/") or re.match(r"[A-Za-z]:[\\/]", name):
        table.warn(name, f"an absolute name in {where}: left out (where it belongs is unclear: "
                   "tar extracts it with its leading '/' removed, under a folder of that "
                   "name, which a source would read as a class)")  # fmt: skip
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        table.warn(name, f"a name in {where} that climbs out with '..': left out (extraction "
                   "refuses it)")  # fmt: skip
        return None
    return "/".join(parts) or None


def tar_members(
    path: Path, a: int, start: int, size: int, table: Table, where: str
) -> Iterator[tuple[str, Row, bool]]:
    """``(clean name, row, is a folder)`` of each regular member and folder of the tar lying at
    ``[start, start + size)`` of ``path``; links and special files noted and left out.

    The headers are read by ``mmcache.sources.tar_headers``: by its own parser, or by
    ``tarfile`` for the kinds of header only ``tarfile`` reads.

    Raises:
        SourceError: the tar is truncated or damaged.
    """
    with open(path, "rb") as raw:
        try:
            found = list(read_headers(raw.fileno(), start, size, where))
        except OtherHeaders:
            found = list(read_by_tarfile(raw, start, size, where))
    for m in found:
        name = clean_name(m.name, table, where)
        if name is None:
            continue
        if m.kind == "dir":
            yield name, (a, 0, 0, 0, -1, 0, 0, 0), True
        elif m.kind == "link":
            table.warn(name, f"a link in {where} (to {m.linkname}): left out, links in "
                       "archives are not followed")  # fmt: skip
        elif m.kind == "file":
            if m.offset + m.size > size:
                raise broken(where, f"it ends inside member {m.name!r}: it is truncated")
            row = (a, start + m.offset, m.size, STORED, -1, m.size, m.mtime_ns, start + m.header)
            yield name, row, False
        # else devices, FIFOs: never images


def image_folder(
    root: Path, kind: str, table: Table, dirs: list[str], images: tuple[str, ...]
) -> Listing:
    """An ImageFolder's classes, labels and order over the table's members (``dirs``: folder
    members, so that a class folder without images is seen)."""
    rows = table.rows
    names = [n for n in rows if is_image(n, images) and not hidden(n)]
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    folders |= {n.split("/", 1)[0] for n in dirs if not hidden(n)}
    folders |= {n.split("/", 1)[0] for n in rows if "/" in n and not hidden(n)}
    if folders:
        classes = sorted(folders)
        index = {c: i for i, c in enumerate(classes)}
        names = [n for n in names if "/" in n]
        empty = sorted(set(classes) - {n.split("/", 1)[0] for n in names})
        if empty:
            raise SourceError(
                f"{root}: {len(empty)} class folder(s) without images "
                f"({', '.join(repr(c) for c in empty[:5])}), which would be classes no sample "
                "has (torchvision's ImageFolder refuses them too)"
            )
    else:
        classes = [stem(root.name)]
        index = {}
    # torchvision's order: folders sorted by path, the files of each sorted by name.
    names.sort(key=lambda n: (posixpath.dirname(n), posixpath.basename(n)))
    if not names:
        raise SourceError(f"{root}: no images found in the archive")
    labels = [index[n.split("/", 1)[0]] if folders else 0 for n in names]
    return found(root, kind, classes, names, labels, table)


def is_image(name: str, images: tuple[str, ...]) -> bool:
    base = posixpath.basename(name)
    return base.lower().endswith(images) and not base.startswith(".")


def hidden(name: str) -> bool:
    return any(p.startswith(".") for p in name.split("/"))


def stem(name: str) -> str:
    lower = name.lower()
    for suffix in TAR_SUFFIXES + ZIP_SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name



def found(
    root: Path,
    kind: str,
    classes: list[str],
    names: list[str],
    labels: list[int],
    table: Table,
    source: dict[str, str] | None = None,
) -> Listing:
    rows = table.rows
    return Listing(
        root=root,
        kind=kind,
        list_file=None,
        classes=classes,
        paths=names,
        labels=np.asarray(labels, np.int32),
        sizes=np.asarray([rows[n][5] for n in names], np.uint64),
        mtimes=np.asarray([rows[n][6] for n in names], np.int64),
        warnings=table.warnings,
        members=table.members(names),
        source_extra=source or {},
    )



def refuse_compressed_member(root: Path, offset: int, where: str) -> None:
    with open(root, "rb") as f:
        head = os.pread(f.fileno(), 8, offset)
    for magic, (name, tool) in COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise compressed(Path(where), f"{name}-compressed", f"extract it and `{tool} -d` it")

