"""Archives as sources: tar, tar of tars, WebDataset shards and zip, listed and read in place.

Nothing is extracted. The scan walks the archive's headers (``mmcache._tar``, ``zipfile``)
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

A listed member's address travels to the decode workers inside its path string, behind a
marker that no file name holds (a NUL byte): ``member_ref``. The address carries the archive's
size and mtime as listed: a worker that finds the archive changed stores nothing for the member
(``BAD_SOURCE_CHANGED``), as for a file changed since it was listed. The member's bytes are put
in an anonymous in-memory file and decoded through ``decode.decode_record``, so the pixels,
truncation check and reasons are exactly those of the same bytes in a file.
"""

from __future__ import annotations

import calendar
import errno
import io
import json
import os
import posixpath
import re
import shlex
import stat as stat_mod
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import format as fmt
from ._tar import OtherHeaders, broken, pread_all, read_by_tarfile, read_headers
from .decode import Options, StderrCapture, decode_record
from .errors import SourceError
from .probe import probe_region, probe_size

# The start of a path string that addresses an archive member rather than a file: a NUL byte
# cannot occur in a file name, so no real path is ever taken for one, and any code that does
# take one for a path fails at once (Python refuses NUL in paths) instead of reading a file.
MEMBER_MARK = "\0mmcache-member\0"

TAR_SUFFIXES = (".tar",)
ZIP_SUFFIXES = (".zip",)
COMPRESSED_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
# First bytes of the compressors a .tar may hide: gzip, bzip2, xz, zstd.
# The tool of each (``gzip``): ``-dc`` writes what it decompresses to stdout.
_COMPRESSED_MAGIC = {
    b"\x1f\x8b": ("gzip", "gzip"),
    b"BZh": ("bzip2", "bzip2"),
    b"\xfd7zXZ\x00": ("xz", "xz"),
    b"\x28\xb5\x2f\xfd": ("zstd", "zstd"),
}
# What decompresses a compressed tar named by its suffix into the .tar beside it, kept.
_DECOMPRESS_BY_SUFFIX = {
    ".tar.gz": "gunzip -k", ".tgz": "gunzip -k", ".tar.bz2": "bunzip2 -k",
    ".tbz2": "bunzip2 -k", ".tar.xz": "unxz -k", ".txz": "unxz -k", ".tar.zst": "zstd -d",
}  # fmt: skip
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_STORED, _DEFLATED = 0, 8
# The most bytes a deflated zip member may inflate to, whatever its header declares: a BMP of
# the default max_pixels (89,478,485 x 3 bytes) fits, and a 1 MiB member that inflates to
# 1 GiB (a zip bomb) is refused after 256 MiB of output, never decompressed whole.
MAX_INFLATED = 1 << 28
# The most bytes of a shard's .cls or .json label member read (a label is a few bytes).
_MAX_LABEL = 1 << 20
# A member as the scan keeps it: (archive, offset, stored length, method, crc, size, mtime_ns).
Row = tuple[int, int, int, int, int, int, int]


def is_archive_source(source: str | os.PathLike, images: tuple[str, ...]) -> bool:
    """Whether ``source`` names an archive source: a tar or zip file, a compressed tar, a
    brace pattern of shards, or a folder of ``.tar`` shards (``images``: the extensions of
    image files, which such a folder holds none of)."""
    text = os.fspath(source)
    path = Path(text).expanduser()
    if _BRACE.search(path.name) and not path.exists():
        return True
    if path.is_file():
        return path.name.lower().endswith(TAR_SUFFIXES + ZIP_SUFFIXES + COMPRESSED_TAR_SUFFIXES)
    return path.is_dir() and _shards_in(path, images) is not None


def source_exists(source: str) -> bool:
    """Whether the source a cache records is there: a path, or a brace pattern's first shard."""
    if Path(source).exists():
        return True
    shards = _expand(Path(source))
    return bool(shards) and shards[0].exists()


