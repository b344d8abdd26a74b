"""A full or read-only disk: a clear error, and the old cache kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _faults import (
    served_by,
)
from conftest import tmpfs

from mmcache import (
    DestinationError,
    InsufficientSpaceError,
    MemmapImageDataset,
    build_cache,
    cli,
    compact_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache._generation import garbage_bytes

# --- full and read-only disks ---------------------------------------------------------------


def _fill(disk: Path, leave: int) -> None:
    """Fill the filesystem but ``leave`` bytes."""
    free = os.statvfs(disk)
    avail = free.f_bavail * free.f_frsize
    with open(disk / "filler", "ab") as f:
        f.write(b"\1" * max(0, avail - leave))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_disk_is_a_clear_error_and_keeps_the_old_cache(source, tmp_path, tally, workers):
    small = tmp_path / "small"
    for rel in sorted(source.refs["A"])[:20]:
        (small / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(source.roots["A"] / rel, small / rel)
    # what the refresh from the small cache to B writes (appended pixels, index, state, paths)
    build_cache(small, tmp_path / "measure", workers=1)
    need = build_cache(
        source.roots["B"], tmp_path / "measure", workers=1, source_moved=True
    ).written_bytes
    with tmpfs(tmp_path / "disk", "12m") as disk:
        cache = disk / "cache"

        def rebuild_small() -> dict[str, bytes]:
            shutil.rmtree(cache, ignore_errors=True)
            build_cache(small, cache, workers=1)
            return {p.name: p.read_bytes() for p in cache.iterdir()}

        before = rebuild_small()
        # Leave less room than B's pixels need (the disk fills up while decoding), or a little
        # more (it fills up writing the index, paths, state or manifest), or enough.
        kib = 1024
        leaves = [0, 64 * kib, need // 2, need - 4 * kib, need + 8 * kib, need + 24 * kib]
        leaves += [need + 40 * kib, need + 400 * kib]
        if workers == 2:
            leaves = leaves[:1] + leaves[3:4]
        outcomes = Counter()
        for leave in leaves:
            _fill(disk, leave)
            try:
                # force: past the free-space check before the build, to the disk filling up
                build_cache(
                    source.roots["B"], cache, workers=workers, source_moved=True, force=True
                )
            except InsufficientSpaceError as e:
                assert "disk is full" in str(e) and "previous cache" in str(e)
                assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
                tally["full disks survived"] += 1
                tally["full disks: refresh, appending"] += 1
                outcomes["refused"] += 1
            else:
                assert fmt.read_manifest(cache).shares_data  # it appended, as the failed ones
                assert served_by(cache, source, {"B"}) == "B"
                outcomes["built"] += 1
                (disk / "filler").unlink()
                before = rebuild_small()
            with contextlib.suppress(FileNotFoundError):
                (disk / "filler").unlink()
        assert outcomes["refused"] >= 2
        _fill(disk, 0)  # without force, the free-space check refuses before writing anything
        with pytest.raises(InsufficientSpaceError, match="free some space"):
            build_cache(source.roots["B"], cache, workers=workers, source_moved=True)
        assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
        (disk / "filler").unlink()
        assert len(MemmapImageDataset(cache, on_stale="ignore")) == 20
        assert verify_cache(cache).ok


def test_a_full_disk_during_a_compaction_keeps_the_cache(source, tmp_path, tally, monkeypatch):
    import mmcache._compact as compaction

    # 20 files of A, then the same paths as B has them (some rewritten, some gone): a refresh
    # that appends leaves the replaced records as garbage to compact.
    versions = {}
    for version in ("A", "B"):
        versions[version] = tmp_path / version
        for rel in sorted(source.refs["A"])[:20]:
            if (source.roots[version] / rel).exists():
                (versions[version] / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(source.roots[version] / rel, versions[version] / rel)
    with tmpfs(tmp_path / "disk", "4m") as disk:
        cache = disk / "cache"

        def with_garbage() -> dict[str, bytes]:
            shutil.rmtree(cache, ignore_errors=True)
            build_cache(versions["A"], cache, workers=1)
            build_cache(versions["B"], cache, workers=1, source_moved=True, compact_at=1.0)
            assert garbage_bytes(fmt.read_cache_files(fmt.read_manifest(cache))) > 0
            return {p.name: p.read_bytes() for p in cache.iterdir()}

        def pixels() -> dict[str, np.ndarray]:
            ds = MemmapImageDataset(cache, on_stale="ignore")
            return {
                os.path.relpath(p, versions["B"]): ds[i][0] for i, (p, _) in enumerate(ds.samples)
            }

        before = with_garbage()
        expected = pixels()
        assert expected.keys() < source.refs["B"].keys()
        assert all(np.array_equal(v, source.refs["B"][k]) for k, v in expected.items())
        _fill(disk, 0)  # the free-space check refuses before writing anything
        with pytest.raises(InsufficientSpaceError, match="free some space"):
            compact_cache(cache)
        assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
        (disk / "filler").unlink()
        # Past the check (as --force does for a build), to the disk filling up: while copying
        # the records (less room than the live bytes), or writing the index, state, paths or
        # manifest (a little more), or not at all.
        monkeypatch.setattr(compaction, "check_free_space", lambda *args, **kwargs: -1)
        live = sum(v.nbytes for v in expected.values())
        kib = 1024
        leaves = [0, 64 * kib, live // 2, live - 4 * kib, live + 4 * kib, live + 12 * kib]
        leaves += [live + 64 * kib]
        outcomes = Counter()
        for leave in leaves:
            _fill(disk, leave)
            try:
                compact_cache(cache)
            except InsufficientSpaceError as e:
                assert "disk is full" in str(e) and "the cache is intact" in str(e)
                assert {p.name: p.read_bytes() for p in cache.iterdir()} == before
                assert verify_cache(cache).ok
                tally["full disks survived"] += 1
                tally["full disks: compaction"] += 1
                outcomes["refused"] += 1
            else:
                m = fmt.read_manifest(cache)
                assert not m.shares_data and garbage_bytes(fmt.read_cache_files(m)) == 0
                got = pixels()
                assert got.keys() == expected.keys()
                assert all(np.array_equal(got[k], expected[k]) for k in got)
                outcomes["compacted"] += 1
                (disk / "filler").unlink()
                before = with_garbage()
            with contextlib.suppress(FileNotFoundError):
                (disk / "filler").unlink()
        assert outcomes["refused"] >= 3 and outcomes["compacted"] >= 1


def test_a_read_only_destination_is_a_clear_error(source, tmp_path, tally):
    with tmpfs(tmp_path / "disk", "8m") as disk:
        cache = disk / "cache"
        build_cache(source.roots["A"], cache, workers=1)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        try:
            with pytest.raises(DestinationError, match="cannot write the cache here"):
                build_cache(source.roots["B"], cache, workers=1, source_moved=True)
            assert served_by(cache, source, {"A"}) == "A"  # reading needs no write
            tally["read-only destinations survived"] += 1
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)


def test_an_up_to_date_cache_on_a_read_only_mount_builds_as_up_to_date(small_folder, tmp_path):
    # a cache published read-only (a shared dataset mount): the routine `mmcache build` before
    # a run has nothing to write, so it says "up to date" instead of failing
    with tmpfs(tmp_path / "disk", "8m") as disk:
        cache = disk / "cache"
        build_cache(small_folder, cache, workers=1)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        try:
            assert build_cache(small_folder, cache, workers=1).up_to_date
            assert cli.main(["build", str(small_folder), str(cache), "-q"]) == 0
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
