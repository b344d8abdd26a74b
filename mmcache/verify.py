"""Verifying a cache: every record's checksum, and optionally its pixels against the source.

Opening a cache already checks its structure (``format.read_cache_files``) and the checksums of
its manifest, index and paths; what opening does not read is the pixels. ``verify_cache`` reads
them all, sequentially in data-file order (the order the disk reads fastest), and compares each
record's CRC-32 with the one stored when it was written. With ``source``, it also decodes source
files again and compares the pixels, which catches what a checksum cannot: a record written
wrong in the first place, or a decoder that now decodes differently.
"""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path

import numpy as np

from . import format as fmt
from ._filler import check_trusted_source, lost_fill_markers
from ._generation import remove_stale_generations, writer_lock
from ._opening import open_for_reading
from ._redecode import redecode
from .annotations import mask_record, recorded_mask_file
from .decode import Options, preprocess, read_image, read_sample
from .errors import CacheFormatError
from .reports import BadRecord, ProgressFn, RepairReport, VerifyReport
from .sources import SOURCES, ImageReader, member_file, read_member_table

__all__ = ["repair_cache", "verify_cache"]

SOURCE_MODES = (False, "sample", "all")
# "sample" decodes 1% of the records, and at least 20: enough to catch a decoder that decodes
# every file differently, in a few seconds for ImageNet's 1.28M.
SAMPLE_FRACTION = 0.01
SAMPLE_MIN = 20
# Reads of up to 8 MiB of consecutive records: a syscall per read is then noise next to the
# copy, and the buffer stays small.
READ_BYTES = 8 << 20


def verify_cache(
    cache: str | os.PathLike,
    source: bool | str = False,
    progress: ProgressFn | None = None,
    *,
    seed: int | None = None,
) -> VerifyReport:
    """Check every filled record's CRC-32; with ``source``, compare pixels with the source too.

    Args:
        cache: the cache folder.
        source: ``False`` (checksums only), ``"sample"`` (also decode 1% of the source files, at
            least 20, chosen at random, and compare) or ``"all"`` (decode every source file).
            Files missing or changed since the build are counted, not compared.
        progress: called as ``progress(done, total)``, in records checked plus files decoded.
        seed: seeds the choice of the sample (default: a different sample each run).

    Returns:
        A ``VerifyReport``; ``report.bad`` names each bad record (index, path, what).

    Raises:
        CacheNotFoundError: no cache there.
        CacheFormatError: the cache is damaged in its structure (refused at open, or its
            members file), or its data file shrank while it was read.

    Examples:
        >>> report = verify_cache("cache/train", source="sample")  # doctest: +SKIP
        >>> report.ok, [(b.index, b.path, b.what) for b in report.bad]  # doctest: +SKIP
    """
    start = time.perf_counter()
    report = _check(fmt.open_cache(cache), source, progress, seed)
    report.seconds = time.perf_counter() - start
    return report


def _check(
    files: fmt.CacheFiles, source: bool | str, progress: ProgressFn | None, seed: int | None
) -> VerifyReport:
    """``verify_cache`` on opened cache files."""
    if source is True:
        source = "sample"
    if source not in SOURCE_MODES:
        raise ValueError(f"source must be False, 'sample' or 'all', got {source!r}")
    read_member_table(files)  # (a cache of an archive: where its members lie, checked)
    n = len(files.index)
    filled = np.flatnonzero(files.state["state"] == fmt.FILLED)
    chosen = _source_sample(filled, source, seed)
    total = len(filled) + len(chosen)
    report = VerifyReport(
        cache=files.manifest.path,
        records=n,
        checked=0,
        bytes=0,
        seconds=0.0,
        empty=int((files.state["state"] == fmt.EMPTY).sum()),
    )
    if files.manifest.mode == "build":  # a built cache has every record FILLED
        for i in np.flatnonzero(files.state["state"] != fmt.FILLED):
            code = int(files.state["state"][i])
            what = f"marked bad ({fmt.BAD_REASONS.get(code, code)}) in a built cache"
            report.bad.append(BadRecord(int(i), files.path(int(i)), what))
    check_checksums(files, filled, report, progress, total)
    if len(chosen):
        _compare_source(files, chosen, report, progress, total)
    report.bad.sort(key=lambda b: b.index)
    return report


