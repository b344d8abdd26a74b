"""Fault injection: kills, a full disk, a read-only disk, a changing source, damaged files, fuzzed
readers and concurrent processes. A cache is never silently wrong and never crashes its reader.

Quick by default; ``MMCACHE_FAULTS=long`` runs many more kills, flips and fuzzed inputs. With
``MMCACHE_FAULTS_REPORT=file.json`` the session writes what it counted there (kills survived,
corruptions detected, inputs fuzzed): ``tools/reliability.py`` runs this and prints the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import opened_file, reference, reseal, tmpfs, wait_until, write_image
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache import (
    CacheError,
    CacheFormatError,
    CacheNotFoundError,
    DecodeError,
    DestinationError,
    InsufficientSpaceError,
    MemmapImageDataset,
    build_cache,
    compact_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache.staleness import stale_reason

LONG = os.environ.get("MMCACHE_FAULTS", "") == "long"
KILLS = 100 if LONG else 10  # per scenario: build and refresh, 20 kills in the quick mode
FLIPS = 400 if LONG else 16  # bit flips per file kind, at seeded random positions
FUZZ = 3000 if LONG else 100  # hypothesis examples per fuzz test
SEED = int(os.environ.get("MMCACHE_FAULTS_SEED", "20240607"))
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

fuzz_settings = settings(
    max_examples=FUZZ,
    deadline=None,
    database=None,  # no .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="session")
def tally():
    """What the suite counted; written to $MMCACHE_FAULTS_REPORT (tests never print)."""
    counts: Counter = Counter()
    yield counts
    out = os.environ.get("MMCACHE_FAULTS_REPORT")
    if out:
        Path(out).write_text(json.dumps({"long": LONG, "seed": SEED, **counts}, indent=1))


# --- sources and references -----------------------------------------------------------------


class Source:
    """Two versions of one image folder, A and B (B: some files rewritten, removed, added), made
    of hard links to a few distinct images, with the pixels each relative path must give."""

    def __init__(self, root: Path, n: int = 400, distinct: int = 8) -> None:
        base = [write_image(root / "base" / f"{k}.png", 96, 64, seed=k) for k in range(distinct)]
        extra = [write_image(root / "base" / f"x{k}.png", 80, 72, seed=50 + k) for k in range(4)]
        pixels = {p: reference(p) for p in base + extra}
        self.roots = {"A": root / "A", "B": root / "B"}
        self.refs: dict[str, dict[str, np.ndarray]] = {"A": {}, "B": {}}
        for i in range(n):
            rel = f"c{i % 3}/{i:04d}.png"
            a = base[i % distinct]
            self._link(a, "A", rel, pixels)
            if i % 10 == 3:
                continue  # removed in B
            b = extra[i % len(extra)] if i % 4 == 1 else a  # rewritten in B
            self._link(b, "B", rel, pixels)
        for i in range(n, n + n // 10):  # added in B
            self._link(extra[i % len(extra)], "B", f"c{i % 3}/{i:04d}.png", pixels)

    def _link(self, target: Path, version: str, rel: str, pixels: dict) -> None:
        dst = self.roots[version] / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(target, dst)
        self.refs[version][rel] = pixels[target]

    def which(self, manifest: fmt.Manifest) -> str:
        return next(v for v, r in self.roots.items() if Path(manifest.source["root"]) == r)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Source:
    return Source(tmp_path_factory.mktemp("faults-src"))


def _served(cache: Path, source: Source, allowed: set[str | None]) -> str | None:
    """Which version the cache serves (None: no cache), after checking every record's pixels
    against the reference, every checksum, and that the version is one of ``allowed``."""
    try:
        ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
    except CacheNotFoundError:
        assert None in allowed, f"{cache}: no cache, expected one of {allowed}"
        return None
    version = source.which(ds.manifest)
    assert version in allowed
    refs = source.refs[version]
    root = source.roots[version]
    assert [os.path.relpath(p, root) for p, _ in ds.samples] == sorted(refs)
    for i, (path, _) in enumerate(ds.samples):
        assert np.array_equal(ds[i][0], refs[os.path.relpath(path, root)]), path
    assert verify_cache(cache).ok
    return version


def _popen(*args: str) -> subprocess.Popen:
    """Python with ``args``, in its own process group (killpg reaches its decode workers);
    stderr goes to a file, read by ``_stderr``: a pipe nobody reads while the test polls could
    fill up and stop the process."""
    err = tempfile.TemporaryFile()  # noqa: SIM115 (it lives as long as the process object)
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
        env=ENV,
    )
    proc.err_file = err
    return proc


def _stderr(proc: subprocess.Popen) -> str:
    """What the ended process wrote to stderr (closes the file)."""
    with proc.err_file as f:
        f.seek(0)
        return f.read().decode(errors="replace")


def _kill_when(proc: subprocess.Popen, reached) -> bool:
    """SIGKILL the process group as soon as ``reached()`` is true, polled while the process
    runs; whether the kill landed (the process died of it rather than finishing first)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and not reached():
        assert time.monotonic() < deadline, "the process neither reached the point nor ended"
        time.sleep(0.001)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_group_gone(proc.pid)
    err = _stderr(proc)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode == -signal.SIGKILL


