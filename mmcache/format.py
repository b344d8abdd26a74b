"""The on-disk cache format: its specification, and the only code that reads or writes its files.

Format version 1.0
==================

A cache is one folder; move or copy it as a unit. Its files:

``manifest.json``
    UTF-8 JSON object, at most ``MAX_MANIFEST_BYTES``. It is the commit point: a folder without
    it holds no cache, and a reader reads it once and then only the files it names. Keys:

    - ``"magic"``: MUST be ``"mmcache"``.
    - ``"format_version"``: ``[major, minor]``. A reader MUST refuse a major it does not know and
      SHOULD read a newer minor of a known major (minors only add keys). This is 1.0.
    - ``"generation"``: 16 lowercase hex digits naming the data files of this version of the
      cache; ``"files"`` maps ``"index"``, ``"state"``, ``"paths"``, ``"data"`` to their names,
      ``"<kind>-<generation>.bin"``, and ``"sizes"`` gives their exact byte sizes.
    - ``"count"``: the number of records N; ``"index_dtype"`` and ``"state_dtype"``: the record
      layouts below, spelled as numpy dtype descriptions, which MUST equal them exactly.
    - ``"mode"``: ``"build"`` (every record filled when published) or ``"lazy"`` (records are
      filled on first read, see ``state``).
    - ``"source"``: ``{"root", "kind"}`` with kind ``"folder"`` or ``"list"`` (and ``"list_file"``).
    - ``"options"``: the preprocessing, as ``Options.to_json``; ``"classes"``: class names, index
      = label.
    - ``"skipped"`` / ``"warnings"``: lists of ``{"path", "reason"}`` for files left out / files
      whose decoder complained but produced an image.
    - ``"fingerprints"``: ``{"listing", "options", "decoder"}``, hex SHA-256 digests; ``"decoder"``
      also records the decoder versions; ``"mmcache_version"``, ``"created"``.

``index-<generation>.bin``
    N records of ``INDEX_DTYPE`` (little-endian, 56 bytes, no header). Record i describes image
    i: ``offset`` of its pixels in the data file (a multiple of ``DATA_ALIGN``), ``height``,
    ``width``, ``channels``, ``label``, where its source path lies in the paths file
    (``path_offset``, ``path_length``), and the source file's ``source_size`` and
    ``source_mtime_ns`` when it was listed. ``flags`` is reserved and MUST be 0.

``state-<generation>.bin``
    N records of ``STATE_DTYPE`` (8 bytes): ``crc32`` (zlib's CRC-32 of the record's pixel bytes)
    and ``state``: ``EMPTY`` (0, not yet decoded: lazy mode only), ``FILLED`` (1), or a ``BAD_*``
    code >= 2 (the file could not be cached; ``BAD_REASONS`` says why). Only this file changes
    after publication, and only in lazy mode: a filler writes the pixels, then ``crc32`` and
    ``state`` together, so a record that reads ``FILLED`` is complete.

``paths-<generation>.bin``
    The source paths, relative to the source root, ``/``-separated, UTF-8, concatenated.

``data-<generation>.bin``
    Raw pixels: record i is ``height * width * channels`` uint8 bytes at ``offset``, row-major
    H x W x C. Records are in index order; gaps between them read as zero. May be sparse.

``lock``
    An empty file that writers ``flock``; readers ignore it.

Writers publish a new version by writing the four files of a fresh generation, flushing them to
disk, then replacing ``manifest.json`` atomically (``os.replace``), then deleting the previous
generation's files. A reader that already mapped them keeps reading them (POSIX keeps an unlinked
file alive while it is open), so a rebuild never tears a running job. Given this text, plain numpy
reads a cache::

    m = json.load(open("cache/manifest.json"))
    index = np.fromfile("cache/" + m["files"]["index"], dtype=mmcache.format.INDEX_DTYPE)
    data = np.memmap("cache/" + m["files"]["data"], dtype=np.uint8, mode="r")
    r = index[i]
    img = data[r["offset"]:r["offset"] + r["height"] * r["width"] * r["channels"]]
    img = img.reshape(r["height"], r["width"], r["channels"])
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CacheFormatError, CacheNotFoundError

MAGIC = "mmcache"
FORMAT_VERSION = (1, 0)
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "lock"
FILE_KINDS = ("index", "state", "paths", "data")
# A manifest lists class names and skipped files; 64 MiB holds millions of them and bounds
# what a hostile manifest can make us allocate.
MAX_MANIFEST_BYTES = 64 << 20
# Records start on 64-byte boundaries (as numpy's ARRAY_ALIGN): a cache line, so a copy of a
# record never starts mid-line. Larger (4096) would waste a third of a 32x32 RGB record.
DATA_ALIGN = 64
# A bound on any single dimension, far above any real image, so shape arithmetic on hostile
# index values cannot overflow int64.
MAX_SIDE = 1 << 20
MAX_CHANNELS = 4

INDEX_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("path_offset", "<u8"),
        ("source_size", "<u8"),
        ("source_mtime_ns", "<i8"),
        ("height", "<u4"),
        ("width", "<u4"),
        ("channels", "<u4"),
        ("label", "<i4"),
        ("path_length", "<u4"),
        ("flags", "<u4"),
    ]
)
STATE_DTYPE = np.dtype([("crc32", "<u4"), ("state", "<u4")])

EMPTY = 0
FILLED = 1
BAD_UNDECODABLE = 2
BAD_HEADER_MISMATCH = 3
BAD_TOO_LARGE = 4
BAD_SOURCE_CHANGED = 5
BAD_REASONS = {
    BAD_UNDECODABLE: "the decoder could not read it",
    BAD_HEADER_MISMATCH: "its header disagrees with its decoded size",
    BAD_TOO_LARGE: "it has more pixels than the limit",
    BAD_SOURCE_CHANGED: "it changed or vanished since it was listed",
}


def dtype_descr(dtype: np.dtype) -> list[list[str]]:
    """A dtype as the JSON list ``[[name, type], ...]`` the manifest stores."""
    return [[name, dtype.fields[name][0].str] for name in dtype.names]


def aligned(n: int) -> int:
    """``n`` rounded up to the next multiple of ``DATA_ALIGN``."""
    return -(-n // DATA_ALIGN) * DATA_ALIGN


def layout_offsets(nbytes: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets of records of the given byte sizes laid out in order, and the data file size."""
    sizes = np.asarray(nbytes, dtype=np.int64)
    if len(sizes) == 0:
        return np.zeros(0, np.uint64), 0
    steps = -(-sizes // DATA_ALIGN) * DATA_ALIGN
    offsets = np.concatenate([[0], np.cumsum(steps[:-1])]).astype(np.uint64)
    return offsets, int(offsets[-1]) + int(sizes[-1])


def new_generation() -> str:
    return secrets.token_hex(8)


def file_name(kind: str, generation: str) -> str:
    return f"{kind}-{generation}.bin"


def is_cache_file_name(name: str) -> bool:
    """Whether a folder entry is one mmcache writes (so the folder may be reused for a cache)."""
    if name in (MANIFEST_NAME, LOCK_NAME) or name.startswith(MANIFEST_NAME + ".tmp"):
        return True
    kind, _, rest = name.partition("-")
    gen, _, ext = rest.partition(".")
    return kind in FILE_KINDS and ext == "bin" and len(gen) == 16 and _is_hex(gen)


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


@dataclass
class Manifest:
    """A validated ``manifest.json`` of one cache generation (see the module docstring)."""

    path: Path
    generation: str
    count: int
    mode: str
    source: dict[str, Any]
    options: dict[str, Any]
    classes: list[str]
    skipped: list[dict[str, str]]
    warnings: list[dict[str, str]]
    fingerprints: dict[str, str]
    decoder: dict[str, str]
    sizes: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)
    # The version the file declares (a newer minor than FORMAT_VERSION reads too).
    format_version: tuple[int, int] = FORMAT_VERSION

    def file(self, kind: str) -> Path:
        return self.path / file_name(kind, self.generation)

    def to_json(self) -> dict[str, Any]:
        return {
            "magic": MAGIC,
            "format_version": list(FORMAT_VERSION),
            "generation": self.generation,
            "files": {kind: file_name(kind, self.generation) for kind in FILE_KINDS},
            "sizes": self.sizes,
            "count": self.count,
            "index_dtype": dtype_descr(INDEX_DTYPE),
            "state_dtype": dtype_descr(STATE_DTYPE),
            "mode": self.mode,
            "source": self.source,
            "options": self.options,
            "classes": self.classes,
            "skipped": self.skipped,
            "warnings": self.warnings,
            "fingerprints": self.fingerprints,
            "decoder": self.decoder,
            **self.extra,
        }


