"""The checks of a manifest's parts (``mmcache._manifest``), each given a hand-written manifest
object: what each accepts at its limits, and what it refuses one past them, with the whole
message it refuses with."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from mmcache import CacheFormatError, CacheNotFoundError
from mmcache import _manifest as checks
from mmcache import format as fmt

MPATH = Path("c/manifest.json")
LIMIT = 12  # the path limit these tests pass (MAX_PATH is 4096)
I64 = 1 << 63


def _refused(check, message: str, error: type[Exception] = CacheFormatError) -> None:
    with pytest.raises(error) as e:
        check()
    assert type(e.value) is error
    assert str(e.value) == message


# --- parse_json_object: the bytes' size and parse cost, then JSON, then an object -------------

# {"a":[1,1,...,1]}: 5 + 1 + 999 * 2 + 2 + 1 = 2,007 bytes, whose two containers, 999 commas
# and one string cost 2 * 64 + 999 * 32 + 24 = 32,120.
OBJECT_OF_1000 = b'{"a":[' + b"1," * 999 + b"1]}"
COST_REFUSED = (
    "c/manifest.json: 2,007 bytes of JSON whose parse would take about 32,120 bytes of memory, "
    "more than the 32,119 a manifest may: not a manifest mmcache wrote"
)


def test_a_manifest_of_the_size_limit_is_parsed_and_one_byte_more_is_refused():
    raw = b'{"a": "bcd"}'  # 12 bytes
    assert checks.parse_json_object(raw, MPATH, 12, 1 << 20) == {"a": "bcd"}
    _refused(
        lambda: checks.parse_json_object(raw + b" ", MPATH, 12, 1 << 20),
        "c/manifest.json: larger than 12 bytes",
    )


def test_a_manifest_of_the_cost_limit_is_parsed_and_one_byte_of_cost_more_is_refused():
    parsed = checks.parse_json_object(OBJECT_OF_1000, MPATH, 1 << 20, 32120)
    assert parsed == {"a": [1] * 1000}
    _refused(lambda: checks.parse_json_object(OBJECT_OF_1000, MPATH, 1 << 20, 32119), COST_REFUSED)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b'{"a": ', "Expecting value: line 1 column 7 (char 6)"),
        (
            b'{"a": "\xff"}',
            "'utf-8' codec can't decode byte 0xff in position 7: invalid start byte",
        ),
        (b"", "Expecting value: line 1 column 1 (char 0)"),
    ],
)
def test_bytes_that_are_no_json_are_refused_as_damaged_naming_the_parser_s_reason(raw, reason):
    _refused(
        lambda: checks.parse_json_object(raw, MPATH, 1 << 20, 1 << 20),
        f"c/manifest.json: not valid JSON ({reason}); the file seems damaged",
    )


def test_json_too_deep_or_with_a_huge_integer_is_refused_as_damaged():
    for raw in (b"[" * 100_000, b"1" * 5000):
        with pytest.raises(CacheFormatError) as e:
            checks.parse_json_object(raw, MPATH, 1 << 20, 1 << 30)
        assert str(e.value).startswith("c/manifest.json: not valid JSON (")
        assert str(e.value).endswith("); the file seems damaged")


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"a"', b"7", b"null"])
def test_json_that_is_no_object_is_refused(raw):
    _refused(
        lambda: checks.parse_json_object(raw, MPATH, 1 << 20, 1 << 20),
        "c/manifest.json: expected a JSON object",
    )


def test_a_manifest_is_read_from_its_file_up_to_the_size_limit(tmp_path):
    mpath = tmp_path / "manifest.json"
    mpath.write_bytes(b'{"a": "bcd"}')
    assert checks.load_manifest_json(tmp_path, mpath, 12, 1 << 20, bool) == {"a": "bcd"}
    mpath.write_bytes(b'{"a": "bcd"} ')
    _refused(
        lambda: checks.load_manifest_json(tmp_path, mpath, 12, 1 << 20, bool),
        f"{mpath}: larger than 12 bytes",
    )


def test_a_folder_that_is_missing_or_holds_no_manifest_is_no_cache(tmp_path):
    missing = tmp_path / "gone"
    _refused(
        lambda: checks.load_manifest_json(missing, missing / "m.json", 12, 99, bool),
        f"{missing}: no cache here (not a folder)",
        CacheNotFoundError,
    )
    _refused(
        lambda: checks.load_manifest_json(tmp_path, tmp_path / "m.json", 12, 99, bool),
        f"{tmp_path}: an empty folder, not a cache; `mmcache build SOURCE CACHE` makes one",
        CacheNotFoundError,
    )


def test_a_folder_of_cache_files_without_its_manifest_is_an_unfinished_cache(tmp_path):
    (tmp_path / "index-1.bin").write_bytes(b"")
    _refused(
        lambda: checks.load_manifest_json(
            tmp_path, tmp_path / "m.json", 12, 99, lambda name: name.startswith("index-")
        ),
        f"{tmp_path}: no finished cache here (m.json is missing: a build was stopped before it "
        "published, or is running now); run `mmcache build` again",
        CacheNotFoundError,
    )


def test_a_huge_manifest_file_is_refused_without_being_read_whole(tmp_path):
    mpath = tmp_path / "manifest.json"
    with open(mpath, "wb") as f:
        f.truncate(16 << 20)  # sparse: 16 MiB of zeros that take no disk
    tracemalloc.start()
    try:
        with pytest.raises(CacheFormatError) as e:
            checks.load_manifest_json(tmp_path, mpath, 12, 1 << 20, bool)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(e.value) == f"{mpath}: larger than 12 bytes"
    assert peak < 1 << 20  # the limit and a byte more are read, not the file


# --- check_version and rebuild_command -------------------------------------------------------


def _version(version, m: dict | None = None):
    m = {"magic": "mmcache", "format_version": version, **(m or {})}
    return lambda: checks.check_version(m, Path("/c d"), MPATH, "mmcache", (5, 1), LIMIT)


@pytest.mark.parametrize(
    "version",
    [[5, 0], [5, 1], [5, 7], [5, (1 << 31) - 1]],  # a minor version of the major read is read
)
def test_a_format_version_of_the_major_read_is_read(version):
    assert _version(version)() == (version[0], version[1])


@pytest.mark.parametrize(
    "version",
    [[5], [5, 1, 0], [5, 1 << 31], [5, -1], [-1, 1], [5, 1.0], [5, True], "5.1", None],
)
def test_a_format_version_that_is_no_pair_of_31_bit_naturals_is_refused(version):
    _refused(
        _version(version),
        f"c/manifest.json: format_version is {version!r}, expected [major, minor]",
    )


def test_the_magic_is_checked_word_for_word():
    _refused(
        lambda: checks.check_version({"magic": "mmcache "}, Path("c"), MPATH, "mmcache", (5, 1), 9),
        "c/manifest.json: magic is 'mmcache ', expected 'mmcache'",
    )


def test_a_newer_major_is_refused_naming_the_versions_and_an_older_one_naming_the_rebuild():
    _refused(
        _version([6, 0]),
        "c/manifest.json: format version 6.0 is not supported by this mmcache (it reads 5.x); "
        "upgrade mmcache or rebuild the cache",
    )
    old = "c/manifest.json: written by a development version of mmcache (format 4.3), which this "
    old += "one does not read; rebuild it: mmcache build "
    _refused(_version([4, 3], {"source": {"root": "/data/a b"}}), old + "'/data/a b' '/c d'")
    # 12 characters, the limit, is named; 13, a root that is no name, or no source: SOURCE
    _refused(_version([4, 3], {"source": {"root": "/data/abcdef"}}), old + "/data/abcdef '/c d'")
    for source in ({"root": "/data/abcdefg"}, {"root": ""}, {"root": 7}, {}, ["/data"], None):
        _refused(_version([4, 3], {"source": source}), old + "SOURCE '/c d'")


# --- check_requires ----------------------------------------------------------------------------

FEATURES = ("fields", "masks", "layout:rgb")


@pytest.mark.parametrize("requires", [[], ["masks"], ["layout:rgb", "fields", "masks"]])
def test_features_all_known_are_the_cache_s_requirements(requires):
    assert checks.check_requires(requires, MPATH, FEATURES) == requires


@pytest.mark.parametrize("requires", [None, "masks", ["masks", 3], {"masks": 1}])
def test_requirements_that_are_no_list_of_names_are_refused(requires):
    _refused(
        lambda: checks.check_requires(requires, MPATH, FEATURES),
        f"c/manifest.json: requires is {requires!r}, expected a list of feature names",
    )


def test_unknown_requirements_are_refused_naming_each_and_the_features_known():
    _refused(
        lambda: checks.check_requires(["hdr", "masks", "Fields"], MPATH, FEATURES),
        "c/manifest.json: the cache requires 'hdr', 'Fields', which this mmcache does not know "
        "(it knows fields, masks, layout:rgb); upgrade mmcache or rebuild the cache",
    )


# --- check_files: the files and sizes of one generation -------------------------------------

GEN = "0123456789abcdef"
OLD = "fedcba9876543210"
KINDS = ("index", "state", "paths", "data")


def _files(files, sizes, kinds=KINDS, max_bytes=100):
    m = {"files": files, "sizes": sizes}
    return lambda: checks.check_files(
        m, kinds, GEN, MPATH, fmt.file_name, fmt._data_generation, max_bytes
    )


def _names(data_gen=GEN, **more):
    names = {k: f"{k}-{GEN}.bin" for k in ("index", "state", "paths")}
    return {**names, "data": f"data-{data_gen}.bin", **more}


SIZES = {"index": 0, "state": 1, "paths": 99, "data": 7}


def test_a_generation_s_files_and_sizes_are_read_with_the_data_file_s_generation():
    assert _files(_names(), SIZES)() == (GEN, SIZES)
    # the data file may be an earlier generation's: the records stay where they were
    assert _files(_names(OLD), SIZES)() == (OLD, SIZES)
    fields = {**SIZES, "fields": 99}
    kinds = (*KINDS, "fields")
    assert _files(_names(fields=f"fields-{GEN}.bin"), fields, kinds)() == (GEN, fields)


NOT_THE_GENERATION = "c/manifest.json: file names do not match the generation"


@pytest.mark.parametrize(
    "files",
    [
        _names(index=f"index-{OLD}.bin"),
        _names(paths=f"paths-{OLD}.bin"),
        _names(state="state.bin"),
        {k: v for k, v in _names().items() if k != "state"},
        _names(fields=f"fields-{GEN}.bin"),  # a kind the cache does not have
        list(_names().values()),
        None,
    ],
)
def test_files_of_another_generation_or_kinds_are_refused(files):
    _refused(_files(files, SIZES), NOT_THE_GENERATION)


@pytest.mark.parametrize("data", ["data.bin", f"data-{GEN}.tmp", f"index-{GEN}.bin", 7, None])
def test_a_data_file_name_that_names_no_generation_is_refused_naming_it(data):
    _refused(
        _files({**_names(), "data": data}, SIZES),
        f"c/manifest.json: data file name {data!r} is not data-<16 hex digits>.bin",
    )


@pytest.mark.parametrize(
    "sizes, ok",
    [
        ({**SIZES, "data": 99}, True),  # one below the limit passed: the largest size
        ({**SIZES, "data": 100}, False),
        ({**SIZES, "index": -1}, False),
        ({**SIZES, "paths": 1.0}, False),
        ({**SIZES, "state": True}, False),
        ({**SIZES, "fields": 0}, False),
        ({k: v for k, v in SIZES.items() if k != "data"}, False),
        ([0, 1, 99, 7], False),
        (None, False),
    ],
)
def test_file_sizes_are_naturals_below_the_limit_one_for_each_file(sizes, ok):
    if ok:
        assert _files(_names(), sizes)() == (GEN, sizes)
    else:
        _refused(_files(_names(), sizes), "c/manifest.json: bad file sizes")


# --- check_layout and check_options ------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{}, {"pixels": "rgb"}, {"pixels": "yuv420"}, {"mask": "uint8"}, {"mask": "uint16"},
     {"pixels": "yuv420", "mask": None}],
)  # fmt: skip
def test_the_layouts_and_mask_dtypes_known_are_read(options):
    assert checks.check_layout(options, MPATH) is None


@pytest.mark.parametrize("layout", ["RGB", "bgr", "", None, 3, ["rgb"]])
def test_an_unknown_layout_is_refused_naming_the_layouts_read(layout):
    _refused(
        lambda: checks.check_layout({"pixels": layout, "mask": "uint8"}, MPATH),
        f"c/manifest.json: records are stored in pixel layout {layout!r}, which this mmcache "
        "does not know (it reads rgb, yuv420); upgrade mmcache or rebuild the cache",
    )


@pytest.mark.parametrize("mask", ["UINT8", "int8", "float32", "", 8, ["uint8"]])
def test_an_unknown_mask_dtype_is_refused_naming_it(mask):
    _refused(
        lambda: checks.check_layout({"pixels": "rgb", "mask": mask}, MPATH),
        f"c/manifest.json: records carry masks of {mask!r}, which this mmcache does not know; "
        "upgrade mmcache or rebuild the cache",
    )


def test_options_that_are_not_valid_are_refused_with_the_reason_and_the_fix():
    assert checks.check_options({"size": [4, 6]}, MPATH) is None
    with pytest.raises(CacheFormatError) as e:
        checks.check_options({"sharpen": 2}, MPATH)
    assert str(e.value) == (
        "c/manifest.json: options are not valid: unknown option 'sharpen'; rebuild the cache"
    )


# --- check_entries: the skipped and warnings lists --------------------------------------------


def _entries(skipped, warnings=()):
    m = {"skipped": skipped, "warnings": list(warnings)}
    return lambda: checks.check_entries(m, MPATH, LIMIT)


def _not_entries(key: str) -> str:
    return (
        f"c/manifest.json: {key} must be a list of {{path, reason}} (and integer size, mtime_ns, "
        "state)"
    )


GOOD_ENTRIES = [
    {"path": "a", "reason": "unreadable"},
    {"path": "a/b/c/d/e/fg", "reason": ""},  # 12 characters: the limit; any reason
    {"path": "a", "reason": "r", "size": I64 - 1, "mtime_ns": -I64, "state": 0},
    {"path": "a", "reason": "r", "size": -I64, "mtime_ns": I64 - 1, "state": I64 - 1},
    {"path": "a", "reason": "r", "state": -I64, "extra": "kept"},
]


@pytest.mark.parametrize("entry", GOOD_ENTRIES)
def test_entries_with_a_path_a_reason_and_int64_numbers_are_read(entry):
    assert _entries([entry], [entry])() is None


def test_empty_lists_of_entries_are_read():
    assert _entries([])() is None


BAD_ENTRIES = [
    {"path": "a/b/c/d/e/fgh", "reason": "r"},  # 13 characters
    {"path": "", "reason": "r"},
    {"path": "a\x00", "reason": "r"},
    {"path": 3, "reason": "r"},
    {"reason": "r"},
    {"path": "a"},
    {"path": "a", "reason": 3},
    {"path": "a", "reason": None},
    *({"path": "a", "reason": "r", key: value} for key in ("size", "mtime_ns", "state")
      for value in (I64, -I64 - 1, 1.0, True, "1", None)),
    ["a", "r"],
    "a",
]  # fmt: skip


@pytest.mark.parametrize("entry", BAD_ENTRIES)
def test_an_entry_without_a_path_a_reason_or_with_numbers_not_int64_is_refused(entry):
    _refused(_entries([GOOD_ENTRIES[0], entry]), _not_entries("skipped"))
    _refused(_entries([], [entry, GOOD_ENTRIES[0]]), _not_entries("warnings"))


@pytest.mark.parametrize("entries", [None, {"path": "a", "reason": "r"}, "a", ({"path": "a"},)])
def test_entries_that_are_no_list_are_refused(entries):
    _refused(_entries(entries), _not_entries("skipped"))
    _refused(lambda: checks.check_entries({"skipped": []}, MPATH, LIMIT), _not_entries("warnings"))


# --- check_members: the members file's entry and the archives it names -----------------------

# A members layout written out by hand: 8 + 4 = 12 bytes a record, packed.
MEMBERS_DTYPE = np.dtype([("offset", "<u8"), ("length", "<u4")])
MEMBERS_DESCR = [["offset", "<u8"], ["length", "<u4"]]
MEMBERS_FILE = f"members-{GEN}.bin"
TAR = {"kind": "tar", "root": "/d/t.tar"}
SHARDS = {"kind": "webdataset", "root": "/d/shards", "pattern": "/d/shards/s-{0..9}.tar"}
AT_LIMIT = "/d/" + "a" * 17 + ".tar"  # 24 characters: the path limit of these tests
PATTERN_ELSEWHERE = {"kind": "webdataset", "root": "/d/shards", "pattern": "/e/s-{0..9}.tar"}


def _entry(**changes):
    entry = {
        "file": MEMBERS_FILE,
        "size": 3 * 12,
        "crc32": 0,
        "dtype": MEMBERS_DESCR,
        "archives": [["/d/t.tar", 10, 0]],
    }
    return {**entry, **changes}


def _members(entry, source=TAR, count=3):
    m = {"source": source} if entry is None else {"source": source, "members": entry}
    return lambda: checks.check_members(m, count, MPATH, MEMBERS_FILE, MEMBERS_DTYPE, 24)


def test_a_cache_without_a_members_entry_has_no_members():
    assert _members(None)() is None


def test_a_members_entry_of_another_generation_s_file_is_left_for_the_members_to_be_listed():
    assert _members(_entry(file=f"members-{OLD}.bin"))() is None
    # what is not this generation's file is not read further
    assert _members(_entry(file="members.bin", size=-1, archives=None))() is None


@pytest.mark.parametrize(
    "entry, source",
    [
        (_entry(), TAR),
        (_entry(crc32=(1 << 32) - 1), TAR),
        (_entry(archives=[]), TAR),
        (_entry(archives=[["/d/t.tar", 0, -I64]]), TAR),
        (_entry(archives=[["/d/t.tar", (1 << 62) - 1, I64 - 1]]), TAR),
        (_entry(archives=[["/d/shards/s-0.tar", 10, 0], ["/d/shards/s-9.tar", 10, 0]]), SHARDS),
        (_entry(archives=[["/d/shards", 10, 0]]), SHARDS),  # the root itself
        (_entry(archives=[["/e/s-1.tar", 10, 0]]), PATTERN_ELSEWHERE),  # in the pattern's folder
        (_entry(archives=[["/d/shards/x.tar", 10, 0]]), PATTERN_ELSEWHERE),  # in the root
        (_entry(archives=[["/d/t.tar/a.tar", 10, 0]]), TAR),  # "in" the root: a file there
        (_entry(archives=[[AT_LIMIT, 10, 0]]), {"kind": "tar", "root": AT_LIMIT}),
    ],
)
def test_a_members_entry_of_this_generation_with_archives_of_its_source_is_read(entry, source):
    assert _members(entry, source)() == entry


KEYS_REFUSED = "c/manifest.json: members must be {archives, crc32, dtype, file, size}"


@pytest.mark.parametrize(
    "entry",
    [
        {k: v for k, v in _entry().items() if k != "crc32"},
        _entry(extra=1),
        [MEMBERS_FILE, 36, 0, MEMBERS_DESCR, []],
        "members.bin",
    ],
)
def test_a_members_entry_of_other_keys_is_refused_naming_the_keys(entry):
    _refused(_members(entry), KEYS_REFUSED)


@pytest.mark.parametrize(
    "dtype",
    [
        [["offset", "<u8"]],
        [["offset", "<u8"], ["length", "<u8"]],
        [["offset", ">u8"], ["length", ">u4"]],
        [["length", "<u4"], ["offset", "<u8"]],
        [["offset", 0], ["length", 8]],  # the fields' offsets, not their types
        "|V12",
    ],
)
def test_a_members_entry_of_another_layout_is_refused(dtype):
    _refused(
        _members(_entry(dtype=dtype)),
        "c/manifest.json: members dtype is not the layout of the spec",
    )


@pytest.mark.parametrize("size, count", [(35, 3), (37, 3), (12, 3), (36, 2), (0, 1)])
def test_a_members_file_not_of_one_record_a_record_is_refused(size, count):
    _refused(_members(_entry(size=size), count=count), "c/manifest.json: members size != count")


def test_a_members_file_of_no_records_is_read_for_no_records():
    assert _members(_entry(size=0), count=0)() == _entry(size=0)


@pytest.mark.parametrize("crc", [1 << 32, -1, 1.0, True, "0", None])
def test_a_members_crc_that_is_no_crc_32_is_refused(crc):
    _refused(_members(_entry(crc32=crc)), "c/manifest.json: members crc32 is not a CRC-32")


NOT_ARCHIVES = "c/manifest.json: members archives must be [path, size, mtime_ns] lists"


@pytest.mark.parametrize(
    "archives",
    [
        None,
        {"/d/t.tar": [10, 0]},
        (["/d/t.tar", 10, 0],),
        [("/d/t.tar", 10, 0)],
        [["/d/t.tar", 10]],
        [["/d/t.tar", 10, 0, 0]],
        [[AT_LIMIT[:-4] + "a.tar", 10, 0]],  # 25 characters
        [["", 10, 0]],
        [["/d/t\x00.tar", 10, 0]],
        [[3, 10, 0]],
        [["/d/t.tar", 1 << 62, 0]],
        [["/d/t.tar", -1, 0]],
        [["/d/t.tar", 10.0, 0]],
        [["/d/t.tar", True, 0]],
        [["/d/t.tar", 10, I64]],
        [["/d/t.tar", 10, -I64 - 1]],
        [["/d/t.tar", 10, 0.0]],
        [["/d/t.tar", 10, False]],
        [["/d/t.tar", 10, 0], ["/d/t.tar", 10, None]],  # every archive is checked
    ],
)
def test_archives_that_are_no_lists_of_path_size_and_mtime_are_refused(archives):
    _refused(_members(_entry(archives=archives)), NOT_ARCHIVES)


@pytest.mark.parametrize(
    "path, source",
    [
        ("/d/u.tar", TAR),  # beside the source, not the source
        ("/d", TAR),
        ("d/t.tar", {"kind": "tar", "root": "d/t.tar"}),  # the source, but no absolute path
        ("t.tar", {"kind": "tar", "root": "t.tar"}),
        ("/d/shards/sub/s-1.tar", SHARDS),  # below the folder, not in it
        ("/d/s-1.tar", SHARDS),
        ("/e/sub/s-1.tar", PATTERN_ELSEWHERE),
        ("/f/s-1.tar", PATTERN_ELSEWHERE),
    ],
)
def test_an_archive_that_is_neither_the_source_nor_in_its_folder_is_refused_naming_it(path, source):
    archives = [[source["root"], 10, 0], [path, 10, 0]] if path[0] == "/" else [[path, 10, 0]]
    _refused(
        _members(_entry(archives=archives), source),
        f"c/manifest.json: members archive {path!r} is neither the source nor a file in its folder",
    )
