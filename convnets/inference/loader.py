"""From ``(input, error)`` items to decoded batches (:class:`Decoding`: how), and to per-input results.

:func:`map_batches` is the loop predict and embed share. Batches keep an uninterrupted run's boundaries
(:func:`iter_chunks`) and are decoded here, on threads (``workers=0``), or whole in the processes of a
:class:`~torch.utils.data.DataLoader`: the same tensors, bit for bit, in input order, at most
``PREFETCH * workers`` batches ahead (so a slow ``--from-file -`` pipe delays finished batches).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from PIL import Image

from convnets.constants import DEFAULT_TIMEOUT
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inference.inputs import InputItem as Item
from convnets.preprocessing.io import is_url
from convnets.preprocessing.pipeline import prepare_batch, thumbnail_of
from convnets.preprocessing.presets import EvalPreset
from convnets.runtime import check_workers, init_worker

__all__ = ["PREFETCH", "DecodedBatch", "Decoding", "Result", "decode", "iter_batches", "iter_chunks", "map_batches"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Decoding:
    """How inputs become tensors: one object from the command line (or a caller) to :func:`decode`.

    Attributes:
        preset: the preprocessing; ``None``: the model's, filled in by :meth:`with_preset`.
        timeout: total seconds allowed for each URL download.
        workers: decoding processes (0: here, on threads); ``None``: :func:`convnets.runtime.default_workers`.
        allow_private: download URLs from loopback, private or link-local addresses.
        fast_decode: decode large JPEGs at a reduced DCT scale first.
        thumbnail: also keep each decoded input as a thumbnail fitting this square (``predict --show``).
    """

    preset: EvalPreset | None = None
    timeout: float = DEFAULT_TIMEOUT
    workers: int | None = 0
    allow_private: bool = True
    fast_decode: bool = False
    thumbnail: int | None = None

    def with_preset(self, preset: EvalPreset) -> Decoding:
        """This decoding with ``preset`` (the model's, sized as asked)."""
        return replace(self, preset=preset)

    def for_device(self, device: torch.device | str) -> Decoding:
        """This decoding with ``workers`` set: the default for ``device`` when it was ``None``."""
        from convnets.runtime import default_workers

        return self if self.workers is not None else replace(self, workers=default_workers(torch.device(device).type))


class Result:
    """The base of predict's and embed's per-input results: the input, and why it could not be read."""

    input: str
    error: ImageLoadError | None

    @property
    def ok(self) -> bool:
        """Whether the input was read and computed."""
        return self.error is None

#: Batches each worker process decodes ahead (DataLoader's ``prefetch_factor``).
PREFETCH = 2


def iter_chunks(items: Iterable[Item], batch_size: int, start: int = 0) -> Iterator[list[Item]]:
    """``items`` in batches of ``batch_size``, lazily; the first is shortened by ``start`` (inputs of the run
    before ``items``), so that each image is in the uninterrupted run's batch and gives the same numbers."""
    stream = iter(items)
    first = batch_size - start % batch_size
    while chunk := list(itertools.islice(stream, first or batch_size)):
        first = 0
        yield chunk


@dataclass(frozen=True)
class DecodedBatch:
    """One batch decoded: its items, the tensor of those that decoded, each row's position in ``items``,
    and by position the errors and thumbnails."""

    items: list[Item]
    tensor: torch.Tensor
    rows: list[int]
    errors: dict[int, ImageLoadError]
    thumbnails: dict[int, Image.Image] = field(default_factory=dict)

    def pin_memory(self) -> DecodedBatch:
        """The batch with its tensor in page-locked memory."""
        return replace(self, tensor=self.tensor.pin_memory())

    def to(self, device: torch.device) -> DecodedBatch:
        """The batch with its tensor on ``device`` (non-blocking from pinned memory)."""
        if self.tensor.device == device:
            return self
        return replace(self, tensor=self.tensor.to(device, non_blocking=self.tensor.is_pinned()))


@dataclass(frozen=True)
class _Decoder:
    """A map-style dataset whose "indices" are the chunks themselves: the main process reads the inputs, the
    workers only decode."""

    decoding: Decoding

    def __getitems__(self, chunk: list[Item]) -> DecodedBatch:
        return decode(chunk, self.decoding, in_worker=torch.utils.data.get_worker_info() is not None)

    def __getitem__(self, item: Item) -> DecodedBatch:  # the Dataset protocol; batches use __getitems__
        return self.__getitems__([item])


def decode(chunk: list[Item], decoding: Decoding, *, in_worker: bool = False) -> DecodedBatch:
    """Decode and preprocess one batch on the CPU (``decoding`` with a preset); unreadable inputs become ``errors``.

    In a worker process (``in_worker``) local files get one thread, URLs several (they wait on the network).
    """
    readable = [i for i, (_, error) in enumerate(chunk) if error is None]
    names = [chunk[i][0] for i in readable]
    threads = 1 if in_worker and not any(is_url(name) for name in names) else None
    thumbnails: dict[int, Image.Image] = {}
    size = decoding.thumbnail

    def keep(pos: int, image: Image.Image) -> None:  # the image the tensor is made from: read once
        if size:
            thumbnails[readable[pos]] = thumbnail_of(image, size)
    batch = prepare_batch(names, on_error="collect", preset=decoding.preset, timeout=decoding.timeout,
                          workers=threads, allow_private=decoding.allow_private, fast_decode=decoding.fast_decode,
                          on_image=keep if size else None)
    errors = {i: error for i, (_, error) in enumerate(chunk) if error is not None}
    errors.update({readable[pos]: error for pos, error in batch.errors})
    return DecodedBatch(chunk, batch.tensor, [readable[pos] for pos in batch.indices], errors, thumbnails)


def _identity(batch: Any) -> Any:
    return batch


def iter_batches(items: Iterable[Item], *, batch_size: int, decoding: Decoding | None = None,
                 preset: EvalPreset | None = None, timeout: float = DEFAULT_TIMEOUT, workers: int | None = 0,
                 device: torch.device | str = "cpu", start: int = 0) -> Iterator[DecodedBatch]:
    """Decoded batches of ``items``, in input order, on ``device`` (on CUDA through pinned memory); ``decoding``
    (default: ``Decoding(preset, timeout, workers)``) must have a preset; ``start``: as for :func:`iter_chunks`."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not isinstance(start, int) or start < 0:
        raise InvalidArgumentError(f"start must be a non-negative integer, got {start!r}")
    device = torch.device(device)
    decoding = (decoding or Decoding(preset=preset, timeout=timeout, workers=workers)).for_device(device)
    workers = check_workers(decoding.workers)
    if decoding.preset is None:
        raise InvalidArgumentError("decoding needs a preset (the model's: convnets.preset_for_model)")
    pin = device.type == "cuda"
    chunks = iter_chunks(items, batch_size, start)
    decoder = _Decoder(decoding)
    if workers == 0:
        for chunk in chunks:
            batch = decoder.__getitems__(chunk)
            yield (batch.pin_memory() if pin else batch).to(device)
        return
    # The chunks are the batch sampler (DataLoader pulls PREFETCH * workers ahead); the decoder returns the batch.
    loader: Any = torch.utils.data.DataLoader(decoder, batch_sampler=chunks,  # type: ignore[arg-type]
                                              num_workers=workers, collate_fn=_identity, pin_memory=pin,
                                              prefetch_factor=PREFETCH, worker_init_fn=init_worker)
    log.debug("decoding in %d worker processes", workers)
    for batch in loader:
        yield batch.to(device)


def map_batches(compute: Callable[[torch.Tensor], Iterable[T]], items: Iterable[Item], *, batch_size: int,
                decoding: Decoding, device: torch.device | str = "cpu", start: int = 0,
                on_batch: Callable[[int], None] | None = None,
                ) -> Iterator[tuple[str, T | None, ImageLoadError | None, Image.Image | None]]:
    """The loop of predictions and embeddings: decode each batch, ``compute`` one value per row of its tensor
    (under ``torch.inference_mode``); yields ``(input, value, error, thumbnail)`` per input, ``None`` where absent."""
    for batch in iter_batches(items, batch_size=batch_size, decoding=decoding, device=device, start=start):
        values: dict[int, T] = {}
        if batch.rows:
            with torch.inference_mode():
                values = dict(zip(batch.rows, compute(batch.tensor)))
        for i, (name, _) in enumerate(batch.items):
            yield name, values.get(i), batch.errors.get(i), batch.thumbnails.get(i)
        if on_batch is not None:
            on_batch(len(batch.items))
