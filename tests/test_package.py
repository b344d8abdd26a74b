"""What the package shows its users and their tools: a sorted ``__all__``, every exported name
in ``dir()``, the lazy torch names visible to type checkers, and ``py.typed`` in the wheel."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import mmcache

ROOT = Path(__file__).resolve().parents[1]


def test_all_is_sorted():
    assert mmcache.__all__ == sorted(mmcache.__all__)


def test_dir_lists_every_exported_name_the_lazy_ones_too():
    assert set(mmcache.__all__) <= set(dir(mmcache))


def test_type_checkers_see_each_lazy_name_imported_from_where_it_is_loaded():
    tree = ast.parse((ROOT / "mmcache" / "__init__.py").read_text())
    guarded = next(
        node for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )  # fmt: skip
    seen = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    lazy = mmcache._TORCH_PARTS
    assert seen == lazy
    assert set(lazy) <= set(mmcache.__all__)


def test_the_wheel_ships_py_typed(tmp_path):
    assert (ROOT / "mmcache" / "py.typed").is_file()
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("mmcache-*.whl")
    assert "mmcache/py.typed" in zipfile.ZipFile(wheel).namelist()