@dataclass
class Members:
    """Where each listed member's bytes lie: its archive, offset and stored length."""

    archives: list[str]  # the archive files, absolute
    stats: list[tuple[int, int]]  # each archive's (size, mtime_ns) when listed
    names: list[str]  # each member's listed path (the listing's ``paths``)
    archive: np.ndarray  # int32: index into ``archives``
    offset: np.ndarray  # int64: where the member's stored bytes start in its archive
    length: np.ndarray  # int64: how many bytes are stored
    method: np.ndarray  # uint8: 0 stored, 8 deflated (zip)
    crc: np.ndarray  # int64: the zip's CRC-32 of the member, -1 for tar members

    def ref(self, i: int) -> str:
        """Member ``i``'s address, as the path string the decode workers get."""
        a = int(self.archive[i])
        size, mtime = self.stats[a]
        fields = (
            self.archives[a], size, mtime, int(self.offset[i]), int(self.length[i]),
            int(self.method[i]), int(self.crc[i]), self.names[i],
        )  # fmt: skip
        return MEMBER_MARK + "\0".join(str(f) for f in fields)

    def probe(self, i: int, size: int, exif: bool = True) -> tuple[int, int] | None:
        """The (height, width) of member ``i`` from its header, as ``probe.probe_size``;
        ``size``: the member's size as listed (a deflated one inflates to no more)."""
        ref = parse_ref(self.ref(i))
        try:
            fd = open_archive(ref.archive)
        except OSError:
            return None
        try:
            if ref.method == _STORED:
                return probe_region(fd, ref.offset, ref.length, exif)
            data = _read_member(fd, ref, size)
        finally:
            os.close(fd)
        if isinstance(data, str):
            return None
        with _in_memory_file(data) as path:
            return probe_size(path, exif)


@dataclass(frozen=True)
class MemberRef:
    """A member's address, parsed from ``Members.ref``."""

    archive: str
    archive_size: int
    archive_mtime_ns: int
    offset: int
    length: int
    method: int
    crc: int
    name: str


# A member address that says why there is no member (``MemberFinder.ref``).
_GONE = MEMBER_MARK + "\0"


def is_member(path: str) -> bool:
    return path.startswith(MEMBER_MARK)


def is_gone(ref: str) -> bool:
    return ref.startswith(_GONE)


def parse_ref(path: str) -> MemberRef:
    archive, size, mtime, offset, length, method, crc, name = path[len(MEMBER_MARK) :].split(
        "\0", 7
    )
    return MemberRef(
        archive, int(size), int(mtime), int(offset), int(length), int(method), int(crc), name
    )


def decode_member(
    path: str,
    size: int,
    mtime_ns: int,
    opts: Options,
    capture: StderrCapture | None = None,
) -> tuple[int, int, str, np.ndarray | None]:
    """``decode.decode_record`` for the member that ``path`` (a ``Members.ref``) addresses.

    ``size`` is the member's size; ``mtime_ns`` its header's time (both checked by the scan's
    fingerprint; here the archive's own size and mtime, carried in ``path``, guard the bytes).
    """
    if is_gone(path):
        return fmt.BAD_SOURCE_CHANGED, 0, path[len(_GONE) :], None
    ref = parse_ref(path)
    try:
        fd = open_archive(ref.archive)
    except OSError:
        return fmt.BAD_SOURCE_CHANGED, 0, "its archive vanished since it was listed", None
    try:
        if _stat_key(fd) != (ref.archive_size, ref.archive_mtime_ns):
            return fmt.BAD_SOURCE_CHANGED, 0, "its archive changed since it was listed", None
        data = _read_member(fd, ref, size)
        if _stat_key(fd) != (ref.archive_size, ref.archive_mtime_ns):
            return fmt.BAD_SOURCE_CHANGED, 0, "its archive changed while it was read", None
    finally:
        os.close(fd)
    if isinstance(data, str):
        return fmt.BAD_UNDECODABLE, 0, data, None
    if len(data) != size:
        return fmt.BAD_UNDECODABLE, 0, f"holds {len(data):,} bytes, its header says {size:,}", None
    with _in_memory_file(data) as name:
        st = os.stat(name)
        return decode_record(name, st.st_size, st.st_mtime_ns, opts, capture, name=ref.name)


