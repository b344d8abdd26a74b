"""The node-local copy behind ``MemmapImageDataset(url)``: where it lives, and bringing it up to
date with the remote when the dataset is opened (a sparse copy, ``mmcache.remote.sparse``)."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

from ..errors import CacheError, RemoteError, StaleCacheWarning
from .sparse import sparse_copy
from .stores import locate

# Where copies go without ``local=``: $MMCACHE_LOCAL, else the user's cache folder.
LOCAL_ENV = "MMCACHE_LOCAL"


def default_local(url: str) -> Path:
    """``$MMCACHE_LOCAL/<url's digest>``, else ``$XDG_CACHE_HOME/mmcache/remote/<digest>``
    (``~/.cache/...``): one folder per URL, stable across runs."""
    digest = hashlib.sha256(locate(url).url.encode()).hexdigest()[:16]
    root = os.environ.get(LOCAL_ENV) or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "mmcache", "remote"
    )
    return Path(root) / digest


def up_to_date_copy(url: str, local: str | os.PathLike | None, on_stale: str) -> Path:
    """The local copy of the cache published at ``url``, sparse when first made (records are
    fetched as they are read): a copy of its latest generation, or with ``on_stale`` other than
    ``"refresh"`` an earlier copy as ``sparse_copy`` says.

    A store that cannot be reached leaves the local copy usable as it is: with ``on_stale``
    ``"warn"`` (a ``StaleCacheWarning``) or ``"ignore"``; ``"error"`` and ``"refresh"`` raise.

    Raises:
        RemoteError, CacheError: as ``pull_cache``, or no usable local copy.
    """
    folder = Path(local) if local is not None else default_local(url)
    try:
        sparse_copy(url, folder, on_stale)
    except RemoteError as e:
        if on_stale in ("error", "refresh") or not (folder / "manifest.json").exists():
            raise
        if on_stale == "warn":
            warnings.warn(
                f"{folder}: using the local copy as it is: {e}", StaleCacheWarning, stacklevel=3
            )
    except CacheError:
        raise
    return folder
