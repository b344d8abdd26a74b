"""The command line, called in-process: one-line errors, exit codes, the demo."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import pytest
from conftest import write_image

import mmcache
import mmcache.space
from mmcache import MemmapImageDataset
from mmcache.cli import main


def test_build_then_up_to_date(small_folder, tmp_path, capsys):
    assert (
        main(
            ["build", str(small_folder), str(tmp_path / "c"), "--max-side", "32", "--workers", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "12 images in 3 classes" in out and "12 decoded; 0 skipped" in out
    assert MemmapImageDataset(tmp_path / "c")[0][0].shape == (24, 32, 3)
    assert main(["build", str(small_folder), str(tmp_path / "c"), "--max-side", "32"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_build_lists_skipped_files(testimages, tmp_path, capsys):
    assert main(["build", str(testimages), str(tmp_path / "c"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 skipped" in out and "skipped broken.png" in out
    assert "skipped truncated_jpeg.jpg: truncated" in out
    assert "1 truncated JPEG skipped (`--keep-truncated --replace` rebuilds" in out
    assert main(["info", str(tmp_path / "c")]) == 0
    assert "2 skipped, 1 warning" in capsys.readouterr().out  # junk_jpeg_header.jpg's
    # The advice works: the cache rebuilt keeping it, with its decoder's warning; --strict
    # accepts a truncated file that --keep-truncated keeps.
    args = ["build", str(testimages), str(tmp_path / "c"), "--keep-truncated", "--replace"]
    assert main([*args, "--strict"]) == 1  # broken.png
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 skipped" in out and "warning truncated_jpeg.jpg: Premature end of JPEG file" in out
    assert main(["info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "1 skipped, 2 warnings" in out and "warning truncated_jpeg.jpg: Premature end" in out
    assert main(["info", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [w["path"] for w in info["warnings"]] == ["junk_jpeg_header.jpg", "truncated_jpeg.jpg"]


def test_strict_fails_on_a_truncated_jpeg_unless_kept(testimages, tmp_path, capsys):
    (testimages / "broken.png").unlink()
    assert main(["build", str(testimages), str(tmp_path / "c"), "--strict"]) == 1
    assert "truncated_jpeg.jpg: truncated" in capsys.readouterr().err
    kept = ["build", str(testimages), str(tmp_path / "c"), "--strict", "--keep-truncated"]
    assert main(kept) == 0


# docs/build.md: a missing or empty source, no images, an unwritable destination, or a path that
# is not an mmcache cache: "one line, `mmcache: error: ...`, exit status 1". An option value out
# of range is a usage error, exit status 2, as argparse gives for a malformed one.
@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["build", "{tmp}/missing", "{tmp}/c"], "source not found", 1),
        (["build", "{tmp}", "{tmp}/c"], "no images found", 1),
        (["build", "{src}", "{src}"], "is not an mmcache cache", 1),
        (["build", "{src}", "/proc/nope"], "cannot write the cache here", 1),
        (["build", "{src}", "{tmp}/c", "--max-side", "0"], "expected a positive whole number", 2),
        (["build", "{src}", "{tmp}/c", "--compact-at", "1.5"], "expected a share between 0", 2),
    ],
)
def test_user_mistakes_are_one_line_errors(small_folder, tmp_path, capsys, args, message, status):
    args = [a.format(tmp=tmp_path / "empty", src=small_folder) for a in args]
    (tmp_path / "empty").mkdir()
    code = main(args)
    err = capsys.readouterr().err
    assert code == status
    assert err.startswith("mmcache: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_strict_build_exits_non_zero(testimages, tmp_path, capsys):
    assert main(["build", str(testimages), str(tmp_path / "c"), "--strict"]) == 1
    assert "broken.png" in capsys.readouterr().err


def test_bad_option_values_are_one_line_usage_errors_with_status_2(small_folder, tmp_path, capsys):
    assert main(["build", str(small_folder), str(tmp_path / "c"), "--size", "big"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmcache: error: argument --size: size must look like WIDTHxHEIGHT")
    assert err.count("\n") == 1 and not (tmp_path / "c").exists()
    # the mistake people make: a single number
    assert main(["build", str(small_folder), str(tmp_path / "c"), "--size", "224"]) == 2
    err = capsys.readouterr().err
    assert "for a square write 224x224, to keep the aspect ratio use --short-side 224" in err


def test_compact_at_chooses_between_appending_and_a_compact_data_file(
    small_folder, tmp_path, capsys
):
    cache = str(tmp_path / "c")
    assert main(["build", str(small_folder), cache, "--workers", "0"]) == 0
    capsys.readouterr()
    for seed, share, where in [(1, "0", "a new data file"), (2, "100%", "appended")]:
        write_image(small_folder / "cat" / "img_000.jpg", 64, 48, seed=seed)
        args = ["build", str(small_folder), cache, "--workers", "0", "--compact-at", share]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "1 decoded" in out and f"({where}" in out


def test_python_dash_m_and_the_demo(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmcache",
            "demo",
            "--images",
            "24",
            "--image-size",
            "64x48",
            "--epochs",
            "2",
            "--workers",
            "0",
            "--workdir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "pixels identical to decoding: yes" in r.stdout
    for name in ("decode every epoch", "mmcache DataLoader", "mmcache BatchLoader"):
        assert r.stdout.count(f"{name:<20} epoch") == 2
        assert f"best epoch, {name:<20}" in r.stdout
    assert (tmp_path / "demo" / "cache" / "manifest.json").exists()
    # --image-size is WxH; the library's image_size is (height, width)
    assert "photo-like JPEGs of 64x48 in" in r.stdout
    image = next((tmp_path / "demo" / "images").rglob("*.jpg"))
    assert cv2.imread(str(image)).shape == (48, 64, 3)


def test_reduced_decode_flag_reaches_the_cache(small_folder, tmp_path, capsys):
    args = ["build", str(small_folder), str(tmp_path / "c"), "--max-side", "16", "--workers", "1"]
    assert main([*args, "--reduced-decode"]) == 0
    assert MemmapImageDataset(tmp_path / "c").manifest.options["reduced_decode"] is True
    assert main(args) == 1  # without the flag: other options, refused
    assert "--max-side 16 --reduced-decode" in capsys.readouterr().err
    assert main([*args, "--replace"]) == 0  # a rebuild, not "up to date"
    assert "up to date" not in capsys.readouterr().out
    assert MemmapImageDataset(tmp_path / "c").manifest.options["reduced_decode"] is False


# --- messages that say what they mean ---------------------------------------------------------


def _build(src, cache, *extra):
    return main(["build", str(src), str(cache), "--workers", "1", *extra])


def test_the_build_summary_counts_what_was_decoded_reused_and_removed(
    small_folder, tmp_path, capsys
):
    cache = tmp_path / "c"
    assert _build(small_folder, cache) == 0
    out = capsys.readouterr().out
    assert "12 images in 3 classes" in out and "\n  12 decoded; 0 skipped" in out
    assert "img/s" not in out  # a rate over a fraction of a second says nothing
    os.utime(small_folder / "dog" / "img_005.jpg")  # touched: modified, nothing lost
    assert _build(small_folder, cache) == 0
    out = capsys.readouterr().out
    assert "1 decoded (1 changed since the last build), 11 reused; 0 skipped" in out
    assert "dropped" not in out and "removed" not in out
    (small_folder / "dog" / "img_006.jpg").unlink()
    write_image(small_folder / "dog" / "extra.jpg", 20, 20, seed=9)
    assert _build(small_folder, cache) == 0
    out = capsys.readouterr().out
    assert "12 images in 3 classes" in out
    assert "1 decoded (1 new), 11 reused, 1 removed (gone from the source); 0 skipped" in out


def test_quiet_prints_nothing_and_logs_get_no_carriage_returns(small_folder, tmp_path, capsys):
    assert _build(small_folder, tmp_path / "c", "--quiet") == 0
    assert capsys.readouterr() == ("", "")
    # stderr is not a terminal here: no progress bar, so no carriage return anywhere
    run = subprocess.run(
        [sys.executable, "-m", "mmcache", "build", str(small_folder), str(tmp_path / "d")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "\r" not in run.stderr + run.stdout
    assert "12 images in 3 classes" in run.stdout


def test_info_says_when_the_source_is_gone_and_gives_sizes_as_height_by_width(
    small_folder, tmp_path, capsys
):
    assert _build(small_folder, tmp_path / "c", "--size", "32x24") == 0
    capsys.readouterr()
    assert main(["info", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "all 24x32x3 (height x width x channels)" in out
    assert f"source:     {small_folder}, unchanged" in out
    assert "1 classes" not in out and "3 classes" in out
    os.rename(small_folder, tmp_path / "moved")
    assert main(["info", str(tmp_path / "c")]) == 0
    assert f"source:     not found at {small_folder}, so not compared" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["min_size"] == [24, 32, 3] and info["source_found"] is False


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p, "not an mmcache cache (it holds 'cat' and more)"),
        (lambda p: (p.parent / "e").mkdir() or p.parent / "e", "an empty folder, not a cache"),
        (
            lambda p: (
                (p.parent / "s").mkdir() or (p.parent / "s" / "lock").touch() or p.parent / "s"
            ),
            "a build was stopped before it published, or is running now",
        ),
    ],
)
def test_opening_what_is_not_a_cache_says_what_it_is(small_folder, tmp_path, capsys, make, message):
    assert main(["info", str(make(small_folder))]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mmcache: error: ") and message in err and err.count("\n") == 1


def test_every_argument_of_every_command_has_help():
    from mmcache.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"{name} {action.dest}"
        for name, sub in commands.choices.items()
        for action in sub._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert missing == []


# --- every option a message offers is one the command (or function) it names accepts ------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from mmcache.cli import _parser

    parser = _parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _accepts(function, keyword: str) -> bool:
    return keyword in inspect.signature(function).parameters


def assert_offers_accepted(message: str, command: str, function) -> None:
    """Each option ``message`` offers works: a `mmcache SUB --flag` or `name(..., kw=...)` in
    backticks where that command or function takes it; a bare --flag or kw=True where the message
    came from: the subcommand ``command`` and the Python call ``function`` (the pair that mirror
    each other, as a library message serves both)."""
    subcommands = _subcommands()
    offered = 0
    for sub, rest in re.findall(r"`mmcache (\w+)([^`]*)`", message):
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
            assert flag in subcommands[sub]._option_string_actions, (sub, flag, message)
            offered += 1
    for name, args in re.findall(r"`(\w+)\(([^`]*)\)`", message):
        for keyword in re.findall(r"\b([a-z_]+)=", args):
            assert _accepts(getattr(mmcache, name), keyword), (name, keyword, message)
            offered += 1
    bare = re.sub(r"`[^`]*`", "", message)
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", bare):
        assert flag in subcommands[command]._option_string_actions, (flag, message)
        offered += 1
    for keyword in re.findall(r"\b([a-z_]+)=True", bare):
        assert _accepts(function, keyword), (keyword, message)
        offered += 1
    assert offered or "free some space there" in message, message


# Each way a full disk is met: (the subcommand, the Python call it mirrors, what to run).
SPACE_CASES = {
    "build": ("build", "build_cache", lambda src, c, tmp: main(["build", str(src), str(c)])),
    "create_lazy_cache": ("build", "create_lazy_cache", lambda src, c, tmp: (
        mmcache.create_lazy_cache(src, c))),
    "dataset": ("build", "MemmapImageDataset", lambda src, c, tmp: (
        MemmapImageDataset(c, source=src))),
    "copy": ("copy", "copy_cache", lambda src, c, tmp: main(["copy", str(c), str(tmp / "d")])),
    "compact": ("compact", "compact_cache", lambda src, c, tmp: main(["compact", str(c)])),
    "repair": ("verify", "repair_cache", lambda src, c, tmp: (
        _flip_a_pixel(c), main(["verify", str(c), "--repair"]))[1]),
}  # fmt: skip


def _flip_a_pixel(cache: Path) -> None:
    """Damage record 0's first byte, so a repair has a record to decode again."""
    m = mmcache.format.read_manifest(cache)
    with open(m.file("data"), "r+b") as f:
        f.write(bytes([f.read(1)[0] ^ 0xFF]))


