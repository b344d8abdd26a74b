"""tools/train.py, the end-to-end example, runs as its docstring says (a smoke run, no timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_builds_the_caches_trains_validates_and_resumes(tmp_path):
    args = [sys.executable, str(ROOT / "tools" / "train.py"), "--workdir", str(tmp_path)]
    args += ["--images", "24", "--epochs", "2", "--size", "32", "--batch-size", "8"]
    run = subprocess.run([*args, "--json", str(tmp_path / "a.json")], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "train: 24 images, 4 classes, built" in run.stdout
    assert "val: 4 images" in run.stdout and "epoch 2: loss" in run.stdout
    figures = json.loads((tmp_path / "a.json").read_text())
    assert 0 <= figures["val_accuracy"] <= 1 and figures["images_per_second"] > 0
    ckpt = ["--checkpoint", str(tmp_path / "c.pt")]
    stopped = subprocess.run([*args, *ckpt, "--save-every", "2", "--stop-after", "4"],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert stopped.returncode == 0 and "stopped after step 4" in stopped.stdout
    resumed = subprocess.run([*args, *ckpt, "--resume", "--json", str(tmp_path / "b.json")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0 and "resumed at epoch 2, batch 1" in resumed.stdout
    assert "up to date" in resumed.stdout  # the caches are reused, not rebuilt
    # stopped mid-epoch and resumed, training ends where the uninterrupted run ended
    assert json.loads((tmp_path / "b.json").read_text())["weights_sum"] == figures["weights_sum"]


def test_train_segmentation_trains_on_masks_resumes_and_shows_boxes(tmp_path):
    args = [sys.executable, str(ROOT / "tools" / "train_segmentation.py"), "--workdir",
            str(tmp_path), "--images", "12", "--image-size", "40", "--size", "32",
            "--batch-size", "4", "--epochs", "2"]  # fmt: skip
    run = subprocess.run([*args, "--json", str(tmp_path / "a.json")], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "train: 12 images with masks, 4 classes, built" in run.stdout
    assert "epoch 2: loss" in run.stdout and "mean IoU" in run.stdout
    figures = json.loads((tmp_path / "a.json").read_text())
    assert 0 <= figures["mean_iou"] <= 1 and figures["images_per_second"] > 0
    ckpt = ["--checkpoint", str(tmp_path / "s.pt")]
    stopped = subprocess.run([*args, *ckpt, "--stop-after", "4"], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert stopped.returncode == 0 and "stopped after step 4" in stopped.stdout
    resumed = subprocess.run([*args, *ckpt, "--resume", "--json", str(tmp_path / "b.json")],
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0 and "resumed at epoch 2, batch 2" in resumed.stdout
    assert json.loads((tmp_path / "b.json").read_text())["weights_sum"] == figures["weights_sum"]
    boxes = subprocess.run([*args, "--detection"], capture_output=True, text=True, timeout=300)
    assert boxes.returncode == 0, boxes.stderr
    assert "first batch: (4, 32, 32, 3) images" in boxes.stdout and "image 3:" in boxes.stdout
