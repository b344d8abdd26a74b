"""Staleness: whether a cache still matches its source listing and this machine's decoder.

Kept free of torch so that ``mmcache info`` and other torch-less callers can ask.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from . import format as fmt
from .decode import Options, decoder_accepted, decoder_versions
from .scan import Listing, diff_listings, scan_source


def stale_reason(files: fmt.CacheFiles, listing: Listing | None = None) -> str | None:
    """Why a cache no longer matches its source or decoder, or None if it still does.

    ``listing``: the source to compare with (default: scan the source the cache records).
    """
    m = files.manifest
    reasons = []
    if not decoder_accepted(m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")):
        reasons.append(
            f"it was decoded by {_versions(m.decoder)}, this machine decodes with "
            f"{_versions(None)} (`mmcache build --trust-decoder` keeps it as it is)"
        )
    if listing is None:
        source = recorded_source(m)
        if source and Path(source).exists():
            try:
                listing = scan_source(source)
            except Exception as e:  # a source that now fails to scan has changed, in a way
                reasons.append(f"the source cannot be scanned ({e})")
    if listing is not None:
        if listing.source_json() != m.source:
            reasons.append(f"it was made from {recorded_source(m)}, not {_source_of(listing)}")
        elif listing.fingerprint() != m.fingerprints.get("listing"):
            reasons.append("the source changed: " + _diff_summary(files, listing))
    return "; ".join(reasons) or None


def rebuild_advice(m: fmt.Manifest) -> str:
    """What to run to bring cache ``m`` up to date, with the options it was made with."""
    try:
        flags = Options.from_json(m.options).flags()
    except (TypeError, ValueError):
        flags = ""
    how = "made" if m.mode == "lazy" else "built"
    command = f"mmcache build {recorded_source(m)} {m.path}" + (f" {flags}" if flags else "")
    return f"it was {how} with {flags or 'the default options'}; `{command}` updates it"


def recorded_source(m: fmt.Manifest) -> str:
    """The folder or list file a cache was made from."""
    return str(m.source.get("list_file") if m.source.get("kind") == "list" else m.source["root"])


def _source_of(listing: Listing) -> str:
    return str(listing.list_file if listing.kind == "list" else listing.root)


def _diff_summary(files: fmt.CacheFiles, listing: Listing) -> str:
    m = files.manifest
    idx = files.index
    paths = files.paths() + [s["path"] for s in m.skipped]
    n_skip = len(m.skipped)
    skipped_stats = np.array(
        [(s.get("size", -1), s.get("mtime_ns", -1)) for s in m.skipped], np.int64
    ).reshape(-1, 2)
    sizes = np.concatenate([idx["source_size"].astype(np.int64), skipped_stats[:, 0]])
    mtimes = np.concatenate([idx["source_mtime_ns"], skipped_stats[:, 1]])
    labels = np.concatenate([idx["label"], np.zeros(n_skip, np.int32)])
    diff = diff_listings(m.classes, paths, labels, sizes, mtimes, listing)
    diff.relabeled = [p for p in diff.relabeled if p in set(files.paths())]
    return diff.summary()


def _versions(versions: dict[str, str] | None) -> str:
    v = decoder_versions() if versions is None else versions
    return ", ".join(f"{k} {v[k]}" for k in sorted(v)) or "an unknown decoder"
