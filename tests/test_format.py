"""The format's readers refuse malformed files with the error class and words that say what is
wrong, in tables as numpy's format tests keep them: one row a malformed manifest, index, state
or paths file, with the error it must raise and a fragment of its message."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import reseal

from mmcache import (
    CacheFormatError,
    CacheNotFoundError,
    MemmapImageDataset,
    build_cache,
    create_lazy_cache,
)
from mmcache import _manifest as manifest_checks
from mmcache import format as fmt
from mmcache.sample_data import make_segmentation_set


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    """A copy of the fault tests' pristine cache (tests/_faults.py): four records with gaps."""
    return Path(shutil.copytree(pristine, tmp_path / "cache"))


def _manifest(cache: Path) -> dict:
    return json.loads((cache / fmt.MANIFEST_NAME).read_text())


def _write_manifest(cache: Path, m: dict) -> None:
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))


def _set(key: str, value):
    def edit(m: dict) -> None:
        m[key] = value

    return edit


def _drop(key: str):
    def edit(m: dict) -> None:
        del m[key]

    return edit


def _set_file(kind: str, name: str):
    def edit(m: dict) -> None:
        m["files"][kind] = name

    return edit


def _set_option(name: str, value):
    def edit(m: dict) -> None:
        m["options"][name] = value

    return edit


