"""Caches in object storage: publishing a cache under a prefix (push) and copying it back (pull).

``stores`` says what a store is and which engine serves each URL scheme; ``published`` is the
layout of a published cache; ``push`` and ``pull`` move it. Every engine library is optional.
"""

from __future__ import annotations

from pathlib import Path

from ..reports import RemoteInfo
from .published import read_published
from .pull import pull_cache
from .push import push_cache
from .stores import Store, is_remote, open_store

__all__ = ["Store", "is_remote", "open_store", "pull_cache", "push_cache", "remote_info"]


def remote_info(url: str) -> RemoteInfo:
    """What is published under ``url``, from its ``remote.json`` alone.

    Raises:
        CacheNotFoundError, CacheFormatError, RemoteError: as ``pull_cache``.
    """
    p = read_published(open_store(url), Path("/nonexistent"))  # (no local files are read)
    m = p.manifest
    return RemoteInfo(
        url=p.store.url,
        format_version=m.format_version,
        generation=m.generation,
        mode=m.mode,
        images=m.count,
        classes=m.classes,
        skipped=len(m.skipped),
        bytes=sum(m.sizes.values()),
        chunks=len(p.chunks),
        chunk_bytes=p.chunk_bytes,
        options=m.options,
        source=m.source,
    )
