"""Masks, boxes and the user's arrays: stored with their images, read back as targets."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from conftest import reseal

from mmcache import (
    CacheFormatError,
    Compose,
    MemmapImageDataset,
    RandomHorizontalFlip,
    RandomResizedCrop,
    SourceError,
    StrictBuildError,
    build_cache,
    compact_cache,
    copy_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache.cli import main
from mmcache.sample_data import CLASS_COLOURS, make_detection_set, make_segmentation_set

# The per-sample crops warn of upscaling small images, which these tests do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*upscaled to:UserWarning")


def classes_of(img: np.ndarray, classes: int = 4) -> np.ndarray:
    """Each pixel's class: the index of its nearest class colour."""
    d = img[..., None, :].astype(np.int32) - CLASS_COLOURS[:classes].astype(np.int32)
    return np.argmin((d * d).sum(-1), axis=-1)


def away_from_borders(mask: np.ndarray, radius: int = 1) -> np.ndarray:
    """Where the (2 radius + 1)^2 neighbourhood of a pixel is all one class."""
    k = 2 * radius + 1
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(mask, radius, mode="edge"), (k, k))
    return (windows == mask[..., None, None]).all(axis=(-1, -2))


@pytest.fixture(scope="module")
def seg(tmp_path_factory) -> tuple[Path, Path]:
    return make_segmentation_set(tmp_path_factory.mktemp("seg"), images=6, size=(48, 64))


@pytest.fixture(scope="module")
def det(tmp_path_factory) -> tuple[Path, Path]:
    return make_detection_set(tmp_path_factory.mktemp("det"), images=10, size=(48, 64))


@pytest.mark.parametrize("pixels", ["rgb", "yuv420"])
def test_masks_are_cropped_and_flipped_with_their_images(seg, tmp_path, pixels):
    images, masks = seg
    report = build_cache(images, tmp_path / "c", masks=masks, short_side=40, pixels=pixels,
                         workers=0)  # fmt: skip
    assert report.images == 6 and not report.skipped
    plain = MemmapImageDataset(tmp_path / "c")
    img, target = plain[0]
    assert set(target) == {"mask"} and target["mask"].shape == img.shape[:2]
    ds = MemmapImageDataset(
        tmp_path / "c", transform=Compose([RandomResizedCrop(32), RandomHorizontalFlip()])
    )
    # yuv420's chroma is half resolution: colours blend one pixel further from a border.
    radius = 1 if pixels == "rgb" else 2
    for seed in range(12):
        torch.manual_seed(seed)
        img, target = ds[seed % len(ds)]
        assert img.shape == (32, 32, 3) and target["mask"].shape == (32, 32)
        inside = away_from_borders(target["mask"], radius)
        assert inside.mean() > 0.5
        np.testing.assert_array_equal(classes_of(img)[inside], target["mask"][inside])


def test_palette_masks_are_read_as_their_indices(tmp_path):
    grey = make_segmentation_set(tmp_path / "grey", images=3, size=(40, 40))
    palette = make_segmentation_set(tmp_path / "pal", images=3, size=(40, 40), palette=True)
    build_cache(grey[0], tmp_path / "a", masks=grey[1], workers=0)
    build_cache(palette[0], tmp_path / "b", masks=palette[1], workers=0)
    a, b = MemmapImageDataset(tmp_path / "a"), MemmapImageDataset(tmp_path / "b")
    assert cv2.imread(str(next(palette[1].iterdir())), cv2.IMREAD_UNCHANGED).ndim == 3  # colours
    for i in range(3):
        np.testing.assert_array_equal(a[i][1]["mask"], b[i][1]["mask"])
        assert b[i][1]["mask"].max() < 4


def test_without_pillow_a_palette_mask_is_skipped_with_an_install_that_works(
    tmp_path, monkeypatch
):
    # mmcache is not on a package index: the advice names pillow itself, or the checkout's extra
    palette = make_segmentation_set(tmp_path / "pal", images=1, size=(16, 16), palette=True)
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL fails, as without Pillow
    with pytest.raises(SourceError) as caught:
        build_cache(palette[0], tmp_path / "b", masks=palette[1], workers=0)
    assert 'pip install pillow (or, in a checkout of mmcache, pip install -e ".[masks]")' in str(
        caught.value
    )
    assert "mmcache[masks]" not in str(caught.value)


