"""Scanning a source: which image files a folder or list names, their labels, sizes and mtimes.

Three kinds of source, decided by what the path is:

- an ImageFolder-style folder: each first-level subfolder is a class, images are found
  recursively below it; classes, labels and sample order are those of torchvision's
  ``ImageFolder`` (classes sorted by name; ``sorted(os.walk(...))`` order, files sorted);
- a folder with images and no class subfolders: one class named after the folder, label 0;
- a text or CSV file of ``path,label`` lines (paths relative to the file's folder, or absolute;
  blank lines and ``#`` comments ignored). Labels are class numbers when every one is an
  integer, class names when none is; a list that mixes them (``1O`` typed for ``10``) is an
  error naming the lines, never a silent relabelling. A first line ``path,label`` is a header;
  a header ``path,class`` makes every label a class name, digits too.

As torchvision's ``ImageFolder``, a class folder without images is an error. Unlike it, hidden
files and folders (name starting with ``.``) are skipped, a symlinked folder is followed only the
first time its target is reached, so a link loop ends, and a folder that holds an mmcache cache
(a cache built inside its own source) is neither a class nor searched for images: the listing
names it in ``ignored``.
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import stat as stat_mod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _archives
from . import format as fmt
from .annotations import Annotations
from .errors import SourceError
from .probe import probe_size, sniff_format

__all__ = ["IMAGE_EXTENSIONS", "Listing", "ListingDiff", "diff_listings", "scan_source"]

# torchvision's IMG_EXTENSIONS, and .pbm, which OpenCV reads with .ppm and .pgm (Netpbm).
IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".png", ".ppm", ".pgm", ".pbm", ".bmp", ".tif", ".tiff", ".webp",
)  # fmt: skip


def is_image_file(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


@dataclass
class Listing:
    """What a source holds: one entry per image, in dataset order."""

    root: Path
    kind: str
    list_file: Path | None
    classes: list[str]
    paths: list[str]
    labels: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray
    # Folders below the root left out because they hold an mmcache cache, relative to it.
    ignored: list[str] = field(default_factory=list)
    # Files of a folder source left out as not images: their count by extension ("" for none).
    other_files: dict[str, int] = field(default_factory=dict)
    # ``{"path", "reason"}`` for each file that is another listed file under another label
    # (a link from one class folder into another): kept, as ImageFolder keeps it, but said.
    warnings: list[dict[str, str]] = field(default_factory=list)
    # What the images are paired with (masks, boxes, arrays): ``annotations.annotate``.
    annotations: Annotations | None = None
    # An archive source's members: where each path's bytes lie, as listed (``Members``) or,
    # for a cache's records, found again on first use (``RecordedMembers``); None for files.
    members: _archives.Members | _archives.RecordedMembers | None = None
    # More keys of the manifest's ``source`` (an archive's shard pattern, its label key).
    source_extra: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def abspath(self, i: int) -> str:
        """Where entry ``i`` is read from: its file, or an archive member's address."""
        if self.members is not None:
            return str(self.members.ref(i))
        return os.path.join(self.root, self.paths[i])

    def probe(self, i: int, exif: bool = True) -> tuple[int, int] | None:
        """``probe_size`` of entry ``i`` (``exif``: as ``probe_size``'s).

        Raises:
            OSError: its file cannot be opened or read.
        """
        if self.members is not None:
            return self.members.probe(i, int(self.sizes[i]), exif)
        return probe_size(self.abspath(i), exif)

    def fingerprint(self) -> str:
        """SHA-256 over classes and every (path, label, size, mtime): any change changes it."""
        return listing_fingerprint(self.classes, self.paths, self.labels, self.sizes, self.mtimes)

    def source_json(self) -> dict:
        d = {"root": str(self.root), "kind": self.kind}
        if self.list_file is not None:
            d["list_file"] = str(self.list_file)
        if self.annotations is not None:
            d.update(self.annotations.source_json())
        return {**d, **self.source_extra}


