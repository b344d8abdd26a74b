"""Building: bad input, strictness, the pixel limit, reuse, refusing to overwrite, atomicity."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    TESTIMAGES,
    make_folder,
    opened_file,
    sigint_by_default,
    wait_until,
    write_image,
)

from mmcache import (
    CacheNotFoundError,
    DestinationError,
    MemmapImageDataset,
    NotACacheError,
    OptionsChangedError,
    SourceChangedError,
    SourceError,
    StrictBuildError,
    build_cache,
)
from mmcache import format as fmt
from mmcache._generation import new_generation
from mmcache.cli import main


def test_build_report_and_files(small_folder, tmp_path):
    report = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert (report.images, report.classes, report.decoded) == (12, 3, 12)
    assert report.skipped == [] and not report.up_to_date
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert m["magic"] == "mmcache" and m["format_version"] == list(fmt.FORMAT_VERSION)
    assert m["classes"] == ["cat", "dog", "emu"] and m["count"] == 12
    assert set(os.listdir(tmp_path / "cache")) == {"manifest.json", "lock", *m["files"].values()}
    assert report.bytes == m["sizes"]["data"]


def test_plain_numpy_reads_a_cache_by_the_spec(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    folder = tmp_path / "cache"
    m = json.loads((folder / "manifest.json").read_text())
    dtype = np.dtype([tuple(f) for f in m["index_dtype"]])
    index = np.fromfile(folder / m["files"]["index"], dtype=dtype)
    data = np.memmap(folder / m["files"]["data"], dtype=np.uint8, mode="r")
    ds = MemmapImageDataset(folder)
    for i, r in enumerate(index):
        n = int(r["height"]) * int(r["width"]) * int(r["channels"])
        img = np.asarray(data[r["offset"] : r["offset"] + n]).reshape(
            r["height"], r["width"], r["channels"]
        )
        assert np.array_equal(img, ds[i][0])
        assert r["offset"] % 64 == 0


def test_undecodable_files_are_skipped_and_recorded(testimages, tmp_path):
    report = build_cache(testimages, tmp_path / "cache", workers=2)
    assert [s["path"] for s in report.skipped] == ["broken.png", "truncated_jpeg.jpg"]
    assert report.skipped[1]["reason"].startswith("truncated")
    m = fmt.read_manifest(tmp_path / "cache")
    assert [s["path"] for s in m.skipped] == ["broken.png", "truncated_jpeg.jpg"]
    warned = {w["path"]: w["reason"] for w in m.warnings}
    assert "extraneous bytes" in warned["junk_jpeg_header.jpg"]
    assert "truncated_jpeg.jpg" not in {
        p.rsplit("/", 1)[-1] for p, _ in MemmapImageDataset(tmp_path / "cache").samples
    }


@pytest.fixture
def cut_jpeg(tmp_path: Path) -> Path:
    """A folder of two real JPEGs, one of them cut to its first half (a download cut short)."""
    src = tmp_path / "cut"
    src.mkdir()
    shutil.copy(TESTIMAGES / "hopper.jpg", src / "whole.jpg")
    data = (TESTIMAGES / "flower.jpg").read_bytes()
    (src / "half.jpg").write_bytes(data[: len(data) // 2])
    return src


def test_a_truncated_jpeg_is_skipped_as_truncated_by_default(cut_jpeg, tmp_path):
    report = build_cache(cut_jpeg, tmp_path / "cache", workers=1)
    assert report.images == 1
    assert [(s["path"], s["reason"].split(":")[0]) for s in report.skipped] == [
        ("half.jpg", "truncated")
    ]
    with pytest.raises(StrictBuildError, match=r"half\.jpg: truncated.*--keep-truncated"):
        build_cache(cut_jpeg, tmp_path / "strict", workers=1, strict=True)
    assert not (tmp_path / "strict").exists()


def test_a_whole_jpeg_with_bytes_after_its_end_is_not_truncated(tmp_path):
    # A phone's appended video or a vendor's trailer: whatever follows the end-of-image marker
    # (here a start-of-scan marker with no end after it) is not the image's.
    src = tmp_path / "tail"
    src.mkdir()
    data = (TESTIMAGES / "flower.jpg").read_bytes()
    (src / "tail.jpg").write_bytes(data + b"\x00\xff\xda\x00\x08 trailer bytes")
    report = build_cache(src, tmp_path / "cache", workers=1, strict=True)
    assert (report.images, report.skipped) == (1, [])


def test_keep_truncated_keeps_it_with_its_warning_and_strict_accepts_it(cut_jpeg, tmp_path):
    report = build_cache(cut_jpeg, tmp_path / "cache", workers=1, keep_truncated=True)
    assert (report.images, report.skipped) == (2, [])
    assert [w["path"] for w in report.warnings] == ["half.jpg"]
    assert "Premature end of JPEG file" in report.warnings[0]["reason"]
    strict = build_cache(cut_jpeg, tmp_path / "strict", workers=1, strict=True, keep_truncated=True)
    assert strict.images == 2
    # the option is part of what the cache was made with: a build without it must repeat it
    with pytest.raises(OptionsChangedError, match="--keep-truncated"):
        build_cache(cut_jpeg, tmp_path / "cache", workers=1)


def test_strict_build_fails_and_leaves_no_cache(testimages, tmp_path):
    with pytest.raises(StrictBuildError, match="broken.png"):
        build_cache(testimages, tmp_path / "cache", strict=True, workers=1)
    with pytest.raises(CacheNotFoundError):
        MemmapImageDataset(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # a failed first build leaves no folder behind


def test_strict_build_keeps_the_previous_cache(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    before = MemmapImageDataset(tmp_path / "cache")[0][0].copy()
    (small_folder / "cat" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with pytest.raises(StrictBuildError, match="bad.jpg"):
        build_cache(small_folder, tmp_path / "cache", strict=True, workers=1)
    ds = MemmapImageDataset(tmp_path / "cache", on_stale="ignore")
    assert len(ds) == 12 and np.array_equal(ds[0][0], before)


def test_images_above_the_pixel_limit_are_refused_without_decoding(tmp_path, monkeypatch):
    write_image(tmp_path / "src" / "big.png", 300, 200)
    write_image(tmp_path / "src" / "ok.png", 20, 20)
    import cv2

    decoded = []
    real = cv2.imread
    monkeypatch.setattr(cv2, "imread", lambda p, *a: decoded.append(opened_file(p)) or real(p, *a))
    report = build_cache(tmp_path / "src", tmp_path / "cache", max_pixels=10_000, workers=0)
    assert report.images == 1
    assert [s["path"] for s in report.skipped] == ["big.png"]
    assert report.skipped[0]["reason"] == (
        "300x200 pixels (60,000), more than the --max-pixels (max_pixels) limit of 10,000"
    )
    assert [Path(p).name for p in decoded] == ["ok.png"]


def _png_header(width: int, height: int) -> bytes:
    """An 8-bit RGB PNG of that size whose image data is not zlib data: its header reads as
    a sound PNG, its decoding fails at once."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IDAT", b"junk") + chunk(b"IEND", b"")


