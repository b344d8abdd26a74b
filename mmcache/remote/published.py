"""A cache as published in an object store: its objects, and ``remote.json``, which names them.

Published format 1.0
====================

A cache published under a prefix is these objects (keys relative to the prefix):

``index-<g>.bin``, ``state-<g>.bin``, ``paths-<g>.bin``, ``fields-<g>.bin``, ``members-<g>.bin``
    The files of generation ``<g>`` of the cache (``mmcache.format``), each one object.
``data-<id>.<start>.<size>.<crc>``
    A chunk of the data file ``data-<id>.bin``: its ``size`` bytes from byte ``start`` (both
    lowercase hex), whose zlib CRC-32 is ``crc`` (8 hex digits). The chunks cover the data file
    from 0 to the manifest's ``sizes["data"]`` in order, without gaps. A chunk is never
    rewritten (its key names its content): a refresh appends records past the end of the data
    file, so a push after it keeps every chunk and sends the new bytes as new chunks of at most
    ``chunk_bytes``.
``remote.json``
    Written last: a prefix without it holds no cache, and a reader that has read it finds every
    object it names. A UTF-8 JSON object, bounded as a manifest is:

    - ``"magic"``: ``"mmcache-remote"``; ``"version"``: ``[1, 0]`` (a reader refuses another
      major).
    - ``"manifest"``: the cache's ``manifest.json`` object, checked as a local one is; a pull
      writes it as the local cache's manifest.
    - ``"objects"``: for each file kind but ``data``, ``{"key", "size", "crc32"}``: the object's
      key (the manifest's file name), its size (the manifest's) and its zlib CRC-32.
    - ``"data"``: ``{"chunk_bytes", "chunks"}``: the size new chunks are cut to, and the list
      of ``{"key", "start", "size", "crc32"}`` in order, covering ``sizes["data"]`` exactly.
    - ``"checksums"``: ``{"remote": crc}``, the CRC-32 of the object without ``"checksums"``,
      computed as the manifest's is (``mmcache.format.manifest_checksum``).

Records are checked against the CRC-32s of the state object when fetched; the other files
against the manifest's checksums (and ``crc32`` above).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .. import format as fmt
from .._checks import expect, is_int
from .._manifest import parse_json_object
from ..errors import CacheFormatError, CacheNotFoundError
from .stores import Store

REMOTE_NAME = "remote.json"
MAGIC = "mmcache-remote"
VERSION = (1, 0)
# Chunks of 64 MiB: a 150 GB cache is ~2,300 objects, each fetched in a few ranged requests.
CHUNK_BYTES = 64 << 20
MIN_CHUNK, MAX_CHUNK = 1 << 20, 4 << 30
# The keys a push may delete when no publication names them any more (nothing else is touched).
OWN_KEY = re.compile(
    r"(index|state|paths|fields|members)-[0-9a-f]{16}\.bin|data-[0-9a-f]{16}(\.[0-9a-f]+){2}\.[0-9a-f]{8}"
)


@dataclass
class Published:
    """A checked ``remote.json``: the manifest (its ``path`` where its files are to go), the
    other files' objects by kind, and the data file's chunks as ``(key, start, size, crc32)``."""

    store: Store
    manifest: fmt.Manifest
    objects: dict[str, dict[str, Any]]
    chunk_bytes: int
    chunks: list[tuple[str, int, int, int]]
    raw: dict[str, Any]

    @functools.cached_property
    def starts(self) -> list[int]:
        return [c[1] for c in self.chunks]

    def keys(self) -> set[str]:
        return {o["key"] for o in self.objects.values()} | {c[0] for c in self.chunks}

    def chunks_within(self, start: int, end: int) -> list[tuple[str, int, int, int]]:
        """The chunks that hold bytes ``start`` to ``end`` of the data file."""
        first = bisect.bisect_right(self.starts, start) - 1
        found = []
        for c in self.chunks[max(first, 0) :]:
            if c[1] >= end:
                break
            found.append(c)
        return found

    def read_range(self, start: int, end: int, store: Store | None = None) -> bytes:
        """Bytes ``start`` to ``end`` of the data file, from the chunks that hold them (read
        through ``store``, another client of the same prefix, or the publication's own).

        Raises:
            CacheFormatError: a chunk is missing or shorter than published.
            RemoteError: the store failed for longer than its retries allow.
        """
        parts = []
        for key, at, size, _ in self.chunks_within(start, end):
            a, b = max(start, at) - at, min(end, at + size) - at
            got = (store or self.store).get(key, a, b)
            if got is None or len(got) != b - a:
                raise CacheFormatError(
                    f"{self.store.url}/{key}: "
                    f"{'missing' if got is None else 'shorter than published'}; the cache was "
                    "pushed again since this copy began (open or pull it again), or damaged "
                    "(push it again)"
                )
            parts.append(got)
        return b"".join(parts)


def file_size(m: fmt.Manifest, kind: str) -> int:
    """The size of ``m``'s file of ``kind`` (the members file's is in its own entry)."""
    return m.members["size"] if kind == fmt.MEMBERS_KIND and m.members else m.sizes[kind]


def chunk_key(data_name: str, start: int, size: int, crc: int) -> str:
    """The key of the chunk of data file ``data_name`` (``data-<id>.bin``) of ``size`` bytes
    from ``start``, whose CRC-32 is ``crc``."""
    return f"{data_name.removesuffix('.bin')}.{start:x}.{size:x}.{crc:08x}"


def description(
    manifest_json: dict[str, Any],
    objects: dict[str, dict[str, Any]],
    chunk_bytes: int,
    chunks: list[dict[str, Any]],
) -> bytes:
    """The content of ``remote.json`` (see above)."""
    d = {
        "magic": MAGIC,
        "version": list(VERSION),
        "manifest": manifest_json,
        "objects": objects,
        "data": {"chunk_bytes": chunk_bytes, "chunks": chunks},
    }
    d["checksums"] = {"remote": fmt.manifest_checksum(d)}
    return json.dumps(d, indent=1, ensure_ascii=True).encode("ascii")


def read_published(store: Store, folder: Path) -> Published:
    """``store``'s ``remote.json``, checked; its manifest's files to be in ``folder``.

    Raises:
        CacheNotFoundError: the prefix holds no published cache.
        CacheFormatError: anything malformed: a key outside the prefix's names, sizes that do
            not add up, a damaged manifest.
    """
    where = cast(Path, f"{store.url}/{REMOTE_NAME}")  # (a URL: Path would fold its "//")
    raw = store.get(REMOTE_NAME)
    if raw is None:
        raise CacheNotFoundError(
            f"{store.url}: no cache published here (no {REMOTE_NAME}); push one with "
            f"`mmcache push CACHE {store.url}`"
        )
    d = manifest_object(raw, where)
    expect(d.get("magic") == MAGIC, where, f"not an mmcache publication (magic {MAGIC!r})")
    version = d.get("version")
    expect(
        isinstance(version, list) and len(version) == 2 and version[0] == VERSION[0],
        where,
        f"published format {version!r}, this mmcache reads {VERSION[0]}.x: upgrade mmcache",
    )
    expect(
        d.get("checksums") == {"remote": fmt.manifest_checksum(d)},
        where,
        "checksum mismatch: the file is damaged; push the cache again",
    )
    expect(isinstance(d.get("manifest"), dict), where, "no manifest")
    manifest = fmt.manifest_from_json(d["manifest"], folder, where)
    objects = _checked_objects(d.get("objects"), manifest, where)
    chunk_bytes, chunks = _checked_chunks(d.get("data"), manifest, where)
    return Published(store, manifest, objects, chunk_bytes, chunks, d)


def _checked_objects(objects: Any, m: fmt.Manifest, where: Path) -> dict[str, dict[str, Any]]:
    kinds = [kind for kind in m.written_kinds if kind != "data"]
    expect(isinstance(objects, dict) and sorted(objects) == sorted(kinds), where, "bad objects")
    for kind in kinds:
        o = objects[kind]
        expect(
            isinstance(o, dict)
            and o.get("key") == m.file(kind).name
            and o.get("size") == file_size(m, kind)
            and is_int(o.get("crc32"), 0, 1 << 32),
            where,
            f"object of the {kind} file does not match the manifest",
        )
    return objects


def _checked_chunks(data: Any, m: fmt.Manifest, where: Path) -> tuple[int, list]:
    expect(isinstance(data, dict), where, "no data chunks")
    chunk, listed = data.get("chunk_bytes"), data.get("chunks")
    expect(is_int(chunk, MIN_CHUNK, MAX_CHUNK + 1), where, f"chunk_bytes {chunk!r} out of range")
    expect(isinstance(listed, list), where, "no list of data chunks")
    chunks, at = [], 0
    for k, c in enumerate(listed):
        ok = isinstance(c, dict) and is_int(c.get("size"), 1, MAX_CHUNK + 1)
        ok = ok and c.get("start") == at and is_int(c.get("crc32"), 0, 1 << 32)
        if not ok or c.get("key") != chunk_key(m.file("data").name, at, c["size"], c["crc32"]):
            raise CacheFormatError(
                f"{where}: data chunk {k} is not the one from byte {at} its key, start, size "
                "and CRC-32 must name"
            )
        chunks.append((c["key"], at, c["size"], c["crc32"]))
        at += c["size"]
    expect(at == m.sizes["data"], where, f"data chunks cover {at} bytes, not {m.sizes['data']}")
    return chunk, chunks


def manifest_object(raw: bytes, where: Path) -> dict[str, Any]:
    """The JSON object ``raw``, within the bounds of a manifest."""
    return parse_json_object(raw, where, fmt.MAX_MANIFEST_BYTES, fmt.MAX_MANIFEST_COST)