def _wait_group_gone(pgid: int) -> None:
    wait_until(
        lambda: not subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True).stdout,
        "the processes of a killed build to be gone",
    )


def _build_cmd(src: Path, cache: Path, workers: int) -> list[str]:
    # A and B are two versions of one folder at two places: --source-moved lets either
    # refresh a cache of the other.
    return ["-m", "mmcache", "build", str(src), str(cache), "--workers", str(workers),
            "--source-moved"]  # fmt: skip


def _new_files(cache: Path, before: set[str]) -> dict[str, os.stat_result]:
    """The generation files in ``cache`` that were not there when the build started, by kind."""
    try:
        names = set(os.listdir(cache)) - before
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        kind = name.partition("-")[0]
        if kind in fmt.FILE_KINDS and name.endswith(".bin"):
            with contextlib.suppress(FileNotFoundError):
                found[kind] = os.stat(cache / name)
    return found


def _build_point(rng: np.random.Generator, cache: Path):
    """A point of a build's progress to kill it at, drawn at random, as a function that says
    whether the build has reached it: a share of the pixels it writes written (into a new data
    file, or appended to the current one; 0: as soon as the room for them is made), or, one
    time in four, the generation's other files being written, just before it is published.
    Points, not times: they hold however slow the machine is."""
    before = set(os.listdir(cache)) if cache.is_dir() else set()
    current = _current_data(cache)
    if rng.random() < 0.25:
        return lambda: len({k for k in _new_files(cache, before) if k != "data"}) > 0
    share = rng.uniform(0, 1)

    def reached() -> bool:
        data = _new_files(cache, before).get("data")
        if data is not None:
            return data.st_blocks * 512 >= share * data.st_size
        if current is None:
            return False
        path, size0, allocated0 = current
        with contextlib.suppress(FileNotFoundError):
            now = os.stat(path)
            grown = now.st_size - size0
            return grown > 0 and now.st_blocks * 512 - allocated0 >= share * grown
        return False

    return reached


def _current_data(cache: Path) -> tuple[Path, int, int] | None:
    """The published generation's data file, its size and the bytes allocated to it, or None."""
    try:
        path = fmt.read_manifest(cache).file("data")
        st = os.stat(path)
    except (CacheError, FileNotFoundError):
        return None
    return path, st.st_size, st.st_blocks * 512


def _build(src: Path, cache: Path) -> None:
    proc = _popen(*_build_cmd(src, cache, 1))
    code, err = proc.wait(), _stderr(proc)
    assert code == 0, err


def _bins(cache: Path) -> list[str]:
    return sorted(n for n in os.listdir(cache) if n != "lock")


