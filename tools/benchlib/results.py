"""What a bench table holds: a method's timed epochs, a target's verdict, and their text."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmcache.sample_data import make_image_folder

EventFn = Callable[[str], None]


@dataclass
class RunSettings:
    """What both tables take: the images (``source``, or ``images`` generated photo-like JPEGs
    of ``image_size``) and the batches (``batch_size``, ``workers``, ``epochs``)."""

    source: str | os.PathLike | None = None
    images: int = 2000
    image_size: tuple[int, int] = (720, 480)
    batch_size: int = 64
    workers: int = 2
    epochs: int = 3
    seed: int = 0

    def generate(self, folder: Path, seed: int) -> Path:
        """``images`` JPEGs of ``image_size`` (quality 90) in up to four classes in ``folder``."""
        classes = max(1, min(4, self.images))
        return Path(make_image_folder(
            folder, classes=classes, per_class=-(-self.images // classes),
            size=self.image_size[::-1], quality=90, seed=seed,  # (height, width)
        ))  # fmt: skip


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

    def describe(self) -> str:
        """One line: the epochs, the rate, and what else was measured."""
        if self.skipped:
            return f"{self.name}: skipped ({self.skipped})"
        epochs = ", ".join(f"{t:.2f}" for t in self.epoch_seconds)
        text = f"{self.name}: epochs [{epochs}] s, {self.steady_images_per_second:,.0f} img/s"
        if self.prepare_seconds:
            text += f", prepare {self.prepare_seconds:.2f} s"
        if self.peak_pss:
            text += f", peak PSS {self.peak_pss / 1e6:,.0f} MB, USS {self.peak_uss / 1e6:,.0f} MB"
        if self.cache_resident is not None:
            text += f", cache {self.cache_resident:.0%} in RAM at the start"
        if self.reported_mib is not None:
            text += f", {self.reported_mib:,.0f} MiB freed memory reported meanwhile"
        return text


def pick(rows: list[MethodResult], key: str) -> MethodResult | None:
    """The row ``key`` if it ran (not skipped)."""
    return next((r for r in rows if r.key == key and not r.skipped), None)


def steady_rate(rows: list[MethodResult], key: str) -> float:
    """Row ``key``'s steady images per second; NaN if it did not run."""
    row = pick(rows, key)
    return row.steady_images_per_second if row else math.nan


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

    def cells(self) -> tuple[str, str, str]:
        """The measured value, the need and the verdict, as text."""
        got = "n/a" if math.isnan(self.value) else f"{self.value:.2f}"
        need = (">=" if self.higher_is_better else "<=") + f" {self.threshold:g}"
        return got, need, {True: "pass", False: "FAIL", None: "n/a"}[self.passed]


@dataclass
class TableReport:
    """A table after the loading one: its settings, its rows timed epoch by epoch, and the
    targets computed from them."""

    settings: dict
    rows: list[MethodResult] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)

    def row(self, key: str) -> MethodResult | None:
        return pick(self.rows, key)

    def rate_table(self) -> list[str]:
        """The rows as markdown: a column per epoch's seconds, then the steady img/s."""
        return epochs_table(
            self.rows, ["method"], ["img/s (median 2..)"],
            lambda r: ([r.name], [f"{r.steady_images_per_second:,.0f}"]),
        )  # fmt: skip


def check_keys(chosen: Iterable[str], known: dict[str, str], what: str) -> None:
    """Refuse keys of ``chosen`` that ``known`` lacks, naming the choices."""
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"unknown {what}(s) {sorted(unknown)}; choose from {list(known)}")


def epochs_table(
    rows: list[MethodResult],
    lead: list[str],
    tail: list[str],
    cells: Callable[[MethodResult], tuple[list[str], list[str]]],
) -> list[str]:
    """A markdown table of ``rows`` with a column per epoch between ``lead`` and ``tail``
    columns; ``cells`` gives a row's lead and tail cells. A skipped row says why."""
    epochs = max((len(r.epoch_seconds) for r in rows), default=0)
    head = [*lead, *[f"epoch {k + 1} s" for k in range(epochs)], *tail]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.skipped:
            lines.append(f"| {r.name} | skipped: {r.skipped} |" + " |" * (len(head) - 2))
            continue
        before, after = cells(r)
        missing = [""] * (epochs - len(r.epoch_seconds))
        row = [*before, *[f"{t:.2f}" for t in r.epoch_seconds], *missing, *after]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def targets_markdown(targets: list[Target], title: str) -> str:
    out = [f"## {title}", "", "| target | measured | needed | result |", "|---|---|---|---|"]
    for t in targets:
        got, need, result = t.cells()
        need = need.replace(">=", "≥").replace("<=", "≤")
        out.append(f"| {t.name} | {got} | {need} | {result}{' ' + t.note if t.note else ''} |")
    return "\n".join(out) + "\n"


def finite(x):
    """NaN -> None throughout, so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [finite(v) for v in x]
    return x


def yes_no(v: bool | None) -> str:
    return {True: "yes", False: "NO", None: "not checked"}[v]