def test_the_default_pixel_limit_is_pillows(tmp_path, capsys):
    # docs/build.md: --max-pixels "default 89,478,485, Pillow's decompression-bomb limit": an image
    # of one pixel more is refused from its header; one of exactly that many is not (it is
    # decoded, and found undecodable: these two have no real pixel data).
    src = tmp_path / "src"
    write_image(src / "ok.png", 20, 20)
    (src / "over.png").write_bytes(_png_header(87211, 1026))  # 89,478,486 pixels
    (src / "at.png").write_bytes(_png_header(16385, 5461))  # 89,478,485 pixels
    assert 87211 * 1026 == 89_478_486 and 16385 * 5461 == 89_478_485
    report = build_cache(src, tmp_path / "cache", workers=1)
    skipped = {s["path"]: s for s in report.skipped}
    assert report.images == 1 and sorted(skipped) == ["at.png", "over.png"]
    assert skipped["over.png"]["state"] == fmt.BAD_TOO_LARGE
    assert "pixels" in skipped["over.png"]["reason"]
    assert skipped["at.png"]["state"] == fmt.BAD_UNDECODABLE
    # the command line applies the same default
    assert main(["build", str(src), str(tmp_path / "cli"), "--workers", "1"]) == 0
    assert "skipped over.png" in capsys.readouterr().out
    cli = fmt.read_manifest(tmp_path / "cli")
    assert cli.skipped == fmt.read_manifest(tmp_path / "cache").skipped