def _stat_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def _read_member(fd: int, ref: MemberRef, declared: int) -> bytes | str:
    """The member's bytes, or why they cannot be had (a str): a deflated member inflates to at
    most ``declared`` bytes (what its header says) and ``MAX_INFLATED``."""
    limit = min(declared, MAX_INFLATED)
    if ref.method == _DEFLATED and declared > MAX_INFLATED:
        return (f"its header says it inflates to {declared:,} bytes, more than the "
                f"{MAX_INFLATED:,} mmcache inflates a zip member to")  # fmt: skip
    raw = pread_all(fd, ref.length, ref.offset)
    if len(raw) != ref.length:
        return "the archive ends inside this member: it is truncated"
    data = raw
    if ref.method == _DEFLATED:
        try:
            d = zlib.decompressobj(-15)  # a zip's raw deflate stream
            # One byte past the limit tells a member that inflates beyond it (a bomb) from
            # one that fits, without ever holding more than the limit.
            data = d.decompress(raw, limit + 1)
        except zlib.error as e:
            return f"its compressed bytes are damaged in the zip ({e})"
        if len(data) > limit or d.unconsumed_tail:
            return (f"it inflates to more than {limit:,} bytes (what its header declares, at "
                    f"most {MAX_INFLATED:,}): the archive is damaged or hostile")  # fmt: skip
    if ref.crc >= 0 and zlib.crc32(data) != ref.crc:
        return "its bytes fail the zip's CRC-32 check: the archive is damaged"
    return data


_FD_DIR = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)


