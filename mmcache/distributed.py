"""Building one cache with every rank of a torch.distributed process group (as torchrun starts).

``build_cache`` comes here when a process group of more than one rank is initialised; every rank
calls it with the same arguments. The cache folder must lie on a filesystem every rank reaches
(NFS, Lustre, or one machine's disk for several local ranks), at the same path. Three collective
steps, on a private gloo group so they work beside an nccl training group:

1. **scatter**: rank 0 scans the source, plans the layout from headers and allocates the new
   generation in the cache folder (holding the writer lock, copying unchanged records from the
   previous cache as a single-process build does), then sends each rank its share of the decode
   jobs: a contiguous run of records of about equal source pixel count, since decoding time grows
   with pixels, not files. Or it sends "stop": the cache is up to date, or planning failed.
2. **gather**: each rank decodes its share with its own decode worker processes (the same
   machinery as a single-process build: records written in place with ``pwrite``), flushes its
   writes to the shared disk, and sends back each record's state, CRC, decoder message, and the
   pixels of the rare files whose header did not predict their size, or the error that stopped it.
3. **broadcast**: rank 0 checks that every record came back once, finishes and publishes the
   generation atomically, and sends every rank the report, or the error, so that all ranks return
   the same report or raise the same ``CacheError``.

A rank that fails sends its error in step 2; a rank that dies breaks the group's connections, and
a rank that hangs makes the others time out after ``dist_timeout`` seconds: either way every rank
raises ``DistributedBuildError`` and rank 0 removes the new generation's files, so the previous
cache stays intact and nothing half-built is published.
"""

from __future__ import annotations

import os
import re
import socket
import time
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from . import _writer as writer
from ._opening import open_for_writing
from ._session import DIST_TIMEOUT, BuildRequest, Session, session, up_to_date_report
from ._workers import Result, decode_records
from .decode import Options
from .errors import CacheError, DistributedBuildError
from .reports import BuildReport, ProgressFn

__all__ = ["balanced_shares", "build_distributed", "torchrun_process_group"]

_NOTHING_PUBLISHED = "nothing was published; the previous cache, if any, is intact"