# (id, edit of the manifest's JSON, resealed after, error, message fragment)
MANIFESTS = [
    ("magic", _set("magic", "npy"), CacheFormatError, "magic is 'npy', expected 'mmcache'"),
    ("newer major", _set("format_version", [9, 0]), CacheFormatError,
     "format version 9.0 is not supported"),
    ("version not a pair", _set("format_version", "2.0"), CacheFormatError,
     "format_version is '2.0', expected [major, minor]"),
    ("development version", _set("format_version", [4, 0]), CacheFormatError,
     "written by a development version of mmcache (format 4.0), which this one does not read; "
     "rebuild it: mmcache build "),
    ("unknown required feature", _set("requires", ["layout:hdr", "layout:rgb"]), CacheFormatError,
     "the cache requires 'layout:hdr', which this mmcache does not know (it knows fields, "
     "fill-markers, masks, remote-fill, layout:rgb, layout:yuv420); upgrade mmcache or rebuild "
     "the cache"),
    ("requires missing", _drop("requires"), CacheFormatError,
     "requires is None, expected a list of feature names"),
    ("requires not a list", _set("requires", "layout:rgb"), CacheFormatError,
     "requires is 'layout:rgb', expected a list of feature names"),
    ("requires what is unused", _set("requires", ["layout:rgb", "masks"]), CacheFormatError,
     "requires ['layout:rgb', 'masks'] where the cache uses ['layout:rgb']: the manifest was "
     "damaged or edited"),
    ("requires too little", _set("requires", []), CacheFormatError,
     "requires [] where the cache uses ['layout:rgb']"),
    ("uses masks unrequired", _set_option("mask", "uint8"), CacheFormatError,
     "requires ['layout:rgb'] where the cache uses ['layout:rgb', 'masks']"),
    ("negative count", _set("count", -1), CacheFormatError, "bad count -1"),
    ("count not an int", _set("count", 1.5), CacheFormatError, "bad count 1.5"),
    ("mode", _set("mode", "eager"), CacheFormatError, "unknown mode 'eager'"),
    ("empty class name", _set("classes", ["a", ""]), CacheFormatError,
     "classes must be a list of non-empty strings"),
    ("data file name", _set_file("data", "../data.bin"), CacheFormatError,
     "is not data-<16 hex digits>.bin"),
    ("mask dtype", _set_option("mask", "float32"), CacheFormatError,
     "records carry masks of 'float32'"),
    ("mask not a name", _set_option("mask", [8]), CacheFormatError,
     "records carry masks of [8]"),
    ("layout not a name", _set_option("pixels", []), CacheFormatError,
     "records are stored in pixel layout []"),
    ("generation 15 digits", _set("generation", "0123456789abcde"), CacheFormatError,
     "bad generation id"),
    ("generation not hex", _set("generation", "0123456789abcdeg"), CacheFormatError,
     "bad generation id"),
    ("count at the limit", _set("count", 1 << 40), CacheFormatError, f"bad count {1 << 40}"),
    ("index dtype", _set("index_dtype", [["offset", "<u8"]]), CacheFormatError,
     "index_dtype is not the layout of the spec"),
    ("state dtype", _set("state_dtype", "u1"), CacheFormatError,
     "state_dtype is not the layout of the spec"),
    ("records but no classes", _set("classes", []), CacheFormatError, "records but no classes"),
    ("source not an object", _set("source", ["folder"]), CacheFormatError,
     "source must be an object"),
    ("decoder not an object", _set("decoder", "opencv"), CacheFormatError,
     "decoder must be an object"),
    ("skipped not a list", _set("skipped", {"path": "a"}), CacheFormatError,
     "skipped must be a list of {path, reason} (and integer size, mtime_ns, state)"),
    ("a warning without reason", _set("warnings", [{"path": "a"}]), CacheFormatError,
     "warnings must be a list of {path, reason} (and integer size, mtime_ns, state)"),
    ("fields not a list", _set("fields", {"a": 1}), CacheFormatError, "fields"),
    ("size an object", _set_option("size", {"h": 2}), CacheFormatError,
     "options are not valid: size"),
    ("size empty", _set_option("size", []), CacheFormatError, "options are not valid: size"),
    ("size negative", _set_option("size", [4, -1]), CacheFormatError,
     "options are not valid: size"),
    ("short side a string", _set_option("short_side", "64"), CacheFormatError,
     "options are not valid: short_side"),
    ("unknown option", _set_option("sharpen", 2), CacheFormatError,
     "options are not valid: unknown option 'sharpen'"),
    ("colour", _set_option("color", "sepia"), CacheFormatError,
     "options are not valid: color"),
    ("origin in a built cache", _set("origin", {"url": "s3://bucket/train"}), CacheFormatError,
     "a copy with an origin must be a lazy cache"),
    ("origin not an object", _set("origin", "s3://bucket/train"), CacheFormatError,
     'origin must be {"url"}, a store URL without credentials'),
    ("origin with credentials", _set("origin", {"url": "s3://AKIA:secret@host/train"}),
     CacheFormatError, 'origin must be {"url"}, a store URL without credentials'),
    ("origin not a URL", _set("origin", {"url": "/data/train"}), CacheFormatError,
     'origin must be {"url"}, a store URL without credentials'),
]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "error", "fragment"), [m[1:] for m in MANIFESTS], ids=[m[0] for m in MANIFESTS]
)
def test_a_malformed_manifest(cache, edit, error, fragment):
    m = _manifest(cache)
    edit(m)
    _write_manifest(cache, m)
    reseal(cache)  # so that the check aimed at answers, not the checksum
    with pytest.raises(error, match="manifest.json: .*") as e:
        fmt.read_manifest(cache)
    assert fragment in str(e.value)


# (id, the manifest file's bytes, error, message fragment): never resealed
MANIFEST_BYTES = [
    ("empty", b"", CacheFormatError, "not valid JSON"),
    ("cut short", b'{"magic": "mmcache", ', CacheFormatError, "not valid JSON"),
    ("not an object", b"[1, 2]", CacheFormatError, "manifest.json: expected a JSON object"),
    ("over the size limit", b" " * (fmt.MAX_MANIFEST_BYTES + 1), CacheFormatError,
     f"larger than {fmt.MAX_MANIFEST_BYTES} bytes"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "error", "fragment"),
    [m[1:] for m in MANIFEST_BYTES],
    ids=[m[0] for m in MANIFEST_BYTES],
)
def test_manifest_bytes_that_are_no_manifest(cache, raw, error, fragment):
    (cache / fmt.MANIFEST_NAME).write_bytes(raw)
    with pytest.raises(error) as e:
        fmt.read_manifest(cache)
    assert fragment in str(e.value)


