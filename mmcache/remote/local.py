"""The ``file://`` engine: objects as files under a local (or mounted) folder.

For a shared filesystem without S3, and for trying push and pull without a server. An object is
written to a temporary name and renamed, so a reader never sees half an object.
"""

from __future__ import annotations

import os
import secrets
from contextlib import suppress
from pathlib import Path

from ..errors import RemoteError
from .stores import Location


class LocalStore:
    """Objects as files under ``file:///folder``."""

    def __init__(self, where: Location, retry_seconds: float | None) -> None:
        self.url = where.url
        self.retry_seconds = retry_seconds
        self.folder = Path(where.prefix)

    def _path(self, key: str) -> Path:
        return self.folder / key

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                data = f.read(-1 if end is None else end - start)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RemoteError(f"{self.url}/{key}: cannot read ({e.strerror})") from None
        return data

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.tmp{secrets.token_hex(4)}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            with suppress(OSError):
                os.unlink(tmp)
            raise RemoteError(f"{self.url}/{key}: cannot write ({e.strerror})") from None

    def sizes(self) -> dict[str, int]:
        found = {}
        for root, _, files in os.walk(self.folder):
            for name in files:
                if not name.startswith("."):
                    p = Path(root) / name
                    found[p.relative_to(self.folder).as_posix()] = p.stat().st_size
        return found

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            with suppress(FileNotFoundError):
                os.unlink(self._path(key))
