"""A tar source, laid out like an ImageFolder or a tar of tars (one per class), read in place."""

from __future__ import annotations

import os
import posixpath
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from .archive import (
    COMPRESSED_TAR_SUFFIXES,
    DECOMPRESS_BY_SUFFIX,
    TAR_SUFFIXES,
    Row,
    Table,
    compressed,
    image_folder,
    refuse_compressed,
    refuse_compressed_member,
    stem,
    tar_members,
)
from .base import ImageReader
from .listing import IMAGE_EXTENSIONS, Listing
from .recorded import RecordedMembers
from .tar_headers import tar_holds
from .webdataset import scan_shards

if TYPE_CHECKING:
    from ..format import CacheFiles


class Tar:
    """The ``tar`` kind: a ``.tar`` file (or a compressed one, to refuse with its fix), or any
    file but a zip given a ``label_key`` (a tar of WebDataset shards)."""

    kind = "tar"
    path_keys: tuple[str, ...] = ("root",)
    reads_files = False
    images: ImageReader | None = None  # OpenCV decodes its samples
    folder_stamps = False

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        path = Path(os.fspath(source)).expanduser()
        if path.is_file() and path.name.lower().endswith(TAR_SUFFIXES + COMPRESSED_TAR_SUFFIXES):
            return True
        return label_key is not None and path.exists() and not path.is_dir()

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        return scan_tar(Path(os.fspath(source)).expanduser().resolve(), label_key)

    def recorded(self, files: CacheFiles) -> RecordedMembers:
        return RecordedMembers(files, tar_holds)

    def exists(self, root: str) -> bool:
        return Path(root).exists()


TAR = Tar()


def scan_tar(root: Path, label_key: str | None) -> Listing:
    """The images of the tar ``root``: an ImageFolder, a tar of tars or WebDataset shards
    (``.cls`` members, or ``label_key`` given), as its members show."""
    images = IMAGE_EXTENSIONS
    lower = root.name.lower()
    if lower.endswith(COMPRESSED_TAR_SUFFIXES):
        tool = next(t for suffix, t in DECOMPRESS_BY_SUFFIX.items() if lower.endswith(suffix))
        raise compressed(root, "compressed", f"run `{tool} {shlex.quote(str(root))}`")
    refuse_compressed(root)
    table = Table()
    a = table.add_archive(root)
    entries = list(tar_members(root, a, 0, table.stats[a][0], table, root.name))
    files = [(name, row) for name, row, is_dir in entries if not is_dir]
    if label_key is not None or any(n.endswith(".cls") for n, _ in files):
        return scan_shards(root, [root], images, label_key, {})
    regular = [(n, r) for n, r in files if not posixpath.basename(n).startswith(".")]
    if regular and all(n.lower().endswith(".tar") for n, _ in regular):
        return scan_tar_of_tars(root, regular, table, images)
    dirs = [name for name, _, is_dir in entries if is_dir]
    for name, row in files:
        table.add(name, row, root.name)
    return image_folder(root, "tar", table, dirs, images)


def scan_tar_of_tars(
    root: Path, inner: list[tuple[str, Row]], table: Table, images: tuple[str, ...]
) -> Listing:
    """Each inner tar a class named after its stem, its members below that folder."""
    dirs = []
    for name, row in inner:
        cls = stem(posixpath.basename(name))
        dirs.append(cls)
        where = f"{root.name}/{name}"
        refuse_compressed_member(root, int(row[1]), where)
        for member, mrow, is_dir in tar_members(root, 0, int(row[1]), int(row[2]), table, where):
            if not is_dir:
                table.add(f"{cls}/{member}", mrow, where)
    return image_folder(root, "tar", table, dirs, images)

