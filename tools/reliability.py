"""The reliability figures: run the fault-injection suite and print what it counted.

Runs the fault tests (tests/test_faults_*.py) under pytest with MMCACHE_FAULTS_REPORT set, so
the suite writes its counts (kills survived, full disks, corruptions detected, inputs fuzzed,
...) to a JSON file, and prints them with the command that reproduces them. The exit status is
pytest's. Usage:

    python tools/reliability.py            # the quick mode, as CI runs it
    python tools/reliability.py --long     # MMCACHE_FAULTS=long: many more kills and inputs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--long", action="store_true", help="the long mode (MMCACHE_FAULTS=long)")
    p.add_argument("--seed", type=int, help="MMCACHE_FAULTS_SEED: where kills land, what flips")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mmcache-reliability-") as tmp:
        report = Path(tmp) / "report.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "MMCACHE_FAULTS_REPORT": str(report),
        }
        if args.long:
            env["MMCACHE_FAULTS"] = "long"
        if args.seed is not None:
            env["MMCACHE_FAULTS_SEED"] = str(args.seed)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
        cmd += sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_faults_*.py"))
        done = subprocess.run(cmd, cwd=REPO, env=env)
        counts = json.loads(report.read_text()) if report.exists() else {}
    seed = counts.pop("seed", None)
    mode = "long" if counts.pop("long", False) else "quick"
    print(f"\nmmcache reliability, {mode} mode, seed {seed}: pytest exit status {done.returncode}")
    for key in sorted(counts):
        print(f"  {key:<48} {counts[key]:>8,}")
    print(
        "reproduce: python tools/reliability.py"
        + (" --long" if args.long else "")
        + (f" --seed {args.seed}" if args.seed is not None else "")
    )
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
