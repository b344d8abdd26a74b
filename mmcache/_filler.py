"""Filling a lazy cache: one record decoded on its first read and stored in place.

A record is filled by decoding its file, writing the pixels with ``pwrite``, then writing its
8-byte state ``(crc32, FILLED)`` with ``pwrite``. Readers look at the state first, so a record
that reads ``FILLED`` is complete, and a process killed between the two writes leaves it
``EMPTY``, to be decoded again by the next reader. Processes filling the same record at once
write the same bytes, so no lock is taken.
"""

from __future__ import annotations

import os

import numpy as np

from . import format as fmt
from . import pixels as px
from ._archives import ARCHIVE_KINDS, MemberFinder, decode_member
from ._files import write_pixels, write_state
from .annotations import MASK_PATH, MASK_STAT
from .decode import Options, decode_record
from .errors import CacheFormatError, DestinationError
from .scan import IMAGE_EXTENSIONS
from .space import disk_full_error


class RecordFiller:
    """Fills the records of one lazy cache generation in place; one per process."""

    def __init__(self, files: fmt.CacheFiles) -> None:
        m = files.manifest
        self.files = files
        self.root = str(m.source.get("root", ""))
        # An archive's members are found by listing it again (their offsets are not recorded).
        archive = m.source.get("kind") in ARCHIVE_KINDS
        self.members = MemberFinder(m.source, IMAGE_EXTENSIONS) if archive else None
        try:
            self.options = Options.from_json(m.options)
        except (TypeError, ValueError) as e:
            raise CacheFormatError(f"{m.path}: bad options in the manifest ({e})") from None
        self.fds: list[int] = []
        try:
            for kind in ("data", "state"):
                self.fds.append(os.open(m.file(kind), os.O_WRONLY))
        except OSError as e:
            self.close()
            raise DestinationError(
                f"{m.file(kind)}: cannot fill the lazy cache ({e.strerror}); records are stored "
                "where the cache lies, so its user must be able to write there"
            ) from None

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
        if self.members is None:
            code, crc, _, pixels = decode_record(
                os.path.join(self.root, rel), size, mtime, self.options, mask=self.mask_file(i)
            )
        else:
            ref = self.members.ref(rel, size, mtime)
            code, crc, _, pixels = decode_member(ref, size, mtime, self.options)
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

    def mask_file(self, i: int) -> tuple[str, int, int] | None:
        """Record ``i``'s mask ``(path, size, mtime_ns)`` as recorded, if records carry masks.

        Raises:
            CacheFormatError: the recorded mask path could lead outside the masks folder.
        """
        files = self.files
        root = files.manifest.source.get("masks")
        if self.options.mask is None or not root or MASK_PATH not in files.fields:
            return None
        rel = files.field_rows(MASK_PATH, i).tobytes().decode("utf-8", "surrogateescape")
        if fmt.check_relative_path(rel) is not None:
            raise CacheFormatError(f"{files.manifest.path}: unsafe mask path {rel!r}")
        size, mtime = (int(v) for v in files.field_rows(MASK_STAT, i).reshape(2))
        return os.path.join(root, rel), size, mtime

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def __del__(self) -> None:
        self.close()
