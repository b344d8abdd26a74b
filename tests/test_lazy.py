"""Lazy mode: a cache filled on first read, by any process, resumable after kill -9; refresh."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import make_folder, opened_file, write_image
from torch.utils.data import DataLoader

import mmcache._layout
from mmcache import (
    BadImageWarning,
    CacheStaleError,
    DecodeError,
    InsufficientSpaceError,
    MemmapImageDataset,
    OptionsChangedError,
    SourceChangedError,
    StaleCacheWarning,
    build_cache,
    create_lazy_cache,
    decode_image,
)
from mmcache import format as fmt

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """24 JPEGs of mixed sizes in 3 classes: records of several sizes share pages."""
    sizes = [(40, 30), (30, 40), (17, 33), (64, 48)] * 2
    return make_folder(tmp_path / "src", {"cat": sizes, "dog": sizes, "emu": sizes})


def _files(cache: Path) -> fmt.CacheFiles:
    return fmt.read_cache_files(fmt.read_manifest(cache))


def _codes(cache: Path) -> np.ndarray:
    return _files(cache).state["state"]


def _record(files: fmt.CacheFiles, i: int) -> bytes:
    r = files.index[i]
    n = int(r["height"]) * int(r["width"]) * int(r["channels"])
    with open(files.manifest.file("data"), "rb") as f:
        f.seek(int(r["offset"]))
        return f.read(n)


def assert_equals_build(cache: Path, src: Path, ref: Path, *, same_offsets=False, **options):
    """``cache`` is complete and, record for record, what ``mmcache build`` makes of ``src``:
    the same records, labels, paths and pixels. Its records lie where a build puts them
    (``same_offsets``) unless a refresh appended some to its data file."""
    assert build_cache(src, cache, workers=1, **options).up_to_date
    build_cache(src, ref, workers=1, **options)
    a, b = _files(cache), _files(ref)
    assert a.manifest.classes == b.manifest.classes
    assert a.manifest.count == b.manifest.count
    assert a.paths_blob == b.paths_blob
    # shapes, labels, path positions, source sizes and mtimes (and offsets, if asked)
    fields = [f for f in fmt.INDEX_DTYPE.names if same_offsets or f != "offset"]
    assert all(np.array_equal(a.index[f], b.index[f]) for f in fields)
    assert np.array_equal(a.state, b.state)  # all FILLED, with the same crc32
    assert all(_record(a, i) == _record(b, i) for i in range(a.manifest.count))


def test_creation_decodes_nothing_and_publishes_empty_records(src, tmp_path, monkeypatch):
    decoded = []
    real = cv2.imread
    monkeypatch.setattr(cv2, "imread", lambda p, *a: decoded.append(p) or real(p, *a))
    report = create_lazy_cache(src, tmp_path / "cache", workers=0)
    assert decoded == [] and report.decoded == 0
    assert (report.images, report.pending) == (0, 24)
    m = fmt.read_manifest(tmp_path / "cache")
    assert m.mode == "lazy" and m.count == 24
    assert (_codes(tmp_path / "cache") == fmt.EMPTY).all()
    data = m.file("data")
    assert data.stat().st_size == m.sizes["data"] > 0
    assert data.stat().st_blocks == 0  # sparse: nothing written yet
    # the same request again finds it current and leaves it alone
    again = create_lazy_cache(src, tmp_path / "cache")
    assert again.up_to_date and fmt.read_manifest(tmp_path / "cache").generation == m.generation


def test_fill_with_two_workers_equals_the_build_and_epoch_two_decodes_nothing(src, tmp_path):
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    epoch1 = [(img.numpy().copy(), label) for img, label in loader]
    assert [label for _, label in epoch1] == ds.targets
    for (path, _), (img, _) in zip(ds.samples, epoch1, strict=True):
        assert np.array_equal(img, decode_image(path))
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)
    # Epoch two must not decode: with the source gone, any decode would fail.
    os.rename(src, tmp_path / "gone")
    epoch2 = [(img.numpy(), label) for img, label in loader]
    pairs = zip(epoch1, epoch2, strict=True)
    assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in pairs)
    # and a later run, opening the cache alone, reads the same
    later = MemmapImageDataset(cache, on_stale="ignore")
    assert all(np.array_equal(later[i][0], epoch1[i][0]) for i in range(len(later)))


def test_fills_by_another_process_are_seen_through_this_process_mapping(src, tmp_path):
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    first = ds[1][0].copy()  # maps the data file here and fills record 1 (records 0-1 share a page)
    ds.read(1)  # reads record 1 back through the mapping: its page is now mapped here
    child = FORK.Process(target=_read_all, args=(cache, src, range(0, 24, 2)))
    child.start()
    child.join()
    assert child.exitcode == 0
    codes = _codes(cache)
    assert (codes[0::2] == fmt.FILLED).all() and codes[3] == fmt.EMPTY
    expected = [decode_image(ds.samples[i][0]) for i in range(24)]
    os.rename(src, tmp_path / "gone")  # so that nothing can be decoded again here
    for i in range(0, 24, 2):  # filled by the child; this process reads them from its mapping
        assert np.array_equal(ds.read(i), expected[i]), i
    assert np.array_equal(ds.read(1), first)


def _read_all(cache: Path, src: Path, order, pause: float = 0.0, then=None) -> None:
    """Read ``order`` checking each image, then set the event ``then`` and wait for ever."""
    ds = MemmapImageDataset(cache, source=src)
    for i in order:
        img, _ = ds[i]
        if not np.array_equal(img, decode_image(ds.samples[i][0])):
            raise SystemExit(f"wrong pixels for record {i}")
        time.sleep(pause)
    if then is not None:
        then.set()
        threading.Event().wait()


def test_a_filler_killed_half_way_is_resumed_by_the_next_run(src, tmp_path):
    cache = tmp_path / "cache"
    half = FORK.Event()
    child = FORK.Process(target=_read_all, args=(cache, src, range(12), 0.0, half))
    child.start()
    assert half.wait(timeout=60), "the child never filled its 12 records"
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    codes = _codes(cache)
    assert (codes[:12] == fmt.FILLED).all() and (codes[12:] == fmt.EMPTY).all()
    ds = MemmapImageDataset(cache, source=src)
    assert all(np.array_equal(ds[i][0], decode_image(ds.samples[i][0])) for i in range(24))
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)


def _label_and_pid(label: int) -> tuple[int, int]:
    return label, os.getpid()


def _slow(img: np.ndarray) -> np.ndarray:
    time.sleep(0.02)
    return img


def test_a_dataloader_worker_killed_mid_epoch_leaves_a_cache_the_next_epoch_completes(
    src, tmp_path
):
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, transform=_slow, target_transform=_label_and_pid, source=src)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    pids = {next(it)[1][1] for _ in range(12)}
    victim = pids.pop()
    # The kill goes inside the block: torch's SIGCHLD handler raises "DataLoader worker (pid
    # ...) is killed by signal" in this thread at its next Python step, wherever that is. And
    # the workers are shut down inside it too: until they are, the dead worker's pid stays
    # registered with that handler, and any child that exits later (a worker stopping here, a
    # subprocess of a later test) raises the error again.
    # Or, when the kill lands while the main process fetches a sample's shared memory from
    # the victim (torch passes it as a file descriptor over a connection to the sender), that
    # connection's ConnectionResetError.
    with pytest.raises((RuntimeError, ConnectionResetError)) as raised:
        try:
            os.kill(victim, signal.SIGKILL)
            for _ in it:
                pass
        finally:
            it._shutdown_workers()
    assert raised.type is ConnectionResetError or "DataLoader worker" in str(raised.value)
    assert all(not w.is_alive() for w in it._workers)  # joined or terminated, and reaped
    del it
    codes = _codes(cache)
    assert (codes == fmt.FILLED).sum() >= 12 and (codes == fmt.EMPTY).any()
    ds = MemmapImageDataset(cache, source=src)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for (path, _), (img, _) in zip(ds.samples, loader, strict=True):
        assert np.array_equal(img.numpy(), decode_image(path))
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)


def test_a_record_torn_by_a_kill_between_pixels_and_state_is_redone(src, tmp_path):
    cache = tmp_path / "cache"
    create_lazy_cache(src, cache)
    files = _files(cache)
    r = files.index[5]
    torn = np.full(int(r["height"]) * int(r["width"]) * 3 // 2, 77, np.uint8)
    with open(files.manifest.file("data"), "r+b") as f:  # half the pixels written, no state
        f.seek(int(r["offset"]))
        f.write(torn.tobytes())
    ds = MemmapImageDataset(cache, source=src)
    assert np.array_equal(ds[5][0], decode_image(ds.samples[5][0]))
    assert all(ds[i][0] is not None for i in range(24))
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)


def test_two_concurrent_fillers_both_finish_with_correct_pixels(src, tmp_path):
    cache = tmp_path / "cache"
    # Both create the cache (one waits for the other's lock), then fill it in opposite orders.
    children = [
        FORK.Process(target=_read_all, args=(cache, src, order, 0.002))
        for order in (range(24), range(23, -1, -1))
    ]
    for c in children:
        c.start()
    for c in children:
        c.join()
    assert [c.exitcode for c in children] == [0, 0]
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4  # one generation
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)


def test_options_are_applied_and_other_options_replace_the_cache_only_when_asked(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=1)
    built = fmt.read_manifest(cache).generation
    with pytest.raises(OptionsChangedError, match="made with the defaults .* --size 16x12"):
        MemmapImageDataset(cache, source=src, size=(12, 16), color="gray")
    assert fmt.read_manifest(cache).generation == built  # untouched
    ds = MemmapImageDataset(cache, source=src, size=(12, 16), color="gray", replace=True)
    m = fmt.read_manifest(cache)
    assert m.mode == "lazy" and (_codes(cache) == fmt.EMPTY).all()
    assert ds[3][0].shape == (12, 16, 1)
    assert all(ds[i][0].shape == (12, 16, 1) for i in range(24))
    assert_equals_build(
        cache, src, tmp_path / "ref", size=(12, 16), color="gray", same_offsets=True
    )
    # the same options again open the cache as it is
    MemmapImageDataset(cache, source=src, size=(12, 16), color="gray")
    assert fmt.read_manifest(cache).generation == m.generation
    with pytest.raises(ValueError, match="only with source"):
        MemmapImageDataset(cache, size=(12, 16))


def test_a_built_cache_of_the_same_source_and_options_is_opened_as_it_is(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, short_side=20, workers=1)
    gen = fmt.read_manifest(cache).generation
    ds = MemmapImageDataset(cache, source=src, short_side=20)
    assert ds.generation == gen and fmt.read_manifest(cache).mode == "build"
    assert np.array_equal(ds[0][0], MemmapImageDataset(cache)[0][0])


@pytest.fixture
def counted_imread(monkeypatch):
    """Counts cv2.imread calls in this process (decode workers=0 runs in this process)."""
    calls: list[Path] = []
    real = cv2.imread
    monkeypatch.setattr(cv2, "imread", lambda p, *a: calls.append(opened_file(p)) or real(p, *a))
    return calls


def test_refresh_after_modifying_one_of_n_files_decodes_exactly_one(src, tmp_path, counted_imread):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=1)
    counted_imread.clear()
    write_image(src / "dog" / "img_010.jpg", 30, 40, seed=1234)
    report = build_cache(src, cache, workers=0)
    assert (report.decoded, report.reused, report.dropped, report.images) == (1, 23, 1, 24)
    assert [Path(p).name for p in counted_imread] == ["img_010.jpg"]
    ds = MemmapImageDataset(cache)
    assert np.array_equal(ds[10][0], decode_image(src / "dog" / "img_010.jpg"))
    # what it published equals a build from scratch
    assert_equals_build(cache, src, tmp_path / "ref")


def test_refresh_with_parallel_workers_reports_the_same_counts(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=2)
    write_image(src / "cat" / "img_002.jpg", 20, 20, seed=77)
    os.unlink(src / "emu" / "img_020.jpg")
    report = build_cache(src, cache, workers=2)
    assert (report.decoded, report.reused, report.dropped, report.images) == (1, 22, 2, 23)
    assert_equals_build(cache, src, tmp_path / "ref")


def test_refresh_after_adding_a_class_relabels_and_decodes_only_the_new_files(
    src, tmp_path, counted_imread
):
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=1)
    make_folder(tmp_path / "more", {"ant": [(20, 20), (21, 19)]})
    os.rename(tmp_path / "more" / "ant", src / "ant")  # sorts first: every label moves up
    counted_imread.clear()
    report = build_cache(src, cache, workers=0)
    assert (report.decoded, report.reused, report.dropped, report.images) == (2, 24, 0, 26)
    assert len(counted_imread) == 2
    ds = MemmapImageDataset(cache)
    assert ds.classes == ["ant", "cat", "dog", "emu"]
    assert ds.targets == [0] * 2 + [1] * 8 + [2] * 8 + [3] * 8
    assert_equals_build(cache, src, tmp_path / "ref")


def test_on_stale_refresh_of_a_lazy_cache_keeps_filled_records_of_unchanged_files(
    src, tmp_path, counted_imread
):
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    for i in range(12):
        ds[i]
    write_image(src / "cat" / "img_003.jpg", 25, 25, seed=5)  # a filled record changes
    write_image(src / "dog" / "zzz.jpg", 26, 24, seed=6)  # a file is added
    with pytest.warns(StaleCacheWarning, match="1 added .*1 modified"):
        MemmapImageDataset(cache, source=src)
    with pytest.raises(CacheStaleError):
        MemmapImageDataset(cache, source=src, on_stale="error")
    counted_imread.clear()
    ds = MemmapImageDataset(cache, source=src, on_stale="refresh")
    assert counted_imread == []  # the refresh itself decodes nothing
    assert len(ds) == 25 and fmt.read_manifest(cache).mode == "lazy"
    codes = _codes(cache)
    assert (codes == fmt.FILLED).sum() == 11 and codes[3] == fmt.EMPTY
    images = [ds[i][0] for i in range(25)]
    assert len(counted_imread) == 25 - 11
    assert all(np.array_equal(images[i], decode_image(ds.samples[i][0])) for i in range(25))
    assert_equals_build(cache, src, tmp_path / "ref")


def test_on_stale_refresh_of_a_built_cache_rebuilds_what_changed(src, tmp_path):
    cache = tmp_path / "cache"
    build_cache(src, cache, max_side=32, workers=1)
    write_image(src / "emu" / "img_017.jpg", 50, 10, seed=8)
    # no source= given: the source and options the cache records are used
    ds = MemmapImageDataset(cache, on_stale="refresh")
    m = fmt.read_manifest(cache)
    assert m.mode == "build" and ds.generation == m.generation
    assert ds[17][0].shape == (6, 32, 3)
    assert_equals_build(cache, src, tmp_path / "ref", max_side=32)


@pytest.fixture
def src_with_bad(tmp_path: Path) -> Path:
    root = make_folder(tmp_path / "bad", {"a": [(20, 10)] * 3, "b": [(10, 20)] * 3})
    (root / "a" / "img_001.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


def test_a_truncated_jpeg_filled_lazily_prints_nothing_the_error_says_it(tmp_path, capfd):
    # libjpeg's own "Premature end of JPEG file" went to the filling process's stderr,
    # unprefixed; the record is refused as truncated before libjpeg reads it
    root = make_folder(tmp_path / "src", {"a": [(64, 64)] * 2})
    data = (root / "a" / "img_001.jpg").read_bytes()
    (root / "a" / "img_001.jpg").write_bytes(data[: len(data) * 2 // 3])
    ds = MemmapImageDataset(tmp_path / "cache", source=root, size=(8, 8))
    with pytest.raises(DecodeError, match=r"img_001\.jpg: truncated: the file ends before"):
        ds[1]
    assert "Premature end" not in capfd.readouterr().err


def test_a_bad_file_raises_by_default(src_with_bad, tmp_path):
    # With size= the record's shape needs no header, so the bad file gets a record, found bad
    # when it is read (without size=, it is decoded at creation and left out, as a build does).
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src_with_bad, size=(8, 8))
    assert len(ds) == 6
    with pytest.raises(DecodeError, match=r"img_001\.jpg: a damaged or truncated JPEG file"):
        ds[1]
    assert _codes(cache)[1] == fmt.BAD_UNDECODABLE
    with pytest.raises(DecodeError, match=r"img_001\.jpg"):  # and again, from its state
        MemmapImageDataset(cache, source=src_with_bad, size=(8, 8)).read(1)
    assert [ds[i][1] for i in (0, 2, 3, 4, 5)] == [0, 0, 1, 1, 1]
    report = build_cache(src_with_bad, cache, size=(8, 8), workers=1)
    assert report.up_to_date and [s["path"] for s in report.skipped] == ["a/img_001.jpg"]
    # the offline build leaves the file out of the index; the lazy cache keeps a BAD record
    assert MemmapImageDataset(cache).targets == [0, 0, 0, 1, 1, 1]


def test_info_counts_the_records_lazy_fills_found_bad(src_with_bad, tmp_path, capsys):
    from mmcache import cache_info
    from mmcache.cli import main

    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src_with_bad, size=(8, 8))
    with pytest.raises(DecodeError):
        ds[1]
    assert [s["path"] for s in cache_info(cache).skipped] == ["a/img_001.jpg"]
    assert main(["info", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "1 skipped" in out and "skipped a/img_001.jpg: the decoder could not read it" in out


def test_a_bad_file_without_size_is_left_out_at_creation_as_a_build_does(src_with_bad, tmp_path):
    report = create_lazy_cache(src_with_bad, tmp_path / "cache")
    assert report.decoded == 0 and [s["path"] for s in report.skipped] == ["a/img_001.jpg"]
    ds = MemmapImageDataset(tmp_path / "cache", source=src_with_bad)
    assert len(ds) == 5 and all(ds[i][0] is not None for i in range(5))
    assert_equals_build(tmp_path / "cache", src_with_bad, tmp_path / "ref", same_offsets=True)


def test_a_bad_file_is_substituted_on_request(src_with_bad, tmp_path):
    ds = MemmapImageDataset(
        tmp_path / "cache", source=src_with_bad, size=(8, 8), on_bad="substitute"
    )
    with pytest.warns(BadImageWarning, match=r"img_001\.jpg.*returning image 2"):
        img, label = ds[1]
    assert np.array_equal(img, ds[2][0]) and label == ds[2][1] == 0
    ds[1]  # warned once per record: a second warning would fail (filterwarnings = error)
    with pytest.raises(DecodeError):
        ds.read(1)  # read() never substitutes


def test_a_header_that_disagrees_with_the_decoded_size_is_marked_bad(src, tmp_path, monkeypatch):
    real = mmcache._layout.probe_size

    def lying(path, exif=True):  # as a header the probe misreads would: height and width swapped
        hw = real(path, exif)
        return hw[::-1] if path.endswith("img_004.jpg") else hw

    monkeypatch.setattr(mmcache._layout, "probe_size", lying)
    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    # the header's claim; the image is 30 x 40
    assert tuple(ds.reader.records.shapes[4]) == (40, 30, 3)
    with pytest.raises(DecodeError, match="header disagrees"):
        ds[4]
    assert _codes(cache)[4] == fmt.BAD_HEADER_MISMATCH
    assert fmt.read_cache_files(fmt.read_manifest(cache)).state[4]["crc32"] == 0
    with open(fmt.read_manifest(cache).file("data"), "rb") as f:
        assert f.read() == bytes(fmt.read_manifest(cache).sizes["data"])  # nothing written


def test_a_full_disk_raises_and_leaves_the_record_empty(src, tmp_path, monkeypatch):
    ds = MemmapImageDataset(tmp_path / "cache", source=src)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fmt.os, "pwrite", full)  # the format writes the pixels
    cache = tmp_path / "cache"
    size = json.loads((cache / fmt.MANIFEST_NAME).read_text())["sizes"]["data"]
    expected = (
        f"{cache}: the disk is full ({os.strerror(errno.ENOSPC)}); free {size:,} bytes for the "
        "whole cache, or build it elsewhere"
    )
    with pytest.raises(InsufficientSpaceError, match=f"^{re.escape(expected)}$"):
        ds[0]
    monkeypatch.undo()
    assert _codes(tmp_path / "cache")[0] == fmt.EMPTY
    assert np.array_equal(ds[0][0], decode_image(ds.samples[0][0]))


def test_in_place_writes_by_a_transform_never_change_a_later_read_of_a_filled_record(src, tmp_path):
    def scribble(a):
        a[:] = 0
        return a

    cache = tmp_path / "cache"
    expected = [decode_image(p) for p, _ in MemmapImageDataset(cache, source=src).samples]
    ds = MemmapImageDataset(cache, source=src, transform=scribble)
    for i in range(0, 24, 2):  # these fill here, the others in the workers below
        assert ds[i][0].max() == 0
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for _ in range(2):  # fills, then reads of filled records, each written over in place
        assert all(img.max() == 0 for img, _ in loader)
    assert (_codes(cache) == fmt.FILLED).all()
    ds.transform = None
    assert all(np.array_equal(ds[i][0], expected[i]) for i in range(24))
    assert_equals_build(cache, src, tmp_path / "ref", same_offsets=True)


def test_a_data_file_truncated_after_filling_is_an_error_at_the_read_not_a_crash(src, tmp_path):
    script = (
        "import os, sys\n"
        "from mmcache import MemmapImageDataset, CacheFormatError\n"
        "ds = MemmapImageDataset(sys.argv[1], source=sys.argv[2])\n"
        "for i in range(len(ds)):\n"
        "    ds[i]\n"
        "print('filled:', ds.reader.filled(list(range(len(ds)))).all())\n"
        "os.truncate(ds.reader.data_path, 0)\n"
        "try:\n"
        "    ds[len(ds) - 1]\n"
        "except CacheFormatError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache"), str(src)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr  # a SIGBUS would give -7
    assert "filled: True" in r.stdout  # what it read last was a filled record
    assert "refused:" in r.stdout and "truncated" in r.stdout


def test_a_pickled_lazy_dataset_fills_in_the_new_process(src, tmp_path):
    import pickle

    ds = MemmapImageDataset(tmp_path / "cache", source=src)
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 2000
    assert np.array_equal(copy[7][0], decode_image(ds.samples[7][0]))
    assert _codes(tmp_path / "cache")[7] == fmt.FILLED
    assert torch.equal(torch.from_numpy(ds[7][0]), torch.from_numpy(copy[7][0]))


def test_a_lazy_cache_refuses_to_start_without_the_free_space(tmp_path):
    # docs/plan.md: "a lazy cache refuse[s] to start when the destination lacks that space (one
    # line with both numbers; --force overrides)". Its data file is sparse, but it will fill.
    from conftest import tmpfs

    from mmcache import plan_cache

    src = make_folder(tmp_path / "big", {"a": [(1500, 1000)] * 3})  # 13.5 MB of pixels
    with tmpfs(tmp_path / "fs", "8m") as disk:
        cache = disk / "cache"
        needed = plan_cache(src, cache).build.disk_bytes
        free = shutil.disk_usage(disk).free
        assert needed > 8 << 20 >= free
        with pytest.raises(InsufficientSpaceError) as e:
            MemmapImageDataset(cache, source=src)
        message = str(e.value)
        assert f"{needed:,} bytes" in message and f"{free:,} bytes" in message
        assert "\n" not in message and "force" in message
        assert not cache.exists() or os.listdir(cache) == []  # nothing written, no manifest
        with pytest.raises(InsufficientSpaceError):
            create_lazy_cache(src, cache)
        # Forced, it starts; the disk then fills at the first record that does not fit, which
        # stays empty: a clear error, no record half-written as filled.
        create_lazy_cache(src, cache, force=True)
        ds = MemmapImageDataset(cache, source=src)
        assert np.array_equal(ds[0][0], decode_image(ds.samples[0][0]))  # 4.5 MB: fits
        with pytest.raises(InsufficientSpaceError, match="disk is full"):
            for i in range(1, 3):
                ds[i]
        codes = _codes(cache)
        assert codes[0] == fmt.FILLED and fmt.EMPTY in codes[1:]
        assert set(codes[1:]) <= {fmt.FILLED, fmt.EMPTY}


def test_a_truncated_jpeg_is_refused_when_filled_unless_kept(tmp_path):
    """The lazy fill follows the build's policy: a JPEG cut short is bad ("truncated") by
    default, and kept, as decoded, with keep_truncated=True."""
    root = make_folder(tmp_path / "cut", {"a": [(60, 40)] * 2})
    data = (root / "a" / "img_001.jpg").read_bytes()
    (root / "a" / "img_001.jpg").write_bytes(data[: len(data) // 2])
    ds = MemmapImageDataset(tmp_path / "cache", source=root)
    assert ds.read(0).shape == (40, 60, 3)
    with pytest.raises(DecodeError, match=r"img_001\.jpg: truncated"):
        ds.read(1)
    assert _codes(tmp_path / "cache")[1] == fmt.BAD_TRUNCATED
    report = build_cache(root, tmp_path / "cache", workers=1)
    assert [(s["path"], s["reason"].split(":")[0]) for s in report.skipped] == [
        ("a/img_001.jpg", "truncated")
    ]
    kept = MemmapImageDataset(tmp_path / "kept", source=root, keep_truncated=True)
    assert np.array_equal(kept.read(1), decode_image(root / "a" / "img_001.jpg"))


def test_lazy_mode_refuses_another_source_unless_replaced_or_moved(src, tmp_path):
    cache = tmp_path / "cache"
    MemmapImageDataset(cache, source=src)[0]
    other = shutil.copytree(src, tmp_path / "other")  # the same files, mtimes kept
    with pytest.raises(SourceChangedError) as e:
        MemmapImageDataset(cache, source=other)
    assert f"made from {src.resolve()}; this build's source is {other.resolve()}" in str(e.value)
    assert fmt.read_manifest(cache).source["root"] == str(src.resolve())
    moved = MemmapImageDataset(cache, source=other, source_moved=True)
    assert fmt.read_manifest(cache).source["root"] == str(other.resolve())
    assert _codes(cache)[0] == fmt.FILLED and len(moved) == 24  # its filled record kept
    MemmapImageDataset(cache, source=src, replace=True)
    assert fmt.read_manifest(cache).source["root"] == str(src.resolve())


def test_a_broken_symlink_is_named_as_one_when_read(src, tmp_path):
    os.symlink("nowhere.jpg", src / "cat" / "gone.jpg")
    # size=: the record needs no header, so the link gets one, found bad when it is read
    ds = MemmapImageDataset(tmp_path / "cache", source=src, size=(8, 8))
    i = [p for p, _ in ds.samples].index(str(src.resolve() / "cat" / "gone.jpg"))
    with pytest.raises(DecodeError, match=r"gone\.jpg: a broken symbolic link: it points to"):
        ds.read(i)
    with pytest.raises(DecodeError, match=r"gone\.jpg: a broken symbolic link"):  # from its state
        MemmapImageDataset(tmp_path / "cache").read(i)


@pytest.mark.parametrize("kind", ["data", "state"])
def test_a_cache_file_the_user_cannot_write_is_named_when_a_fill_needs_it(
    src, tmp_path, monkeypatch, kind
):
    """A lazy cache on a read-only disk, or of files the user may not write: the first read
    that fills says which file and why, and what a lazy cache needs; nothing is left open."""
    from mmcache import DestinationError
    from mmcache import _filler as filler_module

    cache = tmp_path / "cache"
    ds = MemmapImageDataset(cache, source=src)
    name = json.loads((cache / fmt.MANIFEST_NAME).read_text())["files"][kind]
    opened = filler_module.open_for_writing
    closed = []

    def refused(path):
        if path.name == name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        fd = opened(path)
        closed.append(fd)
        return fd

    monkeypatch.setattr(filler_module, "open_for_writing", refused)
    expected = (
        f"{cache / name}: cannot fill the lazy cache ({os.strerror(errno.EACCES)}); records "
        "are stored where the cache lies, so its user must be able to write there"
    )
    with pytest.raises(DestinationError, match=f"^{re.escape(expected)}$"):
        ds[0]
    monkeypatch.undo()
    for fd in closed:  # the data file, opened before the state file was refused
        with pytest.raises(OSError):
            os.fstat(fd)
    assert not any(fmt.is_fill_marker_name(n) for n in os.listdir(cache))
    assert np.array_equal(ds[0][0], decode_image(ds.samples[0][0]))
