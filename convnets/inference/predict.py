"""Classify images with a model: batching, preprocessing, top-k with class names.

Used by ``convnets predict``; also usable from Python::

    model = convnets.se_resnext101_32x4d(pretrained=True)
    results = convnets.predict(model, ["cat.jpg", "photos/"], topk=3)   # Predictions: a list
    results          # in Jupyter: thumbnails, classes and bars; elsewhere print(results) is text

:func:`predict` returns the results in a list that shows itself (:class:`Predictions`);
:func:`iter_predict` yields them one by one and reads its inputs lazily, a batch at a time (any
iterable: a generator over a list file of millions of paths costs no more memory than a few;
:mod:`convnets.inference.inputs`, re-exported here). Results come in input order. ``workers=N`` decodes the next batches in N processes while the model
runs; the loop itself, shared with embeddings, is :func:`convnets.inference.loader.map_batches`.
Writing results to files is :mod:`convnets.inference.outputs`; embeddings are :mod:`convnets.inference.embed`;
``convnets predict`` runs this as a batch job (:mod:`convnets.inference.job`).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from convnets.constants import DEFAULT_TIMEOUT, IMAGE_SUFFIXES
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inference.inputs import InputItem, expand_inputs, iter_inputs
from convnets.inference.loader import Decoding, Result, map_batches
from convnets.inference.names import display_name
from convnets.models.resnet import ResNet
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes
from convnets.preprocessing.pipeline import load_thumbnail, thumbnail_of
from convnets.preprocessing.presets import EvalPreset, preset_for_model

__all__ = ["IMAGE_SUFFIXES", "MAX_ROWS", "InputItem", "Prediction", "Predictions", "TopClass", "class_labels",
           "expand_inputs", "iter_inputs", "iter_predict", "predict", "predict_items", "predictions_html",
           "resolve_decoding", "resolve_preset"]


@dataclass(frozen=True)
class TopClass:
    """One of the most probable classes of an image."""

    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Prediction(Result):
    """The result for one input: its top classes, or why it could not be read (``ok``: see :class:`Result`),
    and its thumbnail when it was decoded with :attr:`Decoding.thumbnail <convnets.inference.loader.Decoding>`
    set (contact sheets draw it; it takes no part in comparisons)."""

    input: str
    top: list[TopClass] = field(default_factory=list)
    error: ImageLoadError | None = None
    thumbnail: Image.Image | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        """The input's name and its classes, one per line, as ``convnets predict`` prints them."""
        if not self.ok:
            return f"{display_name(self.input)}\n  error: {self.error}"
        ranks = (f"  {rank}. {100 * t.probability:6.2f}%  {t.label}  [{t.index}]" for rank, t in enumerate(self.top, 1))
        return "\n".join([display_name(self.input), *ranks])

    def _repr_html_(self) -> str:
        return predictions_html([self])


class Predictions(list[Prediction]):
    """The results of :func:`predict`: a list that shows itself.

    The last expression of a Jupyter cell shows as a table of thumbnails, top classes and
    probability bars (:func:`predictions_html`); ``print`` and a terminal show the text of
    ``convnets predict``.
    """

    def __str__(self) -> str:
        return "\n".join(map(str, self))

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return predictions_html(self)


#: Rows drawn with their thumbnails; the rest of a longer list is counted in one line (a notebook
#: that embeds ten thousand pictures becomes too large to open).
MAX_ROWS = 64

_CELL = "padding:4px 8px;vertical-align:top;text-align:left"


def predictions_html(predictions: Sequence[Prediction], *, thumbnail: int = 128, max_rows: int = MAX_ROWS,
                     timeout: float = DEFAULT_TIMEOUT) -> str:
    """An HTML table of ``predictions``: per input, its thumbnail, name, and top classes with bars.

    What a contact sheet (:mod:`convnets.inference.sheet`) draws into a PNG, inline in a notebook
    (``_repr_html_`` of :class:`Predictions` and :class:`Prediction`). Thumbnails are the
    predictions' own (decoded with ``Decoding(thumbnail=...)``), else read again from each input, and
    embedded as JPEG data URLs; an input that cannot be read again keeps its row, with the reason in
    place of the picture.

    Args:
        predictions: the results to show, in order.
        thumbnail: the longer side of each picture, in pixels.
        max_rows: inputs shown; the others are counted in the last line.
        timeout: seconds allowed for reading each URL again.

    Returns:
        A ``<table>`` (self-contained: the pictures are data URLs, the styles inline).
    """
    rows = [_row(p, thumbnail, timeout) for p in predictions[:max_rows]]
    more = len(predictions) - len(rows)
    if more > 0:
        rows.append(f'<tr><td colspan="2" style="{_CELL}">… and {more} more (index or iterate the list to see them)'
                    "</td></tr>")
    return f'<table class="convnets-predictions" style="border-collapse:collapse">{"".join(rows)}</table>'