@contextmanager
def _in_memory_file(data: bytes) -> Iterator[str]:
    """A path whose file holds ``data``: an anonymous memory file (Linux) or a temporary one.

    The same decoder calls as for a file on disk then read it, so a member decodes to exactly
    the pixels its extracted file would (``cv2.imdecode`` differs: OpenCV 5 returns nothing
    from it for a truncated JPEG that ``imread`` decodes).
    """
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None and _FD_DIR is not None:
        fd = memfd("mmcache-member", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.write(fd, data) if len(data) < (1 << 30) else _write_all(fd, data)
            yield f"{_FD_DIR}/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile(prefix="mmcache-member-") as f:
        f.write(data)
        f.flush()
        yield f.name


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --- listing --------------------------------------------------------------------------------


@dataclass
class Found:
    """What an archive scan found, for ``scan.scan_source`` to make a Listing of."""

    root: Path
    kind: str  # "tar", "zip" or "webdataset"
    classes: list[str]
    paths: list[str]
    labels: list[int]
    sizes: list[int]
    mtimes: list[int]
    members: Members
    warnings: list[dict[str, str]] = field(default_factory=list)
    source: dict[str, str] = field(default_factory=dict)  # more keys for the manifest's source


class _Table:
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
        """Member ``name``: (archive, offset, length, method, crc, size, mtime_ns)."""
        if name in self.rows:  # extraction keeps the last copy of a name
            del self.rows[name]
            self.warn(name, f"appears more than once in {where}: the last copy is used, as "
                      "extraction keeps it")  # fmt: skip
        self.rows[name] = row

    def warn(self, name: str, reason: str) -> None:
        self.warnings.append({"path": name, "reason": reason})

    def members(self, paths: list[str]) -> Members:
        rows = np.array([self.rows[p][:5] for p in paths], np.int64).reshape(-1, 5)
        return Members(
            archives=self.archives,
            stats=self.stats,
            names=paths,
            archive=rows[:, 0].astype(np.int32),
            offset=rows[:, 1].copy(),
            length=rows[:, 2].copy(),
            method=rows[:, 3].astype(np.uint8),
            crc=rows[:, 4].copy(),
        )


def scan_archive(
    source: str | os.PathLike, images: tuple[str, ...], label_key: str | None = None
) -> Found:
    """List the images of the archive source ``source`` (see the module docstring): the
    members whose names end with one of the extensions ``images`` (in any case).

    Raises:
        SourceError: no such source, a compressed tar, a truncated or damaged archive, a
            class without images, shards without labels.
    """
    path = Path(os.fspath(source)).expanduser()
    if _BRACE.search(path.name) and not path.exists():
        pattern = path.parent.resolve() / path.name
        shards = _expand(pattern)
        missing = [s for s in shards if not s.is_file()]
        if not shards or missing:
            raise SourceError(
                f"{pattern}: the pattern names {len(shards)} shards, {len(missing)} of them "
                f"missing ({', '.join(s.name for s in missing[:3])})"
            )
        return _scan_shards(pattern, shards, images, label_key, {"pattern": str(pattern)})
    if not path.exists():
        raise SourceError(f"{path}: source not found")
    root = path.resolve()
    if root.is_dir():
        found = _shards_in(root, images)
        if found is None:
            raise SourceError(f"{root}: not a folder of .tar shards")
        return _scan_shards(root, found, images, label_key, {})
    lower = root.name.lower()
    if lower.endswith(COMPRESSED_TAR_SUFFIXES):
        tool = next(t for suffix, t in _DECOMPRESS_BY_SUFFIX.items() if lower.endswith(suffix))
        raise _compressed(root, "compressed", f"run `{tool} {shlex.quote(str(root))}`")
    if lower.endswith(ZIP_SUFFIXES):
        if label_key is not None:
            raise SourceError(f"{root}: a zip is read as an ImageFolder; label_key is for shards")
        return _scan_zip(root, images)
    _refuse_compressed(root)
    table = _Table()
    a = table.add_archive(root)
    entries = list(_tar_members(root, a, 0, table.stats[a][0], table, root.name))
    files = [(name, row) for name, row, is_dir in entries if not is_dir]
    if label_key is not None or any(n.endswith(".cls") for n, _ in files):
        return _scan_shards(root, [root], images, label_key, {})
    regular = [(n, r) for n, r in files if not posixpath.basename(n).startswith(".")]
    if regular and all(n.lower().endswith(".tar") for n, _ in regular):
        return _scan_tar_of_tars(root, regular, table, images)
    dirs = [name for name, _, is_dir in entries if is_dir]
    for name, row in files:
        table.add(name, row, root.name)
    return _image_folder(root, "tar", table, dirs, images)


def _compressed(path: Path, what: str, how: str) -> SourceError:
    return SourceError(
        f"{path}: a {what} tar reads only front to back, and mmcache reads each image by its "
        f"offset: {how} once (the images stay inside the .tar, nothing is extracted), then "
        "build from that .tar"
    )


def open_archive(path: str | os.PathLike) -> int:
    """A descriptor on the archive ``path``, which must be a regular file: opened without
    blocking, so that a FIFO in its place never hangs a scan or a read.

    Raises:
        OSError: it cannot be opened, or it is not a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.ENXIO, "not a regular file (a FIFO, device or folder)")
    return fd


def _refuse_compressed(path: Path) -> None:
    try:
        fd = open_archive(path)
        try:
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise SourceError(f"{path}: cannot read the archive ({e.strerror})") from None
    for magic, (name, tool) in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            out = path.with_name(f"{path.stem}.decompressed.tar")
            how = f"run `{tool} -dc {shlex.quote(str(path))} > {shlex.quote(str(out))}`"
            raise _compressed(path, f"{name}-compressed", how)


def _clean_name(name: str, table: _Table, where: str) -> str | None:
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


def _tar_members(
    path: Path, a: int, start: int, size: int, table: _Table, where: str
) -> Iterator[tuple[str, Row, bool]]:
    """``(clean name, row, is a folder)`` of each regular member and folder of the tar lying at
    ``[start, start + size)`` of ``path``; links and special files noted and left out.

    The headers are read by ``mmcache._tar``: by its own parser, or by ``tarfile`` for the
    kinds of header only ``tarfile`` reads.

    Raises:
        SourceError: the tar is truncated or damaged.
    """
    with open(path, "rb") as raw:
        try:
            found = list(read_headers(raw.fileno(), start, size, where))
        except OtherHeaders:
            found = list(read_by_tarfile(raw, start, size, where))
    for m in found:
        name = _clean_name(m.name, table, where)
        if name is None:
            continue
        if m.kind == "dir":
            yield name, (a, 0, 0, 0, -1, 0, 0), True
        elif m.kind == "link":
            table.warn(name, f"a link in {where} (to {m.linkname}): left out, links in "
                       "archives are not followed")  # fmt: skip
        elif m.kind == "file":
            if m.offset + m.size > size:
                raise broken(where, f"it ends inside member {m.name!r}: it is truncated")
            row = (a, start + m.offset, m.size, _STORED, -1, m.size, m.mtime_ns)
            yield name, row, False
        # else devices, FIFOs: never images


def _image_folder(
    root: Path, kind: str, table: _Table, dirs: list[str], images: tuple[str, ...]
) -> Found:
    """An ImageFolder's classes, labels and order over the table's members (``dirs``: folder
    members, so that a class folder without images is seen)."""
    rows = table.rows
    names = [n for n in rows if _is_image(n, images) and not _hidden(n)]
    folders = {n.split("/", 1)[0] for n in names if "/" in n}
    folders |= {n.split("/", 1)[0] for n in dirs if not _hidden(n)}
    folders |= {n.split("/", 1)[0] for n in rows if "/" in n and not _hidden(n)}
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
        classes = [_stem(root.name)]
        index = {}
    # torchvision's order: folders sorted by path, the files of each sorted by name.
    names.sort(key=lambda n: (posixpath.dirname(n), posixpath.basename(n)))
    if not names:
        raise SourceError(f"{root}: no images found in the archive")
    labels = [index[n.split("/", 1)[0]] if folders else 0 for n in names]
    return _found(root, kind, classes, names, labels, table)


def _is_image(name: str, images: tuple[str, ...]) -> bool:
    base = posixpath.basename(name)
    return base.lower().endswith(images) and not base.startswith(".")


def _hidden(name: str) -> bool:
    return any(p.startswith(".") for p in name.split("/"))


def _stem(name: str) -> str:
    lower = name.lower()
    for suffix in TAR_SUFFIXES + ZIP_SUFFIXES:
        if lower.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _found(
    root: Path,
    kind: str,
    classes: list[str],
    names: list[str],
    labels: list[int],
    table: _Table,
    source: dict[str, str] | None = None,
) -> Found:
    rows = table.rows
    return Found(
        root=root,
        kind=kind,
        classes=classes,
        paths=names,
        labels=labels,
        sizes=[rows[n][5] for n in names],
        mtimes=[rows[n][6] for n in names],
        members=table.members(names),
        warnings=table.warnings,
        source=source or {},
    )


def _scan_tar_of_tars(
    root: Path, inner: list[tuple[str, Row]], table: _Table, images: tuple[str, ...]
) -> Found:
    """Each inner tar a class named after its stem, its members below that folder."""
    dirs = []
    for name, row in inner:
        cls = _stem(posixpath.basename(name))
        dirs.append(cls)
        where = f"{root.name}/{name}"
        _refuse_compressed_member(root, int(row[1]), where)
        for member, mrow, is_dir in _tar_members(root, 0, int(row[1]), int(row[2]), table, where):
            if not is_dir:
                table.add(f"{cls}/{member}", mrow, where)
    return _image_folder(root, "tar", table, dirs, images)


def _refuse_compressed_member(root: Path, offset: int, where: str) -> None:
    with open(root, "rb") as f:
        head = os.pread(f.fileno(), 8, offset)
    for magic, (name, tool) in _COMPRESSED_MAGIC.items():
        if head.startswith(magic):
            raise _compressed(Path(where), f"{name}-compressed", f"extract it and `{tool} -d` it")


def _scan_zip(root: Path, images: tuple[str, ...]) -> Found:
    table = _Table()
    a = table.add_archive(root)
    try:
        with zipfile.ZipFile(root) as z, open(root, "rb") as f:
            infos = z.infolist()
            size = table.stats[a][0]
            dirs = []
            for info in infos:
                name = _clean_name(info.filename, table, root.name)
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
                if info.compress_type not in (_STORED, _DEFLATED):
                    table.warn(name, f"compressed in {root.name} with zip method "
                               f"{info.compress_type}, which mmcache does not read: left out "
                               "(store or deflate it)")  # fmt: skip
                    continue
                offset = _zip_data_offset(f, info, root)
                if offset + info.compress_size > size:
                    raise broken(root.name, f"it ends inside member {info.filename!r}")
                mtime = _zip_mtime(info)
                row = (a, offset, info.compress_size, info.compress_type, info.CRC,
                       info.file_size, mtime)  # fmt: skip
                table.add(name, row, root.name)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
        raise broken(root.name, f"it does not read as a zip ({e})") from None
    except OSError as e:
        raise SourceError(f"{root}: cannot read the archive ({e.strerror})") from None
    return _image_folder(root, "zip", table, dirs, images)


def _zip_data_offset(f: io.BufferedReader, info: zipfile.ZipInfo, root: Path) -> int:
    """Where a member's stored bytes start: after its local header, whose name and extra
    field lengths may differ from the central directory's."""
    head = os.pread(f.fileno(), 30, info.header_offset)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        raise broken(root.name, f"member {info.filename!r} has no local header where the "
                      "directory says")  # fmt: skip
    name_len = int.from_bytes(head[26:28], "little")
    extra_len = int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def _zip_mtime(info: zipfile.ZipInfo) -> int:
    """The member's time in ns, with its CRC-32 in the nanoseconds: a zip's times step by 2 s,
    so a member rewritten within them at the same size still reads as modified."""
    try:
        seconds = calendar.timegm((*info.date_time, 0, 0, 0))
    except (ValueError, OverflowError):
        seconds = 0
    return seconds * 1_000_000_000 + info.CRC % 1_000_000_000


# --- WebDataset shards ----------------------------------------------------------------------


def _shards_in(folder: Path, images: tuple[str, ...]) -> list[Path] | None:
    """The ``.tar`` shards of a folder that holds only shards (and hidden or other non-image
    files), sorted by name; None if it holds subfolders or images, or no shard."""
    try:
        entries = [e for e in os.scandir(folder) if not e.name.startswith(".")]
    except OSError:
        return None
    if any(e.is_dir() or _is_image(e.name, images) for e in entries):
        return None
    shards = sorted(folder / e.name for e in entries if e.name.lower().endswith(".tar"))
    return shards or None


def _expand(pattern: Path) -> list[Path]:
    """``train-{0000..0002}.tar`` -> the three shard paths, in order (one brace range)."""
    m = _BRACE.search(pattern.name)
    if m is None:
        return []
    lo, hi = m[1], m[2]
    width = len(lo) if len(lo) == len(hi) or lo.startswith("0") else 0
    names = [
        pattern.name[: m.start()] + str(k).zfill(width) + pattern.name[m.end() :]
        for k in range(int(lo), int(hi) + 1)
    ]
    return [pattern.parent / n for n in names]


def _scan_shards(
    root: Path,
    shards: list[Path],
    images: tuple[str, ...],
    label_key: str | None,
    source: dict[str, str],
) -> Found:
    """Samples of WebDataset shards: an image member and a label member per key."""
    table = _Table()
    samples: list[tuple[str, str]] = []  # (path, raw label)
    for shard in shards:
        _refuse_compressed(shard)
        a = table.add_archive(shard)
        groups: dict[str, dict[str, tuple[str, Row]]] = {}
        order: list[str] = []
        for name, row, is_dir in _tar_members(shard, a, 0, table.stats[a][0], table, shard.name):
            base = posixpath.basename(name)
            if is_dir or base.startswith(".") or "." not in base:
                continue
            key = posixpath.join(posixpath.dirname(name), base.split(".", 1)[0])
            ext = base.split(".", 1)[1].lower()
            if key not in groups:
                groups[key] = {}
                order.append(key)
            if ext in groups[key]:
                table.warn(f"{shard.name}/{name}", f"appears more than once in {shard.name}: "
                           "the last copy is used, as extraction keeps it")  # fmt: skip
            groups[key][ext] = (name, row)
        with open(shard, "rb") as f:
            for key in order:
                group = groups[key]
                image = next((g for e, g in group.items() if _is_image("x." + e, images)), None)
                if image is None:
                    continue
                path = f"{shard.name}/{image[0]}"
                label = _sample_label(f.fileno(), group, label_key)
                if label.startswith("\0"):
                    table.warn(path, label[1:])
                    continue
                table.add(path, image[1], shard.name)
                samples.append((path, label))
    last: dict[str, str] = {}
    for p, lab in samples:  # a name twice in a shard: its last copy, where that lies
        last.pop(p, None)
        last[p] = lab
    samples = list(last.items())
    if not samples:
        raise SourceError(f"{root}: no labelled images found in the shards")
    numbers = [re.fullmatch(r"[+-]?\d+", lab) is not None for _, lab in samples]
    if all(numbers):
        labels = [int(lab) for _, lab in samples]
        if min(labels) < 0:
            raise SourceError(f"{root}: a class number is never negative")
        classes = [str(i) for i in range(max(labels) + 1)]
    elif any(numbers):
        raise SourceError(f"{root}: the labels mix class numbers and class names")
    else:
        classes = sorted({lab for _, lab in samples})
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[lab] for _, lab in samples]
    names = [p for p, _ in samples]
    extra = dict(source)
    if label_key is not None:
        extra["label_key"] = label_key
    return _found(root, "webdataset", classes, names, labels, table, extra)


