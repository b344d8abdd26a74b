"""Annotated sources as they come: EXIF-rotated images, COCO files that disagree with the
folder, VOC's images without masks; and first builds whose skipped files cost no space."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from mmcache import (
    BatchLoader,
    Compose,
    MemmapImageDataset,
    RandomHorizontalFlip,
    RandomResizedCrop,
    StrictBuildError,
    build_cache,
)
from mmcache.cli import main

# The crops here upscale small images on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*upscaled to:UserWarning")


def with_orientation(jpeg: bytes, orientation: int) -> bytes:
    """``jpeg`` with an EXIF block (APP1) whose only tag is ``orientation``."""
    tiff = (
        b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
        + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack("<I", 0)
    )  # fmt: skip
    payload = b"Exif\x00\x00" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def rotated_set(root: Path, orientation: int) -> tuple[Path, Path, Path]:
    """A square and a non-square JPEG tagged with EXIF ``orientation``, each black with one
    white rectangle off its centre; their masks (1 on the rectangle) and a COCO file of its
    box, both made on the pixels as stored, as annotation tools see them."""
    images, masks = root / "images", root / "masks"
    images.mkdir(parents=True)
    masks.mkdir()
    doc: dict = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "box"}]}
    for k, (h, w, box) in enumerate([(32, 32, (4, 6, 12, 22)), (24, 40, (3, 5, 14, 12))]):
        y1, x1, y2, x2 = box
        img = np.zeros((h, w, 3), np.uint8)
        img[y1:y2, x1:x2] = 255
        mask = np.zeros((h, w), np.uint8)
        mask[y1:y2, x1:x2] = 1
        jpeg = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 100])[1].tobytes()
        (images / f"{k}.jpg").write_bytes(with_orientation(jpeg, orientation))
        cv2.imwrite(str(masks / f"{k}.png"), mask)
        doc["images"].append({"id": k, "file_name": f"{k}.jpg", "width": w, "height": h})
        doc["annotations"].append({"id": k, "image_id": k, "category_id": 1, "iscrowd": 0,
                                   "bbox": [x1, y1, x2 - x1, y2 - y1]})  # fmt: skip
    coco = root / "instances.json"
    coco.write_text(json.dumps(doc))
    return images, masks, coco


def bright(img: np.ndarray) -> np.ndarray:
    return np.asarray(img).max(axis=-1) > 127


def assert_mask_fits(img: np.ndarray, mask: np.ndarray) -> bool:
    """The white rectangle is where the mask says, but for a pixel of blur at its border;
    returns whether the crop holds some of it."""
    on, inside = bright(img), np.asarray(mask) == 1
    assert (on == inside).mean() > 0.9, (on.astype(int), inside.astype(int))
    return bool(inside.any())


def assert_box_fits(img: np.ndarray, boxes: np.ndarray) -> bool:
    """The box bounds the white rectangle; returns whether the crop holds some of it."""
    ys, xs = np.nonzero(bright(img))
    if not len(ys):
        assert len(boxes) == 0
        return False
    x1, y1, x2, y2 = np.asarray(boxes)[0].tolist()
    assert abs(xs.min() - x1) <= 1.5 and abs(xs.max() + 1 - x2) <= 1.5, (xs, boxes)
    assert abs(ys.min() - y1) <= 1.5 and abs(ys.max() + 1 - y2) <= 1.5, (ys, boxes)
    return True


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_rotated_images_line_up_with_their_masks_and_boxes(tmp_path, orientation):
    images, masks, coco = rotated_set(tmp_path, orientation)
    seg = build_cache(images, tmp_path / "seg", masks=masks, workers=0)
    det = build_cache(images, tmp_path / "det", coco=coco, workers=0)
    assert seg.images == det.images == 2 and not seg.skipped and not det.skipped
    for cache in ("seg", "det"):
        ds = MemmapImageDataset(tmp_path / cache)
        # The rule is recorded: the pixels are cv2.imread's without the EXIF orientation.
        assert ds.manifest.options["exif_orientation"] is False
        for i, (path, _) in enumerate(ds.samples):
            stored = cv2.imread(path, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
            np.testing.assert_array_equal(ds[i][0], cv2.cvtColor(stored, cv2.COLOR_BGR2RGB))
    crop = Compose([RandomResizedCrop(16, scale=(0.6, 1)), RandomHorizontalFlip()])
    seg_ds = MemmapImageDataset(tmp_path / "seg", transform=crop)
    det_ds = MemmapImageDataset(tmp_path / "det", transform=crop)
    seen = 0
    for seed in range(6):
        torch.manual_seed(seed)
        img, target = seg_ds[seed % 2]
        seen += assert_mask_fits(img, target["mask"])
        torch.manual_seed(seed)
        img, target = det_ds[seed % 2]
        seen += assert_box_fits(img, target["boxes"])
    for loader in (BatchLoader(MemmapImageDataset(tmp_path / "seg"), 2, shuffle=True, seed=1,
                               crop=RandomResizedCrop(16, scale=(0.6, 1)), flip=True),
                   BatchLoader(MemmapImageDataset(tmp_path / "det"), 2, shuffle=True, seed=1,
                               crop=RandomResizedCrop(16, scale=(0.6, 1)), flip=True)):  # fmt: skip
        for batch, target in loader:
            for k, img in enumerate(batch.numpy()):
                if "mask" in target:
                    seen += assert_mask_fits(img, target["mask"][k].numpy())
                else:
                    seen += assert_box_fits(img, target["boxes"][k].numpy())
    assert seen >= 10


def test_plain_builds_still_apply_exif_and_annotated_ones_refuse_to(tmp_path, testimages):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(testimages / "hopper_orientation_6.jpg", src / "h.jpg")
    build_cache(src, tmp_path / "plain", workers=0)
    coco = tmp_path / "instances.json"
    image = {"id": 1, "file_name": "h.jpg", "width": 128, "height": 128}
    coco.write_text(json.dumps({"images": [image], "annotations": [],
                                "categories": [{"id": 1, "name": "a"}]}))  # fmt: skip
    build_cache(src, tmp_path / "det", coco=coco, workers=0)
    path = str(src / "h.jpg")
    applied = cv2.cvtColor(cv2.imread(path), cv2.COLOR_BGR2RGB)
    stored = cv2.cvtColor(cv2.imread(path, cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION),
                          cv2.COLOR_BGR2RGB)  # fmt: skip
    assert not np.array_equal(applied, stored)
    np.testing.assert_array_equal(MemmapImageDataset(tmp_path / "plain")[0][0], applied)
    np.testing.assert_array_equal(MemmapImageDataset(tmp_path / "det")[0][0], stored)
    with pytest.raises(ValueError, match="exif_orientation=True with masks= or coco="):
        build_cache(src, tmp_path / "x", coco=coco, exif_orientation=True, workers=0)


def test_coco_sizes_missing_images_and_unknown_ids(tmp_path, capsys):
    images, _, coco = rotated_set(tmp_path, 1)
    doc = json.loads(coco.read_text())
    doc["images"][1]["width"] = 999  # the non-square image is 40 wide
    doc["images"].append({"id": 7, "file_name": "gone.jpg", "width": 8, "height": 8})
    doc["annotations"] += [{"id": 9 + k, "image_id": 70 + k % 2, "category_id": 1,
                            "bbox": [1, 1, 2, 2]} for k in range(3)]  # fmt: skip
    coco.write_text(json.dumps(doc))
    report = build_cache(images, tmp_path / "c", coco=coco, workers=0)
    assert report.images == 1 and [s["path"] for s in report.skipped] == ["1.jpg"]
    assert "gives it 999x24 pixels, the image has 40x24" in report.skipped[0]["reason"]
    assert report.garbage_bytes == 0
    assert report.coco_missing == ["gone.jpg"]
    assert (report.coco_orphans, report.coco_unknown_ids) == (3, [70, 71])
    with pytest.raises(StrictBuildError, match="999x24"):
        build_cache(images, tmp_path / "s", coco=coco, strict=True, workers=0)
    args = ["build", str(images), str(tmp_path / "cli"), "--coco", str(coco), "--workers", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 image of the COCO file not in the source, left out: gone.jpg" in out
    assert "3 COCO annotations of image ids the file does not list, left out: ids 70, 71" in out


def voc_like(root: Path, images: int = 12, masked: int = 3) -> tuple[Path, Path]:
    """VOC's layout: every image in JPEGImages, masks for a few in SegmentationClass."""
    jpegs, masks = root / "JPEGImages", root / "SegmentationClass"
    jpegs.mkdir(parents=True)
    masks.mkdir()
    rng = np.random.default_rng(0)
    for k in range(images):
        img = rng.integers(0, 255, (20, 24, 3), np.uint8)
        cv2.imwrite(str(jpegs / f"2007_{k:06d}.jpg"), img)
        if k % (images // masked) == 0:
            cv2.imwrite(str(masks / f"2007_{k:06d}.png"), np.full((20, 24), k % 3, np.uint8))
    return jpegs, masks


def test_a_voc_layout_s_maskless_images_cost_no_space_and_one_line(tmp_path, capsys):
    jpegs, masks = voc_like(tmp_path / "VOC2012")
    cache = tmp_path / "c"
    assert main(["build", str(jpegs), str(cache), "--masks", str(masks), "--workers", "0"]) == 0
    out = capsys.readouterr().out
    ds = MemmapImageDataset(cache)
    assert len(ds) == 3 and len(ds.manifest.skipped) == 9
    record = 20 * 24 * 3  # and its mask after the pixels, aligned
    assert ds.manifest.sizes["data"] < 3 * 2 * record  # the nine reserve nothing
    lines = [ln for ln in out.splitlines() if "skipped" in ln and "decoded" not in ln]
    assert len(lines) == 1, out
    assert lines[0].startswith("  9 skipped, no mask for it in ")
    assert "2007_000001.jpg, 2007_000002.jpg, 2007_000003.jpg, ..." in lines[0]
    assert "garbage" not in out
    # An up-to-date build does not repeat them.
    assert main(["build", str(jpegs), str(cache), "--masks", str(masks), "--workers", "0"]) == 0
    out = capsys.readouterr().out
    assert "up to date" in out and "9 skipped, see `mmcache info`" in out
    assert "2007_000001" not in out
    assert main(["info", str(cache)]) == 0
    out = capsys.readouterr().out
    assert out.count("2007_000001") == 1 and "  9 skipped, no mask for it in " in out
    # The docs' way to build the annotated images alone: VOC's own list, as a list file.
    stems = sorted(p.stem for p in masks.iterdir())
    (tmp_path / "VOC2012" / "segmentation.csv").write_text(
        "".join(f"JPEGImages/{s}.jpg,0\n" for s in stems)
    )
    report = build_cache(tmp_path / "VOC2012" / "segmentation.csv", tmp_path / "l",
                         masks=masks, workers=0)  # fmt: skip
    assert report.images == 3 and not report.skipped


def test_a_first_build_leaves_no_garbage_for_files_found_bad_when_decoded(tmp_path, testimages):
    src = tmp_path / "src"
    src.mkdir()
    # A truncated JPEG sorts first: its header promised a record, which decoding refuses.
    shutil.copy(testimages / "truncated_jpeg.jpg", src / "a.jpg")
    for name in ("b.jpg", "c.jpg"):
        shutil.copy(testimages / "hopper.jpg", src / name)
    report = build_cache(src, tmp_path / "c", workers=0)
    assert [s["path"] for s in report.skipped] == ["a.jpg"]
    assert report.garbage_bytes == 0
    # A refresh appends none either: the records it adds close over the new bad file's place.
    shutil.copy(testimages / "truncated_jpeg.jpg", src / "b0.jpg")
    shutil.copy(testimages / "hopper.jpg", src / "b1.jpg")
    report = build_cache(src, tmp_path / "c", workers=0)
    assert report.appended and (report.decoded, report.reused) == (1, 2)
    assert report.garbage_bytes == 0
    ds = MemmapImageDataset(tmp_path / "c")
    want = cv2.cvtColor(cv2.imread(str(src / "b.jpg")), cv2.COLOR_BGR2RGB)
    for i in range(3):
        np.testing.assert_array_equal(ds[i][0], want)
    # A mask that does not fit is found only when decoded: no garbage either.
    jpegs, masks = voc_like(tmp_path / "voc", images=6, masked=6)
    cv2.imwrite(str(masks / "2007_000000.png"), np.zeros((5, 5), np.uint8))
    report = build_cache(jpegs, tmp_path / "m", masks=masks, workers=0)
    assert len(report.skipped) == 1 and report.garbage_bytes == 0
    from mmcache import verify_cache

    assert verify_cache(tmp_path / "m").ok and verify_cache(tmp_path / "c").ok
