"""Caches in object storage: publishing a cache under a prefix (push) and copying it back (pull).

``stores`` says what a store is and which engine serves each URL scheme; ``published`` is the
layout of a published cache; ``push`` and ``pull`` move it. Every engine library is optional.
"""

from __future__ import annotations

from .pull import pull_cache
from .push import push_cache
from .stores import Store, is_remote, open_store

__all__ = ["Store", "is_remote", "open_store", "pull_cache", "push_cache"]
