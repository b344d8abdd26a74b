"""A cache made by another decoder version: stale with the reason, rebuilt, or kept on trust."""

from __future__ import annotations

import json
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from conftest import reseal, write_image

from mmcache import (
    CacheStaleError,
    MemmapImageDataset,
    StaleCacheWarning,
    build_cache,
    decode,
    plan_cache,
)
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


def test_the_reason_names_each_version_of_both_decoders(foreign_cache):
    with pytest.raises(CacheStaleError) as e:
        MemmapImageDataset(foreign_cache, on_stale="error")
    here = ", ".join(f"{k} {v}" for k, v in sorted(decoder_versions().items()))
    assert (
        "it was decoded by jpeg libjpeg-turbo (ver 1.5.3-62), opencv 3.4.0, this machine "
        f"decodes with {here} (`mmcache build --trust-decoder` keeps it as it is)"
    ) in str(e.value)
    _as_if_decoded_by(foreign_cache, {})
    with pytest.raises(CacheStaleError, match="it was decoded by an unknown decoder, this"):
        MemmapImageDataset(foreign_cache, on_stale="error")


def test_the_plan_of_a_cache_of_another_decoder_is_a_rebuild_until_it_is_trusted(
    small_folder, foreign_cache
):
    assert not plan_cache(small_folder, foreign_cache).up_to_date
    build_cache(small_folder, foreign_cache, workers=1, trust_decoder=True)
    assert plan_cache(small_folder, foreign_cache).up_to_date


def test_the_trust_is_dated_and_carried_by_every_later_update(small_folder, foreign_cache):
    build_cache(small_folder, foreign_cache, workers=1, trust_decoder=True)
    recorded = datetime.fromisoformat(fmt.read_manifest(foreign_cache).extra["trusted_decoder"]
                                      ["recorded"])  # fmt: skip
    assert recorded.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - recorded) < timedelta(minutes=10)
    # Two updates: the first writes this machine's decoder and names the other one as trusted
    # (its records are kept), the second, whose cache is already this machine's, keeps that.
    for n in range(2):
        write_image(small_folder / "cat" / f"more_{n}.jpg", 20, 10, seed=90 + n)
        report = build_cache(small_folder, foreign_cache, workers=1)
        assert (report.decoded, report.reused) == (1, 12 + n)
        assert fmt.read_manifest(foreign_cache).extra["trusted_decoder"]["versions"] == OTHER
