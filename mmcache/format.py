"""The on-disk cache format: its specification, and the code that reads and checks its files.

Format version 5.1
==================

A cache is one folder; move or copy it as a unit. Its files:

``manifest.json``
    UTF-8 JSON object, at most ``MAX_MANIFEST_BYTES``, of at most ``MAX_MANIFEST_COST`` as
    ``manifest_parse_cost`` estimates it (not millions of tiny values). It is the commit
    point: a folder without it holds no cache, and a reader reads it once and then only the
    files it names. Writers escape every non-ASCII character (``\\uXXXX``), so a file name
    that is not valid UTF-8 is stored as Python's ``surrogateescape`` reads it (each
    undecodable byte as ``\\udc80`` to ``\\udcff``). Keys:

    - ``"magic"``: MUST be ``"mmcache"``.
    - ``"format_version"``: ``[major, minor]``, 5.1 for every cache written now (5.0 lacks only
      ``"members"``). A reader MUST refuse another major (1.0 to 4.0 were development versions
      of mmcache, which readers refuse, saying how to rebuild the cache) and SHOULD read a newer
      minor: a minor only adds keys a reader may ignore. Whatever a reader must understand is a
      feature in ``"requires"``.
    - ``"requires"``: the sorted list of the features this cache uses that a reader must
      understand, and no others: ``"layout:<name>"`` (always: the record layout,
      ``options["pixels"]``), ``"masks"`` (records carry masks, ``options["mask"]``),
      ``"fields"`` (the ``fields`` file), ``"fill-markers"`` (a ``"lazy"`` cache: the
      ``filling-<token>`` files), ``"remote-fill"`` (records fetched from ``"origin"``). A
      reader MUST refuse a cache that requires a feature it does not know, naming it, and one
      whose list is not what the rest of the manifest implies.
    - ``"generation"``: 16 lowercase hex digits naming this version of the cache. ``"files"``
      maps ``"index"``, ``"state"``, ``"paths"`` to ``"<kind>-<generation>.bin"`` and ``"data"``
      to ``"data-<id>.bin"``, where ``<id>`` is the generation that created the data file: this
      one, or an earlier one whose data file it shares. ``"sizes"`` gives the files' exact byte
      sizes; for the data file, the bytes this generation's records lie within.
    - ``"count"``: the number of records N; ``"index_dtype"`` and ``"state_dtype"``: the record
      layouts below, spelled as numpy dtype descriptions, which MUST equal them exactly.
    - ``"mode"``: ``"build"`` (every record filled when published) or ``"lazy"`` (records are
      filled on first read, see ``state``).
    - ``"source"``: ``{"root", "kind"}`` with kind ``"folder"`` or ``"list"`` (and ``"list_file"``),
      or an archive's: ``"tar"``, ``"zip"``, ``"webdataset"`` (``root`` the archive, the folder
      of shards or their brace pattern; optional ``"pattern"`` and ``"label_key"``); paths are
      then member names.
    - ``"options"``: the preprocessing, as ``Options.to_json``; ``"classes"``: class names, index
      = label. ``options["pixels"]`` names the record layout (``mmcache.pixels``): ``"rgb"`` or
      ``"yuv420"``.
    - ``"skipped"`` / ``"warnings"``: lists of ``{"path", "reason"}`` for files left out / files
      whose decoder complained but produced an image.
    - ``"fingerprints"``: ``{"listing", "options", "decoder"}``, hex SHA-256 digests; ``"decoder"``
      also records the decoder versions; ``"mmcache_version"``, ``"created"``.
    - ``"fields"``: the per-record arrays of the ``fields`` file, a list of ``{"name",
      "dtype", "shape"}`` (and, for class numbers, ``"classes"``: their names), in the file's
      order. ``name``: letters, digits and ``_``, unique (a leading ``_`` marks mmcache's own,
      which readers do not return: ``_mask_path``, ``_mask_stat``); ``dtype``: one of
      ``FIELD_DTYPES``; ``shape``: ``[rows, *tail]``, the shape of one record's array, ``rows``
      -1 when it varies per record (boxes) or the fixed count. ``options["mask"]``:
      ``"uint8"`` or ``"uint16"`` when each record carries a mask (below).
    - ``"checksums"``: ``{"index", "paths", "manifest"}`` (and ``"fields"`` in a cache that has
      the file), zlib CRC-32s of the index file, of the paths file, and of the manifest itself:
      of its JSON object without ``"checksums"``, written as
      ``json.dumps(m, sort_keys=True, separators=(",", ":"))``. A reader MUST refuse a cache whose
      checksums do not match. They catch accidental damage (any burst of up to 32 flipped bits),
      not a forger: the reader checks everything else as well.

    - ``"members"`` (5.1, a cache of an archive source): ``{"file", "size", "crc32", "dtype",
      "archives"}``: this generation's ``members`` file (``members-<generation>.bin``), its
      exact size and zlib CRC-32, ``MEMBER_DTYPE`` spelled as ``index_dtype`` is, and the
      archives the records' bytes lie in, ``[path, size, mtime_ns]`` each as listed, each the
      source's ``root`` or a file directly in it (shards) or in its ``pattern``'s folder. A
      reader that ignores the key lists the archives again to find the members. A reader MUST
      ignore an entry naming another generation's file (carried over by a writer that did not
      know the key).

    - ``"origin"`` (5.1, a node-local copy, ``mmcache.remote.sparse``): ``{"url"}``, the
      store prefix the cache was pushed to, without credentials. The cache is ``"lazy"``: an
      ``EMPTY`` record is filled by fetching its bytes from that publication, and its ``crc32``
      in ``state`` is the published CRC-32 those bytes MUST have before they are written.

    Strings: class names are non-empty, unique, without NUL, at most ``MAX_NAME`` characters.

``index-<generation>.bin``
    N records of ``INDEX_DTYPE`` (little-endian, 56 bytes, no header). Record i describes image
    i: ``offset`` of its pixels in the data file (a multiple of ``DATA_ALIGN``), ``height``,
    ``width``, ``channels``, ``label``, where its source path lies in the paths file
    (``path_offset``, ``path_length``), and the source file's ``source_size`` and
    ``source_mtime_ns`` when it was listed. ``flags`` is reserved and MUST be 0.

``state-<generation>.bin``
    N records of ``STATE_DTYPE`` (8 bytes): ``crc32`` (zlib's CRC-32 of the record's pixel bytes)
    and ``state``: ``EMPTY`` (0, not yet decoded: lazy mode only), ``FILLED`` (1), or a ``BAD_*``
    code >= 2 (the file could not be cached; ``BAD_REASONS`` says why; a reader MUST refuse a
    code it does not know). Only this file changes
    after publication, and only in lazy mode: a filler writes the pixels, then ``crc32`` and
    ``state`` together, so a record that reads ``FILLED`` is complete. In a ``"build"`` cache
    every record is ``FILLED`` (a reader MUST refuse ``EMPTY`` there).

``paths-<generation>.bin``
    The source paths, relative to the source root, ``/``-separated, UTF-8 (a file name that is
    not UTF-8 keeps its bytes; read them with ``surrogateescape``), concatenated in index order
    with nothing between them. Each is 1 to ``MAX_PATH`` bytes, without NUL or backslash, and
    never absolute nor with an empty, ``.`` or ``..`` part: it cannot name a file outside the
    source root.

``fields-<generation>.bin`` (when ``"fields"`` is not empty)
    For each field in the manifest's order: N + 1 ``<u8`` row numbers (``starts``: record i's
    rows are ``starts[i]`` to ``starts[i + 1]``; ``starts[0]`` is 0 and they never decrease),
    then ``starts[N]`` rows of ``dtype`` and ``shape[1:]``, then zeros to the next multiple of 8
    bytes. Nothing follows the last field. A field of fixed ``rows`` has exactly that many
    rows per record. Boxes are ``boxes`` (rows of x1, y1, x2, y2, ``<f4``, in the stored
    image's pixels, which span [0, width] x [0, height]) with per-box ``labels`` and
    ``iscrowd``.

``members-<generation>.bin`` (with ``"members"``)
    N records of ``MEMBER_DTYPE`` (32 bytes): where record i's source bytes lie, so that a lazy
    fill, a check against the source or a repair reads its member without listing the archive.
    ``archive`` (an index into ``members["archives"]``); ``offset`` and ``length``: the
    member's stored bytes in it; ``header``: how many bytes before ``offset`` its headers
    start (a tar's header blocks, long-name and pax ones included; a zip's local header);
    ``method``: 0 stored, 8 deflated (zip's numbers); ``crc32``: the zip's CRC-32 of the
    member when ``flags`` bit 0 is set (a tar member has none); other ``flags`` bits are 0. A
    stored member's ``length`` is its record's ``source_size``. A reader MUST refuse a file
    whose size or CRC-32 is not the manifest's, or a record outside its archive as recorded,
    and reads a member's bytes only once the archive has the recorded size and mtime and the
    headers at ``offset - header`` describe that member (its name, offset, length, and for a
    tar its mtime): else it lists the archive again, as without the file.

``data-<id>.bin``
    Raw pixels: record i is ``height * width * channels`` uint8 bytes at ``offset``, row-major
    H x W x C, in layout ``"rgb"``. In layout ``"yuv420"`` (channels 3) it is
    ``height * width + 2 * ceil(height / 2) * ceil(width / 2)`` bytes: planar I420, the Y plane
    (height x width), then Cb, then Cr (each ceil(height / 2) x ceil(width / 2)), BT.601 full
    range as JFIF; ``mmcache.pixels`` states the chroma and odd-size rules. With
    ``options["mask"]``, the image's bytes are followed, from the record's next multiple of 8
    (zeros between), by its mask: height x width values of that dtype, little-endian, row-major
    (a segmentation label map, aligned with the image); the record's CRC-32 covers it all.
    Records do not overlap; they need not be in index order. A record covers its pixels and the
    padding after them up to the next multiple of ``DATA_ALIGN`` (or to ``sizes["data"]``,
    whichever comes first); bytes that no record of this generation covers are garbage (records
    of earlier generations), and gaps read as zero. A first build or a compaction leaves none.
    May be sparse (lazy mode), and may be longer than ``sizes["data"]``, never shorter.

    Generations share a data file by appending: a refresh that keeps the records of unchanged
    files where they are writes the new and modified records after ``sizes["data"]`` of the
    generation it refreshes, and publishes a generation whose records point into both parts.
    A reader of the earlier generation never looks past its own ``sizes["data"]``, so nothing it
    reads changes. A generation that starts a data file afresh (a first build, other options, or
    a compaction of the garbage) names it after itself.

``lock``
    An empty file that writers ``flock``; readers ignore it.

``filling-<token>`` (lazy mode)
    One per process that fills records, ``<token>`` 16 lowercase hex digits: it holds the boot
    id of the machine (Linux's ``/proc/sys/kernel/random/boot_id``, ASCII) and is created and
    flushed to disk, with its folder, before the process's first fill, and deleted after the
    process flushed the data and state files (when it closes its filler). Fills are not
    flushed one by one, so after a power cut a record may read ``FILLED`` while its pixels never
    reached the disk. A reader that finds a ``filling-`` file of another boot (or one it cannot
    read) MUST NOT trust a ``FILLED`` record before checking its pixels against ``crc32``, and
    SHOULD fill a record that fails again, as if ``EMPTY``. A writer holding the lock that finds
    one checks every ``FILLED`` record, writes ``EMPTY`` over the state of those that fail (a
    ``"lazy"`` cache) and flushes it, then deletes the ``filling-`` files of other boots.

Writers hold the lock, write the files of a fresh generation (index, state and paths, and
either a new data file or the records appended to the current one), flush them to disk, then
replace ``manifest.json`` atomically (``os.replace``), then delete the previous generation's
files (its data file only if the new generation does not share it). A writer that finds a data
file longer than its generation's ``sizes["data"]`` cuts it back: the rest is what a writer that
was stopped appended. A reader that already opened a generation's files keeps reading them
(POSIX keeps an unlinked file alive while it is open), so a rebuild never tears a running job.
Given this text, plain numpy reads a cache::

    m = json.load(open("cache/manifest.json"))
    index = np.fromfile("cache/" + m["files"]["index"], dtype=mmcache.format.INDEX_DTYPE)
    data = np.memmap("cache/" + m["files"]["data"], dtype=np.uint8, mode="r")
    r = index[i]
    img = data[r["offset"]:r["offset"] + r["height"] * r["width"] * r["channels"]]
    img = img.reshape(r["height"], r["width"], r["channels"])  # an "rgb" cache's record i
"""

