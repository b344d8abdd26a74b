"""Hostile archives, images and caches are refused within bounded time and memory (issue 38)."""

from __future__ import annotations

import io
import json
import os
import resource
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import reseal, write_image

import mmcache._staleness
from mmcache import BatchLoader, MemmapImageDataset, build_cache, cache_info, create_lazy_cache
from mmcache import format as fmt
from mmcache.errors import CacheFormatError, SourceError

AS_LIMIT = 2 << 30  # the address space each attack runs in (mmcache without torch needs ~0.5 GB)


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_bounded(code: str) -> str:
    """Run ``code`` in a fresh Python under a 2 GB address-space limit; its stdout."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        preexec_fn=_limited, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _build_reason(source: Path, cache: Path) -> str:
    """The reason a build from ``source`` gives for skipping its one image, under the limit."""
    return run_bounded(
        "from mmcache.build import build_cache\nfrom mmcache.errors import SourceError\n"
        f"try:\n    build_cache({str(source)!r}, {str(cache)!r}, workers=1)\n"
        "except SourceError as e:\n    print(e)\n"
    )


def _scan_error(path: Path) -> str:
    return run_bounded(
        "from mmcache.scan import scan_source\nfrom mmcache.errors import SourceError\n"
        f"try:\n    scan_source({str(path)!r})\nexcept SourceError as e:\n    print(e)\n"
    )


def _tar_with_size_field(path: Path, field: bytes, kind: bytes = b"0") -> None:
    """A tar of one member ``a/x.png`` whose header's size field is ``field`` (12 bytes)."""
    info = tarfile.TarInfo("a/x.png")
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[124:136] = field
    header[156:157] = kind
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    path.write_bytes(bytes(header) + bytes(1024))


def test_a_negative_tar_member_size_is_refused_not_looped_on(tmp_path):
    # GNU base-256 -512: the next header would be this one again, forever (1,536 bytes).
    tar = tmp_path / "neg.tar"
    _tar_with_size_field(tar, b"\xff" + (-512 % (1 << 88)).to_bytes(11, "big"))
    assert tar.stat().st_size == 1536
    message = _scan_error(tar)
    assert "neg.tar" in message and "negative size (-512 bytes)" in message


def test_a_negative_size_after_a_sparse_header_is_refused_by_tarfile_too(tmp_path):
    # A sparse header first: the tar is read by tarfile, which looped on -512 as well.
    tar = tmp_path / "sparse.tar"
    _tar_with_size_field(tmp_path / "s", b"%011o\0" % 0, kind=b"S")
    _tar_with_size_field(tar, b"\xff" + (-512 % (1 << 88)).to_bytes(11, "big"))
    tar.write_bytes((tmp_path / "s").read_bytes()[:512] + tar.read_bytes())
    message = _scan_error(tar)
    assert "sparse.tar" in message and "gives its member -512 bytes" in message


def test_a_tar_member_larger_than_its_archive_is_refused(tmp_path):
    tar = tmp_path / "big.tar"
    _tar_with_size_field(tar, b"\x80" + (1 << 40).to_bytes(11, "big"))
    message = _scan_error(tar)
    assert "big.tar" in message and "1,099,511,627,776 bytes" in message


def test_a_long_name_header_is_capped(tmp_path):
    # A GNU long-name header declaring 1.5 GiB, held by a sparse file of a few KB on disk.
    tar = tmp_path / "name.tar"
    length = 3 << 29
    _tar_with_size_field(tar, b"\x80" + length.to_bytes(11, "big"), kind=b"L")
    with open(tar, "r+b") as f:
        f.truncate(512 + length + 1024)
    message = _scan_error(tar)
    assert "GNU long-name header at byte 0 holds 1,610,612,736 bytes" in message


