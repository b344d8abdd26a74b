"""Power cuts, crash state by crash state: record an operation's file-system calls, replay every
state the disk may hold after a power cut, and check that each reads right.

How (the approach of the ALICE study, OSDI 2014): a real mmcache operation (a build, a refresh,
a compaction, a copy, a lazy fill by two processes, a build by two torchrun ranks) runs on a
tiny cache under ``strace -f``, which records every system call that changes a file: opens
that create or truncate, writes with their offsets and bytes, ``ftruncate``, ``fsync`` and
``fdatasync``, renames, unlinks, directory fsyncs, in-kernel copies. Why strace rather than a
FUSE pass-through: it needs no mount, no package and no privilege, sees every process of the
operation (``-f``: fillers, ranks, decode workers) in the order the kernel ran their calls, and
the code under test runs on the real file system, unchanged (a FUSE file system would change
the timing and the page cache the code sees). What strace cannot see are stores through a
writable shared mapping: the tool fails if the operation makes one (mmcache writes with
``pwrite`` only), and it fails if replaying every recorded call does not give, byte for byte,
the files the operation left.

The recorded calls are replayed onto the cache as it was before the operation, cut at every
point, under two models of what a power cut keeps:

- ``ordered`` (ext4 ``data=ordered``, as documented): metadata operations (create, truncate,
  rename, unlink) are kept in order; data written before an ``fsync``/``fdatasync`` of its file is
  kept; the unsynced writes of each file may be lost, each file keeping a prefix of them;
- ``weak``: any write not covered by an fsync of its file may be missing, or torn at 4 KiB
  boundaries (any of its 4 KiB blocks kept), independently; a rename not followed by an fsync of
  its folder may be undone.

A lost write that extended a file leaves it that long, the lost bytes zero (the worst case for a
reader: the sizes look right). States are enumerated exhaustively where a crash point has at
most ``--exhaustive`` of them, else sampled (seeded: ``--seed``, printed). Identical states are
checked once.

Each distinct state is checked in a subprocess (timeout: a hang counts as such) that sees a new
boot id, as a machine after a power cut does (a user and mount namespace, ``unshare -rm``, with
``/proc/sys/kernel/random/boot_id`` bound over): ``MemmapImageDataset`` opened as is and with
``verify="first-read"`` reads every record, each compared with the pixels its source file
decodes to (before and after the operation); ``mmcache verify``; then ``mmcache build`` again,
whose cache must read right. Outcomes: ``old`` (the cache before the operation, or none before a
first build), ``new``, ``refused`` (a clear ``CacheError``); never a wrong pixel, a crash or a
hang. Usage:

    PYTHONPATH=. python tools/crash_states.py                      # every operation
    PYTHONPATH=. python tools/crash_states.py --ops lazy --quick   # one, fewer states
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# The model (recording, parsing, the crash states) is in tools/_helpers/; tools/ is put on the
# path so that the tool also imports when loaded from its file alone (tests/test_crash_states.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _helpers.crash_model import (  # noqa: E402
    ENV,
    FS,
    REPO,
    Op,  # noqa: F401 - tests/test_crash_states.py builds operations through this module
    Plan,
    digest,
    materialize,
    parse,
    plans,
    record,
    write_tree,
)

OPS = ("build", "refresh-append", "refresh-compact", "compact", "copy", "lazy", "dist")


# --- the operations -------------------------------------------------------------------------


def _image(path: Path, seed: int, size: tuple[int, int] = (12, 16)) -> None:
    import cv2
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cv2.imwrite(str(path), rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _decoded(root: Path) -> dict[str, object]:
    """What each source file must read as: cv2's decode, RGB (the caches are built as is)."""
    import cv2

    out = {}
    for p in sorted(root.rglob("*.png")):
        out[str(p.relative_to(root))] = cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB)
    return out


def _mmcache(*args: str | Path, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "mmcache", *map(str, args), "-q"], cwd=cwd, env=ENV,
                   check=True, capture_output=True)  # fmt: skip


