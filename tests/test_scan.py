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


# --- labels never change silently -------------------------------------------------------------


def _list(tmp_path, text: str, n: int = 12):
    for k in range(n):
        write_image(tmp_path / "imgs" / f"{k}.jpg", 8, 8, seed=k)
    lst = tmp_path / "train.csv"
    lst.write_text(text)
    return lst


def test_integer_labels_with_a_typo_are_an_error_naming_the_lines(tmp_path):
    lines = [f"imgs/{k}.jpg,{k % 11}" for k in range(12)]
    lines[10] = "imgs/10.jpg,1O"  # the letter O typed for a zero
    lines[4] = "imgs/4.jpg,four"
    lst = _list(tmp_path, "path,label\n" + "\n".join(lines) + "\n")
    with pytest.raises(SourceError) as e:
        scan_source(lst)
    message = str(e.value)
    # line numbers count the header: imgs/4.jpg is on line 6, imgs/10.jpg on line 12
    assert "class numbers but for line 6 ('four'), line 12 ('1O')" in message
    assert "make the first line 'path,class'" in message


def test_a_path_class_header_makes_every_label_a_name_digits_too(tmp_path):
    lst = _list(tmp_path, "path,class\nimgs/0.jpg,10\nimgs/1.jpg,9\nimgs/2.jpg,1O\n", n=3)
    listing = scan_source(lst)
    assert listing.classes == ["10", "1O", "9"]  # sorted names, as with any class names
    assert listing.labels.tolist() == [0, 2, 1]


def test_negative_class_numbers_are_an_error(tmp_path):
    lst = _list(tmp_path, "imgs/0.jpg,0\nimgs/1.jpg,-1\n", n=2)
    with pytest.raises(SourceError, match=r"line 2 \('-1'\): a class number is never negative"):
        scan_source(lst)


def test_a_cache_inside_its_source_is_neither_a_class_nor_images(tmp_path):
    from mmcache import build_cache

    src = tmp_path / "src"
    for cls in ("cat", "dog"):
        write_image(src / cls / "1.jpg", 8, 8)
    first = build_cache(src, src / "cache", workers=0)  # mmcache build src src/cache
    assert first.ignored == []
    again = build_cache(src, src / "cache", workers=0)  # the cache is now inside the source
    assert again.up_to_date and again.ignored == ["cache"]
    listing = scan_source(src)
    assert listing.classes == ["cat", "dog"] and listing.ignored == ["cache"]
    # deeper, and a build still running (no manifest yet, its files there) count too
    (src / "dog" / "old").mkdir()
    (src / "dog" / "old" / "data-0123456789abcdef.bin").write_bytes(b"")
    write_image(src / "dog" / "old" / "not-an-image-of-ours.jpg", 8, 8)
    assert scan_source(src).ignored == ["cache", "dog/old"]
    assert scan_source(src).paths == ["cat/1.jpg", "dog/1.jpg"]


def test_a_class_folder_without_images_is_an_error_as_in_torchvision(tmp_path):
    write_image(tmp_path / "src" / "cat" / "1.jpg", 8, 8)
    (tmp_path / "src" / "dog").mkdir()
    (tmp_path / "src" / "dog" / "readme.txt").write_text("soon")
    with pytest.raises(SourceError, match=r"1 class folder without images \('dog'\)"):
        scan_source(tmp_path / "src")
    os.rename(tmp_path / "src" / "dog", tmp_path / "src" / ".dog")  # hidden: skipped
    assert scan_source(tmp_path / "src").classes == ["cat"]


@pytest.mark.parametrize("name", ["photo.jpg", "photo.data"])
def test_a_single_image_as_the_source_says_so(tmp_path, name):
    path = write_image(tmp_path / "photo.jpg", 8, 8)
    path = path.rename(tmp_path / name)
    with pytest.raises(SourceError, match=r"is an image( \(JPEG\))?, not a folder or a list"):
        scan_source(path)


