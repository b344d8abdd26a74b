"""A cache folder's lifecycle: its lock, writing a generation, publishing it, retiring the old one.

Writers follow the order the format's specification gives (``mmcache.format``): hold the lock
(``writer_lock``), write and flush a new generation's files (``write_generation``), publish it
by renaming its manifest over the old one (``write_manifest``), then delete the previous
generation's files (``retire``). A writer that fails before publishing deletes what it wrote
(``discarded_on_failure``); one that was killed leaves files the next writer removes
(``remove_stale_generations``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

from ._fields import field_row_dtype
from ._files import cut_data_file, fsync_dir
from ._filler import scrub_lost_fills
from ._opening import (
    check_writable_folder,
    create_exclusively,
    open_for_reading,
    open_for_writing,
)
from .errors import CacheError, DestinationError, NotACacheError
from .format import (
    BAD_REASONS,
    DATA_ALIGN,
    FIELDS_KIND,
    FILE_KINDS,
    FILLED,
    FORMAT_VERSION,
    INDEX_DTYPE,
    LOCK_NAME,
    MAGIC,
    MANIFEST_NAME,
    MEMBERS_KIND,
    STATE_DTYPE,
    CacheFiles,
    Manifest,
    dtype_descr,
    file_name,
    is_cache_file_name,
    is_fill_marker_name,
    manifest_checksum,
    read_cache_files,
    read_manifest,
    record_nbytes,
)
from .sources import read_member_table
from .space import disk_full_error

logger = logging.getLogger(__name__)


def write_generation(
    folder: Path,
    generation: str,
    index: np.ndarray,
    state: np.ndarray,
    paths_blob: bytes,
    data_bytes: int,
    data_generation: str | None = None,
    fields_blob: bytes | None = None,
) -> dict[str, int]:
    """Write a generation's index, state and paths files (and its ``fields`` file, if
    ``fields_blob``), cut its data file (its own, or ``data_generation``'s that it shares) to
    ``data_bytes``, and flush them all to disk; returns the file sizes the manifest records."""
    blobs = {"index": index.tobytes(), "state": state.tobytes(), "paths": paths_blob}
    if fields_blob is not None:
        blobs[FIELDS_KIND] = fields_blob
    for kind, blob in blobs.items():
        with os.fdopen(create_exclusively(folder / file_name(kind, generation)), "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    fd = open_for_writing(folder / file_name("data", data_generation or generation))
    try:
        os.ftruncate(fd, data_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {**{kind: len(blob) for kind, blob in blobs.items()}, "data": data_bytes}


def index_records(
    offsets: np.ndarray,
    shapes: np.ndarray,
    labels: np.ndarray,
    paths: list[bytes],
    source_sizes: np.ndarray,
    source_mtimes: np.ndarray,
) -> tuple[np.ndarray, bytes]:
    """The index records of a generation, in order, and the paths file they point into."""
    lengths = np.array([len(p) for p in paths], np.uint64)
    index = np.zeros(len(paths), INDEX_DTYPE)
    index["offset"] = offsets
    index["path_offset"] = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(paths) else 0
    index["path_length"] = lengths
    index["source_size"] = source_sizes
    index["source_mtime_ns"] = source_mtimes
    if len(paths):
        index["height"], index["width"], index["channels"] = np.asarray(shapes).T
    index["label"] = labels
    return index, b"".join(paths)


def fields_file(specs: list[dict[str, Any]], values: list[list[np.ndarray]]) -> bytes:
    """The content of a ``fields`` file (``mmcache.format``): for each field of ``specs``, the
    arrays of ``values`` (one per record, each of the field's row shape), in order."""
    parts = []
    for spec, arrays in zip(specs, values):
        row = field_row_dtype(spec)
        counts = np.array([len(a) for a in arrays], np.int64)
        starts = np.zeros(len(arrays) + 1, "<u8")
        starts[1:] = np.cumsum(counts)
        shape = (-1, *row.shape)
        data = (
            np.concatenate([np.asarray(a, row.base).reshape(shape) for a in arrays])
            if len(arrays) and counts.sum()
            else np.zeros((0, *row.shape), row.base)
        )
        blob = data.tobytes()
        parts += [starts.tobytes(), blob, bytes(-len(blob) % 8)]
    return b"".join(parts)


def manifest_json(manifest: Manifest) -> dict[str, Any]:
    """``manifest``'s JSON object, without ``"checksums"`` (``write_manifest`` adds them)."""
    return {
        "magic": MAGIC,
        "format_version": list(FORMAT_VERSION),
        "requires": manifest.requires,
        "generation": manifest.generation,
        "files": {kind: manifest.file(kind).name for kind in manifest.file_kinds},
        "sizes": manifest.sizes,
        "count": manifest.count,
        "index_dtype": dtype_descr(INDEX_DTYPE),
        "state_dtype": dtype_descr(STATE_DTYPE),
        "mode": manifest.mode,
        "source": manifest.source,
        "options": manifest.options,
        "classes": manifest.classes,
        "skipped": manifest.skipped,
        "warnings": manifest.warnings,
        "fingerprints": manifest.fingerprints,
        "decoder": manifest.decoder,
        **({"fields": manifest.fields} if manifest.fields else {}),
        **({"members": manifest.members} if manifest.members else {}),
        **({"origin": manifest.origin} if manifest.origin else {}),
        **manifest.extra,
    }


def write_manifest(manifest: Manifest) -> None:
    """Publish ``manifest`` atomically: write a temporary file, flush it, rename it over.

    The checksums of the index and paths files are computed here, from the files as written, so
    every writer's manifest carries them.
    """
    m = manifest_json(manifest)
    summed = [kind for kind in manifest.file_kinds if kind not in ("state", "data")]
    m["checksums"] = {kind: file_crc32(manifest.file(kind)) for kind in summed}
    m["checksums"]["manifest"] = manifest_checksum(m)
    publish_manifest(manifest.path, m)
    manifest.checksums = m["checksums"]
    manifest.format_version = FORMAT_VERSION


def publish_manifest(folder: Path, m: dict[str, Any]) -> None:
    """Write the manifest object ``m`` as ``folder``'s ``manifest.json``, atomically."""
    # A random name, created exclusively: nothing planted under a name it could guess is used.
    tmp = folder / f"{MANIFEST_NAME}.tmp{secrets.token_hex(8)}"
    fd = create_exclusively(tmp)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump(m, f, indent=1, ensure_ascii=True)  # see the spec: non-UTF-8 names
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST_NAME)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(tmp)  # a disk that filled up mid-write leaves no half manifest behind
        raise
    fsync_dir(folder)


def prepare_folder(folder: Path) -> bool:
    """Check that ``folder`` is free or holds only cache files, create it and its lock file;
    True if the folder was created.

    Raises:
        NotACacheError: a file, or a folder holding other things, is in the way.
        DestinationError: the folder cannot be created or written.
    """
    if folder.exists() and not folder.is_dir():
        raise NotACacheError(f"{folder}: a file is in the way; choose another cache path")
    if folder.is_dir():
        strangers = [n for n in os.listdir(folder) if not is_cache_file_name(n)]
        if strangers:
            raise NotACacheError(
                f"{folder}: exists and is not an mmcache cache (it holds {strangers[0]!r}"
                f"{' and more' if len(strangers) > 1 else ''}); refusing to write into it"
            )
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        check_writable_folder(folder)
        # Opening the lock file for writing is the write test: it is created on the first build.
        os.close(open_lock(folder))
    except CacheError:
        raise
    except OSError as e:
        raise DestinationError(f"{folder}: cannot write the cache here ({e.strerror})") from None
    return created


@contextmanager
def writer_lock(folder: Path) -> Iterator[None]:
    """Hold the cache's writer lock: writers of one cache run one after the other. A writer
    that has to wait says so (at INFO, on the ``mmcache`` logger) before it waits.

    Raises:
        UnsafeCacheError: the folder is another user's, or writable by others without the
            sticky bit; or the lock file is a link.
    """
    check_writable_folder(folder)
    fd = open_lock(folder)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another build of %s to finish (it holds the lock)", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_lock(folder: Path) -> int:
    """A descriptor of the folder's lock file, created if missing (exclusively: a dangling
    link in its place is refused, never followed to create its target)."""
    path = folder / LOCK_NAME
    while True:
        with suppress(FileNotFoundError):
            return open_for_writing(path)
        with suppress(FileExistsError):  # (another writer created it just now: open that)
            return create_exclusively(path)


def open_existing(folder: Path) -> CacheFiles | None:
    """The cache a writer finds in ``folder``, or None: no cache, or a damaged one (which is
    then rebuilt from scratch, nothing of it reused). Its members file too is checked: a
    build is what writes it again."""
    try:
        files = read_cache_files(read_manifest(folder))
        read_member_table(files)
        return files
    except CacheError:
        return None


def published_generation(folder: Path) -> str | None:
    """The generation the folder's manifest names now, or None."""
    try:
        return read_manifest(folder).generation
    except CacheError:
        return None


def remove_generation(folder: Path, generation: str) -> None:
    """Delete the files named after ``generation`` (those that are there): a generation that
    was being written when its writer failed. A data file it appended to is not its own."""
    for kind in (*FILE_KINDS, FIELDS_KIND, MEMBERS_KIND):
        with suppress(FileNotFoundError):
            os.unlink(folder / file_name(kind, generation))


def retire(previous: Manifest, current: Manifest) -> None:
    """Delete ``previous``'s files once ``current`` is published: its index, state and paths
    (its fields and members), and its data file unless ``current``'s records lie in it too."""
    for kind in previous.written_kinds:
        if kind != "data" or previous.file("data") != current.file("data"):
            with suppress(FileNotFoundError):
                os.unlink(previous.file(kind))


def remove_stale_generations(
    folder: Path, current: CacheFiles | None, resumed: Manifest | None = None
) -> CacheFiles | None:
    """Delete what killed writers left: the files of every generation but ``current``'s,
    temporary manifests, and bytes appended to ``current``'s data file past its
    ``sizes["data"]``; and undo what a power cut left (``scrub_lost_fills``). Only a writer
    holding the lock may call it (no other generation is being written then, and no generation
    of a longer data file is published). Returns ``current`` with its record states as they
    are now. ``resumed``: a generation being written again (a pull), whose files are kept."""
    keep = {MANIFEST_NAME, LOCK_NAME}
    for m in (current.manifest if current else None, resumed):
        keep |= {m.file(kind).name for kind in m.written_kinds} if m else set()
    for name in os.listdir(folder):  # generation files, and manifests half written
        if is_cache_file_name(name) and name not in keep and not is_fill_marker_name(name):
            with suppress(FileNotFoundError):
                os.unlink(folder / name)
    if current is None:
        return None
    if resumed is None or resumed.file("data") != current.manifest.file("data"):
        cut_data_file(current.manifest.file("data"), current.manifest.sizes["data"])
    return scrub_lost_fills(current)


@contextmanager
def discarded_on_failure(
    folder: Path, generation: str, advice: str, appended_to: tuple[Path, int] | None = None
) -> Iterator[None]:
    """Delete a new generation's files if anything fails (or is interrupted) inside, unless it
    failed after publishing them: the previous cache stays as it was. A full disk (or quota)
    is raised as ``InsufficientSpaceError``, its message ending with ``advice``.

    ``appended_to``: ``(data file, size)`` when the generation appended its records to an
    earlier generation's data file, which is then cut back to ``size``. Publishing may run
    inside, so that a disk that fills up while the manifest is written discards the new
    generation and reads as InsufficientSpaceError.
    """
    try:
        yield
    except BaseException as e:
        if published_generation(folder) == generation:  # failed after the commit point
            raise
        remove_generation(folder, generation)
        if appended_to is not None:  # what was appended to the shared data file
            cut_data_file(*appended_to)
        full = disk_full_error(e, folder, advice)
        if full is not None:
            raise full from None
        raise


def new_generation() -> str:
    return secrets.token_hex(8)


def file_crc32(path: Path, chunk: int = 1 << 20) -> int:
    """zlib CRC-32 of a whole file, read in 1 MiB chunks."""
    crc = 0
    with os.fdopen(open_for_reading(path), "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def live_bytes(offsets: np.ndarray, nbytes: np.ndarray, data_size: int) -> int:
    """Bytes of a data file of ``data_size`` bytes that records at ``offsets`` of ``nbytes``
    bytes cover: their pixels and the alignment padding after each (see ``mmcache.format``).

    Records start on ``DATA_ALIGN`` boundaries and do not overlap, so the padding after one
    record is never inside another and the sum counts no byte twice.
    """
    start = np.asarray(offsets, np.int64)
    size = np.asarray(nbytes, np.int64)
    padded = -(-size // DATA_ALIGN) * DATA_ALIGN
    return int(np.clip(np.minimum(padded, data_size - start), 0, None).sum())


def found_bad(files: CacheFiles) -> list[dict[str, str]]:
    """``{"path", "reason"}`` of each record in a ``BAD_*`` state: the files a lazy cache found
    bad while filling (a build leaves such files out, listing them in ``skipped``)."""
    codes = files.state["state"]
    return [
        {"path": files.path(int(i)), "reason": BAD_REASONS.get(int(codes[i]), "unknown state")}
        for i in np.flatnonzero(codes > FILLED)
    ]


def garbage_bytes(files: CacheFiles) -> int:
    """Bytes of the data file no record of this generation covers (records that refreshes
    replaced or removed); 0 after a first build or a compaction."""
    size = files.manifest.sizes["data"]
    index = files.index
    nbytes = record_nbytes(index, files.manifest.pixels, files.manifest.mask)
    return max(0, size - live_bytes(index["offset"], nbytes, size))
