"""The ImageNet-scale cost curve: every step a user runs, timed in a fresh process, with memory.

Usage:
    python tools/scale.py [--images 10000] [--classes 1000] [--workdir /var/tmp] [--keep]

Makes an ImageNet-shaped source of N tiny JPEGs (``--classes`` class folders named like
ImageNet's synsets, and the same images as a tar of one tar per class, as
``ILSVRC2012_img_train.tar`` ships), then runs each step in a fresh Python process: plan, build,
build again unchanged, info, dataset open, first batch with 2 fork and 2 spawn DataLoader
workers, one shuffled epoch (2 fork workers), the build from the tar of tars, a refresh after
0.1% of the files were added, verify. For each: the step's own seconds (imports excluded), the
process's wall seconds and its peak RSS (decode workers not counted), and the issue's target
for 1.28 M files, against the step's time projected to 1.28 M linearly (the steps grow with
the file count; at small N their fixed costs make the projection pessimistic). Timings on a
shared machine vary from run to run; rerun before reading much into a 20% difference.

``--step NAME`` is the child's side: it runs one step and prints one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The mmcache a step runs: this checkout's, or (--before) another's.
sys.path.insert(0, os.environ.get("SCALE_MMCACHE", str(ROOT)))

FULL = 1_281_167  # ImageNet's training images
# The targets at 1.28 M files (seconds), scaled to N in the table.
TARGETS = {
    "build again, unchanged": 2.0,
    "info": 0.5,
    "plan": 20.0,
    "dataset open": 1.0,
    "first batch, 2 spawn workers": 2.5,
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# Each a fresh process, in this order (``--skip`` leaves some out).
TAR_BUILD = "build from the tar of tars"
STEPS = ("plan", "build", "build again, unchanged", "info", "dataset open",
         "first batch, 2 fork workers", "first batch, 2 spawn workers",
         "one epoch, 2 fork workers", TAR_BUILD, "refresh, +0.1%", "verify")  # fmt: skip


def child(step: str, source: str, cache: str) -> dict:
    """Run one step here; its seconds and, for the open, the bytes it holds per record."""
    from mmcache.cli import main

    out: dict = {}
    quiet = io.StringIO()
    t = time.perf_counter()
    if step in ("plan", "info", "verify"):
        argv = {"plan": ["plan", source], "info": ["info", cache], "verify": ["verify", cache]}
        sys.stdout, saved = quiet, sys.stdout
        try:
            main(argv[step])
        finally:
            sys.stdout = saved
    elif step in (
        "build",
        "build again, unchanged",
        "refresh, +0.1%",
        "build from the tar of tars",
    ):
        main(["build", source, cache, "-q"])
    else:
        import torch

        import mmcache

        before = rss_bytes()
        t = time.perf_counter()
        ds = mmcache.MemmapImageDataset(cache)
        if step == "dataset open":
            out["bytes_per_record"] = (rss_bytes() - before) / len(ds)
        else:
            ctx = "spawn" if "spawn" in step else "fork"
            t = time.perf_counter()
            loader = torch.utils.data.DataLoader(
                ds, batch_size=256, shuffle=True, num_workers=2, multiprocessing_context=ctx
            )
            if step.startswith("first batch"):
                next(iter(loader))
            else:
                out["images"] = sum(len(labels) for _, labels in loader)
    out["seconds"] = time.perf_counter() - t
    return out


def run_step(step: str, source: Path, cache: Path, root: Path = ROOT) -> dict:
    """``step`` in a fresh process, with the mmcache of checkout ``root``: its report, wall
    seconds and peak RSS."""
    t = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--step", step, "--source", str(source), "--cache", str(cache)],
        stdout=subprocess.PIPE,
        text=True,
        # The decode workers' forkserver imports mmcache by name: from this checkout, not from
        # wherever an installed mmcache lies.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
            "SCALE_MMCACHE": str(root),
        },
    )
    with proc:  # (closes its pipe)
        stdout = proc.stdout.read() if proc.stdout else ""
        _, status, usage = os.wait4(proc.pid, 0)  # (its peak RSS, which Popen.wait drops)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped: Popen must not wait
    wall = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"step {step!r} failed (status {status}): {stdout[-2000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["wall"] = wall
    result["peak_rss"] = usage.ru_maxrss * 1024  # Linux: KiB
    return result


def side_by_side(before: Path, folder: Path, cache: Path, repeat: int) -> None:
    """The steps that read a built cache, with ``before``'s mmcache and this one's, alternating
    (so that a busy machine slows both alike): the median of ``repeat`` runs of each."""
    import statistics

    print(f"\nside by side, median of {repeat} alternating runs: before = {before}")
    print(f"{'step':32s} {'before s':>9s} {'after s':>9s} {'ratio':>6s} {'before RSS':>10s} "
          f"{'after RSS':>10s}")  # fmt: skip
    steps = ["build again, unchanged", "info", "dataset open", "first batch, 2 spawn workers"]
    for name in steps:
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(repeat):
            runs["before"].append(run_step(name, folder, cache, before))
            runs["after"].append(run_step(name, folder, cache, ROOT))
        b, a = (statistics.median(r["seconds"] for r in runs[k]) for k in ("before", "after"))
        rb, ra = (max(r["peak_rss"] for r in runs[k]) / 2**20 for k in ("before", "after"))
        held = ""
        if "bytes_per_record" in runs["after"][0]:
            hb, ha = (min(r["bytes_per_record"] for r in runs[k]) for k in ("before", "after"))
            held = f"  held: {hb:.0f} and {ha:.0f} B/record"
        print(f"{name:32s} {b:9.3f} {a:9.3f} {b / a:5.1f}x {rb:8.0f} MB {ra:8.0f} MB{held}")


def make_source(folder: Path, outer: Path, images: int, classes: int) -> None:
    """``images`` tiny JPEGs in ``classes`` folders, and the same as a tar of tars."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    blobs = [
        cv2.imencode(".jpg", rng.integers(0, 255, (24, 32, 3), dtype=np.uint8))[1].tobytes()
        for _ in range(16)
    ]
    per_class = [images // classes + (c < images % classes) for c in range(classes)]
    with tarfile.open(outer, "w") as out:
        for c, count in enumerate(per_class):
            synset = f"n{c:08d}"
            (folder / synset).mkdir(parents=True, exist_ok=True)
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as t:
                for k in range(count):
                    name = f"{synset}_{k}.JPEG"
                    data = blobs[(c + k) % len(blobs)]
                    (folder / synset / name).write_bytes(data)
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), int(time.time())
                    t.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo(f"{synset}.tar")
            info.size = inner.tell()
            inner.seek(0)
            out.addfile(info, inner)
    # As a dataset that was not written a moment ago: folders last changed an hour ago (a build
    # records the mtimes of folders older than its scan for the quick open-time check).
    past = time.time_ns() - 3600 * 10**9
    for d in [folder, *(p for p in folder.iterdir() if p.is_dir())]:
        os.utime(d, ns=(past, past))


