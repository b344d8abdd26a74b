"""The command line, ``mmcache``: the only part of mmcache that prints.

Each subcommand calls one library function and prints its report. A user mistake (a missing
folder, a damaged cache) prints one line, ``mmcache: error: ...``, and exits with status 1;
Ctrl-C exits with 130. Output cut short by its reader (``mmcache plan ... | head -1``) ends
quietly with status 141, as a command killed by SIGPIPE would (128 + 13), so a pipeline under
``set -o pipefail`` still sees that not everything was read. ``main(argv)`` returns the exit
status, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import codecs
import io
import os
import sys
from collections.abc import Sequence
from contextlib import suppress
from typing import cast

from .. import pixels as px
from .._version import __version__
from ..errors import CacheError
from . import build, compact, copy, demo, evict, info, plan, pull, push, verify, warm
from ._shared import Commands, notes_shown, one_line

__all__ = ["main"]

# The subcommands, in the order `mmcache --help` lists them: each module adds its own.
COMMANDS = (build, verify, copy, push, pull, plan, demo, info, warm, compact, evict)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in mmcache's one-line form (exit status 2, as argparse's)."""

    def error(self, message: str):
        self.exit(2, f"mmcache: error: {message} (see `{self.prog} --help`)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="mmcache",
        description="Decode images once into a memory-mapped cache; train from it with PyTorch.",
    )
    p.add_argument("--version", action="version", version=f"mmcache {__version__}")
    cmds = Commands(p.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    for command in COMMANDS:
        command.add(cmds)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    for stream in (sys.stdout, sys.stderr):
        # A file name that is not UTF-8 (its bytes kept as surrogate escapes) prints as \xNN.
        with suppress(AttributeError, ValueError):
            # a TextIOWrapper unless replaced: one without reconfigure raises AttributeError
            cast(io.TextIOWrapper, stream).reconfigure(errors=_ESCAPE)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed
        return e.code if isinstance(e.code, int) else 2
    if getattr(args, "mask", None) and not args.masks:
        print("mmcache: error: --mask-dtype needs --masks MASKS", file=sys.stderr)
        return 2
    pixels = getattr(args, "pixels", None)
    if pixels and px.layout_named(pixels).colour_only and getattr(args, "color", None) == "gray":
        print(
            f"mmcache: error: --pixels {args.pixels} stores colour (luma and half-size chroma) "
            "and --color gray has none: build gray caches without --pixels",
            file=sys.stderr,
        )
        return 2
    try:
        with notes_shown(args.quiet):
            status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        # The Python documentation's recipe (library/signal, "Note on SIGPIPE"): point stdout
        # at devnull, so the interpreter's own flush at exit finds nothing to complain about.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except CacheError as e:
        print(f"mmcache: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mmcache: interrupted", file=sys.stderr)
        return 130


def _escape_bytes(error: UnicodeError) -> tuple[str, int]:
    """Write a surrogate-escaped byte as ``\\xNN``, any other unencodable character as
    ``\\uNNNN``."""
    if not isinstance(error, UnicodeEncodeError):  # registered for the output streams only
        raise error
    chars = error.object[error.start : error.end]
    text = "".join(
        f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else f"\\u{ord(c):04x}"
        for c in chars
    )
    return text, error.end


_ESCAPE = "mmcache-escape"
codecs.register_error(_ESCAPE, _escape_bytes)
