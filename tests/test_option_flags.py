"""The preprocessing options are listed once, in ``mmcache.options.OPTION_FLAGS``: the CLI's
flags, the keyword arguments of ``Options`` and ``Options.flags()`` all come from that table."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mmcache import pixels
from mmcache.cli import _parser
from mmcache.options import COLORS, INTERPOLATIONS, OPTION_FLAGS, OptionFlag, Options


def _build_actions() -> dict[str, argparse.Action]:
    """The ``mmcache build`` parser's options, by the name they are parsed into."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["build"]._actions}


def _sample(spec: OptionFlag) -> object:
    """A value of ``spec``'s field other than its default, that its flag can give."""
    default = getattr(Options(), spec.name)
    if spec.parse is None:
        return not default
    if spec.choices:
        return next(c for c in reversed(spec.choices) if c != default and c not in spec.implied)
    return (160, 224) if spec.name == "size" else 300


def test_every_field_of_options_is_in_the_table_once_in_order():
    assert [spec.name for spec in OPTION_FLAGS] == [f.name for f in dataclasses.fields(Options)]


def test_the_cli_s_flags_are_the_table_s_each_with_one_flag():
    actions = _build_actions()
    for spec in OPTION_FLAGS:
        if spec.flag is None:  # set by other flags (exif_orientation: --masks, --coco)
            assert spec.name not in actions
            continue
        assert actions[spec.name].option_strings == [spec.flag]
        assert actions[spec.name].help == spec.help
        assert actions[spec.name].default == getattr(Options(), spec.name)
    flags = {spec.flag for spec in OPTION_FLAGS}
    others = {dest for dest, a in actions.items() if set(a.option_strings) & flags}
    assert others <= {spec.name for spec in OPTION_FLAGS}


def test_the_choices_are_the_library_s_tables():
    actions = _build_actions()
    assert tuple(actions["color"].choices) == COLORS
    assert tuple(actions["interpolation"].choices) == INTERPOLATIONS
    assert tuple(actions["pixels"].choices) == pixels.LAYOUTS
    assert tuple(actions["mask"].choices) == pixels.MASKS


@pytest.mark.parametrize(
    "spec", [s for s in OPTION_FLAGS if s.flag is not None], ids=lambda s: s.name
)
def test_each_option_round_trips_through_its_flag(spec):
    """``Options.flags()`` parsed by the CLI gives back the same ``Options``."""
    options = Options(**{spec.name: _sample(spec)})
    flags = options.flags()
    assert flags.split()[0] == spec.flag
    args = _parser().parse_args(["build", "src", "cache", "--masks", "m", *flags.split()])
    given = {s.name: getattr(args, s.name) for s in OPTION_FLAGS if s.flag is not None}
    assert Options(**given) == options


def test_the_defaults_have_no_flags_and_the_implied_mask_dtype_none():
    assert Options().flags() == ""
    assert Options(mask="uint8").flags() == ""
    assert Options(short_side=256, color="gray").flags() == "--short-side 256 --color gray"
