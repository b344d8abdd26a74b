"""Concurrent processes building, reading and filling one cache."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

from _faults import (
    ENV,
    LONG,
    served_by,
)

from mmcache import (
    build_cache,
)

# --- concurrent processes ---------------------------------------------------------------------

READER = textwrap.dedent(
    """
    import os, pickle, sys, time
    import numpy as np
    from mmcache import CacheFormatError, MemmapImageDataset
    cache, refs_file, stop = sys.argv[1:]
    with open(refs_file, "rb") as f:
        roots, refs = pickle.load(f)
    passes = reopened = 0
    while not os.path.exists(stop) or passes < 2:
        try:
            ds = MemmapImageDataset(cache, on_stale="ignore", verify="first-read")
            version = next(v for v, r in roots.items() if r == ds.manifest.source["root"])
            for _ in range(2):  # twice: the second pass often reads a generation since replaced
                for i, (path, _) in enumerate(ds.samples):
                    rel = os.path.relpath(path, roots[version])
                    if not np.array_equal(ds[i][0], refs[version][rel]):
                        sys.exit(f"wrong pixels: {version} {rel}")
                time.sleep(0.01)
            passes += 1
            open(f"{stop}.ready.{os.getpid()}", "w").close()  # the builders may start
        except CacheFormatError as e:
            if "rebuilt" not in str(e):  # a generation replaced before we mapped it: reopen
                raise
            reopened += 1
    print(passes, reopened)
    """
)


def test_four_processes_building_and_reading_one_cache(source, tmp_path, tally):
    cache = tmp_path / "cache"
    build_cache(source.roots["A"], cache, workers=1)
    refs_file, stop = tmp_path / "refs.pkl", tmp_path / "stop"
    with open(refs_file, "wb") as f:
        pickle.dump(({v: str(r) for v, r in source.roots.items()}, source.refs), f)
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(cache), str(refs_file), str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("stop.ready.*"))) < len(readers):  # both read, then build
        assert time.monotonic() < deadline and all(r.poll() is None for r in readers)
        time.sleep(0.05)
    rounds = 3 if LONG else 1
    builders = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from mmcache.cli import main\n"
                f"for v in {order * rounds!r}:\n"
                "    assert main(['build', v, sys.argv[1], '--workers', '1', '--source-moved'])"
                " == 0",
                str(cache),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        for order in (
            [str(source.roots["B"]), str(source.roots["A"])],
            [str(source.roots["A"]), str(source.roots["B"])],
        )
    ]
    for b in builders:
        _, err = b.communicate(timeout=300)
        assert b.returncode == 0, err.decode()
    stop.touch()
    for r in readers:
        out, err = r.communicate(timeout=300)
        assert r.returncode == 0, err.decode()
        passes, _ = map(int, out.split())
        tally["concurrent reads verified"] += passes
    assert served_by(cache, source, {"A", "B"}) in ("A", "B")
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4
