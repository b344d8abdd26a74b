"""The one table of source kinds, by name: which kind a source is, and scanning it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Source
    from .listing import Listing

# Every kind by its manifest name, in the order ``detect`` asks them: the kinds registered from
# outside first, then the archive kinds, then a list file, then a folder (which claims the rest).
SOURCES: dict[str, Source] = {}


def register(source: Source, *, first: bool = True) -> None:
    """Add ``source`` to the table under ``source.kind``; ``first``: asked before the kinds
    already there (a new kind must claim its sources before the folder kind claims them all)."""
    others = {k: s for k, s in SOURCES.items() if k != source.kind}
    SOURCES.clear()
    SOURCES.update({source.kind: source, **others} if first else {**others, source.kind: source})


def unregister(kind: str) -> None:
    """Remove kind ``kind`` from the table (a test's own kind, once done)."""
    SOURCES.pop(kind, None)


def detect(source: str | os.PathLike, label_key: str | None) -> Source:
    """The first kind that claims ``source``."""
    return next(s for s in SOURCES.values() if s.claims(source, label_key))


def scan(source: str | os.PathLike, label_key: str | None, max_entries: int | None) -> Listing:
    """The listing of ``source``, by the kind that claims it (see ``Source.scan``)."""
    return detect(source, label_key).scan(source, label_key, max_entries)


def source_exists(source: str) -> bool:
    """Whether the source a cache records is there (a path, or a pattern of shards)."""
    return any(s.exists(source) for s in SOURCES.values())
