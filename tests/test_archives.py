"""Archives as sources: a tar, a tar of tars, WebDataset shards and a zip build the cache their
extracted files build, byte for byte; hostile, truncated and damaged archives are named."""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import re
import subprocess
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder, write_image

from mmcache import build_cache, create_lazy_cache, scan_source
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.errors import SourceError


def cache_bytes(cache: Path) -> tuple[list[str], list[str], list[int], list[bytes]]:
    """(classes, paths, labels, each record's stored bytes): what two caches must share."""
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    data = files.manifest.file("data").read_bytes()
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels)
    pixels = [
        data[int(o) : int(o) + int(n)] for o, n in zip(files.index["offset"], nbytes, strict=True)
    ]
    labels = files.index["label"].tolist()
    return list(files.manifest.classes), files.paths(), labels, pixels


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """Two classes, JPEGs and PNGs of mixed sizes, one in a subfolder, a hidden file."""
    root = make_folder(tmp_path / "src", {"cat": [(40, 30), (31, 17)], "dog": [(20, 36)]})
    write_image(root / "cat" / "deep" / "x.png", 25, 19, seed=7)
    write_image(root / "dog" / "b.png", 18, 22, seed=8)
    (root / "dog" / ".hidden.jpg").write_bytes(b"not listed")
    (root / "dog" / "notes.txt").write_text("not an image")
    return root


def tar_of(folder: Path, dest: Path) -> Path:
    """``tar -C folder -cf dest .``: the members are ``./cls/...``."""
    with tarfile.open(dest, "w") as t:
        t.add(folder, ".")
    return dest


def test_tar_zip_and_tar_of_tars_equal_the_extracted_folder(tmp_path, src):
    expected = build_cache(src, tmp_path / "ref", workers=0, short_side=24)
    tar = tar_of(src, tmp_path / "train.tar")
    outer = tmp_path / "ILSVRC_train.tar"
    with tarfile.open(outer, "w") as t:
        for cls in ("cat", "dog"):  # one tar per class, its images flat or below
            tar_of(src / cls, tmp_path / f"{cls}.tar")
            t.add(tmp_path / f"{cls}.tar", f"{cls}.tar")
    zipped = tmp_path / "train.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        for p in sorted(src.rglob("*")):
            kind = zipfile.ZIP_STORED if p.suffix == ".png" else zipfile.ZIP_DEFLATED
            z.write(p, p.relative_to(src).as_posix(), compress_type=kind)
    ref = cache_bytes(tmp_path / "ref")
    for archive, kind in ((tar, "tar"), (outer, "tar"), (zipped, "zip")):
        cache = tmp_path / f"c-{archive.name}"
        report = build_cache(archive, cache, workers=0, short_side=24)
        assert report.images == expected.images and not report.skipped
        assert cache_bytes(cache) == ref, archive.name
        assert fmt.read_manifest(cache).source == {"root": str(archive), "kind": kind}
    # The decode workers (other processes) read the members as well; the cache is then current.
    report = build_cache(tar, tmp_path / "w", workers=1, short_side=24)
    assert cache_bytes(tmp_path / "w") == ref
    assert build_cache(tar, tmp_path / "w", workers=1, short_side=24).up_to_date


def shards(tmp_path: Path, src: Path, labels: str) -> tuple[Path, Path]:
    """Two WebDataset shards of ``src``'s images (``key.jpg`` + ``key.cls`` or ``key.json``),
    and the list file of the same images, extracted, with the same labels."""
    images = sorted(p for p in src.rglob("*") if p.suffix in (".jpg", ".png") and p.name[0] != ".")
    folder = tmp_path / "shards"
    folder.mkdir()
    lines = ["path,class" if labels == "json" else "path,label"]
    for s in range(2):
        with tarfile.open(folder / f"train-{s:04d}.tar", "w") as t:
            for k, p in enumerate(images[s::2]):
                key = f"s{s}k{k:03d}"
                label = p.parent.name if labels == "json" else str(len(p.parent.name) % 3)
                extra = f'{{"label": "{label}", "w": 1}}' if labels == "json" else label
                for name, data in ((f"{key}{p.suffix}", p.read_bytes()),
                                   (f"{key}.{labels}", extra.encode())):  # fmt: skip
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    t.addfile(info, io.BytesIO(data))
                lines.append(f"{p},{label}")
    listed = tmp_path / "list.csv"
    listed.write_text("\n".join(lines) + "\n")
    return folder, listed


