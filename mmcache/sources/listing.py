"""What a source holds: the Listing of its samples, in dataset order, with their stats."""

from __future__ import annotations

import hashlib
import os
import stat as stat_mod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import format as fmt
from ..annotations import Annotations
from ..decode import sample_size
from ..errors import SourceError
from ..probe import probe_size
from . import registry

if TYPE_CHECKING:  # (members.py reads bytes through decode, which needs no Listing)
    from .base import ImageReader
    from .members import Address, Members
    from .recorded import RecordedMembers

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
    members: Members | RecordedMembers | None = None
    # More keys of the manifest's ``source`` (an archive's shard pattern, its label key).
    source_extra: dict[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    def abspath(self, i: int) -> str | Address:
        """Where entry ``i`` is read from: its file, or an archive member's address."""
        if self.members is not None:
            return self.members.ref(i)
        return os.path.join(self.root, self.paths[i])

    @property
    def images(self) -> ImageReader | None:
        """How its files are read into images when its kind reads them itself (the kind's
        ``Source.images``); None when OpenCV decodes them."""
        kind = registry.SOURCES.get(self.kind)
        return None if kind is None else kind.images

    def probe(self, i: int, exif: bool = True) -> tuple[int, int] | None:
        """``probe_size`` of entry ``i`` (``exif``: as ``probe_size``'s), or its kind's
        reader's ``size``.

        Raises:
            OSError: its file cannot be opened or read.
        """
        if self.members is not None:
            return self.members.probe(i, int(self.sizes[i]), exif)
        path = os.path.join(self.root, self.paths[i])
        reader = self.images
        return probe_size(path, exif) if reader is None else sample_size(reader, path)

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



def with_stats(
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
        warnings=under_two_labels(root, files, paths, label_array, classes),
    )


def under_two_labels(
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
            "reason": f"{how_one(root, paths[a], paths[b])}, so one image is listed under two "
            f"classes, {classes[labels[a]]!r} and {classes[labels[b]]!r}; both are kept, as "
            "torchvision's ImageFolder keeps them",
        }
        for a, b in sorted(found, key=lambda pair: pair[1])
    ]


def how_one(root: Path, first: str, second: str) -> str:
    """How listed path ``second`` came to be the file ``first`` is: the same path listed
    twice (in a list file), a symbolic link on the way, or a hard link."""
    a, b = (os.path.join(root, p) for p in (first, second))
    if os.path.normpath(a) == os.path.normpath(b):
        return f"listed twice (as {first})" if first != second else "listed twice"
    link = any(os.path.realpath(p) != os.path.abspath(p) for p in (a, b))
    return f"the same file as {first} ({'a link' if link else 'a hard link'})"



def looks_like_cache(names: list[str]) -> bool:
    """Whether a folder with these entries holds an mmcache cache, finished or being built."""
    entries = set(names)
    # (The suffix test first: a class folder of 1,300 images is looked at twice per scan.)
    bins = [n for n in entries if n.endswith(".bin")]
    return any(fmt.is_generation_file_name(n) for n in bins) or (
        fmt.MANIFEST_NAME in entries and fmt.LOCK_NAME in entries
    )

