"""The command line, called in-process: one-line errors, exit codes, the demo."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import write_image

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


# The README: a missing or empty source, no images, an unwritable destination, or a path that
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


def test_reduced_decode_flag_reaches_the_cache(small_folder, tmp_path, capsys):
    args = ["build", str(small_folder), str(tmp_path / "c"), "--max-side", "16", "--workers", "1"]
    assert main([*args, "--reduced-decode"]) == 0
    assert MemmapImageDataset(tmp_path / "c").manifest.options["reduced_decode"] is True
    assert main(args) == 1  # without the flag: other options, refused
    assert "--max-side 16 --reduced-decode" in capsys.readouterr().err
    assert main([*args, "--replace"]) == 0  # a rebuild, not "up to date"
    assert "up to date" not in capsys.readouterr().out
    assert "reduced_decode" not in MemmapImageDataset(tmp_path / "c").manifest.options


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
