"""The shape of the package: one module per concept, imports that run one way, no module
reaching into another's private names, torch only where the torch parts live."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mmcache"
MODULES = {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}


def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(), str(MODULES[name]))


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every relative import, at any depth."""
    found = []
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:  # from .x import a, b
                found.append((node.module.split(".")[0], [a.name for a in node.names], node.lineno))
            else:  # from . import x as y
                found += [(a.name, [], node.lineno) for a in node.names]
    return found


def test_no_module_imports_a_private_name_of_another():
    offences = [
        f"mmcache/{name}.py:{line}: {taken} from .{module}"
        for name in MODULES
        for module, names, line in _imports(name)
        for taken in names
        if taken.startswith("_") and not taken.startswith("__")
    ]
    assert offences == []


def _defined_privates(tree: ast.Module) -> set[str]:
    """Underscored names a module defines: functions, classes, attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_")}


def test_no_module_reaches_into_another_s_private_attributes():
    offences = []
    for name in MODULES:
        tree = _tree(name)
        own = _defined_privates(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in own
            ):
                offences.append(f"mmcache/{name}.py:{node.lineno}: .{node.attr}")
    # Other libraries' names are the exception: torch's uint8 antialiased resize kernels, and
    # its storage use count (whether a batch handed out is still held: _batches.in_use).
    allowed = {"._upsample_bilinear2d_aa", "._upsample_bicubic2d_aa"}
    allowed |= {"._C", "._storage_Use_Count", "._cdata"}
    assert [o for o in offences if o.rsplit(": ", 1)[1] not in allowed] == []


def test_imports_have_no_cycle():
    graph = {name: {m for m, _, _ in _imports(name) if m in MODULES} for name in MODULES}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in graph[node]:
            if nxt in path:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    done: set[str] = set()
    for name in MODULES:
        if name not in done:
            visit(name, [name])
    assert cycles == []


def test_every_module_opens_with_a_one_line_docstring_of_its_job():
    missing = []
    for name in MODULES:
        doc = ast.get_docstring(_tree(name))
        if not doc or len(doc.splitlines()[0]) > 100 or not doc.splitlines()[0].endswith("."):
            missing.append(name)
    assert missing == []


def test_the_format_build_and_decode_parts_import_without_torch():
    code = (
        "import sys, mmcache, mmcache.build, mmcache.format, mmcache.plan, mmcache.verify, "
        "mmcache.residency, mmcache.copying, mmcache.cli; "
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_no_issue_numbers_in_code_output_or_docs():
    places = [*PACKAGE.glob("*.py"), *(ROOT / "tools").rglob("*.py"), *(ROOT / "docs").glob("*.md")]
    places.append(ROOT / "README.md")
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [
        f"{p.relative_to(ROOT)}:{k}"
        for p in places
        for k, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def test_the_layout_page_lists_every_module():
    layout = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"`mmcache/(\w+)\.py`", layout))
    assert listed == set(MODULES) - {"__init__", "__main__", "_version"}


def test_every_public_module_says_what_it_exports_in_a_sorted_all():
    """A module is private (``_name``) or public with an ``__all__``, sorted, of names it
    defines or imports."""
    for name, path in MODULES.items():
        if name.startswith("_"):
            continue
        tree = ast.parse(path.read_text())
        found = [
            node.value
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert found, f"mmcache/{name}.py is public but has no __all__"
        names = [ast.literal_eval(e) for e in found[0].elts]
        assert names == sorted(names), f"mmcache/{name}.py: __all__ is not sorted"


def _compares_layout_names(node: ast.Compare) -> bool:
    """Whether a comparison branches on a record layout's name: against ``"yuv420"`` or the
    tuple of names (``LAYOUTS``), or a ``pixels``/``layout`` value against ``"rgb"`` (which
    alone is also a colour order's name)."""
    sides = [node.left, *node.comparators]
    texts = [ast.unparse(side) for side in sides]
    if any(isinstance(side, ast.Constant) and side.value == "yuv420" for side in sides):
        return True
    if any(re.search(r"\bLAYOUTS\b", text) for text in texts):
        return True
    rgb = any(isinstance(side, ast.Constant) and side.value == "rgb" for side in sides)
    return rgb and any(re.search(r"pixels|layout", text) for text in texts)


def test_layout_names_are_compared_in_the_layout_module_only():
    """A new layout is one object in ``mmcache/pixels.py``'s table: nothing else branches on
    a layout's name (``x.pixels == "rgb"``), it asks the layout object."""
    offences = []
    paths = {p.relative_to(ROOT): p for p in PACKAGE.rglob("*.py") if p.name != "pixels.py"}
    for rel, path in sorted(paths.items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and _compares_layout_names(node):
                offences.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert offences == []


def _compares_source_kinds(node: ast.Compare) -> bool:
    """Whether a comparison branches on a source kind's name: a ``kind`` value against a
    built-in kind's name, or anything against a table of kinds (``ARCHIVE_KINDS``)."""
    sides = [node.left, *node.comparators]
    texts = [ast.unparse(side) for side in sides]
    if any(re.search(r"\b\w*_KINDS\b", text) for text in texts):
        return True
    named = any(
        isinstance(side, ast.Constant) and side.value in SOURCE_KIND_NAMES for side in sides
    )
    return named and any(re.search(r"kind", text) for text in texts)


SOURCE_KIND_NAMES = {"folder", "list", "tar", "webdataset", "zip"}


def test_source_kinds_are_compared_in_the_sources_package_only():
    """A new source kind is one object in ``mmcache/sources/``'s table: nothing outside the
    package branches on a kind's name (``source["kind"] == "tar"``), it asks the kind."""
    from mmcache.sources import SOURCES

    assert set(SOURCES) == SOURCE_KIND_NAMES
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[1] == "sources":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and _compares_source_kinds(node):
                offences.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert offences == []


MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def test_no_module_or_function_is_too_long_to_read():
    """No module over 700 lines and no function over 80 (its docstring counted): past that a
    module holds several concepts and a function several steps, each of which wants a name."""
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            offences.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offences.append(f"{rel}:{node.lineno}: {node.name}, {length} lines")
    assert offences == []


def test_no_tool_over_700_lines_and_the_readme_within_250():
    """The tools are read as examples, under the package's limit; the README is the front
    page, each guide behind it a line there (docs/)."""
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in sorted((ROOT / "tools").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
