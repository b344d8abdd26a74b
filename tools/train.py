"""Train a small CNN the ImageNet way from mmcache caches: the end-to-end example.

    python tools/train.py                        # demo images, 3 epochs, 224 px crops
    python tools/train.py --source data/ --epochs 10 --checkpoint ckpt.pt
    python tools/train.py --checkpoint ckpt.pt --resume   # goes on mid-epoch where it stopped

It builds (or reuses) caches of the training and validation images stored at shorter side 256
(``mmcache build SRC CACHE --short-side 256``), trains on ``RandomResizedCrop`` + horizontal
flips and validates on ``CenterResizedCrop`` (the centre 224/256 of the shorter side), both
gathered by ``BatchLoader`` into normalised batches, and prints each epoch's loss, accuracies
and images per second. With ``--checkpoint`` it saves the model, the optimiser and the loader's
position every ``--save-every`` steps and at the end of each epoch; ``--resume`` loads it and
goes on from the next batch of the same epoch, with the same crops. ``--source`` takes an
ImageFolder-style tree with ``train/`` and ``val/`` folders; without it, photo-like demo images
are generated.
Under torchrun, ``tools/train_ddp.py`` runs the same training with DistributedDataParallel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: _helpers

from _helpers.common import add_checkpoint_options, add_run_options  # noqa: E402

import mmcache  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def small_cnn(classes: int) -> nn.Module:
    """Four strided convolutions and a linear layer: enough to learn the demo's classes."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [
            nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        ]

    return nn.Sequential(
        *block(3, 16),
        *block(16, 32),
        *block(32, 64),
        *block(64, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, classes),
    )


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The training and validation caches, built (or found up to date) at shorter side 256."""
    work = Path(args.workdir)
    if args.source:
        train_src, val_src = Path(args.source) / "train", Path(args.source) / "val"
    else:
        train_src, val_src = work / "images" / "train", work / "images" / "val"
        if is_main() and not train_src.exists():
            per_class = max(1, args.images // 4)
            make_image_folder(train_src, classes=4, per_class=per_class, seed=0)
            make_image_folder(val_src, classes=4, per_class=max(1, per_class // 5), seed=1)
        barrier()  # under torchrun the ranks build the caches together, from the same images
    caches = []
    for split, src in (("train", train_src), ("val", val_src)):
        report = mmcache.build_cache(src, work / f"cache-{split}", short_side=256)
        if is_main():
            state = "up to date" if report.up_to_date else f"built in {report.seconds:.1f} s"
            print(f"{split}: {report.images:,} images, {report.classes} classes, {state}")
        caches.append(work / f"cache-{split}")
    return caches[0], caches[1]


def distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main() -> bool:
    return not distributed() or torch.distributed.get_rank() == 0


def barrier() -> None:
    if distributed():
        torch.distributed.barrier()


@dataclass
class Run:
    """Everything training needs: the model, its optimiser and the loaders."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    train: mmcache.BatchLoader
    val: mmcache.BatchLoader
    device: torch.device


def make_run(
    args: argparse.Namespace,
    train_cache: Path,
    val_cache: Path,
    device: torch.device,
    sampler=None,
    wrap=None,
) -> Run:
    train_ds, val_ds = (
        mmcache.MemmapImageDataset(train_cache),
        mmcache.MemmapImageDataset(val_cache),
    )
    loader_args = {"normalize": IMAGENET, "channels_last": True, "device": device}
    train = mmcache.BatchLoader(
        train_ds,
        args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        seed=args.seed,
        crop=mmcache.RandomResizedCrop(args.size),
        flip=True,
        drop_last=sampler is not None,
        **loader_args,
    )
    val = mmcache.BatchLoader(
        val_ds, args.batch_size, crop=mmcache.CenterResizedCrop(args.size), **loader_args
    )
    torch.manual_seed(args.seed)
    model = small_cnn(len(train_ds.classes)).to(device).to(memory_format=torch.channels_last)
    if wrap is not None:
        model = wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    return Run(model, optimizer, train, val, device)


