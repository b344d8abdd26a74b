"""The record reader each process makes (``RecordReader``): a copy opened from a pickle, as a
spawned DataLoader worker opens it; its first-read checks, its messages, the states it sees."""

from __future__ import annotations

import gc
import json
import os
import pickle
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder, reference

from mmcache import CacheFormatError, MemmapImageDataset, build_cache, create_lazy_cache
from mmcache import format as fmt


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src", {"a": [(8, 6), (5, 7)], "b": [(6, 6), (9, 4)]})


def _manifest(cache: Path) -> dict:
    return json.loads((cache / fmt.MANIFEST_NAME).read_text())


def _record_span(cache: Path, i: int) -> tuple[Path, int, int]:
    """Record ``i``'s data file, offset and size (an RGB record: height x width x 3)."""
    m = _manifest(cache)
    index = np.fromfile(cache / m["files"]["index"], fmt.INDEX_DTYPE)
    r = index[i]
    return cache / m["files"]["data"], int(r["offset"]), int(r["height"]) * int(r["width"]) * 3


def _damage(cache: Path, i: int) -> None:
    """Flip the first byte of record ``i`` in the data file."""
    data, offset, _ = _record_span(cache, i)
    with open(data, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _stored_crc(cache: Path, i: int) -> int:
    """Record ``i``'s CRC-32 as the state file holds it (read without mmcache)."""
    state = cache / _manifest(cache)["files"]["state"]
    return int(np.fromfile(state, fmt.STATE_DTYPE)["crc32"][i])


def test_an_unpickled_copy_of_a_rebuilt_cache_names_the_cache_and_both_generations(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    old = _manifest(cache)["generation"]
    copy = pickle.loads(pickle.dumps(MemmapImageDataset(cache)))
    build_cache(src, cache, workers=0, size=(4, 4), replace=True)
    new = _manifest(cache)["generation"]
    assert new != old
    expected = (
        f"{cache}: the cache was rebuilt after this dataset was opened (generation {new}, "
        f"expected {old}); open it again"
    )
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        copy[0]


def test_a_dataset_whose_cache_is_rebuilt_before_its_first_read_names_both_generations(
    src, tmp_path
):
    """The generation's files are gone when the reader maps them: the error names the cache,
    the generation it finds now and the one it opened."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    old = _manifest(cache)["generation"]
    ds = MemmapImageDataset(cache)
    build_cache(src, cache, workers=0, size=(4, 4), replace=True)
    new = _manifest(cache)["generation"]
    assert new != old
    expected = (
        f"{cache}: the cache was rebuilt after this dataset was opened (generation {new}, "
        f"expected {old}); open it again"
    )
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        ds[0]


def test_an_unpickled_copy_checks_first_reads_and_its_message_names_record_file_and_crcs(
    src, tmp_path
):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    copy = pickle.loads(pickle.dumps(MemmapImageDataset(cache, verify="first-read")))
    _damage(cache, 2)
    data, offset, n = _record_span(cache, 2)
    with open(data, "rb") as f:
        f.seek(offset)
        actual = zlib.crc32(f.read(n))
    stored = _stored_crc(cache, 2)
    path = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.jpg"))[2]
    expected = (
        f"{cache}: record 2 ({path}): its pixels fail their checksum (CRC-32 {actual:08x}, "
        f"stored {stored:08x}): the data file is damaged; `mmcache verify {cache} --repair` "
        "decodes it again from the source"
    )
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        copy[2]
    assert copy[1][0].shape == (7, 5, 3)  # the others read


def test_first_read_checks_a_record_once_per_process(src, tmp_path):
    """A record checked at its first read is not checked again by that process (the check
    costs a CRC-32 of the record); a process that reads it first afterwards finds damage."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    ds = MemmapImageDataset(cache, verify="first-read")
    ds[2]
    _damage(cache, 2)
    ds[2]  # checked already
    with pytest.raises(CacheFormatError, match="record 2 .* fail their checksum"):
        MemmapImageDataset(cache, verify="first-read")[2]


def test_a_record_whose_state_is_set_empty_after_it_was_checked_is_not_filled(src, tmp_path):
    """``filled`` follows the state file as it is now (a writer's scrub marks a lost fill
    EMPTY), even for a record this reader has checked."""
    cache = tmp_path / "cache"
    create_lazy_cache(src, cache, workers=0)
    ds = MemmapImageDataset(cache, source=src, verify="first-read")
    for i in range(len(ds)):
        ds[i]
    all_records = np.arange(len(ds))
    assert ds.reader.filled(all_records).tolist() == [True] * 4
    state = cache / _manifest(cache)["files"]["state"]
    with open(state, "r+b") as f:
        f.seek(1 * fmt.STATE_DTYPE.itemsize)
        f.write(np.array([(0, fmt.EMPTY)], fmt.STATE_DTYPE).tobytes())
    assert ds.reader.filled(all_records).tolist() == [True, False, True, True]


def test_a_record_cut_off_the_data_file_is_named_by_its_number_however_it_is_read(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    ds = MemmapImageDataset(cache)
    reader = ds.reader
    reader.mapping()
    before = ds[0][0].copy()
    data, offset, n = _record_span(cache, 3)
    assert offset >= sum(_record_span(cache, i)[2] for i in range(3))  # records 0-2 before
    os.truncate(data, offset + n - 1)
    assert np.array_equal(ds[0][0], before)  # a record the file still holds reads
    expected = (
        f"{data}: record 3 is cut short: the file was truncated after the cache was opened; "
        "rebuild the cache"
    )
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        ds[3]
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        reader.read_into(3, np.empty(n, np.uint8))
    out = np.empty(4, np.uint8)
    reader.read_into(3, out, start=n - 5)  # what is still there reads
    with open(data, "rb") as f:
        f.seek(offset + n - 5)
        assert out.tobytes() == f.read(4)


def test_a_data_file_truncated_before_the_first_read_is_named_with_the_size_checked(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    size = _manifest(cache)["sizes"]["data"]
    data = cache / _manifest(cache)["files"]["data"]
    ds = MemmapImageDataset(cache)
    os.truncate(data, size - 1)
    expected = (
        f"{data}: shorter than the {size} bytes checked at open: the file was truncated "
        "since; rebuild the cache"
    )
    with pytest.raises(CacheFormatError, match=f"^{re.escape(expected)}$"):
        ds[0]


def test_the_mapping_holds_the_generation_s_bytes_not_those_a_writer_appends(src, tmp_path):
    """A writer appends past the records a generation publishes (and a stopped one's tail is
    cut off again): the mapping is the manifest's data size, and the file cut back to it is not
    cut short."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    size = _manifest(cache)["sizes"]["data"]
    data = cache / _manifest(cache)["files"]["data"]
    with open(data, "ab") as f:
        f.write(bytes(4096))
    reader = MemmapImageDataset(cache).reader
    assert len(reader.mapping()) == size
    os.truncate(data, size)
    assert not reader.cut_short()
    os.truncate(data, size - 1)
    assert reader.cut_short()


def _open_fds_of(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="Linux's /proc")
def test_a_reader_freed_closes_its_data_file(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    data = cache / _manifest(cache)["files"]["data"]
    ds = MemmapImageDataset(cache)
    ds[0]
    assert _open_fds_of(data) >= 1  # the reader's, and its mapping's (mmap keeps a dup)
    del ds
    gc.collect()
    assert _open_fds_of(data) == 0


def test_a_reader_fills_through_one_filler_in_its_process(src, tmp_path):
    ds = MemmapImageDataset(tmp_path / "cache", source=src)
    ds[0]
    filler = ds.reader.filler
    ds[1]
    ds[2]
    assert ds.reader.filler is filler
    markers = [n for n in os.listdir(tmp_path / "cache") if fmt.is_fill_marker_name(n)]
    assert len(markers) == 1


def test_after_a_reboot_a_reader_checks_each_fill_once(src, tmp_path, monkeypatch):
    """Another boot's filler file: each FILLED record's CRC-32 is checked at its first read by
    this reader; one that passes is not decoded again, reads as filled, and is not checked
    again (a record damaged after its check is this reader's to trust, as with first-read)."""
    import mmcache._filler as filler_module

    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    for i in range(len(ds)):
        ds[i]
    ds.reader.filler.close()
    monkeypatch.setattr(filler_module, "boot_id", lambda: "this-boot")
    (cache / ("filling-" + "0" * 16)).write_bytes(b"another-boot")
    decoded = []
    decode = filler_module.decode_record
    monkeypatch.setattr(
        filler_module, "decode_record", lambda *a, **k: decoded.append(a[0]) or decode(*a, **k)
    )
    after = MemmapImageDataset(cache, source=src)
    assert not after.reader.filled(np.arange(4)).any()  # none checked yet
    first = after[1][0].copy()
    assert after.reader.filled(np.arange(4)).tolist() == [False, True, False, False]
    assert np.array_equal(after[1][0], first)
    _damage(cache, 1)
    after[1]
    assert decoded == []  # checked once, found whole, never filled again


def test_a_reader_s_data_file_never_gets_descriptor_0_its_folder_s_handle_does(src, tmp_path):
    """A process started without a standard input hands out descriptor 0 to the first file it
    opens: the folder's handle, opened first to open the data file by name, takes it, so the
    data file's descriptor is never 0 (which ``__del__`` then need not tell from "none")."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    ds = MemmapImageDataset(cache)
    saved = os.dup(0)
    try:
        os.close(0)
        assert ds[0][0].shape == (6, 8, 3)  # maps the data file, opened now
        assert ds.reader.fd > 0
    finally:
        # mmap keeps a dup of the data file's descriptor, which may be 0 now: the reader is
        # freed before the standard input is put back, or freeing it later would close that.
        del ds
        gc.collect()
        os.dup2(saved, 0)
        os.close(saved)


def test_after_a_reboot_a_fill_the_power_cut_lost_is_decoded_again(src, tmp_path, monkeypatch):
    """Another boot's filler file, and a FILLED record whose bytes fail their CRC-32 (they
    never reached the disk): the record is decoded again from its source, once, and both the
    read and the data file then hold the source's pixels (cv2's decode of the file)."""
    import mmcache._filler as filler_module

    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    for i in range(len(ds)):
        ds[i]
    ds.reader.filler.close()
    _damage(cache, 1)
    monkeypatch.setattr(filler_module, "boot_id", lambda: "this-boot")
    (cache / ("filling-" + "0" * 16)).write_bytes(b"another-boot")
    decoded = []
    decode = filler_module.decode_record
    monkeypatch.setattr(
        filler_module, "decode_record", lambda *a, **k: decoded.append(a[0]) or decode(*a, **k)
    )
    expected = reference(sorted(src.rglob("*.jpg"))[1])
    after = MemmapImageDataset(cache, source=src)
    assert np.array_equal(after[1][0], expected)
    assert len(decoded) == 1
    assert np.array_equal(after[1][0], expected)
    assert len(decoded) == 1  # the second read is the refilled record's
    data, offset, n = _record_span(cache, 1)
    with open(data, "rb") as f:
        f.seek(offset)
        assert f.read(n) == expected.tobytes()


def test_a_reader_has_its_records_as_int64_arrays_and_no_other_attribute_made_up(src, tmp_path):
    """The record arrays (``Records``: int64, in record order) are made on first use; any other
    name a reader lacks is Python's usual AttributeError, word for word."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    reader = MemmapImageDataset(cache).reader
    with pytest.raises(AttributeError) as missing:
        _ = reader.no_such_name
    assert str(missing.value) == "'RecordReader' object has no attribute 'no_such_name'"
    assert not hasattr(reader, "no_such_name")
    records = reader.records
    assert records.shapes.tolist() == [[6, 8, 3], [7, 5, 3], [6, 6, 3], [4, 9, 3]]
    assert records.nbytes.tolist() == [6 * 8 * 3, 7 * 5 * 3, 6 * 6 * 3, 4 * 9 * 3]
    assert records.labels.tolist() == [0, 0, 1, 1]
    assert records.offsets.tolist() == [_record_span(cache, i)[1] for i in range(4)]
    for a in (records.offsets, records.shapes, records.nbytes, records.labels):
        assert a.dtype == np.int64
    assert reader.offsets is records.offsets and reader.shapes is records.shapes
    assert reader.nbytes is records.nbytes and reader.labels is records.labels


def test_a_reader_freed_before_its_first_read_closes_no_descriptor(src, tmp_path):
    """It holds none until it maps the data file: freeing it leaves the standard streams (the
    descriptors a made-up 0, 1 or 2 would close) open on the files they were."""
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    saved = {n: os.dup(n) for n in (0, 1, 2)}
    try:
        before = {n: os.fstat(n)[1:3] for n in (0, 1, 2)}  # (inode, device)
        ds = MemmapImageDataset(cache)
        del ds
        gc.collect()
        # (the whole descriptor table is not compared: other tests' garbage closes its own)
        assert {n: os.fstat(n)[1:3] for n in (0, 1, 2)} == before
    finally:
        for n, fd in saved.items():
            os.dup2(fd, n)
            os.close(fd)
