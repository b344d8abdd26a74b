"""Epochs of a cache twice the page cache it may use, on local disk, a cloud volume or an HDD.

Run as root (a memory cgroup and a blkio cgroup are made, and removed on exit)::

    python tools/larger_than_ram.py --workdir /var/tmp/ltr --storage local
    python tools/larger_than_ram.py --workdir /var/tmp/ltr --storage cloud-volume
    python tools/larger_than_ram.py --workdir /var/tmp/ltr --storage hdd
    python tools/larger_than_ram.py --workdir /var/tmp/ltr --iops 500 --bps 50000000
    python tools/larger_than_ram.py --workdir /tmp/ltr --gb 0.2 --epochs 1   # a quick run

Storage profiles are read limits that the cgroup v1 blkio controller enforces on the disk that
holds --workdir (``blkio.throttle.read_iops_device`` and ``read_bps_device``): ``local`` is the
disk as it is, ``cloud-volume`` a general-purpose cloud block volume (3,000 IOPS, 125 MB/s),
``hdd`` a spinning disk (150 IOPS, 150 MB/s). A throttle check reads the cold data file under
the limits before the rows, and prints what it got.

It generates photo-like JPEGs of ImageNet-like sizes (500x375, 375x500, 500x333, 333x500; kept
in --workdir for the next run) and builds two caches of about --gb each: one of 224x224 records
(``--size 224x224``, one shape: for the DataLoader and BatchLoader) and one of shorter side 256
(``--short-side 256``: 341x256, 256x341, 384x256, 256x384; for ``BatchLoader(crop=
RandomResizedCrop(224), flip=True)``). Each row runs in a fresh process inside a memory cgroup
whose limit is the row's own memory (measured first, unthrottled) plus --limit-ratio (default
half) of the cache: that is what the page cache may hold. Before each row the page cache is
dropped (the files are evicted and ``/proc/sys/vm/drop_caches`` is written) and the resident
share is checked. Rows:

- ``decode``: decode the JPEGs every epoch in a DataLoader, a random order (resized to 224x224;
  for the crop loader, ``RandomResizedCrop(224)`` + flip of the full image, torchvision's
  recipe); the JPEG reads go through the same throttle;
- ``random``: mmcache, a random order;
- ``quasi``: mmcache, ``QuasiRandomSampler`` (with its read-ahead);
- ``quasi-noprefetch``: the same order without read-ahead;
- ``warm``: ``warm_cache`` inside the group (it stops at the group's limit), then a random order;
- ``yuv420``: a random order from a third and fourth cache of the same images built with
  ``--pixels yuv420`` (half the bytes), under the same limit as the RGB rows. With
  ``--limit-ratio 0.625`` the RGB cache is 1.6x the page cache allowed and the yuv420 cache fits.

For each row and epoch it prints images per second, the MB and the number of reads the disk
served (the blkio group's ``io_service_bytes`` and ``io_serviced``) and the CPU time of the
row's processes as a share of the cores: a row near 100% CPU is CPU-bound, one far below it
waits for the disk. Then the ratios the project's targets are about.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mmcache
# tools/: the measuring side, which this file runs as its child (--measure, --check-file), is in
# tools/_helpers/; put on the path so that it imports however this file is loaded
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _helpers.ltr_measure import cache_name, group_folder, measure, throttle_check  # noqa: E402

# read IOPS, read bytes per second (None: no limit)
PROFILES = {
    "local": (None, None),
    "cloud-volume": (3000, 125_000_000),  # a general-purpose cloud block volume's baseline
    "hdd": (150, 150_000_000),  # a 7,200 rpm disk: a seek per random read, fast streaming
}
ROWS = {
    "decode": "decode every epoch (DataLoader)",
    "random": "mmcache, random order",
    "quasi": "mmcache, QuasiRandomSampler",
    "quasi-noprefetch": "mmcache, QuasiRandomSampler without read-ahead",
    "warm": "mmcache after `warm`, random order",
    "yuv420": "mmcache, yuv420 cache of the same images, random order",
}
LOADERS = {
    "dataloader": "DataLoader(MemmapImageDataset), 224x224 cache",
    "batch": "BatchLoader, 224x224 cache",
    "crop": "BatchLoader(crop=RandomResizedCrop(224), flip=True), shorter-side-256 cache",
}
# The source's image sizes (width, height): ImageNet's common shapes, landscape and portrait.
SHAPES = [(500, 375), (375, 500), (500, 333), (333, 500)]
CLASSES = 10
GROUP_PREFIX = "mmcache-ltr-"
MB = 1e6


# the parent: data, cgroups, rows -------------------------------------------------------------


def prepare(workdir: Path, gb: float, yuv420: bool = False) -> dict:
    """Source JPEGs and the two caches of about ``gb`` GB each (and their yuv420 twins, if
    ``yuv420``); reused when already there."""
    from mmcache import build_cache
    from mmcache.sample_data import make_image_folder

    record_224 = 224 * 224 * 3
    count = max(2 * len(SHAPES) * CLASSES, int(gb * 1e9 / record_224))
    per_shape = -(-count // (len(SHAPES) * CLASSES))
    src = workdir / "src"
    stamp = workdir / "src.json"
    want = {"classes": CLASSES, "per_shape": per_shape, "shapes": SHAPES}
    if not stamp.exists() or json.loads(stamp.read_text()) != json.loads(json.dumps(want)):
        print(f"generating {per_shape * len(SHAPES) * CLASSES:,} JPEGs ...", flush=True)
        stamp.unlink(missing_ok=True)
        for k, size in enumerate(SHAPES):
            part = workdir / f"gen-{k}"
            # SHAPES are (width, height); make_image_folder takes (height, width)
            make_image_folder(part, classes=CLASSES, per_class=per_shape, size=size[::-1], seed=k)
            for f in sorted(part.rglob("*.jpg")):
                # src/class_XX/img_NNNNN_k.jpg: the shapes interleave in listing order, as
                # photos of several shapes do in a real class folder.
                dest = src / f.parent.name / f"{f.stem}_{k}.jpg"
                dest.parent.mkdir(parents=True, exist_ok=True)
                f.replace(dest)
            for d in sorted(part.rglob("*"), reverse=True):
                d.rmdir()
            part.rmdir()
        stamp.write_text(json.dumps(want))
    files = sorted(src.rglob("*.jpg"))
    build_cache(src, workdir / "cache-224", size=(224, 224))
    if yuv420:
        build_cache(src, workdir / cache_name("batch", True), size=(224, 224), pixels="yuv420")
    # The shorter-side-256 cache from as many of the same JPEGs (every class, in listing order)
    # as make about gb GB: its records are about twice the 224x224 ones.
    per_file = sum(_short_side_256(w, h) for w, h in SHAPES) / len(SHAPES)
    keep = min(len(files), int(gb * 1e9 / per_file))
    listing = workdir / "list-256.csv"
    lines = [f"{f},{f.parent.name}" for f in files[:: max(1, len(files) // keep)][:keep]]
    text = "\n".join(lines) + "\n"
    if not listing.exists() or listing.read_text() != text:
        listing.write_text(text)
    build_cache(listing, workdir / "cache-256", short_side=256)
    if yuv420:
        build_cache(listing, workdir / cache_name("crop", True), short_side=256, pixels="yuv420")
    return {"src": src, "jpegs": files}


def _short_side_256(w: int, h: int) -> int:
    s = 256 / min(w, h)
    return round(w * s) * round(h * s) * 3


def limits(storage: str, iops: int | None, bps: int | None) -> tuple[str, int | None, int | None]:
    """(profile name, read IOPS limit, read bytes/s limit): the profile's, or with an explicit
    --iops or --bps, "custom" and those."""
    profile_iops, profile_bps = PROFILES[storage]
    iops = profile_iops if iops is None else iops
    bps = profile_bps if bps is None else bps
    for name, value in (("--iops", iops), ("--bps", bps)):
        if value is not None and value < 1:
            raise SystemExit(f"{name} must be at least 1, got {value}")
    return (storage if (iops, bps) == PROFILES[storage] else "custom"), iops, bps


def block_device(path: Path) -> tuple[str, str]:
    """("major:minor", name) of the whole disk that holds ``path``: what blkio throttles."""
    dev = os.stat(path).st_dev
    key = f"{os.major(dev)}:{os.minor(dev)}"
    sysfs = Path("/sys/dev/block") / key
    if not sysfs.exists():
        raise SystemExit(
            f"{path} is not on a block device (device {key}: tmpfs, overlay or a network "
            "filesystem?): a blkio throttle cannot apply to it; pick a --workdir on a disk"
        )
    disk = sysfs.resolve()
    if (disk / "partition").exists():  # blkio limits are set on the disk, not a partition
        disk = disk.parent
        key = (disk / "dev").read_text().strip()
    return key, disk.name


class Group:
    """A child cgroup (v1) of this process's own group of one controller; ``close`` kills what
    is left in it and removes it."""

    def __init__(self, controller: str) -> None:
        base = Path("/sys/fs/cgroup") / controller
        if not base.is_dir():
            raise SystemExit(f"no cgroup v1 {controller} controller at {base}: cannot confine")
        own = group_folder(controller)
        parent = own if own is not None and own.is_dir() else base
        _remove_stale_groups(parent)
        self.path = parent / f"{GROUP_PREFIX}{os.getpid()}"
        try:
            self.path.mkdir()
        except OSError as e:
            raise SystemExit(
                f"cannot make a {controller} cgroup at {self.path} ({e}); run as root"
            ) from None
        self.parent = parent

    def write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def enter(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Kill the processes still in the group (the rows' workers of an interrupted run, all
        started by this tool), wait until it is empty, and remove it."""
        deadline = time.monotonic() + 30
        while self.path.exists():
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            try:
                self.path.rmdir()
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    print(f"could not remove the cgroup {self.path}: {e}", file=sys.stderr)
                    return
                time.sleep(0.05)


