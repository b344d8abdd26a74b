"""Scanning a source: which image files a folder or list names, their labels, sizes and mtimes.

Three kinds of source, decided by what the path is:

- an ImageFolder-style folder: each first-level subfolder is a class, images are found
  recursively below it; classes, labels and sample order are those of torchvision's
  ``ImageFolder`` (classes sorted by name; ``sorted(os.walk(...))`` order, files sorted);
- a folder with images and no class subfolders: one class named after the folder, label 0;
- a text or CSV file of ``path,label`` lines (paths relative to the file's folder, or absolute;
  labels all integers or all class names; blank lines and ``#`` comments ignored, and a first
  line ``path,label`` is a header).

Unlike torchvision, hidden files and folders (name starting with ``.``) are skipped, and a
symlinked folder is followed only the first time its target is reached, so a link loop ends.
"""

from __future__ import annotations

import csv
import hashlib
import os
import stat as stat_mod
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SourceError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


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

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def abspath(self, i: int) -> str:
        return os.path.join(self.root, self.paths[i])

    def fingerprint(self) -> str:
        """SHA-256 over classes and every (path, label, size, mtime): any change changes it."""
        return listing_fingerprint(self.classes, self.paths, self.labels, self.sizes, self.mtimes)

    def source_json(self) -> dict:
        d = {"root": str(self.root), "kind": self.kind}
        if self.list_file is not None:
            d["list_file"] = str(self.list_file)
        return d


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


def scan_source(source: str | os.PathLike) -> Listing:
    """List the images of ``source`` (a folder or a ``path,label`` file), with their stats.

    Raises:
        SourceError: the source is missing, unreadable, or holds no image files.
    """
    src = Path(source).expanduser()
    if not src.exists():
        raise SourceError(f"{src}: source not found (expected an image folder or a list file)")
    if src.is_file():
        return _scan_list(src.resolve())
    if not src.is_dir():
        raise SourceError(f"{src}: not a folder or a list file")
    root = src.resolve()
    try:
        class_dirs = sorted(
            e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
        )
    except OSError as e:
        raise SourceError(f"{root}: cannot read the folder ({e.strerror})") from None
    if class_dirs:
        classes = class_dirs
        paths, labels = [], []
        for label, name in enumerate(classes):
            for rel in _walk_images(root, name):
                paths.append(rel)
                labels.append(label)
    else:
        classes = [root.name or "images"]
        paths = _walk_images(root, "")
        labels = [0] * len(paths)
    if not paths:
        what = "its class folders" if class_dirs else "it"
        raise SourceError(
            f"{root}: no images found in {what} (looked for {', '.join(IMAGE_EXTENSIONS)})"
        )
    return _with_stats(root, "folder", None, classes, paths, labels)


def _walk_images(root: Path, top: str) -> list[str]:
    """Image paths below ``root/top``, relative to root, in torchvision's order."""
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
        key = (st.st_dev, st.st_ino)
        if key in seen:  # a symlink back to a folder already walked: stop the loop here
            continue
        seen.add(key)
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
            except OSError:
                continue
        found.append((rel_dir, sorted(files)))
    # torchvision sorts the (dirpath, dirnames, filenames) tuples of os.walk by dirpath.
    found.sort(key=lambda t: os.path.join(str(root), t[0]))
    return [f"{d}/{f}" if d else f for d, files in found for f in files]


def _scan_list(list_file: Path) -> Listing:
    rows: list[tuple[str, str]] = []
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
                if not rows and [c.strip().lower() for c in row] == ["path", "label"]:
                    continue
                rows.append((row[0].strip(), row[1].strip()))
    except SourceError:
        raise
    except UnicodeDecodeError:
        raise SourceError(f"{list_file}: not a UTF-8 text list of 'path,label' lines") from None
    except OSError as e:
        raise SourceError(f"{list_file}: cannot read the list ({e.strerror})") from None
    if not rows:
        raise SourceError(f"{list_file}: the list names no images")
    base = list_file.parent
    files = [os.path.normpath(os.path.join(base, p)) for p, _ in rows]
    raw_labels = [lab for _, lab in rows]
    if all(lab.isdigit() for lab in raw_labels):
        labels = [int(lab) for lab in raw_labels]
        classes = [str(i) for i in range(max(labels) + 1)]
    else:
        classes = sorted(set(raw_labels))
        index = {c: i for i, c in enumerate(classes)}
        labels = [index[lab] for lab in raw_labels]
    root = Path(os.path.commonpath([os.path.dirname(p) for p in files]))
    paths = [Path(p).relative_to(root).as_posix() for p in files]
    return _with_stats(root, "list", list_file, classes, paths, labels)


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
    for i, rel in enumerate(paths):
        try:
            st = os.stat(os.path.join(root, rel))
        except OSError as e:
            if kind == "list":
                raise SourceError(f"{root / rel}: listed but unreadable ({e.strerror})") from None
            continue  # vanished since the walk: size 0 makes it fail cleanly at decode time
        if kind == "list" and not stat_mod.S_ISREG(st.st_mode):
            raise SourceError(f"{root / rel}: listed but not a file")
        sizes[i] = st.st_size
        mtimes[i] = st.st_mtime_ns
    return Listing(
        root=root,
        kind=kind,
        list_file=list_file,
        classes=classes,
        paths=paths,
        labels=np.asarray(labels, np.int32),
        sizes=sizes,
        mtimes=mtimes,
    )


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