def _fail(path: Path, what: str) -> CacheFormatError:
    return CacheFormatError(f"{path}: {what}")


def _expect(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise _fail(path, what)


def read_manifest(cache: str | os.PathLike) -> Manifest:
    """Read and validate ``cache/manifest.json``; nothing in it is trusted before it is checked.

    Raises:
        CacheNotFoundError: no cache folder, or no manifest in it (never finished).
        CacheFormatError: anything malformed, or a format version this reader does not know.
    """
    folder = Path(cache)
    mpath = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise CacheNotFoundError(f"{folder}: no cache here (not a folder)")
    try:
        with open(mpath, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CacheNotFoundError(
            f"{folder}: no finished cache here ({MANIFEST_NAME} is missing; "
            "a build that was stopped leaves none - run `mmcache build` again)"
        ) from None
    _expect(len(raw) <= MAX_MANIFEST_BYTES, mpath, f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise _fail(mpath, f"not valid JSON ({e}); the file seems damaged") from None
    _expect(isinstance(m, dict), mpath, "expected a JSON object")
    _expect(m.get("magic") == MAGIC, mpath, f"magic is {m.get('magic')!r}, expected {MAGIC!r}")
    version = m.get("format_version")
    _expect(
        isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version),
        mpath,
        f"format_version is {version!r}, expected [major, minor]",
    )
    if version[0] != FORMAT_VERSION[0]:
        raise _fail(
            mpath,
            f"format version {version[0]}.{version[1]} is not supported by this mmcache "
            f"(it reads {FORMAT_VERSION[0]}.x); upgrade mmcache or rebuild the cache",
        )
    gen = m.get("generation")
    _expect(isinstance(gen, str) and len(gen) == 16 and _is_hex(gen), mpath, "bad generation id")
    count = m.get("count")
    _expect(type(count) is int and 0 <= count < 1 << 40, mpath, f"bad count {count!r}")
    for key, dtype in (("index_dtype", INDEX_DTYPE), ("state_dtype", STATE_DTYPE)):
        _expect(m.get(key) == dtype_descr(dtype), mpath, f"{key} is not the version-1 layout")
    files = m.get("files")
    _expect(
        files == {kind: file_name(kind, gen) for kind in FILE_KINDS},
        mpath,
        "file names do not match the generation",
    )
    sizes = m.get("sizes")
    _expect(
        isinstance(sizes, dict)
        and set(sizes) == set(FILE_KINDS)
        and all(type(v) is int and v >= 0 for v in sizes.values()),
        mpath,
        "bad file sizes",
    )
    _expect(sizes["index"] == count * INDEX_DTYPE.itemsize, mpath, "index size != count")
    _expect(sizes["state"] == count * STATE_DTYPE.itemsize, mpath, "state size != count")
    mode = m.get("mode")
    _expect(mode in ("build", "lazy"), mpath, f"unknown mode {mode!r}")
    classes = m.get("classes")
    _expect(
        isinstance(classes, list) and all(isinstance(c, str) for c in classes),
        mpath,
        "classes must be a list of strings",
    )
    for key in ("source", "options", "fingerprints", "decoder"):
        _expect(isinstance(m.get(key), dict), mpath, f"{key} must be an object")
    for key in ("skipped", "warnings"):
        entries = m.get(key)
        _expect(
            isinstance(entries, list)
            and all(
                isinstance(e, dict)
                and isinstance(e.get("path"), str)
                and isinstance(e.get("reason"), str)
                for e in entries
            ),
            mpath,
            f"{key} must be a list of {{path, reason}}",
        )
    known = {
        "magic", "format_version", "generation", "files", "sizes", "count", "index_dtype",
        "state_dtype", "mode", "source", "options", "classes", "skipped", "warnings",
        "fingerprints", "decoder",
    }  # fmt: skip
    return Manifest(
        path=folder,
        generation=gen,
        count=count,
        mode=mode,
        source=m["source"],
        options=m["options"],
        classes=classes,
        skipped=m["skipped"],
        warnings=m["warnings"],
        fingerprints=m["fingerprints"],
        decoder=m["decoder"],
        sizes=sizes,
        extra={k: v for k, v in m.items() if k not in known},
        format_version=(version[0], version[1]),
    )


def write_manifest(manifest: Manifest) -> None:
    """Publish ``manifest`` atomically: write a temporary file, flush it, rename it over."""
    folder = manifest.path
    tmp = folder / f"{MANIFEST_NAME}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST_NAME)
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries, so a rename in it survives a power cut."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class CacheFiles:
    """The validated index, states and paths of one cache generation (pixels stay on disk)."""

    manifest: Manifest
    index: np.ndarray
    state: np.ndarray
    paths_blob: bytes

    def path(self, i: int) -> str:
        r = self.index[i]
        start = int(r["path_offset"])
        return self.paths_blob[start : start + int(r["path_length"])].decode("utf-8")

    def paths(self) -> list[str]:
        return [self.path(i) for i in range(len(self.index))]


def read_cache_files(manifest: Manifest) -> CacheFiles:
    """Read one generation's index, state and paths, and check them against each other and
    against the data file's size, so that no later read can fall outside the data file.

    Raises:
        CacheFormatError: naming the first inconsistency found.
    """
    sizes = manifest.sizes
    for kind in FILE_KINDS:
        p = manifest.file(kind)
        try:
            actual = p.stat().st_size
        except FileNotFoundError:
            raise _fail(p, "missing (the cache was rebuilt or damaged)") from None
        # The data file may be longer than recorded (a filesystem rounding up), never shorter:
        # a read past its end would kill the reader with SIGBUS.
        ok = actual >= sizes[kind] if kind == "data" else actual == sizes[kind]
        if not ok:
            raise _fail(
                p,
                f"is {actual} bytes, the manifest says {sizes[kind]}: the file is truncated "
                "or was not fully written",
            )
    index = np.fromfile(manifest.file("index"), dtype=INDEX_DTYPE, count=manifest.count)
    state = np.fromfile(manifest.file("state"), dtype=STATE_DTYPE, count=manifest.count)
    with open(manifest.file("paths"), "rb") as f:
        paths_blob = f.read(sizes["paths"])
    validate_records(manifest, index, state, len(paths_blob))
    return CacheFiles(manifest, index, state, paths_blob)


def validate_records(
    manifest: Manifest, index: np.ndarray, state: np.ndarray, paths_bytes: int
) -> None:
    """Check every record's shape, offset, label, path bounds and state (vectorised)."""
    if len(index) == 0:
        return
    where, data_bytes, n_classes = (
        manifest.file("index"),
        manifest.sizes["data"],
        len(manifest.classes),
    )
    h = index["height"].astype(np.int64)
    w = index["width"].astype(np.int64)
    c = index["channels"].astype(np.int64)
    bad = (h < 1) | (h > MAX_SIDE) | (w < 1) | (w > MAX_SIDE) | (c < 1) | (c > MAX_CHANNELS)
    _first_bad(bad, where, "height, width or channels out of range")
    off = index["offset"]
    _first_bad(off % DATA_ALIGN != 0, where, f"offset not a multiple of {DATA_ALIGN}")
    end = off.astype(np.float64) + (h * w * c).astype(np.float64)
    _first_bad(end > data_bytes, where, f"record ends past the data file ({data_bytes} bytes)")
    _first_bad(
        (index["label"] < 0) | (index["label"] >= max(n_classes, 1)),
        where,
        f"label outside 0..{n_classes - 1}",
    )
    pend = index["path_offset"].astype(np.float64) + index["path_length"]
    _first_bad(pend > paths_bytes, where, "path outside the paths file")
    _first_bad(index["flags"] != 0, where, "reserved flags set")
    _first_bad(state["state"] > max(BAD_REASONS), manifest.file("state"), "unknown record state")


def _first_bad(mask: np.ndarray, where: Path, what: str) -> None:
    if mask.any():
        i = int(np.flatnonzero(mask)[0])
        raise _fail(where, f"record {i}: {what} ({int(mask.sum())} such records)")


def check_relative_path(rel: str) -> str | None:
    """Why a stored source path is unsafe (absolute, escaping the root), or None if it is fine."""
    if not rel or "\x00" in rel:
        return "empty or contains NUL"
    if rel.startswith("/") or "\\" in rel:
        return "absolute or with backslashes"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "contains '.', '..' or an empty part"
    return None