def listing_fingerprint(
    classes: list[str],
    paths: list[str],
    labels: np.ndarray,
    sizes: np.ndarray,
    mtimes: np.ndarray,
) -> str:
    h = hashlib.sha256()
    h.update("\0".join(classes).encode("utf-8", "surrogateescape") + b"\n")
    h.update("\0".join(paths).encode("utf-8", "surrogateescape"))
    for arr in (labels, sizes, mtimes):
        h.update(np.ascontiguousarray(arr, dtype="<i8").tobytes())
    return h.hexdigest()


def scan_source(source: str | os.PathLike, *, label_key: str | None = None) -> Listing:
    """List the images of ``source`` (a folder, a ``path,label`` file or an archive), with
    their stats.

    Archives (a ``.tar``, a tar of tars, WebDataset shards, a ``.zip``) are listed in place,
    as ``mmcache._archives`` describes; ``label_key`` names the ``.json`` field that holds a
    WebDataset sample's label (default: its ``.cls`` member).

    Raises:
        SourceError: the source is missing, unreadable, holds no image files, has a class
            folder without images, or is a list with bad lines or mixed labels; an archive is
            compressed, truncated or damaged.
    """
    return scan_within(source, label_key, None)


def scan_within(
    source: str | os.PathLike, label_key: str | None, max_entries: int | None
) -> Listing:
    """``scan_source``, giving up (a ``SourceError``) once a folder source's walk has met more
    than ``max_entries`` folder entries: a manifest that names ``/`` as the source of a cache
    of a few files must not make a staleness check walk the whole file system."""
    if label_key is not None or _archives.is_archive_source(source, IMAGE_EXTENSIONS):
        return _archive_listing(_archives.scan_archive(source, IMAGE_EXTENSIONS, label_key))
    src = Path(source).expanduser()
    if not src.exists():
        raise SourceError(f"{src}: source not found (expected an image folder or a list file)")
    if src.is_file():
        return _scan_list(src.resolve())
    if not src.is_dir():
        raise SourceError(f"{src}: not a folder or a list file")
    root = src.resolve()
    try:
        entries = list(os.scandir(root))
        subdirs = sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))
    except OSError as e:
        raise SourceError(f"{root}: cannot read the folder ({e.strerror})") from None
    ignored: list[str] = []
    others: dict[str, int] = {}
    walk = _Walk(root, ignored, max_entries)
    class_dirs = [d for d in subdirs if not _holds_cache(root / d, d, ignored)]
    if class_dirs:
        classes = class_dirs
        paths, labels, empty = [], [], []
        for label, name in enumerate(classes):
            found = _walk_images(walk, name, others)
            if not found:
                empty.append(name)
            paths += found
            labels += [label] * len(found)
        if empty and paths:
            names = ", ".join(repr(n) for n in empty[:5]) + (" ..." if len(empty) > 5 else "")
            raise SourceError(
                f"{root}: {len(empty)} class folder{'s' if len(empty) > 1 else ''} without "
                f"images ({names}), which would be classes no sample has (torchvision's "
                "ImageFolder refuses them too): add images, remove the folders, or hide them "
                "with a leading '.'"
            )
    else:
        classes = [root.name or "images"]
        paths = _walk_images(walk, "", others)
        labels = [0] * len(paths)
    if not paths:
        what = "its class folders" if class_dirs else "it"
        raise SourceError(
            f"{root}: no images found in {what} (looked for {', '.join(IMAGE_EXTENSIONS)})"
        )
    listing = _with_stats(root, "folder", None, classes, paths, labels)
    listing.ignored = ignored
    listing.other_files = dict(sorted(others.items(), key=lambda kv: (-kv[1], kv[0])))
    return listing


