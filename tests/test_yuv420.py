"""yuv420 records: planar I420 caches, their format, tools, and readers that give back RGB."""

from __future__ import annotations

import json
import math
import os

import cv2
import numpy as np
import pytest
import torch
from conftest import make_folder, reseal

import mmcache
from mmcache import (
    BatchLoader,
    CacheFormatError,
    CenterResizedCrop,
    MemmapImageDataset,
    OptionsChangedError,
    RandomResizedCrop,
    build_cache,
    compact_cache,
    copy_cache,
    plan_cache,
    verify_cache,
)
from mmcache import format as fmt
from mmcache import pixels as px
from mmcache._generation import garbage_bytes
from mmcache.cli import main
from mmcache.transforms import resized_crop

# Odd and even sides, a 1 x 1 and a one-row image among them.
SIZES = {"a": [(64, 48), (61, 47), (1, 1), (7, 1)], "b": [(33, 20), (50, 37), (2, 3), (40, 40)]}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture
def src(tmp_path):
    return make_folder(tmp_path / "src", SIZES)


@pytest.fixture
def yuv(src, tmp_path):
    build_cache(src, tmp_path / "yuv", workers=0, pixels="yuv420")
    return tmp_path / "yuv"


def _i420(path, color="rgb") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The planes the stated rule gives, spelled out: full-range BT.601, replicate an odd last
    row/column, the rounded mean of each 2 x 2 block."""
    bgr = cv2.imread(str(path)).astype(np.float64)
    b, g, r = bgr[..., 0], bgr[..., 1], bgr[..., 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = (b - y) * 0.564 + 128
    cr = (r - y) * 0.713 + 128
    h, w = y.shape
    halves = []
    for c in (cb, cr):
        c = np.pad(c, ((0, h % 2), (0, w % 2)), mode="edge")
        halves.append((c[0::2, 0::2] + c[1::2, 0::2] + c[0::2, 1::2] + c[1::2, 1::2]) / 4)
    return tuple(np.clip(np.round(p), 0, 255) for p in (y, *halves))


def _naive_rgb(y: np.ndarray, cb: np.ndarray, cr: np.ndarray) -> np.ndarray:
    """RGB of I420 planes in float64, unrounded, pixel by pixel: each chroma sample read at
    x / 2 - 1/4 (bilinear, align_corners=False at 2x, edges clamped), then full-range BT.601."""

    def taps(x: int, n: int) -> list[tuple[int, float]]:
        s = x / 2 - 0.25
        j = math.floor(s)
        return [(min(max(j, 0), n - 1), 1 - (s - j)), (min(max(j + 1, 0), n - 1), s - j)]

    out = np.empty((*y.shape, 3))
    for r in range(y.shape[0]):
        for c in range(y.shape[1]):
            b = red = 0.0
            for i, wi in taps(r, cb.shape[0]):
                for j, wj in taps(c, cb.shape[1]):
                    b += wi * wj * (float(cb[i, j]) - 128)
                    red += wi * wj * (float(cr[i, j]) - 128)
            luma = float(y[r, c])
            out[r, c] = (luma + 1.402 * red, luma - 0.344136 * b - 0.714136 * red, luma + 1.772 * b)
    return out


def _random_planes(rng: np.random.Generator, h: int, w: int) -> list[np.ndarray]:
    halves = ((h + 1) // 2, (w + 1) // 2)
    return [rng.integers(0, 256, s, dtype=np.uint8) for s in ((h, w), halves, halves)]


def test_records_follow_the_stated_rule_at_odd_and_even_sizes(yuv):
    ds = MemmapImageDataset(yuv)
    files = fmt.open_cache(yuv)
    for i, (path, _) in enumerate(ds.samples):
        h, w, c = files.shape(i)
        assert c == 3
        y, cb, cr = ds.planes(i)
        assert y.shape == (h, w) and cb.shape == cr.shape == ((h + 1) // 2, (w + 1) // 2)
        assert int(ds.reader.records.nbytes[i]) == h * w + 2 * ((h + 1) // 2) * ((w + 1) // 2)
        for got, want in zip((y, cb, cr), _i420(path), strict=True):
            # OpenCV's fixed-point arithmetic rounds within a level of the float rule
            assert np.abs(got.astype(int) - want).max() <= 1, path
        img = ds[i][0]
        assert img.shape == (h, w, 3) and img.dtype == np.uint8
        assert np.array_equal(img, mmcache.yuv420_to_rgb(y, cb, cr))


def test_round_trip_on_the_real_world_test_images(testimages, tmp_path):
    build_cache(testimages, tmp_path / "rgb", workers=0)
    build_cache(testimages, tmp_path / "yuv", workers=0, pixels="yuv420")
    rgb, yuv = MemmapImageDataset(tmp_path / "rgb"), MemmapImageDataset(tmp_path / "yuv")
    assert rgb.samples == yuv.samples
    values = {
        os.path.basename(p): psnr(rgb[i][0], yuv[i][0]) for i, (p, _) in enumerate(rgb.samples)
    }
    # docs/pixels.md: median 43.9 dB; the worst, a CMYK JPEG of saturated flat colours, 23.8
    assert np.median(list(values.values())) >= 40, values
    assert min(values.values()) >= 22, values
    assert values["hopper.jpg"] >= 40  # a camera-style 4:2:0 JPEG loses almost nothing


def test_the_i420_cache_is_at_most_0_52_of_the_rgb_cache(src, yuv, tmp_path):
    build_cache(src, tmp_path / "rgb", workers=0)
    rgb, planar = fmt.read_manifest(tmp_path / "rgb"), fmt.read_manifest(yuv)
    assert sum(planar.sizes.values()) <= 0.52 * sum(rgb.sizes.values())


def test_the_layout_is_an_option_in_the_fingerprint_and_a_rebuild_needs_replace(src, yuv):
    m = fmt.read_manifest(yuv)
    assert m.pixels == "yuv420" and m.options["pixels"] == "yuv420"
    assert m.format_version == fmt.FORMAT_VERSION and m.requires == ["layout:yuv420"]
    rgb_opts = mmcache.Options()
    assert mmcache.Options(pixels="yuv420").fingerprint() != rgb_opts.fingerprint()
    with pytest.raises(OptionsChangedError, match="--replace|replace"):
        build_cache(src, yuv, workers=0)
    build_cache(src, yuv, workers=0, replace=True)
    assert fmt.read_manifest(yuv).pixels == "rgb"
    assert fmt.read_manifest(yuv).requires == ["layout:rgb"]


def test_gray_with_yuv420_is_refused_with_one_clear_line(src, tmp_path, capsys):
    with pytest.raises(ValueError, match="color='gray' has none"):
        mmcache.Options(color="gray", pixels="yuv420")
    with pytest.raises(ValueError, match="pixels must be one of rgb, yuv420"):
        mmcache.Options(pixels="yuv444")
    code = main(["build", str(src), str(tmp_path / "c"), "--color", "gray", "--pixels", "yuv420"])
    err = capsys.readouterr().err
    assert code != 0 and "gray" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "c" / "manifest.json").exists()


def _edit_manifest(cache, edit):
    path = cache / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))
    reseal(cache)


def test_an_unknown_layout_is_refused(yuv):
    _edit_manifest(yuv, lambda m: m["options"].update(pixels="yuv444"))
    with pytest.raises(CacheFormatError, match="pixel layout 'yuv444'.*upgrade mmcache"):
        MemmapImageDataset(yuv)


def test_a_manifest_cannot_claim_i420_records_without_requiring_them(yuv):
    _edit_manifest(yuv, lambda m: m.update(requires=["layout:rgb"]))
    with pytest.raises(CacheFormatError, match="requires .*'layout:rgb'.* uses .*'layout:yuv420'"):
        fmt.read_manifest(yuv)


def test_a_reader_without_i420_refuses_an_i420_cache_and_still_reads_rgb_ones(
    src, yuv, tmp_path, monkeypatch
):
    build_cache(src, tmp_path / "rgb", workers=0)
    monkeypatch.setattr(fmt, "FEATURES", ("fields", "fill-markers", "masks", "layout:rgb"))
    with pytest.raises(CacheFormatError, match="requires 'layout:yuv420', which this mmcache"):
        MemmapImageDataset(yuv)
    assert len(MemmapImageDataset(tmp_path / "rgb")) == 8


def test_plan_shows_both_layouts_and_info_the_layout(src, yuv, capsys):
    plan = plan_cache(src)
    sizes = plan.build.layout_bytes
    assert set(sizes) == {"rgb", "yuv420"} and sizes["rgb"] == plan.build.data_bytes
    assert sizes["yuv420"] <= 0.52 * sizes["rgb"]
    assert plan_cache(src, pixels="yuv420").build.data_bytes == sizes["yuv420"]
    assert set(plan_cache(src, color="gray").build.layout_bytes) == {"rgb"}
    assert main(["plan", str(src)]) == 0
    out = capsys.readouterr().out
    assert "data as yuv420" in out and "policy (rgb, rgb)" in out
    assert main(["info", str(yuv)]) == 0
    out = capsys.readouterr().out
    assert "pixels:     yuv420" in out and "format:     5.1" in out


def test_verify_finds_a_flipped_byte_in_a_chroma_plane(yuv):
    assert verify_cache(yuv).bad == []
    files = fmt.open_cache(yuv)
    last = int(np.argmax(files.index["offset"]))
    end = int(files.index["offset"][last]) + int(fmt.record_nbytes(files.index, "yuv420")[last])
    with open(files.manifest.file("data"), "r+b") as f:  # the last byte of its Cr plane
        f.seek(end - 1)
        byte = f.read(1)
        f.seek(end - 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert [b.index for b in verify_cache(yuv).bad] == [last]


def _images(cache):
    ds = MemmapImageDataset(cache, on_stale="ignore")
    return [ds[i][0] for i in range(len(ds))]


def test_copy_compact_and_refresh_keep_i420_records(src, yuv, tmp_path):
    before = _images(yuv)
    copy_cache(yuv, tmp_path / "copy")
    assert fmt.read_manifest(tmp_path / "copy").pixels == "yuv420"
    copied = _images(tmp_path / "copy")
    assert all(np.array_equal(a, b) for a, b in zip(before, copied, strict=True))
    # a refresh: one file rewritten at another size, one added; the rest is kept in place
    changed = sorted(src.rglob("*.jpg"))[0]
    cv2.imwrite(str(changed), np.full((9, 13, 3), 200, np.uint8))
    cv2.imwrite(str(src / "b" / "new.jpg"), np.full((5, 6, 3), 30, np.uint8))
    report = build_cache(src, yuv, workers=0, pixels="yuv420", compact_at=1.0)
    assert report.appended and report.decoded == 2 and garbage_bytes(fmt.open_cache(yuv)) > 0
    build_cache(src, tmp_path / "fresh", workers=0, pixels="yuv420")
    fresh = _images(tmp_path / "fresh")
    assert all(np.array_equal(a, b) for a, b in zip(fresh, _images(yuv), strict=True))
    compact_cache(yuv)
    assert garbage_bytes(fmt.open_cache(yuv)) == 0
    assert all(np.array_equal(a, b) for a, b in zip(fresh, _images(yuv), strict=True))
    assert verify_cache(yuv).bad == []


def test_a_lazy_i420_cache_fills_what_a_build_stores(src, yuv, tmp_path):
    lazy = MemmapImageDataset(tmp_path / "lazy", source=src, pixels="yuv420")
    assert fmt.read_manifest(tmp_path / "lazy").pixels == "yuv420"
    built = MemmapImageDataset(yuv)
    for i in range(len(built)):
        assert np.array_equal(lazy[i][0], built[i][0])  # filled on this read
        pairs = zip(lazy.planes(i), built.planes(i), strict=True)
        assert all(np.array_equal(a, b) for a, b in pairs)
    assert verify_cache(tmp_path / "lazy").bad == []


def test_planes_convert_on_torch_within_two_levels_and_rgb_caches_have_none(src, yuv, tmp_path):
    ds = MemmapImageDataset(yuv)
    for i in range(len(ds)):
        planes = [torch.from_numpy(np.ascontiguousarray(p)) for p in ds.planes(i)]
        got = mmcache.yuv420_to_rgb(*planes)
        assert got.dtype == torch.uint8 and tuple(got.shape) == ds[i][0].shape
        assert np.abs(got.numpy().astype(int) - ds[i][0]).max() <= 2
    first = [torch.from_numpy(np.ascontiguousarray(p)) for p in ds.planes(0)]
    batch = [torch.stack([p, p]) for p in first]  # (N, H, W) planes convert as a batch
    assert torch.equal(mmcache.yuv420_to_rgb(*batch)[1], mmcache.yuv420_to_rgb(*first))
    build_cache(src, tmp_path / "rgb", workers=0)
    with pytest.raises(ValueError, match="stores RGB records"):
        MemmapImageDataset(tmp_path / "rgb").planes(0)


def test_on_torch_each_pixel_is_the_formula_rounded_to_the_nearest_level():
    # A naive float64 reference, pixel by pixel: float32 may round a value within a hair of a
    # tie either way, every other pixel is the nearest level (truncating is off on half).
    rng = np.random.default_rng(5)
    for h, w in [(9, 13), (10, 12), (1, 1), (17, 6)]:
        planes = _random_planes(rng, h, w)
        want = _naive_rgb(*planes)
        got = mmcache.yuv420_to_rgb(*map(torch.from_numpy, planes)).numpy().astype(float)
        near_tie = np.abs(want - np.floor(want) - 0.5) < 1e-3
        rounded = np.clip(np.round(want), 0, 255)
        assert np.array_equal(got[~near_tie], rounded[~near_tie]), (h, w)
        assert np.abs(got - rounded).max() <= 1, (h, w)


def test_stacked_planes_convert_as_each_image_alone_on_numpy_and_torch():
    # (2, 3) images of 9 x 13 in one call: each is its own conversion, near the formula
    rng = np.random.default_rng(6)
    singles = [[_random_planes(rng, 9, 13) for _ in range(3)] for _ in range(2)]
    stacked = [np.stack([np.stack([p[k] for p in row]) for row in singles]) for k in range(3)]
    got = mmcache.yuv420_to_rgb(*stacked)
    on_torch = mmcache.yuv420_to_rgb(*map(torch.from_numpy, stacked)).numpy()
    assert got.shape == on_torch.shape == (2, 3, 9, 13, 3) and got.dtype == np.uint8
    for i, j in np.ndindex(2, 3):
        planes = singles[i][j]
        assert np.array_equal(got[i, j], mmcache.yuv420_to_rgb(*planes))
        torch_alone = mmcache.yuv420_to_rgb(*map(torch.from_numpy, planes)).numpy()
        assert np.array_equal(on_torch[i, j], torch_alone)
        want = np.clip(_naive_rgb(*planes), 0, 255)
        assert np.abs(got[i, j].astype(float) - want).max() <= 2.5
    # one leading axis: (3, 9, 13) planes
    row = [np.stack([p[k] for p in singles[0]]) for k in range(3)]
    assert np.array_equal(mmcache.yuv420_to_rgb(*row), got[0])


def test_bgr_caches_read_back_as_bgr(src, tmp_path):
    build_cache(src, tmp_path / "bgr", workers=0, pixels="yuv420", color="bgr")
    build_cache(src, tmp_path / "rgb", workers=0, pixels="yuv420")
    bgr, rgb = _images(tmp_path / "bgr"), _images(tmp_path / "rgb")
    assert all(np.array_equal(a, b[..., ::-1]) for a, b in zip(bgr, rgb, strict=True))


def test_a_manifest_that_records_no_colour_order_reads_as_rgb(src, tmp_path):
    """The colour order's default is RGB, as the build's: a manifest written without the
    option (by hand, or by another writer) reads its I420 records as the RGB cache does."""
    build_cache(src, tmp_path / "rgb", workers=0, pixels="yuv420")
    build_cache(src, tmp_path / "unsaid", workers=0, pixels="yuv420")
    manifest = tmp_path / "unsaid" / fmt.MANIFEST_NAME
    m = json.loads(manifest.read_text())
    del m["options"]["color"]
    manifest.write_text(json.dumps(m))
    reseal(tmp_path / "unsaid")
    rgb, unsaid = _images(tmp_path / "rgb"), _images(tmp_path / "unsaid")
    assert all(np.array_equal(a, b) for a, b in zip(unsaid, rgb, strict=True))


# BatchLoader ----------------------------------------------------------------------------------


@pytest.fixture
def photos(tmp_path):
    """Photo-like records of a few shapes, odd ones among them, for the crop path."""
    src = make_folder(tmp_path / "photos", {"a": [(90, 61), (64, 64), (75, 50)] * 3,
                                            "b": [(61, 90), (100, 67)] * 3})  # fmt: skip
    build_cache(src, tmp_path / "pyuv", workers=0, pixels="yuv420")
    return MemmapImageDataset(tmp_path / "pyuv")


def test_without_crop_whole_records_convert_into_the_batch(yuv, tmp_path):
    src = make_folder(tmp_path / "same", {"a": [(31, 17)] * 5, "b": [(31, 17)] * 4})
    build_cache(src, tmp_path / "same-yuv", workers=0, pixels="yuv420")
    ds = MemmapImageDataset(tmp_path / "same-yuv")
    for read in ("mmap", "pread"):
        images = torch.cat([b for b, _ in BatchLoader(ds, 4, read=read, num_threads=2)])
        assert torch.equal(images, torch.from_numpy(np.stack(_images(tmp_path / "same-yuv"))))
    flipped = next(iter(BatchLoader(ds, 9, flip=True, seed=1)))[0]
    _, _, flips = BatchLoader(ds, 9, flip=True, seed=1).draw_batch(0)
    records = _images(tmp_path / "same-yuv")
    want = [img[:, ::-1] if f else img for img, f in zip(records, flips, strict=True)]
    assert torch.equal(flipped, torch.from_numpy(np.stack(want)))


@pytest.mark.parametrize("read", ["mmap", "pread"])
@pytest.mark.parametrize(
    "crop", [RandomResizedCrop(40), CenterResizedCrop(32)], ids=["rrc", "center"]
)
def test_the_crop_path_equals_cropping_the_converted_record(photos, crop, read):
    # Only the box is converted, from its chroma window upsampled alone: every pixel is the
    # whole record's, so the crop is the RGB path's crop of ``read(i)``, exactly.
    loader = BatchLoader(photos, 5, shuffle=True, seed=4, crop=crop, flip=True, read=read)
    for k, (images, _) in enumerate(loader):
        idx, boxes, flips = loader.draw_batch(k)
        for j, i in enumerate(idx):
            want = resized_crop(photos.read(int(i)), boxes[j], crop.size, crop.interpolation)
            want = want[:, ::-1] if flips[j] else want
            assert np.array_equal(images[j].numpy(), want), (k, j, boxes[j])


def test_a_window_converts_to_the_same_pixels_as_the_whole_record():
    rng = np.random.default_rng(7)
    for h, w in [(9, 13), (10, 12), (1, 1), (2, 7), (33, 17)]:
        record = px.from_bgr(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "yuv420")
        whole = px.convert(*px.planes(record))
        # the whole record against the formula (cv2's fixed point: within two levels)
        assert np.abs(whole - np.clip(_naive_rgb(*px.planes(record)), 0, 255)).max() < 2, (h, w)
        for _ in range(20):
            top, left = int(rng.integers(0, h)), int(rng.integers(0, w))
            bh, bw = int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1))
            box = (top, left, bh, bw)
            rgb = px.converted_window(*px.planes(record), box, (h, w), "rgb",
                                      lambda name, n: np.empty(n, np.uint8))  # fmt: skip
            assert np.array_equal(rgb, whole[top : top + bh, left : left + bw]), (h, w, top, left)


def test_pread_crops_of_the_box_rows_equal_crops_from_the_mapping(photos):
    def run(read):
        loader = BatchLoader(photos, 4, shuffle=True, seed=6, crop=RandomResizedCrop(30),
                             read=read)  # fmt: skip
        return [b.clone() for b, _ in loader]

    assert all(torch.equal(a, b) for a, b in zip(run("mmap"), run("pread"), strict=True))


def test_normalize_channels_last_and_progressive_sizes_on_i420(photos):
    crop = RandomResizedCrop(24)
    plain = BatchLoader(photos, 4, seed=2, crop=crop)
    norm = BatchLoader(photos, 4, seed=2, crop=crop, normalize=([0.5] * 3, [0.25] * 3),
                       channels_last=True)  # fmt: skip
    a, _ = next(iter(plain))
    b, _ = next(iter(norm))
    want = (a.permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
    assert b.shape == (4, 3, 24, 24) and torch.allclose(b, want, atol=1e-5)
    crop.size = (16, 20)
    assert next(iter(plain))[0].shape == (4, 16, 20, 3)


@pytest.mark.needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_i420_batches_on_cuda_equal_the_cpu_batches_and_planes_convert_there(photos):
    kw = {"seed": 3, "crop": RandomResizedCrop(24), "flip": True}
    cpu = [b.clone() for b, _ in BatchLoader(photos, 4, **kw)]
    gpu = [b.cpu() for b, _ in BatchLoader(photos, 4, device="cuda", **kw)]
    assert all(torch.equal(a, b) for a, b in zip(cpu, gpu, strict=True))
    planes = [torch.from_numpy(np.ascontiguousarray(p)).cuda() for p in photos.planes(0)]
    rgb = mmcache.yuv420_to_rgb(*planes)
    assert rgb.is_cuda and np.abs(rgb.cpu().numpy().astype(int) - photos[0][0]).max() <= 2


def test_the_same_seed_gives_the_same_i420_batches_whatever_the_threads(photos):
    def run(threads):
        loader = BatchLoader(photos, 4, shuffle=True, seed=9, crop=RandomResizedCrop(28),
                             flip=True, num_threads=threads)  # fmt: skip
        return [b.clone() for b, _ in loader]

    one, three = run(1), run(3)
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


def test_an_i420_epoch_resumes_from_its_state_dict(photos):
    def make():
        loader = BatchLoader(photos, 4, shuffle=True, seed=5, crop=RandomResizedCrop(28), flip=True)
        loader.set_epoch(1)
        return loader

    first = make()
    it = iter(first)
    next(it)
    state = json.loads(json.dumps(first.state_dict()))
    rest = [b.clone() for b, _ in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b.clone()) for a, (b, _) in zip(rest, resumed, strict=True))


@pytest.mark.parametrize("leading", ["crop", "compose"])
def test_a_dataset_crop_of_i420_records_equals_the_crop_of_the_converted_image(photos, leading):
    # Under one of mmcache's crops the dataset converts only the box: the same pixels, drawn
    # from the same generator as cropping the converted image.
    crop = RandomResizedCrop(24)
    transform = crop if leading == "crop" else mmcache.Compose([crop, torch.from_numpy])
    ds = MemmapImageDataset(photos.cache, transform=transform)
    for i in range(len(ds)):
        torch.manual_seed(i)
        got = np.asarray(ds[i][0])
        torch.manual_seed(i)
        assert np.array_equal(got, crop(photos.read(i))), i
