"""The command line's shape: one module per command, each with its flags, its run and its
output; what they share in one module; no module reaching into another's private names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mmcache.cli

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "mmcache" / "cli"
MODULES = {p.stem: p for p in sorted(CLI.glob("*.py"))}


def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


def test_every_command_is_a_module_with_add_and_run_listed_in_commands():
    commands = {m.__name__.rsplit(".", 1)[1] for m in mmcache.cli.COMMANDS}
    assert commands == set(MODULES) - {"__init__", "_shared"}
    for module in mmcache.cli.COMMANDS:
        assert callable(module.add) and callable(module.run), module.__name__


def test_every_module_opens_with_a_one_line_docstring_of_its_job():
    for name in MODULES:
        doc = ast.get_docstring(_tree(name))
        assert doc, name
        first = doc.splitlines()[0]
        assert len(first) <= 100 and first.endswith("."), name


def test_no_module_over_700_lines_and_no_function_over_80():
    long = [name for name, path in MODULES.items() if len(path.read_text().splitlines()) > 700]
    assert long == []
    functions = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name in MODULES
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert functions == []


def test_no_module_imports_a_private_name_of_another():
    offences = [
        f"mmcache/cli/{name}.py:{node.lineno}: {alias.name} from {'.' * node.level}{node.module}"
        for name in MODULES
        for node in ast.walk(_tree(name))
        if isinstance(node, ast.ImportFrom) and node.level
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert offences == []


def test_the_wheel_is_told_of_every_package():
    """setuptools' ``packages`` lists each folder of the package, so the wheel ships the CLI."""
    listed = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert listed is not None
    packages = {p.strip().strip('"') for p in listed[1].split(",")}
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mmcache").rglob("__init__.py")
    }
    assert packages == folders
