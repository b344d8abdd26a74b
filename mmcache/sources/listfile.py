"""A list-file source: a text or CSV file of ``path,label`` lines."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SourceError
from ..probe import sniff_format
from .base import ImageReader
from .listing import Listing, is_image_file, with_stats

if TYPE_CHECKING:
    from ..format import CacheFiles


class ListFile:
    """The ``list`` kind: an existing file that no archive kind claims."""

    kind = "list"
    path_keys: tuple[str, ...] = ("root", "list_file")
    reads_files = True
    images: ImageReader | None = None  # OpenCV decodes its samples
    folder_stamps = False

    def claims(self, source: str | os.PathLike, label_key: str | None) -> bool:
        return Path(source).expanduser().is_file()

    def scan(
        self, source: str | os.PathLike, label_key: str | None, max_entries: int | None
    ) -> Listing:
        return scan_list(Path(source).expanduser().resolve())

    def recorded(self, files: CacheFiles) -> None:
        return None  # each record's file lies at its path under the root

    def exists(self, root: str) -> bool:
        return Path(root).exists()


LIST = ListFile()


_INTEGER = re.compile(r"[+-]?\d+")


def scan_list(list_file: Path) -> Listing:
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
    return with_stats(root, "list", list_file, classes, paths, labels)


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