def test_sixteen_bit_masks_need_mask_dtype_uint16(seg, tmp_path):
    images, masks = seg
    own = tmp_path / "masks"
    shutil.copytree(masks, own)
    m = cv2.imread(str(own / "img_00000.png"), cv2.IMREAD_UNCHANGED).astype(np.uint16)
    m[0, 0] = 300
    cv2.imwrite(str(own / "img_00000.png"), m)
    report = build_cache(images, tmp_path / "a", masks=own, workers=0)
    assert [e["path"] for e in report.skipped] == ["img_00000.png"]
    assert "--mask-dtype uint16" in report.skipped[0]["reason"]
    build_cache(images, tmp_path / "b", masks=own, mask="uint16", workers=0)
    mask = MemmapImageDataset(tmp_path / "b")[0][1]["mask"]
    assert mask.dtype == np.uint16 and mask[0, 0] == 300


def test_an_image_without_its_mask_or_of_another_size_is_skipped_with_the_reason(seg, tmp_path):
    images, masks = seg
    own = tmp_path / "masks"
    shutil.copytree(masks, own)
    os.unlink(own / "img_00001.png")
    cv2.imwrite(str(own / "img_00002.png"), np.zeros((5, 7), np.uint8))
    report = build_cache(images, tmp_path / "c", masks=own, workers=0)
    reasons = {e["path"]: e["reason"] for e in report.skipped}
    assert set(reasons) == {"img_00001.png", "img_00002.png"}
    assert "no mask for it" in reasons["img_00001.png"]
    assert "7x5" in reasons["img_00002.png"] and "same size" in reasons["img_00002.png"]
    with pytest.raises(StrictBuildError, match="img_00001.png: no mask"):
        build_cache(images, tmp_path / "d", masks=own, strict=True, workers=0)
    with pytest.raises(SourceError, match="masks folder not found"):
        build_cache(images, tmp_path / "e", masks=tmp_path / "nowhere", workers=0)


def test_the_cli_builds_with_masks_and_says_what_it_skipped(seg, tmp_path, capsys):
    images, masks = seg
    assert main(["build", str(images), str(tmp_path / "c"), "--masks", str(masks), "-q"]) == 0
    assert MemmapImageDataset(tmp_path / "c")[0][1]["mask"].dtype == np.uint8
    assert main(["info", str(tmp_path / "c")]) == 0
    assert f"annotated:  mask (uint8, from {masks})" in capsys.readouterr().out
    assert main(["build", str(images), str(tmp_path / "d"), "--mask-dtype", "uint16"]) == 2
    assert "--mask-dtype needs --masks" in capsys.readouterr().err


