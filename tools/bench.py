"""Time mmcache against the alternatives in one run: ``python tools/bench.py --help``.

The same as ``mmcache bench``; the measuring lives in ``mmcache.bench``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mmcache.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
