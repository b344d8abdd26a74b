"""tools/ffcv_bench.py: FFCV's bench row is a note without FFCV's environment, a result with it.

The end-to-end test runs only where ``tools/setup_ffcv.sh`` made ``.venv-ffcv`` (or
``$MMCACHE_FFCV_PYTHON`` names such a python); ``-m "not needs_ffcv"`` leaves it out.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import mmcache

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _load_ffcv_bench():
    spec = importlib.util.spec_from_file_location("ffcv_bench", TOOLS / "ffcv_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ffcv_bench = _load_ffcv_bench()


def test_missing_environment_gives_the_skip_note(tmp_path, monkeypatch):
    monkeypatch.setenv(ffcv_bench.ENV_VAR, str(tmp_path / "no-such-venv" / "bin" / "python"))
    note = ffcv_bench.run_ffcv_peer(tmp_path / "cache", 8, 1, 1, 32)
    assert isinstance(note, str)
    assert note.startswith("FFCV environment missing: run tools/setup_ffcv.sh")
    assert str(tmp_path / "no-such-venv") in note


def test_a_failed_run_gives_its_stderr(tmp_path, monkeypatch):
    # A python that is not FFCV's: the peer cannot read a cache that is not there, and says so.
    monkeypatch.setenv(ffcv_bench.ENV_VAR, sys.executable)
    note = ffcv_bench.run_ffcv_peer(tmp_path / "no-cache", 8, 1, 1, 32)
    assert isinstance(note, str)
    assert note.startswith("FFCV run failed (exit 1)")
    assert "manifest.json" in note


@pytest.mark.needs_ffcv
@pytest.mark.skipif(not ffcv_bench.has_ffcv_env(), reason=ffcv_bench.MISSING)
def test_ffcv_reads_the_cache_pixels_end_to_end(small_folder, tmp_path):
    cache = tmp_path / "cache"
    mmcache.build_cache(small_folder, cache)  # twelve records of four sizes
    result = ffcv_bench.run_ffcv_peer(
        cache, batch_size=5, workers=1, epochs=2, size=32, workdir=tmp_path / "ffcv", validate=True
    )
    assert isinstance(result, dict), result
    assert result["ok"], result["problems"]
    assert result["images"] == 12
    assert result["max_resolution"] == 64
    assert result["validate"]["raw_records_equal"] == 12
    assert result["yielded_per_epoch"] == [12, 12]
    assert result["labels_match_per_epoch"] == [True, True]
    assert result["batch"]["images"] == {
        "type": "torch.Tensor",
        "shape": [5, 32, 32, 3],
        "dtype": "torch.uint8",
    }
    assert len(result["epoch_seconds"]) == 2
    assert result["img_per_s"] > 0
    assert result["versions"]["ffcv"] == "1.0.2"
    assert (tmp_path / "ffcv" / "ffcv.beton").is_file()


def test_the_peer_reads_a_refreshed_cache_with_plain_numpy(small_folder, tmp_path):
    # The peer reads caches without mmcache, from the format's specification: a cache whose
    # data file a refresh shared with an earlier generation must read as the dataset does.
    spec = importlib.util.spec_from_file_location("ffcv_peer", TOOLS / "ffcv_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    cache = tmp_path / "cache"
    mmcache.build_cache(small_folder, cache)
    replaced = sorted(small_folder.rglob("*.jpg"))[0]
    replaced.write_bytes(sorted(small_folder.rglob("*.jpg"))[-1].read_bytes())
    assert mmcache.build_cache(small_folder, cache).appended  # shares the first data file
    ds = mmcache.MemmapImageDataset(cache)
    records = peer.Cache(cache)
    assert len(records) == len(ds)
    for i in range(len(ds)):
        image, label = ds[i]
        assert np.array_equal(records.image(i), image)
        assert records.labels[i] == label