def test_a_file_linked_from_one_class_folder_into_another_is_listed_twice_and_said(tmp_path):
    write_image(tmp_path / "cat" / "a.jpg", 8, 8)
    write_image(tmp_path / "cat" / "b.jpg", 8, 8)
    write_image(tmp_path / "dog" / "c.jpg", 8, 8)
    os.symlink("../cat/a.jpg", tmp_path / "dog" / "a.jpg")  # one image, two labels
    os.symlink("b.jpg", tmp_path / "cat" / "b2.jpg")  # a link within a class: no label doubt
    listing = scan_source(tmp_path)
    # kept under both labels, as torchvision's ImageFolder lists it
    assert listing.paths == ["cat/a.jpg", "cat/b.jpg", "cat/b2.jpg", "dog/a.jpg", "dog/c.jpg"]
    assert [w["path"] for w in listing.warnings] == ["dog/a.jpg"]
    reason = listing.warnings[0]["reason"]
    assert reason.startswith("the same file as cat/a.jpg (a link)") and "'cat' and 'dog'" in reason
    assert "\n" not in reason


def test_a_path_listed_twice_is_said_to_be_listed_twice_not_a_link(tmp_path):
    write_image(tmp_path / "a.jpg", 8, 8)
    os.link(tmp_path / "a.jpg", tmp_path / "hard.jpg")
    (tmp_path / "list.txt").write_text("a.jpg,cat\na.jpg,dog\nhard.jpg,emu\n")
    reasons = [w["reason"] for w in scan_source(tmp_path / "list.txt").warnings]
    assert reasons[0].startswith("listed twice, so one image is listed under two classes, 'cat'")
    assert reasons[1].startswith("the same file as a.jpg (a hard link), so one image")


def test_a_folder_linked_into_another_class_is_said_for_each_file(tmp_path):
    write_image(tmp_path / "cat" / "a.jpg", 8, 8)
    write_image(tmp_path / "dog" / "c.jpg", 8, 8)
    os.symlink("../cat", tmp_path / "dog" / "cats")
    assert [w["path"] for w in scan_source(tmp_path).warnings] == ["dog/cats/a.jpg"]


def test_netpbm_images_are_read_and_other_files_are_counted_by_extension(tmp_path, capsys):
    # GTSRB ships .ppm: torchvision's IMG_EXTENSIONS (with .pgm), and OpenCV's .pbm, are
    # images; a folder of only those is a class, and its other files are counted in one line
    import cv2
    import numpy as np

    from mmcache import MemmapImageDataset, build_cache, cli

    rng = np.random.default_rng(0)
    folder = tmp_path / "src" / "00000"
    folder.mkdir(parents=True)
    for ext in (".ppm", ".pgm", ".pbm"):
        img = rng.integers(0, 2, (9, 7, 3), dtype=np.uint8) * 255
        ok, buf = cv2.imencode(ext, img if ext == ".ppm" else img[:, :, 0])
        (folder / f"img{ext}").write_bytes(buf.tobytes())
    for name in ("GT.csv", "notes.txt", "more.txt", "README"):
        (folder / name).write_text("x")
    listing = scan_source(tmp_path / "src")
    assert listing.paths == ["00000/img.pbm", "00000/img.pgm", "00000/img.ppm"]
    assert listing.other_files == {".txt": 2, "": 1, ".csv": 1}
    report = build_cache(tmp_path / "src", tmp_path / "c", workers=1)
    assert report.other_files == listing.other_files
    ds = MemmapImageDataset(tmp_path / "c")
    for (path, _), (image, _) in zip(ds.samples, ds, strict=True):
        assert np.array_equal(image, cv2.imread(path)[:, :, ::-1])
    assert cli.main(["build", str(tmp_path / "src"), str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "  4 files ignored (not images by their extension): .txt (2), (no extension) (1), .csv (1)"
    )
