"""Checks of values read from a cache's files; each failure a CacheFormatError naming the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ._opening import open_for_reading
from .errors import CacheFormatError


def is_hex(s: str) -> bool:
    """Only lower-case hexadecimal digits (a generation id's)."""
    return all(c in "0123456789abcdef" for c in s)


def fail(path: Path, what: str) -> CacheFormatError:
    """The error that says what is wrong with ``path``."""
    return CacheFormatError(f"{path}: {what}")


def expect(cond: bool, path: Path, what: str) -> None:
    """Raise ``fail(path, what)`` unless ``cond``."""
    if not cond:
        raise fail(path, what)


def is_int(v: Any, lo: int, hi: int) -> bool:
    """An int (not a bool) in ``lo..hi-1``."""
    return type(v) is int and lo <= v < hi


def is_name(v: Any, limit: int) -> bool:
    """A non-empty string of at most ``limit`` characters, without NUL."""
    return isinstance(v, str) and 0 < len(v) <= limit and "\x00" not in v


def expect_written(path: Path, size: int) -> None:
    """``path``'s first ``size`` bytes are on disk, not a hole: a file a writer wrote whole
    (index, paths) that is sparse was forged to make us allocate what it does not hold (a
    cache declaring 50 M records in a few KB), and is refused before it is read."""
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None or size == 0:
        return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        hole = os.lseek(fd, 0, seek_hole)
    except OSError:
        return  # a file system that cannot tell: the reads that follow check what they can
    finally:
        os.close(fd)
    expect(hole >= size, path, f"a sparse file: its bytes from {hole:,} on were never written, "
           f"yet the manifest says it holds {size:,}; it was not written by mmcache")  # fmt: skip


def read_exactly(path: Path, size: int) -> bytearray:
    """``size`` bytes of ``path``; a file that shrank since it was measured is an error."""
    buf = bytearray(size)
    with os.fdopen(open_for_reading(path), "rb") as f:
        got = f.readinto(buf)
    expect(got == size, path, f"read {got} bytes, expected {size}: the file changed while read")
    return buf


def validate_paths(index: np.ndarray, blob: bytes, where: Path, max_length: int) -> None:
    """Paths tile the paths file in order, each 1..``max_length`` bytes, and none can name a
    file outside the source root."""
    start = index["path_offset"]
    length = index["path_length"].astype(np.uint64)
    first_bad(
        (length < 1) | (length > max_length), where, f"path length outside 1..{max_length} bytes"
    )
    expected = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.uint64)
    first_bad(start != expected, where, "paths do not follow each other in the paths file")
    expect(
        int(start[-1]) + int(length[-1]) == len(blob),
        where,
        f"paths end at {int(start[-1]) + int(length[-1])}, the paths file has {len(blob)} bytes",
    )
    # check_relative_path on 1.28M paths takes ~1.5 s; instead find the few records that could
    # fail it with whole-blob searches (~10 ms), and check those exactly.
    arr = np.frombuffer(blob, np.uint8)
    first, last = arr[start.astype(np.int64)], arr[(start + length - 1).astype(np.int64)]
    suspect = np.isin(first, np.frombuffer(b"/.", np.uint8)) | np.isin(
        last, np.frombuffer(b"/.", np.uint8)
    )
    for pattern in (b"\x00", b"\\", b"//", b"/./", b"/../"):
        pos = blob.find(pattern)
        while pos >= 0:
            suspect[np.searchsorted(start, pos, side="right") - 1] = True
            pos = blob.find(pattern, pos + 1)
    for i in np.flatnonzero(suspect):
        a = int(start[i])
        rel = blob[a : a + int(length[i])].decode("utf-8", "surrogateescape")
        why = check_relative_path(rel)
        if why is not None:
            raise fail(where, f"record {i}: stored path {rel!r} is unsafe: {why}")


def first_bad(mask: np.ndarray, where: Path, what: str) -> None:
    """Raise naming the first record ``mask`` marks, and how many it marks."""
    if mask.any():
        i = int(np.flatnonzero(mask)[0])
        raise fail(where, f"record {i}: {what} ({int(mask.sum())} such records)")


def check_relative_path(rel: str) -> str | None:
    """Why a stored source path is unsafe (absolute, escaping the root), or None if it is fine."""
    if not rel or "\x00" in rel:
        return "empty or contains NUL"
    if rel.startswith("/") or "\\" in rel:
        return "absolute or with backslashes"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "contains '.', '..' or an empty part"
    return None


def check_names(names: Any, path: Path, max_length: int) -> list[str]:
    """A list of distinct names (class names), each ``is_name``."""
    expect(
        isinstance(names, list) and all(is_name(c, max_length) for c in names),
        path,
        f"classes must be a list of non-empty strings without NUL, at most {max_length} long",
    )
    expect(len(set(names)) == len(names), path, "class names repeat")
    return names