from __future__ import annotations

import os
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import pixels as px
from ._checks import (
    check_names,
    check_relative_path,
    expect,
    expect_written,
    fail,
    first_bad,
    is_hex,
    is_int,
    read_exactly,
    validate_paths,
)
from ._fields import FIELD_DTYPES, check_fields, read_fields
from ._manifest import (
    check_entries,
    check_files,
    check_layout,
    check_manifest_checksum,
    check_members,
    check_options,
    check_origin,
    check_requires,
    check_source,
    check_version,
    load_manifest_json,
    manifest_checksum,
)
from ._opening import link_refused
from .errors import CacheFormatError

__all__ = [
    "BAD_HEADER_MISMATCH", "BAD_MASK", "BAD_REASONS", "BAD_SOURCE_CHANGED", "BAD_TOO_LARGE",
    "BAD_UNDECODABLE", "CacheFiles", "DATA_ALIGN", "EMPTY", "FEATURES", "FIELDS_KIND",
    "FIELD_DTYPES", "FILE_KINDS", "FILLED", "FILL_MARKER_PREFIX", "FORMAT_VERSION",
    "INDEX_DTYPE", "LOCK_NAME", "MAGIC", "MANIFEST_NAME", "MAX_CHANNELS", "MAX_FILE_BYTES",
    "MAX_MANIFEST_BYTES", "MAX_NAME", "MAX_PATH", "MAX_SIDE", "MEMBERS_KIND", "MEMBER_DTYPE",
    "Manifest",
    "STATE_DTYPE", "cache_folder", "check_relative_path", "dtype_descr", "file_name",
    "is_cache_file_name", "is_fill_marker_name", "is_generation_file_name",
    "manifest_checksum", "manifest_from_json", "open_cache", "read_cache_files", "read_manifest",
    "record_nbytes", "record_shapes", "validate_records",
]  # fmt: skip

