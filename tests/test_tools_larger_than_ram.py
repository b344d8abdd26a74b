"""tools/larger_than_ram.py: its storage profiles, the disk it throttles, and its cgroups removed
after a run, a failed row, Ctrl-C and SIGTERM (no timings checked)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import sigint_by_default, wait_until

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import larger_than_ram as ltr  # noqa: E402 - a tool, imported from its folder

# The tool drops the page cache: one worker runs it and the tests that count resident pages
pytestmark = pytest.mark.xdist_group("page-cache")

CGROUPS = Path("/sys/fs/cgroup")


def test_profiles_and_explicit_limits():
    assert ltr.limits("local", None, None) == ("local", None, None)
    assert ltr.limits("cloud-volume", None, None) == ("cloud-volume", 3000, 125_000_000)
    assert ltr.limits("hdd", None, None) == ("hdd", 150, 150_000_000)
    assert ltr.limits("hdd", 150, None) == ("hdd", 150, 150_000_000)  # the profile's own value
    assert ltr.limits("local", 500, 50_000_000) == ("custom", 500, 50_000_000)
    assert ltr.limits("hdd", None, 10**8) == ("custom", 150, 10**8)
    with pytest.raises(SystemExit, match="--iops must be at least 1"):
        ltr.limits("local", 0, None)


def test_the_throttled_device_is_the_whole_disk_holding_the_folder(tmp_path):
    dev = os.stat(tmp_path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysfs.exists():
        with pytest.raises(SystemExit, match="not on a block device"):
            ltr.block_device(tmp_path)
        return
    key, name = ltr.block_device(tmp_path)
    disk = Path(f"/sys/dev/block/{key}").resolve()
    assert disk.name == name and not (disk / "partition").exists()
    assert sysfs.resolve() in (disk, *disk.iterdir())  # the folder's device, or a partition of it


def test_a_folder_on_no_disk_is_refused_with_the_reason():
    with pytest.raises(SystemExit, match="not on a block device"):
        ltr.block_device(Path("/proc"))  # a pseudo filesystem: no disk to throttle


def _groups() -> list[Path]:
    """The tool's cgroups that exist now, in the memory and blkio hierarchies."""
    return [g for c in ("memory", "blkio") for g in (CGROUPS / c).rglob(f"{ltr.GROUP_PREFIX}*")]


@pytest.fixture(scope="module")
def workdir():
    """A folder on a disk (blkio throttles disks), with the tool's data made once: 80 JPEGs
    and two caches of about 10 MB."""
    if os.geteuid() != 0:
        pytest.skip("the tool makes cgroups: needs root")
    if not all((CGROUPS / c / "cgroup.procs").exists() for c in ("memory", "blkio")):
        pytest.skip("no cgroup v1 memory and blkio controllers here")
    for base in (None, "/var/tmp"):
        folder = Path(tempfile.mkdtemp(prefix="mmcache-ltr-test-", dir=base))
        try:
            ltr.block_device(folder)
            break
        except SystemExit:
            os.rmdir(folder)
    else:
        pytest.skip("no temporary folder on a block device")
    ltr.prepare(folder, 0.01, yuv420=True)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=True)


def _tool(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, str(TOOLS / "larger_than_ram.py"), "--workdir", str(workdir),
            "--gb", "0.01", "--epochs", "1", *args]  # fmt: skip


def test_a_run_prints_the_profile_and_allowance_and_leaves_no_cgroup(workdir):
    before = _groups()
    args = ["--storage", "cloud-volume", "--loaders", "batch", "--rows", "random,quasi,yuv420"]
    run = subprocess.run(_tool(workdir, *args), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "storage cloud-volume: 3,000 IOPS, 125 MB/s" in out
    assert "page cache allowed" in out and "throttle check" in out
    assert f"command: python tools/larger_than_ram.py --workdir {workdir}" in out
    assert "| mmcache, random order |" in out and "| mmcache, QuasiRandomSampler" in out
    # the yuv420 row reads its own cache, half the bytes, and its targets are printed
    assert "| mmcache, yuv420 cache of the same images, random order |" in out
    assert "yuv420 cache: " in out and "(0.50x)" in out
    assert "batch: yuv420 cache / random, epoch 1 >= 1.5x" in out
    assert _groups() == before


def test_a_failed_row_leaves_no_cgroup(workdir):
    before = _groups()
    args = ["--loaders", "batch", "--rows", "random", "--batch-size", "0"]
    run = subprocess.run(_tool(workdir, *args), capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    assert "failed (exit status" in run.stderr and "batch_size" in run.stderr
    assert _groups() == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_leaves_no_cgroup(workdir, sig):
    before = _groups()
    # Epochs long enough to be interrupted in: a slow disk and a limit on the epoch's time.
    args = ["--storage", "hdd", "--iops", "20", "--loaders", "dataloader", "--rows", "random",
            "--max-epoch-seconds", "120"]  # fmt: skip
    with sigint_by_default():  # else a pytest started in the background ignores Ctrl-C's
        # (stderr kept: the tool names a group it could not remove there)
        proc = subprocess.Popen(
            _tool(workdir, *args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    try:
        blkio = CGROUPS / "blkio"

        def a_row_runs() -> bool:
            groups = list(blkio.rglob(f"{ltr.GROUP_PREFIX}{proc.pid}"))
            return bool(groups) and bool((groups[0] / "cgroup.procs").read_text().split())

        wait_until(a_row_runs, "a row to run inside the tool's cgroups", seconds=240)
        proc.send_signal(sig)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert _groups() == before, stderr[-3000:]
    assert _rows_running(workdir) == []  # the row's processes were ended too


def _rows_running(workdir: Path) -> list[str]:
    """Processes of this tool's rows on ``workdir`` that are still there."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--measure" in args and str(workdir).encode() in args:
            found.append(cmdline.parent.name)
    return found
