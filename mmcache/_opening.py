"""Opening a cache's files safely: by a handle on their folder, never through a link, checked.

A cache folder may have been prepared by someone else (copied from a colleague, unpacked from an
archive, made in ``/tmp`` by another user), so a name in it may be a symbolic link to a file of
ours, a hard link to one, or a FIFO. Every file of a cache is therefore opened here: relative
to a descriptor of its folder (``dir_fd``; the folder itself may be a link, as a cache path
often is), with ``O_NOFOLLOW`` (a link in its place fails, ``ELOOP``), ``O_NONBLOCK`` (a FIFO in
its place cannot block the open) and ``O_CLOEXEC``, then checked on the open descriptor with
``fstat``: a regular file and, when opened for writing, one link and the owner of the folder or
ours. New files are created with ``O_CREAT | O_EXCL``, so nothing that stands in their place is
followed or reused. Resizing is ``ftruncate`` on such a descriptor, never a truncate by path.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import UnsafeCacheError

# Flags of every open: no link followed at the last step, no wait on a FIFO, not inherited.
_BASE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_folder(folder: Path) -> int:
    """A read-only descriptor of the folder ``folder`` (a link to a folder is followed: a cache
    path may be one); the caller closes it."""
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_in(path: Path, flags: int, mode: int = 0o666) -> tuple[int, os.stat_result]:
    """Open ``path``'s name relative to its folder with ``flags`` and the safe ones; the
    descriptor and the folder's ``stat``."""
    folder_fd = open_folder(path.parent)
    try:
        folder_stat = os.fstat(folder_fd)
        try:
            fd = os.open(path.name, flags | _BASE_FLAGS, mode, dir_fd=folder_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise link_refused(path) from None
            if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
                raise _not_regular(path) from None
            raise
    finally:
        os.close(folder_fd)
    return fd, folder_stat


def link_refused(path: Path) -> UnsafeCacheError:
    """The error for a symbolic link found in place of the cache file ``path``."""
    return UnsafeCacheError(
        f"{path}: is a symbolic link; a cache's files are never opened through one (delete "
        "it, or rebuild the cache)"
    )


def _not_regular(path: Path) -> UnsafeCacheError:
    return UnsafeCacheError(
        f"{path}: is not a regular file (a FIFO, a device or a folder stands in its place); "
        "delete it, or rebuild the cache"
    )


def _checked(fd: int, path: Path, folder_stat: os.stat_result, writing: bool) -> int:
    """``fd`` once its file proves safe to use; closed, and the reason raised, otherwise."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path)
        if writing and st.st_nlink != 1:
            raise UnsafeCacheError(
                f"{path}: has {st.st_nlink} names (hard links); a cache file written through "
                "one would change the others too: copy the cache (mmcache copy) instead"
            )
        if writing and st.st_uid not in (os.geteuid(), folder_stat.st_uid):
            raise UnsafeCacheError(
                f"{path}: belongs to uid {st.st_uid}, neither you nor the folder's owner "
                f"(uid {folder_stat.st_uid}); refusing to write to it"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_reading(path: Path) -> int:
    """A read-only descriptor of the cache file ``path``, a regular file reached by no link.

    Raises:
        FileNotFoundError: no such file.
        UnsafeCacheError: a link, or not a regular file, is in its place.
    """
    fd, folder_stat = _open_in(path, os.O_RDONLY)
    return _checked(fd, path, folder_stat, writing=False)


def open_for_writing(path: Path) -> int:
    """A read-write descriptor of the existing cache file ``path``: a regular file with one
    link, reached by no link, owned by us or by the folder's owner.

    Raises:
        FileNotFoundError: no such file.
        UnsafeCacheError: it fails one of those checks.
    """
    fd, folder_stat = _open_in(path, os.O_RDWR)
    return _checked(fd, path, folder_stat, writing=True)


def create_exclusively(path: Path, mode: int = 0o666) -> int:
    """A read-write descriptor of a file created at ``path``, which must not exist (no link,
    nothing else in its place is opened).

    Raises:
        FileExistsError: something is there already (a name chosen at random is never).
    """
    fd, _ = _open_in(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    return fd


def read_whole(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of the cache file ``path``, opened with ``open_for_reading``."""
    fd = open_for_reading(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def resize(fd: int, size: int, only_shrink: bool = False, only_grow: bool = False) -> None:
    """Set the open file ``fd``'s size to ``size`` with ``ftruncate`` (only if that shrinks it,
    or only if it grows it, when asked)."""
    now = os.fstat(fd).st_size
    if (only_shrink and now <= size) or (only_grow and now >= size):
        return
    os.ftruncate(fd, size)


def check_writable_folder(folder: Path) -> None:
    """Refuse to write a cache into ``folder`` if someone else could swap its files meanwhile.

    Raises:
        UnsafeCacheError: the folder belongs to another user (root included: a root build into
            a folder a user made is the classic attack), or others may write to it and it lacks
            the sticky bit (``/tmp``'s protection).
    """
    st = os.stat(folder)
    if st.st_uid != os.geteuid():
        raise UnsafeCacheError(
            f"{folder}: the cache folder belongs to uid {st.st_uid}, not to you (uid "
            f"{os.geteuid()}); its owner could replace its files while you write: write the "
            "cache as that user, or into a folder of your own"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeCacheError(
            f"{folder}: the cache folder is writable by every user (mode "
            f"{stat.S_IMODE(st.st_mode):o}) without the sticky bit; `chmod o-w` it (or +t) "
            "before writing a cache there"
        )