def test_an_unchanged_source_is_a_no_op(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    files = {p.name: p.stat() for p in (tmp_path / "cache").iterdir()}
    again = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert again.up_to_date and again.decoded == 0 and again.images == 12
    after = {p.name: p.stat() for p in (tmp_path / "cache").iterdir()}
    assert {n: (s.st_ino, s.st_mtime_ns) for n, s in files.items()} == {
        n: (s.st_ino, s.st_mtime_ns) for n, s in after.items()
    }


def test_an_up_to_date_build_clears_what_a_killed_build_left(small_folder, tmp_path):
    cache = tmp_path / "cache"
    build_cache(small_folder, cache, workers=1)
    leftover = cache / fmt.file_name("data", new_generation())  # as a kill -9 leaves it
    leftover.write_bytes(b"\0" * 4096)
    assert build_cache(small_folder, cache, workers=1).up_to_date
    assert not leftover.exists()
    assert MemmapImageDataset(cache)[0][0].shape[2] == 3


def test_changed_options_are_refused_unless_replace_is_asked(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    with pytest.raises(OptionsChangedError) as e:
        build_cache(small_folder, tmp_path / "cache", size=(16, 16), workers=1)
    assert "made with the defaults (native size, RGB)" in str(e.value)
    assert "asks for --size 16x16" in str(e.value) and "--replace" in str(e.value)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == before
    report = build_cache(small_folder, tmp_path / "cache", size=(16, 16), workers=1, replace=True)
    assert not report.up_to_date and report.decoded == 12 and report.reused == 0
    assert (report.dropped, report.removed) == (12, 0)
    assert MemmapImageDataset(tmp_path / "cache")[0][0].shape == (16, 16, 3)
    # the previous generation's files are gone
    assert len([n for n in os.listdir(tmp_path / "cache") if n.endswith(".bin")]) == 4


def test_a_changed_source_is_rebuilt(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    write_image(small_folder / "dog" / "new.jpg", 30, 20, seed=99)
    report = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert not report.up_to_date and report.images == 13


@pytest.mark.parametrize("content", ["file", "folder"])
def test_a_path_that_is_not_a_cache_is_never_overwritten(small_folder, tmp_path, content):
    target = tmp_path / "precious"
    if content == "file":
        target.write_text("keep me")
    else:
        target.mkdir()
        (target / "thesis.tex").write_text("keep me")
    with pytest.raises(NotACacheError, match="precious"):
        build_cache(small_folder, target, workers=1)
    kept = target if content == "file" else target / "thesis.tex"
    assert kept.read_text() == "keep me"


def test_an_unwritable_destination_is_a_clear_error(small_folder, tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(DestinationError, match="cannot write"):
        build_cache(small_folder, tmp_path / "afile" / "cache", workers=1)
    with pytest.raises(DestinationError, match="cannot write"):
        build_cache(small_folder, "/proc/mmcache-cache", workers=1)


def _build_in_subprocess(src: Path, cache: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mmcache", "build", str(src), str(cache), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _data_blocks(cache: Path) -> dict[str, int]:
    """Bytes allocated to each data file of ``cache`` now (a sparse file grows as it is written)."""
    if not cache.is_dir():
        return {}
    found = {}
    for name in os.listdir(cache):
        if name.startswith("data-"):
            with contextlib.suppress(FileNotFoundError):
                found[name] = os.stat(cache / name).st_blocks * 512
    return found


def _wait_for_data_file(
    cache: Path, proc: subprocess.Popen, min_bytes: int, before: dict[str, int] | None = None
) -> Path:
    """Wait until the build has written ``min_bytes`` of pixels, into a new data file or
    appended to the current one (``before``: the data files' bytes when it started); returns
    the file it writes."""
    before = before or {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        for name, allocated in _data_blocks(cache).items():
            if allocated - before.get(name, 0) >= min_bytes:
                return cache / name
        time.sleep(0.02)
    raise AssertionError("the build never started writing")


@pytest.fixture(scope="session")
def _big_image(tmp_path_factory) -> Path:
    return write_image(tmp_path_factory.mktemp("big") / "one.png", 1600, 1200)


@pytest.fixture
def big_folder(tmp_path: Path, _big_image: Path) -> Path:
    """120 hard links to one 1600x1200 PNG: a build of a few seconds, time to kill it mid-way."""
    for k in range(120):
        d = tmp_path / "big" / ("a" if k % 2 else "b")
        d.mkdir(parents=True, exist_ok=True)
        os.link(_big_image, d / f"{k:03d}.png")
    return tmp_path / "big"


def test_a_killed_build_leaves_the_previous_cache_intact(big_folder, small_folder, tmp_path):
    cache = tmp_path / "cache"
    build_cache(small_folder, cache, workers=1)
    before = [MemmapImageDataset(cache)[i][0].copy() for i in range(12)]
    data_before = _data_blocks(cache)
    # another source: its build replaces the cache (--replace), or would, had it not been killed
    proc = _build_in_subprocess(big_folder, cache, "--workers", "2", "--replace")
    _wait_for_data_file(cache, proc, 1 << 20, data_before)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    ds = MemmapImageDataset(cache, on_stale="ignore")
    assert len(ds) == 12
    assert all(np.array_equal(ds[i][0], before[i]) for i in range(12))
    # the next build cleans up what the killed one left and succeeds
    report = build_cache(big_folder, cache, workers=2, replace=True)
    assert report.images == 120
    assert len([n for n in os.listdir(cache) if n.endswith(".bin")]) == 4


def test_a_killed_first_build_leaves_nothing_a_reader_accepts(big_folder, tmp_path):
    cache = tmp_path / "cache"
    proc = _build_in_subprocess(big_folder, cache, "--workers", "2")
    _wait_for_data_file(cache, proc, 1 << 20)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    with pytest.raises(CacheNotFoundError, match="no finished cache"):
        MemmapImageDataset(cache)


def test_ctrl_c_stops_the_build_and_its_workers_promptly(big_folder, tmp_path):
    cache = tmp_path / "cache"
    with sigint_by_default():  # as a terminal's foreground job, whatever started pytest
        proc = _build_in_subprocess(big_folder, cache, "--workers", "2")
    data = _wait_for_data_file(cache, proc, 1 << 20)
    # A second name for the new data file: the build deletes its own when it stops, this one
    # keeps the file, to see afterwards how much of it the workers had written.
    os.link(data, tmp_path / "kept.bin")
    at_signal = os.stat(data).st_blocks * 512
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert b"Traceback" not in err

    def group_gone() -> bool:
        return not subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).stdout

    wait_until(group_gone, "the build's workers to exit")
    # "At once", not after the work queued: after the signal, the workers wrote at most the
    # records they were writing (2 of 120 records, 5.76 MB each), far from the rest.
    kept = (tmp_path / "kept.bin").stat()
    assert kept.st_blocks * 512 - at_signal < (kept.st_size - at_signal) // 4
    with pytest.raises(CacheNotFoundError):
        MemmapImageDataset(cache)
    assert not cache.exists()


HOLDER = """
import sys, time
from pathlib import Path
from mmcache import build_cache
src, cache, flags = sys.argv[1], sys.argv[2], Path(sys.argv[3])

def pause_once(done, total):  # called while decoding, so while this build holds the lock
    if not (flags / "holding").exists():
        (flags / "holding").touch()
        deadline = time.monotonic() + 120
        while not (flags / "release").exists():
            assert time.monotonic() < deadline, "never released"
            time.sleep(0.01)

build_cache(src, cache, workers=1, progress=pause_once)
(flags / "published").touch()
"""


def _waiting_for_lock(pid: int, lock: Path) -> bool:
    """Whether process ``pid`` is blocked waiting for a lock on ``lock`` (``/proc/locks``
    lists each waiter after "->", with its pid and the file's device:inode)."""
    inode = os.stat(lock).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        waiter = len(fields) > 6 and fields[1] == "->" and fields[5] == str(pid)
        if waiter and int(fields[6].rsplit(":", 1)[1]) == inode:
            return True
    return False


def test_builds_of_one_cache_take_turns_on_the_lock(small_folder, tmp_path):
    # docs/build.md: "Builds of one cache take a lock and run one after the other". The first build
    # stops while decoding (holding the lock) until the test releases it; the second, of the same
    # source, must wait for the lock, and then find the first one's cache up to date.
    cache, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(small_folder), str(cache), str(flags)],
        stderr=subprocess.PIPE,
        env=env,
    )
    second = None
    try:
        wait_until(lambda: (flags / "holding").exists() or first.poll() is not None, "the hold")
        assert first.poll() is None, first.communicate()
        second = subprocess.Popen(
            [sys.executable, "-m", "mmcache", "build", str(small_folder), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        wait_until(
            lambda: (
                _waiting_for_lock(second.pid, cache / fmt.LOCK_NAME) or second.poll() is not None
            ),
            "the second build to wait for the lock",
        )
        assert second.poll() is None, second.communicate()
        assert not (cache / fmt.MANIFEST_NAME).exists()  # nothing published yet
        (flags / "release").touch()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
    finally:
        (flags / "release").touch()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (flags / "published").exists()
    # it ran after the first had published: it found the cache up to date, decoding nothing
    assert b"up to date" in out
    assert len(MemmapImageDataset(cache)) == 12


def test_cache_folder_can_be_moved_as_a_unit(small_folder, tmp_path):
    build_cache(small_folder, tmp_path / "cache", workers=1)
    shutil.move(tmp_path / "cache", tmp_path / "moved")
    ds = MemmapImageDataset(tmp_path / "moved")
    assert len(ds) == 12 and ds[4][0].shape == (48, 64, 3)


def test_a_script_without_a_main_guard_builds_with_workers(tmp_path):
    # Spawned and forkserver children re-run the parent's script unless told otherwise: with a
    # top-level build_cache call that meant a build hanging forever, and the script's side
    # effects repeated in every worker.
    src = make_folder(tmp_path / "src", {"a": [(16, 8)] * 40})  # 3 tasks: 2 worker processes
    script = tmp_path / "train.py"
    script.write_text(
        "from mmcache import build_cache\n"
        "print('top level ran', flush=True)\n"
        f"r = build_cache({str(src)!r}, {str(tmp_path / 'cache')!r}, workers=2)\n"
        "print('images', r.images)\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("top level ran") == 1
    assert "images 40" in r.stdout


# --- builds that end with nothing, and what a skipped file is ---------------------------------


def test_a_build_in_which_no_image_decodes_is_an_error_and_publishes_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(3):
        (src / f"{k}.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(SourceError, match="none of its 3 images could be cached") as e:
        build_cache(src, tmp_path / "cache", workers=1)
    assert "0.jpg: a damaged or truncated JPEG file" in str(e.value)
    assert not (tmp_path / "cache").exists()
    # over an existing cache: the old one stays
    make_folder(tmp_path / "good", {"a": [(20, 20)]})
    build_cache(tmp_path / "good", tmp_path / "cache", workers=1)
    before = sorted(os.listdir(tmp_path / "cache"))
    for p in (tmp_path / "good" / "a").iterdir():
        p.write_bytes(b"")
    with pytest.raises(SourceError, match="none of its 1 images"):
        build_cache(tmp_path / "good", tmp_path / "cache", workers=1)
    assert sorted(os.listdir(tmp_path / "cache")) == before


SKIP_REASONS = {
    "empty.jpg": (b"", "an empty file (0 bytes)"),
    "lfs.jpg": (
        b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 12345\n",
        "a Git LFS pointer, not the image itself (fetch the images with `git lfs pull`)",
    ),
    "page.jpg": (b"<!DOCTYPE html><html><body>404</body></html>", "an HTML page, not an image"),
    "notes.png": (b"just some text\n", "a text file, not an image"),
    "noise.png": (bytes(range(7, 250)), "not an image: its first bytes (07 08 09 0a"),
    "cut.png": (None, "a damaged or truncated PNG file: the decoder cannot read it"),
    "bad.jpg": (b"\xff\xd8\xff\xe0 junk", "a damaged or truncated JPEG file"),
}


def test_skip_reasons_say_what_the_file_is(tmp_path):
    src = make_folder(tmp_path / "src", {"a": [(20, 20)]})
    png = write_image(tmp_path / "whole.png", 40, 40).read_bytes()
    for name, (content, _) in SKIP_REASONS.items():
        (src / "a" / name).write_bytes(png[:60] if content is None else content)
    report = build_cache(src, tmp_path / "cache", workers=1)
    reasons = {s["path"].split("/")[-1]: s["reason"] for s in report.skipped}
    assert set(reasons) == set(SKIP_REASONS)
    for name, (_, expected) in SKIP_REASONS.items():
        assert reasons[name].startswith(expected), (name, reasons[name])


def test_a_build_waiting_for_another_s_lock_says_so_then_runs(small_folder, tmp_path):
    import fcntl

    build_cache(small_folder, tmp_path / "cache", workers=1)
    write_image(small_folder / "cat" / "new.jpg", 20, 20, seed=3)
    fd = os.open(tmp_path / "cache" / "lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a running build holds it
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcache", "build", str(small_folder), str(tmp_path / "cache")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()  # blocks until it says something: the wait
        assert line.startswith("mmcache: waiting for another build of ") and "lock" in line
        assert proc.poll() is None and fmt.read_manifest(tmp_path / "cache").count == 12
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "13 images in 3 classes" in out


def test_another_source_is_refused_naming_both_and_the_cache_is_untouched(small_folder, tmp_path):
    cache = tmp_path / "cache"
    build_cache(small_folder, cache, workers=1)
    before = fmt.read_manifest(cache)
    val = make_folder(tmp_path / "val", {"cat": [(20, 20)], "dog": [(20, 20)], "emu": [(9, 9)]})
    with pytest.raises(SourceChangedError) as e:
        build_cache(val, cache, workers=1)
    message = str(e.value)
    assert f"made from {small_folder.resolve()}; this build's source is {val.resolve()}" in message
    assert "--replace (replace=True)" in message and "--source-moved (source_moved=True)" in message
    assert "\n" not in message
    after = fmt.read_manifest(cache)
    assert (after.generation, after.source) == (before.generation, before.source)
    files = {before.file(kind).name for kind in fmt.FILE_KINDS}
    assert set(os.listdir(cache)) == {"manifest.json", "lock", *files}
    report = build_cache(val, cache, workers=1, replace=True)
    assert report.images == 3 and fmt.read_manifest(cache).source["root"] == str(val.resolve())


def test_a_moved_source_is_accepted_with_source_moved_keeping_its_records(small_folder, tmp_path):
    cache = tmp_path / "cache"
    build_cache(small_folder, cache, workers=1)
    moved = small_folder.rename(tmp_path / "moved")  # the same files: sizes and mtimes kept
    with pytest.raises(SourceChangedError, match=r"src \(no longer there\); this build's"):
        build_cache(moved, cache, workers=1)
    report = build_cache(moved, cache, workers=1, source_moved=True)
    assert (report.decoded, report.reused, report.images) == (0, 12, 12)
    assert fmt.read_manifest(cache).source["root"] == str(moved.resolve())
    assert build_cache(moved, cache, workers=1).up_to_date


def test_a_broken_symlink_is_skipped_as_such(small_folder, tmp_path):
    os.symlink("nowhere.jpg", small_folder / "cat" / "gone.jpg")
    report = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert report.skipped[0]["path"] == "cat/gone.jpg"
    assert report.skipped[0]["reason"] == (
        "a broken symbolic link: it points to nowhere.jpg, which does not exist"
    )
    assert build_cache(small_folder, tmp_path / "cache", workers=1).up_to_date  # not retried


def test_a_file_under_two_classes_is_kept_twice_with_a_warning(small_folder, tmp_path):
    os.symlink("../cat/img_000.jpg", small_folder / "dog" / "linked.jpg")
    report = build_cache(small_folder, tmp_path / "cache", workers=1)
    assert report.images == 13
    assert [w["path"] for w in report.warnings] == ["dog/linked.jpg"]
    assert "the same file as cat/img_000.jpg" in report.warnings[0]["reason"]
    assert fmt.read_manifest(tmp_path / "cache").warnings == report.warnings


def test_size_is_height_width_and_interpolations_have_torchvision_s_names(small_folder, tmp_path):
    import hashlib

    from mmcache.decode import Options

    report = build_cache(
        small_folder, tmp_path / "c", size=(24, 32), interpolation="bilinear", workers=1
    )
    assert report.images and MemmapImageDataset(tmp_path / "c")[0][0].shape == (24, 32, 3)
    # The manifest records every option as Options has it: size (height, width), the names.
    options = fmt.read_manifest(tmp_path / "c").options
    assert options["size"] == [24, 32] and options["interpolation"] == "bilinear"
    stored = {"size": [24, 32], "max_side": None, "short_side": None, "interpolation": "bilinear",
              "color": "rgb", "max_pixels": 89_478_485, "reduced_decode": False, "pixels": "rgb",
              "keep_truncated": False, "mask": None, "exif_orientation": True}  # fmt: skip
    assert options == stored
    digest = hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()
    assert Options(size=(24, 32), interpolation="bilinear").fingerprint() == digest
    assert Options.from_json(stored) == Options(size=(24, 32), interpolation="bilinear")
    with pytest.raises(ValueError, match="got 'linear'"):  # OpenCV's name: not one of these
        build_cache(small_folder, tmp_path / "c", size=(24, 32), interpolation="linear")


def test_the_cli_s_size_is_width_x_height_and_opencv_s_names_are_refused(
    small_folder, tmp_path, capsys
):
    args = ["build", str(small_folder), str(tmp_path / "c"), "--size", "32x24", "--workers", "1"]
    assert main([*args, "--interpolation", "bicubic"]) == 0
    options = fmt.read_manifest(tmp_path / "c").options
    assert options["size"] == [24, 32] and options["interpolation"] == "bicubic"
    assert MemmapImageDataset(tmp_path / "c")[0][0].shape == (24, 32, 3)
    assert main([*args, "--interpolation", "bicubic"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert main([*args, "--interpolation", "cubic"]) == 2
    assert "invalid choice: 'cubic'" in capsys.readouterr().err