def build_distributed(request: BuildRequest, *, timeout: float = DIST_TIMEOUT) -> BuildReport:
    """Build a cache with every rank of the default process group (``build_cache`` calls this).

    Args:
        request: what ``build_cache`` was asked, the same on every rank; its ``workers`` are
            this rank's decode processes (default: this node's cores divided by its ranks,
            ``LOCAL_WORLD_SIZE``, so that several ranks on one node share its cores), its
            ``progress`` is called for this rank's share.
        timeout: seconds a rank waits for the others at each step before the build fails.

    Examples:
        >>> # torchrun --nproc-per-node 2 train.py, in train.py:  # doctest: +SKIP
        >>> torch.distributed.init_process_group("gloo")  # doctest: +SKIP
        >>> report = mmcache.build_cache("data/train", "/shared/cache/train")  # doctest: +SKIP

    Raises:
        DistributedBuildError: a rank failed, died or timed out; and every error a
            single-process build raises, on every rank.
    """
    if request.workers is None:
        per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        request = replace(request, workers=max(1, (os.cpu_count() or 1) // per_node))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    channel = _Channel(group, dist.get_rank(), dist.get_world_size())
    try:
        if channel.rank == 0:
            return _lead(channel, request)
        return _follow(channel, request.workers, request.progress)
    finally:
        if not channel.broken:
            dist.destroy_process_group(group)


def balanced_shares(records: np.ndarray, cost: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split ``records`` (kept in order) into ``parts`` contiguous runs of about equal cost.

    ``cost[i]`` is record i's decode cost (its pixel count); a record of unknown cost (0) counts
    as the mean of the known ones. Contiguous runs keep each rank's writes in one region of the
    data file, which shared filesystems handle best; a record goes to the run its cost midpoint
    falls in, so no run is more than one record's cost away from an equal share.

    Examples:
        >>> [s.tolist() for s in balanced_shares(np.arange(4), np.array([3, 1, 1, 1]), 2)]
        [[0], [1, 2, 3]]
    """
    records = np.asarray(records, np.int64)
    if len(records) == 0:
        return [records[:0] for _ in range(parts)]
    c = np.asarray(cost, np.float64)[records]
    known = c > 0
    c[~known] = c[known].mean() if known.any() else 1.0
    cum = np.cumsum(c)
    midpoints = cum - c / 2
    cuts = np.searchsorted(midpoints, cum[-1] * np.arange(1, parts) / parts, side="left")
    return np.split(records, cuts)


@contextmanager
def torchrun_process_group(timeout: float = DIST_TIMEOUT):
    """Join the process group torchrun describes in the environment, unless one is initialised.

    Initialises gloo from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and
    destroys the group on exit; does nothing if a group is already initialised.

    Examples:
        >>> with torchrun_process_group():  # doctest: +SKIP
        ...     build_cache("data/train", "/shared/cache/train")
    """
    if dist.is_initialized():
        yield
        return
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:  # no rendezvous: a wrong address, a missing rank
        raise DistributedBuildError(
            f"cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} as rank {os.environ.get('RANK')} of "
            f"{os.environ.get('WORLD_SIZE')} ({str(e).strip().splitlines()[0]})"
        ) from None
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Channel:
    """The three collective steps, each run once, on mmcache's own gloo group."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.step = 0  # collectives done
        self.decoding = False  # whether the scatter sent shares (then a gather follows)
        self.broken = False

    def _run(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:  # gloo: a peer closed its connections, or the timeout passed
            self.broken = True
            if isinstance(e, CacheError):
                raise  # ours, raised while waiting (torchrun's SIGTERM): it says what happened
            raise DistributedBuildError(
                f"rank {self.rank}: lost contact with the other ranks ({_gist(e)}): a rank died, "
                f"failed or timed out; {_NOTHING_PUBLISHED}"
            ) from None
        self.step += 1

    def scatter(self, payloads: list | None = None) -> Any:
        out: list[Any] = [None]
        self._run(dist.scatter_object_list, out, payloads, src=0)
        self.decoding = out[0][0] == "go"
        return out[0]

    def gather(self, payload: Any) -> list | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._run(dist.gather_object, payload, out, dst=0)
        return out

    def broadcast(self, outcome: Any = None) -> Any:
        box = [outcome]
        self._run(dist.broadcast_object_list, box, src=0)
        return box[0]

    def fail(self, error: BaseException) -> None:
        """On rank 0: run the steps left with ``error``, so that every rank raises it too."""
        if self.broken or not isinstance(error, Exception):
            return  # lost contact, or interrupted: the others see the connections close
        if not isinstance(error, CacheError):
            error = DistributedBuildError(f"rank 0: {_describe(error)}; {_NOTHING_PUBLISHED}")
        if self.step == 0:
            self.scatter([("stop", None)] * self.world)
        if self.step == 1 and self.decoding:
            self.gather(("error", "rank 0 stopped"))
        self.broadcast(("error", error))


def _lead(channel: _Channel, request: BuildRequest) -> BuildReport:
    start = time.perf_counter()
    try:
        with session(request) as s:
            report = up_to_date_report(s)
            if report is None:
                report = _lead_build(channel, s)
        if channel.step == 0:
            channel.scatter([("stop", None)] * channel.world)
        report.seconds = time.perf_counter() - start
        channel.broadcast(("ok", report))
    except BaseException as e:
        channel.fail(e)
        raise
    return report


def _lead_build(channel: _Channel, s: Session) -> BuildReport:
    request = s.request
    g = writer.allocate(s)
    with writer.discarded_on_failure(g):
        shares = balanced_shares(np.asarray(g.todo, np.int64), g.layout.pixels, channel.world)
        decoding = time.perf_counter()
        options = request.options.to_json()
        share = channel.scatter(
            [("go", (str(g.data_path), options, g.jobs(part))) for part in shares]
        )
        replies = channel.gather(
            _decode_share(share[1], channel.rank, request.workers, request.progress)
        )
        decode_seconds = time.perf_counter() - decoding  # the slowest share: every rank's
        assert replies is not None  # rank 0 gathers every rank's reply
        failures = [message for kind, message in replies if kind == "error"]
        if failures:
            raise DistributedBuildError(f"{'; '.join(failures)}; {_NOTHING_PUBLISHED}")
        for rank, ((_, packed), part) in enumerate(zip(replies, shares)):
            if not np.array_equal(np.sort(packed["index"]), part):
                raise DistributedBuildError(
                    f"rank {rank} returned {len(packed['index'])} results for its "
                    f"{len(part)} records; {_NOTHING_PUBLISHED}"
                )
            g.record(_unpack(packed))
        manifest, report = writer.finish(g, s)
        writer.publish(s, manifest)
    report.decode_seconds = decode_seconds
    return report


def _follow(channel: _Channel, workers: int | None, progress: ProgressFn | None) -> BuildReport:
    kind, share = channel.scatter()
    if kind == "go":
        channel.gather(_decode_share(share, channel.rank, workers, progress))
    status, value = channel.broadcast()
    if status == "ok":
        return value
    raise value


def _decode_share(
    share: tuple[str, dict, list], rank: int, workers: int | None, progress: ProgressFn | None
) -> tuple[str, Any]:
    """Decode this rank's jobs into the shared data file: ``("ok", results)`` or ``("error", why)``.

    Never raises an ``Exception``: a rank's failure travels to rank 0 as a message.
    """
    data_path, options, jobs = share
    where = f"rank {rank} ({socket.gethostname()})"
    try:
        fd = open_for_writing(Path(data_path))
    except FileNotFoundError:
        return "error", (
            f"{where}: cannot see {data_path}, which rank 0 created: the cache folder must be "
            "on a filesystem every rank reaches at the same path (or build on one node and "
            "`mmcache copy` the cache to the others)"
        )
    except OSError as e:
        return "error", f"{where}: cannot open {data_path} ({e.strerror})"
    try:
        results = list(
            decode_records(jobs, data_path, Options.from_json(options), workers, progress)
        )
        # On a network filesystem a node's writes reach the server when flushed; rank 0 must not
        # publish before every node's pixels are there.
        os.fsync(fd)
    except Exception as e:
        return "error", f"{where}: {_describe(e)}"
    finally:
        os.close(fd)
    return "ok", _pack(results)


def _pack(results: list[Result]) -> dict[str, Any]:
    """Results as arrays (~12 bytes a record to pickle) plus the rare messages and overflows."""
    return {
        "index": np.array([r.record for r in results], np.int64),
        "state": np.array([r.state for r in results], np.uint32),
        "crc32": np.array([r.crc32 for r in results], np.uint32),
        "messages": {r.record: r.message for r in results if r.message},
        "overflow": {r.record: r.overflow for r in results if r.overflow is not None},
    }


def _unpack(packed: dict[str, Any]) -> list[Result]:
    messages, overflow = packed["messages"], packed["overflow"]
    return [
        Result(int(i), int(code), int(crc), messages.get(int(i), ""), overflow.get(int(i)))
        for i, code, crc in zip(packed["index"], packed["state"], packed["crc32"])
    ]


def _gist(e: BaseException) -> str:
    """gloo's message without its source location and advice: "Read error ...: Connection reset"."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().split("\n")[0])
    return text.split(". ")[0] or type(e).__name__


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CacheError) else f"{type(e).__name__}: {e}"
