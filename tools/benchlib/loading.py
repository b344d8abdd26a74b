"""The loading table: the same shuffled DataLoader epochs over one folder, each way of loading it.

Decode every epoch, a ``Manager().dict()`` cache, an in-RAM array, an mmcache cache, a lazily
filled one, ``BatchLoader``, and a plain copy loop over the cache's records (the memory-copy
limit), with the memory of the process tree sampled meanwhile, the build rate against this
machine's decode and write rates, and the project's targets.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from baselines import InMemoryDataset, ManagerDictDataset

import mmcache
from mmcache import MemmapImageDataset, Options, build_cache, scan_source
from mmcache import format as fmt
from mmcache.demo import DecodingDataset, time_epochs

from .machine import (
    WriteRate,
    fresh_memory_write_rate,
    machine_description,
    single_core_decode_rate,
)
from .memory import MemorySampler, drop_page_cache, reported_kib, resident_share
from .results import (
    EventFn,
    MethodResult,
    RunSettings,
    Target,
    check_keys,
    epochs_table,
    finite,
    pick,
    steady_rate,
    targets_markdown,
    yes_no,
)

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
# The methods that read the cache the "mmcache" method builds.
CACHE_READERS = ("mmcache", "batch_loader", "copy_loop")
ONE_SIZE = "needs one image size"


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
        return pick(self.methods, key)

    def to_json(self) -> dict:
        d = asdict(self)
        for m, dm in zip(self.methods, d["methods"]):
            dm["steady_seconds"] = m.steady_seconds
            dm["steady_images_per_second"] = m.steady_images_per_second
        return finite(d)

    def to_markdown(self) -> str:
        def cells(m: MethodResult) -> tuple[list[str], list[str]]:
            child = f"{m.peak_child_uss / 1e6:,.0f}" if m.peak_child_uss else ""
            return [m.name, f"{m.prepare_seconds:.2f}"], [
                f"{m.steady_images_per_second:,.0f}", f"{m.peak_pss / 1e6:,.0f}",
                f"{m.peak_uss / 1e6:,.0f}", child,
            ]  # fmt: skip

        tail = ["img/s (steady)", "peak PSS MB", "peak USS MB", "max worker USS MB"]
        lines = epochs_table(self.methods, ["method", "prepare s"], tail, cells)
        out = ["# mmcache benchmark", "", *lines, "", self._build_line(), *self._notes()]
        out += ["", targets_markdown(self.targets, "Targets"), "## Machine and settings", ""]
        out += [f"- {k}: {v}" for k, v in self.machine.items()]
        out += [f"- {k}: {v}" for k, v in self.settings.items()]
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

    def _build_line(self) -> str:
        return (
            f"Build: {self.build_images_per_second:,.0f} img/s with {self.build_workers} "
            f"worker(s), the whole `build_cache` call ({self.build_decode_images_per_second:,.0f}"
            f" img/s in its decode phase); one core decodes {self.decode_images_per_second:,.0f}"
            f" img/s. Cache: {self.cache_bytes / 1e6:,.1f} MB. Pixels of mmcache equal "
            f"decoding: {yes_no(self.pixels_equal)}."
        )

    def _notes(self) -> list[str]:
        out = ["", self.write_rate.describe()] if self.write_rate is not None else []
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
        return out


@dataclass
class LoadingSettings(RunSettings):
    """What ``run_bench`` was asked for (see its arguments)."""

    build_workers: int | None = None
    size: tuple[int, int] | None = None
    cold: bool = False
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    decode_sample: int = 200
    write_pause: float = 5.0

    def describe(self) -> dict:
        """The settings as the report lists them."""
        generated = self.source is None
        w, h = self.image_size
        return {
            "source": "generated (photo-like JPEGs, quality 90)" if generated else str(self.source),
            "images": self.images,
            "image_size": f"{w}x{h}" if generated else "as found",
            "batch_size": self.batch_size,
            "workers": self.workers,
            "shuffle": True,
            "epochs": self.epochs,
            "resize": f"{self.size[0]}x{self.size[1]}" if self.size else "no",
            "cold": self.cold,
        }


def run_bench(
    *,
    workdir: str | os.PathLike | None = None,
    on_event: EventFn | None = None,
    methods: list[str] | None = None,
    **settings,
) -> BenchReport:
    """Run every loading method on one image folder with the same DataLoader settings.

    Args:
        workdir: where the images and caches go (default: a temporary folder, removed after).
        on_event: called with a one-line description of each step as it finishes.
        methods: keys of ``METHODS`` to run (default: all); ``copy_loop`` and
            ``batch_loader`` need ``mmcache``'s cache and build it if ``mmcache`` is left out.
        **settings: the fields of ``LoadingSettings``: ``source`` (an image folder; default:
            generate ``images`` photo-like JPEGs of ``image_size``, quality 90, in
            ``workdir``); ``batch_size``, ``workers``, ``epochs`` (the DataLoader settings,
            the same for every method: shuffled, workers persist across epochs);
            ``build_workers`` (decode processes for the mmcache build; default all cores);
            ``size`` (resize every image to ``(width, height)``, build option and baselines
            alike: needed for a folder of mixed sizes, which the default collate cannot stack);
            ``cold`` (drop the page cache, images and caches, before each method);
            ``decode_sample`` (how many images time the single-core decode rate);
            ``write_pause`` (seconds idle before timing a write into fresh memory, see
            ``fresh_memory_write_rate``); ``seed``.

    Example:
        >>> report = run_bench(images=500, epochs=2)  # doctest: +SKIP
        >>> write_report(report, "bench-out")  # doctest: +SKIP

    Returns:
        A ``BenchReport``; ``write_report`` turns it into files.
    """
    methods = list(METHODS) if methods is None else methods
    check_keys(methods, METHODS, "method")
    run = LoadingSettings(methods=methods, **settings)
    tmp = tempfile.mkdtemp(prefix="mmcache-bench-") if workdir is None else None
    try:
        return LoadingRun(run, Path(workdir or tmp), on_event or (lambda _line: None)).run()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


class LoadingRun:
    """One run of the loading table: the methods in order, each timed and sampled."""

    def __init__(self, settings: LoadingSettings, workdir: Path, say: EventFn) -> None:
        self.s = settings
        self.workdir = workdir
        self.say = say
        self.options = Options(size=settings.size)
        self.cache, self.lazy_cache = workdir / "cache", workdir / "lazy-cache"
        self.report = BenchReport(settings=settings.describe(), machine=machine_description())
        self.source = Path(settings.source) if settings.source is not None else None
        self.samples: list[tuple[str, int]] = []
        self.built: MemmapImageDataset | None = None
        self.memory: MemorySampler | None = None

    def run(self) -> BenchReport:
        if self.source is None:
            self.source = self._generate()
        for folder in (self.cache, self.lazy_cache):
            shutil.rmtree(folder, ignore_errors=True)  # a bench measures a build from scratch
        chosen = self.s.methods
        if any(k in chosen for k in CACHE_READERS):
            # Built first: the cache's listing is the sample list every method uses, so all
            # see the same images (the build skips what OpenCV cannot decode).
            self._timed("mmcache", self._build)
        else:
            listing = scan_source(self.source)
            self.samples = [(listing.abspath(i), int(listing.labels[i]))
                            for i in range(len(listing))]  # fmt: skip
        if self.built is not None and len(self.built):
            self._measure_write_rate()
        bodies: dict[str, Callable[[MethodResult], None]] = {
            "decode": self._decode, "manager_dict": self._manager_dict,
            "in_memory": self._in_memory, "lazy": self._lazy,
            "batch_loader": self._batch_loader, "copy_loop": self._copy_loop,
        }  # fmt: skip
        for key in ("decode", "manager_dict", "in_memory"):
            if key in chosen:
                self._timed(key, bodies[key])
        if self.built is not None and len(self.built):
            self._check_pixels_and_decode_rate()
        for key in ("lazy", "batch_loader", "copy_loop"):
            if key in chosen:
                self._timed(key, bodies[key])
        self.report.methods.sort(key=lambda m: list(METHODS).index(m.key))
        self.report.targets = targets(self.report)
        return self.report

    def _generate(self) -> Path:
        images, (w, h) = self.s.images, self.s.image_size
        start = time.perf_counter()
        source = self.s.generate(self.workdir / "images", self.s.seed)
        self.say(f"generated {images} JPEGs of {w}x{h} in {time.perf_counter() - start:.1f} s")
        return source

    def _timed(self, key: str, body: Callable[[MethodResult], None]) -> None:
        """Run ``body`` as method ``key`` with the memory sampled; store and announce it."""
        result = MethodResult(key, METHODS[key])
        gc.collect()
        if self.s.cold:
            self.report.cold = drop_page_cache([self.source, self.cache, self.lazy_cache])
        reported = reported_kib()
        with MemorySampler() as self.memory:
            body(result)
        self.memory.store(result)
        if reported is not None:
            result.reported_mib = (reported_kib() - reported) / 1024
        self.report.methods.append(result)
        self.say(result.describe())

    def _epochs_of(self, dataset) -> list[float]:
        # A sample at each epoch's end too (outside the timing; workers persist), so that
        # epochs shorter than the sampling interval are measured as well.
        return time_epochs(
            dataset, self.s.epochs, batch_size=self.s.batch_size, workers=self.s.workers,
            on_epoch=lambda _epoch, _seconds: self.memory.sample(),
        )  # fmt: skip

    def _build(self, result: MethodResult) -> None:
        report, workers = self.report, self.s.build_workers
        b = build_cache(self.source, self.cache, workers=workers, size=self.s.size)
        # Wall clock of the whole call: process start, scan, plan, decode, flush, publish.
        report.build_images_per_second = b.decoded / b.seconds if b.seconds > 0 else math.nan
        report.build_decode_images_per_second = b.images_per_second
        report.build_workers = max(1, min(workers or os.cpu_count() or 1, b.decoded))
        report.cache_bytes = b.bytes
        result.prepare_seconds = b.seconds
        self.built = MemmapImageDataset(self.cache, on_stale="ignore")
        self.samples = self.built.samples
        result.images = len(self.built)
        if "mmcache" in self.s.methods:
            result.cache_resident = resident_share(self.cache)
            result.epoch_seconds = self._epochs_of(self.built)

    def _measure_write_rate(self) -> None:
        # After the build, which ran into memory nobody had freed just before, as in use; the
        # same amount of pixels in records of the cache's mean size.
        record = max(1, self.report.cache_bytes // len(self.built))
        nbytes = min(self.report.cache_bytes, 2 << 30)
        rate = fresh_memory_write_rate(self.workdir / "write-rate", nbytes, record,
                                       self.s.write_pause)  # fmt: skip
        self.report.write_rate = rate
        self.say(rate.describe())

    def _check_pixels_and_decode_rate(self) -> None:
        built, report = self.built, self.report
        check = range(0, len(built), max(1, len(built) // 8))
        decoding = DecodingDataset(self.samples, self.options)
        report.pixels_equal = all(np.array_equal(built[i][0], decoding[i][0]) for i in check)
        paths = [p for p, _ in self.samples[: self.s.decode_sample]]
        report.decode_images_per_second = single_core_decode_rate(paths, self.options)
        self.say(
            f"build {report.build_images_per_second:,.0f} img/s with {report.build_workers} "
            f"worker(s) ({report.build_decode_images_per_second:,.0f} in its decode phase); "
            f"one core decodes {report.decode_images_per_second:,.0f} img/s"
        )

    def _decode(self, result: MethodResult) -> None:
        result.images = len(self.samples)
        result.epoch_seconds = self._epochs_of(DecodingDataset(self.samples, self.options))

    def _manager_dict(self, result: MethodResult) -> None:
        # As that approach does it: one Manager made in the parent, its dict proxy handed to
        # the Dataset, workers filling it in epoch one and reading it after.
        manager = multiprocessing.Manager()
        try:
            ds = ManagerDictDataset(self.samples, manager.dict(), self.options)
            result.images = len(self.samples)
            result.epoch_seconds = self._epochs_of(ds)
        finally:
            manager.shutdown()

    def _in_memory(self, result: MethodResult) -> None:
        start = time.perf_counter()
        try:
            ds = InMemoryDataset(self.samples, self.options)
        except ValueError:
            result.skipped = ONE_SIZE
            return
        result.prepare_seconds = time.perf_counter() - start
        result.images = len(ds)
        result.epoch_seconds = self._epochs_of(ds)

    def _lazy(self, result: MethodResult) -> None:
        start = time.perf_counter()
        ds = MemmapImageDataset(self.lazy_cache, source=self.source, size=self.s.size)
        result.prepare_seconds = time.perf_counter() - start
        result.images = len(ds)
        result.epoch_seconds = self._epochs_of(ds)

    def _batch_loader(self, result: MethodResult) -> None:
        start = time.perf_counter()
        ds = MemmapImageDataset(self.cache, on_stale="ignore")
        result.prepare_seconds = time.perf_counter() - start
        result.images = len(ds)
        result.cache_resident = resident_share(self.cache)
        try:
            loader = mmcache.BatchLoader(ds, self.s.batch_size, shuffle=True)
        except mmcache.MixedShapesError:
            result.skipped = ONE_SIZE
            return
        result.epoch_seconds = time_epochs(
            ds, self.s.epochs, batch_size=self.s.batch_size, workers=0, loader=loader
        )

    def _copy_loop(self, result: MethodResult) -> None:
        result.cache_resident = resident_share(self.cache)
        times = copy_loop(self.cache, self.s.epochs, self.s.batch_size, self.s.seed)
        if isinstance(times, str):
            result.skipped = times
            return
        result.images = len(self.samples)
        result.epoch_seconds = times


def copy_loop(cache: Path, epochs: int, batch_size: int, seed: int) -> list[float] | str:
    """Seconds per epoch of copying records, shuffled, into one reused batch buffer."""
    files = fmt.read_cache_files(fmt.read_manifest(cache))
    index = files.index
    shapes = np.stack([index["height"], index["width"], index["channels"]], 1)
    if len(index) == 0 or (shapes != shapes[0]).any():
        return ONE_SIZE
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
        return steady_rate(report.methods, key)

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


def chart(report: BenchReport, path: Path) -> Path | None:
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