@pytest.mark.parametrize("labels", ["cls", "json"])
def test_webdataset_shards_equal_a_list_of_the_extracted_files(tmp_path, src, labels):
    folder, listed = shards(tmp_path, src, labels)
    key = "label" if labels == "json" else None
    build_cache(listed, tmp_path / "ref", workers=0)
    ref_classes, ref_paths, ref_labels, ref_pixels = cache_bytes(tmp_path / "ref")
    pattern = str(folder / "train-{0000..0001}.tar")
    for source in (folder, pattern):
        cache = tmp_path / f"c{len(str(source))}"
        build_cache(scan_source(source, label_key=key), cache, workers=0)
        classes, paths, labels_, pixels = cache_bytes(cache)
        # Paths are shard/member names; each image once, with the label its list line gives.
        by_pixels = {px: lab for px, lab in zip(ref_pixels, ref_labels, strict=True)}
        assert classes == ref_classes
        assert sorted(pixels) == sorted(ref_pixels)
        assert [by_pixels[px] for px in pixels] == labels_
        assert paths[0] == "train-0000.tar/s0k000.png" and paths[-1].startswith("train-0001")
        m = fmt.read_manifest(cache)
        assert m.source.get("label_key") == key
        assert (m.source.get("pattern") is not None) == (source == pattern)
        assert build_cache(scan_source(source, label_key=key), cache, workers=0).up_to_date
    # The command line takes the pattern and the label key; the cache is then current.
    args = ["--label-key", "label"] if key else []
    assert main(["build", pattern, str(tmp_path / "cli"), "-q", "--workers", "0", *args]) == 0
    assert cache_bytes(tmp_path / "cli") == cache_bytes(cache)
    assert "up to date" in main_out(["build", pattern, str(tmp_path / "cli"), *args])
    info = main_out(["info", str(tmp_path / "cli")])
    assert "the source changed" not in info and "not found" not in info


def test_a_changed_archive_decodes_only_its_new_and_modified_members(tmp_path, src):
    tar = tar_of(src, tmp_path / "train.tar")
    cache = tmp_path / "cache"
    build_cache(tar, cache, workers=0)
    before = cache_bytes(cache)
    with tarfile.open(tar, "a") as t:  # one new image, one image replaced (the last copy wins)
        t.add(write_image(tmp_path / "new.jpg", 21, 21, seed=30), "cat/new.jpg")
        t.add(write_image(tmp_path / "other.jpg", 22, 23, seed=31), "dog/img_002.jpg")
    assert "the source changed" in main_out(["info", str(cache)])
    report = build_cache(tar, cache, workers=0)
    assert (report.decoded, report.reused) == (2, len(before[1]) - 1)
    warnings = {w["path"]: w["reason"] for w in fmt.read_manifest(cache).warnings}
    assert "the last copy is used" in warnings["dog/img_002.jpg"]
    extracted = tmp_path / "extracted"
    with tarfile.open(tar) as t:
        t.extractall(extracted, filter="data")  # the last copy of a name, as a user would get
    build_cache(extracted, tmp_path / "ref", workers=0)
    got, want = cache_bytes(cache)[1:], cache_bytes(tmp_path / "ref")[1:]
    assert sorted(zip(*got, strict=True)) == sorted(zip(*want, strict=True))


def main_out(argv: list[str]) -> str:
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_an_archive_changed_after_the_scan_stores_nothing_of_it(tmp_path, src):
    tar = tar_of(src, tmp_path / "train.tar")
    listing = scan_source(tar)
    os.utime(tar, ns=(1, 1))  # rewritten in place since it was listed
    with pytest.raises(SourceError, match="none of its"):
        build_cache(listing, tmp_path / "cache", workers=0)


