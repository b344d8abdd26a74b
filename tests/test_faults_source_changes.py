"""A source file that changes during the build is skipped, then picked up."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import opened_file, reference, write_image

from mmcache import (
    MemmapImageDataset,
    build_cache,
)
from mmcache import format as fmt

# --- a source that changes during the build -------------------------------------------------


def _rewrite(path: Path) -> None:
    write_image(path, 30, 20, seed=77)


CHANGES = {
    "deleted": lambda p: p.unlink(),
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "rewritten": _rewrite,
}


@pytest.mark.parametrize("when", ["after listing", "while decoding"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_source_file_that_changes_during_the_build_is_skipped_then_picked_up(
    small_folder, tmp_path, monkeypatch, tally, change, when
):
    import cv2

    import mmcache._writer as writer

    victim = small_folder / "dog" / "img_005.jpg"
    original, stat0 = victim.read_bytes(), victim.stat()
    if when == "after listing":
        real_plan = writer.plan_layout

        def plan_then_change(listing, opts, *skip):
            plan = real_plan(listing, opts, *skip)
            CHANGES[change](victim)
            return plan

        monkeypatch.setattr(writer, "plan_layout", plan_then_change)
    else:
        real_imread = cv2.imread

        def imread_while_changing(path, *args):
            if opened_file(path) == victim:
                CHANGES[change](victim)
            return real_imread(path, *args)

        monkeypatch.setattr(cv2, "imread", imread_while_changing)
    report = build_cache(small_folder, tmp_path / "cache", workers=0)  # the patch is here
    monkeypatch.undo()
    assert [(s["path"], s["state"]) for s in report.skipped] == [
        ("dog/img_005.jpg", fmt.BAD_SOURCE_CHANGED)
    ]
    assert "changed" in report.skipped[0]["reason"] or "vanished" in report.skipped[0]["reason"]
    assert report.images == 11
    # Put the file back as it was listed, mtime included: the next build must decode it.
    victim.write_bytes(original)
    os.utime(victim, ns=(stat0.st_atime_ns, stat0.st_mtime_ns))
    again = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert not again.up_to_date and again.images == 12 and again.skipped == []
    ds = MemmapImageDataset(tmp_path / "cache", verify="first-read")
    for i, (path, _) in enumerate(ds.samples):
        assert np.array_equal(ds[i][0], reference(path))
    tally["changing source files caught"] += 1
