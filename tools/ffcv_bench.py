"""FFCV's row of the benchmark, from mmcache's environment: ``run_ffcv_peer``.

FFCV lives in its own virtual environment (``tools/setup_ffcv.sh`` makes ``.venv-ffcv/``), and
this module never imports it: it runs ``tools/ffcv_peer.py`` with that environment's python
(or ``$MMCACHE_FFCV_PYTHON``) in a subprocess and returns the parsed JSON result, or a note
saying why the row is skipped. Example::

    sys.path.insert(0, "tools")
    from ffcv_bench import run_ffcv_peer

    result = run_ffcv_peer("cache", batch_size=256, workers=2, epochs=4, size=224)
    if isinstance(result, str):
        print("FFCV skipped:", result)
    else:
        print(f"FFCV: {result['img_per_s']:.0f} img/s")
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tools" / "ffcv_peer.py"
ENV_VAR = "MMCACHE_FFCV_PYTHON"
MISSING = "FFCV environment missing: run tools/setup_ffcv.sh"
# The peer writes a .beton and compiles its pipeline with numba (about 15 s on 2 cores) before
# the epochs; an hour bounds a run that hangs (FFCV's writer waits forever for a dead worker).
DEFAULT_TIMEOUT = 3600.0


def ffcv_python() -> Path:
    """The interpreter of FFCV's environment: ``$MMCACHE_FFCV_PYTHON`` or ``.venv-ffcv``'s."""
    return Path(os.environ.get(ENV_VAR) or ROOT / ".venv-ffcv" / "bin" / "python")


def has_ffcv_env() -> bool:
    """Whether FFCV's environment exists (not whether FFCV imports in it)."""
    python = ffcv_python()
    return python.is_file() and os.access(python, os.X_OK)


def _tail(text: str, lines: int = 12) -> str:
    # tqdm's progress bars redraw with \r: splitlines() cuts them into their redraws.
    kept = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def run_ffcv_peer(
    cache: str | os.PathLike,
    batch_size: int = 256,
    workers: int = 2,
    epochs: int = 4,
    size: int = 224,
    workdir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    validate: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict | str:
    """Time FFCV's Loader on the cache's pixels in FFCV's own environment.

    Args:
        cache: An mmcache cache folder (3-channel records, every one filled).
        batch_size: Images per batch.
        workers: FFCV's threads, and the processes that write its .beton.
        epochs: Epochs to time; the result's ``img_per_s`` is the median of epochs 2..N.
        size: Output side of the RandomResizedCrop.
        workdir: Where ``ffcv.beton`` is written and kept (default: a temporary folder).
        seed: FFCV's order seed.
        validate: Also check that the .beton holds the cache's pixels (``"validate"`` key).
        timeout: Seconds before the run is abandoned.

    Returns:
        The peer's JSON result as a dict (see ``tools/ffcv_peer.py``), or a string saying why
        there is none: the environment is missing, or the run failed (with the last lines of
        its stderr).
    """
    python = ffcv_python()
    if not has_ffcv_env():
        return f"{MISSING} (no {python})"
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME"):  # mmcache's numpy 2 must not shadow FFCV's numpy 1
        env.pop(name, None)
    with tempfile.TemporaryDirectory(prefix="mmcache-ffcv-") as tmp:
        out = Path(tmp) / "ffcv.json"
        cmd = [str(python), str(PEER), "--cache", str(Path(cache).resolve())]
        cmd += ["--batch-size", str(batch_size), "--workers", str(workers)]
        cmd += ["--epochs", str(epochs), "--size", str(size), "--seed", str(seed)]
        cmd += ["--json", str(out)]
        if workdir is not None:
            cmd += ["--workdir", str(Path(workdir).resolve())]
        if validate:
            cmd.append("--validate")
        try:
            # From the temporary folder: no folder named ffcv in the cwd can shadow the package.
            proc = subprocess.run(
                cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else ""
            return f"FFCV run timed out after {timeout:.0f} s:\n{_tail(stderr or '')}"
        except OSError as e:
            return f"{MISSING} ({python}: {e})"
        if proc.returncode != 0 or not out.is_file():
            return f"FFCV run failed (exit {proc.returncode}):\n{_tail(proc.stderr)}"
        try:
            return json.loads(out.read_text(encoding="utf-8"))
        except ValueError as e:
            return f"FFCV run wrote no valid JSON ({e}):\n{_tail(proc.stderr)}"
