"""A cache folder from someone else, or another user on the machine: nothing written, truncated,
created or leaked outside the cache's own files (docs/reliability.md, "Security").

The attacker is uid 65534 (``setpriv``) where the attack needs another user; root is the victim.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder

from mmcache import (
    CacheFormatError,
    UnsafeCacheError,
    build_cache,
    compact_cache,
    copy_cache,
    create_lazy_cache,
    evict_cache,
    repair_cache,
    warm_cache,
)
from mmcache import format as fmt

NOBODY = 65534
ROOT = Path(__file__).resolve().parents[1]
SETPRIV = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as a second user (uid 65534)",
)


@pytest.fixture
def shared():
    """A folder every user may write to, sticky, like /tmp (tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="mmcache-security-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_attacker(*argv: str | os.PathLike) -> None:
    """Run a command as uid 65534."""
    subprocess.run([*SETPRIV, *map(str, argv)], check=True, timeout=30)


def tiny(root: Path) -> Path:
    return make_folder(root, {"a": [(8, 8), (8, 8)], "b": [(8, 8)]})


def data_file(cache: Path) -> Path:
    return cache / json.loads((cache / fmt.MANIFEST_NAME).read_text())["files"]["data"]


def victim_file(path: Path, size: int = 100_000) -> bytes:
    """A file of root's, such as a ``.bashrc``; returns its bytes."""
    content = (b"# root's file\n" * (size // 14 + 1))[:size]
    path.write_bytes(content)
    return content


def given_away(cache: Path, mode: int = 0o644, uid: int = NOBODY) -> None:
    """Make ``cache`` the attacker's, as if they had made it (chown -R 65534)."""
    for p in [cache, *cache.iterdir()]:
        os.chown(p, uid, uid)
        p.chmod(0o755 if p.is_dir() else mode)


@needs_root
def test_a_read_never_writes_through_a_planted_data_link(shared, tmp_path):
    """Why 1: a lazy cache whose data file is a link to a file of the reader's."""
    from mmcache import MemmapImageDataset

    src = tiny(shared / "src")
    cache = shared / "cache"
    create_lazy_cache(src, cache, workers=0)
    given_away(cache)
    bashrc = shared / "bashrc"
    before = victim_file(bashrc)
    as_attacker("ln", "-sf", bashrc, data_file(cache))
    with pytest.raises(UnsafeCacheError, match="symbolic link"):
        MemmapImageDataset(cache, source=src)[0]  # the caller names the source: trusted
    assert bashrc.read_bytes() == before


def test_a_fill_never_writes_through_a_hard_link(tmp_path):
    """Why 1, with a hard link (a user may make one to a file of theirs only, where
    fs.protected_hardlinks is on; root makes it here): a file with two names is not written."""
    from mmcache import MemmapImageDataset

    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    create_lazy_cache(src, cache, workers=0)
    data = data_file(cache)
    target = tmp_path / "victim"
    before = victim_file(target)
    data.unlink()
    os.link(target, data)
    with pytest.raises(UnsafeCacheError, match="2 names"):
        MemmapImageDataset(cache, source=src)[0]
    assert target.read_bytes() == before


def test_a_fill_never_writes_through_a_hard_linked_state_file(tmp_path):
    """As above, the state file: the data file opened for writing first is closed again and
    the refusal is the one raised (the state file holds what it held, so the cache opens)."""
    from mmcache import MemmapImageDataset

    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    create_lazy_cache(src, cache, workers=0)
    state = cache / json.loads((cache / fmt.MANIFEST_NAME).read_text())["files"]["state"]
    target = tmp_path / "victim"
    target.write_bytes(state.read_bytes())
    before = target.read_bytes()
    state.unlink()
    os.link(target, state)
    with pytest.raises(UnsafeCacheError, match="2 names"):
        MemmapImageDataset(cache, source=src)[0]
    assert target.read_bytes() == before
    assert not any(data_file(cache).read_bytes())


@needs_root
def test_root_refuses_to_build_into_another_users_folder(shared):
    """Why 2: the attacker made the folder, and could plant links named like the next files."""
    src = tiny(shared / "src")
    as_attacker("mkdir", shared / "cache")
    with pytest.raises(UnsafeCacheError, match="belongs to uid 65534"):
        build_cache(src, shared / "cache", workers=0)
    assert os.listdir(shared / "cache") == []


def test_a_folder_every_user_can_write_without_the_sticky_bit_is_refused(tmp_path):
    src = tiny(tmp_path / "src")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o777)
    with pytest.raises(UnsafeCacheError, match="writable by every user"):
        build_cache(src, tmp_path / "cache", workers=0)
    (tmp_path / "cache").chmod(0o1777)  # /tmp's protection: allowed
    build_cache(src, tmp_path / "cache", workers=0)


def test_files_a_build_creates_are_never_opened_through_planted_links(tmp_path):
    """Why 2: with the generation id read off the data file as it appears, links named like
    the next index file and ``manifest.json.tmp<pid>`` were followed by the build's writes."""
    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    target = tmp_path / "victim"
    before = victim_file(target)

    def race(done, total):  # the attacker, acting while the build decodes
        for name in os.listdir(cache):
            if name.startswith("data-"):
                for planted in (name.replace("data-", "index-"), f"manifest.json.tmp{os.getpid()}"):
                    if not (cache / planted).is_symlink():
                        (cache / planted).symlink_to(target)

    with pytest.raises(FileExistsError):
        build_cache(src, cache, workers=0, progress=race)
    assert target.read_bytes() == before


def _linked_data_cache(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """A built cache whose data file was swapped for a link to a longer file of root's."""
    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    data = data_file(cache)
    target = tmp_path / "victim"
    content = data.read_bytes() + victim_file(tmp_path / "pad")
    target.write_bytes(content)
    data.unlink()
    data.symlink_to(target)
    return src, cache, content


@pytest.mark.parametrize("writer", ["repair", "compact", "copy into it", "build into it"])
def test_no_writer_truncates_through_a_linked_data_file(tmp_path, writer):
    """Why 3: ``cut_data_file`` truncated by path in every writer's stale-generation cleanup.
    The link is refused when the cache is opened; a writer that replaces the cache (copy,
    build) deletes it as a damaged cache's file, never following it."""
    src, cache, content = _linked_data_cache(tmp_path)
    if writer in ("repair", "compact"):
        with pytest.raises(UnsafeCacheError, match="symbolic link"):
            repair_cache(cache, workers=0) if writer == "repair" else compact_cache(cache)
    elif writer == "copy into it":
        build_cache(src, tmp_path / "other", workers=0)
        copy_cache(tmp_path / "other", cache)
    else:
        build_cache(src, cache, workers=0)
    assert (tmp_path / "victim").read_bytes() == content


@needs_root
def test_a_copy_leaks_no_bytes_of_a_root_only_file(shared, tmp_path):
    """Why 4: a lazy cache's data file linked (hard or soft) to a file only root may read."""
    src = tiny(shared / "src")
    cache = shared / "cache"
    create_lazy_cache(src, cache, workers=0)
    data = data_file(cache)
    secret = shared / "secret"
    secret.write_bytes(b"SECRET!!" * (data.stat().st_size // 8 + 1))
    secret.chmod(0o600)
    given_away(cache)
    as_attacker("ln", "-sf", secret, data)
    with pytest.raises(UnsafeCacheError, match="symbolic link"):
        copy_cache(cache, tmp_path / "soft")
    # A hard link (which fs.protected_hardlinks stops a user from making; root makes it here)
    # gets through the open, but only records whose CRC vouches for them are copied.
    data.unlink()
    os.link(secret, data)
    copy_cache(cache, tmp_path / "hard")
    assert b"SECRET" not in data_file(tmp_path / "hard").read_bytes()


def test_compact_refuses_a_record_that_fails_its_crc(tmp_path):
    """Why 4: compact copied FILLED records without checking them."""
    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    with open(data_file(cache), "r+b") as f:
        f.write(b"\xff\x00\xff")
    with pytest.raises(CacheFormatError, match="fails its CRC-32"):
        compact_cache(cache)


@needs_root
@pytest.mark.parametrize("uid", [NOBODY, 1])
def test_a_lazy_cache_of_another_user_decodes_no_private_source(shared, uid):
    """Why 5: a manifest naming the reader's private folder as its source (confused deputy).
    Any owner but the reader and root is another user (uid 1 too); an unpickled copy of the
    dataset, as a spawned DataLoader worker has, refuses as well."""
    from mmcache import MemmapImageDataset

    private = shared / "private"
    tiny(private)
    private.chmod(0o700)
    cache = shared / "cache"
    create_lazy_cache(private, cache, workers=0)
    given_away(cache, mode=0o666, uid=uid)
    expected = (
        f"{cache}: belongs to uid {uid}, so the source its manifest names "
        f"({str(private)!r}) is not decoded into it; open the cache with source= set to that "
        "folder if you trust it, or build a cache of your own"
    )
    ds = MemmapImageDataset(cache)
    copy = pickle.loads(pickle.dumps(ds))
    with pytest.raises(UnsafeCacheError, match=f"^{re.escape(expected)}$"):
        ds[0]
    with pytest.raises(UnsafeCacheError, match=f"^{re.escape(expected)}$"):
        copy[0]
    data = data_file(cache).read_bytes()
    assert not any(data), "a private image was decoded into the attacker's file"


@needs_root
def test_a_lazy_cache_of_another_user_fills_from_the_source_its_opener_names(shared):
    """``source=`` is the opener's word that the root is theirs to decode: the dataset and an
    unpickled copy of it (a spawned DataLoader worker's) fill the records from it."""
    from mmcache import MemmapImageDataset, decode_image

    src = tiny(shared / "src")
    cache = shared / "cache"
    create_lazy_cache(src, cache, workers=0)
    given_away(cache, mode=0o666)
    ds = MemmapImageDataset(cache, source=src)
    copy = pickle.loads(pickle.dumps(ds))
    for i in range(len(ds)):
        assert np.array_equal(copy[i][0], decode_image(ds.samples[i][0]))
    assert np.array_equal(ds[0][0], decode_image(ds.samples[0][0]))


def test_the_lock_as_a_dangling_link_never_creates_its_target(tmp_path):
    """Why 6: ``os.open(lock, O_RDWR | O_CREAT)`` created the link's target."""
    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    (cache / fmt.LOCK_NAME).unlink()
    (cache / fmt.LOCK_NAME).symlink_to(tmp_path / "nologin")
    with pytest.raises(UnsafeCacheError, match="symbolic link"):
        build_cache(src, cache, workers=0, force=True)
    assert not (tmp_path / "nologin").exists()


def test_a_cache_path_that_is_a_link_keeps_working(tmp_path):
    """Links inside a cache are refused; the cache folder itself may be one."""
    src = tiny(tmp_path / "src")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    build_cache(src, tmp_path / "link" / "cache", workers=0)
    build_cache(src, tmp_path / "link" / "cache", workers=0, force=True)
    compact_cache(tmp_path / "link" / "cache")
    assert repair_cache(tmp_path / "link" / "cache", workers=0).ok


@pytest.fixture
def alarm():
    """SIGALRM after 10 s raises in the test: a blocking open is interrupted, not waited on."""

    def expired(signum, frame):
        raise TimeoutError("blocked for 10 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_a_fifo_as_the_data_file_is_refused_without_blocking(tmp_path, alarm):
    """Why 10: a FIFO in place of the data file made copy, warm and evict block for ever."""
    src = tiny(tmp_path / "src")
    cache = tmp_path / "cache"
    build_cache(src, cache, workers=0)
    data = data_file(cache)
    data.unlink()
    os.mkfifo(data)
    for call in (lambda: copy_cache(cache, tmp_path / "dest"), lambda: warm_cache(cache),
                 lambda: evict_cache(cache)):  # fmt: skip
        with pytest.raises(UnsafeCacheError, match="not a regular file"):
            call()


# What the strace test runs: every writer, each on a tiny cache.
WRITERS = """
import os, sys
from pathlib import Path
from mmcache import build_cache, compact_cache, copy_cache, create_lazy_cache, repair_cache
from mmcache import format as fmt
from mmcache._records import open_reader  # (the dataset's reader, without importing torch)
work = Path(sys.argv[1])
src, cache = work / "src", work / "cache"
build_cache(src, cache, workers=0)                      # build
(src / "a" / "img_000.jpg").rename(src / "a" / "new.jpg")
build_cache(src, cache, workers=0)                      # refresh
files = fmt.open_cache(cache)
fd = os.open(files.manifest.file("data"), os.O_WRONLY | os.O_NOFOLLOW)  # damage a record
os.pwrite(fd, b"\\xff\\x00\\xff", int(files.index["offset"][0]))
os.close(fd)
assert repair_cache(cache, workers=0).repaired          # repair
compact_cache(cache)                                    # compaction
copy_cache(cache, work / "copy")                        # copy
create_lazy_cache(src, work / "lazy", workers=0)
lazy = fmt.read_manifest(work / "lazy")                 # lazy fill, as a dataset's
open_reader(work / "lazy", lazy.generation, False, source_given=True).stored_or_none(0)
"""

CACHE_NAME = re.compile(
    r'"(?:[^"]*/)?(?:(?:index|state|paths|data|fields)-[0-9a-f]+\.bin|manifest\.json[^"]*'
    r'|\.?lock[^"]*|filling-[0-9a-f]+)"'
)


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_every_writer_opens_cache_files_without_following_links(tmp_path):
    """Recorded with strace: each open of a cache file for writing has O_NOFOLLOW or O_EXCL,
    and nothing is truncated by path."""
    tiny(tmp_path / "src")
    (tmp_path / "writers.py").write_text(WRITERS)
    log = tmp_path / "strace.log"
    calls = "open,openat,truncate,ftruncate,creat,rename,renameat,renameat2"
    run = subprocess.run(
        ["strace", "-f", "-qq", "--seccomp-bpf", "-e", f"trace={calls}", "-o", str(log),
         sys.executable, str(tmp_path / "writers.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    lines = log.read_text().splitlines()
    writes = [
        line
        for line in lines
        if re.search(r"\bopen(at)?\(", line)
        and CACHE_NAME.search(line)
        and re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", line)
    ]
    assert len(writes) > 20  # the writers were traced
    unsafe = [line for line in writes if "O_NOFOLLOW" not in line and "O_EXCL" not in line]
    assert unsafe == []
    by_path = [line for line in lines if re.search(r"\b(truncate|creat)\(", line)]
    assert by_path == []
    assert np.any([("ftruncate(" in line) for line in lines])
