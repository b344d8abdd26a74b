"""Push and pull: a cache published under an object-store prefix and copied back, checked.

Against a real S3 server (SeaweedFS's, see tests/s3server.py), and a folder (``file://``) where
said; the faults are in tests/test_remote_faults.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MIB, big_folder, same_records, wait_until, write_image

import mmcache
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.remote.published import REMOTE_NAME
from mmcache.remote.stores import open_store


def test_a_pushed_cache_pulls_back_identical_and_a_second_push_sends_nothing(tmp_path, remote):
    src = big_folder(tmp_path / "src")
    mmcache.build_cache(src, tmp_path / "cache", workers=0)
    first = mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    assert first.uploaded == first.bytes and first.objects_kept == 0
    again = mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    assert again.uploaded == 0 and again.objects_uploaded == 0

    pulled = mmcache.pull_cache(remote, tmp_path / "local")
    assert pulled.fetched_records == pulled.images == 12 and pulled.present == 0
    same_records(tmp_path / "cache", tmp_path / "local")
    assert mmcache.verify_cache(tmp_path / "local").bad == []
    assert mmcache.pull_cache(remote, tmp_path / "local").up_to_date


def test_after_a_refresh_push_and_pull_move_only_the_new_records(tmp_path, remote):
    src = big_folder(tmp_path / "src", n=16)
    mmcache.build_cache(src, tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    mmcache.pull_cache(remote, tmp_path / "local")
    write_image(src / "b" / "new.jpg", 600, 500, seed=99)  # appended by the refresh
    build = mmcache.build_cache(src, tmp_path / "cache", workers=0)
    assert build.appended and build.decoded == 1

    push = mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    small = sum(v for k, v in fmt.read_manifest(tmp_path / "cache").sizes.items() if k != "data")
    # The new record, the small files, and at most the last chunk, which it grew.
    assert push.uploaded <= build.written_bytes + small + MIB
    assert push.uploaded < push.bytes / 3
    pull = mmcache.pull_cache(remote, tmp_path / "local")
    assert pull.fetched_records == 1 and pull.present == 16
    same_records(tmp_path / "cache", tmp_path / "local")


def test_a_killed_pull_resumes_fetching_only_what_is_missing(tmp_path, remote):
    mmcache.build_cache(big_folder(tmp_path / "src", n=40), tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    marker = tmp_path / "first-run-written"
    # A pull whose progress (called after each run of records is written) stops it there.
    script = (
        "import sys, time, pathlib, mmcache\n"
        "from mmcache.remote import pull\n"
        "pull.RUN_BYTES = 4 << 20\n"
        "def progress(done, total):\n"
        "    pathlib.Path(sys.argv[3]).touch(); time.sleep(600)\n"
        "mmcache.pull_cache(sys.argv[1], sys.argv[2], progress, concurrency=1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, remote, tmp_path / "local", marker])
    try:
        wait_until(marker.exists, "the pull to write its first run of records", 120)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert not (tmp_path / "local" / fmt.MANIFEST_NAME).exists()  # nothing half published
    with pytest.raises(mmcache.CacheNotFoundError):
        mmcache.MemmapImageDataset(tmp_path / "local")

    resumed = mmcache.pull_cache(remote, tmp_path / "local")
    assert 0 < resumed.present < 40 and resumed.fetched_records == 40 - resumed.present
    same_records(tmp_path / "cache", tmp_path / "local")


def test_a_record_altered_in_the_store_is_refused_by_name_and_nothing_is_published(
    tmp_path, remote
):
    mmcache.build_cache(big_folder(tmp_path / "src", n=4), tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    store = open_store(remote)
    files = fmt.open_cache(tmp_path / "cache")
    chunk = json.loads(store.get(REMOTE_NAME))["data"]["chunks"][0]["key"]
    damaged = bytearray(store.get(chunk))
    damaged[int(files.index["offset"][0]) + 100] ^= 0xFF  # one byte of record 0
    store.put(chunk, bytes(damaged))

    with pytest.raises(mmcache.CacheFormatError, match=r"record 0 \(a/img_000.jpg\) fails its CRC"):
        mmcache.pull_cache(remote, tmp_path / "local")
    assert not (tmp_path / "local" / fmt.MANIFEST_NAME).exists()


def test_the_cli_pushes_and_pulls_and_says_so_in_one_line(tmp_path, remote, capsys):
    mmcache.build_cache(big_folder(tmp_path / "src", n=2), tmp_path / "cache", workers=0)
    assert main(["push", "-q", str(tmp_path / "cache"), remote]) == 0
    assert main(["push", str(tmp_path / "cache"), remote]) == 0
    assert "0 B sent in 0 objects" in capsys.readouterr().out
    assert main(["pull", remote, str(tmp_path / "local")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "2 records" in out[0] and "every record checked" in out[0]
    assert main(["pull", remote, str(tmp_path / "local")]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main(["pull", remote.replace("train", "nothing"), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no cache published here" in err[0]


def test_a_dataset_opened_by_url_reads_its_local_copy_in_workers_and_follows_a_new_push(
    tmp_path, remote
):
    src = big_folder(tmp_path / "src", n=6)
    mmcache.build_cache(src, tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    ds = mmcache.MemmapImageDataset(remote, local=tmp_path / "node")
    same_records(tmp_path / "cache", tmp_path / "node")
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    local = mmcache.MemmapImageDataset(tmp_path / "cache")
    for i, (image, label) in enumerate(loader):
        assert np.array_equal(np.asarray(image), np.asarray(local[i][0])) and label == local[i][1]

    write_image(src / "a" / "new.jpg", 640, 480, seed=77)
    mmcache.build_cache(src, tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    assert len(mmcache.MemmapImageDataset(remote, local=tmp_path / "node", on_stale="refresh")) == 7


def test_two_nodes_pull_their_own_copies_and_two_processes_of_a_node_fetch_once(
    tmp_path, remote
):
    mmcache.build_cache(big_folder(tmp_path / "src", n=8), tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    script = "import sys, mmcache; print(mmcache.pull_cache(*sys.argv[1:]).fetched_records)"
    nodes = [tmp_path / "node0", tmp_path / "node0", tmp_path / "node1"]  # two ranks on node 0
    procs = [
        subprocess.Popen([sys.executable, "-c", script, remote, node], stdout=subprocess.PIPE)
        for node in nodes
    ]
    fetched = [int(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(fetched[:2]) == [0, 8] and fetched[2] == 8  # node 0's records fetched once
    for node in ("node0", "node1"):
        same_records(tmp_path / "cache", tmp_path / node)


def test_a_lazy_cache_with_records_not_filled_is_not_pushed(tmp_path, remote):
    src = big_folder(tmp_path / "src", n=2)
    mmcache.create_lazy_cache(src, tmp_path / "lazy")
    with pytest.raises(mmcache.CacheError, match="2 records are not filled yet"):
        mmcache.push_cache(tmp_path / "lazy", remote)


def test_info_on_a_url_describes_the_publication_without_pulling(tmp_path, remote, capsys):
    mmcache.build_cache(big_folder(tmp_path / "src", n=2), tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", remote, chunk_bytes=MIB)
    assert main(["info", remote]) == 0
    out = capsys.readouterr().out
    assert "(published)" in out and "images:     2, 2 classes" in out
    assert main(["info", "--json", remote]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["images"] == 2
    assert info["generation"] == fmt.read_manifest(tmp_path / "cache").generation


def test_a_cache_of_a_tar_travels_with_its_members_file_through_a_folder_store(tmp_path):
    import tarfile

    src = big_folder(tmp_path / "src", n=2)
    with tarfile.open(tmp_path / "src.tar", "w") as tar:
        tar.add(src, arcname=".")
    mmcache.build_cache(tmp_path / "src.tar", tmp_path / "cache", workers=0)
    assert fmt.read_manifest(tmp_path / "cache").members is not None
    url = f"file://{tmp_path}/store"
    mmcache.push_cache(tmp_path / "cache", url)
    mmcache.pull_cache(url, tmp_path / "local")
    assert mmcache.verify_cache(tmp_path / "local").bad == []
    same_records(tmp_path / "cache", tmp_path / "local")


def test_the_remote_bench_prints_its_targets_table(tmp_path, weed):
    tool = Path(__file__).resolve().parents[1] / "tools" / "remote_bench.py"
    run = subprocess.run(
        [sys.executable, tool, "--images", "8", "--turns", "1", "--concurrency", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    for row in ("pull vs plain download", "epoch two vs local cache", "push after +1% images"):
        assert row in run.stdout