MAGIC = "mmcache"
# The one version every writer writes. It follows the development versions 1.0 to 4.0 rather
# than starting again at 1.0, so that no cache they wrote can pass for one of this format.
FORMAT_VERSION = (5, 1)
# The features a cache may require (its manifest's "requires"): what this reader understands.
FEATURES = ("fields", "fill-markers", "masks", "remote-fill", *(f"layout:{n}" for n in px.LAYOUTS))
MANIFEST_NAME = "manifest.json"
LOCK_NAME = "lock"
FILE_KINDS = ("index", "state", "paths", "data")
# The side file of a cache with fields.
FIELDS_KIND = "fields"
# The side file of a cache of an archive source: where each record's member lies in it.
MEMBERS_KIND = "members"
# The files of processes filling a lazy cache (see the spec).
FILL_MARKER_PREFIX = "filling-"
# A manifest lists class names and skipped files; 64 MiB holds millions of them and bounds
# what a hostile manifest can make us allocate.
MAX_MANIFEST_BYTES = 64 << 20
# What parsing a manifest may cost in Python objects, estimated from its bytes before it is
# parsed (``manifest_parse_cost``): 64 MiB of ``[[],[],...`` took 1.9 GB, while a manifest of
# skipped-file entries costs about twice its size.
MAX_MANIFEST_COST = 512 << 20
# Records start on 64-byte boundaries (as numpy's ARRAY_ALIGN): a cache line, so a copy of a
# record never starts mid-line. Larger (4096) would waste a third of a 32x32 RGB record.
DATA_ALIGN = 64
# A bound on any single dimension, far above any real image, so shape arithmetic on hostile
# index values cannot overflow int64.
MAX_SIDE = 1 << 20
MAX_CHANNELS = 4
# Bounds on stored strings: Linux's PATH_MAX for a source path; class names are folder names
# (255 bytes on most filesystems) or list labels, and 4096 leaves room for either.
MAX_PATH = 4096
MAX_NAME = 4096
# File sizes recorded in a manifest stay below 2**62, so sums of them never overflow int64.
MAX_FILE_BYTES = 1 << 62

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
MEMBER_DTYPE = np.dtype(
    [
        ("offset", "<u8"),
        ("length", "<u8"),
        ("archive", "<u4"),
        ("header", "<u4"),
        ("crc32", "<u4"),
        ("method", "<u2"),
        ("flags", "<u2"),
    ]
)

