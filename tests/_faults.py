"""What the fault tests share: the counts they run at, the tally they report, the source
folder and pristine cache they damage, and the helpers that start, kill and wait for
processes. Loaded as a plugin by conftest.py, so that one tally serves the session."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import reference, wait_until, write_image

from mmcache import CacheError, CacheNotFoundError, build_cache, verify_cache
from mmcache import format as fmt
from mmcache._staleness import stale_reason

LONG = os.environ.get("MMCACHE_FAULTS", "") == "long"
KILLS = 100 if LONG else 4  # per scenario: build and refresh, 8 kills in the quick mode
FLIPS = 400 if LONG else 16  # bit flips per file kind, at seeded random positions
FUZZ = 3000 if LONG else 100  # hypothesis examples per fuzz test
SEED = int(os.environ.get("MMCACHE_FAULTS_SEED", "20240607"))
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def pytest_xdist_auto_num_workers(config):
    """No workers (one process) when the tally is to be written: each worker's session would
    write only its own counts, over the others'. Else one more worker than cores: the tests
    wait on their child processes, servers and timeouts, and the extra worker fills those
    waits (measured: docs/architecture.md, the tests row)."""
    if os.environ.get("MMCACHE_FAULTS_REPORT"):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


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


def served_by(cache: Path, source: Source, allowed: set[str | None]) -> str | None:
    """Which version the cache serves (None: no cache), after checking every record's pixels
    against the reference, every checksum, and that the version is one of ``allowed``."""
    from mmcache import MemmapImageDataset  # (imports torch: not at the plugin's load)

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


def popen(*args: str) -> subprocess.Popen:
    """Python with ``args``, in its own process group (killpg reaches its decode workers);
    stderr goes to a file, read by ``stderr_of``: a pipe nobody reads while the test polls could
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


def stderr_of(proc: subprocess.Popen) -> str:
    """What the ended process wrote to stderr (closes the file)."""
    with proc.err_file as f:
        f.seek(0)
        return f.read().decode(errors="replace")


def kill_when(proc: subprocess.Popen, reached) -> bool:
    """SIGKILL the process group as soon as ``reached()`` is true, polled while the process
    runs; whether the kill landed (the process died of it rather than finishing first)."""
    deadline = time.monotonic() + 120
    while proc.poll() is None and not reached():
        assert time.monotonic() < deadline, "the process neither reached the point nor ended"
        time.sleep(0.001)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_group_gone(proc.pid)
    err = stderr_of(proc)
    assert proc.returncode in (0, -signal.SIGKILL), err
    return proc.returncode == -signal.SIGKILL


def wait_group_gone(pgid: int) -> None:
    wait_until(
        lambda: not subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True).stdout,
        "the processes of a killed build to be gone",
    )


def build_cmd(src: Path, cache: Path, workers: int) -> list[str]:
    # A and B are two versions of one folder at two places: --source-moved lets either
    # refresh a cache of the other.
    return ["-m", "mmcache", "build", str(src), str(cache), "--workers", str(workers),
            "--source-moved"]  # fmt: skip


def new_files(cache: Path, before: set[str]) -> dict[str, os.stat_result]:
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


def build_point(rng: np.random.Generator, cache: Path):
    """A point of a build's progress to kill it at, drawn at random, as a function that says
    whether the build has reached it: a share of the pixels it writes written (into a new data
    file, or appended to the current one; 0: as soon as the room for them is made), or, one
    time in four, the generation's other files being written, just before it is published.
    Points, not times: they hold however slow the machine is."""
    before = set(os.listdir(cache)) if cache.is_dir() else set()
    current = current_data(cache)
    if rng.random() < 0.25:
        return lambda: len({k for k in new_files(cache, before) if k != "data"}) > 0
    share = rng.uniform(0, 1)

    def reached() -> bool:
        data = new_files(cache, before).get("data")
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


def current_data(cache: Path) -> tuple[Path, int, int] | None:
    """The published generation's data file, its size and the bytes allocated to it, or None."""
    try:
        path = fmt.read_manifest(cache).file("data")
        st = os.stat(path)
    except (CacheError, FileNotFoundError):
        return None
    return path, st.st_size, st.st_blocks * 512


def build_once(src: Path, cache: Path) -> None:
    proc = popen(*build_cmd(src, cache, 1))
    code, err = proc.wait(), stderr_of(proc)
    assert code == 0, err


def bins(cache: Path) -> list[str]:
    return sorted(n for n in os.listdir(cache) if n != "lock")


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


def copy_pristine(pristine: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(pristine, dst)
    return dst


def cache_file(cache: Path, kind: str) -> Path:
    if kind == "manifest":
        return cache / "manifest.json"
    return cache / json.loads((cache / "manifest.json").read_text())["files"][kind]


def open_and_read_all(cache: Path) -> list[np.ndarray]:
    """What a training job does, with every check on; returns the images."""
    from mmcache import MemmapImageDataset

    ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
    stale_reason(ds.reader.files)  # reads the manifest's source and skip entries
    return [ds[i][0] for i in range(len(ds))]
