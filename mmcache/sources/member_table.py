"""A cache's members file: where each record's bytes lie in its archive, written and read back.

The build writes it beside the index (``members-<generation>.bin``, see ``mmcache.format``) from
the listing's ``Members``, so that a lazy fill, ``verify --source`` and a repair find a record's
member without listing the archive again (``recorded``). A repair, a compaction and a copy,
which publish the same records in a new generation, write the same table under its name.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .. import format as fmt
from .._checks import expect, fail, first_bad
from .._opening import create_exclusively, read_whole
from .members import Members

# ``flags`` bit 0: ``crc32`` holds the member's CRC-32 (a zip's), checked once it is read.
HAS_CRC = 1


def write_member_table(
    folder: Path, generation: str, members: object, keep: np.ndarray
) -> dict[str, Any] | None:
    """Write ``generation``'s members file for the listed members ``keep`` (the generation's
    records, in order) and flush it; returns the manifest's ``members`` entry. None when
    ``members`` is not a listing's ``Members`` (files of a folder, a cache's own records)."""
    if not isinstance(members, Members):
        return None
    k = np.asarray(keep, np.int64)
    span = members.offset[k] - members.header[k]
    if len(k) and not (span.min() >= 1 and span.max() < (1 << 32)):
        return None  # (headers the scan never reads: the members are listed again)
    table = np.zeros(len(k), fmt.MEMBER_DTYPE)
    table["offset"], table["length"] = members.offset[k], members.length[k]
    table["archive"], table["header"] = members.archive[k], span
    crc = members.crc[k]
    table["crc32"] = np.where(crc >= 0, crc, 0)
    table["flags"] = np.where(crc >= 0, HAS_CRC, 0)
    table["method"] = members.method[k]
    stats = [[a, int(st[0]), int(st[1])] for a, st in zip(members.archives, members.stats)]
    return _write(folder, generation, table.tobytes(), stats)


def carry_member_table(m: fmt.Manifest, folder: Path, generation: str) -> dict[str, Any] | None:
    """The ``members`` entry of a new generation in ``folder`` that holds ``m``'s records in
    their order (a repair, a compaction, a copy): ``m``'s members file, checked, written again
    under ``generation``'s name. None when ``m`` has none.

    Raises:
        CacheFormatError: ``m``'s members file is missing or damaged.
    """
    if m.members is None:
        return None
    return _write(folder, generation, _checked_bytes(m), m.members["archives"])


def read_member_table(files: fmt.CacheFiles) -> np.ndarray | None:
    """The members file of ``files``' generation (None: it has none), checked: its size and
    CRC-32, each record within its archive as recorded, and a stored member as long as its
    record's source file. Nothing in it is read from an archive before this check.

    Raises:
        CacheFormatError: one line, naming the file, the first bad record and the fix.
    """
    m = files.manifest
    if m.members is None:
        return None
    path = m.file(fmt.MEMBERS_KIND)
    table = np.frombuffer(_checked_bytes(m), fmt.MEMBER_DTYPE)
    archives = m.members["archives"]
    which = table["archive"].astype(np.int64)
    first_bad(which >= len(archives), path, "its archive is not one of the manifest's")
    limit = np.array([a[1] for a in archives], np.uint64)[which] if len(table) else which
    offset, length = table["offset"], table["length"]
    # Exact unsigned arithmetic, as for the data file's records: offset + length <= size.
    first_bad(
        (offset > limit) | (length > limit - np.minimum(offset, limit)),
        path,
        "its member lies outside its archive as recorded (the file was damaged or made to "
        "mislead); rebuild the cache",
    )
    first_bad((table["header"] == 0) | (table["header"] > offset), path,
              "its member's headers lie outside its archive")  # fmt: skip
    first_bad(~np.isin(table["method"], (0, 8)), path, "unknown compression method")
    first_bad(table["flags"] > HAS_CRC, path, "reserved flags set")
    first_bad(
        (table["method"] == 0) & (length != files.index["source_size"]),
        path,
        "a stored member's length is not its source file's size",
    )
    return table


def _checked_bytes(m: fmt.Manifest) -> bytes:
    """The content of ``m``'s members file, of the size and CRC-32 its manifest records."""
    assert m.members is not None
    path, size = m.file(fmt.MEMBERS_KIND), m.members["size"]
    try:
        blob = read_whole(path, size + 1)
    except FileNotFoundError:
        raise fail(path, "missing (the cache was rebuilt, or is damaged)") from None
    got = f"{len(blob):,}{'+' if len(blob) > size else ''}"
    damaged = "the file is damaged; rebuild the cache"
    expect(len(blob) == size, path, f"is {got} bytes, the manifest says {size:,}: {damaged}")
    crc, recorded = zlib.crc32(blob), m.members["crc32"]
    expect(
        crc == recorded,
        path,
        f"checksum mismatch (CRC-32 {crc:08x}, the manifest says {recorded:08x}): {damaged}",
    )
    return blob


def _write(folder: Path, generation: str, blob: bytes, archives: list) -> dict[str, Any]:
    """Write and flush the members file ``blob`` of ``generation``; its manifest entry."""
    name = fmt.file_name(fmt.MEMBERS_KIND, generation)
    with os.fdopen(create_exclusively(folder / name), "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return {
        "file": name,
        "size": len(blob),
        "crc32": zlib.crc32(blob),
        "dtype": fmt.dtype_descr(fmt.MEMBER_DTYPE),
        "archives": archives,
    }