def _zip_bomb(path: Path, inflated_mib: int) -> None:
    """A zip of one deflated member ``a/x.png`` that inflates to ``inflated_mib`` MiB of zeros,
    from ~1 KB per MiB: full-flushed deflate blocks repeat byte for byte."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(bytes(1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    data = block * inflated_mib + c.flush()
    name, size = b"a/x.png", inflated_mib << 20
    crc = 0  # never reached: the bomb is refused before its CRC-32 is checked
    local = struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(data),
                        size, len(name), 0)  # fmt: skip
    central = struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 8, 0, 0x21, crc,
                          len(data), size, len(name), 0, 0, 0, 0, 0, 0)  # fmt: skip
    directory_at = len(local) + len(name) + len(data)
    end = struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 1, 1, len(central) + len(name),
                      directory_at, 0)  # fmt: skip
    path.write_bytes(local + name + data + central + name + end)


def test_a_zip_bomb_is_refused_without_inflating_it(tmp_path):
    bomb = tmp_path / "bomb.zip"
    _zip_bomb(bomb, 1024)  # 1 MiB that inflates to 1 GiB
    assert bomb.stat().st_size < (2 << 20)
    out = _build_reason(bomb, tmp_path / "c")
    assert "1,073,741,824 bytes, more than the 268,435,456" in out


def test_a_zip_member_inflating_past_its_declared_size_is_refused(tmp_path):
    bomb = tmp_path / "liar.zip"
    _zip_bomb(bomb, 2)
    raw = bytearray(bomb.read_bytes())
    for at in (22, raw.rindex(b"PK\x01\x02") + 24):  # both headers now declare 1,000 bytes
        raw[at : at + 4] = struct.pack("<I", 1000)
    bomb.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="inflates to more than 1,000 bytes"):
        build_cache(bomb, tmp_path / "c", workers=1)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_max_pixels_is_checked_before_decoding_when_the_probe_is_unsure(tmp_path):
    # A 20000 x 20000 PNG (1.2 GB decoded) whose 5 MiB text chunk leaves the size probe
    # unsure: refused from its IHDR, not decoded (the IDAT here would not even decode).
    png = tmp_path / "a" / "bomb.png"
    png.parent.mkdir()
    text = 5 << 20
    with open(png, "wb") as f:
        ihdr = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)  # 8-bit RGB
        f.write(b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr))
        f.write(struct.pack(">I", text) + b"tEXt")
        f.seek(text + 4, os.SEEK_CUR)  # a sparse text chunk and a CRC of zeros
        f.write(_png_chunk(b"IDAT", zlib.compress(bytes(1000))) + _png_chunk(b"IEND", b""))
    out = _build_reason(tmp_path / "a", tmp_path / "c")
    assert "20000x20000 pixels (400,000,000), more than the --max-pixels" in out


def test_batch_loader_verifies_on_first_read_as_ds_does(tmp_path):
    folder = tmp_path / "src"
    for i in range(4):
        write_image(folder / "a" / f"{i}.png", 8, 6, seed=i)
    cache = tmp_path / "c"
    build_cache(folder, cache, workers=1)
    m = fmt.read_manifest(cache)
    files = fmt.read_cache_files(m)
    with open(m.file("data"), "r+b") as f:  # one byte of record 2 flipped
        at = int(files.index["offset"][2])
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    ds = MemmapImageDataset(cache, verify="first-read")
    with pytest.raises(CacheFormatError, match="damaged"):
        ds[2]
    ds = MemmapImageDataset(cache, verify="first-read")
    with pytest.raises(CacheFormatError, match="damaged"):
        list(BatchLoader(ds, batch_size=4, shuffle=False, num_threads=1))
    assert np.array_equal(ds[0][0], MemmapImageDataset(cache)[0][0])


@pytest.mark.parametrize(
    ("max_pixels", "shape", "state"),
    [
        (64, (9, 8), fmt.BAD_TOO_LARGE),  # 72 pixels
        (72, (9, 8), fmt.BAD_HEADER_MISMATCH),  # decoded: an 8 x 8 image, not 9 x 8
        (None, (16384, 16384), fmt.BAD_TOO_LARGE),  # the default bounds it
        (1 << 40, (16384, 16384), fmt.BAD_TOO_LARGE),  # a limit above the default: capped
    ],
)
def test_a_lazy_record_the_manifest_makes_too_large_is_not_decoded(
    tmp_path, max_pixels, shape, state
):
    """In process (the test above runs in a child, which a mutation pass does not see): the
    record's shape in the index, not the file, is bounded by the manifest's max_pixels and by
    the default; a record within them is decoded (here to another size: refused so)."""
    from mmcache._records import open_reader

    write_image(tmp_path / "src" / "a" / "0.png", 8, 8)
    cache = tmp_path / "c"
    create_lazy_cache(tmp_path / "src", cache, size=(8, 8))
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    index = np.fromfile(cache / m["files"]["index"], fmt.INDEX_DTYPE)
    index["height"], index["width"] = shape
    index.tofile(cache / m["files"]["index"])
    m["options"]["max_pixels"] = max_pixels
    m["sizes"]["data"] = shape[0] * shape[1] * 3
    os.truncate(cache / m["files"]["data"], m["sizes"]["data"])  # sparse
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    m = reseal(cache)
    assert open_reader(cache, m["generation"], False).stored_or_none(0) is None
    states = np.fromfile(cache / m["files"]["state"], fmt.STATE_DTYPE)
    assert (int(states["crc32"][0]), int(states["state"][0])) == (0, state)


def _shard(path: Path, png: bytes) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in (("k.png", png), ("k.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_fifo_among_shards_is_refused_without_blocking(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(shards / "s-0.tar", write_image(tmp_path / "x.png", 4, 4).read_bytes())
    os.mkfifo(shards / "s-1.tar")  # opened for reading, it would wait for a writer forever
    message = _scan_error(shards)
    assert "s-1.tar" in message and "not a regular file" in message


def test_a_manifest_naming_a_huge_root_is_not_walked_whole(tmp_path, monkeypatch):
    # The check's walk stops after 4 entries per record and EXTRA_ENTRIES (100,000; 10 here):
    # a manifest naming / as its source must not make info or an open walk the file system.
    monkeypatch.setattr(mmcache._staleness, "EXTRA_ENTRIES", 10, raising=False)
    for i in range(2):
        write_image(tmp_path / "src" / "a" / f"{i}.png", 4, 4, seed=i)
    cache = tmp_path / "c"
    build_cache(tmp_path / "src", cache, workers=1)
    huge = tmp_path / "huge"
    for i in range(30):
        write_image(huge / "a" / f"{i}.png", 1, 1)
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    m["source"]["root"] = str(huge)
    m.pop("source_stamps", None)  # the quick check cannot vouch for the new root
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    reseal(cache)
    info = cache_info(cache)
    assert info.stale is not None and "holds more than 18 files and folders" in info.stale


def _forged_count(tmp_path: Path, count: int) -> Path:
    """A built cache whose manifest declares ``count`` records, its index, state and paths
    files grown to match as sparse files (a few KB on disk)."""
    for i in range(2):
        write_image(tmp_path / "src" / "a" / f"{i}.png", 4, 4, seed=i)
    cache = tmp_path / "c"
    build_cache(tmp_path / "src", cache, workers=1)
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    m["count"] = count
    m["sizes"]["index"] = count * fmt.INDEX_DTYPE.itemsize
    m["sizes"]["state"] = count * fmt.STATE_DTYPE.itemsize
    m["sizes"]["paths"] = count * 8
    for kind in ("index", "state", "paths"):
        os.truncate(cache / m["files"][kind], m["sizes"][kind])
    m["checksums"]["manifest"] = fmt.manifest_checksum(m)
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    return cache


def test_a_sparse_cache_declaring_50m_records_is_refused_before_allocating(tmp_path):
    cache = _forged_count(tmp_path, 50_000_000)
    out = run_bounded(
        "from mmcache import format as fmt\nfrom mmcache.errors import CacheFormatError\n"
        f"try:\n    fmt.open_cache({str(cache)!r})\nexcept CacheFormatError as e:\n    print(e)\n"
    )
    assert "index-" in out and "a sparse file: its bytes from " in out


def test_a_manifest_of_millions_of_tiny_values_is_refused_before_parsing(tmp_path):
    cache = _forged_count(tmp_path, 2)
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    m["x"] = [[]] * (6 << 20)  # 18 MiB of JSON, ~0.6 GB once parsed
    m["checksums"]["manifest"] = fmt.manifest_checksum(m)  # a forger's: only the cost check
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))  # stands in the way
    with pytest.raises(CacheFormatError, match=r"manifest.json: .* whose parse would take about"):
        fmt.read_manifest(cache)


def test_a_lazy_manifest_asking_for_huge_records_fills_none(tmp_path):
    # A lazy cache forged to ask size=16384x16384: 805 MB decoded and written per read.
    for i in range(2):
        write_image(tmp_path / "src" / "a" / f"{i}.png", 8, 8, seed=i)
    cache = tmp_path / "c"
    create_lazy_cache(tmp_path / "src", cache, size=(8, 8))
    m = json.loads((cache / fmt.MANIFEST_NAME).read_text())
    side = 16384
    nbytes = side * side * 3
    index = np.fromfile(cache / m["files"]["index"], fmt.INDEX_DTYPE)
    index["height"], index["width"] = side, side
    index["offset"] = np.arange(len(index)) * nbytes
    index.tofile(cache / m["files"]["index"])
    m["options"]["size"] = [side, side]
    m["sizes"]["data"] = len(index) * nbytes
    os.truncate(cache / m["files"]["data"], m["sizes"]["data"])  # sparse
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(m))
    m = reseal(cache)
    out = run_bounded(
        "from pathlib import Path\nfrom mmcache._records import open_reader\n"
        f"r = open_reader(Path({str(cache)!r}), {m['generation']!r}, False)\n"
        "print(r.stored_or_none(0) is None, r.codes[0])\n"
    )
    assert out.split() == ["True", str(fmt.BAD_TOO_LARGE)]
