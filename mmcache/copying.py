"""Copying a cache to another folder (a node's local disk): in-kernel, sparse-aware, verified.

The copy is a new generation of the destination cache, published as a build publishes one: the
four files are copied and flushed, read back and checked, and only then is ``manifest.json``
written, so an interrupted or failed copy leaves the destination's previous cache (if any)
intact. Bytes move with ``os.copy_file_range`` (in the kernel, no user-space buffer), falling
back to ``os.sendfile`` and then to ``pread``/``pwrite`` across filesystems that refuse it; only
the data regions of a sparse data file (a lazy cache not yet filled) are copied, found with
``SEEK_DATA``/``SEEK_HOLE``, so the copy stays sparse.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from contextlib import suppress
from pathlib import Path

import numpy as np

from . import format as fmt
from ._files import copy_range, create_generation_file, fsync_dir
from ._generation import (
    discarded_on_failure,
    new_generation,
    open_existing,
    prepare_folder,
    remove_stale_generations,
    retire,
    write_manifest,
    writer_lock,
)
from ._opening import open_for_reading
from .errors import CacheFormatError, DestinationError
from .reports import CopyReport, ProgressFn, VerifyReport
from .sources import carry_member_table
from .space import check_free_space, disk_bytes
from .verify import check_checksums

__all__ = ["copy_cache"]

# Bytes per copy_range call: progress updates every 64 MiB (~0.1 s on an NVMe disk).
STEP = 64 << 20


def copy_cache(
    src: str | os.PathLike, dest: str | os.PathLike, progress: ProgressFn | None = None
) -> CopyReport:
    """Copy the cache ``src`` to the folder ``dest`` and verify the copy.

    ``dest`` is created, or must be an empty folder or a cache (which the copy replaces
    atomically, as a rebuild would). Records in state ``FILLED`` are checked against the CRC-32
    the state file holds for them, read back from the destination's disk.

    Args:
        src: a cache folder.
        dest: the folder to copy it to, typically on a node's local disk.
        progress: called as ``progress(done, total)`` in bytes while copying.

    Examples:
        >>> report = copy_cache("/shared/cache/train", "/local/cache/train")  # doctest: +SKIP
        >>> report.verified == report.images  # doctest: +SKIP

    Raises:
        CacheNotFoundError, CacheFormatError: ``src`` is no cache, is damaged, or the copy does
            not verify (nothing is published then).
        NotACacheError, DestinationError, InsufficientSpaceError: ``dest`` cannot take it.
    """
    start = time.perf_counter()
    source = fmt.cache_folder(src)
    folder = fmt.cache_folder(dest)
    m = fmt.read_manifest(source)
    # Open the four files now: a rebuild of ``src`` that replaces them cannot pull them away.
    fds: dict[str, int] = {}
    try:
        for kind in m.file_kinds:
            try:
                fds[kind] = open_for_reading(m.file(kind))
            except FileNotFoundError:
                raise CacheFormatError(
                    f"{m.file(kind)}: missing (the cache is being rebuilt, or is damaged); "
                    "run the copy again"
                ) from None
        files = fmt.read_cache_files(m)
        if folder.exists() and os.path.samefile(folder, source):
            raise DestinationError(f"{folder}: is the cache being copied; choose another folder")
        had_lock = (folder / fmt.LOCK_NAME).exists()
        created = prepare_folder(folder)
        try:
            with writer_lock(folder):
                previous = open_existing(folder)
                previous = remove_stale_generations(folder, previous)
                copied, verified, manifest = _copy_generation(fds, files, folder, progress)
                write_manifest(manifest)
                if previous is not None:
                    retire(previous.manifest, manifest)
        except BaseException:
            # A failed copy leaves what was there: no folder it created, no lock file it made.
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            elif not had_lock and os.listdir(folder) == [fmt.LOCK_NAME]:
                with suppress(FileNotFoundError):
                    os.unlink(folder / fmt.LOCK_NAME)
            raise
    finally:
        for fd in fds.values():
            os.close(fd)
    return CopyReport(
        source=source,
        dest=folder,
        images=m.count,
        bytes=sum(m.sizes.values()),
        copied=copied,
        verified=verified,
        seconds=time.perf_counter() - start,
    )


def _copy_generation(
    fds: dict[str, int], files: fmt.CacheFiles, folder: Path, progress: ProgressFn | None
) -> tuple[int, int, fmt.Manifest]:
    """Copy, flush and verify the four files as a new generation; its manifest, unpublished."""
    m = files.manifest
    regions = {kind: _data_regions(fds[kind], m.sizes[kind]) for kind in m.file_kinds}
    sizes = {kind: sum(n for _, n in regions[kind]) for kind in m.file_kinds}
    total = sum(sizes.values())
    check_free_space(  # the holes skipped take no space
        folder, disk_bytes(sizes), advice="free some space there or copy to another disk"
    )
    gen = new_generation()
    copied = 0
    with discarded_on_failure(folder, gen, "nothing was published"):
        # The state file before the data: a lazy cache being filled marks a record FILLED only
        # after writing its pixels, so every record FILLED in the copied state is in the copy.
        first = [kind for kind in m.file_kinds if kind not in ("state", "data")]
        for kind in (*first, "state", "data"):
            if kind == "data":
                # Only the bytes of records FILLED now (a superset of those the copied state
                # calls FILLED, each checked below): never an empty record's bytes, which no
                # CRC vouches for (the file could be another's, hard-linked in).
                regions["data"] = _filled_regions(fds["state"], files)
            dst = create_generation_file(folder, kind, gen, m.sizes[kind])  # holes stay
            try:
                for offset, length in regions[kind]:
                    for pos in range(offset, offset + length, STEP):
                        n = min(STEP, offset + length - pos)
                        copy_range(fds[kind], dst, pos, pos, n)
                        copied += n
                        if progress is not None:
                            progress(copied, total)
                os.fsync(dst)
                # Drop the copy from the page cache so that the check below reads the disk.
                os.posix_fadvise(dst, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(dst)
        fsync_dir(folder)
        members = carry_member_table(m, folder, gen)  # (checked as it is read)
        copy = fmt.Manifest(**{**vars(m), "path": folder, "generation": gen,
                               "data_generation": gen, "members": members})  # fmt: skip
        verified = _verify(files, copy)
    return copied, verified, copy


def _data_regions(fd: int, size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the parts of the file's first ``size`` bytes that hold data."""
    regions, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole is left
                break
            return [(0, size)] if size else []  # no SEEK_DATA here: copy it all
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        regions.append((start, end - start))
        pos = end
    return regions


