"""Caches in object storage, measured against the targets of docs/remote.md, in one run.

A real S3 server (SeaweedFS's ``weed mini``, tests/s3server.py) on loopback, or with ``--link``
behind an emulated link (a network namespace and a veth pair, ``tc netem`` delay and rate; on a
kernel without netem, ``tbf`` for the rate and tools/_helpers/delay_line.py for the delay: made
and removed here, root only). Measures, in turns where two things are compared:

- pull vs a plain parallel download of the same chunk objects, the same library (boto3), the
  same concurrency and request size, written to a file the same way;
- training from the remote (``MemmapImageDataset(url, local=...)`` + ``BatchLoader`` with a
  ``QuasiRandomSampler``): epoch one's bytes/s vs the pull's, epoch two vs a local cache;
- a push after a refresh that appended 1% of the images: bytes sent / cache bytes;
- per-record requests (one GET per record, the same concurrency): what they would reach.

    python tools/remote_bench.py --images 800
    sudo python tools/remote_bench.py --images 800 --link 10ms,1gbit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3server import S3Server  # noqa: E402

import mmcache  # noqa: E402
from mmcache import format as fmt  # noqa: E402
from mmcache.remote import pull as pull_module  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

NS, HOST_IP, NS_IP = "mmcache-link", "10.203.0.1", "10.203.0.2"


class LinkedServer(S3Server):
    """The server inside network namespace NS, reached through a veth pair with netem."""

    def _command(self) -> list[str]:
        cmd = [a.replace("127.0.0.1", NS_IP) for a in super()._command()]
        return ["ip", "netns", "exec", NS, *cmd]

    @property
    def endpoint_url(self) -> str:
        return f"http://{NS_IP}:{self.ports['s3']}"


def make_link(delay_ms: float, rate: str) -> tuple[str, bool]:
    """veth pair host <-> NS, ``delay_ms / 2`` each way (``delay_ms`` round trip), ``rate``;
    returns what was applied, and whether netem added the delay: a kernel without
    ``sch_netem`` gets the rate alone (``tbf``), and the delay from a delay line (``delayed``)."""
    sh = lambda c: subprocess.run(c, shell=True, check=True)  # noqa: E731
    sh(f"ip netns add {NS}")
    sh(f"ip link add mmc-h type veth peer name mmc-n netns {NS}")
    sh(f"ip addr add {HOST_IP}/24 dev mmc-h && ip link set mmc-h up")
    sh(f"ip netns exec {NS} sh -c 'ip addr add {NS_IP}/24 dev mmc-n && ip link set mmc-n up "
       "&& ip link set lo up'")  # fmt: skip
    applied = f"{delay_ms:g} ms round trip, {rate}"
    for dev, ns in (("mmc-h", ""), ("mmc-n", f"ip netns exec {NS} ")):
        netem = f"{ns}tc qdisc add dev {dev} root netem delay {delay_ms / 2}ms rate {rate} "
        if subprocess.run(netem + "limit 100000", shell=True, capture_output=True).returncode:
            sh(f"{ns}tc qdisc add dev {dev} root tbf rate {rate} burst 256k latency 50ms")
            applied = (f"{rate} by tbf; {delay_ms:g} ms round trip by a delay line (this kernel "
                       "has no netem)")  # fmt: skip
    return applied, not applied.startswith(f"{rate} by tbf")


@contextlib.contextmanager
def delayed(server: S3Server, delay_ms: float) -> Iterator[str]:
    """The server's S3 endpoint behind a delay line of ``delay_ms`` round trip, in a process of
    its own (tools/_helpers/delay_line.py); yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = Path(__file__).resolve().parent / "_helpers" / "delay_line.py"
    host, s3_port = server.endpoint_url.removeprefix("http://").rsplit(":", 1)
    proc = subprocess.Popen(
        [sys.executable, str(line), str(port), host, s3_port, str(delay_ms / 2)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.communicate()


def remove_link() -> None:
    subprocess.run(f"ip link del mmc-h; ip netns del {NS}", shell=True, capture_output=True)


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def plain_download(url: str, dest: Path, concurrency: int) -> int:
    """Every data chunk of the publication, in ranged GETs of pull's request size, written
    with pwrite: what a download tool does with the same library."""
    import boto3
    from botocore.config import Config

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.session.Session().client("s3", config=Config(max_pool_connections=64))
    d = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/remote.json")["Body"].read())
    step = pull_module.RUN_BYTES
    jobs = [(c["key"], c["start"], a, min(a + step, c["size"])) for c in d["data"]["chunks"]
            for a in range(0, c["size"], step)]  # fmt: skip
    fd = os.open(dest, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)

    def get(job):
        key, start, a, b = job
        rng = f"bytes={a}-{b - 1}"
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{key}", Range=rng)["Body"].read()
        return os.pwrite(fd, body, start + a)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            return sum(pool.map(get, jobs))
    finally:
        os.fsync(fd)
        os.close(fd)


def per_record(url: str, cache: Path, concurrency: int) -> int:
    """One GET per record (of its chunk's range), as a loader asking record by record would."""
    from mmcache.remote.published import read_published
    from mmcache.remote.stores import open_store

    p = read_published(open_store(url), cache)
    files = fmt.open_cache(cache)
    nbytes = fmt.record_nbytes(files.index, files.manifest.pixels, files.manifest.mask)

    def get(i):
        a = int(files.index["offset"][i])
        return sum(len(p.store.get(k, max(a, s) - s, min(a + int(nbytes[i]), s + n) - s))
                   for k, s, n, _ in p.chunks_within(a, a + int(nbytes[i])))  # fmt: skip

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(get, range(files.manifest.count)))


def epoch(ds) -> int:
    loader = mmcache.BatchLoader(ds, 128, sampler=mmcache.QuasiRandomSampler(ds))
    return sum(len(labels) for _, labels in loader)


def cpu_busy(before, after) -> float:
    """The share of the machine's CPU time between two ``psutil.cpu_times()`` not idle."""
    spent = sum(after) - sum(before)
    idle = (after.idle + getattr(after, "iowait", 0)) - (before.idle + getattr(before, "iowait", 0))
    return 1 - idle / spent if spent > 0 else 0.0


def run(
    args: argparse.Namespace, work: Path, server: S3Server, notes: list[str], endpoint: str = ""
) -> list[tuple]:
    os.environ.update(server.env())
    if endpoint:  # through the delay line (the bucket is made directly)
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    url = f"s3://{server.make_bucket('bench')}/train"
    src = make_image_folder(work / "src", classes=4, per_class=args.images // 4, size=(256, 341))
    mmcache.build_cache(src, work / "cache")
    size = sum(fmt.read_manifest(work / "cache").sizes.values())
    mmcache.push_cache(work / "cache", url)
    rows, plain, pulled = [], [], []
    for _turn in range(args.turns):  # in turns: the machine's state changes under both alike
        shutil.rmtree(work / "pulled", ignore_errors=True)
        n, s = timed(lambda: plain_download(url, work / "plain.bin", args.concurrency))
        plain.append(n / s)
        r, s = timed(lambda: mmcache.pull_cache(url, work / "pulled", concurrency=args.concurrency))
        pulled.append(r.fetched / s)
    best_plain, best_pull = max(plain), max(pulled)
    rows.append(("pull vs plain download", best_pull, best_plain, best_pull / best_plain, 0.8))
    mmcache.MemmapImageDataset  # noqa: B018 - torch imported here, not inside the timing
    cpu = psutil.cpu_times()
    ds, s = timed(lambda: mmcache.MemmapImageDataset(url, local=work / "node"))
    _, e1 = timed(lambda: epoch(ds))
    busy = cpu_busy(cpu, psutil.cpu_times())
    first = size / (s + e1)
    notes.append(
        f"epoch one from the remote: open {s:.2f} s, epoch {e1:.2f} s; the CPU was "
        f"{busy:.0%} busy meanwhile ({psutil.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}, the server and the link's delay line included)"
    )
    rows.append(("epoch one from remote vs pull", first, best_pull, first / best_pull, 0.7))
    if args.link:  # the link's rate in bytes/s: "1gbit" is 125 MB/s
        rate = args.link.split(",")[1].lower()
        bits = float(rate.rstrip("gmkbit")) * {"g": 1e9, "m": 1e6, "k": 1e3}[rate.rstrip("bit")[-1]]
        rows.append(("epoch one from remote vs the link", first, bits / 8, first * 8 / bits, 0.7))
        rows.append(("plain download vs the link", best_plain, bits / 8, best_plain * 8 / bits,
                     None))  # fmt: skip
    on_local = mmcache.MemmapImageDataset(work / "cache")
    second, local = [], []
    for _turn in range(3):  # in turns, the best of each: the first epoch after a pause pays
        second.append(timed(lambda: epoch(ds))[1])  # for memory the VM had handed back
        local.append(timed(lambda: epoch(on_local))[1])
    e2, local = min(second), min(local)
    rows.append(("epoch two vs local cache", size / e2, size / local, local / e2, 0.95))
    n, s = timed(lambda: per_record(url, work / "pulled", args.concurrency))
    rows.append(("per-record requests vs pull", n / s, best_pull, n / s / best_pull, None))
    # 1% more images (other names: the others keep their bytes and times, so the refresh
    # appends the new ones and keeps the rest in place).
    new = make_image_folder(work / "new", classes=4, per_class=max(1, args.images // 400),
                            size=(256, 341), seed=1)  # fmt: skip
    for f in new.rglob("*.jpg"):
        f.rename(src / f.parent.name / f"new_{f.name}")
    mmcache.build_cache(src, work / "cache")
    push = mmcache.push_cache(work / "cache", url)
    rows.append(("push after +1% images: sent / cache", push.uploaded, push.bytes,
                 push.uploaded / push.bytes, -0.05))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=pull_module.CONCURRENCY)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--link", help="round trip and rate of an emulated link, e.g. 10ms,1gbit")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mmcache-remote-bench-"))
    server_class, link, netem, delay_ms = S3Server, "", True, 0.0
    notes: list[str] = []
    if args.link:
        delay, rate = args.link.split(",")
        delay_ms = float(delay.removesuffix("ms"))
        remove_link()
        link, netem = make_link(delay_ms, rate)
        server_class = LinkedServer
    try:
        with server_class() as server:
            if netem:
                rows = run(args, work, server, notes)
            else:
                with delayed(server, delay_ms) as endpoint:
                    rows = run(args, work, server, notes, endpoint)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.link:
            remove_link()
    where = f"link: {link}" if args.link else "loopback"
    print(f"{args.images} images, {where}, concurrency {args.concurrency}, {args.turns} turns")
    print(f"{'measure':40} {'this':>12} {'against':>12} {'ratio':>7}  target")
    for name, a, b, ratio, target in rows:
        unit = 1e6
        if target is None:
            verdict = "(shown)"
        elif target < 0:  # at most
            verdict = f"<= {-target:.2f} {'met' if ratio <= -target else 'NOT met'}"
        else:
            verdict = f">= {target:.2f} {'met' if ratio >= target else 'NOT met'}"
        print(f"{name:40} {a / unit:10.1f} M {b / unit:10.1f} M {ratio:7.3f}  {verdict}")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
