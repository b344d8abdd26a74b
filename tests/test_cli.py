"""The command line, called in-process: one-line errors, exit codes, the demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    assert "12 images, 3 classes" in out and "0 skipped" in out
    assert MemmapImageDataset(tmp_path / "c")[0][0].shape == (24, 32, 3)
    assert main(["build", str(small_folder), str(tmp_path / "c"), "--max-side", "32"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_build_lists_skipped_files(testimages, tmp_path, capsys):
    assert main(["build", str(testimages), str(tmp_path / "c"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 skipped" in out and "skipped broken.png" in out
    assert "warning truncated_jpeg.jpg: Premature end of JPEG file" in out


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
        (["build", "{src}", "{tmp}/c", "--max-side", "0"], "max_side must be a positive", 2),
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


def test_bad_size_syntax_is_an_argparse_error(small_folder, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["build", str(small_folder), str(tmp_path / "c"), "--size", "big"])
    assert e.value.code == 2


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
    assert main(args) == 0  # without the flag: other options, so a rebuild, not "up to date"
    assert "up to date" not in capsys.readouterr().out
    assert "reduced_decode" not in MemmapImageDataset(tmp_path / "c").manifest.options
