"""The format's checks, against caches written byte by byte from the spec (``mmcache.format``'s
docstring): each record packed with ``struct`` in the spec's field order, each checksum a
``zlib.crc32`` of the bytes written, the manifest's own of its JSON written as the spec says.
A cache at a limit is read; one a step past it is refused, word for word."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from mmcache import CacheFormatError, UnsafeCacheError
from mmcache import format as fmt
from mmcache._records import RecordReader

GEN = "0123456789abcdef"
OTHER_GEN = "fedcba9876543210"
# The spec's index record: offset, path_offset, source_size (<u8), source_mtime_ns (<i8),
# height, width, channels (<u4), label (<i4), path_length, flags (<u4): 56 bytes.
INDEX_RECORD = struct.Struct("<QQQqIIIiII")
STATE_RECORD = struct.Struct("<II")  # crc32, state
# Options.to_json of the defaults, as a built cache's manifest holds them.
OPTIONS = {
    "size": None, "max_side": None, "short_side": None, "interpolation": "auto",
    "color": "rgb", "max_pixels": 89478485, "reduced_decode": False, "pixels": "rgb",
    "keep_truncated": False, "mask": None, "exif_orientation": True,
}  # fmt: skip
INDEX_DESCR = [
    ["offset", "<u8"], ["path_offset", "<u8"], ["source_size", "<u8"],
    ["source_mtime_ns", "<i8"], ["height", "<u4"], ["width", "<u4"], ["channels", "<u4"],
    ["label", "<i4"], ["path_length", "<u4"], ["flags", "<u4"],
]  # fmt: skip


def _record(offset, h, w, c=3, label=0, path="a/x.png", state=1, flags=0):
    return {"offset": offset, "h": h, "w": w, "c": c, "label": label, "path": path,
            "state": state, "flags": flags}  # fmt: skip


def _seal(m: dict) -> dict:
    """``m`` with its manifest checksum: the CRC-32 of its JSON, sorted keys, no spaces."""
    body = {k: v for k, v in m.items() if k != "checksums"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    m["checksums"]["manifest"] = zlib.crc32(canonical)
    return m


def _files(records: list[dict]) -> tuple[bytes, bytes, bytes]:
    """The index, state and paths files of ``records``, paths concatenated in index order."""
    index, state, paths = b"", b"", b""
    for r in records:
        p = r["path"].encode()
        index += INDEX_RECORD.pack(
            r["offset"], len(paths), 100, 7, r["h"], r["w"], r["c"], r["label"], len(p), r["flags"]
        )
        state += STATE_RECORD.pack(0, r["state"])
        paths += p
    return index, state, paths


def write_cache(
    folder: Path,
    records: list[dict],
    data_size: int,
    *,
    classes=("a", "b"),
    mode="build",
    data_gen=GEN,
    data_file_size=None,
    edit=None,
) -> Path:
    """A cache written from the spec alone: manifest, index, state, paths and data files."""
    folder.mkdir(parents=True, exist_ok=True)
    index, state, paths = _files(records)
    names = {k: f"{k}-{GEN}.bin" for k in ("index", "state", "paths")}
    names["data"] = f"data-{data_gen}.bin"
    (folder / names["index"]).write_bytes(index)
    (folder / names["state"]).write_bytes(state)
    (folder / names["paths"]).write_bytes(paths)
    (folder / names["data"]).write_bytes(
        bytes(data_size if data_file_size is None else data_file_size)
    )
    m = {
        "magic": "mmcache",
        "format_version": [5, 1],
        "requires": ["fill-markers", "layout:rgb"] if mode == "lazy" else ["layout:rgb"],
        "generation": GEN,
        "files": names,
        "sizes": {
            "index": len(index),
            "state": len(state),
            "paths": len(paths),
            "data": data_size,
        },  # fmt: skip
        "count": len(records),
        "index_dtype": INDEX_DESCR,
        "state_dtype": [["crc32", "<u4"], ["state", "<u4"]],
        "mode": mode,
        "source": {"root": "/data/src", "kind": "folder"},
        "options": dict(OPTIONS),
        "classes": list(classes),
        "skipped": [],
        "warnings": [],
        "fingerprints": {"listing": "0" * 64, "options": "1" * 64, "decoder": "2" * 64},
        "decoder": {"opencv": "5.1.0"},
        "checksums": {"index": zlib.crc32(index), "paths": zlib.crc32(paths)},
    }
    if edit is not None:
        edit(m)
    (folder / "manifest.json").write_text(json.dumps(_seal(m)))
    return folder


def _refusal(cache: Path, error=CacheFormatError) -> str:
    with pytest.raises(error) as e:
        fmt.open_cache(cache)
    return str(e.value)


# --- records in the data file ---------------------------------------------------------------


def test_a_hand_written_cache_is_read_as_written(tmp_path):
    records = [_record(0, 2, 3, label=0, path="a/x.png"), _record(64, 1, 1, c=1, label=1,
                                                                  path="b/yy.png")]  # fmt: skip
    files = fmt.open_cache(write_cache(tmp_path / "c", records, 65))
    assert files.paths() == ["a/x.png", "b/yy.png"]
    assert files.path(1) == "b/yy.png"
    assert files.shape(0) == (2, 3, 3) and files.shape(1) == (1, 1, 1)
    assert files.index["path_offset"].tolist() == [0, 7]
    assert files.manifest.count == 2 and files.manifest.classes == ["a", "b"]
    assert files.manifest.skipped == [] and files.manifest.warnings == []
    assert files.manifest.fingerprints["listing"] == "0" * 64
    assert files.manifest.decoder == {"opencv": "5.1.0"}
    assert files.manifest.source == {"root": "/data/src", "kind": "folder"}
    assert files.manifest.sizes == {"index": 112, "state": 16, "paths": 15, "data": 65}
    assert files.manifest.extra == {} and files.fields == {} and files.fields_blob is None


def _pixels(options: dict, requires: list[str]):
    def edit(m: dict) -> None:
        m["options"].update(options)
        m["requires"] = requires

    return edit


# (id, records, data size, edit of the manifest, the refusal after "<index file>: ", or None:
# read). A record of "rgb" is h * w * c bytes; of "yuv420" h * w + 2 * ceil(h/2) * ceil(w/2);
# with a mask of uint8 the image, zeros to a multiple of 8, then h * w bytes.
RECORDS = [
    ("two records that abut", [_record(0, 8, 8, 1), _record(64, 8, 8, 1)], 128, None, None),
    ("a record one byte into the next",
     [_record(0, 5, 13, 1), _record(64, 8, 8, 1)], 128, None,
     "record 1: record overlaps the one before it in the data file (1 such records)"),
    ("the last record ending at the data file's end", [_record(0, 8, 8, 1)], 64, None, None),
    ("the last record one byte past it", [_record(0, 8, 8, 1)], 63, None,
     "record 0: record ends past the data file (63 bytes) (1 such records)"),
    ("a later record one byte past it", [_record(0, 8, 8, 1), _record(64, 8, 8, 1)], 127, None,
     "record 1: record ends past the data file (127 bytes) (1 such records)"),
    ("a record starting past the data file", [_record(128, 1, 1, 1)], 64, None,
     "record 0: record ends past the data file (64 bytes) (1 such records)"),
    ("records out of index order that do not overlap",
     [_record(128, 8, 8, 1), _record(0, 8, 8, 1), _record(64, 8, 8, 1)], 192, None, None),
    ("records out of order, the last in the file overlapping",
     [_record(128, 8, 8, 1), _record(0, 8, 8, 1), _record(64, 5, 13, 1)], 192, None,
     "record 0: record overlaps the one before it in the data file (1 such records)"),
    ("two records at one offset", [_record(0, 1, 1, 1), _record(0, 1, 1, 1)], 64, None,
     "record 1: record overlaps the one before it in the data file (1 such records)"),
    # 17 records (more than a sort's insertion-sort run), last to first in the file, the first
    # two at one offset: the later of the two in the index is the one named.
    ("two records at one offset among 17 out of order",
     [_record(1024, 1, 1, 1)] + [_record(64 * (16 - i), 1, 1, 1) for i in range(16)], 1025, None,
     "record 1: record overlaps the one before it in the data file (1 such records)"),
    ("an offset one past a multiple of 64", [_record(65, 1, 1, 1)], 128, None,
     "record 0: offset not a multiple of 64 (1 such records)"),
    ("label -1", [_record(0, 1, 1, 1, label=-1)], 1, None,
     "record 0: label outside 0..1 (1 such records)"),
    ("the last label", [_record(0, 1, 1, 1, label=1)], 1, None, None),
    ("label one past the last", [_record(0, 1, 1, 1), _record(64, 1, 1, 1, label=2)], 65, None,
     "record 1: label outside 0..1 (1 such records)"),
    ("flags 2", [_record(0, 1, 1, 1, flags=2)], 1, None,
     "record 0: reserved flags set (1 such records)"),
    ("two records out of range", [_record(0, 0, 1, 1), _record(64, 1, 1, 1), _record(128, 1, 0, 1)],
     129, None, "record 0: height, width or channels out of range (2 such records)"),
    ("channels 0 after a good record", [_record(0, 1, 1, 1), _record(64, 1, 1, 0)], 65, None,
     "record 1: height, width or channels out of range (1 such records)"),
    ("width 0", [_record(0, 1, 0, 1)], 1, None,
     "record 0: height, width or channels out of range (1 such records)"),
    ("4 channels", [_record(0, 1, 1, 4)], 4, None, None),
    ("5 channels", [_record(0, 1, 1, 5)], 5, None,
     "record 0: height, width or channels out of range (1 such records)"),
    ("height at the bound", [_record(0, fmt.MAX_SIDE, 1, 1)], 1 << 20, None, None),
    ("height one past it", [_record(0, (1 << 20) + 1, 1, 1)], (1 << 20) + 1, None,
     "record 0: height, width or channels out of range (1 such records)"),
    ("width at the bound", [_record(0, 1, 1 << 20, 1)], 1 << 20, None, None),
    ("width one past it", [_record(0, 1, (1 << 20) + 1, 1)], (1 << 20) + 1, None,
     "record 0: height, width or channels out of range (1 such records)"),
    ("yuv420 of 3 channels ending at the end", [_record(0, 3, 5)], 15 + 2 * 2 * 3,
     _pixels({"pixels": "yuv420"}, ["layout:yuv420"]), None),
    ("yuv420 one byte short", [_record(0, 3, 5)], 15 + 2 * 2 * 3 - 1,
     _pixels({"pixels": "yuv420"}, ["layout:yuv420"]),
     "record 0: record ends past the data file (26 bytes) (1 such records)"),
    ("yuv420 of 1 channel", [_record(0, 2, 2), _record(64, 2, 2, 1)], 70,
     _pixels({"pixels": "yuv420"}, ["layout:yuv420"]),
     "record 1: channels is not 3 in a yuv420 cache (1 such records)"),
    ("a mask after the image, ending at the end", [_record(0, 2, 3)], 24 + 6,
     _pixels({"mask": "uint8"}, ["layout:rgb", "masks"]), None),
    ("a mask one byte short", [_record(0, 2, 3)], 24 + 6 - 1,
     _pixels({"mask": "uint8"}, ["layout:rgb", "masks"]),
     "record 0: record ends past the data file (29 bytes) (1 such records)"),
    ("a path of 4096 bytes", [_record(0, 1, 1, 1, path="p" * 4096)], 1, None, None),
    ("a path of 4097 bytes", [_record(0, 1, 1, 1, path="p" * 4097)], 1, None,
     "record 0: path length outside 1..4096 bytes (1 such records)"),
    ("the highest state code", [_record(0, 1, 1, 1, state=max(fmt.BAD_REASONS))], 1, None, None),
    ("one past it", [_record(0, 1, 1, 1), _record(64, 1, 1, 1, state=8)], 65, None,
     "record 1: unknown record state (1 such records)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("records", "data_size", "edit", "refusal"),
    [r[1:] for r in RECORDS],
    ids=[r[0] for r in RECORDS],
)
def test_records_within_the_data_file_are_read_and_others_refused(
    tmp_path, records, data_size, edit, refusal
):
    cache = write_cache(tmp_path / "c", records, data_size, edit=edit)
    if refusal is None:
        assert len(fmt.open_cache(cache).index) == len(records)
    else:
        where = "state" if "state" in refusal else "index"
        assert _refusal(cache) == f"{cache / f'{where}-{GEN}.bin'}: {refusal}"


def test_an_empty_record_is_read_in_a_lazy_cache_and_refused_in_a_built_one(tmp_path):
    records = [_record(0, 1, 1, 1), _record(64, 1, 1, 1, state=fmt.EMPTY)]
    lazy = write_cache(tmp_path / "lazy", records, 65, mode="lazy")
    assert fmt.open_cache(lazy).state["state"].tolist() == [1, 0]
    built = write_cache(tmp_path / "built", records, 65)
    assert _refusal(built) == (
        f"{built / f'state-{GEN}.bin'}: record 1: empty in a built cache (1 such records)"
    )


def test_a_cache_of_no_records_and_no_classes_is_read(tmp_path):
    files = fmt.open_cache(write_cache(tmp_path / "c", [], 0, classes=()))
    assert files.manifest.count == 0 and len(files.index) == 0 and files.paths() == []


def test_a_reader_of_a_cache_of_no_records_maps_no_bytes_and_no_states(tmp_path):
    """Its data and state files are empty, which mmap refuses to map: the reader stands empty
    arrays in for both."""
    cache = write_cache(tmp_path / "c", [], 0, classes=())
    reader = RecordReader(cache, fmt.open_cache(cache), verify=False)
    assert reader.mapping().dtype == np.uint8 and reader.mapping().tolist() == []
    assert reader.codes.tolist() == []
    assert reader.filled(np.zeros(0, np.int64)).tolist() == []
    assert not reader.cut_short()


def test_records_but_no_classes_are_refused(tmp_path):
    cache = write_cache(tmp_path / "c", [_record(0, 1, 1, 1, label=0)], 1, classes=())
    with pytest.raises(CacheFormatError) as e:
        fmt.read_manifest(cache)
    assert str(e.value) == f"{cache / 'manifest.json'}: records but no classes"


def test_one_byte_of_path_per_record_is_enough(tmp_path):
    files = fmt.open_cache(write_cache(tmp_path / "c", [_record(0, 1, 1, 1, path="x")], 1))
    assert files.manifest.sizes["paths"] == 1 and files.paths() == ["x"]


def test_validate_records_wants_as_many_index_and_state_records_as_the_count(tmp_path):
    cache = write_cache(tmp_path / "c", [_record(0, 1, 1, 1), _record(64, 1, 1, 1)], 65)
    files = fmt.open_cache(cache)
    where = cache / f"index-{GEN}.bin"
    for index, state in ((files.index[:1], files.state), (files.index, files.state[:1])):
        with pytest.raises(CacheFormatError) as e:
            fmt.validate_records(files.manifest, index, state, files.paths_blob)
        assert str(e.value) == f"{where}: expected 2 records"


def _far_records(tmp_path: Path, records: list[dict], data_size: int):
    """The manifest, index and state of a cache whose data file is recorded as ``data_size``
    bytes (beyond what a disk holds: the data file itself is left empty, never read here)."""
    cache = write_cache(tmp_path / "c", records, data_size, data_file_size=0)
    index = np.frombuffer((cache / f"index-{GEN}.bin").read_bytes(), fmt.INDEX_DTYPE)
    state = np.frombuffer((cache / f"state-{GEN}.bin").read_bytes(), fmt.STATE_DTYPE)
    return fmt.read_manifest(cache), index, state, (cache / f"paths-{GEN}.bin").read_bytes()


def test_records_far_past_2_to_the_53_out_of_order_are_read_exactly(tmp_path):
    # 2**60 + 64 and 2**60 are one float64 (its step there is 256): compared exactly, the
    # record at 2**60 comes first and the two one-byte records do not overlap.
    far = 1 << 60
    records = [_record(far + 64, 1, 1, 1), _record(far, 1, 1, 1)]
    fmt.validate_records(*_far_records(tmp_path, records, far + 65))


def test_records_far_past_2_to_the_53_one_byte_into_the_next_are_refused(tmp_path):
    # A 65-byte record at 2**54 ends at 2**54 + 65, which float64 rounds to 2**54 + 64 (its step
    # there is 4), where the next record starts: exactly, they overlap by one byte.
    far = 1 << 54
    records = [_record(far, 5, 13, 1), _record(far + 64, 1, 1, 1)]
    manifest, index, state, paths = _far_records(tmp_path, records, far + 65)
    with pytest.raises(CacheFormatError) as e:
        fmt.validate_records(manifest, index, state, paths)
    assert str(e.value) == (
        f"{manifest.file('index')}: record 1: record overlaps the one before it in the data file "
        "(1 such records)"
    )


def test_validate_records_given_the_paths_file_s_size_checks_all_but_the_paths(tmp_path):
    cache = write_cache(tmp_path / "c", [_record(0, 1, 1, 1, path="../x")], 1)
    files = fmt.read_manifest(cache)
    index = np.frombuffer((cache / f"index-{GEN}.bin").read_bytes(), fmt.INDEX_DTYPE)
    state = np.frombuffer((cache / f"state-{GEN}.bin").read_bytes(), fmt.STATE_DTYPE)
    fmt.validate_records(files, index, state, 4)  # the unsafe path is not looked at
    with pytest.raises(CacheFormatError, match="stored path '../x' is unsafe"):
        fmt.validate_records(files, index, state, b"../x")


# --- the files, before their bytes are read ---------------------------------------------------


def _one_record(tmp_path: Path, **kwargs) -> Path:
    return write_cache(tmp_path / "c", [_record(0, 8, 8, 1)], 64, **kwargs)


def test_a_data_file_longer_than_recorded_is_read(tmp_path):
    cache = _one_record(tmp_path, data_file_size=4096)
    assert fmt.open_cache(cache).manifest.sizes["data"] == 64


@pytest.mark.parametrize(("kind", "size", "recorded"), [
    ("data", 63, 64), ("index", 57, 56), ("index", 55, 56), ("state", 9, 8), ("paths", 6, 7),
])  # fmt: skip
def test_a_file_of_another_size_than_recorded_is_refused(tmp_path, kind, size, recorded):
    cache = _one_record(tmp_path)
    path = cache / f"{kind}-{GEN}.bin"
    blob = path.read_bytes()
    path.write_bytes((blob + bytes(1))[:size])
    assert _refusal(cache) == (
        f"{path}: is {size} bytes, the manifest says {recorded}: the file is truncated or was "
        "not fully written"
    )


@pytest.mark.parametrize("kind", ["index", "state", "paths", "data"])
def test_a_missing_file_is_named(tmp_path, kind):
    cache = _one_record(tmp_path)
    path = cache / f"{kind}-{GEN}.bin"
    path.unlink()
    assert _refusal(cache) == f"{path}: missing (the cache was rebuilt or damaged)"


@pytest.mark.parametrize("kind", ["index", "data"])
def test_a_file_that_is_a_link_is_refused_not_followed(tmp_path, kind):
    cache = _one_record(tmp_path)
    path = cache / f"{kind}-{GEN}.bin"
    target = tmp_path / "elsewhere.bin"
    path.rename(target)
    path.symlink_to(target)
    assert _refusal(cache, UnsafeCacheError) == (
        f"{path}: is a symbolic link; a cache's files are never opened through one (delete it, "
        "or rebuild the cache)"
    )


def test_a_folder_in_place_of_a_file_is_refused(tmp_path):
    cache = _one_record(tmp_path)
    path = cache / f"state-{GEN}.bin"
    path.unlink()
    path.mkdir()
    assert _refusal(cache) == f"{path}: not a regular file"


@pytest.mark.parametrize("kind", ["index", "paths"])
def test_a_file_never_written_is_refused_before_it_is_read(tmp_path, kind):
    cache = _one_record(tmp_path)
    path = cache / f"{kind}-{GEN}.bin"
    size = path.stat().st_size
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size)  # a hole: no byte of it on disk
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.lseek(fd, 0, getattr(os, "SEEK_HOLE", 0)) != 0:
            pytest.skip("this file system does not report holes")
    finally:
        os.close(fd)
    assert _refusal(cache) == (
        f"{path}: a sparse file: its bytes from 0 on were never written, yet the manifest says "
        f"it holds {size:,}; it was not written by mmcache"
    )


@pytest.mark.parametrize("kind", ["index", "paths"])
def test_a_checksum_mismatch_names_both_crc_32s_in_hex(tmp_path, kind):
    cache = _one_record(tmp_path)
    path = cache / f"{kind}-{GEN}.bin"
    m = json.loads((cache / "manifest.json").read_text())
    recorded = m["checksums"][kind] ^ 0x10  # the file is as written, its checksum is not
    m["checksums"][kind] = recorded
    (cache / "manifest.json").write_text(json.dumps(_seal(m)))
    actual = zlib.crc32(path.read_bytes())
    assert _refusal(cache) == (
        f"{path}: checksum mismatch (CRC-32 {actual:08x}, the manifest says {recorded:08x}): "
        "the file is damaged; rebuild the cache"
    )


def test_the_state_file_has_no_checksum_a_filler_changes_it(tmp_path):
    cache = _one_record(tmp_path)
    (cache / f"state-{GEN}.bin").write_bytes(STATE_RECORD.pack(0xDEADBEEF, fmt.FILLED))
    assert int(fmt.open_cache(cache).state["crc32"][0]) == 0xDEADBEEF


def test_files_read_without_checksums_are_not_compared(tmp_path):
    cache = _one_record(tmp_path)
    manifest = fmt.read_manifest(cache)
    manifest.checksums = None
    (cache / f"paths-{GEN}.bin").write_bytes(b"a/y.png")  # another path of the same length
    assert fmt.read_cache_files(manifest).paths() == ["a/y.png"]


# --- names of a cache's files ------------------------------------------------------------------

# (name, is_cache_file_name, is_generation_file_name, is_fill_marker_name, _data_generation)
NAMES = [
    ("manifest.json", True, False, False, None),
    ("lock", True, False, False, None),
    ("manifest.json.tmp", True, False, False, None),
    ("manifest.json.tmp.81f3", True, False, False, None),
    ("manifest.jsonx", False, False, False, None),
    ("xmanifest.json.tmp", False, False, False, None),
    ("locks", False, False, False, None),
    (f"index-{GEN}.bin", True, True, False, None),
    (f"state-{GEN}.bin", True, True, False, None),
    (f"paths-{GEN}.bin", True, True, False, None),
    (f"fields-{GEN}.bin", True, True, False, None),
    (f"members-{GEN}.bin", True, True, False, None),
    (f"data-{GEN}.bin", True, True, False, GEN),
    (f"data-{OTHER_GEN}.bin", True, True, False, OTHER_GEN),
    (f"data-{GEN[:15]}.bin", False, False, False, None),
    (f"data-{GEN}0.bin", False, False, False, None),
    (f"data-{GEN.upper()}.bin", False, False, False, None),
    (f"data-{GEN}.bin.tmp", False, False, False, None),
    (f"data-{GEN}.txt", False, False, False, None),
    (f"data-{GEN}", False, False, False, None),
    (f"data_{GEN}.bin", False, False, False, None),
    (f"manifest-{GEN}.bin", False, False, False, None),
    (f"lock-{GEN}.bin", False, False, False, None),
    (f"Data-{GEN}.bin", False, False, False, None),
    (f"filling-{GEN}", True, False, True, None),
    (f"filling-{OTHER_GEN}", True, False, True, None),
    (f"filling-{GEN[:15]}", False, False, False, None),
    (f"filling-{GEN}0", False, False, False, None),
    (f"filling-{GEN.upper()}", False, False, False, None),
    ("filling-", False, False, False, None),
    (GEN, False, False, False, None),
    (f"{GEN}-filling-", False, False, False, None),
    (f"x{GEN}filling-", False, False, False, None),
    (f"filling-{'g' * 16}", False, False, False, None),
    (f"filling-{GEN[:8]}-{GEN[9:]}", False, False, False, None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "cache", "generation", "marker", "data_gen"), NAMES)
def test_the_names_of_a_cache_s_files(name, cache, generation, marker, data_gen):
    assert fmt.is_cache_file_name(name) is cache
    assert fmt.is_generation_file_name(name) is generation
    assert fmt.is_fill_marker_name(name) is marker
    assert fmt._data_generation(name) == data_gen


@pytest.mark.parametrize("name", [None, 5, b"data-0123456789abcdef.bin", ["data"]])
def test_a_data_file_name_that_is_no_string_has_no_generation(name):
    assert fmt._data_generation(name) is None


def test_a_generation_sharing_an_earlier_data_file_names_it_and_its_own_files(tmp_path):
    cache = write_cache(tmp_path / "c", [_record(0, 8, 8, 1)], 64, data_gen=OTHER_GEN)
    manifest = fmt.read_manifest(cache)
    assert manifest.data_generation == OTHER_GEN and manifest.shares_data
    assert manifest.file("data") == cache / f"data-{OTHER_GEN}.bin"
    for kind in ("index", "state", "paths", "fields", "members"):
        assert manifest.file(kind) == cache / f"{kind}-{GEN}.bin"
    assert fmt.open_cache(cache).manifest.file("data").stat().st_size == 64


def test_a_generation_with_its_own_data_file_does_not_share_it(tmp_path):
    manifest = fmt.read_manifest(_one_record(tmp_path))
    assert manifest.data_generation == GEN and not manifest.shares_data
    assert manifest.file("data") == tmp_path / "c" / f"data-{GEN}.bin"


def test_a_path_that_is_not_utf_8_is_read_with_its_bytes_kept(tmp_path):
    cache = _one_record(tmp_path)
    (cache / f"paths-{GEN}.bin").write_bytes(b"a/\xe9.png")  # Latin-1 'e acute', 7 bytes
    m = json.loads((cache / "manifest.json").read_text())
    m["checksums"]["paths"] = zlib.crc32(b"a/\xe9.png")
    (cache / "manifest.json").write_text(json.dumps(_seal(m)))
    files = fmt.open_cache(cache)
    assert files.path(0) == "a/\udce9.png" and files.paths() == ["a/\udce9.png"]
    assert files.path(0).encode("utf-8", "surrogateescape") == b"a/\xe9.png"


# --- the manifest -----------------------------------------------------------------------------


def _set(key: str, value):
    def edit(m: dict) -> None:
        m[key] = value

    return edit


def _size(kind: str, size: int):
    def edit(m: dict) -> None:
        m["sizes"][kind] = size

    return edit


def _read_refusal(cache: Path) -> str:
    with pytest.raises(CacheFormatError) as e:
        fmt.read_manifest(cache)
    return str(e.value).removeprefix(f"{cache / 'manifest.json'}: ")


# (id, edit of a one-record cache's manifest, resealed, its refusal after "manifest.json: ")
MANIFESTS = [
    ("generation not a string", _set("generation", 123), "bad generation id"),
    ("generation of 17 digits", _set("generation", GEN + "0"), "bad generation id"),
    ("index size one record short", _size("index", 0), "index size != count"),
    ("index size a byte long", _size("index", 57), "index size != count"),
    ("state size one record long", _size("state", 16), "state size != count"),
    ("state size a byte short", _size("state", 7), "state size != count"),
    ("no byte of path", _size("paths", 0), "paths file smaller than one byte per record"),
    ("fingerprints not an object", _set("fingerprints", []), "fingerprints must be an object"),
    ("options not an object", _set("options", None), "options must be an object"),
    ("a source root of 4097 characters", _set("source", {"root": "r" * 4097, "kind": "folder"}),
     "source root must be a non-empty path without NUL, at most 4096 long"),
    ("a skipped path of 4097 bytes", _set("skipped", [{"path": "p" * 4097, "reason": "r"}]),
     "skipped must be a list of {path, reason} (and integer size, mtime_ns, state)"),
    ("a warning's path of 4097 bytes", _set("warnings", [{"path": "p" * 4097, "reason": "r"}]),
     "warnings must be a list of {path, reason} (and integer size, mtime_ns, state)"),
    ("a field's class name of 4097 characters",
     _set("fields", [{"name": "f", "dtype": "<f4", "shape": [-1], "classes": ["c" * 4097]}]),
     "classes must be a list of non-empty strings without NUL, at most 4096 long"),
    ("fields checksummed in a cache without", lambda m: m["checksums"].update(fields=0),
     "checksums missing or malformed (expected {index, manifest, paths} CRC-32s)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "refusal"), [m[1:] for m in MANIFESTS], ids=[m[0] for m in MANIFESTS]
)
def test_a_manifest_out_of_the_spec_is_refused(tmp_path, edit, refusal):
    assert _read_refusal(_one_record(tmp_path, edit=edit)) == refusal


def test_a_newer_minor_version_is_read_as_such(tmp_path):
    manifest = fmt.read_manifest(_one_record(tmp_path, edit=_set("format_version", [5, 9])))
    assert manifest.format_version == (5, 9)


def test_a_skipped_path_of_4096_bytes_is_kept(tmp_path):
    entries = [{"path": "p" * 4096, "reason": "r"}]
    edit = _set("skipped", entries)
    assert fmt.read_manifest(_one_record(tmp_path, edit=edit)).skipped == entries


def test_a_warning_is_kept(tmp_path):
    entries = [{"path": "a/x.png", "reason": "libpng warning"}]
    assert fmt.read_manifest(_one_record(tmp_path, edit=_set("warnings", entries))).warnings == (
        entries
    )


def test_a_copy_s_origin_is_read_and_not_extra(tmp_path):
    def edit(m: dict) -> None:
        m["origin"] = {"url": "s3://bucket/train"}
        m["requires"] = ["fill-markers", "layout:rgb", "remote-fill"]

    manifest = fmt.read_manifest(_one_record(tmp_path, mode="lazy", edit=edit))
    assert manifest.origin == {"url": "s3://bucket/train"} and manifest.extra == {}
    assert manifest.requires == ["fill-markers", "layout:rgb", "remote-fill"]


MEMBER_DESCR = [["offset", "<u8"], ["length", "<u8"], ["archive", "<u4"], ["header", "<u4"],
                ["crc32", "<u4"], ["method", "<u2"], ["flags", "<u2"]]  # fmt: skip


def _members(file: str, size: int = 32, root: str = "/data/a.tar"):
    def edit(m: dict) -> None:
        m["source"] = {"root": root, "kind": "tar"}
        m["members"] = {"file": file, "size": size, "crc32": 0, "dtype": MEMBER_DESCR,
                        "archives": [[root, 1000, 5]]}  # fmt: skip

    return edit


def test_a_members_entry_of_this_generation_is_read_and_not_extra(tmp_path):
    manifest = fmt.read_manifest(_one_record(tmp_path, edit=_members(f"members-{GEN}.bin")))
    assert manifest.members is not None and manifest.members["size"] == 32
    assert manifest.extra == {}
    assert manifest.written_kinds == ("index", "state", "paths", "data", "members")


def test_a_members_entry_of_another_generation_is_ignored(tmp_path):
    manifest = fmt.read_manifest(_one_record(tmp_path, edit=_members(f"members-{OTHER_GEN}.bin")))
    assert manifest.members is None and manifest.extra == {}
    assert manifest.written_kinds == ("index", "state", "paths", "data")


def test_a_members_file_of_another_size_than_the_count_s_is_refused(tmp_path):
    cache = _one_record(tmp_path, edit=_members(f"members-{GEN}.bin", size=64))
    assert _read_refusal(cache) == "members size != count"


def _fields_cache(tmp_path: Path, field: dict, fields_file: bytes) -> Path:
    def edit(m: dict) -> None:
        name = f"fields-{GEN}.bin"
        (tmp_path / "c" / name).write_bytes(fields_file)
        m["fields"] = [field]
        m["files"]["fields"] = name
        m["sizes"]["fields"] = len(fields_file)
        m["checksums"]["fields"] = zlib.crc32(fields_file)
        m["requires"] = ["fields", "layout:rgb"]

    return _one_record(tmp_path, edit=edit)


def test_a_field_s_rows_are_read_from_the_fields_file(tmp_path):
    # starts 0, 2 (<u8 each), then 2 rows of 2 <f4: 1.5, -2, 3, 0.25
    rows = struct.pack("<ffff", 1.5, -2.0, 3.0, 0.25)
    blob = struct.pack("<QQ", 0, 2) + rows
    cache = _fields_cache(tmp_path, {"name": "points", "dtype": "<f4", "shape": [-1, 2]}, blob)
    files = fmt.open_cache(cache)
    assert files.manifest.fields == [{"name": "points", "dtype": "<f4", "shape": [-1, 2]}]
    assert files.manifest.extra == {}  # "fields" is a key of the spec
    assert files.manifest.file_kinds == ("index", "state", "paths", "data", "fields")
    assert files.fields_blob == blob
    assert files.field_rows("points", 0).tolist() == [[1.5, -2.0], [3.0, 0.25]]


def test_a_changed_fields_file_fails_its_checksum(tmp_path):
    blob = struct.pack("<QQ", 0, 1) + struct.pack("<ff", 1.5, -2.0)
    cache = _fields_cache(tmp_path, {"name": "points", "dtype": "<f4", "shape": [-1, 2]}, blob)
    path = cache / f"fields-{GEN}.bin"
    changed = blob[:-1] + b"\x01"
    path.write_bytes(changed)
    m = json.loads((cache / "manifest.json").read_text())
    assert _refusal(cache) == (
        f"{path}: checksum mismatch (CRC-32 {zlib.crc32(changed):08x}, the manifest says "
        f"{m['checksums']['fields']:08x}): the file is damaged; rebuild the cache"
    )


def test_a_fields_file_without_its_checksum_is_refused(tmp_path):
    blob = struct.pack("<QQ", 0, 0)
    cache = _fields_cache(tmp_path, {"name": "points", "dtype": "<f4", "shape": [-1, 2]}, blob)
    m = json.loads((cache / "manifest.json").read_text())
    del m["checksums"]["fields"]
    (cache / "manifest.json").write_text(json.dumps(_seal(m)))
    assert _read_refusal(cache) == (
        "checksums missing or malformed (expected {fields, index, manifest, paths} CRC-32s)"
    )


def test_a_fields_file_cut_short_is_refused_naming_the_fields_file(tmp_path):
    blob = struct.pack("<Q", 0)  # starts[0] alone: one record needs two <u8 row numbers
    cache = _fields_cache(tmp_path, {"name": "points", "dtype": "<f4", "shape": [-1, 2]}, blob)
    assert _refusal(cache) == f"{cache / f'fields-{GEN}.bin'}: field points: cut short"


def test_a_fields_file_with_bytes_after_its_last_field_is_refused_naming_them(tmp_path):
    # starts 0, 1, then one row of 2 <f4 (8 bytes, a multiple of 8: no padding), then 8 more
    blob = struct.pack("<QQ", 0, 1) + struct.pack("<ff", 1.5, -2.0) + bytes(8)
    cache = _fields_cache(tmp_path, {"name": "points", "dtype": "<f4", "shape": [-1, 2]}, blob)
    assert _refusal(cache) == f"{cache / f'fields-{GEN}.bin'}: 8 bytes more than its fields hold"
