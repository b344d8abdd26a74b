"""MemmapImageDataset: ImageFolder's interface, DataLoader workers, pickling, memory, staleness."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_folder, reseal, write_image
from torch.utils.data import DataLoader

from mmcache import (
    CacheFormatError,
    CacheNotFoundError,
    CacheStaleError,
    MemmapImageDataset,
    StaleCacheWarning,
    build_cache,
    decode_image,
)


@pytest.fixture
def cache(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    return tmp_path / "cache"


def test_imagefolder_interface(cache, small_folder):
    ds = MemmapImageDataset(cache)
    assert len(ds) == 12
    assert ds.classes == ["cat", "dog", "emu"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "emu": 2}
    assert ds.targets == [0] * 4 + [1] * 4 + [2] * 4
    assert ds.samples[0] == (str(small_folder.resolve() / "cat" / "img_000.jpg"), 0)
    img, label = ds[5]
    assert isinstance(img, np.ndarray) and img.dtype == np.uint8 and img.shape == (64, 48, 3)
    assert isinstance(label, int) and label == 1
    assert np.array_equal(img, decode_image(ds.samples[5][0]))
    assert np.array_equal(ds[-1][0], ds[11][0])
    with pytest.raises(IndexError):
        ds[12]


def test_transforms_are_applied(cache):
    ds = MemmapImageDataset(
        cache, transform=lambda a: torch.from_numpy(a).permute(2, 0, 1), target_transform=str
    )
    img, label = ds[0]
    assert img.shape == (3, 48, 64) and label == "0"


def test_a_transform_writing_in_place_does_not_touch_the_cache(cache):
    def scribble(a):
        a[:] = 0
        return a

    ds = MemmapImageDataset(cache, transform=scribble)
    clean = MemmapImageDataset(cache)
    originals = [clean[i][0].copy() for i in range(len(clean))]
    for i in range(len(ds)):  # every record written over in place by the transform
        assert ds[i][0].max() == 0
    # the same process, the same dataset: every later read still gives the stored pixels
    ds.transform = None
    for i in range(len(ds)):
        assert np.array_equal(ds[i][0], originals[i])
    assert all(np.array_equal(clean[i][0], originals[i]) for i in range(len(clean)))


def _equal_size_cache(tmp_path, n=24):
    src = make_folder(tmp_path / "eq", {"a": [(32, 24)] * (n // 2), "b": [(32, 24)] * (n // 2)})
    build_cache(src, tmp_path / "eqcache", workers=1)
    return tmp_path / "eqcache"


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_dataloader_workers_under_each_start_method(tmp_path, start_method):
    ds = MemmapImageDataset(_equal_size_cache(tmp_path))
    loader = DataLoader(
        ds, batch_size=5, num_workers=2, multiprocessing_context=start_method, shuffle=False
    )
    # filterwarnings = error: a "non-writable array" warning from collate fails this test.
    images, labels = zip(*loader, strict=True)
    images, labels = torch.cat(images), torch.cat(labels)
    assert images.shape == (24, 24, 32, 3) and images.dtype == torch.uint8
    assert labels.tolist() == ds.targets
    for i in range(24):
        assert np.array_equal(images[i].numpy(), ds[i][0])


def test_in_place_writes_in_dataloader_workers_never_reach_a_later_read(cache):
    def scribble(a):
        a[:] = 0
        return a

    expected = [decode_image(p) for p, _ in MemmapImageDataset(cache).samples]
    ds = MemmapImageDataset(cache, transform=scribble)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    for _ in range(2):  # the second epoch reads records the first wrote over, in other workers
        assert all(img.max() == 0 for img, _ in loader)
    ds.transform = None
    assert all(np.array_equal(img.numpy(), expected[k]) for k, (img, _) in enumerate(loader))
    assert all(np.array_equal(ds[i][0], expected[i]) for i in range(len(ds)))


class _WorkerRss(MemmapImageDataset):
    """Reads each image as the dataset does, touches its pixels, and gives back instead the
    reading process's resident memory (VmRSS, kB) at that moment."""

    def __getitem__(self, i):
        img, _ = super().__getitem__(i)
        total = int(img[::4, ::4].sum())  # every page of the record
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, total


def test_a_dataloader_workers_memory_stays_flat_however_much_of_the_cache_it_reads(tmp_path):
    # 200 images of 320x240x3: 46 MB of pixels, all read by one DataLoader worker. Its
    # resident memory, private and mapped alike, must not grow with what it has read.
    src = make_folder(tmp_path / "m", {"a": [(320, 240)] * 200}, ext=".png")
    build_cache(src, tmp_path / "mcache", workers=1)
    ds = _WorkerRss(tmp_path / "mcache")
    loader = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="fork")
    rss, totals = (torch.cat(t).tolist() for t in zip(*loader, strict=True))
    assert len(rss) == 200 and all(t > 0 for t in totals)
    growth_mb = (max(rss[16:]) - rss[16]) / 1024  # after the first batches' one-time setup
    assert growth_mb < 10, f"a worker's memory grew by {growth_mb:.1f} MB reading 46 MB"