def _remove_stale_groups(parent: Path) -> None:
    """Remove empty groups this tool left behind in a run that was killed (SIGKILL)."""
    for old in parent.glob(f"{GROUP_PREFIX}*"):
        pid = old.name.removeprefix(GROUP_PREFIX)
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(OSError):
                old.rmdir()


def drop_caches(paths: list[Path]) -> None:
    from mmcache.residency import evict_file

    for p in paths:
        evict_file(p)
    # The page cache, not dentries and inodes ("1", not "3"): a training job holds its files
    # open, and here the first pass over a file whose inode was just read back from the disk
    # went out in reads of 150 KB instead of 600 KB-4 MB (a 200 MB read at 86 MB/s instead of
    # 155 under the hdd profile's limits). In a container this is refused: the per-file
    # eviction above is what we have.
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1")


def resident_share(paths: list[Path]) -> float:
    from mmcache.residency import resident_bytes

    size = sum(p.stat().st_size for p in paths)
    return sum(resident_bytes(p) or 0 for p in paths) / size if size else 0.0


def _interrupt(signum, frame):  # SIGTERM/SIGHUP: unwind like Ctrl-C, so the groups are removed
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/var/tmp/mmcache-larger-than-ram")
    p.add_argument(
        "--storage",
        default="local",
        choices=list(PROFILES),
        help="read limits to emulate (default: local, no limits)",
    )
    p.add_argument("--iops", type=int, help="read IOPS limit (overrides the profile's)")
    p.add_argument("--bps", type=int, help="read bytes/s limit (overrides the profile's)")
    p.add_argument("--gb", type=float, default=1.0, help="each cache's size in GB (default 1)")
    p.add_argument(
        "--limit-ratio",
        type=float,
        default=0.5,
        help="page cache allowed / cache size (default 0.5)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--max-epoch-seconds",
        type=float,
        default=60,
        help="stop an mmcache row's epoch after this long and report its rate so far "
        "(default 60; decoding rows always run whole)",
    )
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers, BatchLoader threads")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--loaders", default=",".join(LOADERS), help=f"of {', '.join(LOADERS)}")
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    p.add_argument(
        "--read", default="auto", choices=("auto", "mmap", "pread"), help="BatchLoader's read="
    )
    p.add_argument("--block-size", type=int, default=None, help="QuasiRandomSampler's")
    p.add_argument(
        "--buffer-blocks",
        type=int,
        default=None,
        help="QuasiRandomSampler's (default: its default, or fewer blocks when two "
        "buffers would take more than 20%% of the page cache allowed)",
    )
    p.add_argument("--measure", choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--loader", choices=list(LOADERS), help=argparse.SUPPRESS)
    p.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--blkio-group", help=argparse.SUPPRESS)
    p.add_argument("--check-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.check_file:
        throttle_check(args)
        return 0
    if args.measure:
        measure(args)
        return 0
    rows = args.rows.split(",")
    loaders = args.loaders.split(",")
    for name, allowed in (("row", ROWS), ("loader", LOADERS)):
        bad = [x for x in (rows if name == "row" else loaders) if x not in allowed]
        if bad:
            p.error(f"unknown {name} {bad[0]!r}: choose from {', '.join(allowed)}")
    profile, iops, bps = limits(args.storage, args.iops, args.bps)

    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    device, disk = block_device(workdir)
    data = prepare(workdir, args.gb, yuv420="yuv420" in rows)
    caches = {k: workdir / cache_name(k) for k in LOADERS}
    cache_files = {k: sorted(c.iterdir()) for k, c in caches.items()}
    everything = data["jpegs"] + cache_files["batch"] + cache_files["crop"]
    if "yuv420" in rows:
        everything += [f for k in ("batch", "crop") for f in cache_files_of(caches[k], True)]

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    memory_group = blkio_group = None
    try:
        memory_group = Group("memory")
        blkio_group = Group("blkio")
        if iops:
            blkio_group.write("blkio.throttle.read_iops_device", f"{device} {iops}")
        if bps:
            blkio_group.write("blkio.throttle.read_bps_device", f"{device} {bps}")
        report = run_rows(args, rows, loaders, caches, everything, memory_group, blkio_group, iops)
    finally:
        for group in (memory_group, blkio_group):
            if group is not None:
                group.close()
    print_report(args, report, profile, iops, bps, device, disk, data, caches)
    return 0


def run_rows(args, rows, loaders, caches, everything, memory_group, blkio_group, iops) -> dict:
    """The throttle check, then every (loader, row): calibrated, dropped, measured."""
    from mmcache import MemmapImageDataset

    def child(extra: list[str], *, throttled: bool = True) -> dict:
        def enter() -> None:  # runs in the child before exec: join the groups
            memory_group.enter(os.getpid())
            if throttled:
                blkio_group.enter(os.getpid())

        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, *extra]
        run = subprocess.run(cmd, preexec_fn=enter, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise SystemExit(
                f"{' '.join(extra)} failed (exit status {run.returncode}):\n{run.stderr[-4000:]}"
            )
        return json.loads(run.stdout.strip().splitlines()[-1])

    report: dict = {"rows": [], "check": None, "allowance": {}, "overhead": {}}
    check_file = next(f for f in caches["batch"].iterdir() if f.name.startswith("data"))
    drop_caches(everything)
    memory_group.write("memory.limit_in_bytes", "-1")
    report["check"] = child(["--check-file", str(check_file)])
    for kind in loaders:
        cache_bytes = MemmapImageDataset(caches[kind], on_stale="ignore").manifest.sizes["data"]
        allowance = int(cache_bytes * args.limit_ratio)
        report["allowance"][kind] = (allowance, cache_bytes)
        buffer_blocks = args.buffer_blocks or _buffer_blocks(caches[kind], allowance, args)
        for row in rows:
            if row == "decode" and kind == "batch" and "dataloader" in loaders:
                continue  # the same run as the DataLoader table's decode row
            # Memory of the row's processes, measured without limit or throttle, once per kind
            # of process set (decoding, the DataLoader's workers, BatchLoader's threads).
            key = f"{kind}-decode" if row == "decode" else kind
            extra = [
                "--measure",
                row,
                "--loader",
                kind,
                "--buffer-blocks",
                str(buffer_blocks),
                "--blkio-group",
                str(blkio_group.path),
            ]
            if key not in report["overhead"]:
                memory_group.write("memory.limit_in_bytes", "-1")
                report["overhead"][key] = child([*extra, "--calibrate"], throttled=False)[
                    "overhead"
                ]
            overhead = report["overhead"][key]
            # 5% + 16 MiB over the peak seen: batches in flight vary a little (what they leave
            # unused is page cache; each row's table line says how much the page cache held).
            limit = int(overhead * 1.05) + (16 << 20) + allowance
            drop_caches(everything)
            read = cache_files_of(caches[kind], yuv420=row == "yuv420")
            cold = resident_share(read), resident_share(everything)
            memory_group.write("memory.limit_in_bytes", str(limit))
            result = child(extra) | {"overhead": overhead, "limit": limit, "cold": cold}
            report["rows"].append(result)
            print(f"  {kind} {row}: {_brief(result)}", file=sys.stderr, flush=True)
    return report


def cache_files_of(cache: Path, yuv420: bool = False) -> list[Path]:
    """The files of ``cache``, or of its yuv420 twin."""
    if yuv420:
        cache = cache.with_name(cache.name + "-yuv420")
    return sorted(cache.iterdir())


def _buffer_blocks(cache: Path, allowance: int, args: argparse.Namespace) -> int:
    """QuasiRandomSampler's default buffer, or fewer blocks when two buffers (the one read and
    the one read ahead) would take more than 20% of the page cache allowed: the share that the
    default's two buffers, 512 MiB, are of the RAM of a machine that trains from such a cache
    is far smaller still, and what the page cache holds besides is what an epoch finds there
    from the one before."""
    from mmcache import MemmapImageDataset, QuasiRandomSampler

    ds = MemmapImageDataset(cache, on_stale="ignore")
    s = QuasiRandomSampler(ds, args.block_size)
    block_bytes = s.block_size * float(ds.reader.records.nbytes.mean())
    fit = int(0.2 * allowance / 2 / block_bytes)
    return max(1, min(s.buffer_blocks, fit))


def _brief(r: dict) -> str:
    return ", ".join(
        f"epoch {k + 1} {e['images'] / e['seconds']:,.0f} img/s"
        f"{' (partial)' if e['partial'] else ''}, {e['read_bytes'] / MB:,.0f} MB read"
        for k, e in enumerate(r["epochs"])
    )


def _machine() -> str:
    import cv2
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    ram = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} cores ({cpu}), {ram:.1f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"OpenCV {cv2.__version__}"
    )


def print_report(args, report, profile, iops, bps, device, disk, data, caches) -> None:
    from mmcache import MemmapImageDataset

    limits = []
    if iops:
        limits.append(f"{iops:,} IOPS")
    if bps:
        limits.append(f"{bps / MB:,.0f} MB/s")
    where = f"reads of {device} ({disk}), the disk of --workdir"
    storage = f"{profile}: {', '.join(limits)} ({where})" if limits else f"{profile}: {where}"
    print(f"\ncommand: python tools/larger_than_ram.py {shlex.join(args.argv)}")
    print(f"machine: {_machine()}")
    print(f"storage {storage}")
    c = report["check"]
    seq = c["seq_bytes"] / c["seq_seconds"] / MB
    rand = c["rand_reads"] / c["rand_seconds"]
    print(
        f"throttle check, cold data file: {c['seq_bytes'] / MB:,.0f} MB read sequentially at "
        f"{seq:,.1f} MB/s{f' (limit {bps / MB:,.0f})' if bps else ''}; "
        f"{c['rand_reads']:,} random 4 KB reads at {rand:,.0f}/s"
        f"{f' (limit {iops:,})' if iops else ''}"
    )
    jpeg_bytes = sum(f.stat().st_size for f in data["jpegs"])
    print(
        f"source: {len(data['jpegs']):,} JPEGs of 500x375, 375x500, 500x333 and 333x500, "
        f"{jpeg_bytes / MB:,.0f} MB"
    )
    rows_by = {}
    for r in report["rows"]:
        rows_by.setdefault(r["loader"], {})[r["row"]] = r
    if "batch" in rows_by and "dataloader" in rows_by and "decode" in rows_by["dataloader"]:
        rows_by["batch"] = {"decode": rows_by["dataloader"]["decode"], **rows_by["batch"]}
    targets = []
    for kind, rows in rows_by.items():
        allowance, cache_bytes = report["allowance"][kind]
        ds = MemmapImageDataset(caches[kind], on_stale="ignore")
        print(
            f"\n{LOADERS[kind]}: {len(ds):,} records, cache {cache_bytes / MB:,.0f} MB, page "
            f"cache allowed {allowance / MB:,.0f} MB (the cgroup's limit is that plus the "
            f"row's own memory); batch {args.batch_size}, {args.workers} "
            f"{'workers' if kind == 'dataloader' else 'threads'}; img/s\n"
        )
        head = " | ".join(f"epoch {e + 1}" for e in range(args.epochs))
        print(
            f"| row | {head} | vs random (epoch {args.epochs}) | cache MB in RAM at epoch "
            "start | MB read per epoch | reads per epoch | CPU (of all cores) |"
        )
        print("|---|" + "---:|" * args.epochs + "---:|---:|---:|---:|---:|")
        rate = {name: [e["images"] / e["seconds"] for e in r["epochs"]] for name, r in rows.items()}
        for name, r in rows.items():
            label = ROWS[name]
            if name == "decode" and kind == "crop":
                label = "decode every epoch + RandomResizedCrop + flip (DataLoader)"
            if "block_size" in r:
                label += f" (blocks of {r['block_size']}, buffer {r['buffer_blocks']})"
            if "warm_share" in r:
                label += f" (warmed {r['warm_share']:.0%} in {r['warm_seconds']:.1f} s)"
            cells = [
                f"{x:,.0f}{'*' if e['partial'] else ''}" for e, x in zip(r["epochs"], rate[name])
            ]
            vs = f"{rate[name][-1] / rate['random'][-1]:.2f}x" if "random" in rate else "-"
            epochs = r["epochs"]
            resident = " / ".join(f"{e['resident_at_start'] / MB:,.0f}" for e in epochs)
            read = " / ".join(f"{e['read_bytes'] / MB:,.0f}" for e in epochs)
            reads = " / ".join(f"{e['reads']:,}" for e in epochs)
            cpu = " / ".join(f"{e['cpu'] / e['seconds'] / os.cpu_count():.0%}" for e in epochs)
            print(
                f"| {label} | {' | '.join(cells)} | {vs} | {resident} | {read} | {reads} | {cpu} |"
            )
        partial = [r for r in rows.values() if any(e["partial"] for e in r["epochs"])]
        if partial:
            print(
                f"\n\\* stopped after {args.max_epoch_seconds:g} s: the rate of the images "
                "read so far"
            )
        colds = {f"{r['cold'][0]:.0%}" for r in rows.values()}
        print(
            f"\nresident share of the cache after dropping the page cache, before each row: "
            f"{', '.join(sorted(colds))}"
        )
        last = args.epochs - 1
        if "yuv420" in rate:
            yuv_bytes = MemmapImageDataset(
                cache_files_of(caches[kind], True)[0].parent, on_stale="ignore"
            ).manifest.sizes["data"]
            print(f"yuv420 cache: {yuv_bytes / MB:,.0f} MB ({yuv_bytes / cache_bytes:.2f}x)")
            # Where the disk is the limit, half the bytes must show; on local disk, no loss.
            want = 1.0 if profile == "local" else 1.5
            for base, need in (("random", want), ("decode", 1.0)):
                if base in rate:
                    targets.append(
                        (
                            f"{kind}: yuv420 cache / {base}, epoch {last + 1}",
                            rate["yuv420"][last] / rate[base][last],
                            need,
                        )
                    )
        if "quasi" in rate and "random" in rate:
            targets.append(
                (
                    f"{kind}: QuasiRandomSampler / random order, epoch {last + 1}",
                    rate["quasi"][last] / rate["random"][last],
                    1.5,
                )
            )
        mm = [n for n in rate if n != "decode"]
        if "decode" in rate and mm:
            for e in range(args.epochs):
                best = max(mm, key=lambda n: rate[n][e])
                targets.append(
                    (
                        f"{kind}: best mmcache row ({best}) / decoding, epoch {e + 1}",
                        rate[best][e] / rate["decode"][e],
                        1.0,
                    )
                )
    if targets:
        print(f"\ntargets on {profile}:\n")
        print("| target | measured | |")
        print("|---|---:|---|")
        for name, value, want in targets:
            verdict = "pass" if value >= want else "NOT MET"
            print(f"| {name} >= {want:.1f}x | {value:.2f}x | {verdict} |")


if __name__ == "__main__":
    sys.exit(main())
