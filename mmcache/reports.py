"""What the library's calls return: the report of each operation, and the progress callback.

Plain dataclasses, free of the code that fills them (this module imports nothing of mmcache), so
that any part may name them without importing the parts that make them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BadRecord",
    "BuildReport",
    "CacheInfo",
    "CopyReport",
    "Memory",
    "ProgressFn",
    "PullReport",
    "PushReport",
    "RemoteInfo",
    "RepairReport",
    "VerifyReport",
    "WarmReport",
]

# Called as progress(done, total) while a long step runs (records, files or bytes).
ProgressFn = Callable[[int, int], None]


@dataclass
class BuildReport:
    """What a build did. ``up_to_date`` means it found the cache current and did nothing.

    ``decoded``: files decoded into records now (files that failed count in ``skipped``);
    ``reused``: records carried over from the previous cache without decoding; ``dropped``:
    records of the previous cache whose pixels were discarded, of which ``removed`` because
    their file left the source; ``changed`` counts the decoded files that had a record there
    (modified since, or the cache replaced with other options). ``images`` counts the
    records with pixels; a lazy cache's records still to be filled count in ``pending``.
    ``seconds`` is the whole build, ``decode_seconds`` the decoding alone. ``ignored``: folders
    inside the source left out because they hold a cache (see ``scan_source``).

    ``appended``: the new records went at the end of the current data file, the kept ones
    staying where they were (a refresh), rather than into a new data file (a first build, other
    options, a compaction). ``written_bytes``: what the build wrote, pixels (decoded or copied)
    and the index, state and paths; ``garbage_bytes``: bytes of the data file that no record
    covers now (padding belongs to its record, so a first build or a compaction has none;
    ``bytes`` is the file's size); ``dropped_garbage``: what a compaction took out.
    ``compaction_deferred``: why a refresh appended although its garbage passed ``compact_at``
    (a compact data file would not fit on the disk), else empty.

    ``skipped`` and ``warnings``: ``{"path", "reason"}`` for each file left out (undecodable,
    ``"truncated"``, over the pixel limit, ...) and each file kept with a warning: its
    decoder complained, or it is another listed file under another label (a link from one
    class folder into another, see ``scan_source``).

    ``coco_missing``: the file names of the COCO file's images that the source lacks;
    ``coco_orphans``: how many of its annotations name an image id it does not list, and
    ``coco_unknown_ids`` those ids. Both are left out of the cache, as an image of the source
    absent from the JSON has no boxes.
    """

    cache: Path
    images: int
    classes: int
    bytes: int
    seconds: float
    decoded: int = 0
    reused: int = 0
    dropped: int = 0
    removed: int = 0
    changed: int = 0
    up_to_date: bool = False
    trusted_decoder: bool = False
    pending: int = 0
    decode_seconds: float = 0.0
    appended: bool = False
    written_bytes: int = 0
    garbage_bytes: int = 0
    dropped_garbage: int = 0
    compaction_deferred: str = ""
    skipped: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    other_files: dict[str, int] = field(default_factory=dict)
    coco_missing: list[str] = field(default_factory=list)
    coco_unknown_ids: list[int] = field(default_factory=list)
    coco_orphans: int = 0

    @property
    def images_per_second(self) -> float:
        """Decoding rate: files decoded per second of decoding."""
        return self.decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class CopyReport:
    """What a copy did: ``bytes`` is the caches' size, ``copied`` what was read and written."""

    source: Path
    dest: Path
    images: int
    bytes: int
    copied: int
    verified: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.copied / self.seconds if self.seconds > 0 else 0.0


@dataclass
class BadRecord:
    """A record that failed verification: its index, its source path, and what is wrong."""

    index: int
    path: str
    what: str


@dataclass
class VerifyReport:
    """What ``verify_cache`` checked and found. ``ok`` is true when nothing is bad."""

    cache: Path
    records: int  # records in the cache
    checked: int  # FILLED records whose checksum was checked
    bytes: int  # pixel bytes read
    seconds: float
    empty: int = 0  # lazy records not yet filled (nothing to check)
    source_compared: int = 0  # records decoded again from the source and compared
    source_unavailable: int = 0  # source files missing or changed since the build: not compared
    bad: list[BadRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad


@dataclass
class RepairReport:
    """What ``repair_cache`` did. ``found``: what verification found before repairing (under
    the cache's writer lock, so nothing changed between the two). ``repaired``: the bad records
    decoded again from ``source``; ``unrepaired``: those left as they were, each with why
    (``what``: its source file vanished, changed since the build, or no longer decodes).
    ``generation``: the generation published, or None when nothing was."""

    cache: Path
    source: Path
    found: VerifyReport
    repaired: list[BadRecord] = field(default_factory=list)
    unrepaired: list[BadRecord] = field(default_factory=list)
    generation: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the cache is sound now: nothing was bad, or every bad record was repaired."""
        return not self.unrepaired


@dataclass
class Memory:
    """RAM as the page cache sees it: the host's, or a memory-limited control group's."""

    total: int
    available: int
    cgroup_limited: bool = False

    @property
    def used(self) -> int:
        return self.total - self.available


@dataclass
class CacheInfo:
    """What ``cache_info`` reports about one cache (``to_json`` for a JSON object).

    Attributes:
        cache: the cache folder.
        images: records in the cache; ``filled``: how many hold pixels (all but lazy ones).
        classes: class names, index = label.
        min_size / max_size: smallest and largest (height, width, channels) stored, by pixel
            count; equal when every image has one fixed size (``fixed_size``).
        data_bytes: the data file's size; ``apparent_bytes`` / ``disk_bytes``: all the files of
            this generation, by size and by blocks allocated (less when the data file is sparse).
        live_bytes / garbage_bytes: the data file's bytes the records cover (pixels and
            alignment padding), and the rest (records that refreshes replaced or removed).
        format_version, mode, generation, options: from the manifest; skipped: the files the
            build left out (the manifest's list) and the records lazy fills found bad;
            ``warnings``: files kept although their decoder complained (a JPEG kept truncated
            with ``keep_truncated``, say), and files listed under two classes.
        stale: ``None`` when the source is still matched (or absent), else the reason.
        source: the folder or list file the cache was made from; ``source_found``: whether it
            is there (a copied cache's may not be: then it is not compared).
        resident_bytes: bytes of the data file in the page cache now (``None``: unknown here).
        ram_total / ram_available: the machine's RAM, or its control group's limit and headroom
            when that is smaller (``cgroup_limited``).
        origin: the URL a node-local copy fetches its records from (None: no copy).
    """

    cache: str
    images: int
    filled: int
    classes: list[str]
    min_size: tuple[int, int, int] | None
    max_size: tuple[int, int, int] | None
    data_bytes: int
    live_bytes: int
    garbage_bytes: int
    apparent_bytes: int
    disk_bytes: int
    format_version: tuple[int, int]
    mode: str
    generation: str
    options: dict[str, Any]
    skipped: list[dict[str, Any]]
    warnings: list[dict[str, Any]]
    stale: str | None
    source: str
    source_found: bool
    resident_bytes: int | None
    ram_total: int
    ram_available: int
    cgroup_limited: bool = False
    # What records carry besides pixels: "mask" (its dtype), and each field's description.
    annotations: dict[str, Any] = field(default_factory=dict)
    # Where they came from: "masks" (the folder), "coco" (the file), as recorded.
    source_paired: dict[str, str] = field(default_factory=dict)
    origin: str | None = None

    @property
    def fixed_size(self) -> bool:
        return self.min_size is not None and self.min_size == self.max_size

    @property
    def resident_share(self) -> float | None:
        """Resident bytes / data bytes (1.0 for an empty data file), or None when unknown."""
        if self.resident_bytes is None:
            return None
        return self.resident_bytes / self.data_bytes if self.data_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["fixed_size"] = self.fixed_size
        d["resident_share"] = self.resident_share
        return d


@dataclass
class WarmReport:
    """What ``warm_cache`` did. ``stopped_by_budget``: it stopped before the end of the file."""

    cache: str
    data_bytes: int
    resident_before: int
    resident_after: int
    read_bytes: int
    seconds: float
    budget_bytes: int
    stopped_by_budget: bool
    ram: Memory = field(repr=False, default_factory=lambda: Memory(0, 0))

    @property
    def resident_share(self) -> float:
        return self.resident_after / self.data_bytes if self.data_bytes else 1.0


@dataclass
class PushReport:
    """What a push did: ``bytes`` is the cache's size, ``uploaded`` what was sent (objects the
    store already held with the same content are not sent again)."""

    cache: Path
    url: str
    images: int
    bytes: int
    uploaded: int
    objects_uploaded: int
    objects_kept: int
    objects_deleted: int
    seconds: float


@dataclass
class PullReport:
    """What a pull did: ``fetched`` bytes came from the store; ``present`` records were in the
    local folder already (a resumed or incremental pull), each checked against its CRC-32."""

    url: str
    dest: Path
    images: int
    bytes: int
    fetched: int
    fetched_records: int
    present: int
    seconds: float
    up_to_date: bool = False

    @property
    def bytes_per_second(self) -> float:
        return self.fetched / self.seconds if self.seconds > 0 else 0.0


@dataclass
class RemoteInfo:
    """A cache published in an object store, as ``remote.json`` describes it (nothing fetched
    but that object)."""

    url: str
    format_version: tuple[int, int]
    generation: str
    mode: str
    images: int
    classes: list[str]
    skipped: int
    bytes: int
    chunks: int
    chunk_bytes: int
    options: dict[str, Any]
    source: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
