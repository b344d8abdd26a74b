"""Misuse of the public API gets one clear line: the exception type and words of each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Subset

import mmcache
from mmcache import (
    BatchLoader,
    CenterResizedCrop,
    MemmapImageDataset,
    MultiCrop,
    QuasiRandomSampler,
    RandomHorizontalFlip,
    RandomResizedCrop,
    build_cache,
    cli,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from conftest import make_folder

    root = tmp_path_factory.mktemp("misuse")
    src = make_folder(root / "src", {"a": [(8, 6), (6, 8)], "b": [(7, 7)]})
    build_cache(src, root / "cache", workers=1)
    return src, root / "cache"


class _PIL:  # what the crops see of a PIL image: no numpy shape (Pillow is optional)
    size = (8, 6)
    mode = "RGB"


_PIL.__module__ = "PIL.Image"
_PIL.__name__ = _PIL.__qualname__ = "Image"

# What the calls of the table may name.
NAMES = {
    "np": np, "torch": torch, "mmcache": mmcache, "Subset": Subset, "_PIL": _PIL,
    "BatchLoader": BatchLoader, "CenterResizedCrop": CenterResizedCrop,
    "MemmapImageDataset": MemmapImageDataset, "MultiCrop": MultiCrop,
    "QuasiRandomSampler": QuasiRandomSampler, "RandomHorizontalFlip": RandomHorizontalFlip,
    "RandomResizedCrop": RandomResizedCrop, "build_cache": build_cache,
}  # fmt: skip

# (what is called, given the source folder and the cache), the exception, words of its message
MISUSE = [
    ("ds[1:3]", None, None),  # a slice is a list of samples, as a list's slice
    ("ds[True]", TypeError, "dataset indices are ints, got bool"),
    ("ds['0']", TypeError, "dataset indices are ints, got str"),
    ("ds[1.0]", TypeError, "dataset indices are ints, got float"),
    ("ds[3]", IndexError, "index 3 out of range for 3 images"),
    ("MemmapImageDataset(cache, on_stale='never')", ValueError, "on_stale must be one of"),
    ("MemmapImageDataset(cache, on_bad='skip')", ValueError, "on_bad must be one of"),
    ("MemmapImageDataset(cache, verify=True)", ValueError, "verify must be None or 'first-read'"),
    ("MemmapImageDataset(cache, short_side=8)", ValueError, "apply only with source="),
    ("BatchLoader(Subset(ds, [0, 1]), 2)", TypeError, "sampler=[0, 1, ...]"),
    ("BatchLoader(str(cache), 2)", TypeError, "BatchLoader(MemmapImageDataset("),
    ("BatchLoader(ds, 2.5)", TypeError, "batch_size must be an int, got 2.5"),
    ("BatchLoader(ds, 0)", ValueError, "must be >= 1"),
    ("BatchLoader(ds, 2, num_threads=1.5)", TypeError, "num_threads must be an int, got 1.5"),
    ("BatchLoader(ds, 2, read='mapped')", ValueError, "read must be 'auto', 'mmap' or 'pread'"),
    ("BatchLoader(ds, 2, shuffle=True, sampler=[0])", ValueError, "mutually exclusive"),
    ("BatchLoader(ds, 2, crop=lambda x: x)", ValueError, "crop must be"),
    ("BatchLoader(ds, 2, device='mps')", ValueError, "device must be a CPU or CUDA device"),
    ("RandomResizedCrop(0)", ValueError, "size must be an int or (height, width)"),
    ("RandomResizedCrop(2.5)", TypeError, "size must be an int or (height, width)"),
    ("RandomResizedCrop(8, scale=(0.5, 0.1))", ValueError, "scale must be (low, high)"),
    ("RandomResizedCrop(8, interpolation='cubic2')", ValueError, "interpolation"),
    ("CenterResizedCrop(8, ratio=1.5)", ValueError, "ratio must be within (0, 1]"),
    ("RandomResizedCrop(4)(_PIL())", TypeError, "got a PIL image: np.asarray(image)"),
    ("RandomResizedCrop(4)(torch.zeros(3, 6, 8, dtype=torch.uint8))", TypeError,
     "got a torch.Tensor of shape (3, 6, 8)"),  # fmt: skip
    ("RandomHorizontalFlip()(torch.zeros(3, 6, 8))", TypeError, "take an H x W x C numpy"),
    ("RandomHorizontalFlip(p=2)", ValueError, "p must be within [0, 1]"),
    ("MultiCrop([(RandomResizedCrop(4), 0)])", ValueError, "a count >= 1"),
    ("build_cache(src, cache, size=224)", TypeError, "for a square write size=(224, 224)"),
    ("build_cache(src, cache, short_side=0)", ValueError, "short_side must be a positive int"),
    ("build_cache(src, cache, color='grey')", ValueError, "color must be one of"),
    ("build_cache(src, cache, workers=-1)", ValueError, "workers must be None or an int >= 0"),
    ("build_cache(src, cache, workers=1.5)", ValueError, "workers must be None or an int"),
    ("build_cache(src, cache, dist_timeout=-1)", ValueError, "dist_timeout must be"),
    ("build_cache(src, cache, compact_at=2)", ValueError, "compact_at must be"),
    ("build_cache(src, cache, widht=5)", TypeError, "widht"),
    ("QuasiRandomSampler(ds, block_size=0)", ValueError, "block_size must be at least 1"),
    ("QuasiRandomSampler(ds, buffer_blocks=0)", ValueError, "buffer_blocks must be at least 1"),
    ("mmcache.warm_cache(cache, max_memory='lots')", ValueError, "lots"),
]


@pytest.mark.parametrize(("call", "error", "words"), MISUSE, ids=[row[0] for row in MISUSE])
def test_misuse_is_one_clear_line(built, call, error, words, capsys):
    src, cache = built
    ds = MemmapImageDataset(cache)
    names = {**NAMES, "src": src, "cache": cache, "ds": ds}
    if error is None:
        assert [label for _, label in eval(call, names)] == [ds[1][1], ds[2][1]]
        return
    with pytest.raises(error) as caught:
        eval(call, names)
    assert words in str(caught.value)


def test_the_command_line_refuses_a_negative_dist_timeout(built, capsys):
    src, cache = built
    assert cli.main(["build", str(src), str(cache), "--dist-timeout", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--dist-timeout: must be a number of seconds above 0, got '-1'" in err
