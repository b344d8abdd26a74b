"""The ``fields`` file of per-record arrays: its descriptions' checks, and reading it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ._checks import check_names, expect, first_bad, is_int

# The dtypes a field may have: little-endian integers and floats.
FIELD_DTYPES = ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f4", "<f8")
# Bounds on a field's description: its name, its dimensions, the values of one row.
MAX_FIELD_NAME = 64
MAX_FIELD_DIMS = 4
MAX_ROW_VALUES = 1 << 20


def check_fields(fields: Any, mpath: Path, max_name: int) -> list[dict[str, Any]]:
    """The descriptions of the ``fields`` file's arrays (``mmcache.format``'s spec)."""
    expect(isinstance(fields, list), mpath, "fields must be a list")
    names = set()
    for f in fields:
        expect(isinstance(f, dict) and set(f) <= {"name", "dtype", "shape", "classes"}, mpath,
               "a field must be {name, dtype, shape[, classes]}")  # fmt: skip
        name, shape = f.get("name"), f.get("shape")
        expect(
            isinstance(name, str)
            and 0 < len(name) <= MAX_FIELD_NAME
            and name.isascii()
            and name.replace("_", "a").isalnum()
            and name not in names,
            mpath,
            f"field name {name!r} is not unique letters, digits and _",
        )
        names.add(name)
        expect(f.get("dtype") in FIELD_DTYPES, mpath, f"field {name}: unknown dtype")
        expect(
            isinstance(shape, list)
            and 1 <= len(shape) <= MAX_FIELD_DIMS
            and is_int(shape[0], -1, 1 << 20)
            and all(is_int(v, 1, MAX_ROW_VALUES) for v in shape[1:])
            and int(np.prod(shape[1:])) <= MAX_ROW_VALUES,
            mpath,
            f"field {name}: shape must be [rows or -1, *tail] of positive sizes",
        )
        if "classes" in f:
            check_names(f["classes"], mpath, max_name)
    return fields


def field_row_dtype(spec: dict[str, Any]) -> np.dtype:
    """The dtype of one row of a field (``shape[1:]`` values of its ``dtype``)."""
    return np.dtype((np.dtype(spec["dtype"]), tuple(spec["shape"][1:])))


def read_fields(
    specs: list[dict[str, Any]], blob: bytes, n: int, where: Path
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The arrays of a ``fields`` file's content (``where``, of ``n`` records), checked against
    the manifest's descriptions (``mmcache.format``'s spec): row numbers in order and within the
    file, fixed counts, nothing left over.

    Raises:
        CacheFormatError: naming the field and what is wrong.
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    pos = 0
    for spec in specs:
        name = spec["name"]
        row = field_row_dtype(spec)
        expect(len(blob) - pos >= 8 * (n + 1), where, f"field {name}: cut short")
        starts = np.frombuffer(blob, "<u8", n + 1, pos).astype(np.int64)
        pos += 8 * (n + 1)
        expect(starts[0] == 0 and bool((np.diff(starts) >= 0).all()), where,
               f"field {name}: row numbers out of order")  # fmt: skip
        total = int(starts[-1])
        expect(total <= (len(blob) - pos) // max(row.itemsize, 1), where,
               f"field {name}: more rows than the file holds")  # fmt: skip
        rows_wanted = spec["shape"][0]
        if rows_wanted >= 0:
            wrong = np.diff(starts) != rows_wanted
            first_bad(wrong, where, f"field {name}: not {rows_wanted} rows")
        rows = np.frombuffer(blob, row.base, total * int(np.prod(row.shape or (1,))), pos)
        out[name] = starts, rows.reshape(total, *row.shape)
        pos += -(-total * row.itemsize // 8) * 8
    expect(pos == len(blob), where, f"{len(blob) - pos} bytes more than its fields hold")
    return out
