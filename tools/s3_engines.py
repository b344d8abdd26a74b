"""Object-storage engines side by side on a local S3 server (tests/s3server.py: weed mini).

Each engine installed (boto3 with a client per thread or one shared client, obstore, s3fs):
ranged GETs (8 concurrent 8 MiB requests over a 256 MiB object), a 256 MiB multipart upload in
8 parallel parts, and fork-safety: a client used in the parent, then in a forked child (20 s
bound: a hang is reported, not waited out), and a client made fresh in the child. Loopback on
shared cores (the server competes for them): it compares engines, not networks.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3server import S3Server  # noqa: E402

MIB = 2**20
RANGE, PARTS, CONCURRENCY, FORK_SECONDS = 8 * MIB, 8, 8, 20.0
BUCKET, KEY = "engines", "data.bin"


class Boto3:
    def __init__(self, s3: S3Server, shared: bool) -> None:
        import boto3
        from botocore.config import Config

        self.name = "boto3 shared client" if shared else "boto3 client per thread"
        # a Session each: boto3.client() goes through one default Session, not thread-safe
        kw = dict(endpoint_url=s3.endpoint_url, aws_access_key_id=s3.access_key)
        kw.update(aws_secret_access_key=s3.secret_key, region_name=s3.region)
        config = Config(max_pool_connections=CONCURRENCY)
        make = lambda: boto3.session.Session().client("s3", config=config, **kw)  # noqa: E731
        self.one = make()
        self.pool = [make() for _ in range(CONCURRENCY)] if not shared else None

    def client(self, i: int):  # the shared one, or request i's: client i mod 8 of 8
        return self.pool[i % CONCURRENCY] if self.pool else self.one

    def get(self, start: int, end: int, i: int = 0) -> bytes:
        rng = f"bytes={start}-{end - 1}"
        return self.client(i).get_object(Bucket=BUCKET, Key=KEY, Range=rng)["Body"].read()

    def put_multipart(self, key: str, data: bytes) -> None:
        up = self.one.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        size = -(-len(data) // PARTS)  # 8 parts

        def part(n: int) -> dict:
            at = dict(Bucket=BUCKET, Key=key, UploadId=up, PartNumber=n + 1)
            r = self.client(n).upload_part(Body=data[n * size : (n + 1) * size], **at)
            return {"PartNumber": n + 1, "ETag": r["ETag"]}

        with ThreadPoolExecutor(PARTS) as ex:
            done = {"Parts": list(ex.map(part, range(PARTS)))}
        self.one.complete_multipart_upload(
            Bucket=BUCKET, Key=key, UploadId=up, MultipartUpload=done
        )


class Obstore:
    name = "obstore"

    def __init__(self, s3: S3Server) -> None:
        import obstore
        from obstore.store import S3Store

        self.obstore = obstore
        kw = dict(endpoint=s3.endpoint_url, access_key_id=s3.access_key, region=s3.region)
        kw.update(secret_access_key=s3.secret_key, client_options={"allow_http": True})
        self.one = S3Store(BUCKET, **kw)

    def get(self, start: int, end: int, i: int = 0) -> bytes:
        return bytes(self.obstore.get_range(self.one, KEY, start=start, end=end))

    def put_multipart(self, key: str, data: bytes) -> None:
        self.obstore.put(self.one, key, data, chunk_size=len(data) // PARTS, max_concurrency=PARTS)


class S3fs:
    name = "s3fs"

    def __init__(self, s3: S3Server) -> None:
        import s3fs

        kw = dict(key=s3.access_key, secret=s3.secret_key, endpoint_url=s3.endpoint_url)
        kw.update(client_kwargs={"region_name": s3.region}, skip_instance_cache=True)
        self.one = s3fs.S3FileSystem(**kw)

    def get(self, start: int, end: int, i: int = 0) -> bytes:
        return self.one.cat_file(f"{BUCKET}/{KEY}", start=start, end=end)

    def put_multipart(self, key: str, data: bytes) -> None:  # --mib a multiple of 8: 8 parts
        size = len(data) // PARTS
        self.one.pipe_file(f"{BUCKET}/{key}", data, chunksize=size, max_concurrency=PARTS)


def timed(run, *args) -> tuple[float, float]:
    """Wall and CPU seconds (this process's threads, not the server's) of ``run(*args)``."""
    t, c = time.perf_counter(), time.process_time()
    run(*args)
    return time.perf_counter() - t, time.process_time() - c


def ranged(engine, data: bytes) -> None:
    """All of ``data``'s ranges, CONCURRENCY requests at a time; checks the bytes."""
    starts = range(0, len(data), RANGE)
    with ThreadPoolExecutor(CONCURRENCY) as ex:
        got = ex.map(lambda i: engine.get(starts[i], starts[i] + RANGE, i), range(len(starts)))
        assert all(g == data[s : s + RANGE] for g, s in zip(got, starts)), engine.name


