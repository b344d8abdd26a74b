"""The README's and docs' code runs as written: the Quickstart and the training recipe, on
mixed-size photos stored at shorter side 256, and every command line and Python block of
README.md and docs/*.md.

The rule for a command line (bash, sh and console blocks; ``$ `` lines and ``mmcache `` lines of
unlabelled ones):
- every ``mmcache ...``, ``python tools/X.py ...`` and ``torchrun ... tools/X.py`` or
  ``torchrun ... -m mmcache ...`` is parsed by that program's own argument parser (a tool is run
  with its parser stopped right after parsing), so an unknown option or a malformed value fails;
- an ``mmcache`` command whose paths are all in the Quickstart's layout (``data/...``,
  ``cache/...``) also runs, in the order its file gives, in a folder of small photos: it is cheap;
  the rest (tools, torchrun, absolute paths, placeholders) need big data, GPUs, several
  processes or other machines, and are only parsed (the tools run at tiny sizes in test_tools*);
- ``pip``, ``bash`` and ``python -c``/``python -m pytest`` lines are not checked.
A Python block runs (after the setup PYTHON_RUN gives it) unless PYTHON_NOT_RUN says why not;
every block compiles, and a new block must be added to one of the two. The README's demo output
has the lines the demo prints (numbers aside).
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_folder

import mmcache
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
    # saved after epoch 1's last batch, the state resumes at the start of epoch 2
    state = namespace["checkpoint"]["loader"]
    assert (state["epoch"], state["batches"]) == (2, 0)


# --- every command line and Python block of README.md and docs/*.md -----------------------------

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Paths a runnable command may name: the Quickstart's layout, made in a temporary folder.
LOCAL = re.compile(r"(data|cache)/\w+$")
# Programs whose lines are not checked: installers and shell scripts.
NOT_CHECKED = {"pip", "bash", "export"}


def code_blocks(path: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of ``path``."""
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M)


def command_lines(text: str, language: str) -> list[str]:
    """The shell commands of a code block: every line of a bash or sh block; in a console or
    unlabelled block, the lines after a ``$`` prompt and those that start with ``mmcache ``."""
    text = text.replace("\\\n", " ")  # continuation lines
    if language in ("bash", "sh"):
        return [line for line in text.splitlines() if line.strip()]
    if language in ("console", ""):
        return [
            line.removeprefix("$ ")
            for line in text.splitlines()
            if line.startswith("$ ") or line.startswith("mmcache ")
        ]
    return []


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (split at ; && || |), comments and redirections
    dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    result: list[list[str]] = [[]]
    skip = False
    for token in lexer:
        if skip:
            skip = False
        elif token in (";", "&&", "||", "|"):
            result.append([])
        elif token in (">", "<", ">>"):
            skip = True  # its target
            if result[-1] and result[-1][-1].isdigit():  # 2>/dev/null
                result[-1].pop()
        else:
            result[-1].append(token)
    return [c for c in result if c]


def program_of(argv: list[str]) -> tuple[str, list[str]]:
    """("mmcache", args) or ("tools/X.py", args) a command runs, or (argv[0], []) when it runs
    neither: ``python -m mmcache``, ``python tools/X.py``, ``torchrun [its options] -m mmcache``
    or ``torchrun [its options] tools/X.py``."""
    name = Path(argv[0]).name
    if name == "mmcache":
        return "mmcache", argv[1:]
    if name == "torchrun" or name.startswith("python"):
        for k, arg in enumerate(argv[1:], 1):
            if arg.endswith(".py"):
                return arg, argv[k + 1 :]
            if arg == "-m" and argv[k + 1] == "mmcache":
                return "mmcache", argv[k + 2 :]
            if arg in ("-m", "-c") and name != "torchrun":
                break  # python -m pytest, python -c "...": another program
    return name, []


def all_commands() -> list[tuple[str, str, list[str]]]:
    """(file name, program, args) of every command line in README.md and docs/*.md."""
    found = []
    for path in DOCS:
        for language, text in code_blocks(path):
            for line in command_lines(text, language):
                for argv in commands(line):
                    found.append((path.name, *program_of(argv)))
    return found


class Parsed(Exception):
    """Raised by a tool's argument parser in place of running the tool."""