def test_a_development_version_s_cache_is_refused_in_one_line_naming_the_rebuild(cache):
    m = _manifest(cache)
    m["format_version"] = [2, 1]
    m["source"]["root"] = "/data/my photos"
    _write_manifest(cache, m)  # not resealed: the version is checked first
    with pytest.raises(CacheFormatError) as e:
        fmt.read_manifest(cache)
    assert str(e.value) == (
        f"{cache / fmt.MANIFEST_NAME}: written by a development version of mmcache (format 2.1), "
        f"which this one does not read; rebuild it: mmcache build '/data/my photos' {cache}"
    )


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> tuple[Path, Path]:
    return make_segmentation_set(tmp_path_factory.mktemp("seg"), images=3, size=(24, 32))


# (id, keyword arguments of the build, lazy, the manifest's "requires")
FEATURE_CACHES = [
    ("rgb", {}, False, ["layout:rgb"]),
    ("yuv420", {"pixels": "yuv420"}, False, ["layout:yuv420"]),
    ("masks", {"masks": True}, False, ["fields", "layout:rgb", "masks"]),
    ("fields", {"fields": {"img_00000.png": np.ones((2, 3), np.float32)}}, False,
     ["fields", "layout:rgb"]),
    ("lazy", {}, True, ["fill-markers", "layout:rgb"]),
    ("lazy yuv420 masks", {"pixels": "yuv420", "masks": True}, True,
     ["fields", "fill-markers", "layout:yuv420", "masks"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "lazy", "requires"),
    [c[1:] for c in FEATURE_CACHES],
    ids=[c[0] for c in FEATURE_CACHES],
)
def test_every_feature_combination_is_written_as_the_one_version(
    seg, tmp_path, kwargs, lazy, requires
):
    images, masks = seg
    kwargs = dict(kwargs)
    if kwargs.get("masks"):
        kwargs["masks"] = masks
    if "fields" in kwargs:
        kwargs["fields"] = {"points": kwargs["fields"]}
    (create_lazy_cache if lazy else build_cache)(images, tmp_path / "c", workers=0, **kwargs)
    m = _manifest(tmp_path / "c")
    assert m["format_version"] == list(fmt.FORMAT_VERSION) and m["requires"] == requires
    ds = MemmapImageDataset(tmp_path / "c")
    assert ds.manifest.requires == requires and len(ds) == 3
    image = ds[0][0]
    assert image.shape[2] == 3 and image.dtype == np.uint8


def test_only_keys_outside_the_spec_are_kept_as_extra(cache):
    spec = {
        "magic", "format_version", "generation", "files", "sizes", "count", "index_dtype",
        "state_dtype", "mode", "source", "options", "classes", "skipped", "warnings",
        "fingerprints", "decoder", "checksums", "fields", "requires",
    }  # fmt: skip
    m = _manifest(cache)
    m["a_note_of_mine"] = {"kept": True}
    _write_manifest(cache, m)
    reseal(cache)
    extra = fmt.read_manifest(cache).extra
    assert extra["a_note_of_mine"] == {"kept": True}
    assert set(extra) == set(m) - spec


def test_files_that_are_no_object_are_refused_not_a_type_error(cache):
    m = _manifest(cache)
    m["files"] = 3  # found by the manifest fuzz test: `"fields" in 3` raised TypeError
    _write_manifest(cache, m)
    with pytest.raises(CacheFormatError, match="checksum"):
        fmt.read_manifest(cache)


def test_an_edited_manifest_fails_its_checksum(cache):
    m = _manifest(cache)
    m["classes"] = ["b", "a"]  # well-formed, but not what was written
    _write_manifest(cache, m)
    with pytest.raises(CacheFormatError, match="checksum mismatch .* edited; rebuild the cache"):
        fmt.read_manifest(cache)


@pytest.mark.parametrize(
    ("contents", "fragment"),
    [({}, "an empty folder, not a cache"), ({"notes.txt": b"x"}, "not an mmcache cache")],
    ids=["empty folder", "a stranger's folder"],
)
def test_a_folder_without_a_manifest(tmp_path, contents, fragment):
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    with pytest.raises(CacheNotFoundError, match=fragment):
        fmt.read_manifest(tmp_path)


def _set_record(field: str, value, record: int = 0):
    def edit(index: np.ndarray) -> None:
        index[field][record] = value

    return edit


def _overlap(index: np.ndarray) -> None:
    index["offset"][1] = index["offset"][0]


def _last_record_at_the_data_file_s_last_block(index: np.ndarray, data_bytes: int) -> None:
    index["offset"][3] = (data_bytes - 1) // fmt.DATA_ALIGN * fmt.DATA_ALIGN  # starts inside,
    index["height"][3] = fmt.DATA_ALIGN  # and is longer than the block


def _overlap_out_of_order(index: np.ndarray) -> None:
    index["offset"][2] = index["offset"][0]  # records 0 and 2 share bytes; 2 comes before 1


def _overlap_of_an_earlier_record(index: np.ndarray) -> None:
    index["offset"][0] = index["offset"][2]  # 0 moves onto 2: 1 is first in the file


# (id, edit of the index's records, resealed after, message fragment); all CacheFormatError
INDEX = [
    ("height 0", _set_record("height", 0), "record 0: height, width or channels out of range"),
    ("width too large", _set_record("width", fmt.MAX_SIDE + 1),
     "height, width or channels out of range"),
    ("5 channels", _set_record("channels", 5), "height, width or channels out of range"),
    ("unaligned offset", _set_record("offset", 1),
     f"record 0: offset not a multiple of {fmt.DATA_ALIGN}"),
    ("past the data file", _set_record("offset", 1 << 40), "record ends past the data file"),
    ("overlap", _overlap, "record 1: record overlaps the one before it"),
    ("label", _set_record("label", 2, record=3), "record 3: label outside 0..1"),
    ("flags", _set_record("flags", 1), "record 0: reserved flags set"),
    ("empty path", _set_record("path_length", 0), "path length outside 1..4096 bytes"),
    ("height too large", _set_record("height", fmt.MAX_SIDE + 1),
     "record 0: height, width or channels out of range (1 such records)"),
    ("0 channels", _set_record("channels", 0, record=1),
     "record 1: height, width or channels out of range (1 such records)"),
    # at each bound the record is in range, and then too large for the data file
    ("height at the bound", _set_record("height", fmt.MAX_SIDE), "record ends past the data file"),
    ("width at the bound", _set_record("width", fmt.MAX_SIDE), "record ends past the data file"),
    ("4 channels", _set_record("channels", fmt.MAX_CHANNELS),
     "record 1: record overlaps the one before it"),
    ("the last record past the end", _last_record_at_the_data_file_s_last_block,
     "record 3: record ends past the data file"),
    ("overlap out of order", _overlap_out_of_order,
     "record 2: record overlaps the one before it in the data file (1 such records)"),
    ("overlap of an earlier record", _overlap_of_an_earlier_record,
     "record 2: record overlaps the one before it in the data file (1 such records)"),
]  # fmt: skip


@pytest.mark.parametrize(("edit", "fragment"), [i[1:] for i in INDEX], ids=[i[0] for i in INDEX])
def test_a_malformed_index(cache, edit, fragment):
    path = cache / _manifest(cache)["files"]["index"]
    index = np.fromfile(path, dtype=fmt.INDEX_DTYPE)
    if edit is _last_record_at_the_data_file_s_last_block:
        edit(index, _manifest(cache)["sizes"]["data"])
    else:
        edit(index)
    index.tofile(path)
    reseal(cache)
    with pytest.raises(CacheFormatError, match=f"{path.name}: ") as e:
        fmt.open_cache(cache)
    assert fragment in str(e.value)


def _cut_one_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _unsafe_path(path: Path) -> None:
    blob = path.read_bytes()
    assert blob.startswith(b"a/img_000.png")
    path.write_bytes(b"../img_000.pn" + blob[13:])  # the same length: the paths still tile


def _state_code(code: int):
    def edit(path: Path) -> None:
        state = np.fromfile(path, dtype=fmt.STATE_DTYPE)
        state["state"][2] = code
        state.tofile(path)

    return edit


# (id, file kind, edit of that file, resealed after, message fragment); all CacheFormatError
FILES = [
    ("index cut", "index", _cut_one_byte, "the file is truncated or was not fully written"),
    ("state cut", "state", _cut_one_byte, "the file is truncated or was not fully written"),
    ("paths cut", "paths", _cut_one_byte, "the file is truncated or was not fully written"),
    ("data cut", "data", _cut_one_byte, "the file is truncated or was not fully written"),
    ("index gone", "index", Path.unlink, "missing (the cache was rebuilt or damaged)"),
    ("unknown state", "state", _state_code(99), "record 2: unknown record state (1 such records)"),
    ("empty state in a build", "state", _state_code(fmt.EMPTY),
     "record 2: empty in a built cache (1 such records)"),
    ("unsafe path", "paths", _unsafe_path, "stored path '../img_000.pn' is unsafe"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "edit", "fragment"), [f[1:] for f in FILES], ids=[f[0] for f in FILES]
)
def test_a_malformed_file(cache, kind, edit, fragment):
    path = cache / _manifest(cache)["files"][kind]
    edit(path)
    if path.exists():
        reseal(cache)
    with pytest.raises(CacheFormatError) as e:
        fmt.open_cache(cache)
    assert fragment in str(e.value)
    if kind == "state":  # the file at fault is named
        assert f"{path.name}: " in str(e.value)


def test_every_known_state_code_is_read(cache):
    path = cache / _manifest(cache)["files"]["state"]
    _state_code(max(fmt.BAD_REASONS))(path)
    reseal(cache)
    assert fmt.open_cache(cache).state["state"][2] == max(fmt.BAD_REASONS)


@pytest.mark.parametrize("kind", ["index", "paths"])
def test_a_changed_file_fails_its_checksum(cache, kind):
    path = cache / _manifest(cache)["files"][kind]
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01  # a one-bit change that the structure checks could miss
    path.write_bytes(bytes(blob))
    with pytest.raises(CacheFormatError, match=f"{path.name}: checksum mismatch"):
        fmt.open_cache(cache)


# --- the manifest's own checksum, against a CRC-32 of JSON written by hand -------------------


def test_a_manifest_s_checksum_is_the_crc_32_of_its_canonical_json_without_its_checksums():
    m = {"b": [1, "\u00e9"], "a": {"y": True, "x": None}, "checksums": {"manifest": 7}}
    canonical = b'{"a":{"x":null,"y":true},"b":[1,"\\u00e9"]}'  # sorted, no spaces, ASCII
    assert manifest_checks.manifest_checksum(m) == zlib.crc32(canonical)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match="^nested too deeply$"):
        manifest_checks.manifest_checksum({"x": deep})