def _sample_label(fd: int, group: dict[str, tuple[str, Row]], label_key: str | None) -> str:
    """A sample's label as text, or ``"\\0why not"``."""
    ext = "json" if label_key is not None else "cls"
    member = group.get(ext)
    if member is None:
        return f"\0no .{ext} member beside it: left out"
    row = member[1]
    if int(row[2]) > _MAX_LABEL:
        return f"\0its .{ext} member holds {int(row[2]):,} bytes, not a label: left out"
    raw = os.pread(fd, int(row[2]), int(row[1]))
    try:
        text = raw.decode("utf-8").strip()
        if label_key is None:
            return text
        value = json.loads(text)[label_key]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
        what = f"no field {label_key!r} in its .json" if label_key else "its .cls is not text"
        return f"\0{what}: left out"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"\0its .json field {label_key!r} is {value!r}, not a class number or name"
    return str(value)


# --- lazy caches ----------------------------------------------------------------------------

ARCHIVE_KINDS = ("tar", "zip", "webdataset")


class MemberFinder:
    """The addresses of a cache's members, for filling its records lazily, verifying them
    against their source or repairing them: the archive source the manifest records is listed
    again, once, on the first record asked for (member offsets are not recorded)."""

    def __init__(self, source: dict, images: tuple[str, ...]) -> None:
        self.source, self.images = source, images
        self._found: Found | None = None
        self._index: dict[str, int] = {}
        self._error = ""

    def ref(self, name: str, size: int, mtime_ns: int) -> str:
        """Member ``name``'s address, or (``is_gone``) why it is not the member listed with
        ``size`` and ``mtime_ns`` any more."""
        if self._found is None and not self._error:
            root = self.source.get("pattern") or self.source["root"]
            try:
                self._found = scan_archive(root, self.images, self.source.get("label_key"))
            except SourceError as e:
                self._error = f"its archive cannot be listed any more ({e})"
            else:
                self._index = {p: i for i, p in enumerate(self._found.paths)}
        i = self._index.get(name)
        if self._found is None or i is None:
            return _GONE + (self._error or "no longer in its archive")
        if (self._found.sizes[i], self._found.mtimes[i]) != (size, mtime_ns):
            return _GONE + "changed in its archive since it was listed"
        return self._found.members.ref(i)


