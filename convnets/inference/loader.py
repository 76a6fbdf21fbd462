"""From ``(input, error)`` items to decoded batches (:class:`Decoding`: how), and to per-input results.

:func:`map_batches` is the loop predict and embed share. Batches keep an uninterrupted run's boundaries
(:func:`~convnets.inputs.listing.iter_chunks`) and are decoded here, on threads (``workers=0``), or whole in the processes of a
:class:`~torch.utils.data.DataLoader`: the same tensors, bit for bit, in input order, at most
``PREFETCH * workers`` batches ahead (so a slow ``--from-file -`` pipe delays finished batches). On the device
path (``Decoding.decode="device"``) they only read the inputs and decode what must go the CPU path; the main
process decodes the JPEGs of each batch on the model's device (:func:`finish`, :mod:`convnets.preprocessing.device`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from PIL import Image

from convnets.constants import DECODES, DEFAULT_TIMEOUT
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inputs.listing import InputItem as Item, iter_chunks
from convnets.preprocessing.io import is_url
from convnets.preprocessing.decode import fast_decode_draft, thumbnail_of
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import EvalPreset
from convnets.preprocessing.transforms import normalize_uint8
from convnets.runtime import check_workers, init_worker

__all__ = ["PREFETCH", "DecodedBatch", "Decoding", "Result", "decode", "finish", "iter_batches",
           "map_batches"]

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
        fast_decode: decode large JPEGs at a reduced DCT scale first (on the CPU path).
        thumbnail: also keep each decoded input as a thumbnail fitting this square (``predict --show``).
        decode: where JPEGs are decoded, one of :data:`~convnets.constants.DECODES`: ``"cpu"`` (Pillow),
            ``"device"`` (:mod:`convnets.preprocessing.device`: read here, decoded and preprocessed on the
            model's device, batched), ``"auto"``: the device on CUDA, else the CPU (:meth:`for_device`).
    """

    preset: EvalPreset | None = None
    timeout: float = DEFAULT_TIMEOUT
    workers: int | None = 0
    allow_private: bool = True
    fast_decode: bool = False
    thumbnail: int | None = None
    decode: str = "auto"

    def __post_init__(self) -> None:
        if self.decode not in DECODES:
            raise InvalidArgumentError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}",
                                       keyword="decode")

    def with_preset(self, preset: EvalPreset) -> Decoding:
        """This decoding with ``preset`` (the model's, sized as asked)."""
        return replace(self, preset=preset)

    def for_device(self, device: torch.device | str) -> Decoding:
        """This decoding for a model on ``device``: ``workers`` set (the device's default when it was ``None``),
        ``decode`` resolved to ``"cpu"`` or ``"device"``."""
        from convnets.preprocessing.device import resolve_decode
        from convnets.runtime import default_workers

        kind = torch.device(device).type
        workers = self.workers if self.workers is not None else default_workers(kind)
        return replace(self, workers=workers, decode=resolve_decode(self.decode, device))


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


@dataclass(frozen=True)
class DecodedBatch:
    """One batch decoded: its items, the tensor of those that decoded, each row's position in ``items``,
    and by position the errors and thumbnails."""

    items: list[Item]
    tensor: torch.Tensor
    rows: list[int]
    errors: dict[int, ImageLoadError]
    thumbnails: dict[int, Image.Image] = field(default_factory=dict)
    #: the device path's rows, read but not yet decoded (encoded JPEGs or CPU-path uint8 crops; see
    #: :func:`convnets.preprocessing.device.load_for_device`); ``tensor`` is empty until :func:`finish` decodes them
    loaded: list[torch.Tensor] | None = None

    def pin_memory(self) -> DecodedBatch:
        """The batch with its tensor in page-locked memory (the device path's encoded inputs stay where they are:
        the decoder reads them on the CPU)."""
        return self if self.loaded is not None else replace(self, tensor=self.tensor.pin_memory())

    def to(self, device: torch.device) -> DecodedBatch:
        """The batch with its tensor on ``device`` (non-blocking from pinned memory)."""
        if self.tensor.device == device or self.loaded is not None:
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
    errors = {i: error for i, (_, error) in enumerate(chunk) if error is not None}

    def keep(pos: int, image: Image.Image) -> None:  # the image the tensor is made from: read once
        if size:
            thumbnails[readable[pos]] = thumbnail_of(image, size)
    if decoding.decode == "device":
        assert decoding.preset is not None
        from convnets.preprocessing.device import load_batch_for_device

        loaded = load_batch_for_device(names, decoding.preset, workers=threads, timeout=decoding.timeout,
                                       allow_private=decoding.allow_private, draft=_draft(decoding),
                                       on_image=keep if size else None)
        errors.update({readable[pos]: x for pos, x in enumerate(loaded) if isinstance(x, ImageLoadError)})
        rows = [(readable[pos], x) for pos, x in enumerate(loaded) if not isinstance(x, ImageLoadError)]
        return DecodedBatch(chunk, torch.empty(0), [row for row, _ in rows], errors, thumbnails,
                            loaded=[x for _, x in rows])
    batch = prepare_batch(names, on_error="collect", preset=decoding.preset, timeout=decoding.timeout,
                          workers=threads, allow_private=decoding.allow_private, fast_decode=decoding.fast_decode,
                          on_image=keep if size else None)
    errors.update({readable[pos]: error for pos, error in batch.errors})
    return DecodedBatch(chunk, batch.tensor, [readable[pos] for pos in batch.indices], errors, thumbnails)


