"""``BatchLoader``'s buffers and how one batch is filled: rings, views, draws, the fill path.

A ``Job`` is everything the filling threads of an iteration read (``mmcache._iteration`` runs
them). Every loader fills views (``Job.views``): one without ``views=`` (a crop, or each record
whole), several with it, each with a ring of its own. ``fill`` draws each view's boxes and
flips, then reads each record once for all its views, through one choice of how its bytes are
read (``record_bytes``), and its layout writes them into every view (``pixels.Layout.fill``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import cv2
import numpy as np
import torch

from . import pixels as px
from ._records import RecordReader
from ._targets import flip_target, resized_mask, resized_target
from .transforms import DRAWS, Crop, resize_into

if TYPE_CHECKING:  # (a type only: the loader hands it over, this module never makes one)
    from .sampler import ReadAhead

# Uniform numbers for boxes and flips come in blocks of this many positions, each block from
# its own generator keyed by (seed, epoch, rank, block): any batch is drawn without drawing the
# epoch before it, whatever the batch size or thread count.
DRAW_BLOCK = 1024


class Normalize:
    """``(x / 255 - mean) / std`` of uint8 N x H x W x C images into floats N x C x H x W, as
    one subtraction and one division of 0..255 values: the one normalisation of CPU and CUDA
    batches.

    Args:
        normalize: ``(mean, std)``, ``channels`` values each on the 0..1 scale, std > 0.
        channels: the images' channel count.
        dtype: the float type of the result (default ``torch.float32``).
    """

    def __init__(
        self,
        normalize: tuple[Sequence[float], Sequence[float]],
        channels: int,
        dtype: torch.dtype | None,
    ) -> None:
        mean, std = (np.asarray(v, np.float64).reshape(-1) for v in normalize)
        if len(mean) != channels or len(std) != channels or (std <= 0).any():
            raise ValueError(
                f"normalize must be (mean, std) of {channels} values each, std > 0, got "
                f"{normalize!r}"
            )
        self.dtype = dtype or torch.float32
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a float type, got {self.dtype}")
        self.mean = torch.tensor(mean * 255, dtype=self.dtype).view(1, -1, 1, 1)
        self.std = torch.tensor(std * 255, dtype=self.dtype).view(1, -1, 1, 1)
        self.on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, images: torch.Tensor, out: torch.Tensor | None, channels_last: bool
    ) -> torch.Tensor:
        """Normalise ``images`` into ``out`` (a float N x C x H x W buffer, in either memory
        layout), or into a new tensor on their device: in torch's ``channels_last`` memory
        format with ``channels_last``, else contiguous."""
        as_nchw = images.permute(0, 3, 1, 2)  # a view: the memory stays N x H x W x C
        if out is None:
            out = as_nchw.to(self.dtype)
        else:
            out.copy_(as_nchw)
        mean, std = self.constants(out.device)
        out.sub_(mean).div_(std)
        return out if channels_last or out.is_contiguous() else out.contiguous()

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std (times 255) on ``device``, copied there once."""
        constants = self.on_device.get(device)
        if constants is None:
            constants = self.on_device[device] = (self.mean.to(device), self.std.to(device))
        return constants