EMPTY = 0
FILLED = 1
BAD_UNDECODABLE = 2
BAD_HEADER_MISMATCH = 3
BAD_TOO_LARGE = 4
BAD_SOURCE_CHANGED = 5
BAD_TRUNCATED = 6
BAD_MASK = 7
BAD_REASONS = {
    BAD_UNDECODABLE: "the decoder could not read it",
    BAD_HEADER_MISMATCH: "its header disagrees with its decoded size",
    BAD_TOO_LARGE: "it has more pixels than the limit",
    BAD_SOURCE_CHANGED: "it changed or vanished since it was listed",
    BAD_TRUNCATED: "truncated: the file ends before its image data does",
    BAD_MASK: "its mask or COCO size is missing, unreadable, or does not fit it",
}


def dtype_descr(dtype: np.dtype) -> list[list[str]]:
    """A dtype as the JSON list ``[[name, type], ...]`` the manifest stores."""
    names, fields = dtype.names, dtype.fields
    if names is None or fields is None:
        raise ValueError(f"{dtype} is not a structured dtype")
    return [[name, fields[name][0].str] for name in names]


def record_shapes(index: np.ndarray) -> np.ndarray:
    """(N, 3) int64 array of every record's (height, width, channels)."""
    return np.stack([index["height"], index["width"], index["channels"]], 1).astype(np.int64)


