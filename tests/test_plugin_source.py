"""A source kind written outside the package plugs in through ``mmcache.sources`` alone: a
folder of ``.npy`` arrays, which OpenCV cannot decode, is registered, built into a cache (in
worker processes, which import this module to unpickle its reader), read back pixel for
pixel, refreshed after a file is added, filled lazily and verified against its source; the
quick staleness check stamps its folders because the kind says it may."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mmcache import (
    MemmapImageDataset,
    build_cache,
    cache_info,
    create_lazy_cache,
    format,
    scan_source,
    verify_cache,
)
from mmcache.sources import Listing, register, unregister


class NpyReader:
    """Reads an H x W x 3 uint8 RGB ``.npy`` file. A module-level class: the build's decode
    workers get an instance by pickle, and import this module to rebuild it."""

    def size(self, path: str) -> tuple[int, int] | None:
        shape = np.load(path, mmap_mode="r").shape  # the header only
        return (shape[0], shape[1]) if len(shape) >= 2 else None

    def read(self, path: str) -> np.ndarray:
        return np.load(path, allow_pickle=False)


class NpySource:
    """The ``npy`` kind: a folder whose class folders hold ``.npy`` arrays."""

    kind = "npy"
    path_keys: tuple[str, ...] = ("root",)
    reads_files = True
    images = NpyReader()
    folder_stamps = True  # a file added or removed changes its class folder's mtime

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        path = Path(source)
        return path.is_dir() and any(path.glob("*/*.npy"))

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        root = Path(source).resolve()
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        files = [(f, k) for k, c in enumerate(classes) for f in sorted((root / c).glob("*.npy"))]
        stats = [f.stat() for f, _ in files]
        return Listing(
            root=root,
            kind=self.kind,
            list_file=None,
            classes=classes,
            paths=[f.relative_to(root).as_posix() for f, _ in files],
            labels=np.array([k for _, k in files], np.int32),
            sizes=np.array([st.st_size for st in stats], np.uint64),
            mtimes=np.array([st.st_mtime_ns for st in stats], np.int64),
        )

    def recorded(self, files) -> None:
        return None  # each record's file lies at its path under the root

    def exists(self, root: str) -> bool:
        return Path(root).is_dir()


NPY = NpySource()


@pytest.fixture
def npy_kind():
    register(NPY)
    try:
        yield NPY
    finally:
        unregister(NPY.kind)


def write_arrays(root: Path, shapes: dict[str, list[tuple[int, int]]]) -> dict:
    """Random (height, width) x 3 uint8 arrays in class folders: ``{relative path: array}``."""
    rng = np.random.default_rng(0)
    arrays = {}
    for cls, sizes in shapes.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        for k, (h, w) in enumerate(sizes):
            arrays[f"{cls}/{k}.npy"] = rng.integers(0, 256, (h, w, 3), np.uint8)
            np.save(root / cls / f"{k}.npy", arrays[f"{cls}/{k}.npy"])
    return arrays


def assert_pixels(cache: Path, arrays: dict, **kwargs) -> None:
    ds = MemmapImageDataset(cache, **kwargs)
    assert ds.manifest.source["kind"] == "npy"
    assert len(ds) == len(arrays)
    for (path, label), (image, target) in zip(ds.samples, ds, strict=True):
        rel = Path(path).relative_to(ds.manifest.source["root"]).as_posix()
        np.testing.assert_array_equal(np.asarray(image), arrays[rel])
        assert ds.classes[target] == rel.split("/")[0] and target == label


def test_a_kind_from_outside_builds_reads_and_refreshes(npy_kind, tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    arrays = write_arrays(src, {"cat": [(5, 7), (8, 4)], "dog": [(6, 6)]})
    assert scan_source(src).kind == "npy"

    report = build_cache(src, cache, workers=1)  # a decode worker process unpickles the reader
    assert (report.images, report.decoded, report.skipped) == (3, 3, [])
    assert_pixels(cache, arrays)

    arrays["dog/1.npy"] = np.random.default_rng(1).integers(0, 256, (3, 9, 3), np.uint8)
    np.save(src / "dog" / "1.npy", arrays["dog/1.npy"])
    report = build_cache(src, cache, workers=1)
    assert report.appended and (report.images, report.decoded, report.reused) == (4, 1, 3)
    assert_pixels(cache, arrays)

    report = verify_cache(cache, source="all")  # the source decoded again by the kind's reader
    assert (report.source_compared, report.bad) == (4, [])


def test_a_lazy_cache_fills_from_the_kind_s_reader(npy_kind, tmp_path):
    src, cache = tmp_path / "src", tmp_path / "lazy"
    arrays = write_arrays(src, {"a": [(4, 5)], "b": [(7, 3), (2, 2)]})
    report = create_lazy_cache(src, cache, workers=0)
    # Its shapes come from the reader's size: nothing is decoded before the first reads.
    assert (report.decoded, report.pending) == (0, 3)
    assert_pixels(cache, arrays, source=src)


def test_a_file_the_reader_refuses_is_skipped_with_its_reason(npy_kind, tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    arrays = write_arrays(src, {"a": [(4, 4)]})
    (src / "a" / "broken.npy").write_bytes(b"not an array")
    np.save(src / "a" / "floats.npy", np.zeros((2, 2, 3), np.float32))
    report = build_cache(src, cache, workers=0)
    reasons = {s["path"]: s["reason"] for s in report.skipped}
    assert set(reasons) == {"a/broken.npy", "a/floats.npy"}
    assert "its kind's reader failed on it (ValueError" in reasons["a/broken.npy"]
    assert "float32 array of shape (2, 2, 3)" in reasons["a/floats.npy"]
    assert_pixels(cache, arrays)


def test_the_quick_staleness_check_asks_the_kind(npy_kind, tmp_path, monkeypatch):
    src, cache = tmp_path / "src", tmp_path / "stamped"
    write_arrays(src, {"a": [(3, 3)], "b": [(3, 3)]})
    for folder in (src, src / "a", src / "b"):  # older than the scan: stamped, not -1
        os.utime(folder, ns=(1_000_000_000, 1_000_000_000))
    build_cache(src, cache, workers=0)
    stamps = format.read_manifest(cache).extra["source_stamps"]
    assert stamps == {"folders": {"": 1_000_000_000, "a": 1_000_000_000, "b": 1_000_000_000}}
    assert cache_info(cache, source_check="quick").stale is None
    np.save(src / "b" / "1.npy", np.zeros((2, 2, 3), np.uint8))  # b's mtime moves
    assert "the source changed" in str(cache_info(cache, source_check="quick").stale)

    monkeypatch.setattr(NPY, "folder_stamps", False)  # a kind whose files lie anywhere
    build_cache(src, tmp_path / "unstamped", workers=0)
    assert format.read_manifest(tmp_path / "unstamped").extra.get("source_stamps") is None
