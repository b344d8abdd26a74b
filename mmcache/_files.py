"""File-system primitives of a cache's writers: sparse files, positioned writes, in-kernel copies.

Each is one system call or a short loop of them, with the failure it can meet spelled out: a
full disk raises ``OSError(ENOSPC)`` (never SIGBUS through a mapping), a source file that ends
early raises ``CacheFormatError``. What the files hold is ``mmcache.format``'s business.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from ._opening import create_exclusively, open_folder, open_for_writing, resize
from .errors import CacheFormatError
from .format import STATE_DTYPE, file_name


def create_data_file(path: Path, size: int) -> None:
    """Create a new generation's data file of ``size`` bytes, sparse until records are written."""
    fd = create_exclusively(path)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def create_generation_file(folder: Path, kind: str, generation: str, size: int) -> int:
    """Create one file of a new generation at its final ``size`` (holes until written); returns
    a descriptor open for reading and writing, which the caller closes."""
    fd = create_exclusively(folder / file_name(kind, generation))
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_pixels(fd: int, pixels: np.ndarray, offset: int) -> None:
    """Write a record's pixels at ``offset`` of an open data file with one ``pwrite``.

    ``pwrite``, never a store through a mapping: on a full disk a store to a sparse mapped page
    kills the process with SIGBUS, where ``pwrite`` raises ``OSError(ENOSPC)``.
    """
    written = os.pwrite(fd, pixels.data, offset)
    if written != pixels.nbytes:
        raise OSError(errno.ENOSPC, "short write to the data file")


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries, so a rename in it survives a power cut."""
    fd = open_folder(folder)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_range(src: int, dst: int, src_offset: int, dst_offset: int, length: int) -> None:
    """Copy ``length`` bytes between two open cache files, in the kernel when it can
    (``copy_file_range``), else with ``sendfile``, else with ``pread``/``pwrite``.

    Raises:
        CacheFormatError: the source file ends before ``src_offset + length``.
    """
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src, dst, length - done, src_offset + done, dst_offset + done)
        except OSError as e:
            # Across filesystems (EXDEV), or where unsupported: move the rest another way.
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _copy_in_user_space(src, dst, src_offset + done, dst_offset + done, length - done)
            return
        if n == 0:
            raise CacheFormatError(f"the source file ended early, at byte {src_offset + done}")
        done += n


# Bytes per pread in the user-space copy: a buffer large enough to amortise the syscalls.
_COPY_CHUNK = 8 << 20


def _copy_in_user_space(src: int, dst: int, src_offset: int, dst_offset: int, n: int) -> None:
    done = 0
    os.lseek(dst, dst_offset, os.SEEK_SET)
    try:
        while done < n:  # sendfile writes at dst's position
            k = os.sendfile(dst, src, src_offset + done, n - done)
            if k == 0:
                raise CacheFormatError(f"the source file ended early, at byte {src_offset + done}")
            done += k
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
        while done < n:
            chunk = os.pread(src, min(_COPY_CHUNK, n - done), src_offset + done)
            if not chunk:
                raise CacheFormatError(
                    f"the source file ended early, at byte {src_offset + done}"
                ) from None
            os.pwrite(dst, chunk, dst_offset + done)
            done += len(chunk)


def write_state(fd: int, i: int, crc32: int, code: int) -> None:
    """Write record ``i``'s 8-byte state ``(crc32, code)`` with one ``pwrite``: it is the last
    write of a fill, so a record that reads FILLED has its pixels."""
    os.pwrite(fd, np.array([(crc32, code)], STATE_DTYPE).tobytes(), i * STATE_DTYPE.itemsize)


def cut_data_file(path: Path, size: int) -> None:
    """Truncate the data file at ``path`` to ``size`` bytes if it is longer (what a stopped
    writer appended past the published records)."""
    try:
        fd = open_for_writing(path)
    except FileNotFoundError:
        return
    try:
        resize(fd, size, only_shrink=True)
    finally:
        os.close(fd)


def extend_data_file(path: Path, size: int) -> None:
    """Make the data file at ``path`` at least ``size`` bytes long, the new part sparse: room
    for records to be appended."""
    fd = open_for_writing(path)
    try:
        resize(fd, size, only_grow=True)
    finally:
        os.close(fd)