LAZY_FILL = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from mmcache import MemmapImageDataset
    if len(sys.argv) == 3:  # filler k: its share of the records first, then all of them
        ds, k = MemmapImageDataset(sys.argv[1], on_stale="ignore"), int(sys.argv[2])
        def together(step):  # both processes fill at once, each its share first
            open(f"{__file__}.{step}{k}", "w").close()
            while not all(os.path.exists(f"{__file__}.{step}{j}") for j in range(2)):
                time.sleep(0.01)
        together("ready")
        for i in range(k, len(ds), 2):
            ds[i]
        together("shared")
        for i in range(len(ds)):
            ds[i]
        sys.exit(0)
    procs = [subprocess.Popen([sys.executable, __file__, sys.argv[1], str(k)]) for k in range(2)]
    sys.exit(max(p.wait() for p in procs))
    """
)


def prepare(op: str, work: Path, images: int, workers: int = 0) -> dict:
    """Make the source and the cache as they are before ``op``; returns what the recording
    and the checks need."""
    src, cache = work / "src", work / "cache"
    for i in range(images):
        _image(src / f"c{i % 2}" / f"{i:02d}.png", seed=i)
    before = _decoded(src)
    watch, target = [cache], cache
    if op == "build":
        cmd = ["-m", "mmcache", "build", src, cache, "--workers", str(workers), "-q"]
    elif op.startswith("refresh"):
        _mmcache("build", src, cache, "--workers", "0", cwd=work)
        before = _decoded(src)
        _image(src / "c0" / "00.png", seed=100)  # rewritten
        (src / "c1" / "01.png").unlink()  # removed
        _image(src / "c1" / "90.png", seed=101)  # added
        share = "0.99" if op == "refresh-append" else "0"
        cmd = ["-m", "mmcache", "build", src, cache, "--workers", str(workers), "--compact-at",
               share, "-q"]  # fmt: skip
    elif op == "compact":
        _mmcache("build", src, cache, "--workers", "0", cwd=work)
        _image(src / "c0" / "00.png", seed=100)
        _mmcache("build", src, cache, "--workers", "0", "--compact-at", "0.99", cwd=work)
        before = _decoded(src)
        cmd = ["-m", "mmcache", "compact", cache, "-q"]
    elif op == "copy":
        _mmcache("build", src, cache, "--workers", "0", cwd=work)
        target = work / "copy"
        watch = [target]
        before = {}
        cmd = ["-m", "mmcache", "copy", cache, target, "-q"]
    elif op == "lazy":
        sys.path.insert(0, str(REPO))
        from mmcache import create_lazy_cache

        create_lazy_cache(src, cache)
        script = work / "fill.py"
        script.write_text(LAZY_FILL)
        cmd = [script, cache]
    elif op == "dist":  # a first build by 2 ranks of torch.distributed (gloo), as torchrun runs it
        cmd = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "mmcache", "build", src, cache, "--workers", "0", "-q"]  # fmt: skip
    else:
        raise SystemExit(f"unknown operation {op!r}; one of {', '.join(OPS)}")
    os.sync()  # what was there before the operation is on disk
    return {"src": src, "target": target, "watch": watch, "before": before,
            "cmd": [sys.executable, *map(str, cmd)]}  # fmt: skip


# --- the checker ----------------------------------------------------------------------------

CHECKER = textwrap.dedent(
    """
    import json, os, pickle, shutil, sys, traceback, warnings
    import numpy as np
    warnings.simplefilter("ignore")
    from mmcache import CacheError, MemmapImageDataset, cli

    refs = pickle.load(open(sys.argv[1], "rb"))

    def read_all(cache, **kw):
        try:
            ds = MemmapImageDataset(cache, on_stale="ignore", **kw)
        except CacheError as e:
            return "refused", 0, type(e).__name__
        gen = ds.manifest.generation
        which = "new" if gen == refs["new_gen"] else "old" if gen == refs["old_gen"] else "other"
        expect = refs["after"] if which == "new" else refs["before"]
        root = str(ds.manifest.source.get("root", ""))
        wrong = 0
        try:
            rels = [os.path.relpath(p, root) for p, _ in ds.samples]
            if sorted(rels) != sorted(expect):
                return "wrong-listing", len(rels), which
            for i, rel in enumerate(rels):
                if not np.array_equal(ds[i][0], expect[rel]):
                    wrong += 1
        except CacheError as e:
            return "refused", wrong, type(e).__name__
        return which, wrong, ""

    def quiet(argv):
        import contextlib, io
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return cli.main(argv)

    for line in sys.stdin:
        task = json.loads(line)
        state, out = task["state"], {}
        try:
            for mode, kw in (("default", {}), ("first-read", {"verify": "first-read"})):
                c = state + "-" + mode
                shutil.copytree(state, c)
                target = os.path.join(c, refs["target"])
                none = not os.path.exists(os.path.join(target, "manifest.json"))
                if none and refs["old_gen"] is None:
                    out[mode] = ("old", 0, "no cache")
                else:
                    out[mode] = read_all(target, **kw)
            target = os.path.join(state, refs["target"])
            out["verify"] = quiet(["verify", target]) if os.path.exists(target) else None
            rc = quiet(["build", refs["src"], target, "--workers", "0"])
            bad = -1
            if rc == 0:  # the listing must be the source's now, every pixel right
                try:
                    ds = MemmapImageDataset(target, on_stale="ignore", verify="first-read")
                    root = str(ds.manifest.source["root"])
                    rels = [os.path.relpath(p, root) for p, _ in ds.samples]
                    bad = int(sorted(rels) != sorted(refs["after"])) or sum(
                        not np.array_equal(ds[i][0], refs["after"][rel])
                        for i, rel in enumerate(rels))
                except CacheError as e:
                    bad = -2
            out["rebuild"] = (rc, bad, "")
        except Exception:
            out["crash"] = traceback.format_exc()[-2000:]
        print(json.dumps(out), flush=True)
    """
)


def _rebooted() -> list[str]:
    """The command prefix that runs the checker as if the machine had rebooted (a new boot
    id), or [] where user namespaces are not allowed."""
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        return []
    return ["unshare", "-rm", "sh", "-c",
            'echo 00000000-0000-4000-8000-00000000c0de > "$MMCACHE_CRASH_BOOT" && '
            'mount --bind "$MMCACHE_CRASH_BOOT" /proc/sys/kernel/random/boot_id && exec "$@"',
            "sh"]  # fmt: skip


class Checker:
    """A checker process fed one state at a time; restarted after a crash or a hang."""

    def __init__(self, refs_file: Path, work: Path, timeout: float) -> None:
        self.args = [*_rebooted(), sys.executable, "-c", CHECKER, str(refs_file)]
        self.env = {**ENV, "MMCACHE_CRASH_BOOT": str(work / "boot_id")}
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def check(self, state: Path) -> dict:
        import select

        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, env=self.env, text=True,
                                         start_new_session=True)  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"state": str(state)}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            hung = not ready
            self.close()
            return {"hang": True} if hung else {"crash": "the checker process died"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self.proc = None


@dataclass
class Tally:
    states: int = 0
    distinct: int = 0
    outcomes: Counter = field(default_factory=Counter)
    wrong: int = 0
    crashes: int = 0
    hangs: int = 0
    rebuild_failures: int = 0
    verify: Counter = field(default_factory=Counter)  # mmcache verify's exit statuses
    examples: list[str] = field(default_factory=list)


def explore(op: str, models: list[str], limit: int, seed: int, images: int, timeout: float,
            work: Path, log=print, workers: int = 0) -> dict[str, Tally]:  # fmt: skip
    """Record ``op``, replay its crash states under each of ``models``, check each."""
    t = prepare(op, work, images, workers)
    initial = FS.snapshot([Path(p) for p in t["watch"]])
    old_manifest = Path(t["target"]) / "manifest.json"
    old_gen = json.loads(old_manifest.read_text())["generation"] if old_manifest.exists() else None
    trace = work / "trace.txt"
    record(t["cmd"], work, trace)
    fs = FS.snapshot([])
    fs.roots, fs.dirs = list(initial.roots), set(initial.dirs)
    fs.names, fs.files = dict(initial.names), {i: bytearray(b) for i, b in initial.files.items()}
    ops = parse(trace, fs, work)
    # The recording must give back what the operation left: every byte of every file.
    replayed = materialize(initial, ops, Plan(len(ops)))
    actual = FS.snapshot([Path(p) for p in t["watch"]])
    real = {p: bytes(actual.files[i]) for p, i in actual.names.items()} | dict.fromkeys(actual.dirs)
    if replayed != real:
        differ = sorted(set(replayed) ^ set(real)) or [p for p in real if replayed[p] != real[p]]
        raise SystemExit(f"{op}: the recorded calls do not give the operation's result: {differ}")
    new_gen = json.loads((Path(t["target"]) / "manifest.json").read_text())["generation"]
    refs = {"before": t["before"], "after": _decoded(Path(t["src"])), "old_gen": old_gen,
            "new_gen": new_gen, "src": str(t["src"]),
            "target": os.path.relpath(t["target"], work)}  # fmt: skip
    refs_file = work / "refs.pkl"
    refs_file.write_bytes(pickle.dumps(refs))
    counts = Counter(o.kind for o in ops)
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    log(f"{op}: {len(ops)} recorded changes ({kinds})")
    checker = Checker(refs_file, work, timeout)
    results: dict[str, Tally] = {}
    try:
        for model in models:
            rng = random.Random(f"{seed}-{op}-{model}")
            found, sampled = plans(ops, model, limit, rng)
            tally = results.setdefault(model, Tally())
            seen: dict[str, dict] = {}
            for plan in found:
                tree = materialize(initial, ops, plan)
                key = digest(tree)
                tally.states += 1
                if key in seen:
                    continue
                state = work / "states" / f"{model}-{len(seen)}"
                state.mkdir(parents=True)
                write_tree(tree, initial.roots, work, state)
                seen[key] = out = checker.check(state)
                shutil.rmtree(state.parent, ignore_errors=True)
                _count(tally, out, plan)
            tally.distinct = len(seen)
            log(f"  {model}: {tally.states} states ({tally.distinct} distinct"
                f"{f', sampled, seed {seed}' if sampled else ', exhaustive'}): "
                f"{dict(tally.outcomes)}, wrong pixels {tally.wrong}, crashes {tally.crashes}, "
                f"hangs {tally.hangs}, failed rebuilds {tally.rebuild_failures}; "
                f"mmcache verify exit statuses {dict(tally.verify)}")  # fmt: skip
            for e in tally.examples[:3]:
                log(f"    e.g. {e}")
    finally:
        checker.close()
    return results


def _count(tally: Tally, out: dict, plan: Plan) -> None:
    if out.get("hang"):
        tally.hangs += 1
        tally.examples.append(f"hang at cut {plan.cut}")
        return
    if "crash" in out:
        tally.crashes += 1
        tally.examples.append(f"crash at cut {plan.cut}: {out['crash'].strip().splitlines()[-1]}")
        return
    for mode in ("default", "first-read"):
        which, wrong, why = out[mode]
        tally.outcomes[which if which in ("old", "new", "refused") else "wrong"] += 1
        if which not in ("old", "new", "refused"):
            wrong = max(wrong, 1)
        if wrong:
            tally.wrong += wrong
            tally.examples.append(f"{mode}: {wrong} wrong record(s) at cut {plan.cut} ({which})")
    tally.verify["no folder" if out["verify"] is None else out["verify"]] += 1
    rc, bad, why = out["rebuild"]
    if rc != 0 or bad:
        tally.rebuild_failures += 1
        tally.examples.append(f"the next build at cut {plan.cut}: status {rc}, bad {bad} {why}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("--models", default="ordered,weak", help="ordered, weak or both")
    p.add_argument("--exhaustive", type=int, default=64,
                   help="states per crash point enumerated in full; more are sampled")  # fmt: skip
    p.add_argument("--seed", type=int, default=20261205)
    p.add_argument("--images", type=int, default=6, help="source images (default 6)")
    p.add_argument("--workers", type=int, default=2, help="the recorded builds' decode processes")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per state before a hang")
    p.add_argument("--quick", action="store_true", help="4 images, at most 8 states per point")
    p.add_argument("--workdir", help="keep the work files here (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.exhaustive = 4, 8
    if shutil.which("strace") is None:
        raise SystemExit("strace is not installed: it records the operation's calls")
    models = args.models.split(",")
    print(f"seed {args.seed}; models {', '.join(models)}; {args.images} images; "
          f"reboot simulated: {'yes' if _rebooted() else 'no (no user namespaces)'}")  # fmt: skip
    failed = 0
    start = time.perf_counter()
    for op in args.ops.split(","):
        with tempfile.TemporaryDirectory(prefix=f"mmcache-crash-{op}-", dir=args.workdir) as tmp:
            res = explore(op, models, args.exhaustive, args.seed, args.images, args.timeout,
                          Path(tmp), workers=args.workers)  # fmt: skip
        failed += sum(t.wrong + t.crashes + t.hangs + t.rebuild_failures for t in res.values())
    verdict = f"{failed} failures" if failed else "no wrong pixel, crash, hang or failed rebuild"
    print(f"{time.perf_counter() - start:.0f} s; {verdict}")
    print(f"reproduce: PYTHONPATH=. python tools/crash_states.py --ops {args.ops} "
          f"--models {args.models} --exhaustive {args.exhaustive} --seed {args.seed} "
          f"--images {args.images} --workers {args.workers}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
