"""The exceptions mmcache raises: one hierarchy rooted at ``CacheError``.

Each subclass also inherits the built-in exception a caller would catch anyway
(``FileNotFoundError``, ``ValueError``, ...), so ``except ValueError`` keeps working.
Every class is built from a single message string, so instances pickle and cross
DataLoader worker boundaries intact (a multi-argument ``__init__`` would not).
"""

from __future__ import annotations

__all__ = [
    "BadImageWarning",
    "CacheError",
    "CacheFormatError",
    "CacheNotFoundError",
    "CacheStaleError",
    "DecodeError",
    "DecodeWorkerError",
    "DestinationError",
    "DistributedBuildError",
    "InsufficientSpaceError",
    "MixedShapesError",
    "NotACacheError",
    "OptionsChangedError",
    "RemoteAccessError",
    "RemoteError",
    "SourceChangedError",
    "SourceError",
    "StaleCacheWarning",
    "StateMismatchError",
    "StrictBuildError",
    "UnsafeCacheError",
]


class CacheError(Exception):
    """Base class of every error mmcache raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):
        # One-argument reconstruction: survives pickling across worker processes.
        return (type(self), (str(self),))


class CacheNotFoundError(CacheError, FileNotFoundError):
    """The cache path does not exist or holds no finished cache."""


class CacheFormatError(CacheError, ValueError):
    """A cache on disk is damaged, truncated, or of an unknown format version."""


class NotACacheError(CacheError, FileExistsError):
    """A path that is not an mmcache cache stands where a cache would be written."""


class CacheStaleError(CacheError, RuntimeError):
    """The cache no longer matches its source, options or decoder."""


class SourceError(CacheError, FileNotFoundError):
    """The source folder or list is missing, empty, or holds no images."""


class DecodeError(CacheError, ValueError):
    """An image could not be decoded (or was refused) as the build asked."""


class StrictBuildError(CacheError, RuntimeError):
    """A ``strict`` build met files it could not decode."""


class InsufficientSpaceError(CacheError, OSError):
    """The destination filesystem lacks the space the cache needs."""


class DestinationError(CacheError, OSError):
    """The cache cannot be written where it was asked to be (permissions, a file in the way)."""


class UnsafeCacheError(CacheError, PermissionError):
    """A cache's file or folder that mmcache will not trust: a link, a file with other names,
    a special file, another user's folder, or a source it was not given."""


class DistributedBuildError(CacheError, RuntimeError):
    """A rank of a distributed build failed, died or timed out; nothing was published."""


class OptionsChangedError(CacheError, ValueError):
    """A build asked for other preprocessing options than the cache there was made with."""


class SourceChangedError(CacheError, ValueError):
    """A build named another source folder or list than the cache there was made from."""


class DecodeWorkerError(CacheError, RuntimeError):
    """The build's decode worker processes could not run (they die at start, or on every file)."""


class StaleCacheWarning(UserWarning):
    """A cache opened with ``on_stale="warn"`` no longer matches its source or decoder."""


class MixedShapesError(CacheError, ValueError):
    """A batch of equal-shaped images was asked of a cache whose records differ in shape."""


class StateMismatchError(CacheError, ValueError):
    """A saved loader or sampler state is of another run (another seed, dataset or order), or
    records no dataset or order to check it by."""


class BadImageWarning(UserWarning):
    """A dataset with ``on_bad="substitute"`` returned another image in place of a bad one."""


class RemoteError(CacheError, ConnectionError):
    """An object store that could not be reached or read, for longer than the retries allow;
    or a URL that names no store mmcache can use."""


class RemoteAccessError(RemoteError, PermissionError):
    """An object store that refused the credentials, or access to the bucket."""
