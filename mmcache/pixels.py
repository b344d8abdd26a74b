"""Record pixel layouts: RGB or planar YUV 4:2:0 records, their byte sizes and conversions.

``"rgb"`` (the default): a record is H x W x C uint8, row-major, in the cache's colour order.

``"yuv420"``: a record is planar I420, JPEG's own colour space: the Y plane (H x W), then the
Cb plane, then the Cr plane (each ceil(H/2) x ceil(W/2)), ``H*W + 2*ceil(H/2)*ceil(W/2)``
bytes, about half of RGB. The colour matrix and range are JFIF's: BT.601 full range (OpenCV's
``COLOR_BGR2YCrCb`` / ``COLOR_YCrCb2RGB``; not its ``*_I420`` conversions, which use the
limited "video" range). Each chroma sample is the rounded mean of a 2 x 2 block of full
resolution chroma (``cv2.resize`` with ``INTER_AREA`` to exactly half); an odd height or width
first repeats its last row or column (``BORDER_REPLICATE``), so the last chroma sample covers
one row or column twice. Reading back, chroma is upsampled with ``INTER_LINEAR`` (weights 3/4
and 1/4 between neighbours: libjpeg's "fancy" triangular upsampling) to the even size, cut to
H x W, and converted. In memory an I420 record is a 0-d array of a structured dtype
(``planar_dtype``) whose fields ``y``, ``cb`` and ``cr`` are the planes: its bytes are the
record's, and its dtype carries the image's size.

A record may carry a mask (``mask``: ``"uint8"`` or ``"uint16"``, a segmentation label map of the
image's height x width): its bytes follow the image's, from the next multiple of ``MASK_ALIGN``
of the record (zeros between). In memory such a record is a 0-d array of ``masked_dtype``,
whose fields ``image`` (the image as above) and ``mask`` are views of its bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import cv2
import numpy as np

__all__ = [
    "LAYOUTS", "Layout", "MASKS", "convert", "layout_named", "record_nbytes", "yuv420_to_rgb",
]  # fmt: skip

# The dtypes a record's mask may be stored in: 8-bit label maps (VOC, ADE20K, Cityscapes) and
# 16-bit ones (more than 256 classes).
MASKS = ("uint8", "uint16")
# A mask starts at a multiple of this within its record, so its uint16 values are aligned.
MASK_ALIGN = 8
# What each layout's records convert to, for a cache of each colour order.
_TO_COLOR = {"rgb": cv2.COLOR_YCrCb2RGB, "bgr": cv2.COLOR_YCrCb2BGR}
# BT.601 full range (JFIF): R = Y + 1.402 Cr', G = Y - 0.344136 Cb' - 0.714136 Cr',
# B = Y + 1.772 Cb', where Cb' = Cb - 128 and Cr' = Cr - 128.
_FROM_YCC = ((1.0, 0.0, 1.402), (1.0, -0.344136, -0.714136), (1.0, 1.772, 0.0))

# Bytes ``start .. start + n - 1`` of one record, a flat uint8 array: a view of its bytes
# (mapped, or already read), or read into the buffer given: an array, or the name of a
# reusable scratch buffer. The reader of the record chose how, once.
Read = Callable[[int, int, "str | np.ndarray"], np.ndarray]
# ``resize(src, dst)``: an H x W x C uint8 box resized into the contiguous ``dst``.
Resize = Callable[[np.ndarray, np.ndarray], None]
# ``take(name, nbytes)``: a reusable scratch buffer.
Take = Callable[[str, int], np.ndarray]


class Layout(Protocol):
    """A record layout: how a decoded image is stored in a record and read back.

    A layout is looked up by its name (a manifest's ``pixels``) with ``layout_named``, once; every
    other module asks the object and never compares names. A record's mask is not part of its
    layout: it follows the image's bytes, whatever the layout (``record_nbytes``).
    """

    name: str  # as manifests and ``Options.pixels`` name it
    planar: bool  # stores planes converted when read: crop before converting (``planes``)
    colour_only: bool  # holds 3-channel images only (no ``color="gray"``)
    words: str  # how ``mmcache info`` describes it

    def image_nbytes(self, height: Any, width: Any, channels: Any) -> Any:
        """Bytes of an image of ``height x width x channels`` (ints or int64 arrays)."""
        ...

    def image_format(self, height: int, width: int, channels: int) -> Any:
        """The numpy dtype (or ``(dtype, shape)`` format) of one stored image."""
        ...

    def encode(self, bgr: np.ndarray, color: str, channels: int) -> np.ndarray:
        """The record of a ``cv2.imread`` image (BGR, or H x W gray) in colour order
        ``color``."""
        ...

    def view(self, flat: np.ndarray, height: int, width: int, channels: int) -> np.ndarray:
        """The image whose ``image_nbytes`` bytes are the uint8 array ``flat`` (no copy)."""
        ...

    def fill(
        self,
        read: Read,
        shape: Any,
        boxes: Sequence[Sequence[int]] | None,
        outs: Sequence[np.ndarray],
        resizes: Sequence[Resize],
        take: Take,
        color: str,
    ) -> None:
        """Write the record of ``shape`` (H, W, C), whose bytes ``read`` gives, into ``outs``
        as H x W x C images in colour order ``color``: each box ``(top, left, height,
        width)`` resized into its out with its ``resize``, reading the record once (only the
        rows the boxes span); or with ``boxes`` None the whole image into the one out."""
        ...


class RGB:
    """H x W x C uint8, row-major, in the cache's colour order (the default)."""

    name, planar, colour_only = "rgb", False, False
    words = "rgb (H x W x C)"

    def image_nbytes(self, height: Any, width: Any, channels: Any) -> Any:
        return height * width * channels

    def image_format(self, height: int, width: int, channels: int) -> Any:
        return (np.uint8, (height, width, channels))

    def encode(self, bgr: np.ndarray, color: str, channels: int) -> np.ndarray:
        img = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB) if color == "rgb" else bgr
        return img.reshape(*img.shape[:2], channels)

    def view(self, flat: np.ndarray, height: int, width: int, channels: int) -> np.ndarray:
        return flat.reshape(height, width, channels)

    def fill(
        self,
        read: Read,
        shape: Any,
        boxes: Sequence[Sequence[int]] | None,
        outs: Sequence[np.ndarray],
        resizes: Sequence[Resize],
        take: Take,
        color: str,
    ) -> None:
        height, width, channels = (int(v) for v in shape)
        if boxes is None:  # read straight into the out (a pread), or copied from a view
            flat = outs[0].reshape(-1)
            got = read(0, flat.size, flat)
            if got.ctypes.data != flat.ctypes.data:
                flat[:] = got
            return
        row = width * channels
        top = min(box[0] for box in boxes)
        count = max(box[0] + box[2] for box in boxes) - top
        rows = read(top * row, count * row, "rows").reshape(count, width, channels)
        for (t, left, h, w), out, resize in zip(boxes, outs, resizes):
            resize(rows[t - top : t - top + h, left : left + w], out)


