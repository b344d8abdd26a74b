"""What a refresh costs against a full build: time, bytes written, data file growth, compaction.

    python tools/refresh_bench.py                    # 1,500 JPEGs of 720x480, 30 refreshes of 1%
    python tools/refresh_bench.py --images 200 --image-size 64x48 --refreshes 5 --json out.json

Generates photo-like JPEGs, then, each step in a fresh Python process that calls
``build_cache`` (or ``compact_cache``) once: a full build; a refresh after one file was replaced
(other pixels, a later mtime); one after a file was added; ``--refreshes`` refreshes in a row,
odd ones replacing ``--share`` of the files (drawn at random), even ones adding as many; a
``compact``. Times are the call's own (the process's start and imports left out, as in the
build summary's "in S s"). Bytes written are measured by the kernel, not taken from mmcache's
report: this process is a child subreaper, reaps every process of the step (decode workers and
the forkserver included) and reads ``ru_oublock`` of its children (``write_bytes`` of
/proc/<pid>/io: bytes dirtied in the page cache, whole 4 KiB pages), beside what the files say
was added (the data file's growth, the new index, state, paths and manifest). The data file's
size over its live bytes is from ``os.stat`` and the index; a compaction shows as a data file of
another name. Last, the rate of writing ``--write-mb`` into a new file after a ``--pause`` and
back to back: on a VM whose freed memory goes back to the hypervisor, touching fresh memory is
slow, and every write-heavy timing here depends on it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmcache import format as fmt  # noqa: E402
from mmcache import verify_cache  # noqa: E402
from mmcache.options import parse_size  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

PAGE = 4096
# This VM's ext4 has no journal, so the inode, bitmap, directory and extent blocks a refresh
# dirties (4 new files, 3 deleted, the data file grown) count as its writes: 1 to 10 pages
# measured here. The kernel's count may pass the content's by this much.
METADATA = 16 * PAGE
PR_SET_CHILD_SUBREAPER = 36
# One step, in a process of its own: its writes are its own and its decode workers' alone.
STEP = """
import json, sys, time
from mmcache import build_cache, compact_cache
what, src, cache = sys.argv[1:]
start = time.perf_counter()
r = compact_cache(cache) if what == "compact" else build_cache(src, cache)
print(json.dumps({"seconds": time.perf_counter() - start, "decoded": r.decoded}))
"""


def run_step(what: str, src: Path, cache: Path) -> dict:
    """Run a build or compaction in a new process; its own time and what the kernel counted."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # Not counted: Python's bytecode cache, and the temporary files of Python's tempfile
    # (its probe of the folder, the decoders' stderr capture), on tmpfs, which counts nothing.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if os.path.isdir("/dev/shm"):
        env["TMPDIR"] = "/dev/shm"
    cmd = [sys.executable, "-c", STEP, what, str(src), str(cache)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{what} failed:\n{done.stderr[-3000:]}")
    reap_orphans()
    step = json.loads(done.stdout)
    step["written"] = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock - before) * 512
    return step


