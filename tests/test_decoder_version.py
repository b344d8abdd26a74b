"""A cache made by another decoder version: stale with the reason, rebuilt, or kept on trust."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import reseal, write_image

from mmcache import CacheStaleError, MemmapImageDataset, StaleCacheWarning, build_cache, decode
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.decode import decoder_fingerprint, decoder_versions

OTHER = {"opencv": "3.4.0", "jpeg": "libjpeg-turbo (ver 1.5.3-62)"}


def _as_if_decoded_by(cache: Path, versions: dict[str, str]) -> None:
    """Rewrite the manifest as if another machine's decoder had written the cache."""
    path = cache / fmt.MANIFEST_NAME
    m = json.loads(path.read_text())
    m["decoder"] = versions
    m["fingerprints"]["decoder"] = decoder_fingerprint(versions)
    path.write_text(json.dumps(m))
    reseal(cache)


@pytest.fixture
def foreign_cache(small_folder, tmp_path) -> Path:
    cache = tmp_path / "cache"
    build_cache(small_folder, cache, workers=1)
    _as_if_decoded_by(cache, OTHER)
    return cache


def test_another_decoder_version_is_stale_with_the_reason(foreign_cache):
    with pytest.raises(CacheStaleError, match=r"decoded by jpeg libjpeg-turbo \(ver 1\.5\.3-62\)"):
        MemmapImageDataset(foreign_cache, on_stale="error")
    with pytest.warns(StaleCacheWarning, match=r"opencv 3\.4\.0, this machine decodes with"):
        MemmapImageDataset(foreign_cache)


def test_build_rebuilds_a_cache_of_another_decoder(small_folder, foreign_cache):
    old_generation = fmt.read_manifest(foreign_cache).generation
    report = build_cache(small_folder, foreign_cache, workers=1)
    assert not report.up_to_date and (report.decoded, report.reused) == (12, 0)
    m = fmt.read_manifest(foreign_cache)
    assert m.generation != old_generation and m.decoder == decoder_versions()
    assert "trusted_decoder" not in m.extra
    MemmapImageDataset(foreign_cache, on_stale="error")


def test_trust_decoder_keeps_the_cache_and_records_it(small_folder, foreign_cache):
    before = fmt.read_manifest(foreign_cache)
    report = build_cache(small_folder, foreign_cache, workers=1, trust_decoder=True)
    assert report.up_to_date and report.trusted_decoder and report.decoded == 0
    m = fmt.read_manifest(foreign_cache)
    assert m.generation == before.generation and m.decoder == OTHER  # what decoded it, still
    trusted = m.extra["trusted_decoder"]
    assert trusted["versions"] == decoder_versions()
    assert trusted["fingerprint"] == decoder_fingerprint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemmapImageDataset(foreign_cache)  # no longer stale for its decoder
    # A later plain build finds it current; the trust was recorded, not a one-off.
    again = build_cache(small_folder, foreign_cache, workers=1)
    assert again.up_to_date and not again.trusted_decoder

    # Still stale when the source changes, for the source alone.
    write_image(small_folder / "cat" / "new.jpg", 20, 10, seed=99)
    with pytest.raises(CacheStaleError, match="source changed") as e:
        MemmapImageDataset(foreign_cache, on_stale="error")
    assert "decoded by" not in str(e.value)

    # The update reuses the trusted records and carries the other decoder's name along.
    report = build_cache(small_folder, foreign_cache, workers=1)
    assert (report.decoded, report.reused) == (1, 12) and report.trusted_decoder
    m = fmt.read_manifest(foreign_cache)
    assert m.decoder == decoder_versions() and m.extra["trusted_decoder"]["versions"] == OTHER
    MemmapImageDataset(foreign_cache, on_stale="error")


def test_trust_decoder_with_a_changed_source_reuses_records(small_folder, foreign_cache):
    old = MemmapImageDataset(foreign_cache, on_stale="ignore")[3][0].copy()
    write_image(small_folder / "dog" / "new.jpg", 20, 10, seed=98)
    report = build_cache(small_folder, foreign_cache, workers=1, trust_decoder=True)
    assert (report.decoded, report.reused) == (1, 12) and report.trusted_decoder
    m = fmt.read_manifest(foreign_cache)
    assert m.extra["trusted_decoder"]["fingerprint"] == decoder_fingerprint(OTHER)
    assert np.array_equal(MemmapImageDataset(foreign_cache, on_stale="error")[3][0], old)


def test_a_second_decoder_named_by_the_hook_changes_the_fingerprint(
    small_folder, tmp_path, monkeypatch
):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    monkeypatch.setitem(decode.EXTRA_DECODERS, "simplejpeg", lambda: "1.8.2")
    assert decoder_versions()["simplejpeg"] == "1.8.2"
    with pytest.raises(CacheStaleError, match="this machine decodes with .*simplejpeg 1.8.2"):
        MemmapImageDataset(tmp_path / "cache", on_stale="error")
    assert build_cache(small_folder, tmp_path / "cache", workers=1).decoded == 12
    assert fmt.read_manifest(tmp_path / "cache").decoder["simplejpeg"] == "1.8.2"


def test_cli_trust_decoder(small_folder, foreign_cache, capsys):
    assert main(["build", str(small_folder), str(foreign_cache), "--trust-decoder"]) == 0
    out = capsys.readouterr().out
    assert "up to date" in out and "--trust-decoder, recorded" in out