def _row(prediction: Prediction, side: int, timeout: float) -> str:
    name = html.escape(display_name(prediction.input))
    if not prediction.ok:
        return (f'<tr style="background:#fadede"><td style="{_CELL}"></td><td style="{_CELL}"><b>{name}</b><br>'
                f"{html.escape(str(prediction.error))}</td></tr>")
    picture, why = ((thumbnail_of(prediction.thumbnail, side), None) if prediction.thumbnail is not None
                    else load_thumbnail(prediction.input, side, timeout=timeout))
    if picture is None:
        image = f'<div style="width:{side}px;color:#5a5a5a">{html.escape(why or "")}</div>'
    else:
        buffer = io.BytesIO()
        picture.save(buffer, format="JPEG", quality=85)  # a tenth of a PNG's size: notebooks stay small
        data = base64.b64encode(buffer.getvalue()).decode("ascii")
        image = f'<img src="data:image/jpeg;base64,{data}" alt="{name}" style="max-width:{side}px">'
    classes = "".join(_bar(rank, t.label, t.index, t.probability) for rank, t in enumerate(prediction.top, 1))
    return (f'<tr><td style="{_CELL}">{image}</td><td style="{_CELL}"><b>{name}</b>'
            f'<table style="border-collapse:collapse">{classes}</table></td></tr>')


def _bar(rank: int, label: str, index: int, probability: float) -> str:
    colour = "#9ec4e6" if rank == 1 else "#cbdef0"  # the contact sheet's bars: the best class darker
    width = max(0.0, min(100.0, 100 * probability))
    return (f'<tr><td style="{_CELL};text-align:right">{100 * probability:.2f}%</td>'
            f'<td style="{_CELL};width:160px"><div style="background:{colour};width:{width:.1f}%;height:0.9em">'
            f'</div></td><td style="{_CELL}">{html.escape(label)} <span style="color:#5a5a5a">[{index}]</span></td>'
            "</tr>")


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


def resolve_decoding(model: object, decoding: Decoding | None, *, preset: EvalPreset | None = None,
                     image_size: int | None = None, resize_size: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                     workers: int | None = 0, allow_private: bool = True, fast_decode: bool = False) -> Decoding:
    """The decoding a library call uses: ``decoding``, or one made of the separate options.

    Args:
        model: whose preset (:func:`resolve_preset`) applies where none is given.
        decoding: the whole setting; its ``preset``, when ``None``, is filled in from ``model``.
        preset, image_size, resize_size: as for :func:`resolve_preset` (used without ``decoding``,
            or to fill its missing preset).
        timeout, workers, allow_private, fast_decode: the fields of a new
            :class:`~convnets.inference.loader.Decoding`.

    Returns:
        A decoding with a preset.
    """
    decoding = decoding or Decoding(preset=preset, timeout=timeout, workers=workers, allow_private=allow_private,
                                    fast_decode=fast_decode)
    if decoding.preset is not None and image_size is None and resize_size is None:
        return decoding
    return decoding.with_preset(resolve_preset(model, decoding.preset, image_size, resize_size))


def predict(
    model: Callable[[torch.Tensor], torch.Tensor] | ResNet,
    inputs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    recursive: bool = False,
    **options: Any,
) -> Predictions:
    """Classify images: one :class:`Prediction` per input, in order, in a list that shows itself
    (:func:`iter_predict` yields them one at a time, for more inputs than a list should hold).

    Args:
        model, recursive, **options: as for :func:`iter_predict`.
        inputs: a path, directory or http(s) URL, or several.
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    return Predictions(iter_predict(model, [os.fspath(i) for i in inputs], recursive=recursive, **options))


def iter_predict(
    model: Callable[[torch.Tensor], torch.Tensor] | ResNet,
    inputs: Iterable[str],
    *,
    recursive: bool = False,
    **options: Any,
) -> Iterator[Prediction]:
    """Classify images, a batch at a time, yielding one :class:`Prediction` per input in order
    (unreadable inputs carry their error instead of classes). Inputs are read lazily: a generator of
    a million paths costs no more memory than ten.

    Args:
        model: a classifier in eval mode (or any callable from a normalised batch to logits, such
            as the result of ``convnets.optimize_for_inference``).
        inputs: paths, directories (their images, see :func:`iter_inputs`) and http(s) URLs; any iterable.
        recursive: search directories' subfolders too.
        **options: as for :func:`predict_items` (``labels``, ``topk``, ``batch_size``, ``device``, ...).
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
    workers: int | None = 0,
    decoding: Decoding | None = None,
    allow_private: bool = True,
) -> Iterator[Prediction]:
    """:func:`iter_predict` for inputs already expanded by :func:`iter_inputs` (e.g. after skipping
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
            in this process, on threads, between model calls; ``None``: the default for ``device``.
            See :mod:`convnets.inference.loader`.
        decoding: preset, timeout, workers and allow_private in one
            :class:`~convnets.inference.loader.Decoding` (what ``convnets predict`` passes); replaces
            those four options.
        allow_private: download URLs whose host is a loopback, private or link-local address (the
            default, as upstream); ``False`` makes them fail with an error, for URL lists that come
            from someone else.

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
    names = list(labels)

    def top_classes(batch: torch.Tensor) -> list[list[TopClass]]:
        probabilities = torch.softmax(model(batch).float(), dim=1).cpu()
        values, indices = probabilities.topk(topk, dim=1)
        return [[TopClass(int(c), names[int(c)], float(p)) for p, c in zip(v, i)] for v, i in zip(values, indices)]
    chosen = resolve_decoding(model, decoding, preset=preset, image_size=image_size, resize_size=resize_size,
                              timeout=timeout, workers=workers, allow_private=allow_private)
    for name, top, error, thumbnail in map_batches(top_classes, items, batch_size=batch_size, decoding=chosen,
                                                   device=device, start=start, on_batch=on_batch):
        yield Prediction(name, top or [], error, thumbnail)
