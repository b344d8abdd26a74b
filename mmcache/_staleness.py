"""Whether a cache is current: its source listing, options and decoder against this machine's.

The one decision of it that builds, ``plan_cache``, ``cache_info`` and the dataset share:
``fingerprints`` of what a build would make now, ``to_match`` (a decoder the user trusts counts
as this machine's), ``is_current`` and, for people, ``stale_reason``. Kept free of torch so that
``mmcache info`` and other torch-less callers can ask.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import format as fmt
from .decode import Options, decoder_accepted, decoder_fingerprint, decoder_versions
from .scan import Listing, diff_listings, scan_source, source_exists


def fingerprints(listing: Listing, opts: Options) -> dict[str, str]:
    """What a cache of ``listing`` made now with ``opts`` records: its listing, options and
    decoder fingerprints."""
    return {
        "listing": listing.fingerprint(),
        "options": opts.fingerprint(),
        "decoder": decoder_fingerprint(),
    }


def to_match(m: fmt.Manifest, current: dict[str, str], trust: bool = False) -> dict[str, str]:
    """The fingerprints cache ``m`` must have to be current or to lend its records: ``current``,
    with ``m``'s own decoder when the user trusts it now (``trust``) or trusted it before."""
    recorded = m.fingerprints.get("decoder")
    if (
        recorded is not None
        and recorded != current["decoder"]
        and (trust or decoder_accepted(recorded, m.extra.get("trusted_decoder")))
    ):
        return {**current, "decoder": recorded}
    return current


def same_options(m: fmt.Manifest, opts: Options) -> bool:
    """Whether cache ``m`` was made with the preprocessing ``opts``."""
    return m.fingerprints.get("options") == opts.fingerprint()


def same_source(m: fmt.Manifest, source: str | os.PathLike | Listing) -> bool:
    """Whether cache ``m`` was made from ``source``: the folder or list file (or its listing).

    Compared as the scan records them (symlinks resolved), so without scanning a path.
    """
    if isinstance(source, Listing):
        return recorded_source(m) == source_of(source)
    return recorded_source(m) == str(Path(source).expanduser().resolve())


def is_current(
    files: fmt.CacheFiles, listing: Listing, wanted: dict[str, str], lazy: bool = False
) -> bool:
    """Whether a build of ``listing`` (or, ``lazy``, a lazy creation) would leave ``files`` as it
    is: the same source, fingerprints ``wanted`` (see ``to_match``), and, for a build, no record
    left to fill."""
    m = files.manifest
    # A file that changed while it was decoded was skipped, yet may read the same as when listed
    # (restored with its mtime): such a cache is never current, so the next build retries it.
    retry = any(e.get("state") == fmt.BAD_SOURCE_CHANGED for e in m.skipped)
    return (
        m.source == listing.source_json()
        and all(m.fingerprints.get(k) == v for k, v in wanted.items())
        and (lazy or bool((files.state["state"] != fmt.EMPTY).all()))
        and not retry
    )


def trust_record(versions: dict[str, str]) -> dict:
    """The ``"trusted_decoder"`` a manifest records for a decoder the user declared equivalent."""
    return {
        "versions": versions,
        "fingerprint": decoder_fingerprint(versions),
        "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def carried_trust(m: fmt.Manifest, wanted: dict[str, str], current: dict[str, str]) -> dict | None:
    """The ``trusted_decoder`` record of a generation that reuses records of cache ``m``: the
    other decoder whose pixels it keeps (``m``'s own, or the one ``m`` already trusted)."""
    if wanted["decoder"] != current["decoder"]:
        return trust_record(m.decoder)
    return m.extra.get("trusted_decoder")


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
        if source and source_exists(source):
            try:
                listing = scan_source(source, label_key=m.source.get("label_key"))
            except Exception as e:  # a source that now fails to scan has changed, in a way
                reasons.append(f"the source cannot be scanned ({e})")
    if listing is not None:
        if listing.source_json() != m.source:
            reasons.append(f"it was made from {recorded_source(m)}, not {source_of(listing)}")
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


def source_of(listing: Listing) -> str:
    """The folder or list file ``listing`` comes from, as a manifest records it."""
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