class RecordedMembers:
    """``Members`` for the records of a cache (``MemberFinder`` over their paths and stats)."""

    def __init__(
        self,
        source: dict,
        images: tuple[str, ...],
        names: list[str],
        sizes: np.ndarray,
        mtimes: np.ndarray,
    ) -> None:
        self._finder = MemberFinder(source, images)
        self._names, self._sizes, self._mtimes = names, sizes, mtimes

    def ref(self, i: int) -> str:
        return self._finder.ref(self._names[i], int(self._sizes[i]), int(self._mtimes[i]))

    def probe(self, i: int, size: int, exif: bool = True) -> tuple[int, int] | None:
        """As ``Members.probe`` (``size`` unused: ``ref`` checks the member's recorded size)."""
        ref = self.ref(i)
        if is_gone(ref):
            return None
        with member_file(ref) as path:
            return None if path is None else probe_size(path, exif)


@contextmanager
def member_file(ref: str) -> Iterator[str | None]:
    """A path to a memory file that holds the bytes of member ``ref`` (None if unreadable or
    its archive changed since it was listed): for decoders that take a path."""
    if is_gone(ref):
        yield None
        return
    r = parse_ref(ref)
    try:
        fd = open_archive(r.archive)
    except OSError:
        yield None
        return
    try:
        same = _stat_key(fd) == (r.archive_size, r.archive_mtime_ns)
        data = _read_member(fd, r, MAX_INFLATED) if same else ""
    finally:
        os.close(fd)
    if isinstance(data, str):
        yield None
        return
    with _in_memory_file(data) as path:
        yield path
