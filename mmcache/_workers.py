"""Decode worker processes: a pool that writes records in place and outlives a decoder crash.

The parent sends each worker chunks of jobs through a pipe of its own; the worker decodes each
job, writes its pixels into the data file with ``pwrite`` and reports the record's outcome at
once. So when a worker dies (a decoder segfault on a hostile file, the OOM killer) or stops
answering (a decoder stuck in a loop), the parent knows which record it was on: that record is
tried once more, alone, in a fresh worker, and if that one dies too the file is recorded as bad
("the decoder crashed on it") while the build goes on with the rest. Nothing ever waits on a
dead worker: the parent waits on the workers' pipes and process sentinels together.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import multiprocessing
import os
import pickle
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import wait
from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np

from . import format as fmt
from . import pixels as px
from ._files import write_pixels
from ._opening import open_for_writing
from .decode import Options, StderrCapture, decode_record
from .errors import DecodeWorkerError
from .reports import ProgressFn
from .sources import Address, ImageReader, decode_member

# Records per chunk sent to a worker: large enough that the per-chunk overhead (~100 us)
# vanishes next to a decode (~2 ms for 720x480), small enough to balance the last chunks.
CHUNK = 16
# Chunks a worker holds at once: the next one waits in its pipe while it decodes this one.
AHEAD = 2
# A record that gives no result for this long is taken for a hung decoder: its worker is
# killed and the record handled as a crash. The largest image allowed (89 MP) decodes in
# seconds; this leaves room for a loaded machine and a slow network filesystem.
DECODE_TIMEOUT = 120.0
# Workers that die before they are ready, in a row, before the build gives up.
MAX_START_FAILURES = 3
# Crashes with no record decoded yet, before the build gives up: the decoder is broken.
MAX_CRASHES_BEFORE_ANY_IMAGE = 8


class Job(NamedTuple):
    """One record to decode: where its file is, what it was listed as, where its pixels go."""

    record: int  # its index in the cache
    path: str | Address  # the source file, absolute, or the archive member's address
    offset: int  # where its pixels start in the data file
    shape: tuple[int, int, int]  # (height, width, channels) planned from the file's header
    size: int  # the file's size when listed, in bytes
    mtime_ns: int  # the file's modification time when listed
    # Its mask's (absolute path, size, mtime_ns) as listed, when records carry masks.
    mask: tuple[str, int, int] | None = None
    # Its kind's reader of its file, when OpenCV does not decode it (``Source.images``): it
    # crosses to the worker by pickle, so its class's module is imported there by name.
    reader: ImageReader | None = None

    @property
    def end(self) -> int:
        """Where the record's pixels end at most: ``offset`` + height * width * channels (a
        planar record is smaller), and its mask's, as 16-bit values, after them."""
        h, w, c = self.shape
        return self.offset + h * w * c + (px.MASK_ALIGN + 2 * h * w if self.mask else 0)


class Result(NamedTuple):
    """What decoding one record came to."""

    record: int  # its index in the cache
    state: int  # fmt.FILLED or a BAD_* code
    crc32: int  # the CRC-32 of the stored pixels (0 unless FILLED)
    message: str  # what the decoder said (warnings), or why the file is bad; "" if nothing
    overflow: np.ndarray | None  # pixels of another shape than planned, written later


