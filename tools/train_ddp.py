"""Train a tiny CNN with DistributedDataParallel from an mmcache cache: the scale-out example.

    torchrun --nproc-per-node 2 tools/train_ddp.py CACHE [--epochs 1] [--steps N]
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 tools/train_ddp.py CACHE

Every rank opens the same cache (on a shared filesystem, or its node's local copy made with
``mmcache copy``); ``DistributedSampler`` (or mmcache's ``QuasiRandomSampler`` in distributed
mode, ``--sampler quasi``) hands each rank a disjoint 1/world of every epoch. Runs on CPU with
gloo, or on GPUs with nccl when CUDA is there. Prints, from rank 0, each epoch's mean loss and
the throughput of all ranks together in images per second (the first step, which waits for
the DataLoader workers to start, is left out of the timing).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from mmcache import MemmapImageDataset


class ToTensor:
    """H x W x C uint8 array -> C x S x S uint8 tensor (a picklable transform for workers)."""

    def __init__(self, side: int) -> None:
        self.side = side

    def __call__(self, img: np.ndarray) -> torch.Tensor:
        if img.shape[:2] != (self.side, self.side):
            img = cv2.resize(img, (self.side, self.side), interpolation=cv2.INTER_AREA)
        img = img.reshape(self.side, self.side, -1)
        # uint8 until it reaches the device: a quarter of float32's bytes to move.
        return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)


def tiny_cnn(channels: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def make_sampler(kind: str, ds: MemmapImageDataset, world: int, rank: int, seed: int):
    if kind == "quasi":
        try:
            from mmcache.sampler import QuasiRandomSampler
        except ImportError:
            raise SystemExit("train_ddp: this mmcache has no QuasiRandomSampler") from None
        return QuasiRandomSampler(ds, num_replicas=world, rank=rank, seed=seed, drop_last=True)
    return DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cache", help="an mmcache cache folder")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="stop after N steps in all")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--input-size", type=int, default=64, metavar="S", help="resize to S x S")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--sampler", choices=["distributed", "quasi"], default="distributed")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)

    ds = MemmapImageDataset(args.cache, transform=ToTensor(args.input_size), on_stale="ignore")
    sampler = make_sampler(args.sampler, ds, world, rank, args.seed)
    # Every rank must take the same number of steps (DDP syncs each one), hence drop_last; a
    # share smaller than one batch gets one smaller batch rather than no step at all.
    batch_size = max(1, min(args.batch_size, len(sampler)))
    loader = DataLoader(
        ds,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        persistent_workers=args.workers > 0,
    )
    channels = ds[0][0].shape[0]
    model = tiny_cnn(channels, len(ds.classes)).to(device)
    ids = [local_rank] if device.type == "cuda" else None
    model = DistributedDataParallel(model, device_ids=ids)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    if rank == 0:
        print(
            f"train_ddp: {len(ds):,} images, {len(ds.classes)} classes, {world} ranks ({backend}, "
            f"{device.type}), batch {batch_size} per rank, {len(loader)} steps per epoch",
            flush=True,
        )

    step = 0
    for epoch in range(args.epochs):
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        # [loss sum, batches, images timed]; the clock starts after the first step.
        totals = torch.zeros(3, dtype=torch.float64)
        started = None
        for x, y in loader:
            x = x.to(device, non_blocking=True).float().div_(255)
            y = y.to(device, non_blocking=True)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            totals[0] += loss.item()
            totals[1] += 1
            if started is None:
                started = time.perf_counter()
            else:
                totals[2] += len(y)
            step += 1
            if args.steps is not None and step >= args.steps:
                break
        seconds = time.perf_counter() - started if started is not None else 0.0
        # Every rank took part: sum their losses, batches and images; the slowest rank's time.
        dist.all_reduce(totals)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            loss_mean = totals[0].item() / max(totals[1].item(), 1)
            rate = totals[2].item() / slowest.item() if slowest.item() > 0 else math.nan
            print(
                f"epoch {epoch + 1}: {int(totals[1].item()) // world} steps, loss {loss_mean:.4f}, "
                f"{rate:,.0f} img/s ({world} ranks)",
                flush=True,
            )
        if args.steps is not None and step >= args.steps:
            break
    # Tear down in order while the interpreter is whole: DDP's reducer holds gloo work, and a
    # rank whose gloo threads outlived it aborted at exit ("terminate called without an active
    # exception", SIGABRT after the last epoch) in about 1 run in 4.
    del model, opt, loader
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
