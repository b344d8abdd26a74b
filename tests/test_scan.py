"""Scanning sources: torchvision ImageFolder's order and labels, flat folders, lists, bad input."""

from __future__ import annotations

import os

import pytest
from conftest import write_image

from mmcache import SourceError, scan_source


def test_imagefolder_order_classes_and_labels(tmp_path):
    root = tmp_path / "src"
    for rel in [
        "b/z.jpg", "b/a.PNG", "b/sub/c.jpeg", "b/sub b/d.bmp", "b/sub/deeper/e.webp",
        "a/x.tif", "a/y.TIFF", "c/only.JPG",
    ]:  # fmt: skip
        write_image(root / rel, 8, 8)
    (root / "a" / "notes.txt").write_text("not an image")
    (root / "b" / ".hidden.jpg").write_bytes(b"x")
    (root / ".git").mkdir()
    write_image(root / ".git" / "x.jpg", 8, 8)
    write_image(root / "top_level_file.jpg", 8, 8)  # ImageFolder ignores files beside classes
    listing = scan_source(root)
    assert listing.classes == ["a", "b", "c"]
    assert listing.class_to_idx == {"a": 0, "b": 1, "c": 2}
    # torchvision: for each class, sorted(os.walk(...)) by folder path, files sorted in each.
    assert listing.paths == [
        "a/x.tif", "a/y.TIFF",
        "b/a.PNG", "b/z.jpg", "b/sub/c.jpeg", "b/sub b/d.bmp", "b/sub/deeper/e.webp",
        "c/only.JPG",
    ]  # fmt: skip
    # the same order as torchvision's make_dataset computes it
    walked = [
        os.path.relpath(os.path.join(d, f), root)
        for c in ("a", "b", "c")
        for d, _, files in sorted(os.walk(root / c, followlinks=True))
        for f in sorted(files)
        if f.lower().endswith((".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"))
        and not f.startswith(".")
    ]
    assert listing.paths == walked
    assert listing.labels.tolist() == [0, 0, 1, 1, 1, 1, 1, 2]
    assert all(s > 0 for s in listing.sizes) and all(m > 0 for m in listing.mtimes)


def test_flat_folder_is_one_class(tmp_path):
    for name in ("b.jpg", "a.png"):
        write_image(tmp_path / "flowers" / name, 8, 8)
    listing = scan_source(tmp_path / "flowers")
    assert listing.classes == ["flowers"]
    assert listing.paths == ["a.png", "b.jpg"]
    assert listing.labels.tolist() == [0, 0]


def test_symlinked_folders_are_followed_without_looping(tmp_path):
    root = tmp_path / "src"
    write_image(root / "a" / "1.jpg", 8, 8)
    write_image(tmp_path / "elsewhere" / "2.jpg", 8, 8)
    os.symlink(tmp_path / "elsewhere", root / "a" / "linked")
    os.symlink(root / "a", root / "a" / "loop")  # a folder that contains itself
    listing = scan_source(root)
    assert listing.paths == ["a/1.jpg", "a/linked/2.jpg"]


def test_csv_list_with_names_header_and_comments(tmp_path):
    for rel in ("imgs/x.jpg", "imgs/y.jpg", "other/z.jpg"):
        write_image(tmp_path / rel, 8, 8)
    lst = tmp_path / "train.csv"
    lst.write_text("path,label\n# a comment\nimgs/y.jpg,dog\n\nimgs/x.jpg,cat\nother/z.jpg,dog\n")
    listing = scan_source(lst)
    assert listing.classes == ["cat", "dog"]
    assert listing.root == tmp_path.resolve()
    assert listing.paths == ["imgs/y.jpg", "imgs/x.jpg", "other/z.jpg"]
    assert listing.labels.tolist() == [1, 0, 1]


def test_text_list_with_integer_labels_and_absolute_paths(tmp_path):
    a = write_image(tmp_path / "d" / "a.jpg", 8, 8)
    write_image(tmp_path / "d" / "b.jpg", 8, 8)
    lst = tmp_path / "list.txt"
    lst.write_text(f"{a} 2\nd/b.jpg 0\n")
    listing = scan_source(lst)
    assert listing.classes == ["0", "1", "2"]
    assert listing.paths == ["a.jpg", "b.jpg"]
    assert listing.labels.tolist() == [2, 0]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "source not found"),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no images found"),
        (lambda p: (p / "c" / "k").mkdir(parents=True) or p / "c", "no images found"),
        (lambda p: (p / "l.csv").write_text("") or p / "l.csv", "names no images"),
        (lambda p: (p / "l.csv").write_text("a.jpg,1\n") and p / "l.csv", "unreadable"),
        (lambda p: (p / "l.csv").write_text("a,b,c\n") and p / "l.csv", "expected 'path,label'"),
        (lambda p: (p / "l.csv").write_bytes(b"\xff\xfe\x00") and p / "l.csv", "not a UTF-8"),
    ],
)
def test_bad_sources_raise_one_clear_error(tmp_path, make, message):
    with pytest.raises(SourceError, match=message):
        scan_source(make(tmp_path))