@pytest.mark.parametrize("case", list(SPACE_CASES))
def test_a_full_disk_offers_only_options_its_command_accepts(
    small_folder, tmp_path, capsys, monkeypatch, case
):
    command, function, run = SPACE_CASES[case]
    cache = tmp_path / "c"
    if command != "build":  # a cache to copy or compact, built while there is room
        mmcache.build_cache(small_folder, cache, workers=0)
    monkeypatch.setattr(mmcache.space, "free_bytes", lambda path: 0)
    try:
        assert run(small_folder, cache, tmp_path) == 1
        message = capsys.readouterr().err
    except mmcache.InsufficientSpaceError as e:
        message = str(e)
    assert "needs" in message and "free there" in message, message
    assert_offers_accepted(message, command, getattr(mmcache, function))
    if case == "repair":  # a repair has no way to start anyway: a build's --force is not its
        assert "force" not in message, message


@pytest.mark.parametrize("through", ["cli", "dataset"])
def test_changed_options_offer_only_options_their_command_accepts(
    small_folder, tmp_path, capsys, through
):
    cache = tmp_path / "c"
    mmcache.create_lazy_cache(small_folder, cache, max_side=32)
    if through == "cli":
        assert main(["build", str(small_folder), str(cache), "--max-side", "16"]) == 1
        message, function = capsys.readouterr().err, mmcache.build_cache
    else:
        with pytest.raises(mmcache.OptionsChangedError) as e:
            MemmapImageDataset(cache, source=small_folder, max_side=16)
        message, function = str(e.value), MemmapImageDataset
    assert "--replace" in message and "replace=True" in message
    assert_offers_accepted(message, "build", function)


