"""Training from a URL: the sparse node-local copy that fetches each record's block on its first
read, checked, shared by DataLoader workers, loader threads and the processes of a node.

Against a real S3 server (SeaweedFS's, see tests/s3server.py); the store down is in
tests/test_remote_faults.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch
from conftest import MIB, big_folder, same_records, wait_until, write_image

import mmcache
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.remote import sparse
from mmcache.remote.published import REMOTE_NAME
from mmcache.remote.stores import open_store


def push_eight(root, url: str):
    """A cache of 8 images of ~0.9 MB (two in each MiB of its data file) in ``root``, pushed to
    ``url``: ``(cache folder, url)``."""
    mmcache.build_cache(big_folder(root / "src", n=8), root / "cache", workers=0)
    mmcache.push_cache(root / "cache", url, chunk_bytes=MIB)
    return root / "cache", url


@pytest.fixture(scope="module")
def shared(tmp_path_factory, s3_server):
    """``push_eight`` once for the tests that only read the store (each copies it into a
    folder of its own); the store's endpoint and key in the environment meanwhile."""
    with pytest.MonkeyPatch.context() as env:
        for k, v in s3_server.env().items():
            env.setenv(k, v)
        url = f"s3://{s3_server.make_bucket(f'sparse-{uuid.uuid4().hex[:8]}')}/train"
        yield push_eight(tmp_path_factory.mktemp("shared"), url)


@pytest.fixture
def pushed(tmp_path, remote):
    """``push_eight`` for a test that changes what the store holds."""
    return push_eight(tmp_path, remote)


def filled(folder) -> np.ndarray:
    return fmt.open_cache(folder).state["state"] == fmt.FILLED


def test_opening_a_url_fetches_no_record_and_a_first_read_fetches_its_block(
    tmp_path, shared, monkeypatch, capsys
):
    cache, url = shared
    monkeypatch.setattr(sparse, "BLOCK_BYTES", MIB)
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    files = fmt.open_cache(tmp_path / "node")
    assert files.manifest.mode == "lazy" and files.manifest.origin == {"url": url}
    assert "remote-fill" in files.manifest.requires
    assert not filled(tmp_path / "node").any()
    data = files.manifest.file("data")
    assert os.stat(data).st_size >= files.manifest.sizes["data"]
    assert os.stat(data).st_blocks * 512 < MIB  # allocated sparse: no pixels fetched

    reference = mmcache.MemmapImageDataset(cache)
    image, label = ds[5]
    assert np.array_equal(image, reference[5][0]) and label == reference[5][1]
    block = files.index["offset"] // MIB  # the records that start in record 5's MiB
    np.testing.assert_array_equal(filled(tmp_path / "node"), block == block[5])
    assert ds.reader.filler.fetched == int((block == block[5]).sum())
    assert main(["info", str(tmp_path / "node")]) == 0
    out = capsys.readouterr().out
    assert f"copy of:    {url} (records fetched as they are read)" in out
    assert f"images:     8 ({int((block == block[5]).sum())} filled)" in out


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_fill_the_copy_and_read_what_the_remote_holds(
    tmp_path, shared, method
):
    cache, url = shared
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    workers = 2 if method == "fork" else 1  # (a spawned worker imports torch anew: seconds)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=workers, multiprocessing_context=method
    )
    reference = mmcache.MemmapImageDataset(cache)
    n = 0
    for i, (image, label) in enumerate(loader):
        assert np.array_equal(np.asarray(image), reference[i][0]) and label == reference[i][1]
        n += 1
    assert n == len(reference) and filled(tmp_path / "node").all()
    assert mmcache.verify_cache(tmp_path / "node").bad == []


def test_a_batch_loader_on_a_url_gives_the_batches_of_the_cache_pushed(tmp_path, shared):
    cache, url = shared

    def batches(ds):
        crop = mmcache.RandomResizedCrop(96)
        loader = mmcache.BatchLoader(
            ds, 3, shuffle=True, seed=4, crop=crop, flip=True, num_threads=2
        )
        return [(images.clone(), labels.clone()) for images, labels in loader]

    remote_batches = batches(mmcache.MemmapImageDataset(url, local=tmp_path / "node"))
    local_batches = batches(mmcache.MemmapImageDataset(cache))
    assert len(remote_batches) == 3
    for (a, la), (b, lb) in zip(remote_batches, local_batches, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)
    assert filled(tmp_path / "node").all()


def test_two_processes_of_a_node_fill_one_copy_and_fetch_each_record_once(tmp_path, shared):
    cache, url = shared
    # Each reads every record, in opposite orders, and says how many records it fetched: two
    # processes of node 0, one of node 1 (another local folder).
    script = (
        "import sys, mmcache, mmcache.remote.sparse\n"
        "mmcache.remote.sparse.BLOCK_BYTES = 1 << 20\n"
        "ds = mmcache.MemmapImageDataset(sys.argv[1], local=sys.argv[2])\n"
        "order = range(len(ds)) if sys.argv[3] == 'up' else reversed(range(len(ds)))\n"
        "for i in order: ds[i]\n"
        "filler = ds.reader.filler\n"
        "print(filler.fetched if filler is not None else 0)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, url, tmp_path / "node0", way], stdout=subprocess.PIPE
        )
        for way in ("up", "down")
    ]
    node1 = mmcache.MemmapImageDataset(url, local=tmp_path / "node1")  # meanwhile, here
    for i in range(len(node1)):
        node1[i]
    fetched = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(fetched) == 8 and node1.reader.filler.fetched == 8
    for node in ("node0", "node1"):
        same_records(cache, tmp_path / node)