def record_nbytes(index: np.ndarray, layout: str, mask: str | None = None) -> np.ndarray:
    """int64 array of every record's size in the data file, stored in ``layout`` (a
    manifest's ``pixels``) with a ``mask`` of that dtype if given (its ``mask``):
    height * width * channels for RGB without a mask."""
    return px.record_nbytes(
        index["height"].astype(np.int64),
        index["width"].astype(np.int64),
        index["channels"].astype(np.int64),
        layout,
        mask,
    )


def file_name(kind: str, generation: str) -> str:
    return f"{kind}-{generation}.bin"


def is_cache_file_name(name: str) -> bool:
    """Whether a folder entry is one mmcache writes (so the folder may be reused for a cache)."""
    return (
        name in (MANIFEST_NAME, LOCK_NAME)
        or name.startswith(MANIFEST_NAME + ".tmp")
        or is_generation_file_name(name)
        or is_fill_marker_name(name)
    )


def is_fill_marker_name(name: str) -> bool:
    """Whether a folder entry is a filling process's ``filling-<token>`` file (see the spec)."""
    token = name.removeprefix(FILL_MARKER_PREFIX)
    return token != name and len(token) == 16 and is_hex(token)


def is_generation_file_name(name: str) -> bool:
    """Whether a folder entry is one of the files of a generation (``data-<gen>.bin``...)."""
    kind, _, rest = name.partition("-")
    gen, _, ext = rest.partition(".")
    kinds = (*FILE_KINDS, FIELDS_KIND, MEMBERS_KIND)
    return kind in kinds and ext == "bin" and len(gen) == 16 and is_hex(gen)


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
    skipped: list[dict[str, Any]]
    warnings: list[dict[str, str]]
    fingerprints: dict[str, str]
    decoder: dict[str, str]
    sizes: dict[str, int]
    extra: dict[str, Any] = field(default_factory=dict)
    # As read from disk (None until written); ``write_manifest`` computes them afresh.
    checksums: dict[str, int] | None = None
    # The version the file declares (a newer minor than FORMAT_VERSION reads too).
    format_version: tuple[int, int] = FORMAT_VERSION
    # The generation whose data file this one's records lie in: its own, or an earlier one's.
    data_generation: str = ""
    # The ``fields`` file's arrays, as ``{"name", "dtype", "shape"[, "classes"]}``.
    fields: list[dict[str, Any]] = field(default_factory=list)
    # The ``members`` entry (its file's size, CRC-32, archives); None: members are listed again.
    members: dict[str, Any] | None = None
    # ``{"url"}`` of the publication a node-local copy fetches its records from; None: none.
    origin: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.data_generation = self.data_generation or self.generation

    def file(self, kind: str) -> Path:
        gen = self.data_generation if kind == "data" else self.generation
        return self.path / file_name(kind, gen)

    @property
    def pixels(self) -> str:
        """The record layout, ``"rgb"`` or ``"yuv420"`` (``mmcache.pixels``)."""
        return self.options.get("pixels", "rgb")

    @property
    def mask(self) -> str | None:
        """The dtype of each record's mask, ``"uint8"`` or ``"uint16"``; None: no masks."""
        return self.options.get("mask")

    @property
    def annotated(self) -> bool:
        """Whether records carry annotations (a mask, fields)."""
        return self.mask is not None or bool(self.fields)

    @property
    def requires(self) -> list[str]:
        """The features a reader must understand to read this cache (the spec's list)."""
        uses = {"masks": self.mask is not None, "fields": bool(self.fields),
                "fill-markers": self.mode == "lazy",
                "remote-fill": self.origin is not None}  # fmt: skip
        return sorted([f"layout:{self.pixels}", *(name for name, used in uses.items() if used)])

    @property
    def file_kinds(self) -> tuple[str, ...]:
        """The kinds of this generation's files: ``FILE_KINDS``, and ``fields`` if it has any."""
        return (*FILE_KINDS, FIELDS_KIND) if self.fields else FILE_KINDS

    @property
    def written_kinds(self) -> tuple[str, ...]:
        """The kinds of all this generation's files: ``file_kinds``, and ``members`` if any."""
        return (*self.file_kinds, MEMBERS_KIND) if self.members else self.file_kinds

    @property
    def shares_data(self) -> bool:
        """Whether this generation's records lie in the data file of an earlier generation."""
        return self.data_generation != self.generation


