"""Filling a lazy cache: one record decoded on its first read and stored in place.

A record is filled by decoding its file, writing the pixels with ``pwrite``, then writing its
8-byte state ``(crc32, FILLED)`` with ``pwrite``. Readers look at the state first, so a record
that reads ``FILLED`` is complete, and a process killed between the two writes leaves it
``EMPTY``, to be decoded again by the next reader. Processes filling the same record at once
write the same bytes, so no lock is taken.

Power cuts: fills are not flushed one by one (an fsync per image would cost milliseconds), so
after a power cut a record's state may be on disk while its pixels are not. Each filling process
therefore leaves a ``filling-<token>`` file holding the machine's boot id, flushed before its first
fill and deleted once it has flushed the data and state files (``close``). A ``filling-`` file of
another boot (``lost_fill_markers``) means fills that may not have reached the disk: readers then
check each ``FILLED`` record's CRC-32 before trusting it and fill again one that fails, and a
writer (``scrub_lost_fills``, under the lock) checks them all, marks the failures ``EMPTY`` and
deletes those files. See the format's specification.
"""

from __future__ import annotations

import dataclasses
import importlib
import multiprocessing.util
import os
import secrets
import weakref
import zlib
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Protocol

import numpy as np

from . import format as fmt
from . import pixels as px
from ._files import fsync_dir, write_pixels, write_state
from ._opening import create_exclusively, open_for_reading, open_for_writing
from .annotations import recorded_mask_file
from .decode import DEFAULT_MAX_PIXELS, Options, decode_record
from .errors import CacheError, CacheFormatError, DestinationError, UnsafeCacheError
from .sources import SOURCES, decode_member
from .space import disk_full_error


class Filler(Protocol):
    """What stores a lazy cache's ``EMPTY`` records in one process (``pid``)."""

    pid: int

    def fill(self, i: int) -> tuple[int, np.ndarray | None]:
        """Store record ``i``: ``(its new state, its pixels as stored if FILLED)``."""
        ...

    def fill_ahead(self, records: np.ndarray, stopped: Callable[[], bool]) -> None:
        """Store ``records`` ahead of their reads where many at once cost less than one at a
        time (until ``stopped()``), or do nothing."""
        ...

    def close(self) -> None:
        """Flush what this process filled, delete its ``filling-`` file, close its files."""
        ...


def open_filler(files: fmt.CacheFiles, source_given: bool = False) -> Filler:
    """The filler of ``files`` for this process: a ``RecordFiller``, which decodes the source,
    or for a node-local copy (an ``origin``) the ``RemoteFiller`` that fetches from the store
    (imported only then: the core imports no object-store module)."""
    if files.manifest.origin is not None:
        sparse = importlib.import_module("mmcache.remote.sparse")
        filler: Filler = sparse.RemoteFiller(files)
        return filler
    return RecordFiller(files, source_given)