def _filled_regions(state_fd: int, files: fmt.CacheFiles) -> list[tuple[int, int]]:
    """``(offset, length)`` of the data file's parts that hold records FILLED in the state
    file ``state_fd`` now; records that follow each other (but for padding) make one part."""
    m = files.manifest
    state = np.frombuffer(os.pread(state_fd, m.sizes["state"], 0), fmt.STATE_DTYPE)
    if len(state) != m.count:
        raise CacheFormatError(f"{m.file('state')}: changed size while it was copied")
    filled = np.flatnonzero(state["state"] == fmt.FILLED)
    if not len(filled):
        return []
    starts = files.index["offset"].astype(np.int64)[filled]
    ends = starts + fmt.record_nbytes(files.index, m.pixels, m.mask).astype(np.int64)[filled]
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    padded = -(-ends // fmt.DATA_ALIGN) * fmt.DATA_ALIGN
    # A part ends where the next record starts past the previous one's padding.
    breaks = np.flatnonzero(starts[1:] > padded[:-1])
    firsts = np.concatenate([[0], breaks + 1])
    lasts = np.concatenate([breaks, [len(starts) - 1]])
    return [(int(s), int(e - s)) for s, e in zip(starts[firsts], ends[lasts])]


def _verify(source: fmt.CacheFiles, copy: fmt.Manifest) -> int:
    """Check the copy's sizes, its index, state and paths, and each FILLED record's CRC-32.

    Returns the number of records whose pixels were checked.
    """
    files = fmt.read_cache_files(copy)  # sizes, and every record within the data file
    for kind, ours, theirs in (
        ("index", files.index.tobytes(), source.index.tobytes()),
        ("paths", files.paths_blob, source.paths_blob),
        *[
            (fmt.FIELDS_KIND, files.fields[name][1].tobytes(), source.fields[name][1].tobytes())
            for name in source.fields
        ],
    ):
        if ours != theirs:
            raise CacheFormatError(f"{copy.file(kind)}: differs from the source's; not published")
    # The state is not compared with the source's: a lazy source may have filled more records
    # since. Each record the copy calls FILLED must match its CRC.
    filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
    report = VerifyReport(cache=copy.path, records=copy.count, checked=0, bytes=0, seconds=0.0)
    check_checksums(files, filled, report)
    if report.bad:
        b = report.bad[0]
        raise CacheFormatError(
            f"{copy.file('data')}: record {b.index} ({b.path}) does not match its CRC-32 "
            "in the state file: the copy or the source is damaged; nothing was published"
        )
    return report.checked
