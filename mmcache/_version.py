"""The package version, written only here (pyproject.toml reads it for the wheel's metadata).

The cache format has its own version, in mmcache.format. Unreleased: see CHANGELOG.md.
"""

__version__ = "0.1.0"
