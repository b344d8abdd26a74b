"""Resizing a box of an image into its output: the kernels every crop and ``BatchLoader`` use."""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
import torch

from ._interpolation import OPENCV, interpolation_name


def resized_crop(
    img: np.ndarray,
    box: Sequence[int],
    size: tuple[int, int],
    interpolation: str = "bilinear",
    out: np.ndarray | None = None,
    *,
    antialias: bool = True,
) -> np.ndarray:
    """``img[top:top + height, left:left + width]`` of an H x W x C uint8 array, resized to
    ``size`` (height, width): torchvision's ``resized_crop`` with the default interpolation.

    ``out``: a contiguous ``size`` x C uint8 array to write into, else a new one.
    ``interpolation``, ``antialias``: as for ``RandomResizedCrop``.
    """
    top, left, bh, bw = (int(v) for v in box)
    if out is None:
        out = np.empty((*size, img.shape[2]), np.uint8)
    if not img.flags.writeable:
        img = img.copy()  # torch refuses to wrap read-only memory without a warning
    src = torch.from_numpy(img)[top : top + bh, left : left + bw]
    resize_into(src, torch.from_numpy(out), interpolation_name(interpolation), bool(antialias))
    return out


def resize_into(
    src: torch.Tensor, out: torch.Tensor, interpolation: str = "bilinear", antialias: bool = True
) -> None:
    """Resize the uint8 H x W x C tensor ``src`` (any strides, a view of a record's box, say)
    into the contiguous uint8 H x W x C tensor ``out``, allocating nothing: what every crop
    and ``BatchLoader`` resize with. ``interpolation``, ``antialias``: as the crops' (today's
    names only)."""
    if src.shape == out.shape:
        out.copy_(src)
        return
    kernel = _ANTIALIASED.get(interpolation) if antialias else None
    if kernel is not None:
        # The kernel of torchvision's resize(antialias=True) on uint8, on N x C x H x W views
        # of the H x W x C memory (channels_last), written into ``out`` itself.
        kernel(src.permute(2, 0, 1)[None], list(out.shape[:2]), False, None, None,
               out=out.permute(2, 0, 1)[None])  # fmt: skip
        return
    flag = OPENCV[interpolation]
    dst = out.numpy()
    done = cv2.resize(src.numpy(), (dst.shape[1], dst.shape[0]), dst=dst, interpolation=flag)
    if done.ctypes.data != dst.ctypes.data:  # cv2 made its own array: dst was not usable
        dst[...] = done.reshape(dst.shape)


# torch's antialiased kernels, those torchvision's resize runs; the other names are OpenCV's.
_ANTIALIASED = {
    "bilinear": torch.ops.aten._upsample_bilinear2d_aa.out,
    "bicubic": torch.ops.aten._upsample_bicubic2d_aa.out,
}