def cache_folder(cache: str | os.PathLike) -> Path:
    """``cache`` as an absolute path, ``~`` expanded and ``..`` and ``.`` taken out (as
    ``os.path.abspath``): how every message and report names a cache."""
    return Path(os.path.abspath(Path(cache).expanduser()))


def read_manifest(cache: str | os.PathLike) -> Manifest:
    """Read and validate ``cache/manifest.json``; nothing in it is trusted before it is checked.

    Raises:
        CacheNotFoundError: no cache folder, or no manifest in it (never finished).
        CacheFormatError: anything malformed, or a format version this reader does not know.
    """
    folder = cache_folder(cache)
    mpath = folder / MANIFEST_NAME
    m = load_manifest_json(folder, mpath, MAX_MANIFEST_BYTES, MAX_MANIFEST_COST, is_cache_file_name)
    return manifest_from_json(m, folder, mpath)


def manifest_from_json(m: dict[str, Any], folder: Path, mpath: Path) -> Manifest:
    """Check a manifest's JSON object ``m`` (as ``read_manifest``), naming ``mpath`` in errors;
    its files are in ``folder``. For manifests that are not a local file (an object store's).
    """
    version = check_version(m, folder, mpath, MAGIC, FORMAT_VERSION, MAX_PATH)
    requires = check_requires(m.get("requires"), mpath, FEATURES)
    files: Any = m.get("files")
    fields_kind = FIELDS_KIND if isinstance(files, dict) and FIELDS_KIND in files else None
    checksums = check_manifest_checksum(m, mpath, fields_kind, manifest_checksum)
    # Values from the file: Any until each is checked.
    gen: Any = m.get("generation")
    expect(isinstance(gen, str) and len(gen) == 16 and is_hex(gen), mpath, "bad generation id")
    count: Any = m.get("count")
    expect(is_int(count, 0, 1 << 40), mpath, f"bad count {count!r}")
    for key, dtype in (("index_dtype", INDEX_DTYPE), ("state_dtype", STATE_DTYPE)):
        expect(m.get(key) == dtype_descr(dtype), mpath, f"{key} is not the layout of the spec")
    fields = check_fields(m.get("fields", []), mpath, MAX_NAME)
    kinds = (*FILE_KINDS, FIELDS_KIND) if fields else FILE_KINDS
    data_gen, sizes = check_files(m, kinds, gen, mpath, file_name, _data_generation, MAX_FILE_BYTES)
    expect(sizes["index"] == count * INDEX_DTYPE.itemsize, mpath, "index size != count")
    expect(sizes["state"] == count * STATE_DTYPE.itemsize, mpath, "state size != count")
    expect(sizes["paths"] >= count, mpath, "paths file smaller than one byte per record")
    mode: Any = m.get("mode")
    expect(mode in ("build", "lazy"), mpath, f"unknown mode {mode!r}")
    classes = check_names(m.get("classes"), mpath, MAX_NAME)
    expect(count == 0 or bool(classes), mpath, "records but no classes")
    for key in ("source", "options", "fingerprints", "decoder"):
        expect(isinstance(m.get(key), dict), mpath, f"{key} must be an object")
    check_source(m["source"], mpath, MAX_PATH)
    check_layout(m["options"], mpath)
    check_options(m["options"], mpath)
    check_entries(m, mpath, MAX_PATH)
    members = check_members(m, count, mpath, file_name(MEMBERS_KIND, gen), MEMBER_DTYPE, MAX_PATH)
    known = {
        "magic", "format_version", "generation", "files", "sizes", "count", "index_dtype",
        "state_dtype", "mode", "source", "options", "classes", "skipped", "warnings",
        "fingerprints", "decoder", "checksums", "fields", "requires", "members", "origin",
    }  # fmt: skip
    manifest = Manifest(
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
        checksums=checksums,
        format_version=version,
        data_generation=data_gen,
        fields=fields,
        members=members,
        origin=check_origin(m, mode, mpath, MAX_PATH),
    )
    expect(
        requires == manifest.requires,
        mpath,
        f"requires {requires} where the cache uses {manifest.requires}: the manifest was "
        "damaged or edited; rebuild the cache",
    )
    return manifest


