"""This machine's own rates, which the targets are measured against: decoding on one core and
writing pixels into a new file; and the description of the machine for the report."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import psutil
import torch

import mmcache
from mmcache import Options, decode_image

from .memory import reported_kib


def machine_description() -> dict:
    """CPU model, cores, RAM, OS and the versions that decide the figures."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "opencv": cv2.__version__,
        "numpy": np.__version__,
        "mmcache": mmcache.__version__,
    }


def single_core_decode_rate(paths: list[str], options: Options | None = None) -> float:
    """Images per second of ``decode_image`` (the build's decoder) on one core, in this process."""
    threads = cv2.getNumThreads()
    cv2.setNumThreads(1)
    try:
        decode_image(paths[0], options)  # warm-up: first-call setup of the codec
        start = time.perf_counter()
        for p in paths:
            decode_image(p, options)
        return len(paths) / (time.perf_counter() - start)
    finally:
        cv2.setNumThreads(threads)


# sync_file_range(SYNC_FILE_RANGE_WRITE), as the build's workers call it after each chunk.
WRITE_CHUNK = 16  # records per chunk, as mmcache._workers.CHUNK


@dataclass
class WriteRate:
    """How fast this machine writes decoded pixels into a new file, timed as the build writes:
    one ``pwrite`` per record, writeback started after each chunk of 16, ``fsync`` at the end.

    ``back_to_back``: written right after an equal file was written and deleted, so into
    memory just freed; ``after_pause``: the same after ``pause`` seconds idle, which a machine
    whose hypervisor reclaims freed memory hands back meanwhile, so into fresh memory. Bytes
    per second each; ``reported_kib``: what the kernel's free page reporting handed to the
    hypervisor during the pause (None where it is not there).
    """

    nbytes: int
    record_bytes: int
    pause: float
    back_to_back: float = math.nan
    after_pause: float = math.nan
    reported_kib: int | None = None

    def describe(self) -> str:
        reported = (
            f"; the kernel reported {self.reported_kib / 1024:,.0f} MiB of freed memory to the "
            "hypervisor during the pause"
            if self.reported_kib is not None
            else ""
        )
        return (
            f"Writing decoded pixels into a new file ({self.nbytes / 1e6:,.0f} MB, one pwrite "
            f"per {self.record_bytes / 1e6:.2f} MB record, flushed as the build does): "
            f"{self.after_pause / 1e6:,.0f} MB/s into fresh memory (after {self.pause:g} s idle; "
            f"{1e3 * self.record_bytes / self.after_pause:.2f} ms per record), "
            f"{self.back_to_back / 1e6:,.0f} MB/s back to back (into memory just freed; "
            f"{1e3 * self.record_bytes / self.back_to_back:.2f} ms per record){reported}. "
            "The build target uses the fresh-memory rate: a build writes its data file into "
            "memory nobody freed just before."
        )


def write_new_file(path: Path, nbytes: int, record: np.ndarray) -> float:
    """Seconds to write ``nbytes`` of ``record`` repeated into the new file ``path``, flushed."""
    from mmcache._workers import Job, start_writeback

    n = record.nbytes
    count = max(1, nbytes // n)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.ftruncate(fd, count * n)  # sparse, as the build's data file
        start = time.perf_counter()
        for k in range(0, count, WRITE_CHUNK):
            last = min(count, k + WRITE_CHUNK)
            for j in range(k, last):
                os.pwrite(fd, record, j * n)
            # Only a job's offset and shape matter to start_writeback.
            jobs = [Job(j, "", j * n, (1, n, 1), 0, 0) for j in range(k, last)]
            start_writeback(fd, jobs)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def fresh_memory_write_rate(
    folder: str | os.PathLike, nbytes: int, record_bytes: int, pause: float = 5.0
) -> WriteRate:
    """This machine's rate of writing decoded pixels into a new file in ``folder``, back to back
    and after ``pause`` seconds idle (see ``WriteRate``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    record = rng.integers(0, 256, record_bytes, dtype=np.uint8)  # pixels: nothing to compress
    rate = WriteRate(nbytes, record_bytes, pause)
    written = max(1, nbytes // record_bytes) * record_bytes
    write_new_file(folder / "write-rate-0", nbytes, record)  # frees its memory as it ends
    rate.back_to_back = written / write_new_file(folder / "write-rate-1", nbytes, record)
    before = reported_kib()
    time.sleep(pause)
    after = reported_kib()
    rate.reported_kib = after - before if before is not None and after is not None else None
    rate.after_pause = written / write_new_file(folder / "write-rate-2", nbytes, record)
    return rate
