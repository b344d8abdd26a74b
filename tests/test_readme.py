"""The README's code runs as written: the Quickstart and the training recipe, on mixed-size
photos stored at shorter side 256."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import make_folder

from mmcache.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def block(section: str, language: str) -> str:
    """The first ``language`` code block of README section ``section``."""
    start = README.index(f"## {section}")
    found = re.search(rf"```{language}\n(.*?)```", README[start:], re.S)
    assert found, f"no {language} block in {section!r}"
    return found.group(1)


@pytest.fixture
def photos(tmp_path, monkeypatch):
    """data/train and data/val of photos whose shapes differ (landscape, portrait, square)."""
    sizes = [(400, 300), (300, 400), (512, 288), (300, 300), (640, 480)]
    make_folder(tmp_path / "data" / "train", {"cat": sizes * 2, "dog": sizes * 2})
    make_folder(tmp_path / "data" / "val", {"cat": sizes, "dog": sizes})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_shell_lines(text: str) -> None:
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            argv = shlex.split(line)
            assert argv[0] == "mmcache", line
            assert main(argv[1:]) == 0, line


# torch's advice on a 2-core machine, where the README's 4 workers are more than its cores
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_quickstart_runs_as_written_on_mixed_size_photos(photos):
    run_shell_lines(block("Quickstart", "bash"))
    namespace: dict = {}
    exec(block("Quickstart", "python"), namespace)  # noqa: S102 - the README's own code
    images, labels = namespace["images"], namespace["labels"]
    assert images.shape[1:] == (224, 224, 3) and len(images) == len(labels)
    assert namespace["img"].shape == (224, 224, 3)


def test_the_training_recipe_runs_as_written(photos):
    for split in ("train", "val"):
        assert main(["build", f"data/{split}", f"cache/{split}", "--short-side", "256"]) == 0
    namespace: dict = {}
    exec(block("Training the ImageNet way", "python"), namespace)  # noqa: S102
    images, labels = namespace["images"], namespace["labels"]
    assert images.shape[1:] == (3, 224, 224) and str(images.dtype) == "torch.float32"
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64
    assert namespace["checkpoint"]["loader"]["epoch"] == 1
