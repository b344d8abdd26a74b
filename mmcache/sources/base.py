"""What a source kind is: the ``Source`` protocol that every kind of source implements."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..format import CacheFiles
    from .listing import Listing
    from .recorded import RecordedMembers


class Source(Protocol):
    """One kind of source: how it is recognised, listed, and found again from a cache.

    A kind's samples are read through ``Listing.abspath`` (a file's path, or an archive
    member's ``MemberAddress``); what its build records for the quick staleness check is in the
    listing (``Listing.members`` for archives). Register a new kind with ``registry.register``.
    """

    # The name a manifest records as ``source["kind"]``.
    kind: str
    # The manifest's ``source`` keys that hold paths (checked by ``format`` as paths).
    path_keys: tuple[str, ...]
    # Whether each sample is a file at its path under the root, read by its path (False: an
    # archive's member, found by ``recorded``).
    reads_files: bool

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        """Whether ``source``, as given to ``scan_source``, is of this kind."""
        ...

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        """The listing of ``source`` (``max_entries``: as ``scan.scan_within``).

        Raises:
            SourceError: the source is missing, unreadable or malformed.
        """
        ...

    def recorded(self, files: CacheFiles) -> RecordedMembers | None:
        """Where the records of ``files``, a cache built from this kind, find their bytes
        (None: each is a file at its path under the recorded root): where the cache's members
        file places them, or in a new listing of the source."""
        ...

    def exists(self, root: str) -> bool:
        """Whether the source a manifest records as ``root`` (or ``pattern``) is there."""
        ...
