"""mmcache: decode an image folder once into a memory-mapped cache, and train from it.

Examples:
    >>> import mmcache
    >>> mmcache.build_cache("data/train", "cache/train", short_side=256)  # doctest: +SKIP
    >>> ds = mmcache.MemmapImageDataset("cache/train")  # doctest: +SKIP

The format, build and decode parts import without torch; ``MemmapImageDataset``,
``BatchLoader``, the samplers and the crops import torch when first used.
"""

from typing import TYPE_CHECKING

from ._version import __version__
from .build import build_cache, compact_cache, create_lazy_cache
from .copying import copy_cache
from .decode import Options, decode_image
from .errors import (
    BadImageWarning,
    CacheError,
    CacheFormatError,
    CacheNotFoundError,
    CacheStaleError,
    DecodeError,
    DecodeWorkerError,
    DestinationError,
    DistributedBuildError,
    InsufficientSpaceError,
    MixedShapesError,
    NotACacheError,
    OptionsChangedError,
    RemoteAccessError,
    RemoteError,
    SourceChangedError,
    SourceError,
    StaleCacheWarning,
    StateMismatchError,
    StrictBuildError,
    UnsafeCacheError,
)
from .pixels import yuv420_to_rgb
from .plan import CachePlan, check_free_space, plan_cache
from .remote import pull_cache, push_cache
from .reports import (
    BadRecord,
    BuildReport,
    CacheInfo,
    CopyReport,
    PullReport,
    PushReport,
    RepairReport,
    VerifyReport,
    WarmReport,
)
from .residency import cache_info, evict_cache, warm_cache
from .scan import scan_source
from .verify import repair_cache, verify_cache

if TYPE_CHECKING:  # what __getattr__ imports on first use, for IDEs and type checkers
    from .dataset import MemmapImageDataset
    from .loader import BatchLoader
    from .sampler import QuasiRandomSampler
    from .transforms import (
        CenterResizedCrop,
        Compose,
        Crop,
        MultiCrop,
        RandomHorizontalFlip,
        RandomResizedCrop,
    )

__all__ = [
    "BadImageWarning",
    "BadRecord",
    "BatchLoader",
    "BuildReport",
    "CacheError",
    "CacheFormatError",
    "CacheInfo",
    "CacheNotFoundError",
    "CachePlan",
    "CacheStaleError",
    "CenterResizedCrop",
    "Compose",
    "CopyReport",
    "Crop",
    "DecodeError",
    "DecodeWorkerError",
    "DestinationError",
    "DistributedBuildError",
    "InsufficientSpaceError",
    "MemmapImageDataset",
    "MixedShapesError",
    "MultiCrop",
    "NotACacheError",
    "Options",
    "OptionsChangedError",
    "PullReport",
    "PushReport",
    "QuasiRandomSampler",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RemoteAccessError",
    "RemoteError",
    "RepairReport",
    "SourceChangedError",
    "SourceError",
    "StaleCacheWarning",
    "StateMismatchError",
    "StrictBuildError",
    "UnsafeCacheError",
    "VerifyReport",
    "WarmReport",
    "__version__",
    "build_cache",
    "cache_info",
    "check_free_space",
    "compact_cache",
    "copy_cache",
    "create_lazy_cache",
    "decode_image",
    "evict_cache",
    "plan_cache",
    "pull_cache",
    "push_cache",
    "repair_cache",
    "scan_source",
    "verify_cache",
    "warm_cache",
    "yuv420_to_rgb",
]

_TORCH_PARTS = {
    "BatchLoader": "loader",
    "MemmapImageDataset": "dataset",
    "QuasiRandomSampler": "sampler",
    "CenterResizedCrop": "transforms",
    "Compose": "transforms",
    "Crop": "transforms",
    "MultiCrop": "transforms",
    "RandomHorizontalFlip": "transforms",
    "RandomResizedCrop": "transforms",
}


def __getattr__(name: str) -> object:
    # torch takes ~1 s to import; the build CLI and format readers do not need it.
    if name in _TORCH_PARTS:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_PARTS[name]}", __name__), name)
    raise AttributeError(f"module 'mmcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, which are not in globals() until first used.
    return sorted({*globals(), *_TORCH_PARTS})
