"""Space: the bytes a cache generation takes on disk, and whether its destination has them.

A first build, or one that starts a new data file (other options, a compaction), writes a whole
new generation while the previous one is still on disk (it is deleted only after the new
manifest is published, see ``mmcache.format``), so it needs the new generation's full size free,
whatever the old cache holds. A refresh that appends to the data file needs room for what it
appends and for the new index, state and paths.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import format as fmt
from ._feedback import human_bytes
from .errors import InsufficientSpaceError

__all__ = ["check_free_space"]

# ext4, xfs and tmpfs allocate 4 KiB blocks: a file of 1 byte takes 4096 on disk.
BLOCK = 4096
# Room for manifest.json and its temporary copy: class names and skipped-file lists are a few
# kilobytes for ImageNet's 1,000 classes; 256 KiB covers far more.
MANIFEST_ALLOWANCE = 256 << 10


def generation_sizes(paths: Sequence[str], data_bytes: int) -> dict[str, int]:
    """The exact sizes of the four files of a generation whose records have source ``paths``."""
    n = len(paths)
    return {
        "index": n * fmt.INDEX_DTYPE.itemsize,
        "state": n * fmt.STATE_DTYPE.itemsize,
        "paths": sum(len(p.encode("utf-8", "surrogateescape")) for p in paths),
        "data": int(data_bytes),
    }


def disk_bytes(sizes: dict[str, int]) -> int:
    """What files of these ``sizes`` (and a manifest) occupy on disk, in whole blocks."""
    return sum(-(-v // BLOCK) * BLOCK for v in sizes.values()) + MANIFEST_ALLOWANCE


def existing_ancestor(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else its nearest existing parent: where a new folder would live."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged user may still write on the filesystem that holds (or would hold)
    ``path``."""
    return shutil.disk_usage(existing_ancestor(path)).free


# What a refused build (or lazy cache) may do: every option named here is one that command and
# those functions accept (tests/test_cli.py checks each message's offers).
BUILD_ADVICE = (
    "free some space, choose a smaller size (`mmcache plan` compares them) or start anyway with "
    "`mmcache build --force` (Python: `build_cache(..., force=True)` or "
    "`create_lazy_cache(..., force=True)`)"
)


def check_free_space(
    folder: str | os.PathLike,
    needed_bytes: int,
    force: bool = False,
    advice: str = BUILD_ADVICE,
) -> int:
    """Refuse to start writing a cache into ``folder`` when its filesystem lacks ``needed_bytes``.

    Call it after planning and before writing anything, so a refusal leaves nothing behind.

    Args:
        folder: the cache folder (it need not exist yet).
        needed_bytes: what the files about to be written take on disk (``disk_bytes``).
        force: skip the check (``--force``): the write may then fail with a full disk.
        advice: what the message tells the user to do; name only options the caller accepts.

    Returns:
        The free bytes found (-1 when ``force`` skipped the check).

    Examples:
        >>> check_free_space("cache/train", 170 * 10**9)  # doctest: +SKIP

    Raises:
        InsufficientSpaceError: fewer than ``needed_bytes`` are free, naming both numbers.
    """
    if force:
        return -1
    free = free_bytes(folder)
    if free < needed_bytes:
        raise InsufficientSpaceError(
            f"{folder}: the cache needs {human_bytes(needed_bytes)} ({needed_bytes:,} bytes) of "
            f"disk but only {human_bytes(free)} ({free:,} bytes) are free there; {advice}"
        )
    return free


def disk_full_error(
    error: BaseException, where: str | os.PathLike, advice: str
) -> InsufficientSpaceError | None:
    """The ``InsufficientSpaceError`` a write that failed with ``error`` means, if the disk (or a
    quota) is full; else None. ``advice``: what was kept and what to do, for the message."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return InsufficientSpaceError(f"{where}: the disk is full ({error.strerror}); {advice}")
    return None