def reap_orphans(seconds: float = 60) -> None:
    """Wait for the step's orphans (the forkserver, workers) to end, so their writes count."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)
    sys.exit("a process of the last step did not end")


def generation(cache: Path) -> dict:
    """The published generation as the files say: data file name, size and live bytes."""
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    m = files.manifest
    return {
        "data": m.file("data").name,
        "data_size": os.stat(m.file("data")).st_size,
        # pixels: padding left out
        "live": int(fmt.record_nbytes(files.index, m.pixels, m.mask).sum()),
        "files": [os.stat(m.file(k)).st_size for k in ("index", "state", "paths")]
        + [os.stat(cache / fmt.MANIFEST_NAME).st_size],
        "count": m.count,
    }


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def refresh(src: Path, cache: Path, changed: int, record: int) -> dict:
    """Refresh ``cache`` after ``changed`` files of ``record`` bytes of pixels each changed; its
    time, what it added to the files, what the kernel counted, and the bounds for both."""
    old = generation(cache)
    step = run_step("build", src, cache)
    new = generation(cache)
    if step["decoded"] != changed:
        sys.exit(f"the refresh decoded {step['decoded']} files, not the {changed} changed")
    step.update(new, compacted=new["data"] != old["data"], ratio=new["data_size"] / new["live"])
    if step["compacted"]:
        return step
    # Each new record starts on a 64-byte boundary; the rest is the new index, state, paths
    # and manifest. The kernel counts whole pages, from the one the new part starts in.
    step["added"] = new["data_size"] - old["data_size"] + sum(new["files"])
    step["bound"] = changed * (record + 63) + sum(new["files"])
    first = old["data_size"] // PAGE * PAGE
    step["page_bound"] = pages(new["data_size"]) - first + sum(map(pages, new["files"]))
    return step


def stage(staging: Path, n: int, size: tuple[int, int], seed: int) -> list[Path]:
    """``n`` new photo-like JPEGs with pixels of their own (``seed``), to move into the source."""
    shutil.rmtree(staging, ignore_errors=True)
    make_image_folder(staging, classes=1, per_class=n, size=size[::-1], seed=seed)  # (h, w)
    return sorted(staging.rglob("*.jpg"))


def write_rate(folder: Path, mb: int, pause: float) -> tuple[float, float]:
    """MB/s writing ``mb`` MiB into a new file after ``pause`` seconds, then again at once."""
    block = b"\1" * (8 << 20)
    rates = []
    for wait in (pause, 0):
        time.sleep(wait)
        path = folder / "fresh-memory"
        start = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(max(1, mb // 8)):
                f.write(block)
        rates.append(os.path.getsize(path) / (time.perf_counter() - start) / 1e6)
        path.unlink()
    return rates[0], rates[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=1500, help="images to generate")
    p.add_argument("--image-size", type=parse_size, default=(720, 480), metavar="WxH")
    p.add_argument("--refreshes", type=int, default=30, help="refreshes in a row")
    p.add_argument("--share", type=float, default=0.01, help="files each of them changes")
    p.add_argument("--write-mb", type=int, default=512, help="MiB for the write-rate check")
    p.add_argument("--pause", type=float, default=5.0, help="seconds before the first write")
    p.add_argument("--workdir", type=Path, help="where the source and cache go (default: temp)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    # Orphaned workers and forkservers come to this process, which reaps them: their writes
    # then count in RUSAGE_CHILDREN.
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed: the writes of orphans would not count")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="mmcache-refresh-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src, cache, staging = work / "src", work / "cache", work / "staging"
    for folder in (src, cache, staging):
        shutil.rmtree(folder, ignore_errors=True)
    per_class = max(1, args.images // 10)
    w, h = args.image_size
    record = w * h * 3  # native size, RGB: what build_cache stores by default
    print(f"generating {per_class * 10:,} photo-like JPEGs of {w}x{h} in {src}", flush=True)
    make_image_folder(src, classes=10, per_class=per_class, size=(h, w))
    files = sorted(src.rglob("*.jpg"))

    full = run_step("build", src, cache) | generation(cache)
    rows = [("full build", full)]
    (new,) = stage(staging, 1, args.image_size, seed=1)
    os.replace(new, files[len(files) // 2])  # other pixels, a later mtime
    rows.append(("refresh, 1 file replaced", refresh(src, cache, 1, record)))
    (new,) = stage(staging, 1, args.image_size, seed=2)
    os.replace(new, src / "class_00" / "added_0.jpg")
    files.append(src / "class_00" / "added_0.jpg")
    rows.append(("refresh, 1 file added", refresh(src, cache, 1, record)))

    rng = np.random.default_rng(0)
    series = []
    for k in range(1, args.refreshes + 1):
        n = max(1, round(args.share * len(files)))
        staged = stage(staging, n, args.image_size, seed=100 + k)
        if k % 2:  # odd: replace n files drawn at random (some replaced or added before)
            targets = [files[i] for i in rng.choice(len(files), n, replace=False)]
        else:  # even: add n files
            targets = [src / f"class_{j % 10:02d}" / f"added_{k}_{j}.jpg" for j in range(n)]
            files += targets
        for a, b in zip(staged, targets, strict=True):
            os.replace(a, b)
        step = refresh(src, cache, n, record)
        series.append(step | {"change": "replaced" if k % 2 else "added", "files": n})
    rows.append(("compact", run_step("compact", src, cache) | generation(cache)))
    ok = verify_cache(cache).ok
    shutil.rmtree(staging, ignore_errors=True)
    paused, at_once = write_rate(work, args.write_mb, args.pause)

    mb, base = 1e6, full["seconds"]
    print(f"\n{full['count']:,} images of {w}x{h} ({record:,} B each); {os.cpu_count()} cores\n")
    print("| step | s | vs full build | written (kernel) | added to the files | data file |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in rows:
        added = f"{r['added'] / mb:,.3f} MB" if "added" in r else ""
        print(
            f"| {name} | {r['seconds']:.3f} | {r['seconds'] / base:.3f}x | "
            f"{r['written'] / mb:,.3f} MB | {added} | {r['data_size'] / mb:,.1f} MB |"
        )
    print(f"\n{len(series)} refreshes in a row, each of {args.share:.0%} of the files:\n")
    print("| # | change | s | written (kernel) | data file | live | data / live | compacted |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    for k, r in enumerate(series, 1):
        print(
            f"| {k} | {r['files']} {r['change']} | {r['seconds']:.3f} | "
            f"{r['written'] / mb:,.2f} MB | {r['data_size'] / mb:,.1f} MB | "
            f"{r['live'] / mb:,.1f} MB | {r['ratio']:.3f} | {'yes' if r['compacted'] else 'no'} |"
        )
    print(
        f"\nwriting {args.write_mb} MiB into a new file: {paused:,.0f} MB/s after a "
        f"{args.pause:g} s pause, {at_once:,.0f} MB/s back to back; the full build wrote "
        f"{full['written'] / mb:,.0f} MB in {base:.2f} s ({full['written'] / base / mb:,.0f} "
        f"MB/s); verify after compact: {'ok' if ok else 'FAILED'}"
    )
    targets = []
    for name, r in rows[1:3]:
        targets.append((f"{name}: {r['seconds'] / base:.3f}x the full build <= 0.05",
                        r["seconds"] <= 0.05 * base))  # fmt: skip
        targets.append((
            f"{name}: added {r['added']:,} B to the files <= {r['bound']:,} B (the changed "
            "record, its alignment, index, state, paths, manifest)", r["added"] <= r["bound"]
        ))  # fmt: skip
        targets.append((
            f"{name}: the kernel counted {r['written']:,} B written <= {r['page_bound']:,} B "
            f"(the same in whole pages) + {METADATA // 1024} KiB of filesystem metadata",
            r["written"] <= r["page_bound"] + METADATA,
        ))  # fmt: skip
    if series:
        worst = max(r["ratio"] for r in series)
        targets.append((f"data file / live bytes over the refreshes: {worst:.3f} <= 1.35",
                        worst <= 1.35))  # fmt: skip
    print("\ntargets:")
    for text, passed in targets:
        print(f"  {'pass' if passed else 'FAIL'}  {text}")
    defaults = {"images": 1500, "image_size": (720, 480), "refreshes": 30, "share": 0.01,
                "write_mb": 512, "pause": 5.0}  # fmt: skip
    flags = "".join(
        f" --{k.replace('_', '-')} {'x'.join(map(str, v)) if isinstance(v, tuple) else v}"
        for k, v in vars(args).items()
        if k in defaults and v != defaults[k]
    )
    print(f"reproduce: python tools/refresh_bench.py{flags}")
    if args.json:
        figures = {
            "images": full["count"],
            "image_size": [w, h],
            "record_bytes": record,
            "steps": dict(rows),
            "refreshes": series,
            "write_mb_per_s": {"after_pause": paused, "back_to_back": at_once},
            "pause_s": args.pause,
            "verify_ok": ok,
            "targets": [{"target": t, "pass": ok_} for t, ok_ in targets],
        }
        args.json.write_text(json.dumps(figures, indent=1))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
