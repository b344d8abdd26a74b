"""A lazy cache's fill under kill -9 and under concurrent fillers and readers."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from _faults import (
    ENV,
    KILLS,
    SEED,
    Source,
    kill_when,
    popen,
)

from mmcache import (
    MemmapImageDataset,
    verify_cache,
)
from mmcache import format as fmt

# --- lazy fill ------------------------------------------------------------------------------

LAZY_FILLER = textwrap.dedent(
    """
    import os, pickle, sys
    import numpy as np
    from mmcache import MemmapImageDataset
    cache, src = sys.argv[1:3]
    if len(sys.argv) == 3:  # fill in order
        ds = MemmapImageDataset(cache, source=src, on_stale="ignore")
        for i in range(len(ds)):
            ds[i]
        sys.exit(0)
    # a reader: backwards, so that it reads records the others filled, checking each checksum
    # (from the shared state, as other processes write it) and the pixels
    with open(sys.argv[3], "rb") as f:
        refs = pickle.load(f)
    ds = MemmapImageDataset(cache, source=src, on_stale="ignore", verify="first-read")
    for i, (path, _) in reversed(list(enumerate(ds.samples))):
        if not np.array_equal(ds[i][0], refs[os.path.relpath(path, src)]):
            sys.exit(f"wrong pixels: {path}")
    """
)


def _filled_records_are_right(cache: Path, source: Source, version: str) -> int:
    """Every record a lazy cache says is FILLED holds the reference pixels; returns how many."""
    files = fmt.open_cache(cache)
    assert verify_cache(cache).ok
    data = np.fromfile(files.manifest.file("data"), np.uint8)
    filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
    for i in filled:
        r = files.index[i]
        n = int(r["height"]) * int(r["width"]) * int(r["channels"])
        img = data[int(r["offset"]) : int(r["offset"]) + n]
        assert np.array_equal(img, source.refs[version][files.path(int(i))].reshape(-1))
    return len(filled)


def _filled_count(cache: Path) -> int | None:
    """How many records a lazy cache's state file says are FILLED now (None: no cache yet)."""
    try:
        m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
        state = np.fromfile(cache / m["files"]["state"], fmt.STATE_DTYPE)
    except (FileNotFoundError, ValueError, KeyError):
        return None
    return int((state["state"] == fmt.FILLED).sum())


def test_kill_9_during_a_lazy_fill_leaves_a_partial_cache_that_resumes(source, tmp_path, tally):
    # MemmapImageDataset(cache, source=src) creates the lazy cache when it is missing.
    rng = np.random.default_rng(SEED + 2)
    cache = tmp_path / "cache"
    n = len(source.refs["A"])
    filled = []  # after each kill: how many records were FILLED, and how many at least
    for attempt in range(KILLS):
        # a point of the fill to kill it at: k records filled, some more than now (-1, the first
        # time: while the cache is being created, once its folder is there)
        now = _filled_count(cache) or 0
        k = -1 if attempt == 0 else now + int(rng.integers(0, max(n - now, 1)))
        proc = popen("-c", LAZY_FILLER, str(cache), str(source.roots["A"]))
        if k < 0:
            landed = kill_when(proc, cache.is_dir)
        else:
            landed = kill_when(proc, lambda k=k: (_filled_count(cache) or 0) >= k)
        if (cache / "manifest.json").exists():
            filled.append((_filled_records_are_right(cache, source, "A"), k if landed else n))
        tally["kills survived"] += landed
        tally["kills: lazy fill"] += landed
    assert len(filled) >= KILLS - 1  # after the first kill, the cache was there to kill
    # a fill killed at k records filled leaves at least k (a killed one never undoes a fill,
    # it loses at most the records being written), and no kill loses what earlier runs filled
    assert all(count >= at_least for count, at_least in filled), filled
    counts = [count for count, _ in filled]
    assert counts == sorted(counts), filled
    ds = MemmapImageDataset(cache, source=source.roots["A"], on_stale="ignore")
    for i, (path, _) in enumerate(ds.samples):
        assert np.array_equal(ds[i][0], source.refs["A"][os.path.relpath(path, source.roots["A"])])
    assert _filled_records_are_right(cache, source, "A") == len(ds)


def test_four_processes_filling_and_reading_one_lazy_cache(source, tmp_path, tally):
    # Each creates the cache if it is missing (one does, under the lock; the others find it
    # current), then two fill it in order while two read it backwards with verify="first-read".
    cache, refs_file = tmp_path / "cache", tmp_path / "refs.pkl"
    with open(refs_file, "wb") as f:
        pickle.dump(source.refs["A"], f)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LAZY_FILLER, str(cache), str(source.roots["A"]), *extra],
            stderr=subprocess.PIPE,
            env=ENV,
        )
        for extra in ([], [str(refs_file)], [], [str(refs_file)])
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    assert _filled_records_are_right(cache, source, "A") == len(source.refs["A"])
    tally["concurrent fills verified"] += 4
