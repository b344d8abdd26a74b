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
import hashlib
import itertools
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = 4096  # the unit a write may be torn at
SYSCALLS = (
    "open,openat,creat,close,dup,dup2,dup3,fcntl,write,pwrite64,writev,pwritev,pwritev2,lseek,"
    "ftruncate,truncate,fallocate,fsync,fdatasync,sync_file_range,rename,renameat,renameat2,"
    "unlink,unlinkat,mkdir,mkdirat,rmdir,copy_file_range,sendfile,clone,clone3,fork,vfork,"
    "execve,mmap,chdir"
)
OPS = ("build", "refresh-append", "refresh-compact", "compact", "copy", "lazy", "dist")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


# --- recording ------------------------------------------------------------------------------


@dataclass
class Op:
    """One change to the watched files, resolved to bytes: what a crash state keeps or not."""

    kind: str  # create, write, trunc, fsync, rename, unlink, mkdir, dirfsync
    ino: int = -1
    path: str = ""
    dest: str = ""
    offset: int = 0
    data: bytes = b""
    size: int = 0


@dataclass
class _Open:
    """An open file description (shared by dup and fork): what it is and where it writes."""

    ino: int | None  # None: a folder (its path in ``path``) or a file outside the watched roots
    path: str
    pos: int = 0
    append: bool = False


@dataclass
class FS:
    """The watched roots as the running operation saw them: folders, names, file contents."""

    roots: list[str]
    dirs: set[str] = field(default_factory=set)
    names: dict[str, int] = field(default_factory=dict)
    files: dict[int, bytearray] = field(default_factory=dict)

    def watched(self, path: str) -> bool:
        return any(path == r or path.startswith(r + "/") for r in self.roots)

    def new_ino(self, data: bytes = b"") -> int:
        ino = len(self.files)
        self.files[ino] = bytearray(data)
        return ino

    @classmethod
    def snapshot(cls, roots: list[Path]) -> FS:
        fs = cls([str(r) for r in roots])
        for root in roots:
            if not root.exists():
                continue
            fs.dirs.add(str(root))
            for dirpath, dirnames, filenames in os.walk(root):
                fs.dirs.update(os.path.join(dirpath, d) for d in dirnames)
                for f in filenames:
                    p = os.path.join(dirpath, f)
                    fs.names[p] = fs.new_ino(Path(p).read_bytes())
        return fs


def record(cmd: list[str], cwd: Path, log: Path) -> None:
    """Run ``cmd`` under ``strace -f``, its file-changing calls written to ``log``."""
    strace = ["strace", "-f", "-qq", "-xx", "-s", str(1 << 26), "-e", f"trace={SYSCALLS}",
              "-e", "signal=none", "-o", str(log)]  # fmt: skip
    run = subprocess.run(strace + cmd, cwd=cwd, env=ENV, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the recorded operation failed ({run.returncode}):\n{run.stderr[-3000:]}")


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+|0x[0-9a-f]+|\?)")
_STR = re.compile(r'"((?:\\x[0-9a-f]{2})*)"')


def _bytes(s: str) -> bytes:
    m = _STR.search(s)
    if m is None:
        raise ValueError(f"no string in {s!r}")
    return bytes.fromhex(m.group(1).replace("\\x", ""))


def _split(args: str) -> list[str]:
    """Top-level comma-separated arguments (strings are \\x-escaped: no quotes inside)."""
    out, depth, cur = [], 0, []
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur).strip())
    return out


def _num(s: str) -> int:
    s = s.strip().strip("[]")
    if "=>" in s:
        s = s.split("=>")[0].strip().strip("[]")
    return int(s, 0)


def _joined(lines: list[str]) -> list[tuple[int, str]]:
    """(pid, call) with strace's ``<unfinished ...>``/``<... resumed>`` halves joined."""
    pending: dict[int, str] = {}
    out = []
    for line in lines:
        m = _LINE.match(line)
        if not m:
            continue
        pid, rest = int(m.group(1)), m.group(2)
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        r = re.match(r"^<\.\.\. \w+ resumed>\s?(.*)$", rest)
        if r:
            rest = pending.pop(pid, "") + r.group(1)
        out.append((pid, rest))
    return out