def test_every_command_written_in_a_message_parses():
    """Static: each `mmcache SUB --flag ...` in mmcache's source names a subcommand and flags it
    has (messages built at run time are checked above)."""
    subcommands = _subcommands()
    package = Path(mmcache.__file__).parent
    found = 0
    for path in package.glob("*.py"):
        for sub, rest in re.findall(r"`mmcache (\w+)([^`]*)`", path.read_text()):
            assert sub in subcommands, (path.name, sub)
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", rest):
                assert flag in subcommands[sub]._option_string_actions, (path.name, sub, flag)
            found += 1
    assert found >= 10


@pytest.mark.parametrize("command", ["plan {src}", "info {cache} --json"])
def test_output_into_a_closed_pipe_ends_quietly_with_status_141(small_folder, tmp_path, command):
    mmcache.build_cache(small_folder, tmp_path / "c", workers=0)
    args = command.format(src=small_folder, cache=tmp_path / "c").split()
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as after `| head -1`
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mmcache", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (141, "")


def test_every_command_has_a_description_in_its_help(capsys):
    for name in _subcommands():
        assert main([name, "--help"]) == 0
        lines = capsys.readouterr().out.splitlines()
        # usage (one or more lines), a blank line, then the description
        description = lines[lines.index("") + 1]
        assert description[0].isupper() and description.endswith("."), (name, lines[:4])