def test_coco_boxes_labels_and_crowds(det, tmp_path):
    images, coco = det
    doc = json.loads(coco.read_text())
    build_cache(images, tmp_path / "c", coco=coco, short_side=40, workers=0)
    ds = MemmapImageDataset(tmp_path / "c")
    spec = {f["name"]: f for f in ds.manifest.fields}
    assert spec["labels"]["classes"] == ["cat", "dog", "car"]  # ids 3, 7, 11
    by_image: dict[int, list] = {}
    for a in doc["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    for i, im in enumerate(doc["images"]):
        img, t = ds[i]
        anns = by_image.get(im["id"], [])
        assert len(t["boxes"]) == len(anns) and t["boxes"].dtype == np.float32
        assert t["labels"].tolist() == [(3, 7, 11).index(a["category_id"]) for a in anns]
        assert t["iscrowd"].tolist() == [a["iscrowd"] for a in anns]
        scale = np.array([img.shape[1] / im["width"], img.shape[0] / im["height"]] * 2)
        for box, a in zip(t["boxes"], anns, strict=True):
            x, y, w, h = a["bbox"]
            np.testing.assert_allclose(box, np.array([x, y, x + w, y + h]) * scale, rtol=1e-5)
    assert any(len(ds[i][1]["boxes"]) == 0 for i in range(len(ds)))
    assert any(t.any() for t in (ds[i][1]["iscrowd"] for i in range(len(ds))))


def test_boxes_still_bound_their_rectangles_after_crop_and_flip(det, tmp_path):
    images, coco = det
    build_cache(images, tmp_path / "c", coco=coco, workers=0)
    ds = MemmapImageDataset(
        tmp_path / "c", transform=Compose([RandomResizedCrop(40, scale=(0.3, 1)),
                                           RandomHorizontalFlip()])
    )  # fmt: skip
    checked = 0
    for seed in range(80):
        torch.manual_seed(seed)
        img, t = ds[seed % len(ds)]
        # Only lone rectangles: where two overlap, one hides part of the other.
        if len(t["boxes"]) != 1:
            continue
        ys, xs = np.nonzero(img.max(axis=2) > 128)
        if not len(ys):
            continue
        x1, y1, x2, y2 = t["boxes"][0]
        assert abs(xs.min() - x1) <= 1 and abs(xs.max() + 1 - x2) <= 1
        assert abs(ys.min() - y1) <= 1 and abs(ys.max() + 1 - y2) <= 1
        checked += 1
    assert checked >= 5


def test_a_changed_mask_or_coco_file_is_refreshed(seg, det, tmp_path):
    images, masks = seg
    own = tmp_path / "masks"
    shutil.copytree(masks, own)
    build_cache(images, tmp_path / "c", masks=own, workers=0)
    assert build_cache(images, tmp_path / "c", masks=own, workers=0).up_to_date
    cv2.imwrite(str(own / "img_00003.png"), np.full_like(
        cv2.imread(str(own / "img_00003.png"), cv2.IMREAD_UNCHANGED), 2))  # fmt: skip
    with pytest.warns(UserWarning, match="masks or COCO annotations changed"):
        MemmapImageDataset(tmp_path / "c")
    report = build_cache(images, tmp_path / "c", masks=own, workers=0)
    assert (report.decoded, report.reused) == (1, 5)
    assert (MemmapImageDataset(tmp_path / "c")[3][1]["mask"] == 2).all()

    det_images, coco = det
    build_cache(det_images, tmp_path / "d", coco=coco, workers=0)
    doc = json.loads(coco.read_text())
    doc["annotations"] = doc["annotations"][1:]
    changed = tmp_path / "instances.json"
    changed.write_text(json.dumps(doc))
    report = build_cache(det_images, tmp_path / "d", coco=changed, workers=0, source_moved=True)
    assert not report.up_to_date and report.decoded == 0
    first = doc["images"].index(next(im for im in doc["images"] if im["id"] == 1000))
    assert len(MemmapImageDataset(tmp_path / "d")[first][1]["boxes"]) == len(
        [a for a in doc["annotations"] if a["image_id"] == 1000]
    )


def test_a_lazy_cache_fills_masks_as_a_build_stores_them(seg, tmp_path):
    images, masks = seg
    build_cache(images, tmp_path / "built", masks=masks, short_side=40, workers=0)
    lazy = MemmapImageDataset(tmp_path / "lazy", source=images, masks=masks, short_side=40)
    built = MemmapImageDataset(tmp_path / "built")
    assert lazy.manifest.mode == "lazy"
    for i in range(len(built)):
        np.testing.assert_array_equal(lazy[i][1]["mask"], built[i][1]["mask"])
        np.testing.assert_array_equal(lazy[i][0], built[i][0])


def test_copy_compact_and_verify_carry_the_annotations(seg, det, tmp_path):
    images, masks = seg
    build_cache(images, tmp_path / "c", masks=masks, coco=None, workers=0,
                fields={"points": {"img_00000.png": np.ones((2, 3), np.float32)}})  # fmt: skip
    copy_cache(tmp_path / "c", tmp_path / "copy")
    compact_cache(tmp_path / "copy")
    a, b = MemmapImageDataset(tmp_path / "c"), MemmapImageDataset(tmp_path / "copy")
    for i in range(len(a)):
        for key in ("mask", "points"):
            np.testing.assert_array_equal(a[i][1][key], b[i][1][key])
    assert b[0][1]["points"].shape == (2, 3) and b[1][1]["points"].shape == (0, 3)
    assert not verify_cache(tmp_path / "copy").bad
    # The record's checksum covers its mask: a flipped byte in it is found.
    m = a.manifest
    index = np.fromfile(m.file("index"), fmt.INDEX_DTYPE)
    h, w = int(index[0]["height"]), int(index[0]["width"])
    last = int(index[0]["offset"]) + fmt.record_nbytes(index[:1], "rgb", "uint8")[0] - 1
    with open(m.file("data"), "r+b") as f:
        f.seek(last)
        byte = f.read(1)[0]
        f.seek(last)
        f.write(bytes([byte ^ 1]))
    assert h * w and [b.index for b in verify_cache(tmp_path / "c").bad] == [0]


def test_user_fields_must_share_one_dtype_and_row_shape(seg, tmp_path):
    images, _ = seg
    with pytest.raises(SourceError, match="one dtype and one shape"):
        build_cache(images, tmp_path / "c", workers=0, fields={"k": {
            "img_00000.png": np.zeros((1, 3), np.float32),
            "img_00001.png": np.zeros((1, 2), np.float32)}})  # fmt: skip
    with pytest.raises(SourceError, match="not in the source"):
        build_cache(images, tmp_path / "c", workers=0,
                    fields={"k": {"nope.png": np.zeros(1)}})  # fmt: skip


def test_a_damaged_fields_file_or_description_is_refused(seg, tmp_path):
    images, masks = seg
    build_cache(images, tmp_path / "c", masks=masks, workers=0)
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["format_version"] == [5, 1] and m["requires"] == ["fields", "layout:rgb", "masks"]
    path = tmp_path / "c" / m["files"]["fields"]
    blob = bytearray(path.read_bytes())
    blob[3] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(CacheFormatError, match="fields-.*checksum mismatch"):
        MemmapImageDataset(tmp_path / "c")
    for spec_edit, why in (
        ({"dtype": "object"}, "unknown dtype"),
        ({"shape": [-1, 0]}, "shape must be"),
        ({"name": "a b"}, "not unique letters"),
    ):
        blob[3] ^= 0xFF
        path.write_bytes(bytes(blob))
        m2 = json.loads(json.dumps(m))
        m2["fields"][0].update(spec_edit)
        (tmp_path / "c" / "manifest.json").write_text(json.dumps(m2))
        reseal(tmp_path / "c")
        with pytest.raises(CacheFormatError, match=why):
            MemmapImageDataset(tmp_path / "c")
        blob[3] ^= 0xFF
    # Row numbers past the file's end, resealed: refused before any array is made.
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    blob = bytearray(path.read_bytes())
    blob[3] ^= 0xFF  # undo the last flip
    n = m["count"]
    blob[8 * n : 8 * n + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(blob))
    reseal(tmp_path / "c")
    with pytest.raises(CacheFormatError, match="more rows than the file holds|out of order"):
        MemmapImageDataset(tmp_path / "c")


def test_a_reader_that_knows_no_masks_refuses_a_cache_with_them(seg, tmp_path, monkeypatch):
    images, masks = seg
    build_cache(images, tmp_path / "c", masks=masks, workers=0)
    monkeypatch.setattr(fmt, "FEATURES", ("layout:rgb",))
    with pytest.raises(CacheFormatError, match="requires 'fields', 'masks', which this mmcache"):
        MemmapImageDataset(tmp_path / "c")


def _batches(loader, limit=None):
    """Each batch's images and target, copied (the ring's buffers are reused)."""
    out = []
    for images, target in loader:
        copied = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
                  for k, v in target.items()}  # fmt: skip
        out.append((images.clone(), copied))
        if limit is not None and len(out) == limit:
            break
    return out