@pytest.mark.parametrize(
    "raw, cost",
    [
        (b"", 0),
        (b'{"a":[1,2],"b":"c"}', 2 * 64 + 2 * 32 + 3 * 24),
        (b'"', 0),  # half a string is not counted
        (b"[[],{}]", 3 * 64 + 32),
    ],
)
def test_a_manifest_s_parse_cost_counts_containers_items_and_strings(raw, cost):
    assert manifest_checks.manifest_parse_cost(raw) == cost


def _checked(checksums, fields_kind=None, checksum=lambda m: 7):
    m = {"format_version": 5} if checksums is None else {"checksums": checksums}
    path = Path("c/manifest.json")
    return manifest_checks.check_manifest_checksum(m, path, fields_kind, checksum)


MALFORMED = "c/manifest.json: checksums missing or malformed (expected {{{}}} CRC-32s)"


@pytest.mark.parametrize(
    "checksums, fields_kind, names",
    [
        (None, None, "index, manifest, paths"),
        ({"index": 1, "paths": 2}, None, "index, manifest, paths"),
        ({"index": 1, "paths": 2, "manifest": 7, "fields": 3}, None, "index, manifest, paths"),
        ({"index": 1, "paths": 2, "manifest": 7}, "fields", "fields, index, manifest, paths"),
        ({"index": 1 << 32, "paths": 2, "manifest": 7}, None, "index, manifest, paths"),
        ({"index": -1, "paths": 2, "manifest": 7}, None, "index, manifest, paths"),
        ({"index": True, "paths": 2, "manifest": 7}, None, "index, manifest, paths"),
        ([1, 2, 7], None, "index, manifest, paths"),
    ],
)
def test_malformed_checksums_are_refused_naming_the_crc_32s_expected(checksums, fields_kind, names):
    with pytest.raises(CacheFormatError) as e:
        _checked(checksums, fields_kind)
    assert str(e.value) == MALFORMED.format(names)


