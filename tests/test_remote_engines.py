"""The ``gs://`` and ``az://`` engines, against real servers: fake-gcs-server and Azurite
(tests/emulators.py). What the engines share with ``s3://`` (push, pull, a sparse copy, the
faults) is tested against the S3 server in tests/test_remote*.py; here, that each engine serves
the ``Store`` protocol: a cache pushed, pulled and opened by URL, ranges, listing, deletion,
parts, fork, refused credentials."""

from __future__ import annotations

import base64
import json
import multiprocessing
import re
import uuid

import numpy as np
import pytest
from conftest import MIB, big_folder, same_records

import mmcache
from mmcache.cli import main
from mmcache.remote.published import REMOTE_NAME
from mmcache.remote.stores import open_store


@pytest.fixture(params=["gs", "az"])
def url(request, monkeypatch) -> str:
    """A fresh prefix in a new bucket (container) of the session's emulator for the scheme,
    its endpoint and credentials in the environment, as a user's would be."""
    scheme = request.param
    server = request.getfixturevalue({"gs": "gcs_server", "az": "azurite_server"}[scheme])
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.originalname.lower())[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:8]}"
    bucket = server.make_bucket(name) if scheme == "gs" else server.make_container(name)
    return f"{scheme}://{bucket}/caches/train"


def test_a_cache_pushed_pulls_back_identical_opens_by_url_and_a_second_push_sends_nothing(
    tmp_path, url
):
    mmcache.build_cache(big_folder(tmp_path / "src", n=6), tmp_path / "cache", workers=0)
    first = mmcache.push_cache(tmp_path / "cache", url, chunk_bytes=MIB)
    assert first.uploaded == first.bytes and first.objects_uploaded > 3  # several chunks
    again = mmcache.push_cache(tmp_path / "cache", url, chunk_bytes=MIB)
    assert again.uploaded == 0 and again.objects_uploaded == 0

    pulled = mmcache.pull_cache(url, tmp_path / "local")
    assert pulled.fetched_records == pulled.images == 6
    same_records(tmp_path / "cache", tmp_path / "local")
    assert mmcache.pull_cache(url, tmp_path / "local").up_to_date

    # Opened by URL: a sparse copy, each record fetched by ranged reads on first use.
    ds = mmcache.MemmapImageDataset(url, local=tmp_path / "node")
    reference = mmcache.MemmapImageDataset(tmp_path / "cache")
    assert len(ds) == len(reference) == 6
    for i in range(len(ds)):
        assert np.array_equal(np.asarray(ds[i][0]), np.asarray(reference[i][0]))
        assert ds[i][1] == reference[i][1]


# Objects larger than these go in parts (the engines' constants, lowered so that 9 MiB does):
# GCS's resumable upload in 4 MiB parts (over google-cloud-storage's own 8 MiB for one
# request), Azure's blocks of 1 MiB.
SMALL_PARTS = {"gs": {"PART_BYTES": 4 * MIB}, "az": {"MULTIPART_BYTES": 4 * MIB, "PART_BYTES": MIB}}
ENGINE = {"gs": "mmcache.remote.gcs", "az": "mmcache.remote.azure_blob"}


def test_a_store_reads_ranges_lists_deletes_and_puts_a_large_object_in_parts(url, monkeypatch):
    scheme = url.split(":")[0]
    for name, value in SMALL_PARTS[scheme].items():
        monkeypatch.setattr(f"{ENGINE[scheme]}.{name}", value)
    store = open_store(url, retry_seconds=5)
    store.put("small", b"0123456789")
    store.put("data-0/of-3", memoryview(b"xyz"))  # a chunk's name holds a "/"
    assert store.get("small") == b"0123456789"
    assert store.get("small", 2, 5) == b"234"
    assert store.get("small", 0, 4) == b"0123"
    assert store.get("small", 8, 20) == b"89"  # past the end: what there is
    assert store.get("small", 7) == b"789"
    assert store.get("missing") is None
    assert store.sizes() == {"small": 10, "data-0/of-3": 3}

    large = np.random.default_rng(0).bytes(9 * MIB + 5)
    store.put("large", large)
    assert store.get("large") == large
    assert store.get("large", 5 * MIB - 3, 6 * MIB + 7) == large[5 * MIB - 3 : 6 * MIB + 7]
    if scheme == "az":  # committed as blocks (GCS shows no trace of its parts)
        blob = store.container().get_blob_client("caches/train/large")
        assert len(blob.get_block_list()[0]) == 10

    store.delete(["small", "missing", "data-0/of-3"])  # one missing: no error
    assert store.sizes() == {"large": len(large)}
    assert open_store(url.replace("caches/train", "caches"), 5).sizes() == {
        "train/large": len(large)
    }  # a prefix holds what lies under it


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_a_store_with_no_server_behind_it_is_retried_then_named(scheme, monkeypatch):
    pytest.importorskip({"gs": "google.cloud.storage", "az": "azure.storage.blob"}[scheme])
    from emulators import AZURE_ACCOUNT, AZURE_KEY, free_port

    closed = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", closed)
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
        f"BlobEndpoint={closed}/{AZURE_ACCOUNT};",
    )
    url = f"{scheme}://nowhere/train"
    for call in (lambda s: s.get(REMOTE_NAME), lambda s: s.put("x", b"1"), lambda s: s.sizes()):
        with pytest.raises(mmcache.RemoteError, match=rf"^{url}/\S*: failed for 1 s, still fail"):
            call(open_store(url, retry_seconds=1))


def _pull_in_child(store, url, dest, out, parents):
    from mmcache.remote.pull import pull_cache

    own = store.client()
    assert store.get(REMOTE_NAME) is not None  # the parent's store object, used after fork
    out.put((own is not parents, pull_cache(url, dest).fetched_records))


def test_a_store_used_before_fork_makes_its_own_client_in_the_forked_child(tmp_path, url):
    mmcache.build_cache(big_folder(tmp_path / "src", n=2), tmp_path / "cache", workers=0)
    mmcache.push_cache(tmp_path / "cache", url, chunk_bytes=MIB)
    store = open_store(url)
    assert json.loads(store.get(REMOTE_NAME) or b"")  # its connection pool is open now
    parents = store.client()
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_pull_in_child, args=(store, url, tmp_path / "local", out, parents))
    child.start()
    child.join(120)
    # A client of its own (the parent's pooled sockets are not shared), and it works.
    assert child.exitcode == 0 and out.get(timeout=5) == (True, 2)
    assert store.get(REMOTE_NAME) is not None  # and the parent's still works
    assert store.client() is open_store(url).client() is parents  # one per process


def test_wrong_azure_credentials_are_one_line_without_the_secret(
    tmp_path, azurite_server, monkeypatch, capsys
):
    # (fake-gcs-server takes any credentials, or none: GCS's refusal is not shown here)
    mmcache.build_cache(big_folder(tmp_path / "src", n=2), tmp_path / "cache", workers=0)
    container = azurite_server.make_container(f"refused-{uuid.uuid4().hex[:8]}")
    wrong = base64.b64encode(b"not-the-secret-5f3a9c").decode()
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_server.connection_string(wrong))
    url = f"az://{container}/train"
    with pytest.raises(mmcache.RemoteAccessError, match="access refused"):
        mmcache.push_cache(tmp_path / "cache", url, retry_seconds=5)
    assert main(["pull", url, str(tmp_path / "local")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "access refused" in err
    assert wrong not in err and "not-the-secret" not in err and "Traceback" not in err
