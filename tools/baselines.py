"""What users run instead of mmcache, to measure mmcache against side by side (tools/bench.py).

- ``DecodingDataset`` (in ``mmcache.demo``, which the demo needs too): decodes every image on
  every access (what ``ImageFolder`` does).
- ``ManagerDictDataset``: the popular cache: decoded arrays in a
  ``multiprocessing.Manager().dict()`` shared by the DataLoader workers, filled in epoch one
  until psutil reports 90% memory used.
- ``InMemoryDataset``: every image preloaded into one numpy array in the parent before the
  workers fork: the RAM upper bound.

All three produce the pixels ``mmcache.decode_image`` gives, so results compare exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import psutil
from torch.utils.data import Dataset

from mmcache import Options, decode_image
from mmcache.demo import DecodingDataset


class ManagerDictDataset(DecodingDataset):
    """The ``Manager().dict()`` cache: every read pickles a whole image through a socket.

    Pass the proxy of a ``multiprocessing.Manager().dict()`` made in the parent. Caching stops
    once the machine's memory use passes ``max_memory_percent``, as that approach does.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        shared_dict,
        options: Options | None = None,
        max_memory_percent: float = 90.0,
    ):
        super().__init__(samples, options)
        self.cache = shared_dict
        self.max_memory_percent = max_memory_percent

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        img = self.cache.get(i)
        if img is None:
            img, label = super().__getitem__(i)
            if psutil.virtual_memory().percent < self.max_memory_percent:
                self.cache[i] = img
            return img, label
        return img, self.samples[i][1]


class InMemoryDataset(Dataset):
    """All images decoded into one array before the workers fork (equal sizes only)."""

    def __init__(self, samples: Sequence[tuple[str, int]], options: Options | None = None):
        first = decode_image(samples[0][0], options)
        self.images = np.empty((len(samples), *first.shape), np.uint8)
        for i, (path, _) in enumerate(samples):
            self.images[i] = decode_image(os.fspath(path), options)
        self.labels = np.array([label for _, label in samples], np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.images[i], int(self.labels[i])
