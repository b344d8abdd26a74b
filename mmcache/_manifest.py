"""The checks ``read_manifest`` applies to a manifest's parts, its format's constants passed in.

They are apart from ``mmcache.format`` so that the format's module holds its specification, its
constants and its readers; every check here raises ``CacheFormatError`` (``CacheNotFoundError``
for a folder without a manifest) with the words ``read_manifest`` always gave.
"""

from __future__ import annotations

import json
import os
import shlex
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import pixels as px
from ._checks import expect, fail, is_int, is_name
from ._opening import read_whole
from .errors import CacheNotFoundError
from .options import Options


def manifest_checksum(m: dict[str, Any]) -> int:
    """CRC-32 of a manifest object without its ``"checksums"``, in the canonical JSON form.

    Raises:
        ValueError: the object cannot be written as JSON (too deep, a huge number).
    """
    body = {k: v for k, v in m.items() if k != "checksums"}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return zlib.crc32(text.encode("ascii"))


def manifest_parse_cost(raw: bytes) -> int:
    """About how many bytes of Python objects ``json.loads(raw)`` would make: a list or dict
    (64 bytes and up), an item after a comma (a pointer, a slot: 32), a string (24 and up).
    Counted over the raw bytes (inside strings too), so it errs high, never low."""
    containers = raw.count(b"[") + raw.count(b"{")
    return 64 * containers + 32 * raw.count(b",") + 24 * (raw.count(b'"') // 2)


def no_manifest(folder: Path, manifest_name: str, is_cache_file_name: Callable[[str], bool]) -> str:
    """Why a folder without a manifest holds no cache, from what it does hold."""
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        return f"{folder}: no cache here (the folder cannot be read: {e.strerror})"
    strangers = [n for n in names if not is_cache_file_name(n)]
    if strangers:
        return (
            f"{folder}: not an mmcache cache (it holds {strangers[0]!r}"
            f"{' and more' if len(strangers) > 1 else ''}); a cache is the folder "
            "`mmcache build SOURCE CACHE` writes"
        )
    if not names:
        return f"{folder}: an empty folder, not a cache; `mmcache build SOURCE CACHE` makes one"
    return (
        f"{folder}: no finished cache here ({manifest_name} is missing: a build was stopped "
        "before it published, or is running now); run `mmcache build` again"
    )


def load_manifest_json(
    folder: Path,
    mpath: Path,
    max_bytes: int,
    max_cost: int,
    is_cache_file_name: Callable[[str], bool],
) -> dict[str, Any]:
    """The manifest's JSON object, read with a bound on its size and on its parse's cost."""
    if not folder.is_dir():
        raise CacheNotFoundError(f"{folder}: no cache here (not a folder)")
    try:
        raw = read_whole(mpath, max_bytes + 1)
    except FileNotFoundError:
        raise CacheNotFoundError(no_manifest(folder, mpath.name, is_cache_file_name)) from None
    return parse_json_object(raw, mpath, max_bytes, max_cost)


def parse_json_object(raw: bytes, mpath: Path, max_bytes: int, max_cost: int) -> dict[str, Any]:
    """The JSON object ``raw`` (a manifest, here or fetched), within a manifest's bounds."""
    expect(len(raw) <= max_bytes, mpath, f"larger than {max_bytes} bytes")
    cost = manifest_parse_cost(raw)
    expect(cost <= max_cost, mpath, f"{len(raw):,} bytes of JSON whose parse would take about "
           f"{cost:,} bytes of memory, more than the {max_cost:,} a manifest may: not a "
           "manifest mmcache wrote")  # fmt: skip
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        # ValueError also covers integers of over 4300 digits, which Python refuses to parse.
        raise fail(mpath, f"not valid JSON ({e}); the file seems damaged") from None
    expect(isinstance(m, dict), mpath, "expected a JSON object")
    return m


def check_version(
    m: dict[str, Any],
    folder: Path,
    mpath: Path,
    magic: str,
    version_read: tuple[int, int],
    max_path: int,
) -> tuple[int, int]:
    """The magic, and a format version of this reader's major (``version_read``'s)."""
    expect(m.get("magic") == magic, mpath, f"magic is {m.get('magic')!r}, expected {magic!r}")
    version: Any = m.get("format_version")
    expect(
        isinstance(version, list)
        and len(version) == 2
        and all(is_int(v, 0, 1 << 31) for v in version),
        mpath,
        f"format_version is {version!r}, expected [major, minor]",
    )
    if version[0] < version_read[0]:
        raise fail(mpath, f"written by a development version of mmcache (format "
                   f"{version[0]}.{version[1]}), which this one does not read; rebuild it: "
                   f"{rebuild_command(m, folder, max_path)}")  # fmt: skip
    if version[0] > version_read[0]:
        raise fail(
            mpath,
            f"format version {version[0]}.{version[1]} is not supported by this mmcache "
            f"(it reads {version_read[0]}.x); upgrade mmcache or rebuild the cache",
        )
    return version[0], version[1]


def rebuild_command(m: dict[str, Any], folder: Path, max_path: int) -> str:
    """The command that rebuilds an old cache from its recorded source, into the same folder."""
    source = m.get("source")
    root: Any = source.get("root") if isinstance(source, dict) else None
    root = shlex.quote(root) if is_name(root, max_path) else "SOURCE"
    return f"mmcache build {root} {shlex.quote(str(folder))}"


def check_requires(requires: Any, mpath: Path, features: tuple[str, ...]) -> list[str]:
    """The features the cache requires, every one of which this reader knows."""
    expect(
        isinstance(requires, list) and all(isinstance(f, str) for f in requires),
        mpath,
        f"requires is {requires!r}, expected a list of feature names",
    )
    unknown = [f for f in requires if f not in features]
    if unknown:
        raise fail(
            mpath,
            f"the cache requires {', '.join(map(repr, unknown))}, which this mmcache does not "
            f"know (it knows {', '.join(features)}); upgrade mmcache or rebuild the cache",
        )
    return requires


def check_manifest_checksum(
    m: dict[str, Any],
    mpath: Path,
    fields_kind: str | None,
    checksum: Callable[[dict[str, Any]], int],
) -> dict[str, int]:
    """The manifest's checksums after checking its own (``checksum`` of it; ``fields_kind``: the
    fields file's kind, when the cache has one)."""
    checksums = m.get("checksums")
    expected = {"index", "paths", "manifest"} | ({fields_kind} if fields_kind else set())
    expect(
        isinstance(checksums, dict)
        and set(checksums) == expected
        and all(is_int(v, 0, 1 << 32) for v in checksums.values()),
        mpath,
        f"checksums missing or malformed (expected {{{', '.join(sorted(expected))}}} CRC-32s)",
    )
    assert isinstance(checksums, dict)  # checked above: narrows the type
    try:
        actual = checksum(m)
    except ValueError as e:
        raise fail(mpath, f"cannot be checked ({e})") from None
    expect(
        actual == checksums["manifest"],
        mpath,
        f"checksum mismatch (CRC-32 {actual:08x}, recorded {checksums['manifest']:08x}): "
        "the manifest was damaged or edited; rebuild the cache",
    )
    return checksums


def check_files(
    m: dict[str, Any],
    kinds: tuple[str, ...],
    gen: str,
    mpath: Path,
    file_name: Callable[[str, str], str],
    data_generation: Callable[[Any], str | None],
    max_bytes: int,
) -> tuple[str, dict[str, int]]:
    """The generation whose data file holds the records (``data_generation`` of its name), and
    the sizes of the files of ``kinds``, each named ``file_name(kind, gen)`` but the data file."""
    files: Any = m.get("files")
    expect(
        isinstance(files, dict)
        and set(files) == set(kinds)
        and all(files[kind] == file_name(kind, gen) for kind in kinds if kind != "data"),
        mpath,
        "file names do not match the generation",
    )
    data_gen = data_generation(files["data"])
    if data_gen is None:
        raise fail(mpath, f"data file name {files['data']!r} is not data-<16 hex digits>.bin")
    sizes: Any = m.get("sizes")
    expect(
        isinstance(sizes, dict)
        and set(sizes) == set(kinds)
        and all(is_int(v, 0, max_bytes) for v in sizes.values()),
        mpath,
        "bad file sizes",
    )
    return data_gen, sizes


def check_source(source: dict[str, Any], mpath: Path, max_path: int) -> None:
    """The source's kind is one of mmcache.sources' table, and its paths are names."""
    # Asked here, when a manifest is read: the kinds read their bytes through the decoder,
    # which imports the format, so the table cannot be imported with this module.
    from .sources.registry import SOURCES

    kind = source.get("kind")
    expect(
        isinstance(kind, str) and kind in SOURCES,
        mpath,
        f"source kind {kind!r} is not one of {', '.join(SOURCES)}",
    )
    keys: tuple[str, ...] = SOURCES[str(kind)].path_keys
    keys += tuple(k for k in ("masks", "coco") if k in source)  # annotated caches
    for key in keys:
        expect(
            is_name(source.get(key), max_path),
            mpath,
            f"source {key} must be a non-empty path without NUL, at most {max_path} long",
        )


def check_layout(options: dict[str, Any], mpath: Path) -> None:
    """The record layout and the masks' dtype are ones this reader knows."""
    layout = options.get("pixels", "rgb")
    expect(
        isinstance(layout, str) and px.known(layout),
        mpath,
        f"records are stored in pixel layout {layout!r}, which this mmcache does not know "
        f"(it reads {', '.join(px.LAYOUTS)}); upgrade mmcache or rebuild the cache",
    )
    mask = options.get("mask")
    expect(
        mask is None or mask in px.MASKS,
        mpath,
        f"records carry masks of {mask!r}, which this mmcache does not know; upgrade mmcache "
        "or rebuild the cache",
    )


def check_options(options: dict[str, Any], mpath: Path) -> None:
    """The preprocessing options are ones this reader knows, of the types and ranges they can
    have: every reader of the cache builds ``Options`` from them."""
    try:
        Options.from_json(options)
    except (TypeError, ValueError) as e:
        raise fail(mpath, f"options are not valid: {e}; rebuild the cache") from None


def check_entries(m: dict[str, Any], mpath: Path, max_path: int) -> None:
    """The ``skipped`` and ``warnings`` lists are lists of entries."""
    for key in ("skipped", "warnings"):
        entries = m.get(key)
        expect(
            isinstance(entries, list) and all(_is_entry(e, max_path) for e in entries),
            mpath,
            f"{key} must be a list of {{path, reason}} (and integer size, mtime_ns, state)",
        )


def _is_entry(e: Any, max_path: int) -> bool:
    """A skipped/warnings entry: {path, reason} strings, optional int64 size/mtime_ns/state."""
    return (
        isinstance(e, dict)
        and is_name(e.get("path"), max_path)
        and isinstance(e.get("reason"), str)
        and all(is_int(e.get(k, 0), -(1 << 63), 1 << 63) for k in ("size", "mtime_ns", "state"))
    )


def check_members(
    m: dict[str, Any], count: int, mpath: Path, name: str, dtype: Any, max_path: int
) -> dict[str, Any] | None:
    """The ``members`` entry, its file named ``name`` and of records of ``dtype``, its archives
    the source's (None: no entry, or one naming another generation's file, which a writer that
    did not know the key carried over: the members are listed again)."""
    entry = m.get("members")
    if entry is None:
        return None
    keys = {"file", "size", "crc32", "dtype", "archives"}
    expect(isinstance(entry, dict) and set(entry) == keys, mpath,
           f"members must be {{{', '.join(sorted(keys))}}}")  # fmt: skip
    if entry["file"] != name:
        return None
    descr = [[n, dtype.fields[n][0].str] for n in dtype.names]
    expect(entry["dtype"] == descr, mpath, "members dtype is not the layout of the spec")
    expect(entry["size"] == count * dtype.itemsize, mpath, "members size != count")
    expect(is_int(entry["crc32"], 0, 1 << 32), mpath, "members crc32 is not a CRC-32")
    archives, source = entry["archives"], m["source"]
    expect(
        isinstance(archives, list)
        and all(
            isinstance(a, list)
            and len(a) == 3
            and is_name(a[0], max_path)
            and is_int(a[1], 0, 1 << 62)
            and is_int(a[2], -(1 << 63), 1 << 63)
            for a in archives
        ),
        mpath,
        "members archives must be [path, size, mtime_ns] lists",
    )
    # An archive is the source (a tar, a zip) or one of its shards: never a file elsewhere.
    folders = {source["root"], os.path.dirname(source.get("pattern") or "")} - {""}
    for path, _, _ in archives:
        expect(
            os.path.isabs(path) and (path == source["root"] or os.path.dirname(path) in folders),
            mpath,
            f"members archive {path!r} is neither the source nor a file in its folder",
        )
    return entry


def check_origin(m: dict[str, Any], mode: str, mpath: Path, max_path: int) -> dict[str, Any] | None:
    """The ``origin`` entry of a node-local copy (None: the cache is no copy): ``{"url"}``, a
    store URL without credentials, in a ``"lazy"`` cache."""
    origin = m.get("origin")
    if origin is None:
        return None
    url = origin.get("url") if isinstance(origin, dict) else None
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    expect(
        isinstance(origin, dict) and set(origin) == {"url"} and is_name(url, max_path)
        and bool(scheme) and bool(sep) and "@" not in rest.partition("/")[0],
        mpath,
        'origin must be {"url"}, a store URL without credentials',
    )  # fmt: skip
    expect(mode == "lazy", mpath, "a copy with an origin must be a lazy cache")
    return origin
