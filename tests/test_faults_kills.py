"""kill -9 during a build, a refresh and a compaction: no cache, the old one or the new,
never a wrong one.

The fault tests are tests/test_faults_*.py, sharing tests/_faults.py. Quick by default;
``MMCACHE_FAULTS=long`` runs many more kills, flips and fuzzed inputs. With
``MMCACHE_FAULTS_REPORT=file.json`` the session writes what it counted there (kills survived,
corruptions detected, inputs fuzzed): ``tools/reliability.py`` runs them all and prints the figures.
"""

from __future__ import annotations

import os
import shutil
from collections import Counter

import numpy as np
from _faults import (
    KILLS,
    SEED,
    bins,
    build_cmd,
    build_once,
    build_point,
    kill_when,
    popen,
    served_by,
)

from mmcache import (
    build_cache,
)
from mmcache import format as fmt
from mmcache._generation import garbage_bytes

# --- kill -9 ----------------------------------------------------------------------------------


def test_kill_9_during_a_first_build_leaves_no_cache_or_a_whole_one(source, tmp_path, tally):
    rng = np.random.default_rng(SEED)
    cache = tmp_path / "cache"
    kills = 0
    for _ in range(3 * KILLS):  # until KILLS kills landed while the build ran
        point = build_point(rng, cache)
        proc = popen(*build_cmd(source.roots["A"], cache, int(rng.integers(1, 3))))
        kills += kill_when(proc, point)
        served_by(cache, source, {None, "A"})
        if cache.is_dir() and (cache / "manifest.json").exists():
            shutil.rmtree(cache)  # next time, a first build again (leftovers of kills stay)
        if kills == KILLS:
            break
    assert kills == KILLS
    tally["kills survived"] += kills
    tally["kills: build"] += kills
    # what the killed builds left, the next build clears
    build_cache(source.roots["A"], cache, workers=1)
    assert served_by(cache, source, {"A"}) == "A"
    m = fmt.read_manifest(cache)
    assert bins(cache) == sorted(["manifest.json", *(m.file(k).name for k in fmt.FILE_KINDS)])


def test_kill_9_during_a_refresh_leaves_the_old_cache_or_the_new(source, tmp_path, tally):
    """Half the kills land in refreshes that append to the data file the previous generation
    reads (--compact-at 1), half in refreshes that write a compact one (--compact-at 0)."""
    rng = np.random.default_rng(SEED + 1)
    cache = tmp_path / "cache"
    build_once(source.roots["A"], cache)
    build_once(source.roots["B"], cache)  # a refresh: reuses, decodes, drops
    current = "B"
    quota = {"appending": KILLS // 2, "compacting": KILLS - KILLS // 2}
    kills: Counter = Counter()
    for attempt in range(3 * KILLS):  # until KILLS kills landed while the refresh ran
        needed = [k for k in quota if kills[k] < quota[k]]
        kind = needed[attempt % len(needed)]
        target = "A" if current == "B" else "B"
        data = fmt.read_manifest(cache).file("data")
        point = build_point(rng, cache)
        cmd = build_cmd(source.roots[target], cache, int(rng.integers(1, 3)))
        proc = popen(*cmd, "--compact-at", "1" if kind == "appending" else "0")
        kills[kind] += kill_when(proc, point)
        current = served_by(cache, source, {current, target})
        if current == target:  # it finished first: it did the kind of refresh asked for
            assert (fmt.read_manifest(cache).file("data") == data) == (kind == "appending")
        if kills == quota:
            break
    assert kills == quota
    tally["kills survived"] += KILLS
    tally["kills: refresh"] += KILLS
    tally["kills: refresh, appending"] += kills["appending"]
    build_cache(source.roots["A"], cache, workers=1, source_moved=True)
    assert served_by(cache, source, {"A"}) == "A"
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4


def test_kill_9_during_a_compaction_leaves_the_cache_as_it_was(source, tmp_path, tally):
    rng = np.random.default_rng(SEED + 2)
    cache = tmp_path / "cache"
    build_once(source.roots["A"], cache)
    kills = 0
    for _ in range(3 * KILLS):  # until KILLS kills landed while the compaction ran
        # garbage to compact: a refresh to the other version, appended (compact_at 1: never
        # compacting by itself)
        target = "B" if kills % 2 == 0 else "A"
        build_cache(source.roots[target], cache, workers=1, source_moved=True, compact_at=1.0)
        assert garbage_bytes(fmt.read_cache_files(fmt.read_manifest(cache))) > 0
        point = build_point(rng, cache)
        proc = popen("-m", "mmcache", "compact", str(cache))
        kills += kill_when(proc, point)
        assert served_by(cache, source, {target}) == target  # compaction changes no record
        if kills == KILLS:
            break
    assert kills == KILLS
    tally["kills survived"] += kills
    tally["kills: compaction"] += kills
    report = build_cache(source.roots["A"], cache, workers=1, compact_at=0.0)
    assert not report.appended and served_by(cache, source, {"A"}) == "A"
    m = fmt.read_manifest(cache)
    assert bins(cache) == sorted(["manifest.json", *(m.file(k).name for k in fmt.FILE_KINDS)])