def repair_cache(
    cache: str | os.PathLike,
    source: bool | str = False,
    progress: ProgressFn | None = None,
    *,
    workers: int | None = None,
    seed: int | None = None,
) -> RepairReport:
    """Verify a cache as ``verify_cache`` does, then decode exactly its bad records again from
    the source it was built from (``manifest.json``'s ``source.root``) and publish the result.

    The new pixels are appended to the data file and published as a new generation, atomically,
    as a refresh is: the other records stay where they are, a process that has the cache open
    keeps reading the generation it opened, and a repair stopped half-way changes nothing. A
    bad record whose source file vanished, changed since the build (its size or mtime) or no
    longer decodes is left as it is, still bad, and named in ``report.unrepaired``: the cache
    keeps every record and its order. (A build from the source then refreshes it: it decodes a
    changed file again and drops a vanished one.)

    A separate function rather than ``verify_cache(repair=True)``: verifying only reads and can
    run beside training, while a repair writes, takes the writer lock and reports what it did.

    Args:
        cache: the cache folder.
        source: which records to check, as for ``verify_cache``: ``False`` (checksums),
            ``"sample"`` or ``"all"`` (also compare with the source; records found to differ
            are repaired too).
        progress: called as ``progress(done, total)`` while verifying, then while decoding.
        workers: decode processes (default: one per core, at most one per bad record); 0
            decodes in this process.
        seed: seeds the choice of the sample.

    Returns:
        A ``RepairReport``; ``report.ok`` when the cache is sound now.

    Raises:
        CacheNotFoundError, CacheFormatError: as ``verify_cache``.
        InsufficientSpaceError: no room to append the repaired records (nothing is published).

    Examples:
        >>> report = repair_cache("cache/train")  # doctest: +SKIP
        >>> report.ok, [(b.path, b.what) for b in report.unrepaired]  # doctest: +SKIP
    """
    start = time.perf_counter()
    folder = fmt.cache_folder(cache)
    fmt.read_manifest(folder)  # no cache there: its error, before the lock file is made
    with writer_lock(folder):
        files = fmt.open_cache(folder)
        files = remove_stale_generations(folder, files) or files
        check_trusted_source(files.manifest)  # its records are decoded from the recorded root
        found = _check(files, source, progress, seed)
        found.seconds = time.perf_counter() - start
        report = RepairReport(folder, Path(files.manifest.source["root"]), found)
        failed = redecode(files, [b.index for b in found.bad], workers, progress)
        for b in found.bad:
            if b.index in failed:
                report.unrepaired.append(BadRecord(b.index, b.path, failed[b.index]))
            else:
                report.repaired.append(b)
        if report.repaired:
            report.generation = fmt.read_manifest(folder).generation
    report.seconds = time.perf_counter() - start
    return report