def output(
    images: torch.Tensor,
    normalize: Normalize | None,
    channels_last: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 N x H x W x C ``images`` as the loader hands them out: normalised (into ``out``
    when given), or with ``channels_last`` as an N x C x H x W view, or as they are."""
    if normalize is not None:
        return normalize(images, out, channels_last)
    return images.permute(0, 3, 1, 2) if channels_last else images


class Ring:
    """The batch buffers: uint8 images and labels, and (CPU normalisation) float images.

    Each slot is a tensor of its own, not a view of one ring: autograd checks that a tensor it
    saved for the backward pass was not written since, by a version count that all views of a
    tensor share, so refilling one slot must not touch the version of the batch being trained
    on.
    """

    def __init__(
        self,
        slots: int,
        batch_size: int,
        shape: tuple[int, int, int],
        pin_memory: bool,
        normalize: Normalize | None,
        channels_last: bool,
        mask: str | None = None,
        fields: Sequence[str] = (),
    ) -> None:
        self.shape = shape
        # Annotated caches: each slot's N x H x W masks, and its samples' other fields (rows
        # of boxes, labels...: a list of dicts, one per sample, replaced each fill).
        self.masks = (
            [torch.from_numpy(np.empty((batch_size, *shape[:2]), np.dtype(mask)))
             for _ in range(slots)]
            if mask is not None
            else None
        )  # fmt: skip
        if self.masks is not None and pin_memory:
            self.masks = [m.pin_memory() for m in self.masks]
        self.fields = tuple(fields)
        self.targets: list[list[dict[str, Any]]] = [[] for _ in range(slots)]
        if pin_memory:
            self.images = [
                torch.empty((batch_size, *shape), dtype=torch.uint8, pin_memory=True)
                for _ in range(slots)
            ]
            self.labels = [
                torch.empty(batch_size, dtype=torch.int64).pin_memory() for _ in range(slots)
            ]
        else:
            # numpy's allocator asks for transparent huge pages on large arrays: the first
            # touch of a 50 MB slot faults 25 huge pages instead of 12,000 small ones.
            self.images = [
                torch.from_numpy(np.empty((batch_size, *shape), np.uint8)) for _ in range(slots)
            ]
            self.labels = [torch.from_numpy(np.empty(batch_size, np.int64)) for _ in range(slots)]
        self.floats: list[torch.Tensor] | None = None
        if normalize is not None:
            height, width, channels = shape
            if channels_last:  # N x C x H x W views of N x H x W x C memory
                self.floats = [
                    torch.empty((batch_size, height, width, channels), dtype=normalize.dtype)
                    .permute(0, 3, 1, 2)
                    for _ in range(slots)
                ]  # fmt: skip
            else:
                self.floats = [
                    torch.empty((batch_size, channels, height, width), dtype=normalize.dtype)
                    for _ in range(slots)
                ]
        self.normalize, self.channels_last = normalize, channels_last
        self.pinned = pin_memory

    def claim(self, slot: int) -> None:
        """Make slot ``slot`` safe to refill (CPU batches): each of its buffers that a batch
        handed out still uses (the caller kept it, or a view of it) is replaced by a new one,
        so what the caller holds stays as it was. Pinned buffers are always replaced, from
        torch's caching host allocator, which hands a block out again only once the
        asynchronous copies from it have finished."""
        for buffers in (self.images, self.labels, self.floats, self.masks):
            if buffers is not None:
                renew(buffers, slot, self.pinned)

    def output(self, slot: int, n: int) -> torch.Tensor:
        """Slot ``slot``'s first ``n`` images as the loader hands them out (CPU)."""
        floats = self.floats[slot][:n] if self.floats is not None else None
        return output(self.images[slot][:n], self.normalize, self.channels_last, floats)

    @property
    def annotated(self) -> bool:
        return self.masks is not None or bool(self.fields)

    def target(self, slot: int, n: int) -> Any:
        """The labels of slot ``slot``'s first ``n`` samples, or, from an annotated cache, a
        dict: ``"mask"`` (N x H x W) and each field as a list of N tensors."""
        if not self.annotated:
            return self.labels[slot][:n]
        target: dict[str, Any] = {}
        if self.masks is not None:
            target["mask"] = self.masks[slot][:n]
        for name in self.fields:
            target[name] = [torch.from_numpy(t[name]) for t in self.targets[slot][:n]]
        return target


# How many users a tensor's storage has (each tensor and view over it, the Python storage
# object made to ask): torch has no public name for it, and builds before 2.5 without CUDA
# lack it, where every slot is taken for in use (a new buffer per batch: correct, slower).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _uses(tensor: torch.Tensor) -> int:
    assert _storage_use_count is not None
    return int(_storage_use_count(tensor.untyped_storage()._cdata))


# The count of a tensor nothing else uses, measured rather than assumed (torch's to define).
_UNUSED = None if _storage_use_count is None else _uses(torch.empty(1))


def in_use(tensor: torch.Tensor) -> bool:
    """Whether anything but ``tensor`` itself uses its memory (a batch handed out, a view or
    numpy array of it)."""
    return _UNUSED is None or _uses(tensor) > _UNUSED


def renew(buffers: list[torch.Tensor], slot: int, pinned: bool) -> None:
    """Replace ``buffers[slot]`` by a new buffer of its shape, strides and type if it is in
    use or pinned (see ``Ring.claim``)."""
    old = buffers[slot]
    if pinned or in_use(old):
        buffers[slot] = torch.empty_strided(
            old.shape, old.stride(), dtype=old.dtype, pin_memory=pinned
        )


class View(NamedTuple):
    """One output of every record: a ring of its own."""

    crop: Crop | None  # None: each record copied whole (they all have the ring's shape)
    ring: Ring
    key: tuple[int, ...]  # of its boxes' and flips' numbers: (seed, epoch, rank[, view])


@dataclass
class Job:
    """What the filling threads of one iteration read (only ``fd`` changes: closed at the end).

    Attributes:
        order: the record indices of the iteration, in order.
        batch_size: records per batch (the last batch may hold fewer).
        ahead: CPU: batches filled ahead of the one the consumer holds (the ring has two slots
            more: the batch held and the one before it, which a ``for`` loop's variable still
            references while it asks for the next); CUDA: device batches ready and not yet
            taken, at most.
        views: what each record is written into: one ``View`` (its crop, or None to copy
            each record whole), or one per view with ``views=``.
        listed: batches hand out a list of one batch per view (``views=``).
        device: where batches go.
        normalize: the normalisation of CUDA batches (CPU ones are normalised by the ring).
        channels_last: the memory format of the batches handed out.
        reader: the records.
        mapping: the data file's mapping, a flat uint8 array (None for an empty order).
        mapped: copy records out of ``mapping`` (else read them with ``pread``).
        read_ahead: the sampler's ``ReadAhead`` to tell how far the threads got, or None.
        fd: a descriptor of the data file advised for random reads, or -1 (see
            ``random_reader``).
        flip: mirror each image with probability 1/2.
        params: with ``views``, a list per slot of an N x 5 int64 buffer per view for its
            boxes and flips (``transforms.PARAMS``), or None.
    """

    order: np.ndarray
    batch_size: int
    ahead: int
    views: list[View]
    listed: bool
    device: torch.device
    normalize: Normalize | None
    channels_last: bool
    reader: RecordReader
    mapping: np.ndarray | None
    mapped: bool
    read_ahead: ReadAhead | None
    fd: int
    flip: bool
    params: list[list[torch.Tensor]] | None = None

    @property
    def ring(self) -> Ring:
        """The first view's ring, which holds the labels and targets."""
        return self.views[0].ring

    @property
    def count(self) -> int:
        """Batches in the iteration."""
        return -(-len(self.order) // self.batch_size)


class Scratch:
    """A filling thread's reusable buffers, by name: rows read with pread, the uniform
    numbers of boxes and flips, the planes of I420 crops."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}

    def take(self, name: str, nbytes: int) -> np.ndarray:
        buf = self.buffers.get(name)
        if buf is None or buf.size < nbytes:  # grows to the largest record once, then reused
            buf = self.buffers[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]


def uniforms(draws: tuple[int, ...], first: int, n: int, scratch: Scratch) -> np.ndarray:
    """The ``DRAWS`` uniform numbers of positions ``first .. first + n - 1`` of the epoch,
    drawn into the thread's scratch buffer."""
    blocks = range(first // DRAW_BLOCK, (first + n - 1) // DRAW_BLOCK + 1)
    numbers = scratch.take("numbers", len(blocks) * DRAW_BLOCK * DRAWS * 8).view(np.float64)
    numbers = numbers.reshape(len(blocks) * DRAW_BLOCK, DRAWS)
    for k, block in enumerate(blocks):
        rng = np.random.default_rng([*draws, block])
        rng.random(out=numbers[k * DRAW_BLOCK : (k + 1) * DRAW_BLOCK])
    start = first - blocks[0] * DRAW_BLOCK
    return numbers[start : start + n]


def draw(
    crop: Crop | None,
    flip: bool,
    draws: tuple[int, ...],
    shapes: np.ndarray,
    first: int,
    scratch: Scratch,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The crop boxes and flips of the records of ``shapes`` at positions ``first ...`` of an
    epoch (None for what is not asked).

    Raises:
        ValueError: the crop gave boxes that are not one per record inside its image.
    """
    if crop is None and not flip:
        return None, None
    numbers = uniforms(draws, first, len(shapes), scratch)
    flips = (numbers[:, -1] < 0.5) if flip else None
    boxes = None
    if crop is not None:
        boxes = checked_boxes(crop, crop.boxes(shapes, numbers[:, : crop.draws]), shapes)
    return boxes, flips


def checked_boxes(crop: Crop, boxes: np.ndarray, shapes: np.ndarray) -> np.ndarray:
    """``boxes`` as an N x 4 int64 array, if each is inside its record: a box past the edge
    would be read from the bytes of the next record (or past the data file's end) without an
    error, so a crop of one's own that gets one wrong is stopped here (a few array operations
    a batch, whatever the crop)."""
    found = np.asarray(boxes)
    if found.shape != (len(shapes), 4) or not np.issubdtype(found.dtype, np.integer):
        raise ValueError(
            f"{crop!r}.boxes gave an array of {found.dtype} {found.shape} for {len(shapes)} "
            "records: it must give an N x 4 int array (top, left, height, width)"
        )
    found = found.astype(np.int64, copy=False)
    top, left, height, width = found.T
    inside = (top >= 0) & (left >= 0) & (height >= 1) & (width >= 1)
    inside &= (top + height <= shapes[:, 0]) & (left + width <= shapes[:, 1])
    if not inside.all():
        j = int(np.flatnonzero(~inside)[0])
        raise ValueError(
            f"{crop!r}.boxes gave the box (top, left, height, width) {found[j].tolist()} for "
            f"an image of {int(shapes[j, 0])} x {int(shapes[j, 1])}: a box must lie inside its "
            "image, at least 1 x 1"
        )
    return found


class Record(NamedTuple):
    """One record of a batch, as a filling thread reads it."""

    cache_index: int  # its index in the cache
    offset: int  # where it starts in the data file
    shape: np.ndarray  # (height, width, channels)
    filled: bool  # it holds its pixels (else the reader reads it: it fills or raises)


def fill(
    job: Job, slot: int, number: int, stopped: Callable[[], bool], scratch: Scratch
) -> int | None:
    """Fill ring slot ``slot`` of every view with batch ``number``: each view's boxes and
    flips drawn under its own key, then each record read once (the rows all its boxes span)
    and written into every view by its layout. Its count, or None if ``stopped()`` says
    stop."""
    first = number * job.batch_size
    indices = job.order[first : first + job.batch_size]
    n = len(indices)
    reader, records = job.reader, job.reader.records
    # A data file cut short since it was mapped would kill the process with SIGBUS at the
    # first page past its end: checked before each batch (one fstat), and a batch that finds it
    # cut short is read with pread, which raises the reader's CacheFormatError for the records
    # past the end. Left: a truncation during the batch's copies (see BatchLoader's ``read``).
    mapped = job.mapped and not reader.cut_short()
    np.take(records.labels, indices, out=job.ring.labels[slot][:n].numpy())
    filled = reader.filled(indices)
    offsets = records.offsets[indices].tolist()
    shapes = records.shapes[indices]
    drawn = [draw(view.crop, job.flip, view.key, shapes, first, scratch) for view in job.views]
    if job.params is not None:
        for (drawn_boxes, flips), params in zip(drawn, job.params[slot]):
            assert drawn_boxes is not None  # params are asked for with views, which all crop
            params[:n, :4] = torch.from_numpy(drawn_boxes)
            params[:n, 4] = torch.from_numpy(flips) if flips is not None else 0
    # Without crops every record is copied whole (they share the ring's shape).
    cropped = None
    if job.views[0].crop is not None:
        cropped = [b.tolist() for b, _ in drawn if b is not None]
    outs = [view.ring.images[slot].numpy() for view in job.views]
    resizes = [resizer(view.crop) for view in job.views]
    layout, color, annotated = reader.layout, reader.color, job.ring.annotated
    # One slice copy (or one resize) per record and view, each releasing the GIL (np.take over
    # a strided 2-D view of the mapping was slower for records of a megabyte).
    for j, offset in enumerate(offsets):
        if stopped():
            return None
        record = Record(int(indices[j]), offset, shapes[j], bool(filled[j]))
        read = record_bytes(job, mapped, record, scratch)
        boxes = None if cropped is None else [view_boxes[j] for view_boxes in cropped]
        layout.fill(read, record.shape, boxes, [out[j] for out in outs], resizes, scratch.take,
                    color)  # fmt: skip
        for (_, flips), out in zip(drawn, outs):
            if flips is not None and flips[j]:
                cv2.flip(out[j], 1, dst=out[j])
        if annotated:  # (one view: a loader with views refuses annotated caches)
            flipped = drawn[0][1] is not None and bool(drawn[0][1][j])
            fill_target(job, read, record, boxes[0] if boxes else None, flipped, slot, j)
    return n


def resizer(crop: Crop | None) -> px.Resize:
    """How a view's boxes are resized into its slot: with its crop's kernel."""
    kernel = crop.kernel if crop is not None else ("bilinear", True)  # (no crop: no box)

    def resize(src: np.ndarray, dst: np.ndarray) -> None:
        resize_into(torch.from_numpy(src), torch.from_numpy(dst), *kernel)

    return resize


def record_bytes(job: Job, mapped: bool, record: Record, scratch: Scratch) -> px.Read:
    """How a filling thread reads ``record``'s bytes, chosen once for the record: an empty
    (lazy) or unchecked record through the reader, which fills it, checks it or raises its
    error; else a view of the mapping (``mapped``: the mapping was checked for this batch);
    else ``pread`` into the buffer the layout asks for."""
    if not record.filled:
        flat = px.flat_bytes(job.reader.stored(record.cache_index))
        return lambda start, n, into: flat[start : start + n]
    if mapped:
        assert job.mapping is not None  # mapped: the order is not empty
        mapping, base = job.mapping, record.offset
        return lambda start, n, into: mapping[base + start : base + start + n]

    def read(start: int, n: int, into: str | np.ndarray) -> np.ndarray:
        out = scratch.take(into, n) if isinstance(into, str) else into
        pread(job, record, out, start)
        return out

    return read


def fill_target(
    job: Job,
    read: px.Read,
    record: Record,
    box: list[int] | None,
    flipped: bool,
    slot: int,
    j: int,
) -> None:
    """Sample ``j``'s target in slot ``slot``: its mask cropped (nearest) into the slot's masks
    and its fields' rows (boxes scaled and clipped, dropped rows gone) with the image's box
    and flip, as ``mmcache.transforms`` moves them per sample."""
    ring = job.ring
    height, width = int(record.shape[0]), int(record.shape[1])
    size = ring.shape[:2]
    if ring.masks is not None:
        out = ring.masks[slot][j].numpy()
        mask_dtype = job.reader.manifest.mask
        assert mask_dtype is not None  # the ring has masks: the cache's records carry them
        mask = px.read_mask(read, job.reader.layout, record.shape, mask_dtype)
        if box is None:
            out[...] = mask
        else:
            resized_mask(mask, box, size, out=out)
        if flipped:
            cv2.flip(out, 1, dst=out)
    if ring.fields:
        files = job.reader.files
        target = {name: files.field_rows(name, record.cache_index) for name in ring.fields}
        if box is not None:
            target = resized_target(target, box, (height, width), size)
        if flipped:
            target = flip_target(target, size[1])
        targets = ring.targets[slot]
        if j == 0:
            targets.clear()
        targets.append(target)


def pread(job: Job, record: Record, out: np.ndarray, start: int = 0) -> None:
    """Read ``out.nbytes`` of ``record`` from byte ``start`` of it on: through the iteration's
    own descriptor when it has one, else (or on a short read, so that the error is the
    reader's) through the reader."""
    if job.fd < 0 or os.preadv(job.fd, [out.data], record.offset + start) != out.nbytes:
        job.reader.read_into(record.cache_index, out, start)


def param_buffers(
    slots: int, views: int, batch_size: int, pin_memory: bool
) -> list[list[torch.Tensor]]:
    """Per slot, an N x 5 int64 buffer per view for its boxes and flips."""
    return [
        [torch.empty((batch_size, 5), dtype=torch.int64, pin_memory=pin_memory)
         for _ in range(views)]
        for _ in range(slots)
    ]  # fmt: skip


