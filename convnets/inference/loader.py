"""From a stream of ``(input, error)`` items to decoded batches, decoding in parallel with the model.

Used by :mod:`convnets.inference.predict` and :mod:`convnets.inference.embed`. The main process reads the items (a
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.preprocessing.io import is_url
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import EvalPreset
from convnets.runtime import check_workers

__all__ = ["PREFETCH", "DecodedBatch", "decode", "iter_batches", "iter_chunks"]

log = logging.getLogger(__name__)

#: One input after expansion: a file or URL, or an input already known to fail with its error
#: (the same type as :data:`convnets.inference.predict.InputItem`).
Item = tuple[str, "ImageLoadError | None"]

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
    """

    items: list[Item]
    tensor: torch.Tensor
    rows: list[int]
    errors: dict[int, ImageLoadError]

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

    preset: EvalPreset
    timeout: float

    def __getitems__(self, chunk: list[Item]) -> DecodedBatch:
        return decode(chunk, preset=self.preset, timeout=self.timeout,
                      in_worker=torch.utils.data.get_worker_info() is not None)

    def __getitem__(self, item: Item) -> DecodedBatch:  # the Dataset protocol; batches use __getitems__
        return self.__getitems__([item])


def decode(chunk: list[Item], *, preset: EvalPreset, timeout: float, in_worker: bool = False) -> DecodedBatch:
    """Decode and preprocess one batch on the CPU; unreadable inputs become ``errors``.

    Args:
        chunk: the batch's items; those with an error are not read.
        preset: the preprocessing.
        timeout: total seconds allowed for each URL download.
        in_worker: running in a decoding process: one thread for local files (the processes are
            the parallelism), threads for URLs (they wait on the network).
    """
    readable = [i for i, (_, error) in enumerate(chunk) if error is None]
    names = [chunk[i][0] for i in readable]
    threads = 1 if in_worker and not any(is_url(name) for name in names) else None
    batch = prepare_batch(names, on_error="collect", preset=preset, timeout=timeout, workers=threads)
    errors = {i: error for i, (_, error) in enumerate(chunk) if error is not None}
    errors.update({readable[pos]: error for pos, error in batch.errors})
    return DecodedBatch(chunk, batch.tensor, [readable[pos] for pos in batch.indices], errors)


def _identity(batch: Any) -> Any:
    return batch


def iter_batches(items: Iterable[Item], *, batch_size: int, preset: EvalPreset, timeout: float,
                 workers: int = 0, device: torch.device | str = "cpu", start: int = 0) -> Iterator[DecodedBatch]:
    """Decoded batches of ``items``, in input order, on ``device``.

    Args:
        items: ``(input, error)`` pairs in order, read lazily.
        batch_size: inputs per batch.
        preset: the preprocessing (bit-identical whatever ``workers`` is).
        timeout: total seconds allowed for each URL download.
        workers: decoding processes (0: decode in this process, on threads, between model calls).
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
    workers = check_workers(workers)
    device = torch.device(device)
    pin = device.type == "cuda"
    chunks = iter_chunks(items, batch_size, start)
    decoder = _Decoder(preset, timeout)
    if workers == 0:
        for chunk in chunks:
            batch = decoder.__getitems__(chunk)
            yield (batch.pin_memory() if pin else batch).to(device)
        return
    # batch_sampler: the chunks themselves (any iterable; DataLoader pulls prefetch * workers of
    # them ahead, no more). collate_fn: the decoder already returns the batch.
    loader = torch.utils.data.DataLoader(decoder, batch_sampler=chunks, num_workers=workers,  # type: ignore[arg-type]
                                         collate_fn=_identity, pin_memory=pin, prefetch_factor=PREFETCH)
    log.debug("decoding in %d worker processes", workers)
    for batch in loader:
        yield batch.to(device)
