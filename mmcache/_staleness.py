"""Whether a cache is current: its source listing, options and decoder against this machine's.

The one decision of it that builds, ``plan_cache``, ``cache_info`` and the dataset share:
``fingerprints`` of what a build would make now, ``to_match`` (a decoder the user trusts counts
as this machine's), ``is_current`` and, for people, ``stale_reason``. Kept free of torch so that
``mmcache info`` and other torch-less callers can ask.
"""

from __future__ import annotations

import os
import posixpath
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from . import format as fmt
from .annotations import annotate
from .decode import Options, decoder_accepted, decoder_fingerprint, decoder_versions
from .scan import Listing, diff_listings, scan_within, source_exists
from .sources import SOURCES, Members


def fingerprints(listing: Listing, opts: Options) -> dict[str, str]:
    """What a cache of ``listing`` made now with ``opts`` records: its listing, options and
    decoder fingerprints."""
    return {
        "listing": listing.fingerprint(),
        "options": opts.fingerprint(),
        "decoder": decoder_fingerprint(),
        **(listing.annotations.fingerprints() if listing.annotations is not None else {}),
    }


# How many entries the staleness check's walk of a folder source may meet per record, and
# beyond them: a source grows, and holds other files, but a cache of a few records whose
# manifest names ``/`` must not make ``info`` or an open walk the whole file system.
ENTRIES_PER_RECORD = 4
EXTRA_ENTRIES = 100_000


def rescan(m: fmt.Manifest, bounded: bool = False) -> Listing:
    """The source cache ``m`` was made from, scanned now, with the masks and COCO file it
    records (the user's arrays, which it cannot find again, left out). ``bounded``: give up on
    a folder that holds far more entries than the cache has records (a staleness check).

    Raises:
        SourceError: as ``scan_source`` and ``annotate``; ``bounded``, a source too large.
    """
    limit = ENTRIES_PER_RECORD * m.count + EXTRA_ENTRIES if bounded else None
    listing = scan_within(recorded_source(m), m.source.get("label_key"), limit)
    listing.annotations = annotate(listing, m.source.get("masks"), m.source.get("coco"))
    return listing


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


# Folders whose mtimes a manifest records at most (~50 bytes each in the manifest); a source of
# more folders gets no stamps and every open-time check scans it in full.
MAX_STAMPED_FOLDERS = 100_000
SOURCE_CHECKS = ("quick", "full")


def source_stamps(listing: Listing, scanned_ns: int) -> dict[str, Any] | None:
    """What the quick check (``stamps_match``) compares: the mtime of each folder of a folder
    source (the root and every folder above a listed file), or each archive's size and mtime.

    ``scanned_ns``: when the scan began. A folder modified after that (or within a second of
    it, for file systems of coarse times) may have changed after the scan saw it: it is stamped
    -1, which no check matches, so the open-time check scans the source in full.
    """
    if listing.annotations is not None:
        return None  # masks and a COCO file lie outside the source: the full check sees them
    if listing.members is not None:
        if not isinstance(listing.members, Members):
            return None  # a cache's own records, not a listing: no archive's stats were taken
        archives = listing.members.archives
        return {"archives": {a: list(st) for a, st in zip(archives, listing.members.stats)}}
    if not SOURCES[listing.kind].folder_stamps:
        return None  # its files lie anywhere (a list's): only the full check sees them
    folders = {""}
    for d in {p.rpartition("/")[0] for p in listing.paths}:  # each file's folder, once
        while d not in folders:
            folders.add(d)
            d = posixpath.dirname(d)
    if len(folders) > MAX_STAMPED_FOLDERS:
        return None
    stamps = {}
    for rel in sorted(folders):
        try:
            mtime = os.stat(os.path.join(listing.root, rel)).st_mtime_ns
        except OSError:
            mtime = -1
        stamps[rel] = mtime if mtime < scanned_ns - 1_000_000_000 else -1
    return {"folders": stamps}


