"""Classify images with a model: batching, preprocessing, top-k with class names. From Python::

    results = convnets.predict(model, ["cat.jpg", "photos/"], topk=3)   # Predictions: a list
    results          # in Jupyter: thumbnails, classes and bars; elsewhere print(results) is text

A multi-label model (``convnets train --multilabel``: ``model.multilabel``) scores each class with a
sigmoid rather than a softmax over all of them: ``top`` holds the most probable classes with those
probabilities, and ``labels`` every class whose probability reaches its threshold (``model.thresholds``).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from convnets.constants import DEFAULT_TIMEOUT
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inputs.listing import InputItem, iter_inputs
from convnets.preprocessing.classes import class_labels
from convnets.inference.loader import Decoding, Result, map_batches
from convnets.inputs.names import safe_text
from convnets.text import printable
from convnets.models.resnet import ResNet
from convnets.preprocessing.decode import load_thumbnail, thumbnail_of
from convnets.preprocessing.presets import EvalPreset, preset_for_model

if TYPE_CHECKING:
    from convnets.explanations import Explanation

__all__ = ["MAX_ROWS", "Prediction", "Predictions", "TopClass", "class_labels", "iter_inputs", "iter_predict",
           "predict", "predict_items", "predictions_html", "resolve_decoding", "top_classes"]


@dataclass(frozen=True)
class TopClass:
    """One of the most probable classes of an image."""

    index: int
    label: str
    probability: float


@dataclass(frozen=True)
class Prediction(Result):
    """The result for one input: its top classes or its error, and its thumbnail when decoded with
    ``Decoding(thumbnail=...)`` (for contact sheets; not compared); after :meth:`Predictions.explain`, the heat
    maps of its classes (shown beside the thumbnail).

    Attributes:
        labels: of a multi-label model, the names of the classes whose probability reaches their threshold,
            most probable first (possibly none); ``None`` for a single-label model.
    """

    input: str
    top: list[TopClass] = field(default_factory=list)
    error: ImageLoadError | None = None
    thumbnail: Image.Image | None = field(default=None, repr=False, compare=False)
    labels: list[str] | None = None
    explanations: list[Explanation] = field(default_factory=list, repr=False, compare=False)

    def __str__(self) -> str:
        """The input's name and its classes, one per line, as ``convnets predict`` prints them: names and
        labels :func:`~convnets.text.printable` (a checkpoint's class name cannot move the cursor,
        colour the terminal or add a line)."""
        if not self.ok:
            return f"{printable(self.input)}\n  error: {printable(str(self.error))}"
        ranks = (f"  {rank}. {100 * t.probability:6.2f}%  {printable(t.label)}  [{t.index}]"
                 for rank, t in enumerate(self.top, 1))
        lines = [printable(self.input), *ranks]
        if self.labels is not None:
            lines.append(f"  labels: {', '.join(map(printable, self.labels)) or '(none above its threshold)'}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return predictions_html([self])


class Predictions(list[Prediction]):
    """The results of :func:`predict`: a list shown as a table in Jupyter, as text elsewhere."""

    def __str__(self) -> str:
        return "\n".join(map(str, self))

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return predictions_html(self)

    def explain(self, model: ResNet, *, topk: int = 1, **options: Any) -> Predictions:
        """These predictions with the heat maps of their best classes (:func:`convnets.explain`, the ``explain``
        extra): in Jupyter each thumbnail is shown with its overlays beside it.

        Args:
            model: the model that made the predictions.
            topk: how many of each input's top classes to explain (best first; at most those it has).
            **options: as for :func:`convnets.explain`: ``method``, ``layer``, ``batch_size``, ``device``,
                ``preset``, ``timeout``, ``allow_private`` (use the preprocessing that the predictions had).

        Returns:
            A new :class:`Predictions`, each with its ``explanations``; inputs that failed stay as they are.
        """
        from convnets.explanations import explain_items

        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise InvalidArgumentError(f"topk must be a positive integer, got {topk!r}")
        readable = [p for p in self if p.ok]
        explained = explain_items(model, [(p.input, None) for p in readable],
                                  lambda position, scores: [t.index for t in readable[position].top[:topk]], **options)
        heat = {id(p): e.explanations for p, e in zip(readable, explained)}
        return Predictions(dataclasses.replace(p, explanations=heat.get(id(p), [])) for p in self)


#: Rows drawn with their thumbnails; the rest are counted (a notebook of ten thousand pictures cannot be opened).
MAX_ROWS = 64

_CELL = "padding:4px 8px;vertical-align:top;text-align:left"


def predictions_html(predictions: Sequence[Prediction], *, thumbnail: int = 128, max_rows: int = MAX_ROWS,
                     timeout: float = DEFAULT_TIMEOUT) -> str:
    """A self-contained HTML table of ``predictions``: per input, its thumbnail (the prediction's, else read again
    within ``timeout``; ``thumbnail`` pixels), name, and top classes with bars; rows after ``max_rows`` counted."""
    rows = [_row(p, thumbnail, timeout) for p in predictions[:max_rows]]
    more = len(predictions) - len(rows)
    if more > 0:
        rows.append(f'<tr><td colspan="2" style="{_CELL}">… and {more} more (index or iterate the list to see them)'
                    "</td></tr>")
    return f'<table class="convnets-predictions" style="border-collapse:collapse">{"".join(rows)}</table>'


def _row(prediction: Prediction, side: int, timeout: float) -> str:
    name = html.escape(safe_text(prediction.input))
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
    labels = "" if prediction.labels is None else (
        '<br><span style="color:#5a5a5a">labels:</span> '
        + (", ".join(f"<b>{html.escape(label)}</b>" for label in prediction.labels) or "none above its threshold"))
    heat = ""
    if prediction.explanations:  # Predictions.explain: the heat maps beside the thumbnail
        from convnets.explanations import overlays_html

        heat = f'<td style="{_CELL}">{overlays_html(prediction.explanations, side)}</td>'
    return (f'<tr><td style="{_CELL}">{image}</td>{heat}<td style="{_CELL}"><b>{name}</b>{labels}'
            f'<table style="border-collapse:collapse">{classes}</table></td></tr>')


def _bar(rank: int, label: str, index: int, probability: float) -> str:
    colour = "#9ec4e6" if rank == 1 else "#cbdef0"  # the contact sheet's bars: the best class darker
    width = max(0.0, min(100.0, 100 * probability))
    return (f'<tr><td style="{_CELL};text-align:right">{100 * probability:.2f}%</td>'
            f'<td style="{_CELL};width:160px"><div style="background:{colour};width:{width:.1f}%;height:0.9em">'
            f'</div></td><td style="{_CELL}">{html.escape(label)} <span style="color:#5a5a5a">[{index}]</span></td>'
            "</tr>")


def top_classes(logits: torch.Tensor, labels: Sequence[str], topk: int, thresholds: Sequence[float] | None = None
                ) -> list[tuple[list[TopClass], list[str] | None]]:
    """Per row of ``logits`` (``[N, classes]``): the ``topk`` most probable classes, named by ``labels``, and with
    ``thresholds`` (a multi-label model's) the names whose probability reaches their threshold, most probable first.

    Probabilities are a softmax, or with ``thresholds`` each class's sigmoid.
    """
    logits = logits.float()
    probabilities = (torch.softmax(logits, dim=1) if thresholds is None else torch.sigmoid(logits)).cpu()
    values, indices = probabilities.topk(topk, dim=1)
    tops = [[TopClass(int(c), labels[int(c)], float(p)) for p, c in zip(v, i)] for v, i in zip(values, indices)]
    if thresholds is None:
        return [(top, None) for top in tops]
    # Compared in float64, as convnets evaluate and the thresholds' choice compare them.
    above = probabilities.double() >= torch.tensor([float(t) for t in thresholds], dtype=torch.float64)
    order = torch.argsort(probabilities, dim=1, descending=True, stable=True)
    return [(top, [labels[int(c)] for c in row if above[r, int(c)]]) for r, (top, row) in enumerate(zip(tops, order))]


def resolve_decoding(model: object, decoding: Decoding | None, *, preset: EvalPreset | None = None,
                     image_size: int | None = None, resize_size: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                     workers: int | None = 0, allow_private: bool = True, fast_decode: bool = False,
                     decode: str = "auto") -> Decoding:
    """``decoding``, or one of the separate options; a missing preset is ``model``'s, the sizes given applied."""
    decoding = decoding or Decoding(preset=preset, timeout=timeout, workers=workers, allow_private=allow_private,
                                    fast_decode=fast_decode, decode=decode)
    if decoding.preset is not None and image_size is None and resize_size is None:
        return decoding
    preset = decoding.preset if decoding.preset is not None else preset_for_model(model)
    if image_size is not None:
        preset = preset.with_crop_size(image_size)
    if resize_size is not None and resize_size != preset.resize_size:
        preset = dataclasses.replace(preset, resize_size=resize_size)
    return decoding.with_preset(preset)


def predict(model: Callable[[torch.Tensor], torch.Tensor] | ResNet,
            inputs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *, recursive: bool = False,
            **options: Any) -> Predictions:
    """Classify images (a path, directory or http(s) URL, or several; other options as for :func:`iter_predict`):
    a :class:`Predictions` list, in order."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    return Predictions(iter_predict(model, [os.fspath(i) for i in inputs], recursive=recursive, **options))


def iter_predict(model: Callable[[torch.Tensor], torch.Tensor] | ResNet, inputs: Iterable[str], *,
                 recursive: bool = False, **options: Any) -> Iterator[Prediction]:
    """Classify images a batch at a time, yielding one :class:`Prediction` per input in order; inputs read lazily.

    Args:
        model: a classifier in eval mode, or any callable from a normalised batch to logits.
        inputs: paths, directories (their images, see :func:`iter_inputs`) and http(s) URLs; any iterable.
        recursive: search directories' subfolders too.
        **options: as for :func:`predict_items`.
    """
    return predict_items(model, iter_inputs(inputs, recursive=recursive), **options)


def predict_items(model: Callable[[torch.Tensor], torch.Tensor] | ResNet, items: Iterable[InputItem], *,
                  labels: Sequence[str] | None = None, topk: int = 5, batch_size: int = 32,
                  device: torch.device | str = "cpu", image_size: int | None = None, resize_size: int | None = None,
                  preset: EvalPreset | None = None, timeout: float = DEFAULT_TIMEOUT,
                  on_batch: Callable[[int], None] | None = None, start: int = 0, workers: int | None = 0,
                  decoding: Decoding | None = None, allow_private: bool = True,
                  decode: str = "auto", thresholds: Sequence[float] | None = None) -> Iterator[Prediction]:
    """:func:`iter_predict` for ``(input, error)`` items already expanded by :func:`iter_inputs`.

    Args:
        labels: class names; default :func:`class_labels` of ``model`` (required for other callables).
        image_size, resize_size: center crop and shorter side; default: the preset's (the model's).
        on_batch: called with the number of inputs handled after each batch.
        start: inputs of the whole run before ``items``: batches keep the uninterrupted run's boundaries.
        workers: decoding processes (same tensors, same order); 0: decode here; ``None``: the device's default.
        preset, timeout, allow_private: as for :class:`~convnets.inference.loader.Decoding`.
        decoding: a :class:`~convnets.inference.loader.Decoding`, replacing preset, timeout, workers, allow_private,
            decode.
        decode: where JPEGs are decoded: ``"auto"`` (on ``device`` when it is a CUDA GPU, else with Pillow),
            ``"cpu"`` (Pillow, upstream's numbers) or ``"device"`` (``torchvision.io.decode_jpeg`` and tensor
            preprocessing on ``device``, the CPU included; other images go the CPU path, per image).
        thresholds: per-class decision thresholds of a multi-label model: sigmoid probabilities, and each
            prediction's ``labels``; default: ``model.thresholds`` of a multi-label ResNet, else a softmax.
    """
    if not isinstance(topk, int) or topk < 1:
        raise InvalidArgumentError(f"topk must be a positive integer, got {topk!r}")
    if labels is None:
        if not isinstance(model, ResNet):
            raise InvalidArgumentError("pass labels= when the model is not a convnets ResNet")
        labels = class_labels(model)
    if thresholds is None and isinstance(model, ResNet):
        thresholds = model.decision_thresholds()
    if thresholds is not None and len(thresholds) != len(labels):
        raise InvalidArgumentError(f"thresholds has {len(thresholds)} values for {len(labels)} classes",
                                   keyword="thresholds")
    topk = min(topk, len(labels))
    names = list(labels)
    chosen = resolve_decoding(model, decoding, preset=preset, image_size=image_size, resize_size=resize_size,
                              timeout=timeout, workers=workers, allow_private=allow_private, decode=decode)
    for name, value, error, thumbnail in map_batches(lambda batch: top_classes(model(batch), names, topk, thresholds),
                                                     items, batch_size=batch_size, decoding=chosen, device=device,
                                                     start=start, on_batch=on_batch):
        top, above = value if value is not None else ([], None)
        yield Prediction(name, top, error, thumbnail, labels=above)
