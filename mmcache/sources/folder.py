"""A folder source: ImageFolder-style class folders, or one folder of images as one class."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SourceError
from .base import ImageReader
from .listing import IMAGE_EXTENSIONS, Listing, is_image_file, looks_like_cache, with_stats

if TYPE_CHECKING:
    from ..format import CacheFiles


class Folder:
    """The ``folder`` kind: what no other kind claims is read as a folder (or said missing)."""

    kind = "folder"
    path_keys: tuple[str, ...] = ("root",)
    reads_files = True
    images: ImageReader | None = None  # OpenCV decodes its samples
    folder_stamps = True

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        return True

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        return scan_folder(source, max_entries)

    def recorded(self, files: CacheFiles) -> None:
        return None  # each record's file lies at its path under the root

    def exists(self, root: str) -> bool:
        return Path(root).exists()


FOLDER = Folder()


def scan_folder(source: str | os.PathLike, max_entries: int | None) -> Listing:
    """The folder ``source``'s images (``scan.scan_within``)."""
    src = Path(source).expanduser()
    if not src.exists():
        raise SourceError(f"{src}: source not found (expected an image folder or a list file)")
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
    listing = with_stats(root, "folder", None, classes, paths, labels)
    listing.ignored = ignored
    listing.other_files = dict(sorted(others.items(), key=lambda kv: (-kv[1], kv[0])))
    return listing



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