def test_the_manifest_s_checksum_is_compared_and_its_mismatch_named_in_hex():
    whole = {"index": 0, "paths": (1 << 32) - 1, "manifest": 7, "fields": 3}
    assert _checked(whole, "fields") == whole
    with pytest.raises(CacheFormatError) as e:
        _checked({"index": 0, "paths": 0, "manifest": 7}, checksum=lambda m: 0x2A)
    assert str(e.value) == (
        "c/manifest.json: checksum mismatch (CRC-32 0000002a, recorded 00000007): the manifest "
        "was damaged or edited; rebuild the cache"
    )

    def unwritable(m):
        raise ValueError("nested too deeply")

    with pytest.raises(CacheFormatError) as e:
        _checked({"index": 0, "paths": 0, "manifest": 7}, checksum=unwritable)
    assert str(e.value) == "c/manifest.json: cannot be checked (nested too deeply)"


def _cache_name(name: str) -> bool:
    return name.startswith("index")


def test_a_folder_without_a_manifest_is_described_by_what_it_holds(tmp_path):
    def why(*names: str) -> str:
        folder = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for n in names:
            (folder / n).write_bytes(b"")
        return manifest_checks.no_manifest(folder, "manifest.json", _cache_name)[len(str(folder)) :]

    assert why() == ": an empty folder, not a cache; `mmcache build SOURCE CACHE` makes one"
    tail = "; a cache is the folder `mmcache build SOURCE CACHE` writes"
    assert why("b.txt", "index-1") == ": not an mmcache cache (it holds 'b.txt')" + tail
    assert why("b.txt", "a.txt", "index-1") == (
        ": not an mmcache cache (it holds 'a.txt' and more)" + tail
    )
    assert why("index-1", "index-2") == (
        ": no finished cache here (manifest.json is missing: a build was stopped before it "
        "published, or is running now); run `mmcache build` again"
    )
    missing = tmp_path / "gone"
    assert manifest_checks.no_manifest(missing, "manifest.json", _cache_name) == (
        f"{missing}: no cache here (the folder cannot be read: No such file or directory)"
    )