def _data_generation(name: Any) -> str | None:
    """The ``<id>`` of a data file name ``data-<id>.bin``, or None if it is not one."""
    if not isinstance(name, str) or not is_generation_file_name(name):
        return None
    kind, _, rest = name.partition("-")
    return rest.partition(".")[0] if kind == "data" else None


@dataclass
class CacheFiles:
    """The validated index, states and paths of one cache generation (pixels stay on disk)."""

    manifest: Manifest
    index: np.ndarray
    state: np.ndarray
    paths_blob: bytes
    # Each field's (starts, rows): record i's rows are rows[starts[i]:starts[i + 1]].
    fields: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    fields_blob: bytes | None = None  # the fields file as read (None: the cache has none)

    def field_rows(self, name: str, i: int) -> np.ndarray:
        """Record ``i``'s rows of field ``name`` (a read-only view)."""
        starts, rows = self.fields[name]
        return rows[int(starts[i]) : int(starts[i + 1])]

    def path(self, i: int) -> str:
        r = self.index[i]
        start = int(r["path_offset"])
        # surrogateescape: the build stores a non-UTF-8 file name's bytes as they are.
        return self.paths_blob[start : start + int(r["path_length"])].decode(
            "utf-8", "surrogateescape"
        )

    def paths(self) -> list[str]:
        return [self.path(i) for i in range(len(self.index))]

    def shape(self, i: int) -> tuple[int, int, int]:
        r = self.index[i]
        return int(r["height"]), int(r["width"]), int(r["channels"])


def read_cache_files(manifest: Manifest) -> CacheFiles:
    """Read one generation's index, state and paths, and check them against each other and
    against the data file's size, so that no later read can fall outside the data file.

    Every allocation is bounded by a file size checked first, never by a number read from a file.

    Raises:
        CacheFormatError: naming the first inconsistency found.
    """
    sizes = manifest.sizes
    for kind in manifest.file_kinds:
        p = manifest.file(kind)
        try:
            st = p.lstat()  # (a link is refused, never followed: see mmcache._opening)
        except FileNotFoundError:
            raise fail(p, "missing (the cache was rebuilt or damaged)") from None
        if stat.S_ISLNK(st.st_mode):
            raise link_refused(p)
        expect(stat.S_ISREG(st.st_mode), p, "not a regular file")
        # The data file may be longer than recorded (a filesystem rounding up), never shorter:
        # a read past its end would kill the reader with SIGBUS.
        ok = st.st_size >= sizes[kind] if kind == "data" else st.st_size == sizes[kind]
        if not ok:
            raise fail(
                p,
                f"is {st.st_size} bytes, the manifest says {sizes[kind]}: the file is truncated "
                "or was not fully written",
            )
    small = [kind for kind in manifest.file_kinds if kind != "data"]
    for kind in ("index", "paths"):  # written whole (a lazy cache's state may be sparse)
        expect_written(manifest.file(kind), sizes[kind])
    blobs = {kind: read_exactly(manifest.file(kind), sizes[kind]) for kind in small}
    if manifest.checksums is not None:
        for kind in [kind for kind in small if kind != "state"]:
            actual = zlib.crc32(blobs[kind])
            expect(
                actual == manifest.checksums[kind],
                manifest.file(kind),
                f"checksum mismatch (CRC-32 {actual:08x}, the manifest says "
                f"{manifest.checksums[kind]:08x}): the file is damaged; rebuild the cache",
            )
    # bytearray blobs: the arrays are writable (lazy fill updates states in memory).
    index = np.frombuffer(blobs["index"], dtype=INDEX_DTYPE)
    state = np.frombuffer(blobs["state"], dtype=STATE_DTYPE)
    paths_blob = bytes(blobs["paths"])
    validate_records(manifest, index, state, paths_blob)
    fields_blob = bytes(blobs[FIELDS_KIND]) if manifest.fields else None
    fields = (
        read_fields(manifest.fields, fields_blob, manifest.count, manifest.file(FIELDS_KIND))
        if fields_blob is not None
        else {}
    )
    return CacheFiles(manifest, index, state, paths_blob, fields, fields_blob)


