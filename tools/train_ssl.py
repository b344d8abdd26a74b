"""Self-supervised pretraining of a small CNN the DINO way from a cache: the multi-crop example.

    python tools/train_ssl.py                    # demo images, 2 x 224 + 6 x 96 views, 2 epochs
    python tools/train_ssl.py --checkpoint ssl.pt --save-every 5 --stop-after 7
    python tools/train_ssl.py --checkpoint ssl.pt --resume   # goes on mid-epoch, same views

It builds (or reuses) a cache of the images stored at shorter side 256, and ``BatchLoader``
gathers DINO's views of each image straight into batches: ``--global-views`` crops of
``--global-size`` (scale 0.32-1) and ``--local-views`` of ``--local-size`` (scale 0.05-0.32),
each with its own box and flip, each image read once per step. The photometric augmentations
(colour jitter, grayscale, blur, solarisation) run on the batches in torch, from a generator
seeded by the seed, the epoch and the step, so a resumed run draws them as the uninterrupted
one did. The student (a small CNN and a projection head) sees every view, the teacher (its
moving average) the global ones; the loss is DINO's cross-entropy between the teacher's
centred, sharpened outputs and the student's. It prints each epoch's loss and images per
second. ``--checkpoint`` / ``--resume``: as ``tools/train.py`` (the model, teacher, centre,
optimiser and the loader's position). ``--source``: an image folder (default: demo images).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: _helpers

from _helpers.common import add_checkpoint_options, add_run_options  # noqa: E402

import mmcache  # noqa: E402
from mmcache.sample_data import make_image_folder  # noqa: E402

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
STUDENT_TEMPERATURE, TEACHER_TEMPERATURE = 0.1, 0.04  # DINO's defaults
CENTER_MOMENTUM = 0.9


def network(out_dim: int) -> nn.Module:
    """Four strided convolutions, then a two-layer projection head to ``out_dim`` outputs;
    any input size (a global pooling before the head)."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]  # fmt: skip

    return nn.Sequential(
        *block(3, 16), *block(16, 32), *block(32, 64), *block(64, 64),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, out_dim),
    )  # fmt: skip


def augment(views: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """BYOL/DINO's photometric augmentations of uint8 N x C x H x W ``views``, as batch
    operations with per-image random strengths: colour jitter (brightness, contrast,
    saturation, p 0.8), grayscale (p 0.2), a 3x3 blur (p 0.5), solarisation (p 0.2); then
    ImageNet's normalisation. Float N x C x H x W out."""
    x = views.float().div_(255)
    n = x.shape[0]

    def draw(*shape: int) -> torch.Tensor:
        return torch.rand((n, *shape), generator=generator).view(n, *shape, *[1] * (3 - len(shape)))

    jitter = draw() < 0.8
    brightness = 1 + (draw() * 0.8 - 0.4) * jitter
    contrast = 1 + (draw() * 0.8 - 0.4) * jitter
    saturation = 1 + (draw() * 0.4 - 0.2) * jitter
    gray = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    x = x * brightness
    x = (x - gray.mean((2, 3), keepdim=True)) * contrast + gray.mean((2, 3), keepdim=True)
    gray = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    x = (x - gray) * saturation + gray
    x = torch.where(draw() < 0.2, gray.expand_as(x), x).clamp_(0, 1)
    blurred = F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1)
    x = torch.where(draw() < 0.5, blurred, x)
    x = torch.where((draw() < 0.2) & (x > 0.5), 1 - x, x)
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in IMAGENET)
    return ((x - mean) / std).contiguous(memory_format=torch.channels_last)