# --- kill -9 ----------------------------------------------------------------------------------


def test_kill_9_during_a_first_build_leaves_no_cache_or_a_whole_one(source, tmp_path, tally):
    rng = np.random.default_rng(SEED)
    cache = tmp_path / "cache"
    kills = 0
    for _ in range(3 * KILLS):  # until KILLS kills landed while the build ran
        point = _build_point(rng, cache)
        proc = _popen(*_build_cmd(source.roots["A"], cache, int(rng.integers(1, 3))))
        kills += _kill_when(proc, point)
        _served(cache, source, {None, "A"})
        if cache.is_dir() and (cache / "manifest.json").exists():
            shutil.rmtree(cache)  # next time, a first build again (leftovers of kills stay)
        if kills == KILLS:
            break
    assert kills == KILLS
    tally["kills survived"] += kills
    tally["kills: build"] += kills
    # what the killed builds left, the next build clears
    build_cache(source.roots["A"], cache, workers=1)
    assert _served(cache, source, {"A"}) == "A"
    m = fmt.read_manifest(cache)
    assert _bins(cache) == sorted(["manifest.json", *(m.file(k).name for k in fmt.FILE_KINDS)])


def test_kill_9_during_a_refresh_leaves_the_old_cache_or_the_new(source, tmp_path, tally):
    """Half the kills land in refreshes that append to the data file the previous generation
    reads (--compact-at 1), half in refreshes that write a compact one (--compact-at 0)."""
    rng = np.random.default_rng(SEED + 1)
    cache = tmp_path / "cache"
    _build(source.roots["A"], cache)
    _build(source.roots["B"], cache)  # a refresh: reuses, decodes, drops
    current = "B"
    quota = {"appending": KILLS // 2, "compacting": KILLS - KILLS // 2}
    kills: Counter = Counter()
    for attempt in range(3 * KILLS):  # until KILLS kills landed while the refresh ran
        needed = [k for k in quota if kills[k] < quota[k]]
        kind = needed[attempt % len(needed)]
        target = "A" if current == "B" else "B"
        data = fmt.read_manifest(cache).file("data")
        point = _build_point(rng, cache)
        cmd = _build_cmd(source.roots[target], cache, int(rng.integers(1, 3)))
        proc = _popen(*cmd, "--compact-at", "1" if kind == "appending" else "0")
        kills[kind] += _kill_when(proc, point)
        current = _served(cache, source, {current, target})
        if current == target:  # it finished first: it did the kind of refresh asked for
            assert (fmt.read_manifest(cache).file("data") == data) == (kind == "appending")
        if kills == quota:
            break
    assert kills == quota
    tally["kills survived"] += KILLS
    tally["kills: refresh"] += KILLS
    tally["kills: refresh, appending"] += kills["appending"]
    build_cache(source.roots["A"], cache, workers=1, source_moved=True)
    assert _served(cache, source, {"A"}) == "A"
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4


def test_kill_9_during_a_compaction_leaves_the_cache_as_it_was(source, tmp_path, tally):
    rng = np.random.default_rng(SEED + 2)
    cache = tmp_path / "cache"
    _build(source.roots["A"], cache)
    kills = 0
    for _ in range(3 * KILLS):  # until KILLS kills landed while the compaction ran
        # garbage to compact: a refresh to the other version, appended (compact_at 1: never
        # compacting by itself)
        target = "B" if kills % 2 == 0 else "A"
        build_cache(source.roots[target], cache, workers=1, source_moved=True, compact_at=1.0)
        assert fmt.garbage_bytes(fmt.read_cache_files(fmt.read_manifest(cache))) > 0
        point = _build_point(rng, cache)
        proc = _popen("-m", "mmcache", "compact", str(cache))
        kills += _kill_when(proc, point)
        assert _served(cache, source, {target}) == target  # compaction changes no record
        if kills == KILLS:
            break
    assert kills == KILLS
    tally["kills survived"] += kills
    tally["kills: compaction"] += kills
    report = build_cache(source.roots["A"], cache, workers=1, compact_at=0.0)
    assert not report.appended and _served(cache, source, {"A"}) == "A"
    m = fmt.read_manifest(cache)
    assert _bins(cache) == sorted(["manifest.json", *(m.file(k).name for k in fmt.FILE_KINDS)])


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
                assert _served(cache, source, {"B"}) == "B"
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
    import mmcache._writer as writer

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
            assert fmt.garbage_bytes(fmt.read_cache_files(fmt.read_manifest(cache))) > 0
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
        monkeypatch.setattr(writer, "check_free_space", lambda *args, **kwargs: -1)
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
                assert not m.shares_data and fmt.garbage_bytes(fmt.read_cache_files(m)) == 0
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
            assert _served(cache, source, {"A"}) == "A"  # reading needs no write
            tally["read-only destinations survived"] += 1
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)


