"""The parts of ``tools/bench.py``: one module per table, the shared results and measurements."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
# Run from a checkout: this mmcache, not an installed one, and tools/ for the baselines and peers.
for _path in (str(TOOLS), str(TOOLS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