def dino_loss(student: list[torch.Tensor], teacher: list[torch.Tensor],
              center: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DINO's loss: the cross-entropy of each student view against each teacher (global) view
    other than itself, averaged."""
    targets = [F.softmax((t - center) / TEACHER_TEMPERATURE, dim=-1) for t in teacher]
    total, terms = student[0].new_zeros(()), 0
    for q, target in enumerate(targets):
        for v, s in enumerate(student):
            if v == q:
                continue
            log_p = F.log_softmax(s / STUDENT_TEMPERATURE, dim=-1)
            total = total + (-target * log_p).sum(-1).mean()
            terms += 1
    return total / terms


def prepare(args: argparse.Namespace) -> Path:
    """The cache of the images (``--source``, or generated demo images) at ``--short-side``."""
    work = Path(args.workdir)
    source = Path(args.source) if args.source else work / "images"
    if not args.source and not source.exists():
        make_image_folder(source, classes=4, per_class=max(1, args.images // 4), seed=0)
    report = mmcache.build_cache(source, work / "cache", short_side=args.short_side)
    state = "up to date" if report.up_to_date else f"built in {report.seconds:.1f} s"
    print(f"cache: {report.images:,} images, {state}")
    return work / "cache"


def step_generator(seed: int, epoch: int, step: int) -> torch.Generator:
    """The augmentations' generator of one step: a resumed run draws what the first drew."""
    return torch.Generator().manual_seed(hash((seed, epoch, step)) & (2**63 - 1))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    cache = prepare(args)
    ds = mmcache.MemmapImageDataset(cache)
    views = [
        (mmcache.RandomResizedCrop(args.global_size, scale=(0.32, 1.0)), args.global_views),
        (mmcache.RandomResizedCrop(args.local_size, scale=(0.05, 0.32)), args.local_views),
    ]
    views = [(crop, n) for crop, n in views if n > 0]
    # uint8 views as N x C x H x W views of the pixels; augment() makes the floats
    loader = mmcache.BatchLoader(ds, args.batch_size, shuffle=True, seed=args.seed, views=views,
                                 flip=True, drop_last=True, channels_last=True)  # fmt: skip
    torch.manual_seed(args.seed)
    student = network(args.out_dim).to(memory_format=torch.channels_last)
    teacher = copy.deepcopy(student).requires_grad_(False)
    center = torch.zeros(args.out_dim)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, weight_decay=0.04)
    start_epoch, step = 0, 0
    checkpoint = Path(args.checkpoint) if args.checkpoint else None

    def save(epoch: int) -> None:
        state = {"student": student.state_dict(), "teacher": teacher.state_dict(),
                 "center": center, "optimizer": optimizer.state_dict(),
                 "loader": loader.state_dict(), "epoch": epoch, "step": step}  # fmt: skip
        assert checkpoint is not None
        torch.save(state, checkpoint.with_suffix(".tmp"))
        os.replace(checkpoint.with_suffix(".tmp"), checkpoint)  # a kill leaves the last whole

    if args.resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        student.load_state_dict(state["student"])
        teacher.load_state_dict(state["teacher"])
        center = state["center"]
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        start_epoch, step = state["epoch"], state["step"]
        print(f"resumed at epoch {start_epoch + 1}, batch {state['loader']['batches']}")
    sizes = " + ".join(f"{n} x {crop.size[0]}" for crop, n in views)
    print(f"DINO on the CPU: {len(loader)} steps of {args.batch_size} images per epoch, views "
          f"{sizes}")  # fmt: skip
    figures: dict = {}
    for epoch in range(start_epoch, args.epochs):
        if epoch != start_epoch or not args.resume:
            loader.set_epoch(epoch)
        losses, images, started = [], 0, time.perf_counter()
        for batch in loader:
            crops, _labels = batch
            generator = step_generator(args.seed, epoch, step)
            inputs = [augment(v, generator) for v in crops]
            out = [student(x) for x in inputs]
            with torch.no_grad():
                targets = [teacher(x) for x in inputs[: args.global_views]]
            loss = dino_loss(out, targets, center)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for p, q in zip(teacher.parameters(), student.parameters()):
                    p.mul_(args.momentum).add_(q.detach(), alpha=1 - args.momentum)
                center = center * CENTER_MOMENTUM + torch.cat(targets).mean(0) * (
                    1 - CENTER_MOMENTUM)  # fmt: skip
            losses.append(loss.item())
            images += len(crops[0])
            step += 1
            if checkpoint is not None and args.save_every and step % args.save_every == 0:
                save(epoch)
            if args.stop_after and step >= args.stop_after:
                print(f"stopped after step {step}, as asked (--stop-after)")
                write_json(args, student, {"loss": losses[-1], "step": step})
                return 0
        seconds = time.perf_counter() - started
        figures = {
            "epoch": epoch + 1,
            "loss": sum(losses) / max(len(losses), 1),
            "images_per_second": images / seconds if seconds > 0 else math.nan,
            "step": step,
        }
        if checkpoint is not None:
            loader.set_epoch(epoch + 1)  # the checkpoint starts the next epoch
            save(epoch + 1)
        print(f"epoch {epoch + 1}: loss {figures['loss']:.4f}, "
              f"{figures['images_per_second']:,.1f} img/s (all views, the step included)",
              flush=True)  # fmt: skip
    write_json(args, student, figures)
    return 0


def write_json(args: argparse.Namespace, student: nn.Module, figures: dict) -> None:
    """``--json``: the figures and a checksum of the student's weights (a resumed run that went
    the same way as an uninterrupted one ends with the same weights)."""
    if args.json:
        weights = sum(float(p.double().sum()) for p in student.state_dict().values())
        Path(args.json).write_text(json.dumps({**figures, "weights_sum": weights}) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", help="an image folder (default: generate photo-like demo images)")
    p.add_argument("--images", type=int, default=200, help="demo images (default 200)")
    p.add_argument("--workdir", default="ssl-work", help="images and cache (default ssl-work)")
    p.add_argument("--short-side", type=int, default=256, help="stored shorter side (256)")
    add_run_options(p, epochs=2, batch_size=32, lr=5e-4, optimizer="AdamW", lr_text="5e-4")
    p.add_argument("--global-views", type=int, default=2, help="global views (default 2)")
    p.add_argument("--global-size", type=int, default=224, help="their size (default 224)")
    p.add_argument("--local-views", type=int, default=6, help="local views (default 6)")
    p.add_argument("--local-size", type=int, default=96, help="their size (default 96)")
    p.add_argument("--out-dim", type=int, default=256, help="projection outputs (default 256)")
    p.add_argument("--momentum", type=float, default=0.996, help="teacher EMA (default 0.996)")
    p.add_argument("--seed", type=int, default=0, help="order, views, augmentations, weights")
    add_checkpoint_options(p)
    p.add_argument("--json", help="write the last figures and a weights checksum to this file")
    return p


if __name__ == "__main__":
    sys.exit(main())