def add_files(folder: Path, count: int) -> None:
    """``count`` more images, spread over the class folders (a refresh's new files)."""
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    blob = next(classes[0].iterdir()).read_bytes()
    for k in range(count):
        (classes[k % len(classes)] / f"added_{k}.JPEG").write_bytes(blob)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument(
        "--workdir", default=None, help="where the source and caches go (default: TMPDIR)"
    )
    p.add_argument("--keep", action="store_true", help="keep the source and caches")
    p.add_argument(
        "--before",
        metavar="DIR",
        help="another checkout of mmcache (say `git archive BASE | tar -x -C DIR`): time the "
        "steps that read a built cache with both, side by side, --repeat times each",
    )
    p.add_argument("--repeat", type=int, default=3, help="with --before: runs of each (median)")
    p.add_argument("--skip", action="append", default=[], metavar="STEP",
                   help="leave this step out (again for another): 'first batch, 2 spawn "
                   "workers', ...; the two builds the last line compares cannot be")  # fmt: skip
    p.add_argument("--step", help=argparse.SUPPRESS)
    p.add_argument("--source", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.step:
        print(json.dumps(child(args.step, args.source, args.cache)))
        return 0
    for name in args.skip:
        if name not in STEPS or name in ("build", TAR_BUILD):
            p.error(f"--skip {name!r}: not a step that can be left out (steps: {', '.join(STEPS)})")

    n = args.images
    work = Path(tempfile.mkdtemp(prefix="mmcache-scale-", dir=args.workdir))
    try:
        folder, outer = work / "train", work / "ILSVRC_train.tar"
        t = time.perf_counter()
        make_source(folder, outer, n, min(args.classes, n))
        print(f"made {n:,} JPEGs of 32x24 in {min(args.classes, n):,} classes, as files and as a "
              f"tar of tars, in {time.perf_counter() - t:.1f} s ({work})")  # fmt: skip
        cache, tar_cache = work / "cache", work / "cache-tar"
        steps = [(name, outer, tar_cache) if name == TAR_BUILD else (name, folder, cache)
                 for name in STEPS if name not in args.skip]  # fmt: skip
        rows = []
        for name, source, dest in steps:
            if name.startswith("refresh"):
                if args.before:  # (before the refresh: its new files make a changed source)
                    side_by_side(Path(args.before), folder, cache, args.repeat)
                add_files(folder, max(1, n // 1000))
            r = run_step(name, source, dest)
            rows.append((name, r))
        print(f"\n{n:,} images, {os.cpu_count()} CPUs, each step a fresh process "
              f"(python {sys.version.split()[0]}). Targets are for {FULL:,} files: each step's "
              "time is projected there linearly (below ~100 k files, fixed costs inflate "
              "it)")  # fmt: skip
        print(f"{'step':32s} {'step s':>8s} {'process s':>9s} {'peak RSS':>9s}  target")
        for name, r in rows:
            target = ""
            if name in TARGETS:
                projected = r["seconds"] * FULL / n
                verdict = "met" if projected <= TARGETS[name] else "NOT met"
                target = f"{projected:.3g} s at 1.28 M (target {TARGETS[name]:g}): {verdict}"
            if "bytes_per_record" in r:
                b = r["bytes_per_record"]
                target += f"; {b:.0f} B/record held (<= 100: {'met' if b <= 100 else 'NOT met'})"
            print(f"{name:32s} {r['seconds']:8.2f} {r['wall']:9.2f} "
                  f"{r['peak_rss'] / 2**20:7.0f} MB  {target}")  # fmt: skip
        files = dict(rows)["build"]["seconds"]
        tar = dict(rows)[TAR_BUILD]["seconds"]
        print(f"build from the tar of tars / from the files: {files / tar:.2f}x the speed "
              f"(target >= 0.9x: {'met' if files / tar >= 0.9 else 'NOT met'})")  # fmt: skip
        skips = "".join(f" --skip '{name}'" for name in args.skip)
        print(f"reproduce: python tools/scale.py --images {n} --classes {args.classes}{skips}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