class RecordFiller:
    """Fills the records of one lazy cache generation in place; one per process.

    ``source_given``: the caller named the cache's source itself (``source=``), so the root the
    manifest records is one it trusts; otherwise see ``check_trusted_source``.
    """

    def __init__(self, files: fmt.CacheFiles, source_given: bool = False) -> None:
        m = files.manifest
        self.files = files
        if not source_given:
            check_trusted_source(m)
        self.root = str(m.source.get("root", ""))
        # An archive's members: where the cache's members file places them (or listed again);
        # a kind that reads its files itself gives its reader.
        source = SOURCES[m.source["kind"]]
        self.members = source.recorded(files)
        self.reader = source.images
        try:
            self.options = Options.from_json(m.options)
        except (TypeError, ValueError) as e:
            raise CacheFormatError(f"{m.path}: bad options in the manifest ({e})") from None
        self.fds: list[int] = []
        kind = "data"
        try:
            for kind in ("data", "state"):
                self.fds.append(open_for_writing(m.file(kind)))
            self.marker = fill_marker(m.path)
        except CacheError:
            self.close()
            raise
        except OSError as e:
            self.close()
            raise DestinationError(
                f"{m.file(kind)}: cannot fill the lazy cache ({e.strerror}); records are stored "
                "where the cache lies, so its user must be able to write there"
            ) from None
        # Flushed and the marker deleted when the filler is freed or the process exits (also a
        # multiprocessing child, such as a DataLoader worker, which skips atexit).
        self.pid = os.getpid()
        self._release = weakref.finalize(self, release, self.fds, self.marker, self.pid)
        multiprocessing.util.Finalize(self, self._release, exitpriority=0)

    def fill(self, i: int) -> tuple[int, np.ndarray | None]:
        """Decode record ``i`` and store it: ``(its new state, its pixels if FILLED)``.

        Raises:
            InsufficientSpaceError: the disk is full.
        """
        r = self.files.index[i]
        rel = self.files.path(i)
        if fmt.check_relative_path(rel) is not None:
            raise CacheFormatError(f"{self.files.manifest.path}: unsafe source path {rel!r}")
        size, mtime = int(r["source_size"]), int(r["source_mtime_ns"])
        height, width, _ = self.files.shape(i)
        if height * width > min(self.options.max_pixels or DEFAULT_MAX_PIXELS, DEFAULT_MAX_PIXELS):
            # The record's shape comes from the manifest, which anyone may have written: a
            # size=16384x16384 would make each read decode and write 805 MB. Such a cache is
            # built (``build``), with the user's own options, never filled from a manifest's.
            code, crc, pixels = fmt.BAD_TOO_LARGE, 0, None
        elif self.members is None:
            mask = recorded_mask_file(self.files, i)
            code, crc, _, pixels = decode_record(
                os.path.join(self.root, rel), size, mtime, self.options, mask=mask,
                reader=self.reader,
            )  # fmt: skip
        else:
            code, crc, _, pixels = decode_member(self.members.ref(i), size, mtime, self.options)
        if pixels is not None and px.image_shape(pixels) != self.files.shape(i):
            # The header promised another size (a lying header, an orientation the probe read
            # differently): the record's place is fixed, so the file is refused, never cropped.
            code, crc, pixels = fmt.BAD_HEADER_MISMATCH, 0, None
        data_fd, state_fd = self.fds
        try:
            if pixels is not None:
                write_pixels(data_fd, pixels, int(r["offset"]))
            write_state(state_fd, i, crc, code)
        except OSError as e:
            m = self.files.manifest
            full = disk_full_error(
                e,
                m.path,
                f"free {m.sizes['data']:,} bytes for the whole cache, or build it elsewhere",
            )
            if full is not None:
                raise full from None
            raise
        return code, pixels

    def fill_ahead(self, records: np.ndarray, stopped: Callable[[], bool]) -> None:
        """Nothing: decoding ahead would take the loader's CPU for what it decodes anyway."""

    def close(self) -> None:
        """Flush what this process filled to disk, delete its ``filling-`` file, close."""
        if hasattr(self, "_release"):
            self._release()
        else:  # failed in __init__
            while self.fds:
                os.close(self.fds.pop())


def check_trusted_source(m: fmt.Manifest) -> None:
    """Refuse to decode the source a lazy cache's manifest names unless that manifest and its
    folder are ours (or root's): else whoever wrote it could make this process decode files
    only it may read (a private folder of ours) into a data file they can read.

    Raises:
        UnsafeCacheError: naming the owner and the fix (``source=``).
    """
    foreign = foreign_owner(m)
    if foreign is not None:
        path, owner = foreign
        raise UnsafeCacheError(
            f"{path}: belongs to uid {owner}, so the source its manifest names "
            f"({m.source.get('root', '')!r}) is not decoded into it; open the cache with "
            "source= set to that folder if you trust it, or build a cache of your own"
        )


