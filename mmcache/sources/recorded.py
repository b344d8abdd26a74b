"""A cache's records of an archive source, found again in their archive by listing it once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import SourceError
from ..probe import probe_size
from . import registry
from .members import Address, MemberGone, Members, member_file

if TYPE_CHECKING:
    from .listing import Listing


class MemberFinder:
    """The addresses of a cache's members, for filling its records lazily, verifying them
    against their source or repairing them: the archive source the manifest records is listed
    again, once, on the first record asked for (member offsets are not recorded)."""

    def __init__(self, source: dict, images: tuple[str, ...]) -> None:
        self.source, self.images = source, images
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

    def ref(self, i: int) -> Address:
        return self._finder.ref(self._names[i], int(self._sizes[i]), int(self._mtimes[i]))

    def probe(self, i: int, size: int, exif: bool = True) -> tuple[int, int] | None:
        """As ``Members.probe`` (``size`` unused: ``ref`` checks the member's recorded size)."""
        ref = self.ref(i)
        if isinstance(ref, MemberGone):
            return None
        with member_file(ref) as path:
            return None if path is None else probe_size(path, exif)

