"""Photo-like sample image folders for the demo, benchmarks and tests.

A decode cache is only worth benchmarking on images that cost what photographs cost to decode,
and that cost follows the compressed size: at 720x480, JPEG quality 90, a flat colour is 6 KB,
white noise 310 KB, and real photographs lie in between, around 80-200 KB. So the images here are
built the way photographs look at every scale: smooth illumination gradients and a vignette, a
background of a few colour bands, a few large shaded shapes with soft or sharp edges,
mid-frequency 1/f-like texture whose strength differs from region to region (sky next to
foliage), and a fine sensor-like grain, so that their JPEGs come out as large as photographs
(tests/test_sample_data.py checks the range). Each class has its own dominant hue and a
favourite kind of shape, so that a small CNN trained on the folder has something to learn.

Generating is fast (the demo prints how long it took): the noise textures are made once per
call and each image takes random crops and flips of them, the scene is drawn at half
resolution, only a few OpenCV passes into preallocated buffers run at full resolution, and the
JPEG encoder runs in a second thread.
"""

from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

__all__ = ["CLASS_COLOURS", "make_detection_set", "make_image_folder", "make_photo",
           "make_segmentation_set"]  # fmt: skip

# Extensions accepted by make_image_folder, and the cv2.imencode extension each one uses.
_ENCODERS = {".jpg": ".jpg", ".jpeg": ".jpg", ".png": ".png"}
# Rendered images waiting for the encoder thread: 2 keeps it busy (4.4 ms an image at 720x480;
# 1: 4.8, 4: 4.3, 8: 4.4) and bounds the copies held to 72 MB at 4000x3000.
_PENDING = 2

# The scene (colours, shapes, illumination) is drawn at 1/_SCENE_SCALE of the output size and
# upsampled bilinearly: the large structure has no energy near the pixel scale anyway, this makes
# the per-shape numpy work 4x cheaper, and it softens every edge by ~2 px, as a lens does.
_SCENE_SCALE = 2

# Cell sizes in pixels of the octaves summed into the mid-frequency texture. Equal amplitudes
# per octave give an amplitude spectrum falling like 1/f over 2-64 px, as in natural images;
# the coarser scales are supplied by the scene itself.
_MID_OCTAVES = (2, 4, 8, 16, 32, 64)
# Cell sizes, in scene pixels, of the colour noise mixed into the scene: blotchy hue and
# brightness variation over 8-64 output pixels that flat shapes would otherwise lack.
_LOW_OCTAVES = (4, 8, 16, 32)

# Texture strengths, relative to the local brightness, tuned against the JPEG size at 720x480,
# quality 90 (400 images, seed 0, median KB): scene alone 33; + grain 75; + mid texture 106;
# both 118 (min 69, 10th percentile 90, 90th 140, max 166); both with the grain doubled 139.
# The grain adds less than its look suggests because q90 quantises most of it away, as it does
# for a real camera's noise; the 2-8 px octaves of the mid texture carry most of the size.
_GRAIN = (0.03, 0.05)
_GRAIN_BLUR = 0.5
_MID_AMP = (0.05, 0.42)
_LOW_AMP = (3.0, 10.0)  # coarse-noise std, grey levels
_LOW_CHROMA = 0.4