def stamps_match(m: fmt.Manifest) -> bool:
    """The quick check: whether every folder of the source still has the mtime the build
    recorded (or every archive its size and mtime). A folder's mtime changes when a file in it
    is added, removed or renamed (so also when one is replaced by a rename, as most tools that
    write files safely do), not when a file's bytes are rewritten in place: that is the full
    check's to see (``stale_reason`` without ``quick``, and every build)."""
    stamps = m.extra.get("source_stamps")
    if not isinstance(stamps, dict):
        return False
    try:
        if "archives" in stamps:
            for path, (size, mtime) in stamps["archives"].items():
                st = os.stat(path)
                if (st.st_size, st.st_mtime_ns) != (size, mtime):
                    return False
            return True
        root = m.source["root"]
        return all(
            t >= 0 and os.stat(os.path.join(root, rel)).st_mtime_ns == t
            for rel, t in stamps["folders"].items()
        )
    except (OSError, TypeError, ValueError, KeyError, AttributeError):
        return False


def stale_reason(
    files: fmt.CacheFiles, listing: Listing | None = None, quick: bool = False
) -> str | None:
    """Why a cache no longer matches its source or decoder, or None if it still does.

    ``listing``: the source to compare with (default: scan the source the cache records).
    ``quick``: when the build's stamps of the source still match (``stamps_match``: folder
    mtimes, or archive sizes and mtimes), take the source as unchanged without scanning it.
    """
    m = files.manifest
    reasons = []
    if not decoder_accepted(m.fingerprints.get("decoder"), m.extra.get("trusted_decoder")):
        reasons.append(
            f"it was decoded by {_versions(m.decoder)}, this machine decodes with "
            f"{_versions(None)} (`mmcache build --trust-decoder` keeps it as it is)"
        )
    if listing is None and not (quick and stamps_match(m)):
        source = recorded_source(m)
        if source and source_exists(source):
            try:
                listing = rescan(m, bounded=True)
            except Exception as e:  # a source that now fails to scan has changed, in a way
                reasons.append(f"the source cannot be scanned ({e})")
    if listing is not None:
        if listing.source_json() != m.source:
            reasons.append(f"it was made from {recorded_source(m)}, not {source_of(listing)}")
        elif listing.fingerprint() != m.fingerprints.get("listing"):
            reasons.append("the source changed: " + _diff_summary(files, listing))
        elif _annotations_fingerprint(listing) != m.fingerprints.get("annotations"):
            reasons.append("its masks or COCO annotations changed")
    return "; ".join(reasons) or None


def _annotations_fingerprint(listing: Listing) -> str | None:
    a = listing.annotations
    return None if a is None else a.fingerprints().get("annotations")


def rebuild_advice(m: fmt.Manifest) -> str:
    """What to run to bring cache ``m`` up to date, with the options it was made with."""
    flags = Options.from_json(m.options).flags()  # (read_manifest checked them)
    how = "made" if m.mode == "lazy" else "built"
    paired = "".join(f" --{k} {m.source[k]}" for k in ("masks", "coco") if m.source.get(k))
    command = f"mmcache build {recorded_source(m)} {m.path}{paired}" + (
        f" {flags}" if flags else ""
    )
    return f"it was {how} with {flags or 'the default options'}; `{command}` updates it"


def recorded_source(m: fmt.Manifest) -> str:
    """The folder or list file a cache was made from: its list file where its kind records
    one (``Source.path_keys``), else its root."""
    return str(m.source["list_file"] if _given_as_list(m.source["kind"]) else m.source["root"])


def source_of(listing: Listing) -> str:
    """The folder or list file ``listing`` comes from, as a manifest records it."""
    return str(listing.list_file if _given_as_list(listing.kind) else listing.root)


def _given_as_list(kind: str) -> bool:
    """Whether a source of ``kind`` is given as a list file (asked of the kind, by its name)."""
    return "list_file" in SOURCES[kind].path_keys


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