def test_no_warning_under_w_error_with_the_default_collate(tmp_path):
    # In a fresh interpreter run with -W error, which its DataLoader workers inherit whatever
    # their start method: a warning anywhere (torch's "non-writable array" from the default
    # collate, say) is an exception there, and fails the loop. Built and lazily filled records.
    src = make_folder(tmp_path / "w", {"a": [(32, 24)] * 6, "b": [(32, 24)] * 6})
    build_cache(src, tmp_path / "wcache", workers=1)
    script = (
        "import sys\n"
        "from torch.utils.data import DataLoader\n"
        "from mmcache import MemmapImageDataset\n"
        "def run(ds, epochs=2, **kw):\n"
        "    for _ in range(epochs):\n"
        "        loader = DataLoader(ds, batch_size=4, **kw)\n"
        "        assert sum(len(labels) for _, labels in loader) == 12\n"
        "if __name__ == '__main__':\n"
        "    built = MemmapImageDataset(sys.argv[1])\n"
        "    run(built)\n"
        "    run(MemmapImageDataset(sys.argv[3], source=sys.argv[2]))\n"
        "    for method in ('fork', 'forkserver', 'spawn'):\n"
        "        run(built, epochs=1, num_workers=1, multiprocessing_context=method)\n"
        "    run(MemmapImageDataset(sys.argv[4], source=sys.argv[2]), num_workers=2)\n"
        "    print('ok')\n"
    )
    (tmp_path / "w_error.py").write_text(script)
    caches = [str(tmp_path / "wcache"), str(src), str(tmp_path / "lazy"), str(tmp_path / "lazy2")]
    r = subprocess.run(
        [sys.executable, "-W", "error", str(tmp_path / "w_error.py"), *caches],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert "Warning" not in r.stderr, r.stderr[-3000:]


def test_dataloader_in_process(tmp_path):
    ds = MemmapImageDataset(_equal_size_cache(tmp_path))
    batches = list(DataLoader(ds, batch_size=8, num_workers=0))
    assert [b[0].shape[0] for b in batches] == [8, 8, 8]


def test_pickled_size_does_not_grow_with_the_cache(tmp_path):
    small = MemmapImageDataset(_equal_size_cache(tmp_path / "s", n=4))
    big = MemmapImageDataset(_equal_size_cache(tmp_path / "b", n=200))
    small[0], big[0]  # map the pixels first: a mapped dataset must pickle small too
    assert len(pickle.dumps(big)) == len(pickle.dumps(small)) < 2000
    copy = pickle.loads(pickle.dumps(big))
    assert len(copy) == 200 and np.array_equal(copy[199][0], big[199][0])


def _rss_kb(kind: str = "RssAnon") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(kind + ":"))


def test_reading_the_whole_cache_allocates_no_private_memory(tmp_path):
    # 200 images of 320x240x3: 46 MB of pixels. Reading them all through the dataset must not
    # grow this process's anonymous (private) memory: the pixels stay in the shared page cache.
    src = make_folder(tmp_path / "m", {"a": [(320, 240)] * 200}, ext=".png")
    build_cache(src, tmp_path / "mcache", workers=1)
    ds = MemmapImageDataset(tmp_path / "mcache")
    ds[0]
    before = _rss_kb("RssAnon"), _rss_kb("RssFile")
    total = 0
    for i in range(len(ds)):
        total += int(ds[i][0][::16, ::16].sum())  # touch every image
    anon_mb = (_rss_kb("RssAnon") - before[0]) / 1024
    file_mb = (_rss_kb("RssFile") - before[1]) / 1024
    assert total > 0
    assert anon_mb < 10, f"private memory grew by {anon_mb:.1f} MB"
    # Nor are the cache's pages mapped into the process: its resident set (and so the USS and
    # PSS a memory monitor reports per worker) stays flat however large the cache.
    assert file_mb < 10, f"mapped cache pages grew by {file_mb:.1f} MB"