def _archive_listing(found: _archives.Found) -> Listing:
    return Listing(
        root=found.root,
        kind=found.kind,
        list_file=None,
        classes=found.classes,
        paths=found.paths,
        labels=np.asarray(found.labels, np.int32),
        sizes=np.asarray(found.sizes, np.uint64),
        mtimes=np.asarray(found.mtimes, np.int64),
        warnings=found.warnings,
        members=found.members,
        source_extra=found.source,
    )


def source_exists(source: str) -> bool:
    """Whether the source a cache records is there (a path, or a pattern of shards)."""
    return _archives.source_exists(source)


def _holds_cache(folder: Path, rel: str, ignored: list[str]) -> bool:
    """Whether ``folder`` holds an mmcache cache; if so it is noted in ``ignored``."""
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    if looks_like_cache(names):
        ignored.append(rel)
        return True
    return False


@dataclass
class _Walk:
    """The walk of a folder source's class folders, counting the entries it meets."""

    root: Path
    ignored: list[str]  # folders left out as caches
    max_entries: int | None  # (see ``scan_within``)
    entries: int = 0


def _walk_images(walk: _Walk, top: str, others: dict[str, int]) -> list[str]:
    """Image paths below ``root/top``, relative to root, in torchvision's order; the files
    that are not images counted in ``others`` by extension."""
    root, ignored = walk.root, walk.ignored
    found: list[tuple[str, list[str]]] = []
    seen: set[tuple[int, int]] = set()
    stack = [top]
    while stack:
        rel_dir = stack.pop()
        full = os.path.join(root, rel_dir)
        try:
            st = os.stat(full)
            entries = list(os.scandir(full))
        except OSError:
            continue
        walk.entries += len(entries)
        if walk.max_entries is not None and walk.entries > walk.max_entries:
            raise SourceError(
                f"{root}: holds more than {walk.max_entries:,} files and folders, far more "
                "than the cache records: not walked further (is this the cache's source?)"
            )
        key = (st.st_dev, st.st_ino)
        if key in seen:  # a symlink back to a folder already walked: stop the loop here
            continue
        seen.add(key)
        if rel_dir and looks_like_cache([e.name for e in entries]):
            ignored.append(rel_dir)
            continue
        files = []
        for e in entries:
            if e.name.startswith("."):
                continue
            child = f"{rel_dir}/{e.name}" if rel_dir else e.name
            try:
                if e.is_dir():  # follows symlinks, as os.walk(followlinks=True)
                    stack.append(child)
                elif is_image_file(e.name):
                    files.append(e.name)
                else:
                    ext = os.path.splitext(e.name)[1].lower()
                    others[ext] = others.get(ext, 0) + 1
            except OSError:
                continue
        found.append((rel_dir, sorted(files)))
    # torchvision sorts the (dirpath, dirnames, filenames) tuples of os.walk by dirpath.
    found.sort(key=lambda t: os.path.join(str(root), t[0]))
    return [f"{d}/{f}" if d else f for d, files in found for f in files]


_INTEGER = re.compile(r"[+-]?\d+")