def test_a_filling_process_killed_leaves_no_record_wrong_and_the_next_completes_the_copy(
    tmp_path, shared
):
    cache, url = shared
    script = (
        "import sys, mmcache, mmcache.remote.sparse\n"
        "mmcache.remote.sparse.BLOCK_BYTES = 1 << 20\n"
        "ds = mmcache.MemmapImageDataset(sys.argv[1], local=sys.argv[2])\n"
        "while True:\n"
        "    for i in range(len(ds)): ds[i]\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, url, tmp_path / "node"])
    try:
        wait_until(
            lambda: (tmp_path / "node" / fmt.MANIFEST_NAME).exists()
            and filled(tmp_path / "node").sum() >= 2,
            "the process to fill two records",
            120,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    reference = mmcache.MemmapImageDataset(cache)
    for i in range(len(ds)):
        assert np.array_equal(ds[i][0], reference[i][0])
    assert filled(tmp_path / "node").all()
    assert mmcache.verify_cache(tmp_path / "node").bad == []


def test_a_record_altered_in_the_store_is_refused_by_name_and_stays_empty(tmp_path, pushed):
    cache, url = pushed
    store = open_store(url)
    chunk = json.loads(store.get(REMOTE_NAME))["data"]["chunks"][0]["key"]
    damaged = bytearray(store.get(chunk))
    offset = int(fmt.open_cache(cache).index["offset"][0])
    damaged[offset + 100] ^= 0xFF  # one byte of record 0
    store.put(chunk, bytes(damaged))

    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    with pytest.raises(mmcache.CacheFormatError, match=r"record 0 \(a/img_000.jpg\) fails its CRC"):
        ds[0]
    assert not filled(tmp_path / "node")[0]


def test_a_pull_completes_a_sparse_copy_fetching_only_what_it_lacks(
    tmp_path, shared, monkeypatch
):
    cache, url = shared
    monkeypatch.setattr(sparse, "BLOCK_BYTES", MIB)
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    ds[0]
    had = int(filled(tmp_path / "node").sum())
    assert 0 < had < 8
    report = mmcache.pull_cache(url, tmp_path / "node")
    assert report.present == had and report.fetched_records == 8 - had
    m = fmt.read_manifest(tmp_path / "node")
    assert m.mode == "build" and m.origin is None
    same_records(cache, tmp_path / "node")


def test_a_copy_opened_after_a_new_push_is_stale_as_on_stale_says_and_refreshed_keeps_its_records(
    tmp_path, pushed
):
    cache, url = pushed
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    for i in range(len(ds)):
        ds[i]
    old = fmt.read_manifest(tmp_path / "node").generation
    write_image(tmp_path / "src" / "a" / "new.jpg", 640, 480, seed=77)
    mmcache.build_cache(tmp_path / "src", cache, workers=0)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    new = fmt.open_cache(cache)

    generation = new.manifest.generation
    pushed_again = f"{url} was pushed again since \\(generation {generation}, 9 images\\)"
    with pytest.warns(mmcache.StaleCacheWarning, match=pushed_again + ": using the copy as it is"):
        assert len(mmcache.MemmapImageDataset(url, local=tmp_path / "node")) == 8
    with pytest.raises(mmcache.CacheStaleError, match=pushed_again):
        mmcache.MemmapImageDataset(url, local=tmp_path / "node", on_stale="error")
    assert len(mmcache.MemmapImageDataset(url, local=tmp_path / "node", on_stale="ignore")) == 8
    assert fmt.read_manifest(tmp_path / "node").generation == old

    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node", on_stale="refresh")
    assert len(ds) == 9 and fmt.read_manifest(tmp_path / "node").generation == (
        new.manifest.generation
    )
    np.testing.assert_array_equal(filled(tmp_path / "node"), np.array(new.paths()) != "a/new.jpg")
    same_records(cache, tmp_path / "node")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_copy_another_user_owns_is_not_filled_with_our_credentials(tmp_path, shared):
    cache, url = shared
    mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    for path in (tmp_path / "node", tmp_path / "node" / fmt.MANIFEST_NAME):
        os.chown(path, 65534, 65534)  # as if uid 65534 had made it, naming a store of theirs
    ds = mmcache.MemmapImageDataset(tmp_path / "node")
    with pytest.raises(mmcache.UnsafeCacheError, match=f"belongs to uid 65534, so the store its "
                       f"manifest names \\({url}\\) is not fetched into it"):  # fmt: skip
        ds[0]
    assert not filled(tmp_path / "node").any()


def test_a_folder_holding_another_url_s_copy_is_refused(tmp_path, shared):
    cache, url = shared
    mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    other = f"file://{tmp_path}/store"
    mmcache.push_cache(cache, other)
    refused = f"holds a copy of {url}, not of {other}"
    for on_stale in ("warn", "ignore", "refresh"):
        with pytest.raises(mmcache.DestinationError, match=refused):
            mmcache.MemmapImageDataset(other, local=tmp_path / "node", on_stale=on_stale)