def validate_records(
    manifest: Manifest, index: np.ndarray, state: np.ndarray, paths_blob: bytes | int
) -> None:
    """Check every record's shape, offset, overlap, label, path and state (vectorised).

    ``paths_blob`` is the paths file's content (an int, its size, skips the path checks).
    """
    where, n = manifest.file("index"), manifest.count
    expect(len(index) == n and len(state) == n, where, f"expected {n} records")
    if n == 0:
        return
    data_bytes, n_classes = manifest.sizes["data"], len(manifest.classes)
    h = index["height"].astype(np.int64)
    w = index["width"].astype(np.int64)
    c = index["channels"].astype(np.int64)
    bad = (h < 1) | (h > MAX_SIDE) | (w < 1) | (w > MAX_SIDE) | (c < 1) | (c > MAX_CHANNELS)
    first_bad(bad, where, "height, width or channels out of range")
    layout = manifest.pixels
    if px.layout_named(layout).colour_only:
        first_bad(c != 3, where, f"channels is not 3 in a {layout} cache")
    # <= 2**42 within the bounds: exact
    nbytes = record_nbytes(index, layout, manifest.mask).astype(np.uint64)
    off = index["offset"]
    first_bad(off % DATA_ALIGN != 0, where, f"offset not a multiple of {DATA_ALIGN}")
    # Exact unsigned arithmetic (float64 would round offsets above 2**53): off + n <= size.
    limit = np.uint64(data_bytes)
    first_bad(
        (off > limit) | (nbytes > limit - np.minimum(off, limit)),
        where,
        f"record ends past the data file ({data_bytes} bytes)",
    )
    order = np.argsort(off, kind="stable") if (np.diff(off.astype(np.int64)) < 0).any() else None
    o, s = (off, nbytes) if order is None else (off[order], nbytes[order])
    overlaps = np.zeros(n, bool)
    overlaps[1:] = o[1:] < o[:-1] + s[:-1]
    if order is not None:
        overlaps[order] = overlaps.copy()
    first_bad(overlaps, where, "record overlaps the one before it in the data file")
    first_bad(
        (index["label"] < 0) | (index["label"] >= n_classes),
        where,
        f"label outside 0..{n_classes - 1}",
    )
    first_bad(index["flags"] != 0, where, "reserved flags set")
    codes = state["state"]
    first_bad(codes > max(BAD_REASONS), manifest.file("state"), "unknown record state")
    if manifest.mode == "build":  # (a BAD_* code is read as such: ds[i] raises DecodeError)
        first_bad(codes == EMPTY, manifest.file("state"), "empty in a built cache")
    if isinstance(paths_blob, int):
        return
    validate_paths(index, paths_blob, where, MAX_PATH)


def open_cache(cache: str | os.PathLike) -> CacheFiles:
    """``read_cache_files(read_manifest(cache))``, again if a build replaced the cache between
    the two reads (it deletes the files the first manifest named).

    Raises:
        CacheNotFoundError, CacheFormatError: as ``read_manifest`` and ``read_cache_files``.
    """
    for _ in range(3):
        manifest = read_manifest(cache)
        try:
            return read_cache_files(manifest)
        except CacheFormatError:
            if read_manifest(cache).generation == manifest.generation:
                raise  # the same cache: the damage is real
    raise CacheFormatError(f"{cache}: rebuilt three times while it was being opened; try again")