def _scan_list(list_file: Path) -> Listing:
    rows: list[tuple[int, str, str]] = []  # (line number, path, label)
    names_header = False
    _refuse_image(list_file)
    try:
        with open(list_file, newline="", encoding="utf-8") as f:
            for lineno, row in enumerate(csv.reader(f), 1):
                if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                    continue
                if len(row) == 1:  # "path label" with whitespace instead of a comma
                    row = row[0].rsplit(None, 1)
                if len(row) != 2:
                    raise SourceError(
                        f"{list_file}:{lineno}: expected 'path,label', found {','.join(row)!r}"
                    )
                header = [c.strip().lower() for c in row]
                if not rows and header in (["path", "label"], ["path", "class"]):
                    names_header = header[1] == "class"
                    continue
                rows.append((lineno, row[0].strip(), row[1].strip()))
    except SourceError:
        raise
    except UnicodeDecodeError:
        raise SourceError(f"{list_file}: not a UTF-8 text list of 'path,label' lines") from None
    except OSError as e:
        raise SourceError(f"{list_file}: cannot read the list ({e.strerror})") from None
    if not rows:
        raise SourceError(f"{list_file}: the list names no images")
    base = list_file.parent
    files = [os.path.normpath(os.path.join(base, p)) for _, p, _ in rows]
    raw_labels = [lab for _, _, lab in rows]
    numbers = [_INTEGER.fullmatch(lab) is not None for lab in raw_labels]
    if not names_header and all(numbers):
        labels = [int(lab) for lab in raw_labels]
        negative = [(n, lab) for (n, _, lab), v in zip(rows, labels) if v < 0]
        if negative:
            raise SourceError(f"{list_file}: {_lines(negative)}: a class number is never negative")
        classes = [str(i) for i in range(max(labels) + 1)]
    else:
        if not names_header and any(numbers):
            odd = [(n, lab) for (n, _, lab), num in zip(rows, numbers) if not num]
            raise SourceError(
                f"{list_file}: the labels are class numbers but for {_lines(odd)}: correct "
                "those lines, or, if every label is a class name, make the first line "
                "'path,class'"
            )
        classes = sorted(set(raw_labels))
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[lab] for lab in raw_labels]
    root = Path(os.path.commonpath([os.path.dirname(p) for p in files]))
    paths = [Path(p).relative_to(root).as_posix() for p in files]
    return _with_stats(root, "list", list_file, classes, paths, labels)


def _lines(found: list[tuple[int, str]]) -> str:
    """``line 12 ('1O'), line 40 ('cat')``: the first few of ``(line number, label)``."""
    shown = ", ".join(f"line {n} ({lab!r})" for n, lab in found[:5])
    return shown + (f" and {len(found) - 5} more lines" if len(found) > 5 else "")


def _refuse_image(path: Path) -> None:
    """A single image given as the source is a mistake to name, not a list to parse."""
    try:
        with open(path, "rb") as f:
            image_format = sniff_format(f.read(16))
    except OSError:
        return  # reading the list says why
    if image_format is not None or is_image_file(path.name):
        raise SourceError(
            f"{path}: is an image{f' ({image_format})' if image_format else ''}, not a folder "
            "or a list: give the folder that holds the images"
        )


def _with_stats(
    root: Path,
    kind: str,
    list_file: Path | None,
    classes: list[str],
    paths: list[str],
    labels: list[int],
) -> Listing:
    sizes = np.zeros(len(paths), np.uint64)
    mtimes = np.zeros(len(paths), np.int64)
    files = np.zeros((len(paths), 2), np.uint64)  # (device, inode): which files are one
    for i, rel in enumerate(paths):
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError as e:
            if kind == "list":
                broken = " (a broken symbolic link)" if os.path.islink(root / rel) else ""
                raise SourceError(
                    f"{root / rel}: listed but unreadable ({e.strerror}){broken}"
                ) from None
            # A broken link, or vanished since the walk: size 0, and decoding says which.
            continue
        if kind == "list" and not stat_mod.S_ISREG(st.st_mode):
            raise SourceError(f"{root / rel}: listed but not a file")
        sizes[i] = st.st_size
        mtimes[i] = st.st_mtime_ns
        files[i] = st.st_dev, st.st_ino
    label_array = np.asarray(labels, np.int32)
    return Listing(
        root=root,
        kind=kind,
        list_file=list_file,
        classes=classes,
        paths=paths,
        labels=label_array,
        sizes=sizes,
        mtimes=mtimes,
        warnings=_under_two_labels(root, files, paths, label_array, classes),
    )


