"""What the example training scripts of tools/ share: their run and checkpoint options."""

from __future__ import annotations

import argparse

# The help of train.py and train_ssl.py; train_segmentation.py words two of them its own way.
SAVE_EVERY = "also save every STEPS steps (default: at each epoch's end only)"
STOP_AFTER = "stop after STEPS steps in all, as an interrupted run would"


def add_run_options(
    p: argparse.ArgumentParser,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    optimizer: str = "SGD",
    lr_text: str | None = None,
    batch_help: str | None = None,
) -> None:
    """--epochs, --batch-size and --lr, each with its default in its help (``lr_text``: the
    default as the help writes it, where ``str(lr)`` would not: 5e-4)."""
    p.add_argument("--epochs", type=int, default=epochs, help=f"epochs (default {epochs})")
    p.add_argument(
        "--batch-size",
        type=int,
        default=batch_size,
        help=batch_help or f"batch size (default {batch_size})",
    )
    p.add_argument(
        "--lr", type=float, default=lr, help=f"{optimizer} learning rate (default {lr_text or lr})"
    )


def add_checkpoint_options(
    p: argparse.ArgumentParser,
    *,
    save_every: str = SAVE_EVERY,
    stop_after: str = STOP_AFTER,
    resume_last: bool = False,
) -> None:
    """--checkpoint, --save-every, --resume and --stop-after: save a run, stop it as an
    interruption would, and go on from the checkpoint mid-epoch (``resume_last``: --resume
    listed after --stop-after, as train_segmentation.py's help has it)."""
    p.add_argument("--checkpoint", help="save the run here (and resume from it with --resume)")
    p.add_argument("--save-every", type=int, default=0, metavar="STEPS", help=save_every)

    def resume() -> None:
        p.add_argument("--resume", action="store_true", help="go on from --checkpoint, mid-epoch")

    if not resume_last:
        resume()
    p.add_argument("--stop-after", type=int, default=0, metavar="STEPS", help=stop_after)
    if resume_last:
        resume()