# --- a source that changes during the build -------------------------------------------------


def _rewrite(path: Path) -> None:
    write_image(path, 30, 20, seed=77)


CHANGES = {
    "deleted": lambda p: p.unlink(),
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "rewritten": _rewrite,
}


@pytest.mark.parametrize("when", ["after listing", "while decoding"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_source_file_that_changes_during_the_build_is_skipped_then_picked_up(
    small_folder, tmp_path, monkeypatch, tally, change, when
):
    import cv2

    import mmcache._writer as writer

    victim = small_folder / "dog" / "img_005.jpg"
    original, stat0 = victim.read_bytes(), victim.stat()
    if when == "after listing":
        real_plan = writer.plan_layout

        def plan_then_change(listing, opts):
            plan = real_plan(listing, opts)
            CHANGES[change](victim)
            return plan

        monkeypatch.setattr(writer, "plan_layout", plan_then_change)
    else:
        real_imread = cv2.imread

        def imread_while_changing(path, *args):
            if opened_file(path) == victim:
                CHANGES[change](victim)
            return real_imread(path, *args)

        monkeypatch.setattr(cv2, "imread", imread_while_changing)
    report = build_cache(small_folder, tmp_path / "cache", workers=0)  # the patch is here
    monkeypatch.undo()
    assert [(s["path"], s["state"]) for s in report.skipped] == [
        ("dog/img_005.jpg", fmt.BAD_SOURCE_CHANGED)
    ]
    assert "changed" in report.skipped[0]["reason"] or "vanished" in report.skipped[0]["reason"]
    assert report.images == 11
    # Put the file back as it was listed, mtime included: the next build must decode it.
    victim.write_bytes(original)
    os.utime(victim, ns=(stat0.st_atime_ns, stat0.st_mtime_ns))
    again = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert not again.up_to_date and again.images == 12 and again.skipped == []
    ds = MemmapImageDataset(tmp_path / "cache", verify="first-read")
    for i, (path, _) in enumerate(ds.samples):
        assert np.array_equal(ds[i][0], reference(path))
    tally["changing source files caught"] += 1


# --- damaged files ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A small cache whose records have gaps between them (sizes not multiples of 64)."""
    from conftest import make_folder

    root = tmp_path_factory.mktemp("pristine")
    src = make_folder(root / "src", {"a": [(13, 7), (9, 11)], "b": [(10, 10), (5, 3)]}, ".png")
    build_cache(src, root / "cache", workers=1)
    return root / "cache"


# The pristine cache's records, in ImageFolder order, as make_folder names them; what each must
# hold is the reference decode of that file (pristine.parent / "src" / name).
PRISTINE_FILES = ["a/img_000.png", "a/img_001.png", "b/img_002.png", "b/img_003.png"]


def _copy(pristine: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(pristine, dst)
    return dst


def _file(cache: Path, kind: str) -> Path:
    if kind == "manifest":
        return cache / "manifest.json"
    return cache / json.loads((cache / "manifest.json").read_text())["files"][kind]


def _open_and_read_all(cache: Path) -> list[np.ndarray]:
    """What a training job does, with every check on; returns the images."""
    ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
    stale_reason(ds._files)  # reads the manifest's source and skip entries
    return [ds[i][0] for i in range(len(ds))]


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
    cache = _copy(pristine, tmp_path / "c")
    good = _open_and_read_all(pristine)
    path = _file(cache, kind)
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
        got = _open_and_read_all(cache)
        assert all(np.array_equal(a, b) for a, b in zip(got, good)) and verify_cache(cache).ok
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
    good = _open_and_read_all(pristine)
    offsets = files.index["offset"].astype(int)
    sizes = [int(r["height"]) * int(r["width"]) * int(r["channels"]) for r in files.index]
    cache = _copy(pristine, tmp_path / "c")
    path = _file(cache, kind)
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
                hit = [i for i, (o, n) in enumerate(zip(offsets, sizes)) if o <= pos < o + n]
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


# --- fuzzing the readers ----------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def _only_documented_errors(cache: Path, pristine: Path) -> str:
    """Open and read everything as a training job would, then verify against the source;
    any exception but a CacheError fails the test. Returns "refused" (a CacheError), "found"
    (served, but ``verify --source all`` names bad records) or "accepted": then every record
    served must hold exactly the pixels of its source file, decoded here by the reference."""
    try:
        fmt.open_cache(cache)
        images = _open_and_read_all(cache)
        report = verify_cache(cache, source="all")
    except CacheError:
        return "refused"
    if not report.ok:
        return "found"
    src = pristine.parent / "src"
    assert len(images) == len(PRISTINE_FILES)
    for img, name in zip(images, PRISTINE_FILES):
        assert np.array_equal(img, reference(src / name)), name
    return "accepted"


def _fuzzed(tally: Counter, what: str, outcome: str) -> None:
    tally["inputs fuzzed"] += 1
    tally[f"inputs fuzzed: {what}: {outcome}"] += 1


@pytest.fixture
def scratch(tmp_path) -> Path:
    return tmp_path / "fuzz"


def _key_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _key_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _key_paths(v, (*prefix, i))


@fuzz_settings
@given(data=st.data())
def test_fuzz_manifest_values(pristine, scratch, tally, data):
    """Any value of the manifest replaced or deleted, then resealed as a forger would."""
    cache = _copy(pristine, scratch)
    m = json.loads((cache / "manifest.json").read_text())
    paths = [p for p in _key_paths(m) if p and p[0] != "checksums"]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        parent = m
        try:
            for k in where[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(where[-1], None)
            else:
                parent[where[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    (cache / "manifest.json").write_text(json.dumps(m))
    if data.draw(st.booleans()):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            reseal(cache)
    _fuzzed(tally, "manifest values", _only_documented_errors(cache, pristine))


@fuzz_settings
@given(raw=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_manifest_bytes(pristine, scratch, tally, raw):
    cache = _copy(pristine, scratch)
    (cache / "manifest.json").write_bytes(raw)
    outcome = _only_documented_errors(cache, pristine)
    assert outcome == "refused"  # no random bytes or JSON are a valid manifest
    _fuzzed(tally, "manifest bytes", outcome)


FIELDS = [(name, fmt.INDEX_DTYPE.fields[name][0]) for name in fmt.INDEX_DTYPE.names]
EDGES = [0, 1, 2, 63, 64, 65, 255, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1]


@fuzz_settings
@given(data=st.data())
def test_fuzz_index_state_and_paths(pristine, scratch, tally, data):
    """Fields of the index and state set to edge values, bytes of the paths overwritten; the
    checksums resealed, so that the structural checks alone stand between them and a reader."""
    cache = _copy(pristine, scratch)
    files = fmt.open_cache(cache)
    index, state = files.index.copy(), files.state.copy()
    blob = bytearray(files.paths_blob)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(["index", "state", "paths"]))
        if target == "paths":
            if blob:
                pos = data.draw(st.integers(0, len(blob) - 1))
                blob[pos] = data.draw(st.sampled_from(b"/.\\\x00\xff\xc3a"))
            continue
        arr = index if target == "index" else state
        i = data.draw(st.integers(0, len(arr) - 1))
        name = data.draw(st.sampled_from(arr.dtype.names))
        dtype = arr.dtype.fields[name][0]
        info = np.iinfo(dtype)
        value = data.draw(st.sampled_from(EDGES) | st.integers(info.min, info.max))
        if data.draw(st.booleans()):
            value += int(arr[name][i])  # near the true value: past the end by a little
        arr[name][i] = value if info.min <= value <= info.max else info.max
    index.tofile(_file(cache, "index"))
    state.tofile(_file(cache, "state"))
    _file(cache, "paths").write_bytes(bytes(blob))
    reseal(cache)
    _fuzzed(tally, "index, state, paths", _only_documented_errors(cache, pristine))


# --- concurrent processes ---------------------------------------------------------------------

READER = textwrap.dedent(
    """
    import os, pickle, sys, time
    import numpy as np
    from mmcache import CacheFormatError, MemmapImageDataset
    cache, refs_file, stop = sys.argv[1:]
    with open(refs_file, "rb") as f:
        roots, refs = pickle.load(f)
    passes = reopened = 0
    while not os.path.exists(stop) or passes < 2:
        try:
            ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
            version = next(v for v, r in roots.items() if r == ds.manifest.source["root"])
            for _ in range(2):  # twice: the second pass often reads a generation since replaced
                for i, (path, _) in enumerate(ds.samples):
                    rel = os.path.relpath(path, roots[version])
                    if not np.array_equal(ds[i][0], refs[version][rel]):
                        sys.exit(f"wrong pixels: {version} {rel}")
                time.sleep(0.01)
            passes += 1
            open(f"{stop}.ready.{os.getpid()}", "w").close()  # the builders may start
        except CacheFormatError as e:
            if "rebuilt" not in str(e):  # a generation replaced before we mapped it: reopen
                raise
            reopened += 1
    print(passes, reopened)
    """
)


def test_four_processes_building_and_reading_one_cache(source, tmp_path, tally):
    cache = tmp_path / "cache"
    build_cache(source.roots["A"], cache, workers=1)
    refs_file, stop = tmp_path / "refs.pkl", tmp_path / "stop"
    with open(refs_file, "wb") as f:
        pickle.dump(({v: str(r) for v, r in source.roots.items()}, source.refs), f)
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(cache), str(refs_file), str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("stop.ready.*"))) < len(readers):  # both read, then build
        assert time.monotonic() < deadline and all(r.poll() is None for r in readers)
        time.sleep(0.05)
    rounds = 3 if LONG else 1
    builders = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from mmcache.cli import main\n"
                f"for v in {order * rounds!r}:\n"
                "    assert main(['build', v, sys.argv[1], '--workers', '1', '--source-moved'])"
                " == 0",
                str(cache),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        for order in (
            [str(source.roots["B"]), str(source.roots["A"])],
            [str(source.roots["A"]), str(source.roots["B"])],
        )
    ]
    for b in builders:
        _, err = b.communicate(timeout=300)
        assert b.returncode == 0, err.decode()
    stop.touch()
    for r in readers:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, err.decode()
        passes, _ = map(int, out.split())
        tally["concurrent reads verified"] += passes
    assert _served(cache, source, {"A", "B"}) in ("A", "B")
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4


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
        proc = _popen("-c", LAZY_FILLER, str(cache), str(source.roots["A"]))
        if k < 0:
            landed = _kill_when(proc, cache.is_dir)
        else:
            landed = _kill_when(proc, lambda k=k: (_filled_count(cache) or 0) >= k)
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
