"""tools/train.py, the end-to-end example, runs as its docstring says (a smoke run, no timings).

In-process, as test_tools.py runs train_ssl: each run in a fresh Python would import torch again
(about 3 CPU-seconds each, on a suite that is CPU-bound). Their script entry (the sys.path
lines and ``sys.exit(main())``) is train_ddp.py's, which test_distributed.py runs as a script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))


def test_train_builds_the_caches_trains_validates_and_resumes(tmp_path, capsys):
    import train

    args = ["--workdir", str(tmp_path), "--images", "24", "--epochs", "2", "--size", "32",
            "--batch-size", "8"]  # fmt: skip
    assert train.main([*args, "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "train: 24 images, 4 classes, built" in out
    assert "val: 4 images" in out and "epoch 2: loss" in out
    figures = json.loads((tmp_path / "a.json").read_text())
    assert 0 <= figures["val_accuracy"] <= 1 and figures["images_per_second"] > 0
    ckpt = ["--checkpoint", str(tmp_path / "c.pt")]
    assert train.main([*args, *ckpt, "--save-every", "2", "--stop-after", "4"]) == 0
    assert "stopped after step 4" in capsys.readouterr().out
    assert train.main([*args, *ckpt, "--resume", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "resumed at epoch 2, batch 1" in out
    assert "up to date" in out  # the caches are reused, not rebuilt
    # stopped mid-epoch and resumed, training ends where the uninterrupted run ended
    assert json.loads((tmp_path / "b.json").read_text())["weights_sum"] == figures["weights_sum"]


# At this tiny size a third of the images are under the crop: the warning a script run prints
@pytest.mark.filterwarnings("ignore:RandomResizedCrop.*upscaled:UserWarning")
def test_train_segmentation_trains_on_masks_resumes_and_shows_boxes(tmp_path, capsys):
    import train_segmentation

    args = ["--workdir", str(tmp_path), "--images", "12", "--image-size", "40", "--size", "32",
            "--batch-size", "4", "--epochs", "2"]  # fmt: skip
    assert train_segmentation.main([*args, "--json", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "train: 12 images with masks, 4 classes, built" in out
    assert "epoch 2: loss" in out and "mean IoU" in out
    figures = json.loads((tmp_path / "a.json").read_text())
    assert 0 <= figures["mean_iou"] <= 1 and figures["images_per_second"] > 0
    ckpt = ["--checkpoint", str(tmp_path / "s.pt")]
    assert train_segmentation.main([*args, *ckpt, "--stop-after", "4"]) == 0
    assert "stopped after step 4" in capsys.readouterr().out
    resumed = ["--resume", "--json", str(tmp_path / "b.json")]
    assert train_segmentation.main([*args, *ckpt, *resumed]) == 0
    assert "resumed at epoch 2, batch 2" in capsys.readouterr().out
    assert json.loads((tmp_path / "b.json").read_text())["weights_sum"] == figures["weights_sum"]
    assert train_segmentation.main([*args, "--detection"]) == 0
    out = capsys.readouterr().out
    assert "first batch: (4, 32, 32, 3) images" in out and "image 3:" in out
