"""Memory as a bench run sees it: peak PSS/USS of the process tree, the page cache (dropped
between methods, the cache's share in it) and what the kernel handed back to the hypervisor."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil

import mmcache

from .results import MethodResult

SAMPLE_SECONDS = 0.2


class MemorySampler:
    """Peak PSS and USS summed over this process and its new children, sampled in a thread.

    Children alive when sampling starts (a build's forkserver, the resource tracker) belong to
    no method and are left out; their children (build workers) are counted.
    """

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self.me = psutil.Process()
        self.exclude = {p.pid for p in self.me.children()}
        self.peak_pss = self.peak_uss = self.peak_child_uss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmcache-bench-memory", daemon=True)

    def _processes(self) -> Iterator[psutil.Process]:
        yield self.me
        for child in self.me.children():
            if child.pid not in self.exclude:
                yield child
            with contextlib.suppress(psutil.Error):
                yield from child.children(recursive=True)

    def sample(self) -> None:
        pss = uss = 0
        for p in self._processes():
            try:
                info = p.memory_full_info()
            except psutil.Error:
                continue  # ended between listing and reading, or not ours to read
            pss += info.pss
            uss += info.uss
            if p.pid != self.me.pid:
                self.peak_child_uss = max(self.peak_child_uss, info.uss)
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_uss = max(self.peak_uss, uss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def store(self, result: MethodResult) -> None:
        result.peak_pss, result.peak_uss = self.peak_pss, self.peak_uss
        result.peak_child_uss = self.peak_child_uss


def drop_page_cache(paths: list[Path]) -> str:
    """Evict ``paths`` (files, or folders of files) from the page cache; returns how.

    As root, all clean pages of the machine (``/proc/sys/vm/drop_caches``); otherwise
    ``posix_fadvise(DONTNEED)`` on each file. Either way after ``os.sync()``, since dirty pages
    cannot be dropped.
    """
    os.sync()
    if os.geteuid() == 0:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass  # a container may forbid it even to root
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            with contextlib.suppress(OSError):
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return "posix_fadvise DONTNEED"


def reported_kib() -> int | None:
    """Free memory reported to the hypervisor since boot (virtio free page reporting), KiB."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text())
    except (OSError, ValueError):
        return None


def resident_share(cache: Path) -> float | None:
    """The share of the cache's data file in the page cache now (None if unknown here)."""
    info = mmcache.cache_info(cache, check_stale=False)
    if info.resident_bytes is None or not info.data_bytes:
        return None
    return info.resident_bytes / info.data_bytes
