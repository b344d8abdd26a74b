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

import os
from dataclasses import dataclass

import numpy as np

from .sources import registry
from .sources.listing import IMAGE_EXTENSIONS, Listing

__all__ = ["IMAGE_EXTENSIONS", "Listing", "ListingDiff", "diff_listings", "scan_source"]


def scan_source(source: str | os.PathLike, *, label_key: str | None = None) -> Listing:
    """List the images of ``source`` (a folder, a ``path,label`` file or an archive), with
    their stats.

    Archives (a ``.tar``, a tar of tars, WebDataset shards, a ``.zip``) are listed in place,
    as ``mmcache.sources.archive`` describes; ``label_key`` names the ``.json`` field that holds a
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
    return registry.scan(source, label_key, max_entries)


def source_exists(source: str) -> bool:
    """Whether the source a cache records is there (a path, or a pattern of shards)."""
    return registry.source_exists(source)


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