def _same(a, b):
    assert len(a) == len(b)
    for (ia, ta), (ib, tb) in zip(a, b, strict=True):
        assert torch.equal(ia, ib) and ta.keys() == tb.keys()
        for k in ta:
            if isinstance(ta[k], list):
                assert all(torch.equal(x, y) for x, y in zip(ta[k], tb[k], strict=True))
            else:
                assert torch.equal(ta[k], tb[k])


@pytest.fixture(scope="module")
def seg_cache(seg, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("segc") / "c"
    build_cache(seg[0], cache, masks=seg[1], workers=0)
    return cache


def test_batchloader_crops_and_flips_masks_with_their_images(seg_cache):
    from mmcache import BatchLoader

    ds = MemmapImageDataset(seg_cache)
    loader = BatchLoader(ds, 4, shuffle=True, seed=3, crop=RandomResizedCrop(24), flip=True)
    batches = _batches(loader)
    for images, target in batches:
        assert target["mask"].shape == images.shape[:3] and target["mask"].dtype == torch.uint8
        for img, mask in zip(images.numpy(), target["mask"].numpy(), strict=True):
            inside = away_from_borders(mask)
            np.testing.assert_array_equal(classes_of(img)[inside], mask[inside])
    # Each mask pixel is the stored mask's pixel under its centre in the drawn box (torch's
    # "nearest-exact": floor((i + 0.5) * box side / 24)), mirrored with a flipped image.
    idx, boxes, flips = loader.draw_batch(0)
    for k, i in enumerate(idx):
        top, left, bh, bw = (int(v) for v in boxes[k])
        rows = top + np.floor((np.arange(24) + 0.5) * bh / 24).astype(int)
        cols = left + np.floor((np.arange(24) + 0.5) * bw / 24).astype(int)
        want = ds[int(i)][1]["mask"][np.ix_(rows, cols)]
        want = want[:, ::-1] if flips[k] else want
        np.testing.assert_array_equal(batches[0][1]["mask"][k].numpy(), want)
    # Deterministic whatever the threads and the read path; resumable mid-epoch.
    again = BatchLoader(ds, 4, shuffle=True, seed=3, crop=RandomResizedCrop(24), flip=True,
                        num_threads=1, read="pread")  # fmt: skip
    _same(batches, _batches(again))
    state_loader = BatchLoader(ds, 4, shuffle=True, seed=3, crop=RandomResizedCrop(24), flip=True)
    _batches(state_loader, limit=1)
    resumed = BatchLoader(ds, 4, shuffle=True, seed=3, crop=RandomResizedCrop(24), flip=True)
    resumed.load_state_dict(state_loader.state_dict())
    _same(batches[1:], _batches(resumed))


def test_batchloader_masks_of_yuv420_records_and_of_whole_records(seg, tmp_path):
    from mmcache import BatchLoader

    build_cache(seg[0], tmp_path / "y", masks=seg[1], pixels="yuv420", workers=0)
    ds = MemmapImageDataset(tmp_path / "y")
    for images, target in BatchLoader(ds, 3, seed=0, crop=RandomResizedCrop(24), flip=True):
        for img, mask in zip(images.numpy(), target["mask"].numpy(), strict=True):
            inside = away_from_borders(mask, 2)  # chroma at half resolution: see above
            np.testing.assert_array_equal(classes_of(img)[inside], mask[inside])
    build_cache(seg[0], tmp_path / "w", masks=seg[1], size=(30, 40), workers=0)
    ds = MemmapImageDataset(tmp_path / "w")
    (images, target), *_ = list(_batches(BatchLoader(ds, 6, read="pread")))
    for k in range(6):
        np.testing.assert_array_equal(target["mask"][k].numpy(), ds[k][1]["mask"])


def test_batchloader_moves_boxes_with_their_images(det, tmp_path):
    from mmcache import BatchLoader

    images, coco = det
    build_cache(images, tmp_path / "c", coco=coco, workers=0)
    ds = MemmapImageDataset(tmp_path / "c")
    checked = 0
    for seed in range(4):
        loader = BatchLoader(ds, 5, shuffle=True, seed=seed,
                             crop=RandomResizedCrop(40, scale=(0.3, 1)), flip=True)  # fmt: skip
        for batch, target in loader:
            assert set(target) == {"boxes", "labels", "iscrowd"}
            rows = zip(batch.numpy(), target["boxes"], target["labels"], strict=True)
            for img, boxes, labels in rows:
                assert len(boxes) == len(labels)
                ys, xs = np.nonzero(img.max(axis=2) > 128)
                if len(boxes) != 1 or not len(ys):
                    continue
                x1, y1, x2, y2 = boxes[0].tolist()
                assert abs(xs.min() - x1) <= 1 and abs(xs.max() + 1 - x2) <= 1
                assert abs(ys.min() - y1) <= 1 and abs(ys.max() + 1 - y2) <= 1
                checked += 1
    assert checked >= 5


def test_a_build_not_given_the_user_s_arrays_again_keeps_them(seg, tmp_path):
    images, _ = seg
    source = tmp_path / "images"
    shutil.copytree(images, source)
    points = {"img_00002.png": np.arange(6, dtype=np.float32).reshape(2, 3)}
    build_cache(source, tmp_path / "c", fields={"points": points}, workers=0)
    assert build_cache(source, tmp_path / "c", workers=0).up_to_date  # nothing dropped
    shutil.copy(source / "img_00000.png", source / "new.png")
    report = build_cache(source, tmp_path / "c", workers=0)
    assert report.decoded == 1
    ds = MemmapImageDataset(tmp_path / "c")
    rows = {Path(p).name: ds[i][1]["points"] for i, (p, _) in enumerate(ds.samples)}
    np.testing.assert_array_equal(rows["img_00002.png"], points["img_00002.png"])
    assert rows["new.png"].shape == (0, 3)


def test_views_of_an_annotated_cache_are_refused(seg_cache):
    from mmcache import BatchLoader

    with pytest.raises(ValueError, match="views= of a cache with masks or boxes"):
        BatchLoader(MemmapImageDataset(seg_cache), 4, views=[(RandomResizedCrop(16), 2)])


def test_masks_with_an_archive_source_are_refused(seg, tmp_path):
    import tarfile

    images, masks = seg
    with tarfile.open(tmp_path / "images.tar", "w") as tar:
        tar.add(images, arcname="images")
    with pytest.raises(SourceError, match="masks pair with images in a folder, not in an archive"):
        build_cache(tmp_path / "images.tar", tmp_path / "c", masks=masks, workers=0)


def test_batchloader_fills_a_lazy_cache_s_masks_as_it_reads(seg, tmp_path):
    from mmcache import BatchLoader

    ds = MemmapImageDataset(tmp_path / "lazy", source=seg[0], masks=seg[1])
    loader = BatchLoader(ds, 3, seed=0, crop=RandomResizedCrop(24), flip=True)
    for images, target in loader:
        for img, mask in zip(images.numpy(), target["mask"].numpy(), strict=True):
            inside = away_from_borders(mask)
            np.testing.assert_array_equal(classes_of(img)[inside], mask[inside])
    assert (np.fromfile(ds.manifest.file("state"), fmt.STATE_DTYPE)["state"] == fmt.FILLED).all()


def test_the_plan_counts_the_masks_bytes(seg, tmp_path, capsys):
    from mmcache import plan_cache

    images, masks = seg
    report = build_cache(images, tmp_path / "c", masks=masks, short_side=40, workers=0)
    plan = plan_cache(images, short_side=40, mask="uint8")
    without = plan_cache(images, short_side=40).build.data_bytes
    assert plan.build.data_bytes == report.bytes > without
    args = ["build", str(images), str(tmp_path / "d"), "--masks", str(masks), "--dry-run"]
    assert main([*args, "--short-side", "40"]) == 0
    from mmcache._feedback import human_bytes

    line = next(x for x in capsys.readouterr().out.splitlines() if "<- this build" in x)
    assert human_bytes(report.bytes) in line


def test_verify_against_the_source_decodes_the_masks_too(seg, tmp_path):
    images, masks = seg
    own = tmp_path / "masks"  # as BMPs: a pixel changed keeps the file's size
    own.mkdir()
    for png in masks.iterdir():
        cv2.imwrite(str(own / (png.stem + ".bmp")), cv2.imread(str(png), cv2.IMREAD_UNCHANGED))
    build_cache(images, tmp_path / "c", masks=own, workers=0)
    report = verify_cache(tmp_path / "c", source="all")
    assert report.ok and report.source_compared == 6
    # A mask rewritten in place, its size and mtime put back: only decoding it again sees it.
    path = own / "img_00004.bmp"
    st = path.stat()
    mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    mask[0, 0] = 3 if mask[0, 0] != 3 else 1
    cv2.imwrite(str(path), mask)
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    bad = verify_cache(tmp_path / "c", source="all").bad
    assert [b.path for b in bad] == ["img_00004.png"]
    # a mask gone: its record named, with the reason, the image itself still there
    (own / "img_00002.bmp").unlink()
    bad = verify_cache(tmp_path / "c", source="all").bad
    files = fmt.open_cache(tmp_path / "c")
    assert [(b.index, b.path, b.what) for b in bad if b.path != "img_00004.png"] == [
        (files.paths().index("img_00002.png"), "img_00002.png",
         "its mask vanished since it was listed")
    ]  # fmt: skip


def test_after_a_reboot_a_lazy_cache_s_masked_fills_check_whole(seg, tmp_path, monkeypatch):
    import mmcache._filler

    images, masks = seg
    ds = MemmapImageDataset(tmp_path / "lazy", source=images, masks=masks)
    for i in range(len(ds)):
        ds[i]
    ds._reader.filler.close()
    # Another boot's filler file: every fill is checked, pixels and mask, before it is trusted.
    (tmp_path / "lazy" / "filling-0123456789abcdef").write_text("another-boot-before")
    monkeypatch.setattr(mmcache._filler, "boot_id", lambda: "another-boot")
    assert not verify_cache(tmp_path / "lazy").bad  # whole records: none taken for lost
    # The writer's scrub keeps every fill (none lost), so the build decodes nothing.
    assert build_cache(images, tmp_path / "lazy", masks=masks, workers=0).decoded == 0


def test_multicrop_of_an_annotated_cache_is_refused(seg_cache):
    from mmcache import MultiCrop

    ds = MemmapImageDataset(seg_cache, transform=MultiCrop([(RandomResizedCrop(16), 2)]))
    with pytest.raises(ValueError, match="not an \\(image, target\\) pair"):
        ds[0]