def test_file_names_with_odd_bytes_keep_json_json_and_lines_lines(tmp_path, capsys):
    src = tmp_path / "src"
    write_image(src / "a" / "good.jpg", 32, 24)
    odd = [b"a/\xfe\xff.jpg", b"a/x.jpg\n  skipped y.jpg: not an image\x1b[2J.jpg"]
    for name in odd:  # not images: skipped, so their names reach the summary and the manifest
        with open(os.fsencode(src) + b"/" + name, "wb") as f:
            f.write(b"not an image")
    # the same image under a second class, by a name with an escape sequence: a warning line
    (src / "b").mkdir()
    os.symlink("../a/good.jpg", os.fsencode(src) + b"/b/\x1b[2Jlinked.jpg")
    assert main(["build", str(src), str(tmp_path / "c"), "--workers", "0"]) == 0
    build_out = capsys.readouterr().out
    assert main(["info", str(tmp_path / "c")]) == 0
    info_out = capsys.readouterr().out
    assert "  warning b/\\x1b[2Jlinked.jpg: " in info_out
    for out in (build_out, info_out):
        skipped = [line for line in out.splitlines() if line.lstrip().startswith("skipped ")]
        assert len(skipped) == 2, out
        assert "\x1b" not in out and "a/x.jpg\\n  skipped y.jpg" in out
        assert "a/\\xfe\\xff.jpg" in out
    assert main(["info", str(tmp_path / "c"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sorted(os.fsencode(s["path"]) for s in info["skipped"]) == sorted(odd)


def test_another_source_is_one_line_offering_replace_and_source_moved_which_work(
    small_folder, tmp_path, capsys
):
    cache = str(tmp_path / "c")
    assert main(["build", str(small_folder), cache, "--short-side", "32", "-q"]) == 0
    other = shutil.copytree(small_folder, tmp_path / "val")  # the same files, mtimes kept
    assert main(["build", str(other), cache, "--short-side", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mmcache: error: ") and len(err.strip().splitlines()) == 1
    assert str(small_folder.resolve()) in err and str(other.resolve()) in err
    assert "--replace" in err and "--source-moved" in err
    assert main(["build", str(other), cache, "--short-side", "32", "--source-moved"]) == 0
    assert "0 decoded, 12 reused" in capsys.readouterr().out
    assert main(["build", str(small_folder), cache, "--short-side", "32", "--replace"]) == 0
    assert MemmapImageDataset(cache).samples[0][0].startswith(str(small_folder.resolve()))


def test_the_cli_s_defaults_are_the_library_s():
    from dataclasses import fields

    from mmcache.decode import Options
    from mmcache.demo import run_demo
    from mmcache.residency import warm_cache

    subcommands = _subcommands()
    library = {
        "build": {
            **{f.name: f.default for f in fields(Options)},
            **{
                name: p.default
                for name, p in inspect.signature(mmcache.build_cache).parameters.items()
                if p.default is not inspect.Parameter.empty
            },
        },
        "warm": {"max_memory": inspect.signature(warm_cache).parameters["max_memory"].default},
        "demo": {
            name: p.default
            for name, p in inspect.signature(run_demo).parameters.items()
            if p.default is not inspect.Parameter.empty
        },
    }
    compared = 0
    for sub, defaults in library.items():
        for action in subcommands[sub]._actions:
            if action.dest in defaults and action.default is not None:
                assert action.default == defaults[action.dest], (sub, action.dest)
                compared += 1
    assert compared >= 12


def test_printed_paths_have_no_dot_dot(small_folder, tmp_path, capsys):
    # `mmcache build ../data ../cache` from a subfolder: the report names the folder itself
    cache = tmp_path / "sub" / ".." / "c"
    (tmp_path / "sub").mkdir()
    assert main(["build", str(small_folder / "cat" / ".."), str(cache)]) == 0
    out = capsys.readouterr().out
    assert ".." not in out and out.startswith(f"{tmp_path / 'c'}: 12 images")
    assert main(["verify", str(cache)]) == 0
    assert ".." not in capsys.readouterr().out