def test_a_data_file_truncated_after_open_is_an_error_not_a_crash(tmp_path):
    src = make_folder(tmp_path / "t", {"a": [(64, 48)] * 8})
    build_cache(src, tmp_path / "tcache", workers=1)
    script = (
        "import os, sys, json\n"
        "from mmcache import MemmapImageDataset, CacheFormatError\n"
        "ds = MemmapImageDataset(sys.argv[1])\n"
        "ds[0]\n"
        "m = json.load(open(os.path.join(sys.argv[1], 'manifest.json')))\n"
        "os.truncate(os.path.join(sys.argv[1], m['files']['data']), 4096)\n"
        "try:\n"
        "    ds[7]\n"
        "except CacheFormatError as e:\n"
        "    print('refused:', e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "tcache")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr  # a SIGBUS would give -7
    assert "refused:" in r.stdout and "truncated" in r.stdout


def _rewrite_manifest(cache, **changes):
    path = cache / "manifest.json"
    m = json.loads(path.read_text())
    m.update(changes)
    path.write_text(json.dumps(m))
    return reseal(cache)


def test_a_newer_format_version_is_refused_at_open(cache):
    _rewrite_manifest(cache, format_version=[6, 0])
    with pytest.raises(CacheFormatError, match="format version 6.0 is not supported"):
        MemmapImageDataset(cache)


def test_a_truncated_data_file_is_refused_at_open(cache):
    m = json.loads((cache / "manifest.json").read_text())
    data = cache / m["files"]["data"]
    os.truncate(data, data.stat().st_size - 100)
    with pytest.raises(CacheFormatError, match="truncated"):
        MemmapImageDataset(cache)


def test_a_corrupt_index_is_refused_at_open(cache):
    m = json.loads((cache / "manifest.json").read_text())
    index = cache / m["files"]["index"]
    raw = bytearray(index.read_bytes())
    raw[56 * 3 : 56 * 3 + 8] = (10**12).to_bytes(8, "little")  # record 3's offset, far away
    index.write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        MemmapImageDataset(cache)
    reseal(cache)  # a consistent forgery: the structural checks still refuse it
    with pytest.raises(CacheFormatError, match="record 3"):
        MemmapImageDataset(cache)


def test_no_cache_at_all(tmp_path):
    with pytest.raises(CacheNotFoundError):
        MemmapImageDataset(tmp_path / "nothing")


def test_a_changed_source_warns_with_a_summary(cache, small_folder):
    write_image(small_folder / "dog" / "extra.jpg", 20, 20, seed=7)
    (small_folder / "cat" / "img_001.jpg").unlink()
    with pytest.warns(StaleCacheWarning, match=r"1 added \(dog/extra.jpg\); 1 removed"):
        ds = MemmapImageDataset(cache)
    assert len(ds) == 12  # still serves what it has
    with pytest.raises(CacheStaleError, match="source changed"):
        MemmapImageDataset(cache, on_stale="error")
    MemmapImageDataset(cache, on_stale="ignore")  # no warning: filterwarnings = error


def test_the_stale_warning_names_the_options_and_the_command_that_updates(small_folder, tmp_path):
    cache = tmp_path / "c"
    build_cache(small_folder, cache, short_side=20, interpolation="bicubic", workers=1)
    write_image(small_folder / "dog" / "extra.jpg", 20, 20, seed=7)
    with pytest.warns(StaleCacheWarning) as caught:
        MemmapImageDataset(cache)
    message = str(caught[0].message)
    assert "the source changed: 1 added (dog/extra.jpg)" in message
    assert "it was built with --short-side 20 --interpolation bicubic" in message
    command = f"mmcache build {small_folder} {cache} --short-side 20 --interpolation bicubic"
    assert f"`{command}` updates it" in message


def test_a_modified_file_is_reported(cache, small_folder):
    path = small_folder / "emu" / "img_010.jpg"
    write_image(path, 40, 40, seed=123)
    os.utime(path, ns=(1, 1))
    with pytest.raises(CacheStaleError, match=r"1 modified \(emu/img_010.jpg\)"):
        MemmapImageDataset(cache, on_stale="error")


def test_a_missing_source_is_not_a_change_but_cannot_pass_on_stale_error(
    cache, small_folder, tmp_path
):
    small_folder.rename(tmp_path / "gone")  # unmounted, or a copied cache
    assert len(MemmapImageDataset(cache)) == 12  # (no warning: pytest makes them errors)
    with pytest.raises(CacheStaleError, match=f"its source {small_folder} is not there"):
        MemmapImageDataset(cache, on_stale="error")


def test_a_cache_from_another_decoder_version_is_stale(cache):
    m = json.loads((cache / "manifest.json").read_text())
    _rewrite_manifest(
        cache,
        decoder={**m["decoder"], "opencv": "3.0.0"},
        fingerprints={**m["fingerprints"], "decoder": "0" * 64},
    )
    with pytest.raises(CacheStaleError, match="opencv 3.0.0"):
        MemmapImageDataset(cache, on_stale="error")


def test_a_rebuilt_cache_is_not_mixed_into_an_open_dataset(cache, small_folder):
    ds = MemmapImageDataset(cache)
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    build_cache(small_folder, cache, size=(8, 8), workers=1, replace=True)
    assert ds[0][0].shape == (48, 64, 3)  # already open: keeps reading its generation
    with pytest.raises(CacheFormatError, match="rebuilt after this dataset was opened"):
        copy[0]
