"""A cache's records of an archive source, found again: where its members file says they lie."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import SourceError
from ..probe import probe_size
from . import registry
from .member_table import HAS_CRC, read_member_table
from .members import (
    Address,
    MemberAddress,
    MemberGone,
    Members,
    member_file,
    open_archive,
    stat_key,
)

if TYPE_CHECKING:
    from ..format import CacheFiles
    from .listing import Listing

# A kind's test that the headers at a recorded place describe a record's member: ``(archive
# descriptor, the member's address, where its headers start, its record's source size and
# mtime) -> bool`` (``tar_headers.tar_holds``, ``zip_archive.zip_holds``).
Holds = Callable[[int, MemberAddress, int, int, int], bool]


class MemberFinder:
    """The addresses of a cache's members, found by listing the archive source the manifest
    records again, once, on the first record asked for: for a cache without a members file,
    or whose archive changed since it was written."""

    def __init__(self, source: dict) -> None:
        self.source = source
        self._found: Listing | None = None
        self._index: dict[str, int] = {}
        self._error = ""

    def ref(self, name: str, size: int, mtime_ns: int) -> Address:
        """Member ``name``'s address, or (a ``MemberGone``) why it is not the member listed with
        ``size`` and ``mtime_ns`` any more."""
        if self._found is None and not self._error:
            root = self.source.get("pattern") or self.source["root"]
            try:
                kind = registry.SOURCES[self.source["kind"]]
                self._found = kind.scan(root, self.source.get("label_key"), None)
            except SourceError as e:
                self._error = f"its archive cannot be listed any more ({e})"
            else:
                self._index = {p: i for i, p in enumerate(self._found.paths)}
        i = self._index.get(name)
        if self._found is None or i is None or not isinstance(self._found.members, Members):
            return MemberGone(self._error or "no longer in its archive")
        if (self._found.sizes[i], self._found.mtimes[i]) != (size, mtime_ns):
            return MemberGone("changed in its archive since it was listed")
        return self._found.members.ref(i)


class RecordedMembers:
    """``Members`` for the records of a cache: each read where the cache's members file says
    it lies, once its archive has the size and mtime recorded and the headers there describe
    it (``holds``: its kind's test); else (no members file, a changed archive) found by
    listing the archive again (``MemberFinder``)."""

    def __init__(self, files: CacheFiles, holds: Holds) -> None:
        self.files = files
        self._finder = MemberFinder(files.manifest.source)
        self._holds = holds
        self._table: np.ndarray | None = None
        self._read = False

    def ref(self, i: int) -> Address:
        """Record ``i``'s member's address, or (a ``MemberGone``) why it cannot be read.

        Raises:
            CacheFormatError: the members file is damaged, or places a member outside its
                archive (``member_table.read_member_table``).
        """
        r = self.files.index[i]
        name, size, mtime = self.files.path(i), int(r["source_size"]), int(r["source_mtime_ns"])
        found = self.recorded(i, name, size, mtime)
        return found if found is not None else self._finder.ref(name, size, mtime)

    def recorded(self, i: int, name: str, size: int, mtime_ns: int) -> MemberAddress | None:
        """Record ``i``'s member where the members file places it, read from its headers
        there; None when the cache has no such file, its archive changed since it was written,
        or the headers there do not describe the member (the archive is listed then)."""
        if not self._read:
            self._table, self._read = read_member_table(self.files), True
        members = self.files.manifest.members
        if self._table is None or members is None:
            return None
        e = self._table[i]
        archive, archive_size, archive_mtime = members["archives"][int(e["archive"])]
        crc = int(e["crc32"]) if int(e["flags"]) & HAS_CRC else -1
        ref = MemberAddress(archive, archive_size, archive_mtime, int(e["offset"]),
                            int(e["length"]), int(e["method"]), crc, name)  # fmt: skip
        try:
            fd = open_archive(archive)
        except OSError:
            return None
        try:
            same = stat_key(fd) == (archive_size, archive_mtime)
            start = ref.offset - int(e["header"])
            return ref if same and self._holds(fd, ref, start, size, mtime_ns) else None
        finally:
            os.close(fd)

    def probe(self, i: int, size: int, exif: bool = True) -> tuple[int, int] | None:
        """As ``Members.probe`` (``size`` unused: ``ref`` checks the member's recorded size)."""
        ref = self.ref(i)
        if isinstance(ref, MemberGone):
            return None
        with member_file(ref) as path:
            return None if path is None else probe_size(path, exif)
