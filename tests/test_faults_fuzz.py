"""Fuzzed manifests, indexes, states and paths: the readers raise documented errors only."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from _faults import (
    FUZZ,
    PRISTINE_FILES,
    cache_file,
    copy_pristine,
    open_and_read_all,
)
from conftest import reference, reseal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache import (
    CacheError,
    verify_cache,
)
from mmcache import format as fmt

fuzz_settings = settings(
    max_examples=FUZZ,
    deadline=None,
    database=None,  # no .hypothesis folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# --- fuzzing the readers ----------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def _only_documented_errors(cache: Path, pristine: Path) -> str:
    """Open and read everything as a training job would, then verify against the source;
    any exception but a CacheError fails the test. Returns "refused" (a CacheError), "found"
    (served, but ``verify --source all`` names bad records) or "accepted": then every record
    served must hold exactly the pixels of its source file, decoded here by the reference."""
    try:
        fmt.open_cache(cache)
        images = open_and_read_all(cache)
        report = verify_cache(cache, source="all")
    except CacheError:
        return "refused"
    if not report.ok:
        return "found"
    src = pristine.parent / "src"
    assert len(images) == len(PRISTINE_FILES)
    for img, name in zip(images, PRISTINE_FILES, strict=True):
        assert np.array_equal(img, reference(src / name)), name
    return "accepted"


def _fuzzed(tally: Counter, what: str, outcome: str) -> None:
    tally["inputs fuzzed"] += 1
    tally[f"inputs fuzzed: {what}: {outcome}"] += 1


@pytest.fixture
def scratch(tmp_path) -> Path:
    return tmp_path / "fuzz"


def _key_paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _key_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _key_paths(v, (*prefix, i))


@fuzz_settings
@given(data=st.data())
def test_fuzz_manifest_values(pristine, scratch, tally, data):
    """Any value of the manifest replaced or deleted, then resealed as a forger would."""
    cache = copy_pristine(pristine, scratch)
    m = json.loads((cache / "manifest.json").read_text())
    paths = [p for p in _key_paths(m) if p and p[0] != "checksums"]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        parent = m
        try:
            for k in where[:-1]:
                parent = parent[k]
            if data.draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(where[-1], None)
            else:
                parent[where[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this path
    (cache / "manifest.json").write_text(json.dumps(m))
    if data.draw(st.booleans()):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            reseal(cache)
    _fuzzed(tally, "manifest values", _only_documented_errors(cache, pristine))


@fuzz_settings
@given(raw=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
def test_fuzz_manifest_bytes(pristine, scratch, tally, raw):
    cache = copy_pristine(pristine, scratch)
    (cache / "manifest.json").write_bytes(raw)
    outcome = _only_documented_errors(cache, pristine)
    assert outcome == "refused"  # no random bytes or JSON are a valid manifest
    _fuzzed(tally, "manifest bytes", outcome)


FIELDS = [(name, fmt.INDEX_DTYPE.fields[name][0]) for name in fmt.INDEX_DTYPE.names]
EDGES = [0, 1, 2, 63, 64, 65, 255, 2**20, 2**20 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**53 + 1]


@fuzz_settings
@given(data=st.data())
def test_fuzz_index_state_and_paths(pristine, scratch, tally, data):
    """Fields of the index and state set to edge values, bytes of the paths overwritten; the
    checksums resealed, so that the structural checks alone stand between them and a reader."""
    cache = copy_pristine(pristine, scratch)
    files = fmt.open_cache(cache)
    index, state = files.index.copy(), files.state.copy()
    blob = bytearray(files.paths_blob)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(["index", "state", "paths"]))
        if target == "paths":
            if blob:
                pos = data.draw(st.integers(0, len(blob) - 1))
                blob[pos] = data.draw(st.sampled_from(b"/.\\\x00\xff\xc3a"))
            continue
        arr = index if target == "index" else state
        i = data.draw(st.integers(0, len(arr) - 1))
        name = data.draw(st.sampled_from(arr.dtype.names))
        dtype = arr.dtype.fields[name][0]
        info = np.iinfo(dtype)
        value = data.draw(st.sampled_from(EDGES) | st.integers(info.min, info.max))
        if data.draw(st.booleans()):
            value += int(arr[name][i])  # near the true value: past the end by a little
        arr[name][i] = value if info.min <= value <= info.max else info.max
    index.tofile(cache_file(cache, "index"))
    state.tofile(cache_file(cache, "state"))
    cache_file(cache, "paths").write_bytes(bytes(blob))
    reseal(cache)
    _fuzzed(tally, "index, state, paths", _only_documented_errors(cache, pristine))
