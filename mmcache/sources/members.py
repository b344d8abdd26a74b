"""An archive member's typed address, and reading and decoding its bytes in place."""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..decode import Options, StderrCapture, decode_record
from ..probe import probe_region, probe_size
from .tar_headers import pread_all

STORED, DEFLATED = 0, 8
# The most bytes a deflated zip member may inflate to, whatever its header declares: a BMP of
# the default max_pixels (89,478,485 x 3 bytes) fits, and a 1 MiB member that inflates to
# 1 GiB (a zip bomb) is refused after 256 MiB of output, never decompressed whole.
MAX_INFLATED = 1 << 28


@dataclass(frozen=True)
class MemberAddress:
    """Where a listed member's bytes lie, and its archive's size and mtime when listed: what
    the decode workers get for it in place of a file's path."""

    archive: str
    archive_size: int
    archive_mtime_ns: int
    offset: int
    length: int
    method: int
    crc: int
    name: str



@dataclass(frozen=True)
class MemberGone:
    """A member that cannot be read as listed any more, and why (``MemberFinder.ref``)."""

    reason: str


Address = MemberAddress | MemberGone


def is_member(path: object) -> bool:
    """Whether ``path`` (a decode job's) addresses an archive member rather than a file."""
    return isinstance(path, MemberAddress | MemberGone)


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
    header: np.ndarray  # int64: where its headers start (a tar's first header, a zip's local one)

    def ref(self, i: int) -> MemberAddress:
        """Member ``i``'s address, as the decode workers get it."""
        a = int(self.archive[i])
        size, mtime = self.stats[a]
        return MemberAddress(
            self.archives[a], size, mtime, int(self.offset[i]), int(self.length[i]),
            int(self.method[i]), int(self.crc[i]), self.names[i],
        )  # fmt: skip

    def probe(self, i: int, size: int, exif: bool = True) -> tuple[int, int] | None:
        """The (height, width) of member ``i`` from its header, as ``probe.probe_size``;
        ``size``: the member's size as listed (a deflated one inflates to no more)."""
        ref = self.ref(i)
        try:
            fd = open_archive(ref.archive)
        except OSError:
            return None
        try:
            if ref.method == STORED:
                return probe_region(fd, ref.offset, ref.length, exif)
            data = read_member(fd, ref, size)
        finally:
            os.close(fd)
        if isinstance(data, str):
            return None
        with in_memory_file(data) as path:
            return probe_size(path, exif)



def decode_member(
    ref: Address,
    size: int,
    mtime_ns: int,
    opts: Options,
    capture: StderrCapture | None = None,
) -> tuple[int, int, str, np.ndarray | None]:
    """``decode.decode_record`` for the member that ``ref`` (a ``Members.ref``) addresses.

    ``size`` is the member's size; ``mtime_ns`` its header's time (both checked by the scan's
    fingerprint; here the archive's own size and mtime, carried in ``ref``, guard the bytes).
    """
    if isinstance(ref, MemberGone):
        return fmt.BAD_SOURCE_CHANGED, 0, ref.reason, None
    try:
        fd = open_archive(ref.archive)
    except OSError:
        return fmt.BAD_SOURCE_CHANGED, 0, "its archive vanished since it was listed", None
    try:
        if stat_key(fd) != (ref.archive_size, ref.archive_mtime_ns):
            return fmt.BAD_SOURCE_CHANGED, 0, "its archive changed since it was listed", None
        data = read_member(fd, ref, size)
        if stat_key(fd) != (ref.archive_size, ref.archive_mtime_ns):
            return fmt.BAD_SOURCE_CHANGED, 0, "its archive changed while it was read", None
    finally:
        os.close(fd)
    if isinstance(data, str):
        return fmt.BAD_UNDECODABLE, 0, data, None
    if len(data) != size:
        return fmt.BAD_UNDECODABLE, 0, f"holds {len(data):,} bytes, its header says {size:,}", None
    with in_memory_file(data) as name:
        st = os.stat(name)
        return decode_record(name, st.st_size, st.st_mtime_ns, opts, capture, name=ref.name)


def stat_key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


def read_member(fd: int, ref: MemberAddress, declared: int) -> bytes | str:
    """The member's bytes, or why they cannot be had (a str): a deflated member inflates to at
    most ``declared`` bytes (what its header says) and ``MAX_INFLATED``."""
    limit = min(declared, MAX_INFLATED)
    if ref.method == DEFLATED and declared > MAX_INFLATED:
        return (f"its header says it inflates to {declared:,} bytes, more than the "
                f"{MAX_INFLATED:,} mmcache inflates a zip member to")  # fmt: skip
    raw = pread_all(fd, ref.length, ref.offset)
    if len(raw) != ref.length:
        return "the archive ends inside this member: it is truncated"
    data = raw
    if ref.method == DEFLATED:
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
def in_memory_file(data: bytes) -> Iterator[str]:
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



@contextmanager
def member_file(ref: Address) -> Iterator[str | None]:
    """A path to a memory file that holds the bytes of member ``ref`` (None if unreadable or
    its archive changed since it was listed): for decoders that take a path."""
    if isinstance(ref, MemberGone):
        yield None
        return
    r = ref
    try:
        fd = open_archive(r.archive)
    except OSError:
        yield None
        return
    try:
        same = stat_key(fd) == (r.archive_size, r.archive_mtime_ns)
        data = read_member(fd, r, MAX_INFLATED) if same else ""
    finally:
        os.close(fd)
    if isinstance(data, str):
        yield None
        return
    with in_memory_file(data) as path:
        yield path

