"""Train a tiny segmentation network from an mmcache cache of images with their masks.

    python tools/train_segmentation.py                       # generated set, 3 epochs
    python tools/train_segmentation.py --checkpoint seg.pt --stop-after 5
    python tools/train_segmentation.py --checkpoint seg.pt --resume  # goes on mid-epoch
    python tools/train_segmentation.py --detection           # boxes through the loader

It generates a VOC-like set (photo-textured JPEGs and 8-bit PNG masks: ``images/`` and
``masks/``), builds (or reuses) a cache of both (``mmcache build images/ CACHE --masks masks/``),
and trains a four-layer fully convolutional network on ``BatchLoader`` batches of
``RandomResizedCrop`` + flip applied to each image and its mask alike, printing each epoch's
loss, mean IoU over the classes and images per second. With ``--checkpoint`` it saves the model,
the optimiser and the loader's position every ``--save-every`` steps; ``--resume`` goes on from
the next batch with the same crops. ``--detection`` instead generates a COCO-style set
(``instances.json``), builds a cache with ``--coco`` and prints the first batch's boxes and
labels after the crop and flip.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: _helpers

from _helpers.common import add_checkpoint_options, add_run_options  # noqa: E402

import mmcache  # noqa: E402
from mmcache.sample_data import make_detection_set, make_segmentation_set  # noqa: E402

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


def tiny_fcn(classes: int) -> nn.Module:
    """Two strided convolutions down, two up: a per-pixel classifier at the input's size."""

    def down(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True)]  # fmt: skip

    return nn.Sequential(
        *down(3, 16),
        *down(16, 32),
        nn.ConvTranspose2d(32, 16, 2, stride=2),
        nn.ReLU(inplace=True),
        nn.ConvTranspose2d(16, classes, 2, stride=2),
    )


def mean_iou(confusion: torch.Tensor) -> float:
    """The mean over classes present of intersection over union, from a confusion matrix."""
    tp = confusion.diag().double()
    union = confusion.sum(0).double() + confusion.sum(1).double() - tp
    present = union > 0
    return float((tp[present] / union[present]).mean()) if present.any() else float("nan")


def detection(args: argparse.Namespace, workdir: Path) -> int:
    images, coco = make_detection_set(workdir / "detection", images=args.images,
                                      size=(args.image_size, args.image_size * 4 // 3))  # fmt: skip
    report = mmcache.build_cache(images, workdir / "cache-detection", coco=coco)
    print(f"detection: {report.images} images, built in {report.seconds:.1f} s")
    ds = mmcache.MemmapImageDataset(workdir / "cache-detection")
    classes = next(f["classes"] for f in ds.manifest.fields if f["name"] == "labels")
    loader = mmcache.BatchLoader(ds, args.batch_size, shuffle=True, seed=0, flip=True,
                                 crop=mmcache.RandomResizedCrop(args.size))  # fmt: skip
    images_batch, target = next(iter(loader))
    print(f"first batch: {tuple(images_batch.shape)} images; boxes (x1, y1, x2, y2) per image:")
    for k, (boxes, labels) in enumerate(zip(target["boxes"], target["labels"])):
        names = [classes[int(v)] for v in labels]
        shown = ", ".join(f"{n} {[round(float(v), 1) for v in b]}" for n, b in zip(names, boxes))
        print(f"  image {k}: {shown or 'no boxes'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="seg-work", help="images, caches (default seg-work/)")
    p.add_argument("--images", type=int, default=400, help="images to generate (default 400)")
    p.add_argument("--image-size", type=int, default=240, help="their height (default 240)")
    p.add_argument("--classes", type=int, default=4, help="classes, with background (4)")
    p.add_argument("--size", type=int, default=128, help="crop size (default 128)")
    add_run_options(p, epochs=3, batch_size=32, lr=0.05)
    add_checkpoint_options(
        p,
        save_every="also save every this many steps (default: at epoch ends)",
        stop_after="stop after this many steps (to try --resume)",
        resume_last=True,
    )
    p.add_argument("--json", help="write the last epoch's figures here")
    p.add_argument("--detection", action="store_true", help="show boxes through the loader")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    torch.manual_seed(0)
    if args.detection:
        return detection(args, workdir)
    images, masks = workdir / "segmentation" / "images", workdir / "segmentation" / "masks"
    if not images.exists():  # made once: a later run (--resume) finds the cache up to date
        make_segmentation_set(
            workdir / "segmentation", images=args.images, classes=args.classes, ext=".jpg",
            size=(args.image_size, args.image_size * 4 // 3), texture=True,
        )  # fmt: skip
    report = mmcache.build_cache(images, workdir / "cache", masks=masks)
    state = "up to date" if report.up_to_date else f"built in {report.seconds:.1f} s"
    print(f"train: {report.images} images with masks, {args.classes} classes, {state}")
    ds = mmcache.MemmapImageDataset(workdir / "cache")
    loader = mmcache.BatchLoader(ds, args.batch_size, shuffle=True, seed=0, flip=True,
                                 crop=mmcache.RandomResizedCrop(args.size),
                                 normalize=IMAGENET)  # fmt: skip
    model = tiny_fcn(args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    step, first_epoch = 0, 0
    if args.resume and checkpoint is not None and checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        step, first_epoch = saved["step"], loader.epoch
        print(f"resumed at epoch {loader.epoch + 1}, batch {loader.state_dict()['batches'] + 1}")

    def save() -> None:
        if checkpoint is None:
            return
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict(), "step": step}, tmp)  # fmt: skip
        os.replace(tmp, checkpoint)

    figures: dict = {}
    for epoch in range(first_epoch, args.epochs):
        if epoch != first_epoch or not args.resume:
            loader.set_epoch(epoch)
        confusion = torch.zeros(args.classes, args.classes, dtype=torch.int64)
        total_loss, seen, start = 0.0, 0, time.perf_counter()
        model.train()
        for batch, target in loader:
            mask = target["mask"].long()
            logits = model(batch)
            loss = loss_fn(logits, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            total_loss += loss.item() * len(batch)
            seen += len(batch)
            pred = logits.argmax(1)
            pairs = mask.reshape(-1) * args.classes + pred.reshape(-1)
            confusion += torch.bincount(pairs, minlength=args.classes**2).view(args.classes, -1)
            if args.save_every and step % args.save_every == 0:
                save()
            if args.stop_after and step >= args.stop_after:
                save()
                print(f"stopped after step {step}")
                return 0
        seconds = time.perf_counter() - start
        weights = sum(float(v.double().sum()) for v in model.state_dict().values())
        figures = {"epoch": epoch + 1, "loss": total_loss / max(seen, 1),
                   "mean_iou": mean_iou(confusion), "images_per_second": seen / seconds,
                   "weights_sum": weights}  # fmt: skip
        print(f"epoch {epoch + 1}: loss {figures['loss']:.3f}, mean IoU "
              f"{figures['mean_iou']:.3f}, {figures['images_per_second']:,.0f} img/s")  # fmt: skip
        loader.set_epoch(epoch + 1)
        save()
    if args.json:
        Path(args.json).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
