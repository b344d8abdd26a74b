"""The bench's files: results.md and results.json for the tables, chart.png for the loading one."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .loading import BenchReport, chart
from .multicrop import MultiCropReport
from .results import finite, targets_markdown
from .segmentation import SegmentationReport
from .training import TrainingReport


def write_report(
    report: BenchReport | None,
    out: str | os.PathLike,
    training: TrainingReport | None = None,
    segmentation: SegmentationReport | None = None,
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
    tables: list[tuple[str, Any, str]] = [
        ("training", training, "Training pipeline targets"),
        ("segmentation", segmentation, "Segmentation targets"),
        ("multicrop", multicrop, "Multi-crop targets"),
    ]
    for key, table, title in tables:
        if table is None:
            continue
        parts.append(table.to_markdown())
        parts.append(targets_markdown(table.targets, title))
        data[key] = finite(asdict(table))
        for r, dr in zip(table.rows, data[key]["rows"]):
            dr["steady_images_per_second"] = finite(r.steady_images_per_second)
            if key == "multicrop":
                dr["output_pixels_per_second"] = finite(table.pixel_rate(r.key))
    written[0].write_text("\n".join(parts))
    written[1].write_text(json.dumps(data, indent=2) + "\n")
    png = chart(report, out / "chart.png") if report is not None else None
    if png is not None:
        written.append(png)
    return written
