"""The model behind tools/crash_states.py: recorded file-system calls and their crash states.

An operation's file-changing calls are recorded with ``strace -f`` (``record``) and parsed into
operations on a model file system (``parse``); the states a power cut may leave are enumerated
(``plans``), built (``materialize``), compared (``digest``) and laid out on disk
(``write_tree``)."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = 4096  # the unit a write may be torn at
SYSCALLS = (
    "open,openat,creat,close,dup,dup2,dup3,fcntl,write,pwrite64,writev,pwritev,pwritev2,lseek,"
    "ftruncate,truncate,fallocate,fsync,fdatasync,sync_file_range,rename,renameat,renameat2,"
    "unlink,unlinkat,mkdir,mkdirat,rmdir,copy_file_range,sendfile,clone,clone3,fork,vfork,"
    "execve,mmap,chdir"
)
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