def fork_child(request) -> tuple[int, int]:
    """Fork a child that runs ``request``, writes 'ok' or its error to a pipe: (pid, pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report one line, exit without running the parent's cleanup
        os.close(r)
        try:
            request()
            msg = "ok"
        except BaseException as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {e}"[:60]
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    return pid, r


def collect(children: list[tuple[int, int]]) -> list[str]:
    """What each child reported; 'HANG' for those silent after FORK_SECONDS (then killed)."""
    deadline = time.monotonic() + FORK_SECONDS
    msgs = {}
    while len(msgs) < len(children) and time.monotonic() < deadline:
        waiting = [r for _, r in children if r not in msgs]
        ready, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
        for r in ready:
            msgs[r] = os.read(r, 4096).decode() or "child died"
    for pid, r in children:
        if r not in msgs:
            msgs[r] = f"HANG (> {FORK_SECONDS:g} s)"
            os.kill(pid, signal.SIGKILL)
        os.close(r)
        os.waitpid(pid, 0)
    return [msgs[r] for _, r in children]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="object size (default 256 MiB)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each; the best is shown")
    ap.add_argument("--engines", default="boto3,obstore,s3fs", help="those to run (all)")
    args = ap.parse_args()
    data = os.urandom(args.mib * MIB)
    mib, runs = len(data) / MIB, range(args.repeat)
    factories = [("boto3", lambda s3: Boto3(s3, shared=False))]
    factories += [("boto3", lambda s3: Boto3(s3, True)), ("obstore", Obstore), ("s3fs", S3fs)]
    with S3Server() as s3:
        print(f"weed mini ready in {s3.startup_seconds:.2f} s at {s3.endpoint_url}")
        s3.make_bucket(BUCKET)
        s3.client().put_object(Bucket=BUCKET, Key=KEY, Body=data)
        rows, children = [], []  # children: (pid, pipe) of the fork probes
        for module, factory in (f for f in factories if f[0] in args.engines.split(",")):
            try:
                __import__(module)
            except ImportError:
                rows.append([module, "not installed", "", "", ""])  # forks: one 20 s for all
                continue
            engine = factory(s3)
            get = min(timed(ranged, engine, data) for _ in runs)  # the best of repeat runs
            put = min(timed(engine.put_multipart, f"up{k}", data) for k in runs)
            heads = [s3.client().head_object(Bucket=BUCKET, Key=f"up{k}") for k in runs]
            assert all(h["ContentLength"] == len(data) for h in heads), engine.name
            rows.append(
                [engine.name, *(f"{mib / t:.0f} ({c * 1024 / mib:.1f})" for t, c in (get, put))]
            )
            children += [
                fork_child(lambda e=engine: e.get(0, 1024)),  # a client the parent used
                fork_child(lambda f=factory: f(s3).get(0, 1024)),
            ]
        msgs = collect(children)
        rows = [row if len(row) == 5 else row + [msgs.pop(0), msgs.pop(0)] for row in rows]
    head = "engine|ranged GET MB/s (CPU s/GiB)|multipart PUT MB/s (CPU s/GiB)"
    head = (head + "|parent's client in child|fresh one in child").split("|")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(5)]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"({args.mib} MiB, best of {args.repeat}; MB = MiB)")


if __name__ == "__main__":
    main()
