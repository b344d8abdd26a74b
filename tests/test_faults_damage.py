"""Damaged files (truncated, extended, bit flips): refused at open or found by verify,
never served wrong."""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from _faults import (
    FLIPS,
    LONG,
    SEED,
    cache_file,
    copy_pristine,
    open_and_read_all,
)

from mmcache import (
    CacheFormatError,
    DecodeError,
    MemmapImageDataset,
    verify_cache,
)
from mmcache import format as fmt

DAMAGES = ("empty", "truncate 1", "truncate half", "extend zeros", "extend junk", "extend ws")
# Harmless: a data file longer than recorded, and whitespace after the manifest's JSON object.
HARMLESS = {("data", "extend zeros"), ("data", "extend junk"), ("data", "extend ws")}
HARMLESS.add(("manifest", "extend ws"))
# (kind, damage, outcome): "open" is refused at open; "served" opens and serves the right pixels
TRUNCATE_EXTEND = [
    (kind, damage, "served" if (kind, damage) in HARMLESS else "open")
    for kind in ("manifest", "index", "state", "paths", "data")
    for damage in DAMAGES
]


@pytest.mark.parametrize(("kind", "damage", "outcome"), TRUNCATE_EXTEND)
def test_a_truncated_or_extended_file(pristine, tmp_path, tally, kind, damage, outcome):
    cache = copy_pristine(pristine, tmp_path / "c")
    good = open_and_read_all(pristine)
    path = cache_file(cache, kind)
    size = path.stat().st_size
    if damage.startswith(("empty", "truncate")):
        os.truncate(path, {"empty": 0, "truncate 1": size - 1, "truncate half": size // 2}[damage])
    else:
        tail = {"extend zeros": bytes(100), "extend junk": b"\xff{}junk", "extend ws": b" \n\n"}
        with open(path, "ab") as f:
            f.write(tail[damage])
    if outcome == "open":
        with pytest.raises(CacheFormatError):
            MemmapImageDataset(cache, on_stale="ignore")
        with pytest.raises(CacheFormatError):
            verify_cache(cache)
        tally["corruptions detected"] += 1
    else:
        got = open_and_read_all(cache)
        assert all(np.array_equal(a, b) for a, b in zip(got, good, strict=True))
        assert verify_cache(cache).ok
    tally["damaged caches tried"] += 1


def _positions(path: Path, kind: str, rng) -> list[int]:
    size = path.stat().st_size
    if LONG and kind != "data":
        return list(range(size))  # every byte (one bit each) of the small metadata files
    return sorted(rng.choice(size, min(FLIPS, size), replace=False).tolist())


@pytest.mark.parametrize("kind", ["manifest", "index", "state", "paths", "data"])
def test_bit_flips_are_refused_at_open_or_found_by_verify(pristine, tmp_path, tally, kind):
    # zlib.crc32, not hash(): str hashes differ between runs, so the flips would not repeat
    rng = np.random.default_rng(SEED + zlib.crc32(kind.encode()) % 1000)
    files = fmt.open_cache(pristine)
    good = open_and_read_all(pristine)
    offsets = files.index["offset"].astype(int)
    sizes = [int(r["height"]) * int(r["width"]) * int(r["channels"]) for r in files.index]
    cache = copy_pristine(pristine, tmp_path / "c")
    path = cache_file(cache, kind)
    original = path.read_bytes()
    for pos in _positions(path, kind, rng):
        bit = int(rng.integers(8))
        damaged = bytearray(original)
        damaged[pos] ^= 1 << bit
        path.write_bytes(bytes(damaged))
        if kind in ("manifest", "index", "paths"):
            # the checksums of manifest, index and paths catch every single flipped bit
            with pytest.raises(CacheFormatError):
                MemmapImageDataset(cache, on_stale="ignore")
            tally["corruptions detected"] += 1
        elif kind == "state" and pos % fmt.STATE_DTYPE.itemsize >= 4:
            # the state word of a built cache is FILLED: EMPTY or unknown codes are refused at
            # open; a BAD_* code is named by verify, and reading the record raises
            i = pos // fmt.STATE_DTYPE.itemsize
            code = int.from_bytes(damaged[i * 8 + 4 : i * 8 + 8], "little")
            if code in fmt.BAD_REASONS:
                assert [b.index for b in verify_cache(cache).bad] == [i]
                named = f"{re.escape(files.path(i))}: {re.escape(fmt.BAD_REASONS[code])}"
                with pytest.raises(DecodeError, match=named):
                    MemmapImageDataset(cache, on_stale="ignore")[i]
            else:
                with pytest.raises(CacheFormatError, match="state"):
                    MemmapImageDataset(cache, on_stale="ignore")
            tally["corruptions detected"] += 1
        else:
            # a flipped stored CRC, or flipped pixels: the record is named by verify and by
            # verify="first-read"; a flip between records harms nothing that is served
            if kind == "state":
                hit = [pos // fmt.STATE_DTYPE.itemsize]
            else:
                spans = enumerate(zip(offsets, sizes, strict=True))
                hit = [i for i, (o, n) in spans if o <= pos < o + n]
            assert [b.index for b in verify_cache(cache).bad] == hit
            ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
            for i in range(len(ds)):
                if i in hit:
                    with pytest.raises(CacheFormatError, match=f"record {i} "):
                        ds[i]
                else:
                    assert np.array_equal(ds[i][0], good[i])
            tally["corruptions detected" if hit else "harmless flips (between records)"] += 1
        tally["bit flips tried"] += 1
    path.write_bytes(original)
