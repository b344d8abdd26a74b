"""A cache as published in an object store: its objects, and ``remote.json``, which names them.

Published format 1.0
====================

A cache published under a prefix is these objects (keys relative to the prefix):

``index-<g>.bin``, ``state-<g>.bin``, ``paths-<g>.bin``, ``fields-<g>.bin``
    The files of generation ``<g>`` of the cache (``mmcache.format``), each one object.
``data-<id>.<k>.<n>``
    Chunk ``k`` (six or more decimal digits) of the data file ``data-<id>.bin``: its
    ``chunk_bytes`` bytes from ``k * chunk_bytes`` (the last chunk: what is left), ``n`` bytes
    (lowercase hex). A chunk is never rewritten: a data file's bytes below a published size never
    change (refreshes append), and a last chunk that grew is a new object, its size in its key.
``remote.json``
    Written last: a prefix without it holds no cache, and a reader that has read it finds every
    object it names. A UTF-8 JSON object, bounded as a manifest is:

    - ``"magic"``: ``"mmcache-remote"``; ``"version"``: ``[1, 0]`` (a reader refuses another
      major).
    - ``"manifest"``: the cache's ``manifest.json`` object, checked as a local one is; a pull
      writes it as the local cache's manifest.
    - ``"objects"``: for each file kind but ``data``, ``{"key", "size", "crc32"}``: the object's
      key (the manifest's file name), its size (the manifest's) and its zlib CRC-32.
    - ``"data"``: ``{"chunk_bytes", "chunks"}``, ``chunks`` the list of ``{"key", "size"}`` in
      order, covering the manifest's ``sizes["data"]`` exactly.
    - ``"checksums"``: ``{"remote": crc}``, the CRC-32 of the object without ``"checksums"``,
      computed as the manifest's is (``mmcache.format.manifest_checksum``).

Records are checked against the CRC-32s of the state object when fetched; the other files
against the manifest's checksums (and ``crc32`` above).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from .. import format as fmt
from .._checks import expect, is_int
from ..errors import CacheFormatError, CacheNotFoundError
from .stores import Store

REMOTE_NAME = "remote.json"
MAGIC = "mmcache-remote"
VERSION = (1, 0)
# Chunks of 64 MiB: a 150 GB cache is ~2,300 objects, and a push after a refresh uploads at
# most one chunk of bytes it had already uploaded.
CHUNK_BYTES = 64 << 20
MIN_CHUNK, MAX_CHUNK = 1 << 20, 4 << 30
# The keys a push may delete when no publication names them any more (nothing else is touched).
OWN_KEY = re.compile(
    r"(index|state|paths|fields)-[0-9a-f]{16}\.bin|data-[0-9a-f]{16}\.[0-9]{6,}\.[0-9a-f]+"
)


@dataclass
class Published:
    """A checked ``remote.json``: the manifest (its ``path`` where its files are to go), the
    other files' objects by kind, and the data file's chunks as ``(key, start, size)``."""

    store: Store
    manifest: fmt.Manifest
    objects: dict[str, dict[str, Any]]
    chunk_bytes: int
    chunks: list[tuple[str, int, int]]
    raw: dict[str, Any]

    def keys(self) -> set[str]:
        return {o["key"] for o in self.objects.values()} | {k for k, _, _ in self.chunks}


def chunk_key(data_name: str, k: int, size: int) -> str:
    """The key of chunk ``k`` of data file ``data_name`` (``data-<id>.bin``), of ``size`` bytes."""
    return f"{data_name.removesuffix('.bin')}.{k:06d}.{size:x}"


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
    d = fmt.json_object(raw, where)
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
    kinds = [kind for kind in m.file_kinds if kind != "data"]
    expect(isinstance(objects, dict) and sorted(objects) == sorted(kinds), where, "bad objects")
    for kind in kinds:
        o = objects[kind]
        expect(
            isinstance(o, dict)
            and o.get("key") == m.file(kind).name
            and o.get("size") == m.sizes[kind]
            and is_int(o.get("crc32"), 0, 1 << 32),
            where,
            f"object of the {kind} file does not match the manifest",
        )
    return objects


def _checked_chunks(data: Any, m: fmt.Manifest, where: Path) -> tuple[int, list]:
    expect(isinstance(data, dict), where, "no data chunks")
    size, chunk = m.sizes["data"], data.get("chunk_bytes")
    expect(is_int(chunk, MIN_CHUNK, MAX_CHUNK + 1), where, f"chunk_bytes {chunk!r} out of range")
    listed = data.get("chunks")
    n = -(-size // chunk)
    expect(isinstance(listed, list) and len(listed) == n, where, f"expected {n} data chunks")
    chunks = []
    for k, c in enumerate(listed):
        want = min(chunk, size - k * chunk)
        key = chunk_key(m.file("data").name, k, want)
        if not (isinstance(c, dict) and c.get("key") == key and c.get("size") == want):
            raise CacheFormatError(f"{where}: data chunk {k} is not {key} of {want} bytes")
        chunks.append((key, k * chunk, want))
    return chunk, chunks