def save(path: Path, run: Run, epoch: int, step: int) -> None:
    """Model, optimiser and the loader's position: everything a resumed run needs."""
    state = {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "loader": run.train.state_dict(),
        "epoch": epoch,
        "step": step,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a kill while saving leaves the previous checkpoint whole


def evaluate(run: Run) -> float:
    run.model.eval()
    correct = seen = 0
    with torch.no_grad():
        for images, labels in run.val:
            labels = labels.to(run.device)
            correct += int((run.model(images).argmax(1) == labels).sum())
            seen += len(labels)
    run.model.train()
    return correct / max(seen, 1)


def train(args: argparse.Namespace, run: Run, all_reduce=None) -> dict:
    """The epochs; returns the last epoch's figures (also printed)."""
    loss_fn = nn.CrossEntropyLoss()
    start_epoch, step = 0, 0
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if args.resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, map_location=run.device, weights_only=True)
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.train.load_state_dict(state["loader"])
        start_epoch, step = state["epoch"], state["step"]
        if is_main():
            print(f"resumed at epoch {start_epoch + 1}, batch {state['loader']['batches']}")
    figures: dict = {}
    for epoch in range(start_epoch, args.epochs):
        if epoch != start_epoch or not args.resume:
            run.train.set_epoch(epoch)
        totals = torch.zeros(4, dtype=torch.float64)  # loss sum, batches, correct, images
        started = time.perf_counter()
        for images, labels in run.train:
            labels = labels.to(run.device, non_blocking=True)
            logits = run.model(images)
            loss = loss_fn(logits, labels)
            run.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            run.optimizer.step()
            totals += torch.tensor(
                [loss.item(), 1, int((logits.argmax(1) == labels).sum()), len(labels)],
                dtype=torch.float64,
            )
            step += 1
            if checkpoint is not None and args.save_every and step % args.save_every == 0:
                save(checkpoint, run, epoch, step)
            if args.stop_after and step >= args.stop_after:
                if is_main():
                    print(f"stopped after step {step}, as asked (--stop-after)")
                return figures
        seconds = time.perf_counter() - started
        if all_reduce is not None:
            totals, seconds = all_reduce(totals, seconds)
        figures = {
            "epoch": epoch + 1,
            "loss": totals[0].item() / max(totals[1].item(), 1),
            "train_accuracy": totals[2].item() / max(totals[3].item(), 1),
            "val_accuracy": evaluate(run),
            "images_per_second": totals[3].item() / seconds if seconds > 0 else math.nan,
        }
        if checkpoint is not None:
            run.train.set_epoch(epoch + 1)  # the checkpoint starts the next epoch
            save(checkpoint, run, epoch + 1, step)
        if is_main():
            print(
                f"epoch {epoch + 1}: loss {figures['loss']:.4f}, train accuracy "
                f"{figures['train_accuracy']:.1%}, val accuracy {figures['val_accuracy']:.1%}, "
                f"{figures['images_per_second']:,.0f} img/s",
                flush=True,
            )
    return figures


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--source",
        help="a folder with train/ and val/ image folders (default: "
        "generate photo-like demo images)",
    )
    p.add_argument("--images", type=int, default=1000, help="demo training images (default 1000)")
    p.add_argument("--workdir", default="train-work", help="images and caches (default train-work)")
    add_run_options(p, epochs=3, batch_size=64, lr=0.1,
                    batch_help="batch size (per rank; default 64)")  # fmt: skip
    p.add_argument("--size", type=int, default=224, help="crop size (default 224; 112 is faster)")
    p.add_argument("--seed", type=int, default=0, help="order, crops and initial weights")
    add_checkpoint_options(p)
    p.add_argument("--json", help="write the last epoch's figures to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_cache, val_cache = prepare(args)
    run = make_run(args, train_cache, val_cache, device)
    print(
        f"training on {device}: {len(run.train)} batches of {args.batch_size} per epoch, "
        f"{args.size} px crops"
    )
    figures = train(args, run)
    write_json(args, run, figures)
    return 0


def write_json(args: argparse.Namespace, run: Run, figures: dict) -> None:
    """``--json``: the last epoch's figures, and a checksum of the weights (a resumed run that
    went the same way as an uninterrupted one ends with the same weights)."""
    if args.json and is_main():
        weights = sum(float(p.double().sum()) for p in run.model.state_dict().values())
        Path(args.json).write_text(json.dumps({**figures, "weights_sum": weights}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
