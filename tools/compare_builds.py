"""Build one source with two revisions of mmcache and compare the caches byte for byte.

A change that should not change what a build writes (a restructuring, a speed-up) must leave
the index, state, paths and data files identical, and the manifest identical but for the fields
that name this build (generation, file names, creation time, its own checksum). Usage:

    python tools/compare_builds.py --before 03100a6 --after HEAD [--source DIR] [-- OPTIONS]

Each revision is exported with ``git archive`` into a temporary folder and run from there with
this Python (which must have mmcache's dependencies). Without ``--source`` the build runs on
generated photo-like JPEGs of mixed sizes plus the real-world files of tests/data/testimages.
Options after ``--`` go to ``mmcache build`` (default: one build without options, one with
``--short-side 64``). Exits 1 if any file differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Manifest keys that name one build rather than describe its content (source_stamps: the
# source's folder mtimes, unknown (-1) for a build that starts within a second of their change).
PER_BUILD = ("generation", "files", "created", "checksums", "source_stamps")


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` as plain files in ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def build(tree: Path, source: Path, cache: Path, options: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from mmcache.cli import main; sys.exit(main(sys.argv[1:]))"
    run = subprocess.run(
        [sys.executable, "-c", code, "build", str(source), str(cache), *options],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise SystemExit(f"build with {tree.name} failed:\n{run.stdout}{run.stderr}")


def compare(a: Path, b: Path) -> list[str]:
    """What differs between caches ``a`` and ``b`` (empty if they hold the same bytes)."""
    ma, mb = (json.loads((c / "manifest.json").read_text()) for c in (a, b))
    problems = []
    for kind in ("index", "state", "paths", "data"):
        fa, fb = (c / m["files"][kind] for c, m in ((a, ma), (b, mb)))
        if fa.read_bytes() != fb.read_bytes():
            problems.append(f"{kind} file differs ({fa.stat().st_size} vs {fb.stat().st_size} B)")
    for key in sorted(set(ma) | set(mb)):
        if key not in PER_BUILD and ma.get(key) != mb.get(key):
            problems.append(f"manifest {key!r} differs: {ma.get(key)!r} vs {mb.get(key)!r}")
    for key in ("index", "paths"):
        if ma["checksums"][key] != mb["checksums"][key]:
            problems.append(f"manifest checksum of {key} differs")
    return problems


def sample_source(folder: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from mmcache.sample_data import make_image_folder

    make_image_folder(folder, classes=3, per_class=20, size=(64, 96), seed=7)
    # mixed sizes: portrait images too, and the real-world files (EXIF, CMYK, 16-bit, broken)
    make_image_folder(folder / "tall", classes=1, per_class=6, size=(80, 48), seed=8)
    for real in (REPO / "tests" / "data" / "testimages", REPO.parent / "shared" / "testimages"):
        if real.is_dir():
            ignore = shutil.ignore_patterns("*.md", "LICENSE*")
            shutil.copytree(real, folder / "real", ignore=ignore)
            break
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="git revision of the first build")
    p.add_argument("--after", default="HEAD", help="git revision of the second (default HEAD)")
    p.add_argument("--source", type=Path, help="image folder (default: generated + real files)")
    p.add_argument("options", nargs="*", help="mmcache build options, after --")
    args = p.parse_args()
    runs = [args.options] if args.options else [[], ["--short-side", "64"]]
    with tempfile.TemporaryDirectory(prefix="mmcache-compare-") as tmp:
        tmp = Path(tmp)
        source = args.source or sample_source(tmp / "source")
        # a list, not a dict by revision: --before HEAD --after HEAD compares a build with itself
        trees = [export(rev, tmp / f"tree-{k}") for k, rev in enumerate((args.before, args.after))]
        failed = False
        for options in runs:
            caches = []
            for k, tree in enumerate(trees):
                cache = tmp / f"cache-{k}-{'-'.join(options) or 'default'}"
                build(tree, source, cache, options)
                caches.append(cache)
            problems = compare(*caches)
            label = " ".join(options) or "no options"
            if problems:
                failed = True
                print(f"{label}: DIFFERENT\n  " + "\n  ".join(problems))
            else:
                sizes = sum(f.stat().st_size for f in caches[0].iterdir())
                print(f"{label}: identical ({sizes:,} bytes in {len(os.listdir(caches[0]))} files)")
        print(f"compared {args.before} with {args.after} on {source}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
