"""The package version (the cache format has its own, in mmcache.format)."""

__version__ = "0.1.0"
