"""Mutation testing of one mmcache module against its test files (mutmut, the mutation extra).

Runs in a scratch copy of the package and tests, so the work tree stays as it is; not part of
CI. Prints mutmut's counts and each surviving mutant's diff (docs/mutation.md: how to read it).

    python tools/mutation.py transforms tests/test_transforms.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config(module: str, tests: list[str]) -> str:
    """The ``[tool.mutmut]`` table that mutates ``module`` alone and runs ``tests``."""
    quoted = ", ".join(f'"{t}"' for t in tests)
    return (
        "\n[tool.mutmut]\n"
        'source_paths = ["mmcache/"]\n'
        f'only_mutate = ["mmcache/{module}.py"]\n'
        f"pytest_add_cli_args_test_selection = [{quoted}]\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q", "-n", "0"]\n'
    )


def environment(scratch: Path) -> dict[str, str]:
    """The environment of mutmut's run in ``scratch``: its copy of the package first, and one
    torch intra-op thread. mutmut forks each mutant from a process that has run torch, and a
    forked child that enters torch's OpenMP pool waits for the parent's threads for ever: such
    a hang would be counted as a timeout, that is as a caught mutant."""
    return {**os.environ, "PYTHONPATH": str(scratch), "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "module", help="a module of mmcache/, without .py: transforms, sources/tar_headers, ..."
    )
    parser.add_argument("tests", nargs="+", help="the test files that should catch its bugs")
    parser.add_argument("--max-children", type=int, default=2, help="mutants run at once")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--only", nargs="+", default=[], metavar="GLOB",
                        help="only these mutants: mmcache.transforms.x_resized_crop*, ...")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix=f"mutation-{args.module.replace('/', '.')}-"))
    try:
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for folder in ("mmcache", "tests", "tools"):
            shutil.copytree(ROOT / folder, scratch / folder, ignore=ignore)
        toml = (ROOT / "pyproject.toml").read_text()
        (scratch / "pyproject.toml").write_text(toml + config(args.module, args.tests))
        env = environment(scratch)
        mutmut = [sys.executable, "-m", "mutmut"]
        children = ["--max-children", str(args.max_children)]
        run = subprocess.run([*mutmut, "run", *children, *args.only], cwd=scratch, env=env)
        results = subprocess.run([*mutmut, "results"], cwd=scratch, env=env,
                                 capture_output=True, text=True)  # fmt: skip
        print(results.stdout)
        for line in results.stdout.splitlines():
            name = line.strip().split(":")[0]
            if name and line.strip().endswith("survived"):
                subprocess.run([*mutmut, "show", name], cwd=scratch, env=env)
        return run.returncode
    finally:
        if args.keep:
            print(f"kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
