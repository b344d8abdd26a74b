"""What several commands share: argument types, the preprocessing flags, progress, printing."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .._feedback import human_bytes
from ..annotations import NO_MASK
from ..options import OPTION_FLAGS, SIZE_POLICIES, OptionFlag, Options
from ..scan import Listing, scan_source

if TYPE_CHECKING:
    from tqdm import tqdm


class Progress:
    """A library ``progress(done, total)`` callback shown on stderr: a tqdm bar on a terminal;
    elsewhere (a log file, a pipe) a plain line every ``LOG_EVERY`` seconds, without the
    carriage returns of a bar; nothing with ``--quiet``."""

    LOG_EVERY = 30.0

    def __init__(
        self,
        desc: str,
        unit: str = "img",
        delay: float = 0.0,
        unit_scale: bool = False,
        quiet: bool = False,
    ) -> None:
        self.desc, self.unit, self.delay = desc, unit, delay
        self.bar: tqdm | None = None
        self.unit_scale, self.quiet = unit_scale, quiet
        self.terminal = sys.stderr.isatty()
        self.logged = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if not self.terminal:
            now = time.monotonic()
            if now - self.logged >= self.LOG_EVERY and done < total:
                self.logged = now
                shown = human_bytes(done) if self.unit_scale else f"{done:,}"
                whole = human_bytes(total) if self.unit_scale else f"{total:,} {self.unit}"
                print(f"mmcache: {self.desc}: {shown} of {whole} ({done / total:.0%})",
                      file=sys.stderr, flush=True)  # fmt: skip
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                desc=self.desc,
                unit=self.unit,
                unit_scale=self.unit_scale,
                delay=self.delay,
                file=sys.stderr,
            )
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def notes_shown(quiet: bool) -> Iterator[None]:
    """Print what the library logs at INFO and above (``mmcache: waiting for ...``) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("mmcache: %(message)s"))
    handler.setLevel(logging.WARNING if quiet else logging.INFO)
    logger = logging.getLogger("mmcache")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a library parser: its ValueError's own words, not "invalid value"."""

    def argument(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return argument


def positive_seconds(text: str) -> float:
    """argparse type of a duration: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text!r}")
    return value


def share_arg(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"expected a share between 0 and 1 (or 0% to 100%), got {text!r}"
        )
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive whole number, got {text!r}")
    return value


def _option_type(spec: OptionFlag) -> Callable[[str], Any]:
    """argparse type of a preprocessing flag: the table's parser."""
    return argument_type(spec.parse or str)


def add_option(p: argparse.ArgumentParser | Any, spec: OptionFlag) -> None:
    """``spec``'s flag, its value kept under the name of its ``Options`` field."""
    assert spec.flag is not None
    if spec.parse is None:  # a switch
        p.add_argument(spec.flag, dest=spec.name, action="store_true", help=spec.help)
        return
    p.add_argument(
        spec.flag,
        dest=spec.name,
        type=_option_type(spec),
        choices=spec.choices,
        default=_DEFAULTS[spec.name],
        metavar=spec.metavar,
        help=spec.help,
    )


# The preprocessing flags of build and plan; the mask's dtype is given beside --masks (build).
_PREPROCESSING = [spec for spec in OPTION_FLAGS if spec.flag and spec.name != "mask"]
# A flag left out gives the field's default, as a Python call without that keyword does.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Options)}


def add_preprocessing(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("preprocessing (fixed at build time, recorded in the cache)")
    size = g.add_mutually_exclusive_group()
    for spec in _PREPROCESSING:
        add_option(size if spec.name in SIZE_POLICIES else g, spec)


def preprocessing_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``Options`` (``build_cache``, ``plan_cache``) the flags give."""
    return {spec.name: getattr(args, spec.name) for spec in _PREPROCESSING}


def source_of(args: argparse.Namespace) -> str | Listing:
    """The source to build or plan: its path, or, with ``--label-key``, its listing."""
    if args.label_key is None:
        return str(args.source)
    return scan_source(args.source, label_key=args.label_key)


def add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="image folder (class subfolders or flat), path,label list, or an archive: a .tar "
        "(of class folders, or of one tar per class), a .zip, WebDataset shards (a folder of "
        ".tar, or a pattern such as 'train-{0000..0146}.tar')",
    )
    p.add_argument(
        "--label-key",
        metavar="FIELD",
        help="WebDataset shards: take each sample's label from this field of its .json member "
        "(default: its .cls member)",
    )


class Commands:
    """Adds the subcommands to the parser: each with its help, some with the shared ``-q``."""

    def __init__(self, sub: Any) -> None:  # (argparse's type for it is private)
        self.sub = sub
        self.quiet = argparse.ArgumentParser(add_help=False)
        self.quiet.add_argument(
            "-q", "--quiet", action="store_true", help="print nothing but errors (no progress bars)"
        )

    def command(self, name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        """A subcommand; its one-line help in the list is also the first line of its --help."""
        description = f"{help[0].upper()}{help[1:]}."
        return self.sub.add_parser(name, help=help, description=description, **kwargs)

    def cache_command(
        self,
        name: str,
        func: Callable[[argparse.Namespace], int],
        help: str,
        quiet_flag: bool = True,
    ) -> argparse.ArgumentParser:
        """A subcommand whose first argument is a cache folder."""
        cmd = self.command(name, help, parents=[self.quiet] if quiet_flag else [])
        cmd.add_argument("cache", help="the cache folder")
        cmd.set_defaults(func=func, quiet=False)
        return cmd


def skipped_lines(skipped: list[dict[str, Any]]) -> list[str]:
    """One line per skipped file, but one line for the files of a reason more than three share
    (VOC's images without a mask: most of JPEGImages), with their count and first few names;
    20 lines at most."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s["reason"], []).append(s["path"])
    lines = []
    for reason, paths in by_reason.items():
        if len(paths) <= 3:
            lines += [f"skipped {one_line(p)}: {one_line(reason)}" for p in paths]
            continue
        lines.append(f"{len(paths):,} skipped, {one_line(reason)}: {first_few(paths)}")
        if reason.startswith(NO_MASK):
            lines[-1] += (
                " (a `path,label` list of the images with a mask, as the source, builds "
                "them alone: docs/annotations.md)"
            )
    if len(lines) > 20:
        lines[20:] = [f"... and {len(lines) - 20:,} more lines (see manifest.json)"]
    return lines


def first_few(names: Sequence[object]) -> str:
    """``a.jpg, b.jpg, c.jpg, ...``: the first three of ``names``, one line each."""
    more = ", ..." if len(names) > 3 else ""
    return ", ".join(one_line(str(n)) for n in names[:3]) + more


def garbage(garbage: int, data: int) -> str:
    share = garbage / data if data else 0.0
    return f"{human_bytes(garbage)} of the data file ({share:.1%}) is garbage"


def share(part: int | None, whole: int) -> str:
    if part is None:
        return "unknown (no mincore here)"
    return f"{human_bytes(part)} ({part / whole if whole else 1.0:.0%})"


# Control characters (C0, DEL, C1) as a Python string literal writes them: \n, \t, \x1b.
_CONTROL = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}


def one_line(text: object) -> str:
    """A path (or other text from outside: a decoder's reason, an error) as it is printed for a
    person: on one line, a newline or escape sequence in a file name shown as ``\\n`` or
    ``\\x1b`` rather than acted on. Undecodable bytes are left to the stream, which writes them
    as ``\\xNN`` (``_escape_bytes``)."""
    return str(text).translate(_CONTROL)