ORIGIN_REFUSED = 'c/manifest.json: origin must be {"url"}, a store URL without credentials'


@pytest.mark.parametrize(
    "origin, mode, error",
    [
        (None, "built", None),
        ({"url": "s3://b/train"}, "lazy", None),
        ({"url": "s3://b/a@b/c"}, "lazy", None),  # an "@" past the host is a key's
        ({"url": "s3://key@b/x://y"}, "lazy", ORIGIN_REFUSED),  # the first "://" ends the scheme
        ({"url": "s3://b/" + "t" * 13}, "lazy", None),  # 20 characters: the limit
        ({"url": "s3://b/" + "t" * 14}, "lazy", ORIGIN_REFUSED),
        ({"url": "s3://b/train", "etag": "x"}, "lazy", ORIGIN_REFUSED),
        ({}, "lazy", ORIGIN_REFUSED),
        ({"url": 5}, "lazy", ORIGIN_REFUSED),
        ({"url": "s3://b\x00/t"}, "lazy", ORIGIN_REFUSED),
        ({"url": "://b/train"}, "lazy", ORIGIN_REFUSED),
        ({"url": "s3:/b/train"}, "lazy", ORIGIN_REFUSED),
        ({"url": "s3://key@b/train"}, "lazy", ORIGIN_REFUSED),
        (["s3://b/train"], "lazy", ORIGIN_REFUSED),
        ({"url": "s3://key@b/train"}, "built", ORIGIN_REFUSED),  # the form is checked first
        ({"url": "s3://b/train"}, "built", "c/manifest.json: a copy with an origin must be a "
         "lazy cache"),
    ],
)  # fmt: skip
def test_a_copy_s_origin_is_one_store_url_without_credentials_in_a_lazy_cache(origin, mode, error):
    m = {} if origin is None else {"origin": origin}
    check = lambda: manifest_checks.check_origin(m, mode, Path("c/manifest.json"), 20)  # noqa: E731
    if error is None:
        assert check() == origin
    else:
        with pytest.raises(CacheFormatError) as e:
            check()
        assert str(e.value) == error