def assert_parses(program: str, args: list[str], monkeypatch) -> None:
    """``program``'s own parser accepts ``args``: an unknown option or a bad value fails."""
    if program == "mmcache":
        from mmcache.cli import _parser

        try:
            _parser().parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"mmcache {shlex.join(args)}: usage error") from e
        return
    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        raise Parsed(parse_args(self, argv, namespace))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        patch.setattr(sys, "argv", [program, *args])
        patch.setattr(sys, "path", list(sys.path))
        try:
            runpy.run_path(str(ROOT / program), run_name="__main__")
        except Parsed:
            return
        except SystemExit as e:
            raise AssertionError(f"{program} {shlex.join(args)}: usage error") from e
    raise AssertionError(f"{program} ran without parsing its arguments")


def runnable(program: str, args: list[str]) -> bool:
    """The rule: an ``mmcache`` command whose every path is in the Quickstart's layout
    (``data/...``, ``cache/...``) runs; any other command is only parsed."""
    if program != "mmcache":
        return False
    from mmcache.cli import _parser

    parsed = vars(_parser().parse_args(args))
    paths = [parsed.get(name) for name in ("source", "cache", "dest", "url")]
    paths = [p for p in paths if p is not None and p not in ("sample", "all")]  # verify --source
    return bool(paths) and all(LOCAL.match(p) for p in paths)


def test_every_command_in_the_readme_and_docs_is_one_its_program_accepts(monkeypatch):
    """Every ``mmcache ...``, ``python tools/X.py ...`` and ``torchrun ... tools/X.py`` (or
    ``-m mmcache``) line in README.md and docs/*.md is parsed by that program's own argument
    parser, so an option it does not have or a malformed value fails here. Commands that need
    big data, GPUs, several processes or other machines (the tools, torchrun, absolute paths,
    placeholders such as CACHE) are only parsed; the cheap ones also run (next test)."""
    found = all_commands()
    programs = {program for _, program, _ in found}
    assert {"mmcache", "tools/train_ddp.py", "tools/bench.py"} <= programs
    for name, program, args in found:
        if program in NOT_CHECKED or program.startswith("python"):
            continue  # pip, bash, python -m pytest, python -c "import torch"
        assert program == "mmcache" or program.startswith("tools/"), (name, program, args)
        assert_parses(program, args, monkeypatch)


@pytest.mark.parametrize(
    "doc", sorted({name for name, program, args in all_commands() if runnable(program, args)})
)
def test_the_cheap_commands_of_each_file_run_in_order(doc, photos):
    """A file's runnable commands (``runnable``), in the order it gives them, in a folder with
    data/train and data/val; a cache the file reads but does not build is built first, with
    the default options."""
    runs = [
        args for name, program, args in all_commands() if name == doc and runnable(program, args)
    ]
    built = {args[2] for args in runs if args[0] == "build"}
    for args in runs:
        for cache in (a for a in args[1:] if a.startswith("cache/") and a not in built):
            mmcache.build_cache(cache.replace("cache", "data", 1), cache, workers=0)
            built.add(cache)
        assert main(args) == 0, (doc, args)