def _draft(decoding: Decoding) -> int | None:
    return fast_decode_draft(decoding.preset) if decoding.fast_decode and decoding.preset is not None else None


def finish(batch: DecodedBatch, decoding: Decoding, device: torch.device) -> DecodedBatch:
    """A batch of the device path decoded, resized, cropped and normalised on ``device`` (the CPU path's
    batches are returned as they are); a JPEG neither path decodes becomes an error of the batch."""
    if batch.loaded is None:
        return batch
    assert decoding.preset is not None
    from convnets.preprocessing.device import crops_on_device, thumbnail_of_tensor

    size = decoding.thumbnail
    thumbnails = dict(batch.thumbnails)

    def keep(pos: int, image: torch.Tensor | Image.Image) -> None:
        if size:
            row = batch.rows[pos]
            thumbnails[row] = (thumbnail_of(image, size) if isinstance(image, Image.Image)
                               else thumbnail_of_tensor(image, size))
    crops = crops_on_device(batch.loaded, [batch.items[row][0] for row in batch.rows], decoding.preset, device,
                            draft=_draft(decoding), on_image=keep if size else None)
    errors = dict(batch.errors)
    errors.update({row: crop for row, crop in zip(batch.rows, crops) if isinstance(crop, ImageLoadError)})
    kept = [(row, crop) for row, crop in zip(batch.rows, crops) if isinstance(crop, torch.Tensor)]
    size_ = decoding.preset.crop_size
    pixels = (torch.stack([crop for _, crop in kept]) if kept
              else torch.empty((0, 3, size_, size_), dtype=torch.uint8, device=device))
    return replace(batch, tensor=normalize_uint8(pixels, decoding.preset), rows=[row for row, _ in kept],
                   errors=errors, thumbnails=thumbnails, loaded=None)


def _identity(batch: Any) -> Any:
    return batch


def iter_batches(items: Iterable[Item], *, batch_size: int, decoding: Decoding | None = None,
                 preset: EvalPreset | None = None, timeout: float = DEFAULT_TIMEOUT, workers: int | None = 0,
                 device: torch.device | str = "cpu", start: int = 0) -> Iterator[DecodedBatch]:
    """Decoded batches of ``items``, in input order, on ``device`` (on CUDA through pinned memory); ``decoding``
    (default: ``Decoding(preset, timeout, workers)``) must have a preset; ``start``: as for :func:`~convnets.inputs.listing.iter_chunks`."""
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
    batches: Iterator[DecodedBatch]
    if workers == 0:
        batches = map(decoder.__getitems__, chunks)
        if pin:  # (the device path's batches stay where they are: see DecodedBatch.pin_memory)
            batches = (batch.pin_memory() for batch in batches)
    else:
        # The chunks are the batch sampler (DataLoader pulls PREFETCH * workers ahead); the decoder returns the batch.
        batches = iter(torch.utils.data.DataLoader(decoder, batch_sampler=chunks,  # type: ignore[arg-type]
                                                   num_workers=workers, collate_fn=_identity, pin_memory=pin,
                                                   prefetch_factor=PREFETCH, worker_init_fn=init_worker))
        log.debug("decoding in %d worker processes", workers)
    if decoding.decode == "device":
        yield from _finished_ahead(batches, decoding, device)
        return
    for batch in batches:
        yield batch.to(device)


def _finished_ahead(batches: Iterator[DecodedBatch], decoding: Decoding,
                    device: torch.device) -> Iterator[DecodedBatch]:
    """:func:`finish` of each batch on a thread of its own, one batch ahead of the caller, so that the next batch
    is decoded while the model runs on this one (on a GPU in a stream of its own, which the caller's stream waits
    for before it reads the batch)."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def work(batch: DecodedBatch) -> tuple[DecodedBatch, Any]:
        if stream is None:
            return finish(batch, decoding, device), None
        with torch.cuda.stream(stream):
            done = finish(batch, decoding, device)
            event = torch.cuda.Event()
            event.record(stream)
        return done, event

    def ready(future: Future[tuple[DecodedBatch, Any]]) -> DecodedBatch:
        done, event = future.result()
        if event is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            done.tensor.record_stream(current)  # its memory is not reused before the caller's work on it ends
        return done

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="convnets-device-decode") as pool:
        pending: Future[tuple[DecodedBatch, Any]] | None = None
        try:
            for batch in batches:
                upcoming = pool.submit(work, batch)
                if pending is not None:
                    yield ready(pending)
                pending = upcoming
            if pending is not None:
                yield ready(pending)
        finally:
            if pending is not None:
                pending.cancel()


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
