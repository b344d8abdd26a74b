"""What the package shows its users and their tools: a sorted ``__all__``, every exported name
in ``dir()``, the lazy torch names visible to type checkers, and ``py.typed`` in the wheel."""

from __future__ import annotations

import ast
import inspect
import re
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
    # pyproject.toml reads the version from mmcache/_version.py: the wheel's is __version__
    assert wheel.name.startswith(f"mmcache-{mmcache.__version__}-")


def test_the_version_is_written_once():
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", mmcache.__version__)
    # the changelog starts from it (nothing was released before)
    assert f"## {mmcache.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def test_the_removed_names_are_gone():
    # The package was never released: names it once had went without deprecation shims.
    from mmcache import BatchLoader, MemmapImageDataset, QuasiRandomSampler, transforms

    for name in ("Records", "CenterCrop"):
        assert name not in mmcache.__all__ and name not in dir(mmcache)
        assert not hasattr(mmcache, name)
    assert not hasattr(transforms, "CenterCrop") and "CenterCrop" not in transforms.__all__
    assert not hasattr(BatchLoader, "plan")
    # no __getattr__ handing the reader's names (records, data_path, ...) on
    assert not hasattr(MemmapImageDataset, "__getattr__")
    assert list(inspect.signature(QuasiRandomSampler.state_dict).parameters) == ["self"]


def test_the_api_reference_shows_every_public_module_and_exported_name():
    # docs/api.md is built with mkdocs --strict in CI (.ci/docs); this finds a public module or
    # an exported name left off the page without mkdocs.
    page = (ROOT / "docs" / "api.md").read_text()
    modules = sorted(p.stem for p in (ROOT / "mmcache").glob("*.py") if not p.stem.startswith("_"))
    assert [m for m in modules if f"`mmcache.{m}`" not in page] == []
    missing = [
        name for name in mmcache.__all__
        if name != "__version__"
        and f"::: mmcache.{name}\n" not in page
        and f"::: {getattr(mmcache, name).__module__}\n" not in page
    ]  # fmt: skip
    assert missing == []


def _sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections: title -> the lines under it."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        if line and not line[0].isspace():
            current = sections.setdefault(line[:-1], []) if line.endswith(":") else None
        elif current is not None:
            current.append(line)
    return sections


def test_docstrings_are_google_style_as_the_api_reference_reads_them():
    # griffe renders "Examples:" as doctests but "Example:" as a quote, and takes each Args
    # entry for one parameter: "a, b: ..." is a parameter named "a, b" (a warning, under
    # --strict a failed build).
    found = []
    for path in sorted((ROOT / "mmcache").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                continue
            sections = _sections(ast.get_docstring(node) or "")
            where = f"{path.name}: {getattr(node, 'name', 'module')}"
            found += [f"{where}: Example:" for title in sections if title == "Example"]
            found += [
                f"{where}: {line.strip()[:40]}"
                for line in sections.get("Args", [])
                if re.match(r" {4}\w+(, \w+)+:", line)
            ]
    assert found == []