def hostile_tar(path: Path, image: bytes) -> Path:
    def add(t: tarfile.TarFile, name: str, data: bytes = image, **kw) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        for k, v in kw.items():
            setattr(info, k, v)
        t.addfile(info, io.BytesIO(data) if info.isreg() else None)

    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as t:
        add(t, "cls/ok.jpg")
        add(t, "/etc/abs.jpg")
        add(t, "cls/../../up.jpg")
        add(t, "cls/link.jpg", b"", type=tarfile.SYMTYPE, linkname="/etc/passwd")
        add(t, "cls/hard.jpg", b"", type=tarfile.LNKTYPE, linkname="cls/ok.jpg")
        add(t, "cls/caf\udce9.jpg")  # a Latin-1 name: not UTF-8
        add(t, "cls/twice.jpg", b"first copy, not an image")
        add(t, "cls/twice.jpg")
        add(t, "cls/bad.jpg", image[: len(image) // 3] + b"\0" * 50)  # damaged bytes
        add(t, "./cls/./dot.jpg")
    return path


def test_hostile_member_names_are_left_out_with_reasons(tmp_path):
    image = write_image(tmp_path / "i.jpg", 16, 12).read_bytes()
    tar = hostile_tar(tmp_path / "hostile.tar", image)
    report = build_cache(tar, tmp_path / "cache", workers=0)
    classes, paths, _, pixels = cache_bytes(tmp_path / "cache")
    assert classes == ["cls"]
    assert paths == ["cls/caf\udce9.jpg", "cls/dot.jpg", "cls/ok.jpg", "cls/twice.jpg"]
    assert len(set(pixels)) == 1  # every kept member is the one image
    reasons = {w["path"]: w["reason"] for w in report.warnings}
    assert "absolute" in reasons["/etc/abs.jpg"]
    assert "'..'" in reasons["cls/../../up.jpg"]
    assert "a link" in reasons["cls/link.jpg"] and "a link" in reasons["cls/hard.jpg"]
    assert "last copy" in reasons["cls/twice.jpg"]
    assert [s["path"] for s in report.skipped] == ["cls/bad.jpg"]


def test_truncated_damaged_and_compressed_archives_are_named(tmp_path, src):
    tar = tar_of(src, tmp_path / "train.tar")
    raw = tar.read_bytes()
    cut = tmp_path / "cut.tar"
    for end in (len(raw) // 2, 1500, len(raw) - 10240 + 100):
        cut.write_bytes(raw[:end])
        with pytest.raises(SourceError, match="truncated|damaged"):
            scan_source(cut)
    damaged = bytearray(raw)
    third = raw.index(b"ustar", 1100) - 257  # a member header past the first ones
    damaged[third + 100 : third + 108] = b"garbage!"
    cut.write_bytes(bytes(damaged))
    with pytest.raises(SourceError, match="damaged or truncated archive.*checksum"):
        scan_source(cut)
    # a gzipped tar, by name or hidden in a .tar: the message's command decompresses it, to
    # the .tar the build then reads (as README.md says)
    for name in ("train.tar.gz", "hidden.tar"):
        gz = tmp_path / "gz" / name
        gz.parent.mkdir(exist_ok=True)
        gz.write_bytes(gzip.compress(raw))
        with pytest.raises(SourceError) as caught:
            scan_source(gz)
        command = re.search(r"run `([^`]+)` once", str(caught.value))[1]
        subprocess.run(command, shell=True, check=True)
        tars = sorted(gz.parent.glob("*.tar"))
        assert gz.exists() and scan_source(tars[0]).paths == scan_source(tar).paths
        tars[0].unlink()
    zipped = tmp_path / "t.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.write(src / "cat" / "img_000.jpg", "cat/a.jpg", compress_type=zipfile.ZIP_STORED)
        z.write(src / "cat" / "img_001.jpg", "cat/b.jpg", compress_type=zipfile.ZIP_DEFLATED)
    raw = bytearray(zipped.read_bytes())
    cut.with_suffix(".zip").write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(SourceError, match="damaged or truncated"):
        scan_source(cut.with_suffix(".zip"))
    raw[200] ^= 0xFF  # inside the first (stored) member's bytes
    zipped.write_bytes(bytes(raw))
    report = build_cache(zipped, tmp_path / "z", workers=0)
    assert report.images == 1
    assert "CRC-32" in report.skipped[0]["reason"]


def test_lazy_caches_of_archives_fill_from_the_members(tmp_path, src):
    from mmcache import MemmapImageDataset

    tar = tar_of(src, tmp_path / "train.tar")
    build_cache(src, tmp_path / "ref", workers=0)
    create_lazy_cache(tar, tmp_path / "lazy")
    ds = MemmapImageDataset(tmp_path / "lazy")
    ref = MemmapImageDataset(tmp_path / "ref")
    for i in range(len(ref)):
        assert np.array_equal(ds.read(i), ref.read(i))


def test_verify_and_repair_read_the_members_again(tmp_path, src):
    from mmcache import repair_cache, verify_cache

    tar = tar_of(src, tmp_path / "train.tar")
    cache = tmp_path / "cache"
    build_cache(tar, cache, workers=0)
    report = verify_cache(cache, source="all")
    assert report.source_compared == 5 and not report.bad
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    data = files.manifest.file("data")
    with open(data, "r+b") as f:  # damage record 1's pixels
        f.seek(int(files.index["offset"][1]))
        f.write(b"\xff" * 16)
    assert [b.index for b in verify_cache(cache).bad] == [1]
    repair_cache(cache, workers=0)
    assert not verify_cache(cache, source="all").bad
    # members gone from the archive since the build: not compared, each counted unavailable
    (src / "dog" / "b.png").unlink()
    (src / "cat" / "deep" / "x.png").unlink()
    tar_of(src, tar)
    report = verify_cache(cache, source="all")
    assert report.ok and (report.source_compared, report.source_unavailable) == (3, 2)


def test_verify_decodes_a_member_at_reduced_scale_as_the_build_did(tmp_path):
    from mmcache import verify_cache

    # A JPEG member shrunk 8x at decode (reduced_decode), whose 8x-reduced size rounds to
    # another aspect than its own: the comparison must decode as the build did (by the
    # member's name, .jpg, and from its native size), or it finds every pixel different.
    root = tmp_path / "src"
    write_image(root / "a" / "wide.jpg", 1000, 333)
    tar = tar_of(root, tmp_path / "train.tar")
    cache = tmp_path / "cache"
    build_cache(tar, cache, workers=0, short_side=40, reduced_decode=True)
    assert fmt.open_cache(cache).shape(0) == (40, 120, 3)
    report = verify_cache(cache, source="all")
    assert report.ok and report.source_compared == 1


@pytest.mark.parametrize("form", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_header_parser_reads_what_tarfile_reads(tmp_path, form, monkeypatch):
    import mmcache.sources.archive as archives

    image = write_image(tmp_path / "i.png", 9, 7).read_bytes()
    tar = tmp_path / "t.tar"
    # a short name last: after members of pax (or GNU) headers, one with none of its own
    names = ["c/a.png", "c/" + "long" * 40 + ".png", "c/" + "d" * 120 + "/e.png", "c/é.png"]
    names.append("c/z.png")
    if form == tarfile.USTAR_FORMAT:
        names = [names[0], names[2], names[4]]  # (ustar holds no long base name nor UTF-8 here)
    with tarfile.open(tar, "w", format=form) as t:
        for k, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(image), 1_700_000_000 + k
            t.addfile(info, io.BytesIO(image))
    fast = scan_source(tar)
    monkeypatch.setattr(
        archives, "read_headers", lambda *a: (_ for _ in ()).throw(archives.OtherHeaders())
    )
    slow = scan_source(tar)
    assert fast.paths == slow.paths == sorted(names, key=lambda n: (os.path.dirname(n), n))
    assert fast.mtimes.tolist() == slow.mtimes.tolist()
    assert [fast.abspath(i) for i in range(len(fast))] == [
        slow.abspath(i) for i in range(len(slow))
    ]


def test_a_shard_sample_without_a_label_or_twice_is_said(tmp_path):
    first, second = (
        write_image(tmp_path / f"{k}.jpg", 12, 10, seed=k).read_bytes() for k in (1, 2)
    )
    shard = tmp_path / "one.tar"
    with tarfile.open(shard, "w") as t:
        for name, data in (("a.jpg", first), ("a.cls", b"1"), ("b.jpg", first),
                           ("a.jpg", second), ("a.cls", b"0")):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    listing = scan_source(shard)
    assert (listing.kind, listing.paths, listing.labels.tolist()) == (
        "webdataset",
        ["one.tar/a.jpg"],
        [0],
    )
    reasons = {w["path"]: w["reason"] for w in listing.warnings}
    assert "no .cls member" in reasons["one.tar/b.jpg"]
    assert "last copy" in reasons["one.tar/a.jpg"]
    build_cache(listing, tmp_path / "c", workers=0)
    assert cache_bytes(tmp_path / "c")[3][0] == cache_bytes_of(second, tmp_path)


def cache_bytes_of(image: bytes, tmp_path: Path) -> bytes:
    """The record a build stores for these image bytes (as a file)."""
    folder = tmp_path / "single"
    folder.mkdir()
    (folder / "x.jpg").write_bytes(image)
    build_cache(folder, tmp_path / "single-cache", workers=0)
    return cache_bytes(tmp_path / "single-cache")[3][0]


def test_plan_reads_the_members_headers(tmp_path, src):
    from mmcache import plan_cache

    tar = tar_of(src, tmp_path / "train.tar")
    expected, planned = plan_cache(src, short_side=24), plan_cache(tar, short_side=24)
    assert (planned.files, planned.data_bytes) == (expected.files, expected.data_bytes)
    assert main_out(["plan", str(tar)]).count("\n") > 3


def test_an_absolute_member_name_is_left_out_saying_where_tar_would_put_it(tmp_path, src):
    # GNU tar and Python's tarfile extract /tmp/abs.jpg as tmp/abs.jpg: a class "tmp" that
    # nobody meant, so the scan leaves it out and says so (nothing is silently a class)
    tar = tar_of(src, tmp_path / "train.tar")
    with tarfile.open(tar, "a") as t:
        info = tarfile.TarInfo("/tmp/abs.jpg")
        data = (src / "cat" / "img_000.jpg").read_bytes()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    listing = scan_source(tar)
    assert listing.classes == ["cat", "dog"] and "tmp" not in listing.classes
    assert listing.warnings == [{
        "path": "/tmp/abs.jpg",
        "reason": "an absolute name in train.tar: left out (where it belongs is unclear: tar "
        "extracts it with its leading '/' removed, under a folder of that name, which a source "
        "would read as a class)",
    }]  # fmt: skip


def _members_tar(form: int) -> bytes:
    """A tar of each kind of member mmcache tells apart, with the mtimes and links it keeps."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=form) as t:
        for k, (name, kind, link) in enumerate([
            ("c", tarfile.DIRTYPE, ""), ("c/a.png", tarfile.REGTYPE, ""),
            ("c/s.png", tarfile.SYMTYPE, "a.png"), ("c/h.png", tarfile.LNKTYPE, "c/a.png"),
            ("c/fifo", tarfile.FIFOTYPE, ""), ("c/" + "n" * 120 + ".png", tarfile.REGTYPE, ""),
        ]):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = kind, link, 1_700_000_000 + k
            # the last member's data past tarfile's 64 KiB reads: the window moves on
            data = bytes(range(k * 50)) * (3 if k < 5 else 400) if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("form", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_tarfile_fallback_lists_what_the_header_parser_lists(tmp_path, form):
    # The fallback reads the headers only tarfile reads (sparse, multi-volume), through a window
    # on the outer file: from an inner tar at an offset, every member as the parser gives it.
    from mmcache.sources.tar_headers import read_by_tarfile, read_headers

    inner = _members_tar(form)
    path = tmp_path / "outer"
    path.write_bytes(b"x" * 1536 + inner + b"y" * 700)
    with open(path, "rb") as raw:
        parsed = list(read_headers(raw.fileno(), 1536, len(inner), "t"))
        fallback = list(read_by_tarfile(raw, 1536, len(inner), "t"))
        last = parsed[-1]
        cut = last.offset + (last.size + 511) // 512 * 512  # the end-of-archive blocks cut off
        with pytest.raises(SourceError, match=r"^t\.tar: a damaged .* after 6 members, without "
                           r"the end-of-archive blocks: it is truncated\. Nothing was built from "
                           r"it; download or create it again$"):  # fmt: skip
            list(read_by_tarfile(raw, 1536, cut, "t.tar"))
    # (tarfile drops a folder's trailing slash, which the parser keeps: folders are not read)
    assert [dataclasses.replace(m, name=m.name.rstrip("/")) for m in parsed] == fallback
    assert [(m.kind, m.linkname) for m in parsed[:5]] == [
        ("dir", ""), ("file", ""), ("link", "a.png"), ("link", "c/a.png"), ("other", "")
    ]  # fmt: skip
    assert inner[parsed[1].offset :][: parsed[1].size] == bytes(range(50)) * 3
    assert inner[parsed[5].offset :][: parsed[5].size] == bytes(range(250)) * 400
    # a header damaged past the first: tarfile stops there quietly, the fallback does not
    path.write_bytes(b"x" * 1536 + inner[:1536] + b"\1" * 512 + inner[2048:])  # the 3rd header
    damaged = r"^t\.tar: .* a damaged header at byte 1,536, after 2 members\. Nothing"
    with open(path, "rb") as raw, pytest.raises(SourceError, match=damaged):
        list(read_by_tarfile(raw, 1536, len(inner), "t.tar"))


def test_a_cache_s_recorded_members_probe_as_the_listed_ones(tmp_path, src):
    # Both kinds of a Listing's ``members`` are called ``probe(i, size, exif)``; the recorded
    # ones (repair's listing) once took no size, and a repair that probed one failed.
    from mmcache.sources import SOURCES

    tar = tar_of(src, tmp_path / "train.tar")
    build_cache(tar, tmp_path / "cache", workers=0)
    files = fmt.read_cache_files(fmt.read_manifest(tmp_path / "cache"))
    listing = scan_source(tar)
    assert listing.members is not None and listing.paths == files.paths()
    recorded = SOURCES[files.manifest.source["kind"]].recorded(files)
    assert recorded is not None
    for i in range(len(listing)):
        size = int(listing.sizes[i])
        assert recorded.probe(i, size, True) == listing.members.probe(i, size, True) is not None
