"""Train the small CNN of tools/train.py with DistributedDataParallel: the scale-out example.

    torchrun --nproc-per-node 2 tools/train_ddp.py [--epochs 3] [--sampler quasi]
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 8 tools/train_ddp.py \\
        --source /shared/data --workdir /shared/train-work

The ranks build the caches together (``build_cache`` under a process group shares the decoding
out), then each rank trains on its share of every epoch: ``DistributedSampler``, or mmcache's
``QuasiRandomSampler`` in distributed mode (``--sampler quasi``), feeding a ``BatchLoader`` with
``RandomResizedCrop`` + flips. Rank 0 prints each epoch's loss and accuracies and the
throughput of all ranks together. Checkpoints (``--checkpoint``, rank 0 writes it) hold every
rank's loader position only for the same world size; ``--resume`` goes on mid-epoch. Runs on CPU
with gloo, or on GPUs with nccl when CUDA is there. Options are those of tools/train.py, plus
``--sampler`` and ``--backend``.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train  # noqa: E402

from mmcache import MemmapImageDataset, QuasiRandomSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = train.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--sampler",
        choices=["distributed", "quasi"],
        default="distributed",
        help="how each rank gets its share (default: torch's DistributedSampler)",
    )
    p.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default="auto",
        help="torch.distributed backend (default: nccl with CUDA, else gloo)",
    )
    args = p.parse_args(argv)
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
    train_cache, val_cache = train.prepare(args)
    ds = MemmapImageDataset(train_cache)
    if args.sampler == "quasi":
        sampler = QuasiRandomSampler(
            ds, num_replicas=world, rank=rank, seed=args.seed, drop_last=True
        )
    else:
        sampler = DistributedSampler(
            ds, num_replicas=world, rank=rank, seed=args.seed, drop_last=True
        )
    # Every rank must take the same number of steps (DDP syncs each one), hence drop_last; a
    # share smaller than one batch gets one smaller batch rather than no step at all.
    args.batch_size = max(1, min(args.batch_size, len(sampler)))
    ids = [local_rank] if device.type == "cuda" else None
    run = train.make_run(
        args,
        train_cache,
        val_cache,
        device,
        sampler=sampler,
        wrap=lambda m: DistributedDataParallel(m, device_ids=ids),
    )
    if rank == 0:
        print(
            f"train_ddp: {world} ranks ({backend}, {device.type}), {len(run.train)} batches "
            f"of {args.batch_size} per rank and epoch, {args.size} px crops",
            flush=True,
        )

    def all_reduce(totals: torch.Tensor, seconds: float) -> tuple[torch.Tensor, float]:
        """Every rank's losses and images summed; the slowest rank's time."""
        dist.all_reduce(totals)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return totals, slowest.item()

    if rank != 0:
        args.checkpoint = args.checkpoint and f"{args.checkpoint}.rank{rank}"
    figures = train.train(args, run, all_reduce)
    train.write_json(args, run, figures)
    # Tear down in order while the interpreter is whole: DDP's reducer holds gloo work, and a
    # rank whose gloo threads outlived it aborted at exit ("terminate called without an active
    # exception", SIGABRT after the last epoch) in about 1 run in 4.
    del run
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
