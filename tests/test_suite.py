"""The suite's own rules: under CI a required test that skips fails; a hang fails its test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

INNER = """
import threading

import pytest


def test_passes():
    pass


def test_required_but_skipped():
    pytest.skip("mounting a small tmpfs needs root")


@pytest.mark.needs_cuda
def test_may_skip():
    pytest.skip("needs CUDA")


@pytest.mark.skipif(True, reason="a skipif mark")
def test_required_skipped_by_a_mark():
    pass


@pytest.mark.xfail(reason="a known failure", strict=True)
def test_expected_to_fail():
    raise AssertionError


@pytest.mark.timeout(2)
def test_hangs():
    threading.Event().wait()
"""


def _inner_pytest(tmp_path: Path, ci: str | None, source: str = INNER, args: tuple = ()):
    """pytest on ``source`` with this suite's conftest and pytest settings, in a fresh process."""
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(HERE / "_faults.py", tmp_path / "_faults.py")  # a plugin the conftest loads
    shutil.copy(HERE.parent / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "test_inner.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    # (hypothesis's plugin takes seconds to load in each process, and no inner test uses it)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         "-q", "-n", "0", *args, "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _summary(stdout: str) -> str:
    return stdout.strip().splitlines()[-1]


def test_without_ci_a_skip_is_a_skip_and_a_hang_fails_its_test(tmp_path):
    run = _inner_pytest(tmp_path, ci="")  # empty: as if unset
    assert run.returncode == 1, run.stdout
    assert "1 failed, 1 passed, 3 skipped, 1 xfailed" in _summary(run.stdout)
    assert "FAILED test_inner.py::test_hangs - Failed: Timeout (>2.0s) from pytest-timeout" in (
        run.stdout
    )


def test_under_ci_a_required_test_that_skips_fails(tmp_path):
    run = _inner_pytest(tmp_path, ci="true")  # any non-empty value
    assert run.returncode == 1, run.stdout
    assert "2 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in _summary(run.stdout)
    # the skip inside the test fails it; the skipif mark skips at setup: an error
    assert "FAILED test_inner.py::test_required_but_skipped" in run.stdout
    assert "ERROR test_inner.py::test_required_skipped_by_a_mark" in run.stdout
    assert "skipped under CI, and it is a required test: mounting a small tmpfs" in run.stdout
    assert "SKIPPED [1] test_inner.py" in run.stdout and "needs CUDA" in run.stdout


def test_the_suite_has_a_per_test_timeout_of_minutes():
    text = (HERE.parent / "pyproject.toml").read_text()  # (tomllib is Python 3.11+)
    ini = text[text.index("[tool.pytest.ini_options]") :]
    assert 60 <= int(re.search(r"^timeout = (\d+)$", ini, re.M)[1]) <= 600
    assert "--strict-markers" in ini  # a misspelt needs_cuda would not excuse a skip


def test_no_tests_is_not_a_pass(tmp_path):
    run = _inner_pytest(tmp_path, ci="1", source="")
    assert run.returncode == 5, run.stdout


def test_a_faults_report_makes_n_auto_one_process(monkeypatch):
    # Each xdist worker's session would write its own counts over the others': the tally
    # written to $MMCACHE_FAULTS_REPORT is a whole session's only in one process.
    import _faults

    monkeypatch.setenv("MMCACHE_FAULTS_REPORT", "report.json")
    assert _faults.pytest_xdist_auto_num_workers(None) == 0
    monkeypatch.delenv("MMCACHE_FAULTS_REPORT")
    cores = len(os.sched_getaffinity(0))
    assert _faults.pytest_xdist_auto_num_workers(None) == cores + 1  # one more than cores


GROUPED = """
import os
from pathlib import Path

import pytest


@pytest.mark.xdist_group("page-cache")
@pytest.mark.parametrize("i", range(2))
def test_grouped(i):
    Path(f"ran-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    # The page-cache tests (eviction, residency) and the larger-than-RAM tool's (its cgroups)
    # must not run side by side: the pytest settings' --dist loadgroup keeps each group on one
    # worker, with a pytest and a pytest-xdist that agree on node ids (the dev extra's pin).
    # Ungrouped, xdist hands two tests to two workers, one each. (No conftest: not needed.)
    run = _inner_pytest(tmp_path, ci=None, source=GROUPED, args=("-n", "2", "--noconftest"))
    assert run.returncode == 0, run.stdout
    workers = {(tmp_path / f"ran-{i}").read_text() for i in range(2)}
    assert len(workers) == 1, workers
