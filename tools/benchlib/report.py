"""The bench's files: results.md and results.json for the tables, chart.png for the loading one."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .loading import BenchReport, chart
from .multicrop import MultiCropReport
from .results import finite, targets_markdown
from .training import TrainingReport


def write_report(
    report: BenchReport | None,
    out: str | os.PathLike,
    training: TrainingReport | None = None,
    multicrop: MultiCropReport | None = None,
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
        parts.append(targets_markdown(training.targets, "Training pipeline targets"))
        data["training"] = finite(asdict(training))
        for r, dr in zip(training.rows, data["training"]["rows"]):
            dr["steady_images_per_second"] = finite(r.steady_images_per_second)
    if multicrop is not None:
        parts.append(multicrop.to_markdown())
        parts.append(targets_markdown(multicrop.targets, "Multi-crop targets"))
        data["multicrop"] = finite(asdict(multicrop))
        for r, dr in zip(multicrop.rows, data["multicrop"]["rows"]):
            dr["steady_images_per_second"] = finite(r.steady_images_per_second)
            dr["output_pixels_per_second"] = finite(multicrop.pixel_rate(r.key))
    written[0].write_text("\n".join(parts))
    written[1].write_text(json.dumps(data, indent=2) + "\n")
    png = chart(report, out / "chart.png") if report is not None else None
    if png is not None:
        written.append(png)
    return written