class YUV420:
    """Planar I420 in JFIF's colour space (see the module's docstring)."""

    name, planar, colour_only = "yuv420", True, True
    words = "yuv420 (planar I420, BT.601 full range; read back as RGB)"

    def image_nbytes(self, height: Any, width: Any, channels: Any) -> Any:
        return height * width + 2 * ((height + 1) // 2) * ((width + 1) // 2)

    def image_format(self, height: int, width: int, channels: int) -> Any:
        return planar_dtype(height, width)

    def encode(self, bgr: np.ndarray, color: str, channels: int) -> np.ndarray:
        return from_bgr(bgr, self.name)  # from imread's BGR, whatever the colour order

    def view(self, flat: np.ndarray, height: int, width: int, channels: int) -> np.ndarray:
        return flat.view(planar_dtype(height, width)).reshape(())

    def fill(
        self,
        read: Read,
        shape: Any,
        boxes: Sequence[Sequence[int]] | None,
        outs: Sequence[np.ndarray],
        resizes: Sequence[Resize],
        take: Take,
        color: str,
    ) -> None:
        size = (int(shape[0]), int(shape[1]))
        if boxes is None:
            flat = read(0, self.image_nbytes(*size, 3), "rows")
            convert(*planes(self.view(flat, *size, 3)), color, outs[0])
            return
        # The rows of each plane that all the boxes are converted from, read once; each box
        # is then converted alone (``crop_into``: the pixels of the whole record's conversion).
        top = min(box[0] for box in boxes)
        span = (top, 0, max(box[0] + box[2] for box in boxes) - top, size[1])
        y, cb, cr = plane_rows(read, size, span)
        rows_from = (top, chroma_window(span, size)[0])
        for box, out, resize in zip(boxes, outs, resizes):
            crop_into(y, cb, cr, box, size, out, resize, take, color, rows_from)


def plane_rows(
    read: Read, shape: tuple[int, int], box: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of each plane of an I420 record of ``shape`` (H, W) that its ``box`` is
    converted from (``chroma_window``), whole rows, as ``read`` gives them."""
    height, width = shape
    chroma_width = chroma_shape(height, width)[1]
    chroma_top, _, chroma_rows, _ = chroma_window(box, shape)
    starts = plane_offsets(height, width)
    y = read(starts[0] + box[0] * width, box[2] * width, "luma_rows")
    cb, cr = (
        read(start + chroma_top * chroma_width, chroma_rows * chroma_width, name)
        for start, name in ((starts[1], "cb_rows"), (starts[2], "cr_rows"))
    )
    chroma = (chroma_rows, chroma_width)
    return y.reshape(box[2], width), cb.reshape(chroma), cr.reshape(chroma)


# Every layout, by name: the one table a new layout is added to (the first is the default).
_TABLE: dict[str, Layout] = {one.name: one for one in (RGB(), YUV420())}
LAYOUTS = tuple(_TABLE)


def layout_named(name: str) -> Layout:
    """The layout named ``name`` (a manifest's ``pixels``); ValueError if there is none."""
    found = _TABLE.get(name)
    if found is None:
        raise ValueError(f"unknown pixel layout {name!r}")
    return found


def known(name: str) -> bool:
    """Whether ``name`` names a layout this mmcache reads."""
    return name in _TABLE


def check_layout(layout: str) -> str:
    """``layout`` if it is one of ``LAYOUTS``; ValueError otherwise."""
    if layout not in _TABLE:
        raise ValueError(f"pixels must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def chroma_shape(height: int, width: int) -> tuple[int, int]:
    """The (height, width) of each chroma plane of an I420 record of ``height x width``."""
    return (height + 1) // 2, (width + 1) // 2


def record_nbytes(
    height: Any, width: Any, channels: Any, layout: str, mask: str | None = None
) -> Any:
    """Bytes of a record of ``height x width x channels`` stored as ``layout``, with a
    ``mask`` of that dtype if given (works on ints and on int64 arrays alike): the one place a
    record's size is defined."""
    image = layout_named(layout).image_nbytes(height, width, channels)
    if mask is None:
        return image
    return mask_offset(image) + height * width * np.dtype(mask).itemsize


def mask_offset(image_nbytes: Any) -> Any:
    """Where a record's mask starts: after its image's bytes, at the next ``MASK_ALIGN``."""
    return -(-image_nbytes // MASK_ALIGN) * MASK_ALIGN


def read_mask(read: Read, layout: Layout, shape: Any, mask: str) -> np.ndarray:
    """The H x W mask of a record of ``shape`` stored as ``layout`` with masks of dtype
    ``mask``, as ``read`` gives its bytes."""
    height, width, channels = (int(v) for v in shape)
    dtype = np.dtype(mask)
    start = int(mask_offset(layout.image_nbytes(height, width, channels)))
    flat = read(start, height * width * dtype.itemsize, "mask")
    return flat.view(dtype).reshape(height, width)


def flat_bytes(record: np.ndarray) -> np.ndarray:
    """A stored record's bytes (image, then mask if any) as a flat uint8 array: a view of a
    contiguous record."""
    return np.ascontiguousarray(record).reshape(-1).view(np.uint8)


def check_mask(mask: str | None) -> str | None:
    """``mask`` if it is None or one of ``MASKS``; ValueError otherwise."""
    if mask is not None and mask not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {mask!r}")
    return mask


def masked_dtype(height: int, width: int, channels: int, layout: str, mask: str) -> np.dtype:
    """The structured dtype of one record with a mask: fields ``image`` and ``mask``."""
    stored = layout_named(layout)
    nbytes = stored.image_nbytes(height, width, channels)
    return np.dtype(
        {
            "names": ["image", "mask"],
            "formats": [stored.image_format(height, width, channels),
                        (np.dtype(mask), (height, width))],  # fmt: skip
            "offsets": [0, mask_offset(nbytes)],
            "itemsize": record_nbytes(height, width, channels, layout, mask),
        }
    )


def image_part(record: np.ndarray) -> np.ndarray:
    """The image of a stored record (without its mask, if it has one)."""
    names = record.dtype.names
    return record["image"] if names and "mask" in names else record


def mask_part(record: np.ndarray) -> np.ndarray | None:
    """The H x W mask of a stored record, or None if it has none."""
    names = record.dtype.names
    return record["mask"] if names and "mask" in names else None


def with_mask(image: np.ndarray, mask: np.ndarray, dtype: str) -> np.ndarray:
    """The stored record of ``image`` (a record as ``from_bgr`` or the RGB array) and its
    H x W ``mask`` (cast to ``dtype``, whose range the caller checked)."""
    h, w, c = image_shape(image)
    record = np.zeros((), masked_dtype(h, w, c, "rgb" if not image.dtype.names else "yuv420",
                                       dtype))  # fmt: skip
    record["image"] = image
    record["mask"] = mask
    return record


def planar_dtype(height: int, width: int) -> np.dtype:
    """The structured dtype of one I420 record: fields ``y``, ``cb``, ``cr`` (the planes)."""
    ch, cw = chroma_shape(height, width)
    return np.dtype([("y", np.uint8, (height, width)), ("cb", np.uint8, (ch, cw)),
                     ("cr", np.uint8, (ch, cw))])  # fmt: skip


def image_shape(record: np.ndarray) -> tuple[int, ...]:
    """The (H, W, C) of the image a stored record holds, whatever its layout."""
    names = record.dtype.names
    if names and "mask" in names:
        return image_shape(record["image"])
    if names:
        return (*record.dtype["y"].shape, 3)
    return record.shape


def stored_view(flat: np.ndarray, shape: Any, layout: str, mask: str | None = None) -> np.ndarray:
    """The record whose ``record_nbytes`` bytes are the uint8 array ``flat``, as its layout
    holds it (no copy): H x W x C for ``"rgb"``, a 0-d planar array for ``"yuv420"``, a 0-d
    ``masked_dtype`` array for a record with a ``mask``."""
    h, w, c = (int(v) for v in shape)
    if mask is not None:
        return flat.view(masked_dtype(h, w, c, layout, mask)).reshape(())
    return layout_named(layout).view(flat, h, w, c)


def planes(record: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (Y, Cb, Cr) plane views of an I420 record."""
    record = image_part(record)
    return record["y"], record["cb"], record["cr"]


def from_bgr(img: np.ndarray, layout: str) -> np.ndarray:
    """The I420 record of a ``cv2.imread`` (BGR) image, H x W x 3 uint8, for ``"yuv420"``."""
    if layout != "yuv420":
        raise ValueError(f"from_bgr makes yuv420 records, not {layout!r}")
    h, w = img.shape[:2]
    ch, cw = chroma_shape(h, w)
    ycc = cv2.cvtColor(img, cv2.COLOR_BGR2YCrCb)
    record = np.empty((), planar_dtype(h, w))
    cv2.extractChannel(ycc, 0, dst=record["y"])
    if (2 * ch, 2 * cw) != (h, w):
        ycc = cv2.copyMakeBorder(ycc, 0, 2 * ch - h, 0, 2 * cw - w, cv2.BORDER_REPLICATE)
    # INTER_AREA to exactly half is the rounded mean of each 2 x 2 block.
    half = cv2.resize(ycc, (cw, ch), interpolation=cv2.INTER_AREA)
    cv2.extractChannel(half, 2, dst=record["cb"])
    cv2.extractChannel(half, 1, dst=record["cr"])
    return record


def to_image(record: np.ndarray, color: str = "rgb", out: np.ndarray | None = None) -> np.ndarray:
    """The H x W x 3 image of a stored record: an I420 record converted (into ``out`` if
    given), an RGB record as it is. ``color``: the cache's colour order (rgb or bgr)."""
    record = image_part(record)
    if not record.dtype.names:
        if out is None:
            return record
        out[...] = record
        return out
    return convert(*planes(record), color, out)


def convert(
    y: np.ndarray,
    cb: np.ndarray,
    cr: np.ndarray,
    color: str = "rgb",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The H x W x 3 image (RGB, or BGR for ``color="bgr"``) of I420 planes, into ``out``
    if given."""
    h, w = y.shape
    if cb.shape != chroma_shape(h, w):
        raise ValueError(f"chroma planes of {cb.shape} do not fit a {h}x{w} luma plane")
    ycc = ycc_window(y, cb, cr, (0, 0, h, w), (h, w), thread_buffer)
    if out is None:
        return cv2.cvtColor(ycc, _TO_COLOR[color])
    done = cv2.cvtColor(ycc, _TO_COLOR[color], dst=out)
    if done.ctypes.data != out.ctypes.data:  # cv2 made its own array: out was not usable
        out[...] = done
    return out


# Each thread's conversion buffers, kept: memory freed and taken again is slow to touch on
# some machines (a VM whose freed pages go back to the host), and a dataset converts a record
# per sample.
_buffers = threading.local()


def thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable buffer ``name`` of at least ``nbytes``."""
    buf = getattr(_buffers, name, None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(nbytes, np.uint8)
        setattr(_buffers, name, buf)
    return buf[:nbytes]


def plane_offsets(height: int, width: int) -> tuple[int, int, int]:
    """Where the Y, Cb and Cr planes start in an I420 record of ``height x width``."""
    ch, cw = chroma_shape(height, width)
    return 0, height * width, height * width + ch * cw


def chroma_span(start: int, length: int, samples: int) -> tuple[int, int]:
    """The chroma rows (or columns) ``[first, end)`` that luma rows ``start .. start + length
    - 1`` are upsampled from, of a plane of ``samples``: the half coordinates with one sample
    more each side (bilinear at exactly 2x reads the two nearest), within the plane. Upsampled
    alone, they give those luma rows exactly as upsampling the whole plane does."""
    return max(0, start // 2 - 1), min(samples, (start + length) // 2 + 1)


def chroma_window(box: Sequence[int], shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """The chroma planes' window ``(top, left, height, width)`` that the luma ``box`` of a
    record of ``shape`` (H, W) is converted from (``chroma_span`` of its rows and columns)."""
    ch, cw = chroma_shape(*shape)
    top, bottom = chroma_span(box[0], box[2], ch)
    left, right = chroma_span(box[1], box[3], cw)
    return top, left, bottom - top, right - left


def ycc_window(
    y: np.ndarray,
    cb: np.ndarray,
    cr: np.ndarray,
    box: Sequence[int],
    shape: tuple[int, int],
    take: Callable[[str, int], np.ndarray],
    rows_from: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """The box ``(top, left, height, width)`` of an I420 record of ``shape`` (H, W) as
    YCrCb (OpenCV's channel order): a height x width x 3 view of a ``take`` buffer. Its chroma
    window is upsampled alone at 2x with ``INTER_LINEAR``, so every pixel equals the same pixel
    of the whole record's. ``take(name, nbytes)`` gives reusable scratch buffers;
    ``rows_from``: the record rows the given Y and chroma planes start at, when they hold only
    the rows the box needs (read with ``pread``)."""
    top, left, bh, bw = box
    ct, cl, cbh, cbw = chroma_window(box, shape)
    rows = slice(ct - rows_from[1], ct - rows_from[1] + cbh)
    size = (2 * cbh, 2 * cbw)
    # The planes of the window as three whole arrays of one size, then one merge: OpenCV
    # merges whole arrays several times faster than windows of planes (strided rows) or
    # arrays of mixed channel counts, and numpy interleaves slower still.
    dy, dx = top - 2 * ct, left - 2 * cl
    luma = take("luma", size[0] * size[1]).reshape(size)
    # Only the box's pixels of the luma are read: the rest of the window (a margin of up to
    # three pixels) is not returned.
    y_top = top - rows_from[0]
    luma[dy : dy + bh, dx : dx + bw] = y[y_top : y_top + bh, left : left + bw]
    upsampled = []
    for name, plane in (("cr", cr), ("cb", cb)):
        up = take(name, size[0] * size[1]).reshape(size)
        cv2.resize(plane[rows, cl : cl + cbw], size[::-1], dst=up, interpolation=cv2.INTER_LINEAR)
        upsampled.append(up)
    ycc = take("ycc", size[0] * size[1] * 3).reshape(*size, 3)
    cv2.merge([luma, *upsampled], dst=ycc)
    return ycc[dy : dy + bh, dx : dx + bw]


def converted_window(
    y: np.ndarray,
    cb: np.ndarray,
    cr: np.ndarray,
    box: Sequence[int],
    shape: tuple[int, int],
    color: str,
    take: Callable[[str, int], np.ndarray],
    rows_from: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """The box of ``ycc_window`` converted to ``color``: a contiguous height x width x 3
    ``take`` buffer holding the same pixels as the whole record's conversion."""
    ycc = ycc_window(y, cb, cr, box, shape, take, rows_from)
    # Converted straight out of the window into a contiguous buffer: the conversion is the
    # copy, and torch's resize reads a contiguous source far faster than a strided one.
    out = take("box", ycc.size).reshape(ycc.shape)
    return cv2.cvtColor(ycc, _TO_COLOR[color], dst=out)


def crop_into(
    y: np.ndarray,
    cb: np.ndarray,
    cr: np.ndarray,
    box: Sequence[int],
    shape: tuple[int, int],
    out: np.ndarray,
    resize: Callable[[np.ndarray, np.ndarray], None],
    take: Callable[[str, int], np.ndarray],
    color: str = "rgb",
    rows_from: tuple[int, int] = (0, 0),
) -> None:
    """Resize the box ``(top, left, height, width)`` of an I420 record of ``shape`` (H, W)
    into the H x W x 3 ``out``: the box converted (``converted_window``: the pixels of the
    whole record's conversion), then ``resize(src, dst)``, so a crop equals the same crop of
    the record read as RGB. ``take`` gives reusable scratch buffers."""
    resize(converted_window(y, cb, cr, box, shape, color, take, rows_from), out)


def yuv420_to_rgb(y: Any, cb: Any, cr: Any) -> Any:
    """RGB images from I420 planes (``dataset.planes(i)``), as numpy arrays or torch tensors
    on any device (say, on the GPU after copying the planes there).

    Args:
        y: ``(..., H, W)`` uint8 luma.
        cb: ``(..., ceil(H/2), ceil(W/2))`` uint8 blue-difference chroma.
        cr: ``(..., ceil(H/2), ceil(W/2))`` uint8 red-difference chroma.

    Returns:
        ``(..., H, W, 3)`` uint8 RGB, of the inputs' kind. numpy inputs give exactly what
        ``MemmapImageDataset`` returns; torch tensors are converted with torch operations
        (bilinear chroma upsampling, the BT.601 full-range matrix, rounded to the nearest
        level), within two levels of it (the numpy path is OpenCV's fixed-point conversion).
    """
    if isinstance(y, np.ndarray):
        if y.ndim == 2:
            return convert(y, cb, cr)
        out = np.empty((*y.shape, 3), np.uint8)
        for i in np.ndindex(*y.shape[:-2]):
            convert(y[i], cb[i], cr[i], "rgb", out[i])
        return out
    return _torch_to_rgb(y, cb, cr)


def _torch_to_rgb(y: Any, cb: Any, cr: Any) -> Any:
    import torch
    import torch.nn.functional as F

    h, w = y.shape[-2:]
    ch, cw = cb.shape[-2:]
    lead = y.shape[:-2]
    chroma = torch.stack([cb, cr], -3).reshape(-1, 2, ch, cw).float()
    # bilinear, align_corners=False at exactly 2x: the 3/4, 1/4 weights cv2 uses, edges clamped
    chroma = F.interpolate(chroma, size=(2 * ch, 2 * cw), mode="bilinear", align_corners=False)
    chroma = chroma[..., :h, :w].reshape(*lead, 2, h, w) - 128.0
    luma = y.float()
    m = torch.tensor(_FROM_YCC, dtype=torch.float32, device=y.device)
    cbp, crp = chroma.unbind(-3)
    rgb = torch.stack([luma + m[k, 1] * cbp + m[k, 2] * crp for k in range(3)], -1)
    return rgb.round_().clamp_(0, 255).to(torch.uint8)
