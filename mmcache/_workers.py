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

import cv2
import numpy as np

from . import format as fmt
from ._feedback import ProgressFn
from .decode import Options, StderrCapture, decode_record
from .errors import DecodeWorkerError

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

Job = tuple[int, str, int, tuple[int, int, int], int, int]
Result = tuple[int, int, int, str, "np.ndarray | None"]


def chunked(jobs: list[Job]) -> list[list[Job]]:
    """``jobs`` in the chunks of ``CHUNK`` records that workers take."""
    return [jobs[k : k + CHUNK] for k in range(0, len(jobs), CHUNK)]


def decode_records(
    jobs: list[list[Job]],
    data_path: str | os.PathLike,
    opts: Options,
    workers: int | None,
    progress: ProgressFn | None = None,
) -> Iterator[Result]:
    """Decode ``jobs`` into the data file at ``data_path``; yields each record's result as it
    comes, calling ``progress(done, total)`` meanwhile (see ``run_jobs``)."""
    total = sum(len(chunk) for chunk in jobs)
    done = 0
    for results in run_jobs(jobs, os.fspath(data_path), opts, workers):
        yield from results
        done += len(results)
        if progress is not None:
            progress(done, total)


def run_jobs(
    jobs: list[list[Job]], data_path: str, opts: Options, workers: int | None
) -> Iterator[list[Result]]:
    """Decode ``jobs`` (chunks of records) in worker processes; yields results as they come.

    ``workers``: processes (None: one per core); 0 decodes in this process, without the
    protection from decoder crashes (for debuggers, profilers and tests that patch the decoder).

    Raises:
        DecodeWorkerError: workers die at start, or on every file.
        OSError, CacheError: what a worker raised (a full disk, say), after stopping the rest.
    """
    if not jobs:
        return
    if workers == 0:
        yield from _decode_here(jobs, data_path, opts)
        return
    count = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
    pool = _Pool(data_path, opts)
    try:
        for _ in range(count):
            pool.start_worker()
        yield from pool.results(deque(jobs))
    finally:
        pool.close()


def _decode_here(jobs: list[list[Job]], data_path: str, opts: Options) -> Iterator[list[Result]]:
    fd = os.open(data_path, os.O_WRONLY)
    capture = StderrCapture()
    try:
        for chunk in jobs:
            yield [_decode_job(fd, opts, capture, *job) for job in chunk]
    finally:
        os.close(fd)
        capture.close()


class _Worker:
    """One worker process, the chunks it holds, and how far into the first one it got."""

    def __init__(self, ctx, data_path: str, options: dict) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve, args=(child, data_path, options), name="mmcache-decode", daemon=True
        )
        with _main_script_not_imported():
            self.process.start()
        child.close()
        self.ready = False
        self.chunks: deque[list[Job]] = deque()
        self.done = 0  # records of chunks[0] reported
        self.heard = time.monotonic()  # when it last sent something

    def stop(self, kill: bool = False) -> None:
        if kill:
            with suppress(OSError):
                self.process.kill()
        self.conn.close()


class _Pool:
    def __init__(self, data_path: str, opts: Options) -> None:
        # forkserver: workers start from a clean process (no inherited threads or locks from
        # torch or OpenCV in the parent), and the server forks them quickly after the first.
        self.ctx = multiprocessing.get_context("forkserver")
        # The server imports numpy and OpenCV (most of a worker's imports) once, before it
        # forks the workers. Not mmcache itself: Python 3.11's server ignores the parent's
        # sys.path, so it could import another copy (an installed one) than the parent's.
        self.ctx.set_forkserver_preload(["numpy", "cv2"])
        self.data_path, self.options = data_path, opts.to_json()
        self.workers: list[_Worker] = []
        self.start_failures = 0
        self.crashes = 0
        self.decoded = 0
        self.suspects: dict[int, str] = {}  # record -> how its first try ended

    def start_worker(self) -> None:
        self.workers.append(_Worker(self.ctx, self.data_path, self.options))

    def results(self, pending: deque[list[Job]]) -> Iterator[list[Result]]:
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
        """Send a ready worker chunks until it holds ``AHEAD`` of them."""
        while w.ready and len(w.chunks) < AHEAD and pending:
            chunk = pending.popleft()
            try:
                w.conn.send(chunk)
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
                self.decoded += value[1] == fmt.FILLED
                self.suspects.pop(value[0], None)
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
                    f"{self.data_path}: decode worker processes die as they start ({why}), "
                    f"{self.start_failures} in a row; nothing was published"
                )
        if w.chunks:
            first = w.chunks.popleft()
            culprit, rest = first[w.done], first[w.done + 1 :]
            for chunk in reversed([rest, *w.chunks]):
                if chunk:
                    pending.appendleft(chunk)
            i = culprit[0]
            if i in self.suspects:  # its second try: the file is to blame
                reason = f"the decoder crashed on it: its process {why}, on both tries"
                out.append((i, fmt.BAD_UNDECODABLE, 0, reason, None))
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


def _serve(conn, data_path: str, options: dict) -> None:
    """A worker's life: decode each job of each chunk received, report each record at once."""
    # Ctrl-C goes to the whole process group; the parent alone decides to stop, then kills the
    # workers, so a worker must not die first in the middle of a pwrite.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cv2.setNumThreads(1)  # one decode per core: parallelism comes from the processes
    keep_freed_memory()
    try:
        fd = os.open(data_path, os.O_WRONLY)
        opts = Options.from_json(options)
        capture = StderrCapture()
    except BaseException as e:
        conn.send(("error", _portable(e)))
        return
    conn.send(("ready", None))
    try:
        while (chunk := conn.recv()) is not None:
            for job in chunk:
                conn.send(("done", _decode_job(fd, opts, capture, *job)))
    except EOFError:
        pass  # the parent is gone
    except BaseException as e:
        with suppress(OSError):
            conn.send(("error", _portable(e)))
    finally:
        os.close(fd)
        capture.close()


def _decode_job(
    fd: int,
    opts: Options,
    capture: StderrCapture,
    i: int,
    path: str,
    offset: int,
    shape: tuple[int, int, int],
    size: int,
    mtime_ns: int,
) -> Result:
    code, crc, message, pixels = decode_record(path, size, mtime_ns, opts, capture)
    if code != fmt.FILLED:
        return i, code, 0, message, None
    if pixels.shape != shape:
        return i, fmt.FILLED, crc, message, pixels  # header lied or was unreadable: overflow
    fmt.write_pixels(fd, pixels, offset)
    return i, fmt.FILLED, crc, message, None


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