def _read(fs: FS, o: _Open, offset: int, n: int) -> bytes:
    """What a copy read from ``o``: a watched file as the operation left it so far, or a file
    outside the watched roots (which the operation does not change) as it is now."""
    if o.ino is not None:
        return bytes(fs.files[o.ino][offset : offset + n])
    with open(o.path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def parse(log: Path, fs: FS, cwd: Path) -> list[Op]:
    """The operation's changes to the watched roots, in the order the kernel made them, each
    resolved to the bytes it wrote (``fs``, the roots as they were, is brought up to date)."""
    tables: dict[int, dict[int, tuple[_Open, bool]]] = {}  # pid -> fd -> (description, cloexec)
    ops: list[Op] = []
    unsupported: list[str] = []

    def path_of(pid: int, dirfd: str, p: str) -> str:
        raw = os.fsdecode(_bytes(p))
        if not os.path.isabs(raw):
            base = str(cwd)
            if dirfd not in ("AT_FDCWD", ""):
                o = tables.get(pid, {}).get(int(dirfd))
                base = o[0].path if o else base
            raw = os.path.join(base, raw)
        return os.path.normpath(raw)

    def write(o: _Open, off: int, data: bytes) -> None:
        if o.ino is None:
            return
        buf = fs.files[o.ino]
        if len(buf) < off:
            buf.extend(bytes(off - len(buf)))
        buf[off : off + len(data)] = data
        ops.append(Op("write", ino=o.ino, offset=off, data=bytes(data)))

    for pid, call in _joined(log.read_text().splitlines()):
        m = _CALL.match(call)
        if not m:
            continue
        name, args_s, ret_s = m.group(1), m.group(2), m.group(3)
        ret = int(ret_s, 0) if ret_s != "?" else -1
        if ret < 0:
            continue
        table = tables.setdefault(pid, {})
        a = _split(args_s)
        if name in ("clone", "clone3", "fork", "vfork"):
            if "CLONE_FILES" in args_s:
                tables[ret] = table
            else:  # (the child's first calls may be logged before the parent's return)
                tables[ret] = {**table, **tables.get(ret, {})}
        elif name == "execve":
            for fd in [fd for fd, (_, cloexec) in table.items() if cloexec]:
                del table[fd]
        elif name in ("open", "openat", "creat"):
            dirfd, p, flags = ("AT_FDCWD", a[0], a[1] if len(a) > 1 else "") if name != "openat" \
                else (a[0], a[1], a[2])  # fmt: skip
            if name == "creat":
                flags = "O_CREAT|O_WRONLY|O_TRUNC"
            path = path_of(pid, dirfd, p)
            ino = None
            if fs.watched(path) and path not in fs.dirs and "O_DIRECTORY" not in flags:
                if path not in fs.names:
                    fs.names[path] = fs.new_ino()
                    ops.append(Op("create", ino=fs.names[path], path=path))
                ino = fs.names[path]
                if "O_TRUNC" in flags and fs.files[ino]:
                    del fs.files[ino][:]
                    ops.append(Op("trunc", ino=ino, size=0))
            table[ret] = (_Open(ino, path, append="O_APPEND" in flags), "O_CLOEXEC" in flags)
        elif name == "close":
            table.pop(int(a[0]), None)
        elif name in ("dup", "dup2", "dup3") or (name == "fcntl" and "F_DUPFD" in a[1]):
            src = table.get(int(a[0]))
            if src is not None:
                table[ret] = (src[0], "O_CLOEXEC" in args_s or "F_DUPFD_CLOEXEC" in args_s)
        elif name in ("write", "pwrite64", "writev", "pwritev", "pwritev2"):
            got = table.get(int(a[0]))
            if got is None or got[0].ino is None:
                continue
            o = got[0]
            data = b"".join(bytes.fromhex(s.replace("\\x", "")) for s in _STR.findall(a[1]))
            data = data[:ret]
            if name in ("pwrite64", "pwritev", "pwritev2"):
                write(o, _num(a[3] if name == "pwrite64" else a[3]), data)
            else:
                off = len(fs.files[o.ino]) if o.append else o.pos
                write(o, off, data)
                o.pos = off + len(data)
        elif name == "lseek":
            got = table.get(int(a[0]))
            if got is not None:
                got[0].pos = ret
        elif name in ("ftruncate", "truncate", "fallocate"):
            if name == "truncate":
                path = path_of(pid, "AT_FDCWD", a[0])
                ino = fs.names.get(path)
            else:
                got = table.get(int(a[0]))
                ino = got[0].ino if got else None
            if ino is None:
                continue
            if name == "fallocate":
                if a[1] not in ("0",):
                    unsupported.append(call[:200])
                size = max(len(fs.files[ino]), _num(a[2]) + _num(a[3]))
            else:
                size = _num(a[1])
            buf = fs.files[ino]
            if size < len(buf):
                del buf[size:]
            else:
                buf.extend(bytes(size - len(buf)))
            ops.append(Op("trunc", ino=ino, size=size))
        elif name in ("fsync", "fdatasync"):
            got = table.get(int(a[0]))
            if got is None:
                continue
            o = got[0]
            if o.ino is not None:
                ops.append(Op("fsync", ino=o.ino))
            elif o.path in fs.dirs:
                ops.append(Op("dirfsync", path=o.path))
        elif name in ("rename", "renameat", "renameat2"):
            src, dst = (
                (path_of(pid, "AT_FDCWD", a[0]), path_of(pid, "AT_FDCWD", a[1]))
                if name == "rename"
                else (path_of(pid, a[0], a[1]), path_of(pid, a[2], a[3]))
            )
            if fs.watched(src) or fs.watched(dst):
                if src in fs.names:
                    fs.names[dst] = fs.names.pop(src)
                ops.append(Op("rename", path=src, dest=dst))
        elif name in ("unlink", "unlinkat", "rmdir"):
            path = (
                path_of(pid, "AT_FDCWD", a[0]) if name != "unlinkat" else path_of(pid, a[0], a[1])
            )
            if fs.watched(path):
                if fs.names.pop(path, None) is not None:
                    ops.append(Op("unlink", path=path))
                elif path in fs.dirs:
                    fs.dirs.discard(path)
                    ops.append(Op("rmdir", path=path))
        elif name in ("mkdir", "mkdirat"):
            path = path_of(pid, "AT_FDCWD", a[0]) if name == "mkdir" else path_of(pid, a[0], a[1])
            if fs.watched(path):
                fs.dirs.add(path)
                ops.append(Op("mkdir", path=path))
        elif name == "copy_file_range":
            src, dst = table.get(int(a[0])), table.get(int(a[2]))
            if dst is None or dst[0].ino is None:
                continue
            assert src is not None, call[:200]
            soff = _num(a[1]) if a[1] != "NULL" else src[0].pos
            doff = _num(a[3]) if a[3] != "NULL" else dst[0].pos
            write(dst[0], doff, _read(fs, src[0], soff, ret))
        elif name == "sendfile":
            dst, src = table.get(int(a[0])), table.get(int(a[1]))
            if dst is None or dst[0].ino is None:
                continue
            assert src is not None, call[:200]
            soff = _num(a[2]) if a[2] != "NULL" else src[0].pos
            write(dst[0], dst[0].pos, _read(fs, src[0], soff, ret))
            dst[0].pos += ret
        elif name == "mmap":
            got = table.get(_num(a[4])) if a[4].lstrip("-").isdigit() else None
            if got and got[0].ino is not None and "MAP_SHARED" in a[3] and "PROT_WRITE" in a[2]:
                unsupported.append(call[:200])
    if unsupported:
        raise SystemExit("calls this tool cannot replay (stores through shared mappings?):\n"
                         + "\n".join(unsupported[:5]))  # fmt: skip
    return ops


# --- crash states ---------------------------------------------------------------------------


@dataclass
class Plan:
    """What one crash state keeps: ``ops[:cut]``, less the dropped writes and undone renames;
    ``torn``: write -> the 4 KiB blocks of it kept."""

    cut: int
    dropped: frozenset[int] = frozenset()
    torn: tuple[tuple[int, tuple[int, ...]], ...] = ()
    undone: frozenset[int] = frozenset()


def _unsynced(ops: list[Op], cut: int) -> list[int]:
    """The writes among ``ops[:cut]`` that no later fsync of their file (before ``cut``) covers."""
    synced_after: dict[int, int] = {}
    for k in range(cut):
        if ops[k].kind == "fsync":
            synced_after[ops[k].ino] = k
    return [
        k for k in range(cut) if ops[k].kind == "write" and synced_after.get(ops[k].ino, -1) < k
    ]


def _undoable(ops: list[Op], cut: int) -> list[int]:
    """The renames among ``ops[:cut]`` that no later fsync of their folder (before ``cut``)
    covers."""
    last: dict[str, int] = {}
    for k in range(cut):
        if ops[k].kind == "dirfsync":
            last[ops[k].path] = k
    return [
        k for k in range(cut)
        if ops[k].kind == "rename" and last.get(os.path.dirname(ops[k].dest), -1) < k
    ]  # fmt: skip


def plans(ops: list[Op], model: str, limit: int, rng: random.Random) -> tuple[list[Plan], bool]:
    """Every crash state of ``model`` at every cut (sampled where a cut has more than ``limit``);
    and whether any cut was sampled."""
    out: list[Plan] = []
    sampled = False
    for cut in range(len(ops) + 1):
        unsynced = _unsynced(ops, cut)
        if model == "ordered":
            per_file: dict[int, list[int]] = {}
            for k in unsynced:
                per_file.setdefault(ops[k].ino, []).append(k)
            groups = list(per_file.values())
            total = 1
            for g in groups:
                total *= len(g) + 1
            if total <= limit:
                choices = itertools.product(*[range(len(g) + 1) for g in groups])
            else:
                sampled = True
                choices = ([rng.randint(0, len(g)) for g in groups] for _ in range(limit))
            for keep in choices:
                dropped = frozenset(k for g, n in zip(groups, keep) for k in g[n:])
                out.append(Plan(cut, dropped))
        else:
            undoable = _undoable(ops, cut)
            items = unsynced + undoable
            if 2 ** len(items) <= limit:
                for bits in itertools.product((0, 1), repeat=len(items)):
                    off = {k for k, b in zip(items, bits) if b}
                    out.append(Plan(cut, frozenset(off & set(unsynced)), (),
                                    frozenset(off & set(undoable))))  # fmt: skip
            else:
                sampled = True
                for _ in range(limit):
                    dropped, torn = set(), []
                    for k in unsynced:
                        r = rng.random()
                        if r < 0.4:
                            dropped.add(k)
                        elif r < 0.6:  # torn: any of its blocks kept
                            o = ops[k]
                            first, last = o.offset // BLOCK, (o.offset + len(o.data) - 1) // BLOCK
                            keep = tuple(b for b in range(first, last + 1) if rng.random() < 0.5)
                            torn.append((k, keep))
                    undone = frozenset(k for k in undoable if rng.random() < 0.5)
                    out.append(Plan(cut, frozenset(dropped), tuple(torn), undone))
    return out, sampled


def materialize(initial: FS, ops: list[Op], plan: Plan) -> dict[str, bytes | None]:
    """The watched roots as the disk holds them in crash state ``plan``: path -> bytes (None:
    a folder)."""
    dirs = set(initial.dirs)
    names = dict(initial.names)
    files = {ino: bytearray(b) for ino, b in initial.files.items()}
    torn = dict(plan.torn)
    for k in range(plan.cut):
        o = ops[k]
        if o.kind == "create":
            files[o.ino] = bytearray()
            names[o.path] = o.ino
        elif o.kind == "write":
            buf = files[o.ino]
            end = o.offset + len(o.data)
            if len(buf) < end:  # the size is kept, the lost bytes read as zeros
                buf.extend(bytes(end - len(buf)))
            if k in plan.dropped:
                continue
            if k in torn:
                for b in torn[k]:
                    lo, hi = max(o.offset, b * BLOCK), min(end, (b + 1) * BLOCK)
                    buf[lo:hi] = o.data[lo - o.offset : hi - o.offset]
            else:
                buf[o.offset : end] = o.data
        elif o.kind == "trunc":
            buf = files[o.ino]
            if o.size < len(buf):
                del buf[o.size :]
            else:
                buf.extend(bytes(o.size - len(buf)))
        elif o.kind == "rename" and k not in plan.undone and o.path in names:
            names[o.dest] = names.pop(o.path)
        elif o.kind == "unlink":
            names.pop(o.path, None)
        elif o.kind == "mkdir":
            dirs.add(o.path)
        elif o.kind == "rmdir":
            dirs.discard(o.path)
    tree: dict[str, bytes | None] = {d: None for d in dirs}
    tree.update({p: bytes(files[ino]) for p, ino in names.items()})
    return tree


def digest(tree: dict[str, bytes | None]) -> str:
    h = hashlib.sha256()
    for p in sorted(tree):
        h.update(p.encode() + b"\0")
        v = tree[p]
        h.update(b"D" if v is None else hashlib.sha256(v).digest())
    return h.hexdigest()


def write_tree(tree: dict[str, bytes | None], roots: list[str], base: Path, dest: Path) -> None:
    """Lay ``tree`` out under ``dest`` at the roots' places relative to ``base``."""
    for p, v in sorted(tree.items(), key=lambda kv: kv[0]):
        target = dest / os.path.relpath(p, base)
        if v is None:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(v)


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
