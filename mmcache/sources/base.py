"""What a source kind is: the ``Source`` protocol that every kind of source implements."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..format import CacheFiles
    from .listing import Listing
    from .recorded import RecordedMembers


class ImageReader(Protocol):
    """How a kind reads its samples itself, when they are files OpenCV does not decode (a
    folder of ``.npy`` arrays): ``Source.images``.

    The build's decode workers get it with each job, by pickle: it must be a module-level
    object, or an instance of a module-level class, of a module those processes can import by
    its name (they start as fresh interpreters, with the parent's ``sys.path``).
    """

    def size(self, path: str) -> tuple[int, int] | None:
        """The (height, width) of the sample at ``path``, from its header, without reading its
        pixels; None when the header does not say (the sample is then decoded before it is
        placed). Any exception counts as None."""
        ...

    def read(self, path: str) -> np.ndarray:
        """The sample at ``path``: an H x W x 3 uint8 image in RGB order, or H x W gray.

        Raises:
            Exception: any, when it cannot be read; its message is the record's skip reason.
        """
        ...


class Source(Protocol):
    """One kind of source: how it is recognised, listed, and found again from a cache.

    A kind's samples are read through ``Listing.abspath`` (a file's path, or an archive
    member's ``MemberAddress``) and decoded by OpenCV, or, for a kind with ``images``, by its
    own reader; what its build records for the quick staleness check is in the listing
    (``Listing.members`` for archives, the folders above its files when ``folder_stamps``).
    Register a new kind with ``registry.register``.
    """

    # The name a manifest records as ``source["kind"]``.
    kind: str
    # The manifest's ``source`` keys that hold paths (checked by ``format`` as paths).
    path_keys: tuple[str, ...]
    # Whether each sample is a file at its path under the root, read by its path (False: an
    # archive's member, found by ``recorded``).
    reads_files: bool
    # How its files are read into images, when OpenCV does not decode them (None: it does);
    # only for a kind that ``reads_files``. The build's workers, a lazy cache's fills, ``verify
    # --source`` and the layout's sizes all ask it.
    images: ImageReader | None
    # Whether the quick staleness check may stand on the mtimes of the folders above its files
    # (a file added, removed or renamed changes one); False: only a full scan sees a change (a
    # list file's files lie anywhere, an archive is stamped by its own size and mtime).
    folder_stamps: bool

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
