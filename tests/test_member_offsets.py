"""A cache of an archive records where each member lies (its ``members`` file): a lazy fill,
``verify --source`` and a repair read one member there without listing the archive, check that
the place still holds it, list the archive when it changed, and refuse a file that lies."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder, reseal, write_image

from mmcache import (
    MemmapImageDataset,
    build_cache,
    compact_cache,
    copy_cache,
    create_lazy_cache,
    repair_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache.errors import CacheFormatError
from mmcache.sources import SOURCES


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Two classes of JPEGs of mixed sizes, and a PNG."""
    root = make_folder(tmp_path / "src", {"cat": [(40, 30), (31, 17)], "dog": [(20, 36)]})
    write_image(root / "dog" / "b.png", 18, 22, seed=8)
    return root


def _images(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file())


def _tar(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as t:
        t.add(src, ".")
    return dest


def _long_names(src: Path, dest: Path) -> Path:
    """A pax tar whose names need a pax header (long, not ASCII): the member's own header
    holds another name."""
    with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as t:
        for k, p in enumerate(_images(src)):
            t.add(p, f"{p.parent.name}/{'long' * 30}é{k}{p.suffix}")
    return dest


def _tar_of_tars(src: Path, dest: Path) -> Path:
    with tarfile.open(dest, "w") as t:
        for cls in ("cat", "dog"):
            t.add(_tar(src / cls, dest.parent / f"{cls}.tar"), f"{cls}.tar")
    return dest


def _zip(src: Path, dest: Path) -> Path:
    with zipfile.ZipFile(dest, "w") as z:
        for k, p in enumerate(_images(src)):  # stored and deflated members
            method = zipfile.ZIP_DEFLATED if k % 2 else zipfile.ZIP_STORED
            z.write(p, str(p.relative_to(src)), compress_type=method)
    return dest


class _Stream:
    """A file that cannot tell or seek (a pipe): zipfile writes each member's CRC-32 and sizes
    after its data (a data descriptor), its local header holding zeros."""

    def __init__(self, f) -> None:
        self.write, self.flush = f.write, f.flush


def _streamed_zip(src: Path, dest: Path) -> Path:
    with open(dest, "wb") as f, zipfile.ZipFile(_Stream(f), "w") as z:
        for k, p in enumerate(_images(src)):
            method = zipfile.ZIP_DEFLATED if k % 2 else zipfile.ZIP_STORED
            z.write(p, str(p.relative_to(src)), compress_type=method)
    assert zipfile.ZipFile(dest).infolist()[0].flag_bits & 0x08
    return dest


def _shards(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for s in range(2):
        with tarfile.open(dest / f"train-{s}.tar", "w") as t:
            for k, p in enumerate(_images(src)[s::2]):
                for name, data in ((f"k{k}{p.suffix}", p.read_bytes()), (f"k{k}.cls", b"1")):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
    return dest


ARCHIVES: dict[str, Callable[[Path, Path], Path]] = {
    "train.tar": _tar, "long.tar": _long_names, "outer.tar": _tar_of_tars, "train.zip": _zip,
    "streamed.zip": _streamed_zip, "shards": _shards,
}  # fmt: skip


class Listings:
    """Counts the listings of archive sources after ``watch``; with ``refuse``, each one fails
    the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count, self.refused = 0, False
        for kind in ("tar", "zip", "webdataset"):
            scan = SOURCES[kind].scan

            def counted(*args, _scan=scan, **kwargs):
                self.count += 1
                assert not self.refused, "the archive was listed"
                return _scan(*args, **kwargs)

            monkeypatch.setattr(SOURCES[kind], "scan", counted)

    def watch(self, refuse: bool) -> None:
        self.count, self.refused = 0, refuse


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> Listings:
    return Listings(monkeypatch)


def _pixels(cache: Path) -> list[np.ndarray]:
    ds = MemmapImageDataset(cache, on_stale="ignore")
    return [ds.read(i).copy() for i in range(len(ds))]


@pytest.mark.parametrize("name", list(ARCHIVES))
def test_a_lazy_fill_reads_one_member_without_listing_its_archive(tmp_path, src, name, listings):
    archive = ARCHIVES[name](src, tmp_path / name)
    build_cache(archive, tmp_path / "ref", workers=0)
    create_lazy_cache(archive, tmp_path / "lazy")
    m = fmt.read_manifest(tmp_path / "lazy")
    assert m.members is not None and m.file(fmt.MEMBERS_KIND).is_file()
    ds = MemmapImageDataset(tmp_path / "lazy", on_stale="ignore")
    listings.watch(refuse=True)
    expected = _pixels(tmp_path / "ref")
    for i in reversed(range(len(ds))):  # each fill its own member, in any order
        assert np.array_equal(ds.read(i), expected[i])
    assert listings.count == 0


def test_verify_source_and_repair_read_the_members_without_listing(tmp_path, src, listings):
    cache = tmp_path / "cache"
    build_cache(_tar(src, tmp_path / "train.tar"), cache, workers=0)
    listings.watch(refuse=True)
    report = verify_cache(cache, source="all")
    assert report.source_compared == 4 and not report.bad
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    with open(files.manifest.file("data"), "r+b") as f:  # damage record 1's pixels
        f.seek(int(files.index["offset"][1]))
        f.write(b"\xff" * 16)
    assert [b.index for b in repair_cache(cache, workers=0).repaired] == [1]
    assert not verify_cache(cache, source="all").bad and listings.count == 0


def test_an_archive_changed_since_the_build_is_listed_again_once(tmp_path, src, listings):
    tar = _tar(src, tmp_path / "train.tar")
    create_lazy_cache(tar, tmp_path / "lazy")
    ds = MemmapImageDataset(tmp_path / "lazy", on_stale="ignore")
    with tarfile.open(tar, "a") as t:  # a member appended: the others are where they were
        t.add(write_image(tmp_path / "new.jpg", 9, 9), "cat/new.jpg")
    listings.watch(refuse=False)
    assert all(ds.read(i) is not None for i in range(len(ds)))
    assert listings.count == 1


def _forge(cache: Path, edit: Callable[[np.ndarray, dict], None], seal: bool = True) -> None:
    """Edit the members file and its manifest entry, then seal both as a forger would (or,
    without ``seal``, leave the file's CRC-32 in the manifest as it was: damage)."""
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    path = cache / m["members"]["file"]
    table = np.fromfile(path, fmt.MEMBER_DTYPE)
    edit(table, m["members"])
    path.write_bytes(table.tobytes())
    if seal:
        m["members"]["crc32"] = zlib.crc32(path.read_bytes())
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    reseal(cache)


def _set(key: str, value: int) -> Callable[[np.ndarray, dict], None]:
    return lambda table, entry: table[key].__setitem__(0, value)


HOSTILE = {
    "outside": (_set("offset", 1 << 40), True, "lies outside its archive"),
    "absurd size": (_set("length", (1 << 64) - 1), True, "lies outside its archive"),
    "no archive": (_set("archive", 7), True, "not one of the manifest's"),
    "headers": (_set("header", 0), True, "headers lie outside"),
    "damaged": (_set("offset", 1 << 40), False, "checksum mismatch"),
}


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_a_members_file_that_lies_is_refused_in_one_line(tmp_path, src, attack, listings):
    tar = _tar(src, tmp_path / "train.tar")
    edit, seal, words = HOSTILE[attack]
    for make, cache in ((create_lazy_cache, tmp_path / "lazy"), (build_cache, tmp_path / "c")):
        make(tar, cache)
        _forge(cache, edit, seal)
    listings.watch(refuse=True)
    ds = MemmapImageDataset(tmp_path / "lazy", on_stale="ignore")
    with pytest.raises(CacheFormatError, match=words) as e:
        ds.read(0)  # a fill
    assert "members-" in str(e.value) and "\n" not in str(e.value)
    for cache in (tmp_path / "lazy", tmp_path / "c"):
        with pytest.raises(CacheFormatError, match=words):
            verify_cache(cache, source="all")
    with pytest.raises(CacheFormatError, match=words):
        repair_cache(tmp_path / "c", source="all", workers=0)
    assert listings.count == 0


def test_an_archive_outside_the_source_is_refused_at_open(tmp_path, src):
    create_lazy_cache(_tar(src, tmp_path / "train.tar"), tmp_path / "lazy")
    _forge(tmp_path / "lazy", lambda t, e: e["archives"][0].__setitem__(0, "/etc/shadow"))
    with pytest.raises(CacheFormatError, match="neither the source nor a file in its folder"):
        fmt.read_manifest(tmp_path / "lazy")


def test_a_place_that_holds_another_member_is_not_read_as_this_one(tmp_path, src, listings):
    # Records 0 and 1 trade places in the members file: each place holds a member, not the
    # record's, so the headers there do not describe it and the archive is listed instead.
    tar = _tar(src, tmp_path / "train.tar")
    build_cache(tar, tmp_path / "ref", workers=0)
    create_lazy_cache(tar, tmp_path / "lazy")

    def trade(t: np.ndarray, e: dict) -> None:
        for key in ("offset", "header"):
            t[key][[0, 1]] = t[key][[1, 0]]

    _forge(tmp_path / "lazy", trade)
    listings.watch(refuse=False)
    assert [a.shape for a in _pixels(tmp_path / "lazy")] == [
        a.shape for a in _pixels(tmp_path / "ref")
    ]
    assert all(map(np.array_equal, _pixels(tmp_path / "lazy"), _pixels(tmp_path / "ref")))
    assert listings.count == 1


def test_compaction_copy_and_repair_carry_the_members_file(tmp_path, src, listings):
    cache = tmp_path / "cache"
    build_cache(_tar(src, tmp_path / "train.tar"), cache, workers=0)
    compact_cache(cache)
    copy_cache(cache, tmp_path / "copy")
    for folder in (cache, tmp_path / "copy"):
        m = fmt.read_manifest(folder)
        assert m.members is not None and m.members["file"] == f"members-{m.generation}.bin"
        assert sorted(p.name for p in folder.glob("members-*")) == [m.members["file"]]
    listings.watch(refuse=True)
    assert verify_cache(tmp_path / "copy", source="all").source_compared == 4


def test_a_cache_without_the_file_or_with_another_generation_s_lists_the_archive(tmp_path, src):
    # A 5.0 cache has no members file; a writer that did not know the key carries it over to
    # a generation it did not write it for: both are read by listing the archive, as before.
    tar = _tar(src, tmp_path / "train.tar")
    build_cache(tar, tmp_path / "ref", workers=0)
    for k, change in enumerate(("drop", "carry")):
        cache = tmp_path / f"lazy{k}"
        create_lazy_cache(tar, cache)
        m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
        if change == "drop":
            (cache / m.pop("members")["file"]).unlink()
            m["format_version"] = [5, 0]
        else:
            m["members"]["file"] = "members-0123456789abcdef.bin"
        (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
        reseal(cache)
        assert fmt.read_manifest(cache).members is None
        assert all(map(np.array_equal, _pixels(cache), _pixels(tmp_path / "ref")))


def _local_header(name: bytes, data: bytes, flags: int, method: int, sizes: tuple) -> bytes:
    """A zip local header written by hand (APPNOTE 4.3.7: signature, version, flags, method,
    time, date, CRC-32, stored and inflated sizes, name and extra lengths), its name, a 4-byte
    extra field, then ``data``."""
    crc, stored, inflated = sizes
    fixed = struct.pack("<HHHHHIIIHH", 20, flags, method, 0, 0, crc, stored, inflated,
                        len(name), 4)  # fmt: skip
    return b"PK\x03\x04" + fixed + name + b"\xfe\xca\0\0" + data


_DATA = bytes(range(256)) * 8  # 2,048 bytes, the member's as stored
_CRC = zlib.crc32(_DATA)
_BOUND = 2048 + 2 + 64  # the most a deflated member of 2,048 bytes may be stored in (zlib)
_PLAIN = {"name": b"cat/a.png", "flags": 0, "method": 0, "sizes": (_CRC, 2048, 2048)}
_LATE = {"flags": 0x08, "method": 8, "sizes": (0, 0, 0)}  # sizes in a data descriptor
_ZIP64 = {"method": 8, "sizes": (_CRC, 0xFFFFFFFF, 0xFFFFFFFF)}
_DEFLATED = {"method": 8, "crc": _CRC, "name": "cat/a.png"}
# (the local header's fields, the member's address as recorded, what zip_holds answers)
ZIP_PLACES = {
    "as listed": ({}, {}, True),
    "its name with ./ and //": ({"name": b"./cat//a.png"}, {}, True),
    "its name cut at its first NUL": ({"name": b"cat/a.png\0tail\0end"}, {}, True),
    "another name": ({}, {"name": "cat/b.png"}, False),
    "a name one folder down": ({}, {"name": "x/cat/a.png"}, False),
    "UTF-8 by its flag": ({"name": "cat/é.png".encode(), "flags": 0x800}, {"name": "cat/é.png"},
                          True),
    "bad UTF-8 replaced": ({"name": b"cat/\xff.png", "flags": 0x800}, {"name": "cat/\ufffd.png"},
                           True),
    "cp437 without it": ({"name": "cat/é.png".encode(), "flags": 0x07},
                         {"name": "cat/\u251c\u2310.png"}, True),
    "cp437 is not UTF-8": ({"name": "cat/é.png".encode()}, {"name": "cat/é.png"}, False),
    "another method": ({}, {"method": 8}, False),
    "another data offset": ({}, {"offset": 1}, False),
    "not a local header": ({"magic": b"PK\x01\x02"}, {}, False),
    "a header cut short": ({"cut": 29}, {}, False),
    "another stored length": ({}, {"length": 2047}, False),
    "another inflated size": ({"sizes": (_CRC, 2048, 2047)}, {}, False),
    "another CRC-32": ({}, {"crc": _CRC ^ 1}, False),
    "a recorded CRC-32 of 0": ({}, {"crc": 0}, False),
    "no CRC-32 recorded": ({"sizes": (0, 2048, 2048)}, {"crc": -1}, True),
    "flag bits 0 to 2 are not a descriptor": ({"flags": 0x07}, {"length": 2047}, False),
    "a descriptor, stored": ({**_LATE, "method": 0}, {"length": 10**9}, True),
    "a descriptor, at deflate's bound": (_LATE, {**_DEFLATED, "length": _BOUND}, True),
    "a descriptor, past it": (_LATE, {**_DEFLATED, "length": _BOUND + 1}, False),
    "zip64 sizes, at the bound": (_ZIP64, {**_DEFLATED, "length": _BOUND}, True),
    "zip64 sizes, past it": (_ZIP64, {**_DEFLATED, "length": _BOUND + 1}, False),
}


@pytest.mark.parametrize("case", list(ZIP_PLACES))
def test_a_zip_place_holds_the_member_its_local_header_describes(tmp_path, case):
    from mmcache.sources.members import MemberAddress
    from mmcache.sources.zip_archive import zip_holds

    fields, changes, expected = ZIP_PLACES[case]
    header = {**_PLAIN, **{k: v for k, v in fields.items() if k in _PLAIN}}
    blob = b"junk" + _local_header(data=_DATA, **header)
    blob = fields.get("magic", b"PK\x03\x04").join(blob.split(b"PK\x03\x04", 1))
    path = tmp_path / "a.zip"
    path.write_bytes(blob[: 4 + fields["cut"]] if "cut" in fields else blob)
    offset = 4 + 30 + len(header["name"]) + 4
    ref = dataclasses.replace(
        MemberAddress(str(path), 0, 0, offset, 2048, 0, _CRC, "cat/a.png"), **changes
    )
    ref = dataclasses.replace(ref, offset=offset + changes.get("offset", 0))
    with open(path, "rb") as f:
        assert zip_holds(f.fileno(), ref, 4, 2048, 0) is expected
