"""mmcache side by side with what users would use instead, in one run: ``python tools/bench.py``.

``run_bench`` times the same shuffled DataLoader epochs over one image folder for each way of
loading it (decode every epoch, a ``Manager().dict()`` cache, an in-RAM array, an mmcache cache,
a lazily filled one, ``BatchLoader``) plus a plain copy loop over the cache's records (the
memory-copy limit), samples the memory of the process tree meanwhile, measures the build rate
against the single-core decode rate and this machine's rate of writing pixels into a new file,
and checks the project's targets. ``write_report`` writes
results.md, results.json and chart.png; ``python tools/bench.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cv2
import numpy as np
import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: this mmcache, not an installed one
sys.path.insert(0, str(HERE))

from baselines import InMemoryDataset, ManagerDictDataset  # noqa: E402

import mmcache  # noqa: E402
from mmcache import MemmapImageDataset, Options, build_cache, decode_image, scan_source  # noqa: E402
from mmcache import format as fmt  # noqa: E402
from mmcache.demo import DecodingDataset, time_epochs  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

# name, label in the table; the order they run in.
METHODS = {
    "decode": "decode every epoch",
    "manager_dict": "Manager().dict() cache",
    "in_memory": "in-RAM array (preloaded)",
    "mmcache": "mmcache MemmapImageDataset",
    "lazy": "mmcache lazy fill",
    "batch_loader": "mmcache BatchLoader",
    "copy_loop": "memory limit: copy loop",
}
SAMPLE_SECONDS = 0.2

EventFn = Callable[[str], None]


@dataclass
class MethodResult:
    """One way of loading: its preparation, its epochs and the peak memory of its processes.

    ``prepare_seconds`` is the build (mmcache), the preload (in-RAM array) or opening the
    dataset. Peak memory is the largest sum over the main process and its children (DataLoader
    workers, the manager process, build workers) of PSS and of USS, sampled every 0.2 s;
    ``peak_child_uss`` is the largest USS of one child alone (a DataLoader worker's).
    ``skipped`` says why a method did not run (it needs images of one size, say).
    ``reported_mib``: freed memory the kernel handed back to the hypervisor while the method
    ran (None where the kernel does not report it), which that memory costs to touch again;
    ``cache_resident``: the share of the cache's data file in the page cache as the method's
    epochs began (methods that read the built cache).
    """

    key: str
    name: str
    prepare_seconds: float = 0.0
    epoch_seconds: list[float] = field(default_factory=list)
    images: int = 0
    peak_pss: int = 0
    peak_uss: int = 0
    peak_child_uss: int = 0
    skipped: str = ""
    reported_mib: float | None = None
    cache_resident: float | None = None

    @property
    def steady_seconds(self) -> float:
        """Median epoch after the first (which warms caches and fills lazy ones), else the one."""
        e = self.epoch_seconds
        return float(np.median(e[1:] if len(e) > 1 else e)) if e else math.nan

    @property
    def steady_images_per_second(self) -> float:
        s = self.steady_seconds
        return self.images / s if s > 0 else math.nan


@dataclass
class Target:
    """One ratio of the project's targets, computed from the run; ``passed`` is None if
    unmeasured."""

    name: str
    value: float
    threshold: float
    higher_is_better: bool = True
    passed: bool | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if self.passed is None and not math.isnan(self.value):
            if self.higher_is_better:
                self.passed = self.value >= self.threshold
            else:
                self.passed = self.value <= self.threshold


@dataclass
class BenchReport:
    """Everything one bench run measured, with the machine and the settings it ran with."""

    settings: dict
    machine: dict
    methods: list[MethodResult] = field(default_factory=list)
    cache_bytes: int = 0
    build_images_per_second: float = math.nan  # the whole build_cache call, wall clock
    build_decode_images_per_second: float = math.nan  # its decode phase alone
    decode_images_per_second: float = math.nan  # one core, the build's decoder
    build_workers: int = 1
    write_rate: WriteRate | None = None
    pixels_equal: bool | None = None
    cold: str = ""
    targets: list[Target] = field(default_factory=list)

    def method(self, key: str) -> MethodResult | None:
        for m in self.methods:
            if m.key == key and not m.skipped:
                return m
        return None

    def to_json(self) -> dict:
        d = asdict(self)
        for m, dm in zip(self.methods, d["methods"]):
            dm["steady_seconds"] = m.steady_seconds
            dm["steady_images_per_second"] = m.steady_images_per_second
        return _finite(d)

    def to_markdown(self) -> str:
        s = self.settings
        epochs = max((len(m.epoch_seconds) for m in self.methods), default=0)
        head = ["method", "prepare s", *[f"epoch {k + 1} s" for k in range(epochs)]]
        head += ["img/s (steady)", "peak PSS MB", "peak USS MB", "max worker USS MB"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in self.methods:
            if m.skipped:
                lines.append(f"| {m.name} | skipped: {m.skipped} |" + " |" * (len(head) - 2))
                continue
            cells = [m.name, f"{m.prepare_seconds:.2f}"]
            cells += [f"{t:.2f}" for t in m.epoch_seconds]
            cells += [""] * (epochs - len(m.epoch_seconds))
            cells += [
                f"{m.steady_images_per_second:,.0f}",
                f"{m.peak_pss / 1e6:,.0f}",
                f"{m.peak_uss / 1e6:,.0f}",
                f"{m.peak_child_uss / 1e6:,.0f}" if m.peak_child_uss else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
        out = ["# mmcache benchmark", "", *lines, ""]
        out.append(
            f"Build: {self.build_images_per_second:,.0f} img/s with {self.build_workers} "
            f"worker(s), the whole `build_cache` call ({self.build_decode_images_per_second:,.0f}"
            f" img/s in its decode phase); one core decodes {self.decode_images_per_second:,.0f}"
            f" img/s. Cache: {self.cache_bytes / 1e6:,.1f} MB. Pixels of mmcache equal "
            f"decoding: {_yes_no(self.pixels_equal)}."
        )
        if self.write_rate is not None:
            out += ["", self.write_rate.describe()]
        reported = [f"{m.name} {m.reported_mib:,.0f}" for m in self.methods
                    if m.reported_mib is not None]  # fmt: skip
        if reported:
            text = "Freed memory the kernel handed back to the hypervisor while each method ran "
            out += ["", text + "(MiB; touching it again is slow): " + ", ".join(reported) + "."]
        resident = [f"{m.name} {m.cache_resident:.0%}" for m in self.methods
                    if m.cache_resident is not None]  # fmt: skip
        if resident:
            out += ["", "The cache's share in RAM as the epochs began: " + ", ".join(resident)
                    + "."]  # fmt: skip
        out += ["", _targets_markdown(self.targets, "Targets"), "## Machine and settings", ""]
        out += [f"- {k}: {v}" for k, v in self.machine.items()]
        out += [f"- {k}: {v}" for k, v in s.items()]
        if self.cold:
            out.append(f"- page cache dropped between methods: {self.cold}")
        out += [
            "",
            "img/s (steady) is the number of images over the median epoch after the first (the "
            "first epoch alone when there is one). Peak memory is the largest sum over the main "
            "process and its children, sampled every 0.2 s.",
            "",
        ]
        return "\n".join(out)


def _yes_no(v: bool | None) -> str:
    return {True: "yes", False: "NO", None: "not checked"}[v]


def _finite(x):
    """NaN -> None throughout, so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def machine_description() -> dict:
    """CPU model, cores, RAM, OS and the versions that decide the figures."""
    import torch

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


class _MemorySampler:
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

    def __enter__(self) -> _MemorySampler:
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
_WRITE_CHUNK = 16  # records per chunk, as mmcache._workers.CHUNK


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


def _reported_kib() -> int | None:
    """Free memory reported to the hypervisor since boot (virtio free page reporting), KiB."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/reported_kib").read_text())
    except (OSError, ValueError):
        return None


def _write_new_file(path: Path, nbytes: int, record: np.ndarray) -> float:
    """Seconds to write ``nbytes`` of ``record`` repeated into the new file ``path``, flushed."""
    from mmcache._workers import start_writeback

    n = record.nbytes
    count = max(1, nbytes // n)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        os.ftruncate(fd, count * n)  # sparse, as the build's data file
        start = time.perf_counter()
        for k in range(0, count, _WRITE_CHUNK):
            last = min(count, k + _WRITE_CHUNK)
            for j in range(k, last):
                os.pwrite(fd, record, j * n)
            # The build's jobs are (record, path, offset, shape, size, mtime): only the offset
            # and shape matter to start_writeback.
            jobs = [(j, "", j * n, (1, n, 1), 0, 0) for j in range(k, last)]
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
    _write_new_file(folder / "write-rate-0", nbytes, record)  # frees its memory as it ends
    rate.back_to_back = written / _write_new_file(folder / "write-rate-1", nbytes, record)
    before = _reported_kib()
    time.sleep(pause)
    after = _reported_kib()
    rate.reported_kib = after - before if before is not None and after is not None else None
    rate.after_pause = written / _write_new_file(folder / "write-rate-2", nbytes, record)
    return rate


def _copy_loop(cache: Path, epochs: int, batch_size: int, seed: int) -> list[float] | str:
    """Seconds per epoch of copying records, shuffled, into one reused batch buffer."""
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    index = files.index
    shapes = np.stack([index["height"], index["width"], index["channels"]], 1)
    if len(index) == 0 or (shapes != shapes[0]).any():
        return "needs one image size"
    h, w, c = (int(v) for v in shapes[0])
    nbytes = h * w * c
    data = np.memmap(files.manifest.file("data"), np.uint8, "r")
    offsets = index["offset"].astype(np.int64)
    batch = np.empty((batch_size, h, w, c), np.uint8)
    flat = batch.reshape(batch_size, nbytes)
    rng = np.random.default_rng(seed)
    times = []
    for _ in range(epochs):
        order = rng.permutation(len(offsets))
        start = time.perf_counter()
        for k in range(0, len(order), batch_size):
            for j, i in enumerate(order[k : k + batch_size]):
                off = offsets[i]
                flat[j] = data[off : off + nbytes]
        times.append(time.perf_counter() - start)
    del data
    return times


def _batch_loader_epochs(dataset, epochs: int, batch_size: int) -> list[float]:
    loader = mmcache.BatchLoader(dataset, batch_size, shuffle=True)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for _images, _labels in loader:
            pass
        times.append(time.perf_counter() - start)
    return times


def run_bench(
    *,
    source: str | os.PathLike | None = None,
    images: int = 2000,
    image_size: tuple[int, int] = (720, 480),
    batch_size: int = 64,
    workers: int = 2,
    epochs: int = 3,
    build_workers: int | None = None,
    size: tuple[int, int] | None = None,
    cold: bool = False,
    methods: list[str] | None = None,
    workdir: str | os.PathLike | None = None,
    decode_sample: int = 200,
    write_pause: float = 5.0,
    seed: int = 0,
    on_event: EventFn | None = None,
) -> BenchReport:
    """Run every loading method on one image folder with the same DataLoader settings.

    Args:
        source: an image folder; default: generate ``images`` photo-like JPEGs of
            ``image_size`` (quality 90) in ``workdir``.
        batch_size, workers, epochs: the DataLoader settings, the same for every method
            (shuffled; workers persist across epochs).
        build_workers: decode processes for the mmcache build (default: all cores).
        size: resize every image to ``(width, height)`` (build option and baselines alike);
            needed for a folder of mixed sizes, which the default collate cannot stack.
        cold: drop the page cache (images and caches) before each method.
        methods: keys of ``METHODS`` to run (default: all); ``copy_loop`` and
            ``batch_loader`` need ``mmcache``'s cache and build it if ``mmcache`` is left out.
        workdir: where the images and caches go (default: a temporary folder, removed after).
        decode_sample: how many images time the single-core decode rate.
        write_pause: seconds idle before timing a write into fresh memory (see
            ``fresh_memory_write_rate``).
        on_event: called with a one-line description of each step as it finishes.

    Example:
        >>> report = run_bench(images=500, epochs=2)  # doctest: +SKIP
        >>> write_report(report, "bench-out")  # doctest: +SKIP

    Returns:
        A ``BenchReport``; ``write_report`` turns it into files.
    """
    say = on_event or (lambda _line: None)
    methods = list(METHODS) if methods is None else methods
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {list(METHODS)}")
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="mmcache-bench-")
        workdir = tmp
    workdir = Path(workdir)
    try:
        return _run(
            workdir,
            source,
            images,
            image_size,
            batch_size,
            workers,
            epochs,
            build_workers,
            size,
            cold,
            methods,
            decode_sample,
            write_pause,
            seed,
            say,
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(
    workdir: Path,
    source: str | os.PathLike | None,
    images: int,
    image_size: tuple[int, int],
    batch_size: int,
    workers: int,
    epochs: int,
    build_workers: int | None,
    size: tuple[int, int] | None,
    cold: bool,
    methods: list[str],
    decode_sample: int,
    write_pause: float,
    seed: int,
    say: EventFn,
) -> BenchReport:
    options = Options(size=size)
    generated = source is None
    if generated:
        classes = max(1, min(4, images))
        start = time.perf_counter()
        source = make_image_folder(
            workdir / "images",
            classes=classes,
            per_class=-(-images // classes),
            size=image_size,
            quality=90,
            seed=seed,
        )
        say(
            f"generated {images} JPEGs of {image_size[0]}x{image_size[1]} in "
            f"{time.perf_counter() - start:.1f} s"
        )
    source = Path(source)
    cache, lazy_cache = workdir / "cache", workdir / "lazy-cache"
    for folder in (cache, lazy_cache):
        shutil.rmtree(folder, ignore_errors=True)  # a bench measures a build from scratch
    report = BenchReport(
        settings={
            "source": "generated (photo-like JPEGs, quality 90)" if generated else str(source),
            "images": images,
            "image_size": f"{image_size[0]}x{image_size[1]}" if generated else "as found",
            "batch_size": batch_size,
            "workers": workers,
            "shuffle": True,
            "epochs": epochs,
            "resize": f"{size[0]}x{size[1]}" if size else "no",
            "cold": cold,
        },
        machine=machine_description(),
    )

    def between() -> None:
        gc.collect()
        if cold:
            report.cold = drop_page_cache([source, cache, lazy_cache])

    sampler: list[_MemorySampler] = []

    def epochs_of(dataset) -> list[float]:
        # A sample at each epoch's end too (outside the timing; workers persist), so that
        # epochs shorter than the sampling interval are measured as well.
        return time_epochs(
            dataset,
            epochs,
            batch_size=batch_size,
            workers=workers,
            on_epoch=lambda _epoch, _seconds: sampler[-1].sample(),
        )

    def run(key: str, body: Callable[[MethodResult], None]) -> MethodResult:
        result = MethodResult(key, METHODS[key])
        between()
        reported = _reported_kib()
        with _MemorySampler() as mem:
            sampler.append(mem)
            body(result)
        mem.store(result)
        if reported is not None:
            result.reported_mib = (_reported_kib() - reported) / 1024
        report.methods.append(result)
        say(_describe(result))
        return result

    need_cache = any(k in methods for k in ("mmcache", "batch_loader", "copy_loop"))
    samples: list[tuple[str, int]] = []
    built: MemmapImageDataset | None = None

    def build(result: MethodResult) -> None:
        nonlocal built, samples
        b = build_cache(source, cache, workers=build_workers, size=size)
        # Wall clock of the whole call: process start, scan, plan, decode, flush, publish.
        report.build_images_per_second = b.decoded / b.seconds if b.seconds > 0 else math.nan
        report.build_decode_images_per_second = b.images_per_second
        report.build_workers = max(1, min(build_workers or os.cpu_count() or 1, b.decoded))
        report.cache_bytes = b.bytes
        result.prepare_seconds = b.seconds
        built = MemmapImageDataset(cache, on_stale="ignore")
        samples = built.samples
        result.images = len(built)
        if "mmcache" in methods:
            result.cache_resident = _resident_share(cache)
            result.epoch_seconds = epochs_of(built)

    if need_cache:
        # Built first: the cache's listing is the sample list every method uses, so all see
        # the same images (the build skips what OpenCV cannot decode).
        run("mmcache", build)
    else:
        listing = scan_source(source)
        samples = [(listing.abspath(i), int(listing.labels[i])) for i in range(len(listing))]

    if built is not None and len(built):
        # After the build, which ran into memory nobody had freed just before, as in use; the
        # same amount of pixels in records of the cache's mean size.
        record = max(1, report.cache_bytes // len(built))
        nbytes = min(report.cache_bytes, 2 << 30)
        report.write_rate = fresh_memory_write_rate(workdir / "write-rate", nbytes, record,
                                                    write_pause)  # fmt: skip
        say(report.write_rate.describe())

    if "decode" in methods:

        def decode(result: MethodResult) -> None:
            result.images = len(samples)
            result.epoch_seconds = epochs_of(DecodingDataset(samples, options))

        run("decode", decode)
    if "manager_dict" in methods:

        def manager_dict(result: MethodResult) -> None:
            # As that approach does it: one Manager made in the parent, its dict proxy handed
            # to the Dataset, workers filling it in epoch one and reading it after.
            manager = multiprocessing.Manager()
            try:
                ds = ManagerDictDataset(samples, manager.dict(), options)
                result.images = len(samples)
                result.epoch_seconds = epochs_of(ds)
            finally:
                manager.shutdown()

        run("manager_dict", manager_dict)
    if "in_memory" in methods:

        def in_memory(result: MethodResult) -> None:
            start = time.perf_counter()
            try:
                ds = InMemoryDataset(samples, options)
            except ValueError:
                result.skipped = "needs one image size"
                return
            result.prepare_seconds = time.perf_counter() - start
            result.images = len(ds)
            result.epoch_seconds = epochs_of(ds)

        run("in_memory", in_memory)
    if built is not None and len(built):
        check = range(0, len(built), max(1, len(built) // 8))
        decoding = DecodingDataset(samples, options)
        report.pixels_equal = all(np.array_equal(built[i][0], decoding[i][0]) for i in check)
        paths = [p for p, _ in samples[:decode_sample]]
        report.decode_images_per_second = single_core_decode_rate(paths, options)
        say(
            f"build {report.build_images_per_second:,.0f} img/s with {report.build_workers} "
            f"worker(s) ({report.build_decode_images_per_second:,.0f} in its decode phase); "
            f"one core decodes {report.decode_images_per_second:,.0f} img/s"
        )
    if "lazy" in methods:

        def lazy(result: MethodResult) -> None:
            start = time.perf_counter()
            ds = MemmapImageDataset(lazy_cache, source=source, size=size)
            result.prepare_seconds = time.perf_counter() - start
            result.images = len(ds)
            result.epoch_seconds = epochs_of(ds)

        run("lazy", lazy)
    if "batch_loader" in methods:

        def batch_loader(result: MethodResult) -> None:
            start = time.perf_counter()
            ds = MemmapImageDataset(cache, on_stale="ignore")
            result.prepare_seconds = time.perf_counter() - start
            result.images = len(ds)
            result.cache_resident = _resident_share(cache)
            try:
                result.epoch_seconds = _batch_loader_epochs(ds, epochs, batch_size)
            except mmcache.MixedShapesError:
                result.skipped = "needs one image size"

        run("batch_loader", batch_loader)
    if "copy_loop" in methods:

        def copy_loop(result: MethodResult) -> None:
            result.cache_resident = _resident_share(cache)
            times = _copy_loop(cache, epochs, batch_size, seed)
            if isinstance(times, str):
                result.skipped = times
                return
            result.images = len(samples)
            result.epoch_seconds = times

        run("copy_loop", copy_loop)
    report.methods.sort(key=lambda m: list(METHODS).index(m.key))
    report.targets = targets(report)
    return report


def _describe(m: MethodResult) -> str:
    if m.skipped:
        return f"{m.name}: skipped ({m.skipped})"
    epochs = ", ".join(f"{t:.2f}" for t in m.epoch_seconds)
    text = f"{m.name}: epochs [{epochs}] s, {m.steady_images_per_second:,.0f} img/s"
    if m.prepare_seconds:
        text += f", prepare {m.prepare_seconds:.2f} s"
    if m.peak_pss:
        text += f", peak PSS {m.peak_pss / 1e6:,.0f} MB, USS {m.peak_uss / 1e6:,.0f} MB"
    if m.cache_resident is not None:
        text += f", cache {m.cache_resident:.0%} in RAM at the start"
    if m.reported_mib is not None:
        text += f", {m.reported_mib:,.0f} MiB freed memory reported meanwhile"
    return text


def _resident_share(cache: Path) -> float | None:
    """The share of the cache's data file in the page cache now (None if unknown here)."""
    info = mmcache.cache_info(cache, check_stale=False)
    if info.resident_bytes is None or not info.data_bytes:
        return None
    return info.resident_bytes / info.data_bytes


BUILD_TARGET = "build img/s / (cores / (t_decode + t_write))"


def build_ratio(report: BenchReport) -> float:
    """The build's rate over what its cores could do if they only decoded and wrote: ``cores /
    (t_decode + t_write)``, t_decode one core's decode time per image, t_write the time to write
    one image's pixels into a new file, in fresh memory (the build's condition)."""
    mm = report.method("mmcache")
    if report.write_rate is None or mm is None or not mm.images:
        return math.nan
    cores = min(os.cpu_count() or 1, report.build_workers)
    t_decode = 1 / report.decode_images_per_second
    t_write = (report.cache_bytes / mm.images) / report.write_rate.after_pause
    return report.build_images_per_second / (cores / (t_decode + t_write))


def targets(report: BenchReport) -> list[Target]:
    """The project's targets as ratios of this run's figures (n/a where a method did not run)."""

    def rate(key: str) -> float:
        m = report.method(key)
        return m.steady_images_per_second if m else math.nan

    mm, dec, md, ram = rate("mmcache"), rate("decode"), rate("manager_dict"), rate("in_memory")
    bl, copy = rate("batch_loader"), rate("copy_loop")
    lazy, decode = report.method("lazy"), report.method("decode")
    lazy_ratio = (
        lazy.epoch_seconds[0] / float(np.mean(decode.epoch_seconds))
        if lazy and decode and lazy.epoch_seconds and decode.epoch_seconds
        else math.nan
    )
    lazy_note = ""
    if not math.isnan(lazy_ratio) and report.write_rate is not None and lazy.images:
        # What writing the pixels alone adds to a decoding epoch: each worker writes its share
        # of the cache into fresh memory (at this machine's rate) besides decoding it.
        workers = max(1, report.settings.get("workers", 1))
        write = report.cache_bytes / report.write_rate.after_pause / workers
        lazy_note = (
            f"writing the pixels into fresh memory alone adds "
            f"{write / float(np.mean(decode.epoch_seconds)):.2f}x here"
        )
    mm_m = report.method("mmcache")
    pss_over = (mm_m.peak_pss - report.cache_bytes) / 1e6 if mm_m else math.nan
    return [
        Target("MemmapImageDataset / decode every epoch", mm / dec, 2.5),
        Target("MemmapImageDataset / Manager.dict cache", mm / md, 2.5),
        Target("MemmapImageDataset / in-RAM array", mm / ram, 0.95),
        Target("BatchLoader / copy loop (memory limit)", bl / copy, 0.8),
        Target("BatchLoader / decode every epoch", bl / dec, 6.0),
        Target(BUILD_TARGET, build_ratio(report), 0.85, note="t_write into fresh memory"),
        Target(
            "lazy epoch 1 / decode-every-epoch epoch",
            lazy_ratio,
            1.15,
            higher_is_better=False,
            note=lazy_note,
        ),
        Target("mmcache peak PSS - cache size (MB)", pss_over, 300.0, higher_is_better=False),
        Target(
            "worker USS flat from 1k to 4k images (MB)",
            math.nan,
            50.0,
            higher_is_better=False,
            note="compare 'max worker USS' of runs with --images 1000 and 4000",
        ),
    ]


def write_report(
    report: BenchReport | None, out: str | os.PathLike, training: TrainingReport | None = None
) -> list[Path]:
    """Write ``results.md``, ``results.json`` and (with matplotlib) ``chart.png`` into ``out``.

    Returns the paths written.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.md", out / "results.json"]
    parts = [report.to_markdown()] if report is not None else ["# mmcache benchmark\n"]
    data = report.to_json() if report is not None else {}
    if training is not None:
        parts.append(training.to_markdown())
        parts.append(_targets_markdown(training.targets, "Training pipeline targets"))
        data["training"] = _finite(asdict(training))
        for r, dr in zip(training.rows, data["training"]["rows"]):
            dr["steady_images_per_second"] = _finite(r.steady_images_per_second)
    written[0].write_text("\n".join(parts))
    written[1].write_text(json.dumps(data, indent=2) + "\n")
    chart = _chart(report, out / "chart.png") if report is not None else None
    if chart is not None:
        written.append(chart)
    return written


def _targets_markdown(targets: list[Target], title: str) -> str:
    out = [f"## {title}", "", "| target | measured | needed | result |", "|---|---|---|---|"]
    for t in targets:
        need = ("≥ " if t.higher_is_better else "≤ ") + f"{t.threshold:g}"
        got = "n/a" if math.isnan(t.value) else f"{t.value:.2f}"
        result = {True: "pass", False: "FAIL", None: "n/a"}[t.passed]
        out.append(f"| {t.name} | {got} | {need} | {result}{' ' + t.note if t.note else ''} |")
    return "\n".join(out) + "\n"


def _chart(report: BenchReport, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None  # matplotlib is in the [bench] extra; the table does without it
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for m in report.methods:
        if m.epoch_seconds:
            x = range(1, len(m.epoch_seconds) + 1)
            ax.plot(x, m.epoch_seconds, marker="o", label=m.name)
    most = max((len(m.epoch_seconds) for m in report.methods), default=1)
    ax.set_xticks(range(1, most + 1))
    ax.set_xlabel("epoch")
    ax.set_ylabel("seconds per epoch")
    ax.set_yscale("log")
    s = report.settings
    ax.set_title(f"{s['images']} images, batch {s['batch_size']}, {s['workers']} workers, shuffled")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the training pipeline: RandomResizedCrop + flip into batches -----------------------------

TRAINING_ROWS = {
    "decode_crop": "decode + RandomResizedCrop in a DataLoader (what ImageFolder users run)",
    "mmcache_crop": "MemmapImageDataset + the same per-sample crop in a DataLoader",
    "ffcv": "FFCV Loader, RAW records, RandomResizedCropRGBImageDecoder + flip + ToTensor",
    "thread_loop": "a plain loop in 2 threads: resize each crop box into one reused buffer",
    "batch_loader_crop": "mmcache BatchLoader(crop=RandomResizedCrop, flip=True)",
}
# Run in turns, epoch by epoch, since their ratio is a target.
ALTERNATED_ROWS = ("thread_loop", "batch_loader_crop")


@dataclass
class TrainingReport:
    """The training-pipeline table: the same crops of the same images, five ways."""

    settings: dict
    rows: list[MethodResult] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    ffcv: dict | None = None

    def row(self, key: str) -> MethodResult | None:
        return next((r for r in self.rows if r.key == key and not r.skipped), None)

    def to_markdown(self) -> str:
        s = self.settings
        epochs = max((len(r.epoch_seconds) for r in self.rows), default=0)
        head = ["method", *[f"epoch {k + 1} s" for k in range(epochs)], "img/s (median 2..)"]
        out = [
            "## Training pipeline",
            "",
            f"{s['images']:,} images stored at shorter side {s['short_side']}, "
            f"RandomResizedCrop({s['size']}) + flip, batch {s['batch_size']}, "
            f"{s['workers']} workers or threads, {s['epochs']} epochs; the plain thread loop "
            "and BatchLoader(crop) run in turns, epoch by epoch.",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for r in self.rows:
            if r.skipped:
                out.append(f"| {r.name} | skipped: {r.skipped} |" + " |" * (len(head) - 2))
                continue
            cells = [r.name, *[f"{t:.2f}" for t in r.epoch_seconds]]
            cells += [""] * (epochs - len(r.epoch_seconds))
            cells.append(f"{r.steady_images_per_second:,.0f}")
            out.append("| " + " | ".join(cells) + " |")
        return "\n".join(out) + "\n"


def run_training_bench(
    *,
    source: str | os.PathLike | None = None,
    images: int = 1000,
    image_size: tuple[int, int] = (720, 480),
    short_side: int = 256,
    size: int = 224,
    batch_size: int = 256,
    workers: int = 2,
    epochs: int = 10,
    seed: int = 0,
    rows: list[str] | None = None,
    workdir: str | os.PathLike,
    on_event: EventFn | None = None,
) -> TrainingReport:
    """Time RandomResizedCrop + flip into batches five ways on the same images, in one run.

    The images (``source``, or ``images`` generated JPEGs of ``image_size``) are cached at
    shorter side ``short_side``; every row crops ``size`` x ``size`` boxes with torchvision's
    box sampling and antialiased bilinear resize (FFCV: its own crop decoder), flips half, and
    is timed over ``epochs`` epochs of ``batch_size``, with ``workers`` DataLoader workers or
    threads. FFCV runs in its own environment (tools/setup_ffcv.sh), on the cache's pixels.
    The plain thread loop and ``BatchLoader(crop)``, whose ratio is a target, run in turns.
    """
    say = on_event or (lambda _line: None)
    rows = list(TRAINING_ROWS) if rows is None else rows
    unknown = set(rows) - set(TRAINING_ROWS)
    if unknown:
        raise ValueError(f"unknown row(s) {sorted(unknown)}; choose from {list(TRAINING_ROWS)}")
    workdir = Path(workdir)
    if source is None:
        classes = max(1, min(4, images))
        source = make_image_folder(
            workdir / "training-images", classes=classes, per_class=-(-images // classes),
            size=image_size, quality=90, seed=seed + 1,
        )  # fmt: skip
    cache = workdir / f"cache-short-{short_side}"
    build_cache(source, cache, short_side=short_side, replace=True)
    ds = MemmapImageDataset(cache, on_stale="ignore")
    crop = mmcache.RandomResizedCrop(size)
    per_sample = mmcache.Compose([crop, mmcache.RandomHorizontalFlip()])
    report = TrainingReport(
        settings={
            "images": len(ds),
            "short_side": short_side,
            "size": size,
            "batch_size": batch_size,
            "workers": workers,
            "epochs": epochs,
            "stored": "x".join(str(v) for v in ds.records.shapes[0][1::-1]) + " (first record)",
        }
    )

    def dataloader(dataset) -> list[float]:
        return time_epochs(dataset, epochs, batch_size=batch_size, workers=workers)

    threads = max(1, workers)  # the thread rows' counterpart of the DataLoader's workers

    def one_row(key: str) -> MethodResult:
        row = MethodResult(key, TRAINING_ROWS[key], images=len(ds))
        if key == "decode_crop":
            row.epoch_seconds = dataloader(DecodingDataset(ds.samples, transform=per_sample))
        elif key == "mmcache_crop":
            row.epoch_seconds = dataloader(MemmapImageDataset(cache, transform=per_sample))
        else:
            sys.path.insert(0, str(HERE))
            from ffcv_bench import run_ffcv_peer

            result = run_ffcv_peer(cache, batch_size, workers, epochs, size, workdir / "ffcv")
            if isinstance(result, str):
                row.skipped = result
            else:
                row.epoch_seconds, report.ffcv = result["epoch_seconds"], result
        return row

    def epoch_runner(key: str, pool: ThreadPoolExecutor) -> Callable[[], float]:
        if key == "thread_loop":
            return _crop_thread_loop(ds, crop, batch_size, pool, threads, seed)
        loader = mmcache.BatchLoader(
            ds, batch_size, shuffle=True, seed=seed, crop=crop, flip=True, num_threads=threads
        )
        return lambda: time_epochs(ds, 1, batch_size=batch_size, workers=0, loader=loader)[0]

    results: dict[str, MethodResult] = {}
    for key in rows:
        if key in results:  # ran in turns with an earlier row
            continue
        gc.collect()
        if key not in ALTERNATED_ROWS:
            results[key] = one_row(key)
            say(_describe(results[key]))
            continue
        # The in-process rows whose ratio is a target run in turns, epoch by epoch: run one
        # after the other, each met this VM's memory in a different state.
        turns = [k for k in rows if k in ALTERNATED_ROWS]
        with ThreadPoolExecutor(threads) as pool:
            times = _alternately(epochs, {k: epoch_runner(k, pool) for k in turns})
        for k in turns:
            results[k] = MethodResult(k, TRAINING_ROWS[k], epoch_seconds=times[k], images=len(ds))
            say(_describe(results[k]))
    report.rows = [results[key] for key in rows]
    report.targets = training_targets(report)
    return report


def _crop_thread_loop(
    ds, crop, batch_size: int, pool: ThreadPoolExecutor, threads: int, seed: int
) -> Callable[[], float]:
    """An epoch per call of the bare work, returning its seconds: each record's crop box, a
    view of the mapping, resized (and half of them flipped) into one reused batch buffer by
    the ``pool``'s threads."""
    from mmcache.transforms import resize_into

    records = ds.records
    with warnings.catch_warnings():  # torch cannot mark the read-only mapping read-only
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(ds.mapping())
    h, w = crop.size
    batch = torch.empty((batch_size, h, w, records.shapes[0][2]), dtype=torch.uint8)
    rng = np.random.default_rng(seed)

    def fill(part):
        for j, i, (top, left, bh, bw), flip in part:
            rh, rw, rc = (int(v) for v in records.shapes[i])
            off = int(records.offsets[i])
            src = data[off : off + rh * rw * rc].view(rh, rw, rc)[top : top + bh, left : left + bw]
            resize_into(src, batch[j])
            if flip:
                out = batch[j].numpy()
                cv2.flip(out, 1, dst=out)

    def epoch() -> float:
        order = rng.permutation(len(ds))
        start = time.perf_counter()
        for k in range(0, len(order), batch_size):
            idx = order[k : k + batch_size]
            boxes = crop.boxes(records.shapes[idx], rng.random((len(idx), crop.draws)))
            jobs = list(zip(range(len(idx)), idx.tolist(), boxes.tolist(),
                            (rng.random(len(idx)) < 0.5).tolist()))  # fmt: skip
            list(pool.map(fill, [jobs[t::threads] for t in range(threads)]))
        return time.perf_counter() - start

    return epoch


def _alternately(epochs: int, runners: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Seconds per epoch of each runner, run in turns: epoch k of every runner before epoch
    k + 1 of any, who goes first swapping each round."""
    times: dict[str, list[float]] = {key: [] for key in runners}
    keys = list(runners)
    for k in range(epochs):
        for key in keys if k % 2 == 0 else keys[::-1]:
            times[key].append(runners[key]())
    return times


def training_targets(report: TrainingReport) -> list[Target]:
    """The training pipeline's targets, as ratios of this run's figures."""

    def rate(key: str) -> float:
        r = report.row(key)
        return r.steady_images_per_second if r else math.nan

    bl, ffcv, decode = rate("batch_loader_crop"), rate("ffcv"), rate("decode_crop")
    return [
        Target("BatchLoader(crop) / FFCV Loader", bl / ffcv, 1.5),
        Target("BatchLoader(crop) / decode + crop in a DataLoader", bl / decode, 10.0),
        Target("BatchLoader(crop) / the plain thread loop", bl / rate("thread_loop"), 0.9),
        Target(
            "MemmapImageDataset + crop / decode + crop (DataLoaders)",
            rate("mmcache_crop") / decode,
            5.0,
        ),  # fmt: skip
    ]


def _size(text: str) -> tuple[int, int]:
    try:
        return mmcache.decode.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="loading,training",
                   help="loading (the DataLoader table), training (the crop pipeline table), or "
                   "both (default)")  # fmt: skip
    p.add_argument("--source", help="image folder to use (default: generate photo-like JPEGs)")
    p.add_argument("--images", type=int, default=2000, help="images to generate (default 2000)")
    p.add_argument("--image-size", type=_size, default=(720, 480), metavar="WxH",
                   help="size of the generated images (default 720x480)")  # fmt: skip
    p.add_argument("--epochs", type=int, default=3, help="epochs per method (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument("--build-workers", type=int, help="build processes (default: cores)")
    p.add_argument("--size", type=_size, metavar="WxH", help="resize all to WxH (mixed sizes)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each method")
    p.add_argument("--methods", help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--write-pause", type=float, default=5.0, metavar="S",
                   help="seconds idle before timing a write into fresh memory (5)")  # fmt: skip
    g = p.add_argument_group("the training pipeline table")
    g.add_argument("--training-images", type=int, default=1000,
                   help="images to generate for it (default 1000; --source if given)")  # fmt: skip
    g.add_argument("--short-side", type=int, default=256, help="stored shorter side (256)")
    g.add_argument("--crop", type=int, default=224, help="RandomResizedCrop size (224)")
    g.add_argument("--training-batch-size", type=int, default=256, help="batch size (256)")
    g.add_argument(
        "--training-epochs", type=int, default=10,
        help="epochs (10: an epoch of the fast rows is 0.1 s, and their median needs several)",
    )  # fmt: skip
    g.add_argument("--rows", help="comma-separated subset of: " + ", ".join(TRAINING_ROWS))
    p.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    p.add_argument("--workdir", help="keep the images and caches here (default: a temp folder)")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"loading", "training"}:
        p.error(f"--parts takes loading, training or both, got {args.parts!r}")
    tmp = None if args.workdir else tempfile.mkdtemp(prefix="mmcache-bench-")
    workdir = Path(args.workdir or tmp)
    say = lambda line: print("  " + line, flush=True)  # noqa: E731
    report = training = None
    try:
        if "loading" in parts:
            print(
                f"mmcache bench: {args.source or f'{args.images} generated JPEGs'}, "
                f"{args.epochs} epochs, batch {args.batch_size}, {args.workers} DataLoader "
                "workers, shuffled" + (", cold page cache" if args.cold else ""),
                flush=True,
            )
            report = run_bench(
                source=args.source, images=args.images, image_size=args.image_size,
                batch_size=args.batch_size, workers=args.workers, epochs=args.epochs,
                build_workers=args.build_workers, size=args.size, cold=args.cold,
                methods=args.methods.split(",") if args.methods else None,
                write_pause=args.write_pause, workdir=workdir / "loading", on_event=say,
            )  # fmt: skip
        if "training" in parts:
            print(
                f"training pipeline: {args.source or f'{args.training_images} generated JPEGs'} "
                f"at shorter side {args.short_side}, RandomResizedCrop({args.crop}) + flip, batch "
                f"{args.training_batch_size}, {args.workers} workers or threads",
                flush=True,
            )
            training = run_training_bench(
                source=args.source, images=args.training_images, image_size=args.image_size,
                short_side=args.short_side, size=args.crop, batch_size=args.training_batch_size,
                workers=args.workers, epochs=args.training_epochs,
                rows=args.rows.split(",") if args.rows else None,
                workdir=workdir / "training", on_event=say,
            )  # fmt: skip
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    written = write_report(report, args.out, training)
    print("targets:")
    for t in (report.targets if report else []) + (training.targets if training else []):
        got = "n/a" if math.isnan(t.value) else f"{t.value:.2f}"
        need = (">=" if t.higher_is_better else "<=") + f" {t.threshold:g}"
        result = {True: "pass", False: "FAIL", None: "n/a"}[t.passed]
        print(f"  {result:4}  {t.name}: {got} (needs {need}){'  ' + t.note if t.note else ''}")
    print("reproduce: python tools/bench.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if report is None or report.pixels_equal is not False else 1


if __name__ == "__main__":
    sys.exit(main())
