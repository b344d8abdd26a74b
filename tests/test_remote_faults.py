"""Object-store faults, against a real S3 server: refused credentials, a server down at open or
mid-transfer (a pull's, a push's, a sparse copy's fill), a publication forged to reach outside
its prefix, a client made before fork."""

from __future__ import annotations

import json
import multiprocessing
import threading

import pytest
from conftest import make_folder, wait_until

import mmcache
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.remote import sparse
from mmcache.remote.published import REMOTE_NAME
from mmcache.remote.stores import open_store

MIB = 1 << 20


@pytest.fixture
def cache(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(640, 480)] * 4, "b": [(600, 500)] * 4})
    mmcache.build_cache(src, tmp_path / "cache", workers=0)
    return tmp_path / "cache"


def serve(server, monkeypatch) -> str:
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{server.make_bucket('faults')}/train"


def test_wrong_credentials_are_one_line_without_the_secret(
    cache, tmp_path, s3_server, s3_bucket, monkeypatch, capsys
):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-5f3a9c")
    url = f"s3://{s3_bucket}/train"
    with pytest.raises(mmcache.RemoteAccessError, match="access refused"):
        mmcache.push_cache(cache, url, retry_seconds=5)
    assert main(["pull", url, str(tmp_path / "local")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "access refused" in err
    assert "not-the-secret" not in err and "Traceback" not in err


def test_credentials_written_into_a_url_are_refused_without_repeating_them(tmp_path):
    with pytest.raises(mmcache.RemoteError, match="credentials in a URL") as e:
        mmcache.pull_cache("s3://AKIA:hunter2@bucket/x", tmp_path / "local")
    assert "hunter2" not in str(e.value)


def test_a_server_down_at_open_is_retried_then_named_and_a_restart_in_time_succeeds(
    cache, tmp_path, private_s3_server, monkeypatch
):
    url = serve(private_s3_server, monkeypatch)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    private_s3_server.stop()
    with pytest.raises(mmcache.RemoteError, match=rf"{url}/remote.json: failed for 2 s"):
        mmcache.pull_cache(url, tmp_path / "local", retry_seconds=2)
    assert not (tmp_path / "local" / fmt.MANIFEST_NAME).exists()

    restart = threading.Timer(1.0, private_s3_server.start)
    restart.start()
    try:
        report = mmcache.pull_cache(url, tmp_path / "local", retry_seconds=120)
    finally:
        restart.join()
    assert report.fetched_records == 8
    assert mmcache.verify_cache(tmp_path / "local").bad == []


def test_a_server_lost_mid_pull_leaves_nothing_published_and_the_next_pull_resumes(
    cache, tmp_path, private_s3_server, monkeypatch
):
    url = serve(private_s3_server, monkeypatch)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    monkeypatch.setattr("mmcache.remote.pull.RUN_BYTES", 2 * MIB)  # several requests

    def stop_after_the_first_run(done, total):
        if private_s3_server.running:
            private_s3_server.stop()

    with pytest.raises(mmcache.RemoteError, match="failed for 1 s"):
        mmcache.pull_cache(
            url, tmp_path / "local", stop_after_the_first_run, concurrency=1, retry_seconds=1
        )
    assert not (tmp_path / "local" / fmt.MANIFEST_NAME).exists()
    private_s3_server.start()
    resumed = mmcache.pull_cache(url, tmp_path / "local")
    assert 0 < resumed.present < 8 and resumed.fetched_records == 8 - resumed.present
    assert mmcache.verify_cache(tmp_path / "local").bad == []


def test_a_server_lost_mid_push_leaves_the_previous_publication_whole(
    cache, tmp_path, private_s3_server, monkeypatch
):
    url = serve(private_s3_server, monkeypatch)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    first = fmt.read_manifest(cache).generation
    make_folder(tmp_path / "src", {"c": [(640, 480)] * 4})
    mmcache.build_cache(tmp_path / "src", cache, workers=0)

    def stop(done, total):
        if private_s3_server.running:
            private_s3_server.stop()

    with pytest.raises(mmcache.RemoteError):
        mmcache.push_cache(cache, url, stop, chunk_bytes=MIB, concurrency=1, retry_seconds=1)
    private_s3_server.start()
    pulled = mmcache.pull_cache(url, tmp_path / "local")
    assert pulled.images == 8 and fmt.read_manifest(tmp_path / "local").generation == first


@pytest.mark.parametrize(
    "forge, message",
    [
        (lambda d: d["data"]["chunks"][0].update(key="../../other/secret"), "data chunk 0 is not"),
        (lambda d: d["objects"]["index"].update(key="../index.bin"), "does not match the manif"),
        (lambda d: d["data"].update(chunk_bytes=1 << 50), "chunk_bytes .* out of range"),
        (lambda d: d["manifest"]["sizes"].update(index=1 << 45), "bad file sizes|checksum"),
        (lambda d: d.update(version=[2, 0]), "published format"),
        (lambda d: d.update(magic="other"), "not an mmcache publication"),
    ],
)
def test_a_forged_publication_is_refused_before_anything_is_fetched(
    cache, tmp_path, forge, message
):
    url = f"file://{tmp_path}/store"
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    store = open_store(url)
    d = json.loads(store.get(REMOTE_NAME))
    forge(d)
    del d["checksums"]
    d["checksums"] = {"remote": fmt.manifest_checksum(d)}  # resealed: the forger's best
    store.put(REMOTE_NAME, json.dumps(d).encode())
    with pytest.raises(mmcache.CacheFormatError, match=message):
        mmcache.pull_cache(url, tmp_path / "local")
    assert not (tmp_path / "local").exists()


def _pull_in_child(store, url, dest, out):
    from mmcache.remote.pull import pull_cache

    assert store.get(REMOTE_NAME) is not None  # the parent's store object, used after fork
    out.put(pull_cache(url, dest).fetched_records)


def test_a_store_used_before_fork_works_in_the_forked_child(
    cache, tmp_path, s3_server, s3_bucket, monkeypatch
):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{s3_bucket}/train"
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    store = open_store(url)
    assert store.get(REMOTE_NAME) is not None  # its connection pool is open now
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_pull_in_child, args=(store, url, tmp_path / "local", out))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and out.get(timeout=5) == 8
    assert store.get(REMOTE_NAME) is not None  # and the parent's still works


def test_a_copy_is_read_without_the_store_and_a_record_it_lacks_names_the_url(
    cache, tmp_path, private_s3_server, monkeypatch
):
    url = serve(private_s3_server, monkeypatch)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    monkeypatch.setattr(sparse, "BLOCK_BYTES", MIB)  # two records a block
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    ds[0]
    private_s3_server.stop()
    monkeypatch.setenv("MMCACHE_RETRY_SECONDS", "1")  # (read at each request)
    with pytest.raises(mmcache.RemoteError, match=rf"^{url}/data-\S+: failed for 1 s"):
        ds[7]
    with pytest.warns(mmcache.StaleCacheWarning, match="using the local copy as it is"):
        ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    assert ds[1][0].shape == (480, 640, 3)  # fetched with record 0

    private_s3_server.start()
    monkeypatch.delenv("MMCACHE_RETRY_SECONDS")  # (a gateway just started may 5xx a while)
    for i in range(len(ds)):
        ds[i]
    private_s3_server.stop()  # complete: the store is not needed any more
    monkeypatch.setenv("MMCACHE_RETRY_SECONDS", "1")
    with pytest.warns(mmcache.StaleCacheWarning):
        ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    reference = mmcache.MemmapImageDataset(cache)
    for i in range(len(ds)):
        assert (ds[i][0] == reference[i][0]).all()


def test_a_throttling_store_s_503s_are_retried_by_a_pull_and_a_sparse_copy(
    cache, tmp_path, private_s3_server, monkeypatch
):
    url = serve(private_s3_server, monkeypatch)
    mmcache.push_cache(cache, url, chunk_bytes=MIB)
    private_s3_server.throttle(reads=1)
    monkeypatch.setattr("mmcache.remote.pull.RUN_BYTES", MIB)  # 8 requests at once
    attempts = iter(range(1000))

    def refused_without_retries() -> bool:  # once the gateway applies the throttle
        try:
            mmcache.pull_cache(url, tmp_path / f"try{next(attempts)}", retry_seconds=0)
        except mmcache.RemoteError as e:
            assert "ErrTooManyRequest" in str(e)
            return True
        return False

    wait_until(refused_without_retries, "the server to throttle concurrent reads", 60)
    report = mmcache.pull_cache(url, tmp_path / "local", retry_seconds=60)
    assert report.fetched_records == 8
    assert mmcache.verify_cache(tmp_path / "local").bad == []

    monkeypatch.setattr(sparse, "BLOCK_BYTES", MIB)
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    loader = mmcache.BatchLoader(ds, 4, crop=mmcache.RandomResizedCrop(32), num_threads=2)
    assert sum(len(labels) for _, labels in loader) == 8
    assert (fmt.open_cache(tmp_path / "node").state["state"] == fmt.FILLED).all()


def test_a_retry_time_that_is_no_number_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MMCACHE_RETRY_SECONDS", "soon")
    with pytest.raises(mmcache.RemoteError, match=r"^\$MMCACHE_RETRY_SECONDS='soon': not a number"):
        mmcache.MemmapImageDataset(f"file://{tmp_path}/store", local=tmp_path / "node")
