"""Classify images with a model: batching, preprocessing, top-k with class names.

Used by ``convnets predict``; also usable from Python::

    model = convnets.se_resnext101_32x4d(pretrained=True)
    for result in convnets.inference.predict.predict(model, ["cat.jpg", "photos/"], topk=3):
        print(result.input, result.top[0].label if result.ok else result.error)

Inputs are read lazily, a batch at a time (any iterable: a generator over a list file of millions
of paths costs no more memory than a few); results come in input order. ``workers=N`` decodes the
next batches in N processes while the model runs (:mod:`convnets.inference.loader`). Writing results to files
is :mod:`convnets.inference.records`; embeddings are :mod:`convnets.inference.embed`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from convnets.constants import IMAGE_SUFFIXES
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inference.loader import iter_batches
from convnets.models.resnet import ResNet
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes
from convnets.preprocessing.io import DEFAULT_TIMEOUT, is_url
from convnets.preprocessing.presets import EvalPreset, preset_for_model

__all__ = ["IMAGE_SUFFIXES", "InputItem", "Prediction", "TopClass", "class_labels", "expand_inputs", "iter_inputs",
           "resolve_preset",
           "predict", "predict_items"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class TopClass:
    """One of the most probable classes of an image."""

    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Prediction:
    """The result for one input: its top classes, or why it could not be read."""

    input: str
    top: list[TopClass] = field(default_factory=list)
    error: ImageLoadError | None = None

    @property
    def ok(self) -> bool:
        """Whether the input was read and classified."""
        return self.error is None


#: One input after expansion: a file or URL, or an input that is already known to fail with its error.
InputItem = tuple[str, "ImageLoadError | None"]


def _hidden(name: str) -> bool:
    """Hidden files and folders (``.name``; also macOS's ``._name`` resource forks) are skipped."""
    return name.startswith(".")


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES and not _hidden(name)


def _walk(directory: str, recursive: bool, ancestors: frozenset[str] = frozenset()) -> Iterator[str]:
    """Images in ``directory``, sorted by name; with ``recursive`` its subfolders' in the same order
    (each folder's images and subfolders sorted together, so a path sorts by its components).

    Hidden files and folders are skipped; a symbolic link to a folder that is being walked (a
    cycle) is not entered.
    """
    try:
        with os.scandir(directory) as listing:
            entries = sorted((e for e in listing if not _hidden(e.name)), key=lambda e: e.name)
    except OSError as e:
        log.warning("cannot list %s: %s", directory, e)
        return
    inside = ancestors | {os.path.realpath(directory)} if recursive else ancestors
    for entry in entries:
        path = str(Path(directory) / entry.name)  # as Path spells it: './a' lists 'a/x.jpg'
        try:
            is_dir = entry.is_dir()
        except OSError:
            continue
        if is_dir:
            if recursive and os.path.realpath(path) not in inside:
                yield from _walk(path, recursive, inside)
        elif _is_image(entry.name) and entry.is_file():
            yield path


def iter_inputs(inputs: Iterable[str] | str | os.PathLike[str], *, recursive: bool = False) -> Iterator[InputItem]:
    """Replace each directory by its images, lazily (constant memory for any number of inputs).

    Args:
        inputs: file paths, directories and URLs, as given on the command line or read from a list
            (or one of them alone). Only directories are searched; a file named explicitly is used
            even when hidden.
        recursive: search directories' subfolders too (depth first, sorted by name); default: only
            the images directly inside. Hidden files and folders (``.name``, ``._name``) are skipped.

    Yields:
        ``(input, None)`` for each file or URL in order; a directory without images gives
        ``(directory, error)``, so that it is reported like any other unreadable input.
    """
    if isinstance(inputs, (str, os.PathLike)):  # one path, not an iterable of its characters
        inputs = [inputs]
    for item in inputs:
        item = os.fspath(item)
        if is_url(item) or not os.path.isdir(item):
            yield item, None
            continue
        found = False
        for image in _walk(item, recursive):
            found = True
            yield image, None
        if not found:
            where = "or its subfolders " if recursive else ""
            yield item, ImageLoadError(f"Cannot load images from {item!r}: the directory {where}has no files "
                                       f"ending in {', '.join(sorted(IMAGE_SUFFIXES))}.")


def expand_inputs(inputs: Iterable[str], *, recursive: bool = False) -> list[InputItem]:
    """:func:`iter_inputs` as a list (for few inputs; streams should use :func:`iter_inputs`)."""
    return list(iter_inputs(inputs, recursive=recursive))


def class_labels(model: ResNet) -> list[str]:
    """Names of the model's outputs: the checkpoint's, ImageNet's for 1000 classes, else indices."""
    if model.class_names is not None:
        return list(model.class_names)
    if model.num_classes == NUM_CLASSES:
        return [str(name) for name in get_imgnet_classes()]
    return [f"class {i}" for i in range(model.num_classes)]


def resolve_preset(model: object, preset: EvalPreset | None, image_size: int | None,
                   resize_size: int | None) -> EvalPreset:
    """The preset ``predict`` uses: ``preset`` or the model's, with the sizes given applied."""
    base = preset if preset is not None else preset_for_model(model)
    if image_size is not None:
        base = base.with_crop_size(image_size)
    if resize_size is not None and resize_size != base.resize_size:
        base = dataclasses.replace(base, resize_size=resize_size)
    return base


def predict(
    model: Callable[[torch.Tensor], torch.Tensor] | ResNet,
    inputs: Iterable[str],
    *,
    recursive: bool = False,
    **options: Any,
) -> Iterator[Prediction]:
    """Classify images, a batch at a time, yielding one :class:`Prediction` per input in order.

    Inputs are read lazily, a batch at a time: a generator of a million paths costs no more memory
    than ten.

    Args:
        model: a classifier in eval mode (or any callable from a normalised batch to logits, such
            as the result of ``convnets.optimize_for_inference``).
        inputs: paths, directories (their images, see :func:`iter_inputs`) and http(s) URLs; any
            iterable, e.g. a generator reading a list file.
        recursive: search directories' subfolders too.
        **options: as for :func:`predict_items` (``labels``, ``topk``, ``batch_size``, ``device``,
            ``image_size``, ``resize_size``, ``preset``, ``timeout``, ``on_batch``, ``workers``).

    Yields:
        A prediction per file or URL; unreadable inputs carry their error instead of classes.
    """
    return predict_items(model, iter_inputs(inputs, recursive=recursive), **options)


def predict_items(
    model: Callable[[torch.Tensor], torch.Tensor] | ResNet,
    items: Iterable[InputItem],
    *,
    labels: Sequence[str] | None = None,
    topk: int = 5,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
    image_size: int | None = None,
    resize_size: int | None = None,
    preset: EvalPreset | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    on_batch: Callable[[int], None] | None = None,
    start: int = 0,
    workers: int = 0,
) -> Iterator[Prediction]:
    """:func:`predict` for inputs already expanded by :func:`iter_inputs` (e.g. after skipping
    the ones an earlier run recorded).

    Args:
        model: as for :func:`predict`.
        items: ``(input, error)`` pairs in order; those with an error are reported, not read.
        labels: class names; default :func:`class_labels` of ``model``.
        topk: how many classes per image.
        batch_size: images per forward pass.
        device: where the batch goes.
        image_size, resize_size: preprocessing sizes (center crop, shorter side); default: the
            preset's. ``image_size`` alone scales the resize as :meth:`EvalPreset.for_image_size`.
        preset: the evaluation preset; default :func:`~convnets.preprocessing.presets.preset_for_model`
            of ``model`` (224 / 256 for the NGC weights, a checkpoint's recorded image size).
        timeout: total seconds allowed for each URL download.
        on_batch: called with the number of inputs handled after each batch (progress bars).
        start: how many inputs of the whole run come before ``items`` (a resumed run's skipped
            ones): batches keep the boundaries of the uninterrupted run (multiples of
            ``batch_size``), so each image is computed in the same batch and gives the same numbers.
        workers: processes that decode the next batches while the model runs (a PyTorch
            ``DataLoader``; the same tensors, bit for bit, and the same order); 0 (default): decode
            in this process, on threads, between model calls. See :mod:`convnets.inference.loader`.

    Yields:
        A prediction per file or URL; unreadable inputs carry their error instead of classes.

    Raises:
        InvalidArgumentError: ``topk`` or ``batch_size`` is not a positive integer, ``workers`` a
            negative one, or ``labels``
            is missing for a model that is not a convnets ResNet (checked on the first ``next``).
    """
    if not isinstance(topk, int) or topk < 1:
        raise InvalidArgumentError(f"topk must be a positive integer, got {topk!r}")
    if labels is None:
        if not isinstance(model, ResNet):
            raise InvalidArgumentError("pass labels= when the model is not a convnets ResNet")
        labels = class_labels(model)
    topk = min(topk, len(labels))
    preset = resolve_preset(model, preset, image_size, resize_size)
    for batch in iter_batches(items, batch_size=batch_size, preset=preset, timeout=timeout, workers=workers,
                              device=device, start=start):
        tops: dict[int, list[TopClass]] = {}
        if batch.rows:
            with torch.inference_mode():
                probabilities = torch.softmax(model(batch.tensor).float(), dim=1).cpu()
            values, indices = probabilities.topk(topk, dim=1)
            for row, pos in enumerate(batch.rows):
                tops[pos] = [TopClass(int(c), labels[int(c)], float(p)) for p, c in zip(values[row], indices[row])]
        for i, (name, _) in enumerate(batch.items):
            yield Prediction(name, tops.get(i, []), batch.errors.get(i))
        if on_batch is not None:
            on_batch(len(batch.items))