# The Python blocks of README.md and docs/*.md, by file and the start of their first line of
# code: those that run, with the code that runs before each (in a folder with data/train and
# data/val) ...
PYTHON_RUN = {
    ("format.md", 'with open("cache/manifest.json") as f:'): (
        "import json\nimport numpy as np\ni = 3\n"
        'mmcache.build_cache("data/train", "cache", workers=0)'
    ),
    ("lazy.md", 'ds = mmcache.MemmapImageDataset("cache/train", s'): "",
    ("lazy.md", 'report = mmcache.create_lazy_cache("data/train",'): "",
    ("reliability.md", 'report = mmcache.repair_cache("cache/train")'): (
        'mmcache.build_cache("data/train", "cache/train", workers=0)'
    ),
    ("reliability.md", 'report = mmcache.verify_cache("cache/train", sour'): (
        'mmcache.build_cache("data/train", "cache/train", workers=0)'
    ),
    ("annotations.md", "from mmcache import BatchLoader, MemmapImageDataset, Rand"): (
        "from mmcache.sample_data import make_detection_set, make_segmentation_set\n"
        'voc = make_segmentation_set("voc", images=6, size=(300, 400))\n'
        'mmcache.build_cache(voc[0], "cache/voc", masks=voc[1], workers=0)\n'
        'coco = make_detection_set("coco", images=6, size=(600, 800))\n'
        'mmcache.build_cache(coco[0], "cache/coco", coco=coco[1], workers=0)'
    ),
    ("multicrop.md", "from mmcache import BatchLoader, MemmapImageDataset, Mult"): (
        'mmcache.build_cache("data/train", "cache/train", short_side=256, workers=0)'
    ),
    ("multicrop.md", "from mmcache import BatchLoader, MemmapImageDataset, Rand"): (
        'mmcache.build_cache("data/train", "cache/train", short_side=256, workers=0)'
    ),
    ("multicrop.md", "from mmcache import MemmapImageDataset, MultiCrop, Random"): (
        'mmcache.build_cache("data/train", "cache/train", short_side=256, workers=0)'
    ),
    ("training.md", "crop = mmcache.RandomResizedCrop(160)"): (
        'mmcache.build_cache("data/train", "cache/train", short_side=256, workers=0)\n'
        'ds = mmcache.MemmapImageDataset("cache/train")\nepochs = 3'
    ),
}
# ... and those that do not, with the reason.
TORCHVISION = "needs torchvision, which mmcache does not depend on"
CUDA = "needs a CUDA device"
REMOTE = "needs an S3 server: tests/test_remote.py runs these calls against a real one"
PYTHON_NOT_RUN = {
    ("README.md", "import torch"): "test_the_quickstart_runs_as_written_on_mixed_size_photos",
    ("README.md", "import mmcache"): "run by test_the_training_recipe_runs_as_written",
    ("lazy.md", 'dataset = torchvision.datasets.ImageFolder("data'): TORCHVISION,
    ("loader.md", "import mmcache"): CUDA,
    ("residency.md", "from torch.utils.data import DataLoader"): (
        "90 epochs of 8 DataLoader workers; tests/test_residency.py runs QuasiRandomSampler"
    ),
    ("README.md", 'ds = MemmapImageDataset("s3://bucket/imagenet/'): REMOTE,
    ("remote.md", "from mmcache import MemmapImageDataset, push_cache, p"): REMOTE,
    ("remote.md", 'ds = MemmapImageDataset("s3://bucket/imagenet/'): REMOTE,
    ("scaleout.md", 'torch.distributed.init_process_group("gloo")  # o'): (
        "needs torchrun and /shared; tests/test_distributed.py builds under a process group"
    ),
}


def python_blocks() -> list[tuple[tuple[str, str], str]]:
    """(its key in PYTHON_RUN or PYTHON_NOT_RUN, code) of every Python block; the key is
    (file name, "?") for a block in neither."""
    found = []
    for path in DOCS:
        for language, text in code_blocks(path):
            if language == "python":
                first = next(s for s in text.splitlines() if s.strip() and not s.startswith("#"))
                keys = [k for k in (*PYTHON_RUN, *PYTHON_NOT_RUN) if k[0] == path.name]
                key = next((k for k in keys if first.startswith(k[1])), (path.name, "?"))
                found.append((key, text))
    return found


def test_every_python_block_is_run_or_says_why_not():
    """A Python block runs (next test) unless PYTHON_NOT_RUN gives the reason it cannot here:
    a CUDA device, torchvision, torchrun, minutes of training. Every block at least compiles."""
    found = python_blocks()
    assert sorted(key for key, _ in found) == sorted({*PYTHON_RUN, *PYTHON_NOT_RUN})
    for key, code in found:
        compile(code, str(key), "exec")


@pytest.mark.parametrize(("doc", "first"), list(PYTHON_RUN))
def test_the_runnable_python_blocks_run(doc, first, photos):
    code = next(code for key, code in python_blocks() if key == (doc, first))
    namespace: dict = {"mmcache": mmcache, "torch": torch}
    exec(PYTHON_RUN[doc, first], namespace)  # noqa: S102 - the block's setup
    exec(code, namespace)  # noqa: S102 - the docs' own code


def line_prefixes(text: str) -> list[str]:
    """Each line up to its first digit, the demo's folder written as DIR: what the demo prints
    whatever the figures."""
    lines = text.strip().splitlines()
    workdir = re.search(r" in (\S+), ", lines[0]).group(1)
    return [re.split(r"\d", line.replace(workdir, "DIR"))[0].rstrip() for line in lines]


# torch's advice when a DataLoader has more workers than the machine has cores
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_the_demo_output_in_the_readme_is_what_the_demo_prints(tmp_path, capsys):
    shown = next(
        text for language, text in code_blocks(ROOT / "README.md")
        if language == "text" and text.startswith("mmcache demo: ")
    )  # fmt: skip
    args = ["demo", "--images", "24", "--image-size", "64x48", "--workdir", str(tmp_path)]
    assert main(args) == 0
    assert line_prefixes(capsys.readouterr().out) == line_prefixes(shown)