def _scene_size(width: int, height: int) -> tuple[int, int]:
    """Scene resolution (width, height) for an output of width x height."""
    return max(1, -(-width // _SCENE_SCALE)), max(1, -(-height // _SCENE_SCALE))


def _margin(n: int) -> int:
    # A 1/8 margin gives every image its own crop offset (times four flips) for a texture of
    # ~1.27x the output's area: 60 MB of float32 for each full-size texture at 4000x3000.
    return max(8, n // 8)


def _octave_noise(
    rng: np.random.Generator, height: int, width: int, cells: tuple[int, ...], channels: int = 1
) -> np.ndarray:
    """Sum of bicubically upsampled white noise at the given cell sizes, normalised to std 1."""
    shape = (height, width) if channels == 1 else (height, width, channels)
    acc = np.zeros(shape, np.float32)
    tmp = np.empty(shape, np.float32)  # one temporary, not one per octave: ~60 MB at 4000x3000
    for cell in cells:
        small_shape = (height // cell + 2, width // cell + 2) + shape[2:]
        small = rng.standard_normal(small_shape, dtype=np.float32)
        resized = cv2.resize(small, (width, height), dst=tmp, interpolation=cv2.INTER_CUBIC)
        np.add(acc, resized.reshape(shape), out=acc)
    return _normalise(acc)


def _normalise(a: np.ndarray) -> np.ndarray:
    a -= a.mean()
    std = float(a.std())
    if std > 0:  # a 1x1 field has none
        a /= std
    return a


@dataclass
class _Canvas:
    """Everything reused from image to image at one size: noise textures and work buffers.

    The textures are cropped at random offsets (and flipped) for every image. The buffers are
    there because allocating fresh full-size arrays costs more than the arithmetic done in them
    (page faults on every fresh multi-MB block).

    Attributes:
        width: Output width.
        height: Output height.
        mid: Mid-frequency 1/f-like texture, float32, std 1, larger than the output by a margin.
        grain: Fine grain (white noise, blurred to ~1 px like demosaiced sensor noise),
            float32, std 1, same size as ``mid``.
        low: Three-channel coarse noise at scene resolution plus a margin, float32, std 1.
        vignette: Squared distance from the centre at scene resolution, 0 there and 1 at the
            corners, float32.
    """

    width: int
    height: int
    mid: np.ndarray
    grain: np.ndarray
    low: np.ndarray
    vignette: np.ndarray

    def __post_init__(self) -> None:
        sw, sh = _scene_size(self.width, self.height)
        h, w = self.height, self.width
        f32 = np.float32
        self.scene = np.empty((sh, sw, 3), f32)
        self.amp = np.empty((sh, sw), f32)
        self.light = np.empty((sh, sw), f32)
        self.scene3 = np.empty((sh, sw, 3), f32)  # the light, then the coarse-noise crop
        self.scene8 = np.empty((sh, sw, 3), np.uint8)
        self.scene_full = np.empty((h, w, 3), np.uint8)
        self.mod = np.empty((h, w), f32)
        self.crop = np.empty((h, w), f32)
        # The final multiply runs in bands of ~1 M pixels (all of a 720x480 image): a
        # full-size 3-channel float32 copy of the modulation would be 144 MB at 4000x3000.
        self.band = max(1, (1 << 20) // w)
        self.mod3 = np.empty((min(h, self.band), w, 3), f32)
        self.out = np.empty((h, w, 3), np.uint8)

    @classmethod
    def create(cls, rng: np.random.Generator, width: int, height: int) -> _Canvas:
        """Make the textures and buffers for a size (the slow part: once per size)."""
        th, tw = height + _margin(height), width + _margin(width)
        mid = _octave_noise(rng, th, tw, _MID_OCTAVES)
        grain = rng.standard_normal((th, tw), dtype=np.float32)
        grain = _normalise(cv2.GaussianBlur(grain, (0, 0), _GRAIN_BLUR, dst=grain))
        sw, sh = _scene_size(width, height)
        low = _octave_noise(rng, sh + _margin(sh), sw + _margin(sw), _LOW_OCTAVES, channels=3)
        # Mostly brightness, some hue: independent channels alone make garish purple/green
        # blotches that photographs of real surfaces do not have.
        lum = low.mean(axis=2, keepdims=True)
        low = _normalise(lum + _LOW_CHROMA * (low - lum))
        ys = (np.arange(sh, dtype=np.float32) + 0.5) / sh - 0.5
        xs = (np.arange(sw, dtype=np.float32) + 0.5) / sw - 0.5
        vignette = (2.0 * (ys[:, None] ** 2 + xs[None, :] ** 2)).astype(np.float32)
        return cls(width, height, mid, grain, low, vignette)


def _crop(rng: np.random.Generator, texture: np.ndarray, out: np.ndarray) -> np.ndarray:
    """A random crop of texture the size of out, randomly flipped: out, or a view of texture."""
    height, width = out.shape[:2]
    y = int(rng.integers(0, texture.shape[0] - height + 1))
    x = int(rng.integers(0, texture.shape[1] - width + 1))
    flip = int(rng.integers(-1, 3))  # -1, 0, 1: cv2.flip codes; 2: no flip
    view = texture[y : y + height, x : x + width]
    if flip == 2:
        return view  # OpenCV reads strided views in place
    return cv2.flip(view, flip, dst=out).reshape(out.shape)


def _hsv_to_bgr(hue: float, sat: float, val: float) -> np.ndarray:
    """BGR colour in 0-255 (float32, shape (3,)) of a hue in degrees, saturation and value 0-1."""
    hsv = np.array([[[hue % 360.0, sat, val]]], np.float32)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)[0, 0] * np.float32(255.0)


def _colour(rng: np.random.Generator, hue: float) -> np.ndarray:
    """A colour that is near hue most of the time, a muted random one otherwise."""
    if rng.random() < 0.7:
        return _hsv_to_bgr(
            hue + rng.normal(0.0, 15.0), rng.uniform(0.25, 0.85), rng.uniform(0.25, 0.95)
        )
    return _hsv_to_bgr(rng.uniform(0.0, 360.0), rng.uniform(0.05, 0.6), rng.uniform(0.15, 0.95))


# Shape kinds; a class favours one of them (see _render).
_KINDS = 4  # 0 ellipse, 1 rotated rectangle, 2 irregular polygon, 3 thick stroke
_SHIFT = 4  # fractional bits for cv2 drawing coordinates: sub-pixel shape positions
_ONE = 1 << _SHIFT


def _draw_shape(
    rng: np.random.Generator, kind: int, mask: np.ndarray, cx: float, cy: float, r: float
) -> None:
    """Draw a filled shape of kind centred at (cx, cy), radius about r, into mask (value 1)."""
    angle = rng.uniform(0.0, 360.0)
    if kind == 0:
        axes = (max(1, round(r * _ONE)), max(1, round(r * rng.uniform(0.3, 1.0) * _ONE)))
        cv2.ellipse(
            mask,
            (round(cx * _ONE), round(cy * _ONE)),
            axes,
            angle,
            0.0,
            360.0,
            1.0,
            -1,
            cv2.LINE_AA,
            _SHIFT,
        )
        return
    if kind == 1:
        box = ((cx, cy), (2 * r, 2 * r * rng.uniform(0.25, 1.0)), angle)
        points = cv2.boxPoints(box)
    elif kind == 2:
        n = int(rng.integers(5, 12))
        t = np.sort(rng.uniform(0.0, 2 * math.pi, n))
        rad = r * rng.uniform(0.45, 1.0, n)
        points = np.stack([cx + rad * np.cos(t), cy + rad * np.sin(t)], axis=1)
    else:
        theta = math.radians(angle)
        dx, dy = r * math.cos(theta), r * math.sin(theta)
        thick = max(1, round(r * rng.uniform(0.08, 0.25)))
        cv2.line(
            mask,
            (round((cx - dx) * _ONE), round((cy - dy) * _ONE)),
            (round((cx + dx) * _ONE), round((cy + dy) * _ONE)),
            1.0,
            thick,
            cv2.LINE_AA,
            _SHIFT,
        )
        return
    pts = np.round(np.asarray(points, np.float64) * _ONE).astype(np.int32)
    cv2.fillPoly(mask, [pts], 1.0, cv2.LINE_AA, _SHIFT)


def _shape_mask(
    rng: np.random.Generator,
    kind: int,
    width: int,
    height: int,
    cx: float,
    cy: float,
    r: float,
    sigma: float,
) -> np.ndarray:
    """A width x height float32 mask, 1 inside a shape of kind at (cx, cy), edge blurred by sigma.

    A wide blur is done by drawing at a lower resolution, blurring there by ~2 px and upsampling,
    far cheaper than a direct GaussianBlur of a large sigma.
    """
    if sigma <= 0.3:
        mask: np.ndarray = np.zeros((height, width), np.float32)
        _draw_shape(rng, kind, mask, cx, cy, r)
        return mask
    down = max(1.0, sigma / 2.0)
    sw, sh = max(1, math.ceil(width / down)), max(1, math.ceil(height / down))
    mask = np.zeros((sh, sw), np.float32)
    _draw_shape(rng, kind, mask, cx / down, cy / down, r / down)
    mask = cv2.GaussianBlur(mask, (0, 0), sigma / down)
    if down > 1.0:
        mask = cv2.resize(mask, (width, height), interpolation=cv2.INTER_LINEAR)
    return mask.reshape(height, width)


def _render(
    rng: np.random.Generator, canvas: _Canvas, hue: float, kind_bias: int | None
) -> np.ndarray:
    """Render one photo-like image into canvas.out (BGR uint8, overwritten by the next call).

    Args:
        rng: Source of every random choice for this image.
        canvas: Textures and buffers for the output size.
        hue: Dominant hue in degrees.
        kind_bias: Shape kind (0 to _KINDS - 1) drawn 60 % of the time, or None for no bias.

    Returns:
        canvas.out.
    """
    width, height = canvas.width, canvas.height
    sw, sh = _scene_size(width, height)
    # Background: a 3x2 grid of colours (sky, middle, ground), bilinearly stretched, which
    # leaves flat-ish bands at top and bottom and gradients between them.
    grid = np.stack([np.stack([_colour(rng, hue) for _ in range(2)]) for _ in range(3)])
    scene = cv2.resize(grid, (sw, sh), dst=canvas.scene, interpolation=cv2.INTER_LINEAR)
    scene = scene.reshape(sh, sw, 3)
    # Texture strength per region: smooth (sky, walls) to busy (foliage, fabric).
    amp = canvas.amp
    amp.fill(rng.uniform(*_MID_AMP))

    _draw_shapes(rng, scene, amp, hue, kind_bias)

    # Illumination: a random 2x2 brightness field (light from one side) times a vignette.
    light: np.ndarray = rng.uniform(0.65, 1.2, (2, 2)).astype(np.float32)
    light = cv2.resize(light, (sw, sh), dst=canvas.light, interpolation=cv2.INTER_LINEAR)
    light = light.reshape(sh, sw)
    np.multiply(light, 1.0 - np.float32(rng.uniform(0.0, 0.35)) * canvas.vignette, out=light)
    light3 = cv2.cvtColor(light, cv2.COLOR_GRAY2BGR, dst=canvas.scene3).reshape(sh, sw, 3)
    cv2.multiply(scene, light3, dst=scene)
    # Coarse colour noise: hue and brightness blotches inside the flat shapes.
    cv2.scaleAdd(_crop(rng, canvas.low, canvas.scene3), rng.uniform(*_LOW_AMP), scene, dst=scene)

    # The scene is upsampled as uint8: a quarter of the memory of float32 at full size (36 MB,
    # not 144, at 4000x3000) and a faster resize; the grain hides the 1-level steps.
    np.clip(scene, 0.0, 255.0, out=scene)
    scene8 = cv2.convertScaleAbs(scene, dst=canvas.scene8).reshape(sh, sw, 3)  # rounds

    # Full resolution: the scene times a luminance modulation 1 + amp * mid + g * grain. Only
    # these few OpenCV passes (~0.7 ms at 720x480) run at full size; the encoder costs ~1.2 ms.
    full = cv2.resize(
        scene8, (width, height), dst=canvas.scene_full, interpolation=cv2.INTER_LINEAR
    )
    mod: np.ndarray = cv2.resize(
        amp, (width, height), dst=canvas.mod, interpolation=cv2.INTER_LINEAR
    )
    mod = mod.reshape(height, width)
    cv2.multiply(mod, _crop(rng, canvas.mid, canvas.crop), dst=mod)
    cv2.scaleAdd(_crop(rng, canvas.grain, canvas.crop), rng.uniform(*_GRAIN), mod, dst=mod)
    mod += 1.0
    out = canvas.out
    for y in range(0, height, canvas.band):
        y1 = min(height, y + canvas.band)
        mod3 = cv2.cvtColor(mod[y:y1], cv2.COLOR_GRAY2BGR, dst=canvas.mod3[: y1 - y])
        # Rounds and saturates to 0-255 in the same pass.
        cv2.multiply(full[y:y1], mod3.reshape(y1 - y, width, 3), dst=out[y:y1], dtype=cv2.CV_8U)
    return out


def _draw_shapes(
    rng: np.random.Generator,
    scene: np.ndarray,
    amp: np.ndarray,
    hue: float,
    kind_bias: int | None,
) -> None:
    """Draw 3 to 8 shaded shapes into ``scene`` (sh x sw x 3 float32), each with its texture
    strength in ``amp`` (sh x sw); ``hue`` and ``kind_bias`` as ``_render``'s."""
    sh, sw = amp.shape
    side = min(sw, sh)
    for _ in range(int(rng.integers(3, 9))):
        if kind_bias is not None and rng.random() < 0.6:
            kind = kind_bias
        else:
            kind = int(rng.integers(0, _KINDS))
        r = side * rng.uniform(0.08, 0.45)
        cx, cy = rng.uniform(-0.1, 1.1) * sw, rng.uniform(-0.1, 1.1) * sh
        # Soft edges on about half the shapes (defocus); the others keep the ~2 px upsampling
        # edge, the sharpest a photograph normally has.
        sigma = r * rng.uniform(0.02, 0.15) if rng.random() < 0.5 else 0.0
        pad = r * 1.05 + 3 * sigma + 2
        x0, x1 = max(0, math.floor(cx - pad)), min(sw, math.ceil(cx + pad))
        y0, y1 = max(0, math.floor(cy - pad)), min(sh, math.ceil(cy + pad))
        if x0 >= x1 or y0 >= y1:
            continue
        mask = _shape_mask(rng, kind, x1 - x0, y1 - y0, cx - x0, cy - y0, r, sigma)
        # Shading: the colour times a random brightness at each corner, bilinearly spread, as
        # from light falling unevenly on the shape. A 2x2 resize is ~10x cheaper than a ramp
        # computed per pixel in numpy.
        corners = rng.uniform(0.6, 1.3, (2, 2, 1)).astype(np.float32) * _colour(rng, hue)
        target = cv2.resize(corners, (x1 - x0, y1 - y0), interpolation=cv2.INTER_LINEAR)
        roi = scene[y0:y1, x0:x1]
        roi[...] = cv2.blendLinear(target.reshape(roi.shape), roi, mask, 1.0 - mask)
        aroi = amp[y0:y1, x0:x1]
        aroi += mask * (np.float32(rng.uniform(*_MID_AMP)) - aroi)


def _check_size(height: int, width: int) -> None:
    if width < 1 or height < 1:
        raise ValueError(
            f"image size must be at least 1x1, got (height, width) = ({height}, {width})"
        )


def make_photo(
    rng: np.random.Generator, height: int, width: int, *, hue: float | None = None
) -> np.ndarray:
    """Make one photo-like image.

    Builds its own noise textures each call (several times the cost of the image itself), so
    for many images use :func:`make_image_folder`, which builds them once.

    Args:
        rng: Source of randomness; the image is a function of its state.
        height: Image height in pixels, at least 1.
        width: Image width in pixels, at least 1.
        hue: Dominant hue in degrees (0 red, 120 green, 240 blue); random if None.

    Returns:
        A height x width x 3 uint8 BGR array.

    Raises:
        ValueError: If width or height is below 1.
    """
    height, width = int(height), int(width)
    _check_size(height, width)
    canvas = _Canvas.create(rng, width, height)
    if hue is None:
        hue = rng.uniform(0.0, 360.0)
    return _render(rng, canvas, float(hue), None)


def make_image_folder(
    root: str | os.PathLike[str],
    *,
    classes: int = 4,
    per_class: int = 50,
    size: tuple[int, int] = (480, 720),
    quality: int = 90,
    seed: int = 0,
    ext: str = ".jpg",
) -> Path:
    """Write classes x per_class photo-like images as an ImageFolder tree and return root.

    Files are ``root/class_XX/img_XXXXX<ext>``, ext lower-cased, numbers zero-padded (wider when
    classes or per_class need it) so that name order is numeric order. Class ``c`` has a dominant
    hue of ``360 * c / classes`` degrees and a favourite kind of shape. Existing files of those
    names are overwritten; nothing else in root is touched.

    The output is deterministic: the same arguments give the same bytes with the same numpy and
    OpenCV. Image ``(c, i)`` depends only on seed, size, quality, ext, classes, c and i, not on
    per_class.

    Args:
        root: Folder to write into; created if missing.
        classes: Number of class folders, at least 1.
        per_class: Images per class, at least 1.
        size: Image size as (height, width), as torchvision's sizes, each at least 1.
        quality: JPEG quality 0-100; ignored for PNG.
        seed: Non-negative random seed.
        ext: ``".jpg"``, ``".jpeg"`` or ``".png"`` (any case).

    Returns:
        root as a Path.

    Raises:
        ValueError: If an argument is out of range or ext is not supported.
    """
    height, width = (int(v) for v in size)
    _check_size(height, width)
    if classes < 1 or per_class < 1:
        raise ValueError(f"classes and per_class must be at least 1, got {classes}, {per_class}")
    if not 0 <= quality <= 100:
        raise ValueError(f"quality must be in 0-100, got {quality}")
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    suffix = ext.lower()
    if suffix not in _ENCODERS:
        raise ValueError(f"ext must be one of {sorted(_ENCODERS)}, got {ext!r}")
    encoder = _ENCODERS[suffix]
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality)] if encoder == ".jpg" else []

    root = Path(root)
    canvas = _Canvas.create(np.random.default_rng([seed, 0]), width, height)
    class_digits = max(2, len(str(classes - 1)))
    image_digits = max(5, len(str(per_class - 1)))
    # Encoding and writing run in a second thread while the next image renders: OpenCV lets go
    # of the GIL in imencode, and on two cores this takes 720x480 images from ~5.5-6.3 to
    # ~3.7-4.4 ms each, 224x224 ones from ~2.8 to ~1.6 ms, and 64x48 ones from ~2 to ~1.7 ms.
    pending: deque[Future[None]] = deque()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmcache-sample-data") as pool:
        for c in range(classes):
            folder = root / f"class_{c:0{class_digits}d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                # One stream per image, so an image does not depend on how many came before it.
                rng = np.random.default_rng([seed, 1, c, i])
                hue = 360.0 * c / classes + rng.normal(0.0, 6.0)
                img = _render(rng, canvas, hue, c % _KINDS).copy()  # canvas.out is reused
                path = folder / f"img_{i:0{image_digits}d}{suffix}"
                pending.append(pool.submit(_write, path, img, encoder, params))
                if len(pending) > _PENDING:
                    pending.popleft().result()
        while pending:
            pending.popleft().result()
    return root


def _write(path: Path, img: np.ndarray, encoder: str, params: list[int]) -> None:
    """Encode img with cv2.imencode(encoder, img, params) and write the bytes to path."""
    ok, buf = cv2.imencode(encoder, img, params)
    if not ok:  # pragma: no cover - cv2 fails only on invalid input
        raise RuntimeError(f"cv2.imencode({encoder!r}) failed for {path}")
    path.write_bytes(buf.tobytes())


# The class colours of the annotated sets (RGB). The first four are corners of the RGB cube
# that make a regular tetrahedron: of any weighted mean of them (what a resize makes of
# neighbouring pixels), the nearest is the one of the largest weight, so a pixel's class reads
# back from its colour.
CLASS_COLOURS = np.array(
    [(0, 0, 0), (255, 255, 0), (255, 0, 255), (0, 255, 255), (255, 255, 255), (128, 0, 0),
     (0, 128, 0), (0, 0, 128)], np.uint8,
)  # fmt: skip


# The share of a photo-like image mixed into an annotated set's colours with ``texture``: at
# 500x375, quality 90, its JPEGs average 45 KB (a quarter gave 29 KB; photo-like images alone
# are 80-200 KB at 720x480).
TEXTURE = 0.6


def make_segmentation_set(
    root: str | os.PathLike[str],
    *,
    images: int = 40,
    size: tuple[int, int] = (240, 320),
    classes: int = 4,
    seed: int = 0,
    ext: str = ".png",
    palette: bool = False,
    texture: bool = False,
) -> tuple[Path, Path]:
    """Write a VOC-like segmentation set: ``root/images/img_XXXXX<ext>`` and their masks
    ``root/masks/img_XXXXX.png``; returns the two folders.

    Each image is background (class 0) with random rectangles and ellipses of the other
    classes, each pixel ``CLASS_COLOURS[class]``; its mask holds the class numbers, 8-bit
    grey, or a palette PNG (VOC's kind, written with Pillow) with ``palette``. ``texture``
    mixes a photo-like image into the colours (``TEXTURE`` of each pixel: for benchmarks,
    JPEGs that cost what photos cost to decode); without it the colours are exact, so a pixel's
    class reads back from its colour.
    Sizes vary by up to a quarter around ``size`` (height, width). Deterministic.

    Raises:
        ValueError: an argument out of range.
        ImportError: ``palette`` without Pillow.
    """
    if not 2 <= classes <= len(CLASS_COLOURS):
        raise ValueError(f"classes must be 2 to {len(CLASS_COLOURS)}, got {classes}")
    if images < 1 or seed < 0:
        raise ValueError(f"images must be at least 1 and seed non-negative, got {images}, {seed}")
    suffix = ext.lower()
    if suffix not in _ENCODERS:
        raise ValueError(f"ext must be one of {sorted(_ENCODERS)}, got {ext!r}")
    root = Path(root)
    image_dir, mask_dir = root / "images", root / "masks"
    image_dir.mkdir(parents=True, exist_ok=True)
    mask_dir.mkdir(parents=True, exist_ok=True)
    canvas = None
    for k in range(images):
        rng = np.random.default_rng([seed, 2, k])
        h, w = (int(v * rng.uniform(0.75, 1.25)) for v in size)
        _check_size(h, w)
        mask = np.zeros((h, w), np.uint8)
        for _ in range(int(rng.integers(2, 6))):
            c = int(rng.integers(1, classes))
            cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
            ry = int(rng.integers(h // 8 + 1, h // 3 + 2))
            rx = int(rng.integers(w // 8 + 1, w // 3 + 2))
            if rng.random() < 0.5:
                cv2.rectangle(mask, (cx - rx, cy - ry), (cx + rx, cy + ry), c, -1)
            else:
                cv2.ellipse(mask, (cx, cy), (rx, ry), 0, 0, 360, c, -1)
        rgb: np.ndarray = CLASS_COLOURS[mask]
        if texture:
            if canvas is None or canvas.out.shape[:2] != (h, w):
                canvas = _Canvas.create(np.random.default_rng([seed, 3]), w, h)
            photo = _render(rng, canvas, float(rng.uniform(0, 360)), None)[:, :, ::-1]
            rgb = cv2.addWeighted(rgb, 1 - TEXTURE, photo, TEXTURE, 0)
        name = f"img_{k:05d}"
        encoder = _ENCODERS[suffix]
        params = [cv2.IMWRITE_JPEG_QUALITY, 90] if encoder == ".jpg" else []
        bgr: np.ndarray = np.ascontiguousarray(rgb[:, :, ::-1])
        _write(image_dir / f"{name}{suffix}", bgr, encoder, params)
        if palette:
            from PIL import Image

            im = Image.fromarray(mask, mode="P")
            im.putpalette(CLASS_COLOURS.reshape(-1).tolist())
            im.save(mask_dir / f"{name}.png")
        else:
            _write(mask_dir / f"{name}.png", mask, ".png", [])
    return image_dir, mask_dir


def make_detection_set(
    root: str | os.PathLike[str],
    *,
    images: int = 40,
    size: tuple[int, int] = (240, 320),
    seed: int = 0,
    ext: str = ".png",
    texture: bool = False,
) -> tuple[Path, Path]:
    """Write a COCO-style detection set: ``root/images/img_XXXXX<ext>`` and
    ``root/instances.json``; returns the folder and the JSON file.

    Each image holds 0 to 4 solid rectangles (every fifth image none), each of a category's
    colour (``CLASS_COLOURS[1 + its label]``) over a black background, its box the
    rectangle's pixels exactly. Categories have the non-contiguous ids 3, 7 and 11 (labels
    0, 1, 2); every third box is a crowd box. ``texture``: as ``make_segmentation_set``.
    Deterministic.
    """
    import json

    suffix = ext.lower()
    if suffix not in _ENCODERS or images < 1 or seed < 0:
        raise ValueError(f"bad ext, images or seed: {ext!r}, {images}, {seed}")
    root = Path(root)
    image_dir = root / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    ids = (3, 7, 11)
    doc: dict = {
        "images": [], "annotations": [],
        "categories": [{"id": cid, "name": n} for cid, n in zip(ids, ("cat", "dog", "car"))],
    }  # fmt: skip
    encoder = _ENCODERS[suffix]
    params = [cv2.IMWRITE_JPEG_QUALITY, 90] if encoder == ".jpg" else []
    for k in range(images):
        rng = np.random.default_rng([seed, 4, k])
        h, w = (int(v * rng.uniform(0.75, 1.25)) for v in size)
        _check_size(h, w)
        name = f"img_{k:05d}{suffix}"
        rgb = np.zeros((h, w, 3), np.uint8)
        doc["images"].append({"id": 1000 + k, "file_name": name, "height": h, "width": w})
        for _ in range(0 if k % 5 == 4 else int(rng.integers(1, 5))):
            label = int(rng.integers(0, 3))
            bw, bh = int(rng.integers(w // 8, w // 2)), int(rng.integers(h // 8, h // 2))
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            rgb[y : y + bh, x : x + bw] = CLASS_COLOURS[1 + label]
            doc["annotations"].append({
                "id": len(doc["annotations"]), "image_id": 1000 + k, "bbox": [x, y, bw, bh],
                "category_id": ids[label], "iscrowd": int(len(doc["annotations"]) % 3 == 2),
                "area": bw * bh,
            })  # fmt: skip
        bgr: np.ndarray = np.ascontiguousarray(rgb[:, :, ::-1])
        if texture:
            bgr = cv2.addWeighted(bgr, 1 - TEXTURE, make_photo(rng, h, w), TEXTURE, 0)
        _write(image_dir / name, bgr, encoder, params)
    json_path = root / "instances.json"
    json_path.write_text(json.dumps(doc))
    return image_dir, json_path
