"""Decoding records of an existing cache again, into a generation published in its place.

``verify``'s repair calls ``redecode`` for the records it found bad: their new pixels are
appended to the data file as a refresh appends, with the ``Generation`` of ``mmcache._writer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from . import format as fmt
from ._files import extend_data_file
from ._generation import new_generation, write_generation
from ._layout import Layout, aligned, layout_offsets
from ._workers import decode_records
from ._writer import Generation, append_overflow, discarded_on_failure, publish
from .annotations import recorded_annotations
from .decode import Options
from .errors import CacheFormatError
from .reports import ProgressFn
from .scan import Listing
from .sources import SOURCES, carry_member_table
from .space import check_free_space, disk_bytes


class _NothingRepaired(Exception):
    """Raised inside ``redecode`` when no record decoded again: nothing is to be published."""


def redecode(
    files: fmt.CacheFiles,
    records: Iterable[int],
    workers: int | None = None,
    progress: ProgressFn | None = None,
) -> dict[int, str]:
    """Decode ``records`` of a cache again from its recorded source, and publish a generation
    in which they hold the new pixels; the caller holds the cache's writer lock.

    As a refresh does, the new pixels are appended to the data file and every other record
    stays where it is, so readers of the current generation are undisturbed and the previous
    record becomes garbage (``compact_cache`` drops it). A record whose source file is gone,
    changed since it was listed (the decoder checks its size and mtime) or no longer decodes
    keeps its old offset, pixels and checksum: the cache keeps its records and their order.
    Nothing is published when no record decoded again.

    Returns:
        Why each record that was not decoded again was not (empty when all were).
    """
    m = files.manifest
    n = len(files.index)
    todo = sorted(set(map(int, records)))
    if not todo:
        return {}
    try:
        options = Options.from_json(m.options)
    except (TypeError, ValueError) as e:
        raise CacheFormatError(f"{m.path / fmt.MANIFEST_NAME}: bad options ({e})") from None
    layout, start = _layout_after(files, todo)
    g = Generation(
        folder=m.path, gen=new_generation(), listing=_recorded_listing(files), layout=layout,
        state=files.state["state"].copy(), crcs=files.state["crc32"].copy(), messages={},
        overflow={}, reused=n - len(todo), todo=todo, data_gen=m.data_generation,
        appended_after=m.sizes["data"],
    )  # fmt: skip
    check_free_space(
        m.path,
        disk_bytes({**m.sizes, "data": layout.data_bytes - start}),
        advice="free some space there; the cache is unchanged (the repaired records are "
        "appended to its data file)",
    )
    failed: dict[int, str] = {}
    try:
        with discarded_on_failure(g):
            extend_data_file(g.data_path, layout.data_bytes)
            g.state[todo] = fmt.EMPTY
            g.record(decode_records(g.jobs(todo), g.data_path, options, workers, progress))
            for i in todo:
                if g.state[i] != fmt.FILLED:  # left as it was
                    failed[i] = g.messages.get(i) or fmt.BAD_REASONS[int(g.state[i])]
                    g.state[i] = files.state["state"][i]
                    g.crcs[i] = files.state["crc32"][i]
                    layout.offsets[i] = files.index["offset"][i]
            if len(failed) == len(todo):
                raise _NothingRepaired
            data_bytes = layout.data_bytes
            if g.overflow:  # the source now decodes to another size
                data_bytes = append_overflow(
                    g.data_path, g.overflow, layout, layout.offsets, data_bytes
                )
            index = files.index.copy()
            index["offset"] = layout.offsets
            index["height"], index["width"], index["channels"] = layout.shapes.T
            state = np.zeros(n, fmt.STATE_DTYPE)
            state["crc32"], state["state"] = g.crcs, g.state
            sizes = write_generation(
                g.folder, g.gen, index, state, files.paths_blob, data_bytes, g.data_gen,
                files.fields_blob,
            )
            created = datetime.now(timezone.utc).isoformat(timespec="seconds")
            manifest = fmt.Manifest(**{**vars(m), "generation": g.gen, "sizes": sizes,
                                       "members": carry_member_table(m, m.path, g.gen),
                                       "extra": {**m.extra, "created": created}})  # fmt: skip
            publish(files, manifest)
    except _NothingRepaired:
        pass
    return failed


def _recorded_listing(files: fmt.CacheFiles) -> Listing:
    """The listing a cache's records were made from, as its manifest and index record it."""
    m, n = files.manifest, len(files.index)
    listing = Listing(
        root=Path(m.source["root"]),
        kind=m.source.get("kind", "folder"),
        list_file=None,
        classes=list(m.classes),
        paths=[files.path(i) for i in range(n)],
        labels=files.index["label"].astype(np.int64),
        sizes=files.index["source_size"].astype(np.int64),
        mtimes=files.index["source_mtime_ns"].astype(np.int64),
        annotations=recorded_annotations(files),
    )
    # An archive's members: where the members file places them; a file lies at its path.
    listing.members = SOURCES[listing.kind].recorded(files)
    return listing


def _layout_after(files: fmt.CacheFiles, todo: list[int]) -> tuple[Layout, int]:
    """The cache's layout with the records ``todo`` moved after the current records, each on its
    own aligned start; and where the first of them starts."""
    m, n = files.manifest, len(files.index)
    shapes = fmt.record_shapes(files.index)
    offsets = files.index["offset"].astype(np.uint64)
    start = aligned(m.sizes["data"])
    moved, end = layout_offsets(fmt.record_nbytes(files.index, m.pixels, m.mask)[todo])
    offsets[todo] = moved + np.uint64(start)
    state = files.state["state"].copy()
    layout = Layout(shapes, offsets, start + end, state, np.zeros(n, np.int64), m.pixels, m.mask)
    return layout, start