def _under_two_labels(
    root: Path, files: np.ndarray, paths: list[str], labels: np.ndarray, classes: list[str]
) -> list[dict[str, str]]:
    """A warning for each listed file that an earlier listed path reaches under another label:
    one image that would be trained as two classes (a link from one class folder to another)."""
    listed = np.flatnonzero(files[:, 1] != 0)  # 0: not stat'ed (vanished, a broken link)
    # Sorted by (device, inode), then listing order: the paths of one file are adjacent.
    order = listed[np.lexsort((listed, files[listed, 1], files[listed, 0]))]
    same = (files[order[1:]] == files[order[:-1]]).all(axis=1)
    found: list[tuple[int, int]] = []
    first: dict[int, int] = {}
    for k in np.flatnonzero(same).tolist():
        a, b = int(order[k]), int(order[k + 1])
        a = first.setdefault(a, a)  # compare with the file's first listed path
        first[b] = a
        if labels[a] != labels[b]:
            found.append((a, b))
    return [
        {
            "path": paths[b],
            "reason": f"{_how_one(root, paths[a], paths[b])}, so one image is listed under two "
            f"classes, {classes[labels[a]]!r} and {classes[labels[b]]!r}; both are kept, as "
            "torchvision's ImageFolder keeps them",
        }
        for a, b in sorted(found, key=lambda pair: pair[1])
    ]


def _how_one(root: Path, first: str, second: str) -> str:
    """How listed path ``second`` came to be the file ``first`` is: the same path listed
    twice (in a list file), a symbolic link on the way, or a hard link."""
    a, b = (os.path.join(root, p) for p in (first, second))
    if os.path.normpath(a) == os.path.normpath(b):
        return f"listed twice (as {first})" if first != second else "listed twice"
    link = any(os.path.realpath(p) != os.path.abspath(p) for p in (a, b))
    return f"the same file as {first} ({'a link' if link else 'a hard link'})"


@dataclass
class ListingDiff:
    """How a source changed between two listings, by relative path."""

    added: list[str]
    removed: list[str]
    modified: list[str]
    relabeled: list[str]
    classes_changed: bool

    @property
    def changed(self) -> bool:
        return bool(
            self.added or self.removed or self.modified or self.relabeled or self.classes_changed
        )

    def summary(self, limit: int = 3) -> str:
        parts = []
        for name, items in (
            ("added", self.added),
            ("removed", self.removed),
            ("modified", self.modified),
            ("relabeled", self.relabeled),
        ):
            if items:
                shown = ", ".join(items[:limit]) + (", ..." if len(items) > limit else "")
                parts.append(f"{len(items)} {name} ({shown})")
        if self.classes_changed:
            parts.append("classes changed")
        return "; ".join(parts) if parts else "no changes"


def diff_listings(
    old_classes: list[str],
    old_paths: list[str],
    old_labels: np.ndarray,
    old_sizes: np.ndarray,
    old_mtimes: np.ndarray,
    new: Listing,
) -> ListingDiff:
    old = {
        p: (old_classes[int(lab)], int(s), int(m))
        for p, lab, s, m in zip(old_paths, old_labels, old_sizes, old_mtimes)
    }
    added, modified, relabeled = [], [], []
    new_paths = set()
    for i, p in enumerate(new.paths):
        new_paths.add(p)
        prev = old.get(p)
        if prev is None:
            added.append(p)
            continue
        if (prev[1], prev[2]) != (int(new.sizes[i]), int(new.mtimes[i])):
            modified.append(p)
        if prev[0] != new.classes[int(new.labels[i])]:
            relabeled.append(p)
    removed = [p for p in old_paths if p not in new_paths]
    return ListingDiff(added, removed, modified, relabeled, list(old_classes) != new.classes)


def looks_like_cache(names: list[str]) -> bool:
    """Whether a folder with these entries holds an mmcache cache, finished or being built."""
    entries = set(names)
    # (The suffix test first: a class folder of 1,300 images is looked at twice per scan.)
    bins = [n for n in entries if n.endswith(".bin")]
    return any(fmt.is_generation_file_name(n) for n in bins) or (
        fmt.MANIFEST_NAME in entries and fmt.LOCK_NAME in entries
    )
