"""From a stream of ``(input, error)`` items to decoded batches, and from batches to per-input results.

Used by :mod:`convnets.inference.predict` and :mod:`convnets.inference.embed`: both run
:func:`map_batches` (decode a batch, compute on its tensor, hand back one value or error per input)
and their results share :class:`Result`. How inputs are decoded is one setting, :class:`Decoding`
(preprocessing preset, download timeout, worker processes, private addresses allowed, fast JPEG decoding), carried unchanged from the command
line through :mod:`convnets.inference.job` and the library to :func:`decode`.

The main process reads the items (a
listing, a directory walk, a list file: any iterable, read lazily) and cuts them into batches of
``batch_size`` with the boundaries of an uninterrupted run (:func:`iter_chunks`); decoding and
preprocessing each batch (:func:`~convnets.preprocessing.pipeline.prepare_batch`, the model's
:class:`~convnets.preprocessing.presets.EvalPreset`) happens

* with ``workers=0`` in the calling process, on a thread pool per batch, while the model waits;
* with ``workers=N`` in N worker processes of a PyTorch :class:`~torch.utils.data.DataLoader`, so
  that the next batches are decoded while the model runs on this one. Each worker decodes a whole
  batch, single-threaded (with threads for URLs, which wait on the network), so the tensors are
  the ones ``workers=0`` gives, bit for bit. Batches come back in input order; at most
  ``prefetch * N`` batches are in flight, so memory does not grow with the number of inputs.

On CUDA the batch is put in pinned memory and copied with ``non_blocking=True``.

With workers, the main process reads the inputs ``PREFETCH * workers + 1`` batches ahead of the
batch it hands out (DataLoader asks for the next batch's inputs before returning one): an input
source that blocks (``--from-file -`` fed slowly through a pipe) delays finished batches until
more inputs arrive or the source ends. ``workers=0`` reads exactly one batch ahead.
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
        preset: the preprocessing (crop, resize, normalisation); ``None``: the model's, filled in
            by whoever knows the model (:meth:`with_preset`).
        timeout: total seconds allowed for each URL download.
        workers: decoding processes (0: decode in this process, on threads, between model calls);
            ``None``: the default for the device (:func:`convnets.runtime.default_workers`).
        allow_private: download URLs whose host is a loopback, private or link-local address (the
            default, as upstream); ``False`` refuses them (``--deny-private-urls``), for URL lists
            that come from someone else.
        fast_decode: decode large JPEGs at a reduced DCT scale first (``--fast-decode``; see
            :func:`~convnets.preprocessing.pipeline.prepare_batch`); default: the exact preprocessing.
        thumbnail: also keep each decoded input as a thumbnail fitting this square, in pixels
            (:func:`~convnets.preprocessing.pipeline.thumbnail_of`), for contact sheets
            (``predict --show``); ``None`` (default): keep none.
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
    """What :mod:`convnets.inference.predict` and :mod:`convnets.inference.embed` yield per input (their
    dataclasses add the computed value): the input, and why it could not be read, if it could not."""

    input: str
    error: ImageLoadError | None

    @property
    def ok(self) -> bool:
        """Whether the input was read and computed."""
        return self.error is None

#: Batches each worker process decodes ahead (DataLoader's ``prefetch_factor``).
PREFETCH = 2


def iter_chunks(items: Iterable[Item], batch_size: int, start: int = 0) -> Iterator[list[Item]]:
    """``items`` cut into batches of ``batch_size``, read lazily.

    Args:
        items: the inputs in order.
        batch_size: inputs per batch.
        start: how many inputs of the whole run come before ``items`` (a resumed run's skipped
            ones): the first batch is shortened so that batches keep the boundaries of the
            uninterrupted run (multiples of ``batch_size``), and each image is computed in the
            same batch, giving the same numbers.
    """
    stream = iter(items)
    first = batch_size - start % batch_size
    while chunk := list(itertools.islice(stream, first or batch_size)):
        first = 0
        yield chunk


@dataclass(frozen=True)
class DecodedBatch:
    """One batch of inputs, decoded.

    Attributes:
        items: the batch's ``(input, error)`` items in order.
        tensor: ``[len(rows), 3, H, W]`` float32, the inputs that decoded.
        rows: for each row of ``tensor``, its position in ``items``.
        errors: position in ``items`` -> why that input could not be read.
        thumbnails: position in ``items`` -> its thumbnail (with :attr:`Decoding.thumbnail`).
    """

    items: list[Item]
    tensor: torch.Tensor
    rows: list[int]
    errors: dict[int, ImageLoadError]
    thumbnails: dict[int, Image.Image] = field(default_factory=dict)

    def pin_memory(self) -> DecodedBatch:
        """The batch with its tensor in page-locked memory (DataLoader calls this with ``pin_memory``)."""
        return replace(self, tensor=self.tensor.pin_memory())

    def to(self, device: torch.device) -> DecodedBatch:
        """The batch with its tensor on ``device`` (non-blocking from pinned memory)."""
        if self.tensor.device == device:
            return self
        return replace(self, tensor=self.tensor.to(device, non_blocking=self.tensor.is_pinned()))


@dataclass(frozen=True)
class _Decoder:
    """Decodes one batch: a map-style dataset whose "indices" are the batches themselves.

    The batch sampler is the stream of chunks, so the main process reads the inputs and the
    workers only decode; ``__getitems__`` takes a whole chunk and returns its :class:`DecodedBatch`.
    """

    decoding: Decoding

    def __getitems__(self, chunk: list[Item]) -> DecodedBatch:
        return decode(chunk, self.decoding, in_worker=torch.utils.data.get_worker_info() is not None)

    def __getitem__(self, item: Item) -> DecodedBatch:  # the Dataset protocol; batches use __getitems__
        return self.__getitems__([item])


def decode(chunk: list[Item], decoding: Decoding, *, in_worker: bool = False) -> DecodedBatch:
    """Decode and preprocess one batch on the CPU; unreadable inputs become ``errors``.

    Args:
        chunk: the batch's items; those with an error are not read.
        decoding: the preset (required here), the download timeout and whether private addresses
            may be downloaded from.
        in_worker: running in a decoding process: one thread for local files (the processes are
            the parallelism), threads for URLs (they wait on the network).
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
    """Decoded batches of ``items``, in input order, on ``device``.

    Args:
        items: ``(input, error)`` pairs in order, read lazily.
        batch_size: inputs per batch.
        decoding: how to decode (its preset is required; the tensors are bit-identical whatever
            its ``workers`` is); default: ``Decoding(preset, timeout, workers)``.
        preset, timeout, workers: the fields of ``decoding`` when it is not given.
        device: where the batches' tensors go; on CUDA through pinned memory, without blocking.
        start: as for :func:`iter_chunks`.

    Raises:
        InvalidArgumentError: ``batch_size`` is not a positive integer, ``start`` or ``workers`` not
            a non-negative one (on the first ``next``).
    """
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
    # batch_sampler: the chunks themselves (any iterable; DataLoader pulls prefetch * workers of
    # them ahead, no more). collate_fn: the decoder already returns the batch.
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
    """The library loop of predictions and embeddings: decode each batch, ``compute`` on its tensor.

    Args:
        compute: from a decoded batch tensor ``[R, 3, H, W]`` to one value per row (run under
            ``torch.inference_mode``; not called for a batch of which no input could be read).
        items: ``(input, error)`` pairs in order; those with an error are reported, not read.
        batch_size, decoding, device, start: as for :func:`iter_batches`.
        on_batch: called with the number of inputs handled after each batch (progress bars, flushing).

    Yields:
        ``(input, value, error, thumbnail)`` per input in order: ``value`` ``None`` where ``error`` is
        set, ``thumbnail`` ``None`` unless ``decoding`` keeps thumbnails and the input was decoded.
    """
    for batch in iter_batches(items, batch_size=batch_size, decoding=decoding, device=device, start=start):
        values: dict[int, T] = {}
        if batch.rows:
            with torch.inference_mode():
                values = dict(zip(batch.rows, compute(batch.tensor)))
        for i, (name, _) in enumerate(batch.items):
            yield name, values.get(i), batch.errors.get(i), batch.thumbnails.get(i)
        if on_batch is not None:
            on_batch(len(batch.items))
