"""WebDataset shards as a source: an image member and a label member per key, read in place."""

from __future__ import annotations

import json
import os
import posixpath
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SourceError
from . import registry
from .archive import Row, Table, found, is_image, refuse_compressed, tar_members
from .base import ImageReader
from .listing import IMAGE_EXTENSIONS, Listing
from .recorded import RecordedMembers
from .tar_headers import tar_holds

if TYPE_CHECKING:
    from ..format import CacheFiles

BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
# The most bytes of a shard's .cls or .json label member read (a label is a few bytes).
MAX_LABEL = 1 << 20


class WebDataset:
    """The ``webdataset`` kind: a brace pattern of shards, a folder of ``.tar`` shards, or any
    source given a ``label_key`` that is not a file (a single tar of shards is the tar kind's to
    read: which it is shows only in its members)."""

    kind = "webdataset"
    path_keys: tuple[str, ...] = ("root",)
    reads_files = False
    images: ImageReader | None = None  # OpenCV decodes its samples
    folder_stamps = False

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        path = Path(os.fspath(source)).expanduser()
        if BRACE.search(path.name) and not path.exists():
            return True
        if label_key is not None and (path.is_dir() or not path.exists()):
            return True
        return path.is_dir() and shards_in(path, IMAGE_EXTENSIONS) is not None

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        path = Path(os.fspath(source)).expanduser()
        if BRACE.search(path.name) and not path.exists():
            pattern = path.parent.resolve() / path.name
            shards = expand(pattern)
            missing = [s for s in shards if not s.is_file()]
            if not shards or missing:
                raise SourceError(
                    f"{pattern}: the pattern names {len(shards)} shards, {len(missing)} of them "
                    f"missing ({', '.join(s.name for s in missing[:3])})"
                )
            extra = {"pattern": str(pattern)}
            return scan_shards(pattern, shards, IMAGE_EXTENSIONS, label_key, extra)
        if not path.exists():
            raise SourceError(f"{path}: source not found")
        root = path.resolve()
        if not root.is_dir():  # a tar of shards (a cache's recorded root)
            return registry.detect(root, label_key).scan(root, label_key, max_entries)
        found_shards = shards_in(root, IMAGE_EXTENSIONS)
        if found_shards is None:
            raise SourceError(f"{root}: not a folder of .tar shards")
        return scan_shards(root, found_shards, IMAGE_EXTENSIONS, label_key, {})

    def recorded(self, files: CacheFiles) -> RecordedMembers:
        return RecordedMembers(files, tar_holds)

    def exists(self, root: str) -> bool:
        """Whether the source is there: a path, or a brace pattern's first shard."""
        if Path(root).exists():
            return True
        shards = expand(Path(root))
        return bool(shards) and shards[0].exists()


WEBDATASET = WebDataset()


def shards_in(folder: Path, images: tuple[str, ...]) -> list[Path] | None:
    """The ``.tar`` shards of a folder that holds only shards (and hidden or other non-image
    files), sorted by name; None if it holds subfolders or images, or no shard."""
    try:
        entries = [e for e in os.scandir(folder) if not e.name.startswith(".")]
    except OSError:
        return None
    if any(e.is_dir() or is_image(e.name, images) for e in entries):
        return None
    shards = sorted(folder / e.name for e in entries if e.name.lower().endswith(".tar"))
    return shards or None


def expand(pattern: Path) -> list[Path]:
    """``train-{0000..0002}.tar`` -> the three shard paths, in order (one brace range)."""
    m = BRACE.search(pattern.name)
    if m is None:
        return []
    lo, hi = m[1], m[2]
    width = len(lo) if len(lo) == len(hi) or lo.startswith("0") else 0
    names = [
        pattern.name[: m.start()] + str(k).zfill(width) + pattern.name[m.end() :]
        for k in range(int(lo), int(hi) + 1)
    ]
    return [pattern.parent / n for n in names]


def scan_shards(
    root: Path,
    shards: list[Path],
    images: tuple[str, ...],
    label_key: str | None,
    source: dict[str, str],
) -> Listing:
    """Samples of WebDataset shards: an image member and a label member per key."""
    table = Table()
    samples: list[tuple[str, str]] = []  # (path, raw label)
    for shard in shards:
        refuse_compressed(shard)
        a = table.add_archive(shard)
        groups: dict[str, dict[str, tuple[str, Row]]] = {}
        order: list[str] = []
        for name, row, is_dir in tar_members(shard, a, 0, table.stats[a][0], table, shard.name):
            base = posixpath.basename(name)
            if is_dir or base.startswith(".") or "." not in base:
                continue
            key = posixpath.join(posixpath.dirname(name), base.split(".", 1)[0])
            ext = base.split(".", 1)[1].lower()
            if key not in groups:
                groups[key] = {}
                order.append(key)
            if ext in groups[key]:
                table.warn(f"{shard.name}/{name}", f"appears more than once in {shard.name}: "
                           "the last copy is used, as extraction keeps it")  # fmt: skip
            groups[key][ext] = (name, row)
        with open(shard, "rb") as f:
            for key in order:
                group = groups[key]
                image = next((g for e, g in group.items() if is_image("x." + e, images)), None)
                if image is None:
                    continue
                path = f"{shard.name}/{image[0]}"
                label = sample_label(f.fileno(), group, label_key)
                if label.startswith("\0"):
                    table.warn(path, label[1:])
                    continue
                table.add(path, image[1], shard.name)
                samples.append((path, label))
    last: dict[str, str] = {}
    for p, lab in samples:  # a name twice in a shard: its last copy, where that lies
        last.pop(p, None)
        last[p] = lab
    samples = list(last.items())
    if not samples:
        raise SourceError(f"{root}: no labelled images found in the shards")
    numbers = [re.fullmatch(r"[+-]?\d+", lab) is not None for _, lab in samples]
    if all(numbers):
        labels = [int(lab) for _, lab in samples]
        if min(labels) < 0:
            raise SourceError(f"{root}: a class number is never negative")
        classes = [str(i) for i in range(max(labels) + 1)]
    elif any(numbers):
        raise SourceError(f"{root}: the labels mix class numbers and class names")
    else:
        classes = sorted({lab for _, lab in samples})
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[lab] for _, lab in samples]
    names = [p for p, _ in samples]
    extra = dict(source)
    if label_key is not None:
        extra["label_key"] = label_key
    return found(root, "webdataset", classes, names, labels, table, extra)


def sample_label(fd: int, group: dict[str, tuple[str, Row]], label_key: str | None) -> str:
    """A sample's label as text, or ``"\\0why not"``."""
    ext = "json" if label_key is not None else "cls"
    member = group.get(ext)
    if member is None:
        return f"\0no .{ext} member beside it: left out"
    row = member[1]
    if int(row[2]) > MAX_LABEL:
        return f"\0its .{ext} member holds {int(row[2]):,} bytes, not a label: left out"
    raw = os.pread(fd, int(row[2]), int(row[1]))
    try:
        text = raw.decode("utf-8").strip()
        if label_key is None:
            return text
        value = json.loads(text)[label_key]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError):
        what = f"no field {label_key!r} in its .json" if label_key else "its .cls is not text"
        return f"\0{what}: left out"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"\0its .json field {label_key!r} is {value!r}, not a class number or name"
    return str(value)