SOURCE_PATH = "c/manifest.json: source {} must be a non-empty path without NUL, at most 12 long"


@pytest.mark.parametrize(
    "source, error",
    [
        ({"kind": "folder", "root": "/data/train"}, None),
        ({"kind": "folder", "root": "/data/train1"}, None),  # 12 characters: the limit
        ({"kind": "folder", "root": "/data/train12"}, SOURCE_PATH.format("root")),
        ({"kind": "folder", "root": ""}, SOURCE_PATH.format("root")),
        ({"kind": "folder", "root": "/da\x00ta"}, SOURCE_PATH.format("root")),
        ({"kind": "folder"}, SOURCE_PATH.format("root")),
        ({"kind": "list", "root": "/data", "list_file": "/l.txt"}, None),
        ({"kind": "list", "root": "/data"}, SOURCE_PATH.format("list_file")),
        ({"kind": "tar", "root": "/t.tar", "masks": "/m"}, None),
        ({"kind": "tar", "root": "/t.tar", "masks": 3}, SOURCE_PATH.format("masks")),
        ({"kind": "tar", "root": "/t.tar", "coco": ""}, SOURCE_PATH.format("coco")),
        ({"kind": "tar", "root": "/t.tar", "extra": 3}, None),  # only path keys are paths
    ],
)  # fmt: skip
def test_a_source_s_paths_are_names_within_the_limit(source, error):
    check = lambda: manifest_checks.check_source(source, Path("c/manifest.json"), 12)  # noqa: E731
    if error is None:
        check()
    else:
        with pytest.raises(CacheFormatError) as e:
            check()
        assert str(e.value) == error


@pytest.mark.parametrize("kind", ["nope", None, 3, "Folder"])
def test_a_source_of_a_kind_not_registered_is_refused_naming_the_kinds(kind):
    with pytest.raises(CacheFormatError) as e:
        manifest_checks.check_source({"kind": kind, "root": "/d"}, Path("c/manifest.json"), 12)
    # (a kind registered by another test may follow the built-in ones)
    assert str(e.value).startswith(
        f"c/manifest.json: source kind {kind!r} is not one of webdataset, zip, tar, list, folder"
    )