def check_checksums(
    files: fmt.CacheFiles,
    records: np.ndarray,
    report: VerifyReport,
    progress: ProgressFn | None = None,
    total: int = 0,
) -> None:
    """CRC-32 of each of ``records``, reading the data file in offset order with ``pread``;
    adds to ``report``'s ``checked`` and ``bytes``, and a ``BadRecord`` per mismatch.

    ``pread`` rather than a memory map: a data file truncated while we read gives a short read,
    which is reported, where a mapping would kill the process with SIGBUS. ``copy_cache``
    checks its copies with this too.

    Raises:
        CacheFormatError: the data file ends before a record does.
    """
    index = files.index
    offsets = index["offset"].astype(np.int64)[records]
    sizes = fmt.record_nbytes(index, files.manifest.pixels, files.manifest.mask)[records]
    order = np.argsort(offsets, kind="stable")
    records, offsets, sizes = records[order], offsets[order], sizes[order]
    crcs = files.state["crc32"]
    path = files.manifest.file("data")
    # Fills a power cut may have lost (lazy mode): said so, as readers fill them again.
    lost = ""
    if files.manifest.mode == "lazy" and lost_fill_markers(files.manifest.path):
        lost = ": a fill lost in a power cut, filled again when read"
    fd = open_for_reading(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        k = 0
        while k < len(records):
            # a batch: consecutive records spanning at most READ_BYTES (or one larger record)
            lo = offsets[k]
            j = k + 1
            while j < len(records) and offsets[j] + sizes[j] - lo <= READ_BYTES:
                j += 1
            span = int(offsets[j - 1] + sizes[j - 1] - lo)
            buf = os.pread(fd, span, int(lo))
            if len(buf) < span:
                raise CacheFormatError(
                    f"{path}: ends at {int(lo) + len(buf)} bytes, record {int(records[k])} "
                    "needs more: the data file was truncated while it was verified"
                )
            view = memoryview(buf)
            for r, off, size in zip(records[k:j], offsets[k:j], sizes[k:j]):
                a = int(off - lo)
                actual = zlib.crc32(view[a : a + int(size)])
                if actual != int(crcs[r]):
                    report.bad.append(
                        BadRecord(
                            int(r),
                            files.path(int(r)),
                            f"pixels fail their checksum (CRC-32 {actual:08x}, "
                            f"stored {int(crcs[r]):08x}){lost}",
                        )
                    )
            report.checked += j - k
            report.bytes += int(sizes[k:j].sum())
            k = j
            if progress is not None:
                progress(report.checked, total)
    finally:
        os.close(fd)


def _source_sample(filled: np.ndarray, source: bool | str, seed: int | None) -> np.ndarray:
    if not source:
        return np.zeros(0, np.int64)
    if source == "all" or len(filled) <= SAMPLE_MIN:
        return filled
    k = max(SAMPLE_MIN, int(len(filled) * SAMPLE_FRACTION))
    return np.sort(np.random.default_rng(seed).choice(filled, k, replace=False))


def _compare_source(
    files: fmt.CacheFiles,
    records: np.ndarray,
    report: VerifyReport,
    progress: ProgressFn | None,
    total: int,
) -> None:
    """Decode each chosen record's source file as the build did, and compare the pixels;
    records already found bad (their checksum) are not decoded: one record, one entry."""
    m = files.manifest
    try:
        options = Options.from_json(m.options)
    except (TypeError, ValueError) as e:
        raise CacheFormatError(f"{m.path / fmt.MANIFEST_NAME}: bad options ({e})") from None
    root = Path(m.source["root"])
    # An archive's members: where the members file places them (or listed again); a file
    # lies at its path, read by OpenCV or by its kind's own reader.
    kind = SOURCES[m.source["kind"]]
    members = kind.recorded(files)
    index = files.index
    path = m.file("data")
    known = {b.index for b in report.bad}
    with os.fdopen(open_for_reading(path), "rb") as f:
        for done, r in enumerate(records, 1):
            if int(r) in known:  # a record already found bad is not compared again
                pass
            elif members is not None:  # an archive's member, its bytes in a memory file
                with member_file(members.ref(int(r))) as name:
                    if name is None:
                        report.source_unavailable += 1
                    else:
                        _compare_one(f, files, int(r), Path(name), options, report,
                                     files.path(int(r)))  # fmt: skip
            else:
                src = root / files.path(int(r))
                rec = index[r]
                try:
                    st = src.stat()
                except OSError:
                    st = None
                if st is None or (st.st_size, st.st_mtime_ns) != (
                    int(rec["source_size"]),
                    int(rec["source_mtime_ns"]),
                ):
                    report.source_unavailable += 1  # missing or changed: stale, not damaged
                else:
                    _compare_one(f, files, int(r), src, options, report, reader=kind.images)
            if progress is not None:
                progress(report.checked + done, total)


def _compare_one(
    f,
    files: fmt.CacheFiles,
    r: int,
    src: Path,
    options: Options,
    report: VerifyReport,
    name: str | None = None,
    reader: ImageReader | None = None,
) -> None:
    rec = files.index[r]
    shape = files.shape(r)
    rel = files.path(r)
    # As the build decodes (cv2.imread, then preprocess), but with the output shape checked
    # before resizing: options from a damaged manifest must not make us allocate gigabytes.
    if reader is None:
        img, native = read_image(src, options, name)
    else:
        img, native, _ = read_sample(reader, str(src), options)
    if img is None:
        report.bad.append(BadRecord(r, rel, "its source no longer decodes"))
        return
    report.source_compared += 1
    assert native is not None  # read_image gives the size of every image it read
    decoded = options.output_shape(*native)
    if decoded != shape:
        report.bad.append(BadRecord(r, rel, f"stored as {shape}, the source decodes to {decoded}"))
        return
    expected = preprocess(img, options, native)
    mask = recorded_mask_file(files, r)
    if mask is not None and options.mask is not None:  # its mask, decoded again with it
        record = mask_record(expected, mask, native, options.mask)
        if isinstance(record, tuple):
            report.bad.append(BadRecord(r, rel, record[1]))
            return
        expected = record
    # The record's bytes as the build stores them (pixels, and a mask after them).
    want = np.frombuffer(np.ascontiguousarray(expected).tobytes(), np.uint8)
    nbytes = want.size
    stored = os.pread(f.fileno(), nbytes, int(rec["offset"]))
    if len(stored) < nbytes:
        raise CacheFormatError(f"{files.manifest.file('data')}: truncated while it was verified")
    differ = int(np.count_nonzero(np.frombuffer(stored, np.uint8) != want))
    if differ:
        report.bad.append(
            BadRecord(r, rel, f"{differ} of {nbytes} bytes differ from the decoded source")
        )
