"""Compaction: a cache's current records copied into a data file of their own, without garbage."""

from __future__ import annotations

import os
import time
import zlib
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import _generation as generation
from . import format as fmt
from ._files import create_data_file, write_pixels
from ._generation import (
    garbage_bytes,
    live_bytes,
    new_generation,
    remove_stale_generations,
    retire,
    write_generation,
    write_manifest,
    writer_lock,
)
from ._layout import layout_offsets
from ._opening import open_for_reading, open_for_writing
from ._session import new_report
from .errors import CacheFormatError
from .reports import BuildReport
from .sources import carry_member_table
from .space import check_free_space, disk_bytes


def compact(cache: str | os.PathLike) -> BuildReport:
    """Write the cache's current records into a data file of their own, in index order, with
    no garbage between them, and publish that as a new generation (``compact_cache``)."""
    start = time.perf_counter()
    folder = fmt.cache_folder(cache)
    fmt.read_manifest(folder)  # no cache there: its error, before anything else
    with writer_lock(folder):
        files = fmt.read_cache_files(fmt.read_manifest(folder))
        files = remove_stale_generations(folder, files) or files
        m = files.manifest
        nbytes = fmt.record_nbytes(files.index, m.pixels, m.mask)
        offsets, data_bytes = layout_offsets(nbytes)
        gen = new_generation()
        sizes = {**m.sizes, "data": data_bytes}
        check_free_space(
            folder,
            disk_bytes(sizes),
            advice="free some space there; the cache is unchanged (a compaction writes the "
            "compact data file beside the current one)",
        )
        with generation.discarded_on_failure(
            folder, gen, "nothing was published; the cache is intact"
        ):
            create_data_file(folder / fmt.file_name("data", gen), data_bytes)
            copied = copy_filled(files, offsets, folder / fmt.file_name("data", gen))
            index = files.index.copy()
            index["offset"] = offsets
            sizes = write_generation(
                folder,
                gen,
                index,
                files.state.copy(),
                files.paths_blob,
                data_bytes,
                fields_blob=files.fields_blob,
            )
            extra = {**m.extra, "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            members = carry_member_table(m, folder, gen)
            manifest = fmt.Manifest(**{**vars(m), "generation": gen, "data_generation": gen,
                                       "sizes": sizes, "extra": extra,
                                       "members": members})  # fmt: skip
            write_manifest(manifest)
        retire(m, manifest)
    codes = files.state["state"]
    return new_report(
        folder,
        codes,
        len(m.classes),
        sizes,
        copied,
        seconds=time.perf_counter() - start,
        garbage_bytes=data_bytes - live_bytes(offsets, nbytes, data_bytes),
        dropped_garbage=garbage_bytes(files),
        skipped=list(m.skipped),
    )


def copy_filled(files: fmt.CacheFiles, offsets: np.ndarray, data_path: Path) -> int:
    """Copy each FILLED record of ``files`` to its new offset in ``data_path``, checking its
    CRC-32 on the way (nothing unchecked is copied); bytes copied.

    Raises:
        CacheFormatError: a record fails its CRC-32 (nothing is published then).
    """
    filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels, files.manifest.mask)
    crcs = files.state["crc32"]
    src_path = files.manifest.file("data")
    src = open_for_reading(src_path)
    try:
        dst = open_for_writing(data_path)
        try:
            for i in filled.tolist():
                n = int(nbytes[i])
                record = os.pread(src, n, int(files.index["offset"][i]))
                if len(record) != n or zlib.crc32(record) != int(crcs[i]):
                    raise CacheFormatError(
                        f"{src_path}: record {i} ({files.path(i)}) fails its CRC-32; nothing "
                        "was compacted: run `mmcache verify --repair` on the cache first"
                    )
                write_pixels(dst, np.frombuffer(record, np.uint8), int(offsets[i]))
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return int(nbytes[filled].sum())