def foreign_owner(m: fmt.Manifest) -> tuple[Path, int] | None:
    """``(path, uid)`` of the cache folder or manifest when another user (not root) owns it:
    whoever wrote that manifest chose what a fill reads, with this process's rights."""
    mine = (os.geteuid(), 0)
    for path in (m.path, m.path / fmt.MANIFEST_NAME):
        try:
            owner = os.stat(path).st_uid
        except OSError:
            continue  # a manifest gone since it was read: its generation's reads fail anyway
        if owner not in mine:
            return path, owner
    return None


def boot_id() -> str:
    """This boot's id (Linux), or "" where there is none: then every ``filling-`` file counts as
    another boot's."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read(64).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def fill_marker(folder: Path) -> Path:
    """Create this process's ``filling-<token>`` file in ``folder``, holding the boot id, and
    flush it and the folder: it is on disk before any fill it covers."""
    path = folder / f"{fmt.FILL_MARKER_PREFIX}{secrets.token_hex(8)}"
    fd = create_exclusively(path)
    try:
        os.write(fd, boot_id().encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(folder)
    return path


def release(fds: list[int], marker: Path, pid: int) -> None:
    """Flush the data and state files (``fds``), then delete ``marker``, then close them. In a
    process forked from the filler's (``pid``), only close them: the marker is the parent's."""
    try:
        if os.getpid() != pid:
            return
        for fd in fds:
            os.fdatasync(fd)
        with suppress(FileNotFoundError):
            os.unlink(marker)  # (no folder flush: a marker that comes back only costs a check)
    except OSError:
        pass  # not flushed: the marker stays, and after a power cut readers check the fills
    finally:
        while fds:
            os.close(fds.pop())


def lost_fill_markers(folder: Path) -> list[Path]:
    """The ``filling-`` files in ``folder`` left by another boot (or unreadable): their fills
    may not have reached the disk."""
    try:
        names = [n for n in os.listdir(folder) if fmt.is_fill_marker_name(n)]
    except OSError:
        return []
    if not names:
        return []
    this_boot = boot_id()
    lost = []
    for n in names:
        try:
            with os.fdopen(open_for_reading(folder / n), "rb") as f:
                same = this_boot != "" and f.read(64).decode("ascii", "replace") == this_boot
        except FileNotFoundError:
            continue  # its filler just finished
        except (OSError, CacheError):
            same = False
        if not same:
            lost.append(folder / n)
    return lost


def stored_crc(data_fd: int, files: fmt.CacheFiles, i: int) -> int | None:
    """CRC-32 of record ``i``'s bytes in the data file, or None if the file ends before them."""
    off = int(files.index[i]["offset"])
    m = files.manifest
    n = int(fmt.record_nbytes(files.index[i : i + 1], m.pixels, m.mask)[0])
    got = os.pread(data_fd, n, off)
    return zlib.crc32(got) if len(got) == n else None


def scrub_lost_fills(files: fmt.CacheFiles) -> fmt.CacheFiles:
    """After a power cut (``filling-`` files of another boot): check every FILLED record's
    pixels, write EMPTY over the state of those that fail (a lazy cache: they fill again) and
    flush it, then delete those files. Only a writer holding the lock calls it. Returns the
    files with the states as they are now."""
    m = files.manifest
    lost = lost_fill_markers(m.path)
    if not lost:
        return files
    state = files.state.copy()
    with os.fdopen(open_for_reading(m.file("data")), "rb") as data:
        failed = [
            int(i)
            for i in np.flatnonzero(state["state"] == fmt.FILLED)
            if stored_crc(data.fileno(), files, int(i)) != int(state["crc32"][i])
        ]
    if failed and m.mode == "lazy":
        fd = open_for_writing(m.file("state"))
        try:
            for i in failed:
                write_state(fd, i, 0, fmt.EMPTY)
                state[i] = (0, fmt.EMPTY)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    if not failed or m.mode == "lazy":  # else: left for verify to name and repair
        for path in lost:
            with suppress(FileNotFoundError):
                os.unlink(path)
    return dataclasses.replace(files, state=state)