def chunked(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` in the chunks of ``CHUNK`` records that workers take."""
    return [jobs[k : k + CHUNK] for k in range(0, len(jobs), CHUNK)]


def decode_records(
    jobs: list[list[Job]],
    data_path: str | os.PathLike,
    opts: Options,
    workers: int | None,
    progress: ProgressFn | None = None,
    pool: DecodePool | None = None,
) -> Iterator[Result]:
    """Decode ``jobs`` into the data file at ``data_path``; yields each record's result as it
    comes, calling ``progress(done, total)`` meanwhile. With ``pool``, its workers (started
    earlier) do it; else a pool of ``workers`` for these jobs (see ``DecodePool``).
    """
    total = sum(len(chunk) for chunk in jobs)
    done = 0
    own = pool is None
    if pool is None:
        count = (os.cpu_count() or 1) if workers is None else workers
        pool = DecodePool(opts, min(count, len(jobs)))
    try:
        for results in pool.run(jobs, os.fspath(data_path)):
            yield from results
            done += len(results)
            if progress is not None:
                progress(done, total)
    finally:
        if own:
            pool.close()


class DecodePool:
    """Decode worker processes, started ahead of the work.

    A build starts them as soon as it knows it has files to decode, so that they are up while
    it plans the layout and prepares the data file; ``run`` then hands them the jobs.

    Args:
        opts: the preprocessing the workers apply.
        workers: processes (None: one per core); 0 decodes in the calling process, without the
            protection from decoder crashes (for debuggers, profilers and tests that patch the
            decoder).

    Raises (from ``run``):
        DecodeWorkerError: workers die at start, or on every file.
        OSError, CacheError: what a worker raised (a full disk, say), after stopping the rest.
    """

    def __init__(self, opts: Options, workers: int | None) -> None:
        self.opts = opts
        self.count = (os.cpu_count() or 1) if workers is None else workers
        self._pool = _Pool(opts) if self.count else None
        if self._pool is not None:
            for _ in range(self.count):
                self._pool.start_worker()

    def run(self, jobs: list[list[Job]], data_path: str) -> Iterator[list[Result]]:
        """Decode ``jobs`` (chunks of records) into ``data_path``; yields results as they come."""
        if not jobs:
            return
        if self._pool is None:
            yield from _decode_here(jobs, data_path, self.opts)
        else:
            yield from self._pool.results(deque(jobs), data_path)

    def close(self) -> None:
        """Stop the workers: at once if the work failed or was interrupted, else when done."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> DecodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decode_here(jobs: list[list[Job]], data_path: str, opts: Options) -> Iterator[list[Result]]:
    fd = open_for_writing(Path(data_path))
    capture = StderrCapture()
    try:
        for chunk in jobs:
            yield [_decode_job(fd, opts, capture, job) for job in chunk]
    finally:
        os.close(fd)
        capture.close()


class _Worker:
    """One worker process, the chunks it holds, and how far into the first one it got."""

    def __init__(self, ctx, options: dict) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, options), name="mmcache-decode", daemon=True
        )
        with _main_script_not_imported():
            self.process.start()
        child.close()
        self.ready = False
        self.chunks: deque[list[Job]] = deque()
        self.done = 0  # records of chunks[0] reported
        self.heard = time.monotonic()  # when it last sent something
        self.data_path: str | None = None  # the data file it has open

    def stop(self, kill: bool = False) -> None:
        if kill:
            with suppress(OSError):
                self.process.kill()
        self.conn.close()


class _Pool:
    def __init__(self, opts: Options) -> None:
        # forkserver: workers start from a clean process (no inherited threads or locks from
        # torch or OpenCV in the parent), and the server forks them quickly after the first.
        forkserver = multiprocessing.get_context("forkserver")
        # The server imports numpy, OpenCV and this module (a worker's imports) once, before
        # it forks the workers, with the parent's sys.path: so the same mmcache.
        forkserver.set_forkserver_preload(["numpy", "cv2", __name__])
        # (either context: start_worker falls back to spawn)
        self.ctx: multiprocessing.context.BaseContext = forkserver
        self.options = opts.to_json()
        self.data_path = ""
        self.workers: list[_Worker] = []
        self.start_failures = 0
        self.crashes = 0
        self.decoded = 0
        self.suspects: dict[int, str] = {}  # record -> how its first try ended

    def start_worker(self) -> None:
        try:
            worker = _Worker(self.ctx, self.options)
        except ChildProcessError:
            # The forkserver was started by a process this one was forked from: not being
            # its parent, this process cannot ask whether it still runs, and every start
            # fails so (CPython gh-86354). Its workers are spawned instead.
            self.ctx = multiprocessing.get_context("spawn")
            worker = _Worker(self.ctx, self.options)
        self.workers.append(worker)

    def results(self, pending: deque[list[Job]], data_path: str) -> Iterator[list[Result]]:
        self.data_path = data_path
        while pending or any(w.chunks for w in self.workers):
            for w in self.workers:
                self._feed(w, pending)
            waitables = [w.conn for w in self.workers] + [w.process.sentinel for w in self.workers]
            wait(waitables, timeout=min(5.0, DECODE_TIMEOUT))
            out: list[Result] = []
            for w in list(self.workers):
                dead = self._drain(w, out)
                silent = time.monotonic() - w.heard > DECODE_TIMEOUT
                if not dead and silent and (w.chunks or not w.ready):
                    w.process.kill()
                    w.process.join()
                    dead = f"gave no result in {DECODE_TIMEOUT:.0f} s: the decoder hung"
                elif not dead and not w.process.is_alive():
                    dead = _death(w.process.exitcode)
                if dead:
                    self._replace(w, dead, pending, out)
            if out:
                yield out

    def _feed(self, w: _Worker, pending: deque[list[Job]]) -> None:
        """Send a ready worker chunks until it holds ``AHEAD`` of them (and first, the data
        file to write them into)."""
        while w.ready and len(w.chunks) < AHEAD and pending:
            chunk = pending.popleft()
            try:
                if w.data_path != self.data_path:
                    w.conn.send(("file", self.data_path))
                    w.data_path = self.data_path
                w.conn.send(("chunk", chunk))
            except OSError:  # it just died: the loop finds out from its sentinel
                pending.appendleft(chunk)
                return
            if not w.chunks:
                w.heard = time.monotonic()  # the clock of a hang starts with the work
            w.chunks.append(chunk)

    def _drain(self, w: _Worker, out: list[Result]) -> str | None:
        """Take every message ``w`` has sent; how it ended if its pipe closed, else None."""
        while True:
            try:
                if not w.conn.poll():
                    return None
                kind, value = w.conn.recv()
            except (EOFError, OSError):
                w.process.join()
                return _death(w.process.exitcode)
            w.heard = time.monotonic()
            if kind == "ready":
                w.ready = True
                self.start_failures = 0
            elif kind == "error":
                raise value
            else:
                out.append(value)
                self.decoded += value.state == fmt.FILLED
                self.suspects.pop(value.record, None)
                w.done += 1
                if w.done == len(w.chunks[0]):
                    w.chunks.popleft()
                    w.done = 0

    def _replace(self, w: _Worker, why: str, pending: deque[list[Job]], out: list[Result]) -> None:
        """Take a dead worker's unfinished records back, judge the one it died on, start another."""
        self.workers.remove(w)
        w.stop()
        if not w.ready:
            self.start_failures += 1
            if self.start_failures >= MAX_START_FAILURES:
                raise DecodeWorkerError(
                    f"{self.data_path or 'the build'}: decode worker processes die as they "
                    f"start ({why}), "
                    f"{self.start_failures} in a row; nothing was published"
                )
        if w.chunks:
            first = w.chunks.popleft()
            culprit, rest = first[w.done], first[w.done + 1 :]
            for chunk in reversed([rest, *w.chunks]):
                if chunk:
                    pending.appendleft(chunk)
            i = culprit.record
            if i in self.suspects:  # its second try: the file is to blame
                reason = f"the decoder crashed on it: its process {why}, on both tries"
                out.append(Result(i, fmt.BAD_UNDECODABLE, 0, reason, None))
                self.suspects.pop(i)
            else:
                self.suspects[i] = why
                pending.appendleft([culprit])  # alone, so its outcome is its own
            self.crashes += 1
            if self.crashes >= MAX_CRASHES_BEFORE_ANY_IMAGE and not self.decoded:
                raise DecodeWorkerError(
                    f"{self.data_path}: the decoder crashed {self.crashes} times and decoded "
                    f"no image (last: its process {why}): is OpenCV broken here? Nothing was "
                    "published"
                )
        self.start_worker()

    def close(self) -> None:
        """Stop every worker: at once if the build failed or was interrupted, else when done."""
        for w in self.workers:
            if w.chunks or not w.ready:
                w.stop(kill=True)
            else:
                with suppress(OSError):
                    w.conn.send(None)
        deadline = time.monotonic() + 10
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.stop()
        self.workers.clear()


def _death(exitcode: int | None) -> str:
    """How a worker process ended, in words: ``"was killed by SIGSEGV"``."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with status {exitcode}"


# --- in the worker process ---------------------------------------------------------------------


def _serve(conn, options: dict) -> None:
    """A worker's life: decode each job of each chunk received, report each record at once.

    Messages: ``("file", path)`` (write into this data file from now on), ``("chunk", jobs)``,
    ``None`` (stop). After each chunk the worker asks the kernel to start writing its records
    to disk, so that the build's final flush finds little left to do.
    """
    # Ctrl-C goes to the whole process group; the parent alone decides to stop, then kills the
    # workers, so a worker must not die first in the middle of a pwrite.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cv2.setNumThreads(1)  # one decode per core: parallelism comes from the processes
    keep_freed_memory()
    fd = -1
    try:
        opts = Options.from_json(options)
        capture = StderrCapture()
    except BaseException as e:
        conn.send(("error", _portable(e)))
        return
    conn.send(("ready", None))
    try:
        while (message := conn.recv()) is not None:
            kind, value = message
            if kind == "file":
                if fd >= 0:
                    os.close(fd)
                fd = open_for_writing(Path(value))
                continue
            for job in value:
                conn.send(("done", _decode_job(fd, opts, capture, job)))
            start_writeback(fd, value)
    except EOFError:
        pass  # the parent is gone
    except BaseException as e:
        with suppress(OSError):
            conn.send(("error", _portable(e)))
    finally:
        if fd >= 0:
            os.close(fd)
        capture.close()


def start_writeback(fd: int, chunk: list[Job]) -> None:
    """Start writing the chunk's records to disk (``sync_file_range``, not waiting for it):
    the writes of a build reach the disk while it decodes, instead of in one flush at its end.
    Only a hint: where the call is missing, the final flush does it all."""
    if _sync_file_range is None or not chunk:
        return
    first = min(job.offset for job in chunk)
    last = max(job.end for job in chunk)
    _sync_file_range(fd, first, last - first, _SYNC_FILE_RANGE_WRITE)


def _libc_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (OSError, AttributeError, TypeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return f


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # <fcntl.h>: start writeback of the range's dirty pages


def _decode_job(fd: int, opts: Options, capture: StderrCapture, job: Job) -> Result:
    if not isinstance(job.path, str):  # an archive's member
        code, crc, message, pixels = decode_member(job.path, job.size, job.mtime_ns, opts, capture)
    else:
        code, crc, message, pixels = decode_record(
            job.path, job.size, job.mtime_ns, opts, capture, job.mask, reader=job.reader
        )
    if code != fmt.FILLED:
        return Result(job.record, code, 0, message, None)
    assert pixels is not None  # a FILLED record comes with its pixels
    if px.image_shape(pixels) != job.shape:  # the header lied or was unreadable: overflow
        return Result(job.record, fmt.FILLED, crc, message, pixels)
    write_pixels(fd, pixels, job.offset)
    return Result(job.record, fmt.FILLED, crc, message, None)


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (to cross the pipe), else a RuntimeError that says it."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
    return e


def keep_freed_memory() -> None:
    """Make glibc reuse freed decode buffers instead of handing them back to the kernel.

    Each decode allocates and frees a few buffers of ~1 MB (720x480x3). By default glibc returns
    such memory (mmap threshold, heap trimming), so the next image page-faults it all in again;
    on machines whose hypervisor reclaims freed memory each fresh page is slow to touch (the
    bench reports this machine's fresh-memory write rate). A worker holds at most a few such
    buffers, so keeping them costs a few MB. A no-op where the C library is not glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    mallopt(m_trim_threshold, 256 << 20)
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum


@contextmanager
def _main_script_not_imported() -> Iterator[None]:
    """Start worker processes without re-running the caller's main script in them.

    A forkserver or spawn child imports the parent's ``__main__`` script before it runs its task,
    re-running the script's top-level code: with no ``if __name__ == "__main__":`` guard around a
    ``build_cache`` call, that call would start workers of its own. Our workers need nothing from
    the script, so while a worker starts the script is presented as the module named
    ``__main__``, which multiprocessing's children skip. (fork would not import it, but OpenCV's
    thread pool deadlocks in a forked child when the parent has used it.)
    """
    main = sys.modules.get("__main__")
    if main is None or getattr(main, "__spec__", None) is not None:
        yield  # run with -m, or interactive: children do not import it anyway
        return
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = None
