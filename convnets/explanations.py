"""Explanations: where in an image the evidence for a class lies (Grad-CAM and its variants), from Python::

    maps = convnets.explain(model, ["cat.jpg", "photos/"], topk=2)   # Explanations: a list, one per input and class
    maps[0].heatmap        # float32 [H, W] of the image as read (upright), 0..1; 0 outside what the model saw
    maps[0].overlay()      # the image with the heat map over it (a PIL image); in Jupyter the list draws itself

The heat maps are pytorch-grad-cam's (the ``explain`` extra), computed on
the tensor that ``convnets predict`` feeds the model (the same decoding, resize and center crop), for the logit of
each class: valid for a softmax (single-label) and a sigmoid (multi-label) classifier alike. pytorch-grad-cam
upsamples each map to the model's input (the crop, :attr:`Explanation.crop_heatmap`) and scales it to 0..1; here it
is also put back where the crop came from in the image (:attr:`Explanation.heatmap`, the image's own height and
width), so that it can be laid over the image or compared with regions of it pixel for pixel.

Which classes are explained without ``classes=`` is decided in one place, :func:`default_targets`.
"""

from __future__ import annotations

import base64
import html
import io
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from convnets.constants import DEFAULT_EXPLAIN_METHOD, DEFAULT_TIMEOUT, EXPLAIN_METHODS
from convnets.errors import ImageLoadError, InvalidArgumentError, InvalidArgumentTypeError
from convnets.inputs.listing import InputItem, iter_chunks, iter_inputs
from convnets.inputs.names import safe_text
from convnets.models.resnet import ResNet
from convnets.preprocessing.classes import class_labels
from convnets.preprocessing.decode import thumbnail_of
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import EvalPreset, preset_for_model

__all__ = ["MIN_MAP_SIDE", "ExplainedInput", "Explanation", "Explanations", "class_scores", "default_layer",
           "default_targets", "explain", "explain_items", "explanations_html", "greyed", "heatmap_in_image",
           "model_thresholds", "resolve_classes"]

log = logging.getLogger(__name__)

#: The smallest side (in cells) of the feature map that :func:`default_layer` explains from. A class's map is
#: the target layer's map, upsampled: the last stage at NVIDIA's 224 px is 7x7; a model trained at 64 px has a
#: 2x2 last stage, which cannot say which part of the image the evidence is in, so a smaller input is explained
#: from an earlier stage (measured: tests/test_explain.py, and docs/explain.md's table).
MIN_MAP_SIDE = 6


def _grad_cam() -> Any:
    """The ``pytorch_grad_cam`` module, or :class:`~convnets.errors.MissingDependencyError` naming the extra."""
    from convnets.deploy.formats.base import require

    return require("pytorch_grad_cam", extra="explain", purpose="explanations (convnets explain, convnets.explain)")


@dataclass(frozen=True)
class Explanation:
    """Where the evidence for one class lies in one image.

    Attributes:
        input: the input's name (path or URL).
        index: the class explained (an output of the model).
        label: its name.
        score: the model's score for it: the softmax probability, or the sigmoid one for a multi-label model
            (see :func:`class_scores`).
        method: the pytorch-grad-cam method (``gradcam``, ``gradcam++``, ...; :data:`EXPLAIN_METHODS`).
        layer: the stage whose last block's output was explained (``layer4``, ...).
        heatmap: float32 ``[H, W]``, the image's height and width as it was read (upright): 0..1, the heat
            of the model's input put back where the center crop came from; 0 outside the crop (what the
            model did not see).
        crop_heatmap: float32 ``[S, S]`` at the model's input (the crop): pytorch-grad-cam's own map.
        box: ``(left, top, right, bottom)``, where the crop came from in the image, in its pixels.
        image: the image as read (for :meth:`overlay`; not compared).
    """

    input: str
    index: int
    label: str
    score: float
    method: str
    layer: str
    heatmap: npt.NDArray[np.float32] = field(repr=False, compare=False)
    crop_heatmap: npt.NDArray[np.float32] = field(repr=False, compare=False)
    box: tuple[int, int, int, int] = (0, 0, 0, 0)
    image: Image.Image | None = field(default=None, repr=False, compare=False)

    def overlay(self, *, image_weight: float = 0.5) -> Image.Image:
        """The image with the heat map over it in colour (pytorch-grad-cam's ``show_cam_on_image``, jet colours)
        inside :attr:`box`, the crop the model saw; outside it, the image greyed (:func:`greyed`), so that what
        was cropped away does not read as the dark blue of "no heat".

        Args:
            image_weight: the image's share of each pixel, 0..1 (the heat map's is the rest).
        """
        if self.image is None:
            raise InvalidArgumentError(f"the explanation of {safe_text(self.input)} holds no image to overlay")
        show_cam_on_image = _grad_cam().utils.image.show_cam_on_image
        rgb = np.asarray(self.image, dtype=np.float32) / 255
        picture = show_cam_on_image(rgb, self.heatmap, use_rgb=True, image_weight=image_weight)
        left, top, right, bottom = self.box
        if right > left and bottom > top:  # an explanation made without a box shows no crop
            outside = np.ones(picture.shape[:2], dtype=bool)
            outside[top:bottom, left:right] = False
            picture[outside] = greyed(np.asarray(self.image))[outside]
        return Image.fromarray(picture)

    def _repr_html_(self) -> str:
        return explanations_html([self])


class Explanations(list[Explanation]):
    """The results of :func:`explain`, one per input and class, in input order: a list shown in Jupyter as each
    image's overlays with their classes and scores, as text elsewhere."""

    def __str__(self) -> str:
        return "\n".join(f"{safe_text(e.input)}  {e.label} [{e.index}]  {100 * e.score:.2f}%  ({e.method}, {e.layer})"
                         for e in self)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return explanations_html(self)


@dataclass(frozen=True)
class ExplainedInput:
    """One input of :func:`explain_items`: its explanations, or why it could not be read."""

    input: str
    explanations: list[Explanation] = field(default_factory=list)
    error: ImageLoadError | None = None

    @property
    def ok(self) -> bool:
        """Whether the input was read and explained."""
        return self.error is None


def class_scores(model: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The model's scores of its logits ``[N, C]``: sigmoid probabilities for a multi-label model (one whose
    ``multilabel`` attribute is true), else softmax ones. The classes' order is the logits' either way."""
    logits = logits.float()
    return torch.sigmoid(logits) if getattr(model, "multilabel", False) else torch.softmax(logits, dim=1)


def model_thresholds(model: torch.nn.Module) -> list[float] | None:
    """A multi-label model's decision threshold per class (:meth:`~convnets.models.resnet.ResNet.decision_thresholds`),
    else ``None``."""
    thresholds = model.decision_thresholds() if isinstance(model, ResNet) else None
    return None if thresholds is None else [float(t) for t in thresholds]


def default_targets(scores: npt.ArrayLike, *, topk: int | None = None, class_names: Sequence[str] | None = None,
                    thresholds: Sequence[float] | None = None) -> list[int]:
    """The classes explained for one input when none are asked for, best score first.

    The one place that decides it (``convnets explain`` without ``--class``, :func:`explain` without ``classes``):
    the ``topk`` best scores; without ``topk``, the classes whose score reaches their threshold (a multi-label
    model's, :func:`model_thresholds`), or the best one if none does or there are no thresholds.

    Args:
        scores: the input's score per class (:func:`class_scores`' row).
        topk: how many (at most the number of classes); ``None``: see above.
        class_names: the classes' names (unused today: for rules that name classes).
        thresholds: a score per class from which a class counts as present.
    """
    row = np.asarray(scores, dtype=np.float64).reshape(-1)
    order = [int(i) for i in np.argsort(-row, kind="stable")]  # ties: the lower index first, as torch.topk on the CPU
    if topk is None and thresholds is not None:
        present = [i for i in order if row[i] >= thresholds[i]]
        return present or order[:1]
    return order[:min(topk or 1, row.size)]


def resolve_classes(classes: Iterable[int | str], labels: Sequence[str], *, option: str = "classes") -> list[int]:
    """Class indices from indices and names (a name first as itself, else a number as an index).

    Raises:
        InvalidArgumentError: an index out of range or an unknown name; the message names ``option``.
    """
    by_name = {name: i for i, name in enumerate(labels)}
    chosen: list[int] = []
    for value in classes:
        if isinstance(value, str) and value in by_name:
            index = by_name[value]
        else:
            try:
                index = int(value) if not isinstance(value, bool) else -1
            except ValueError:
                shown = ", ".join(repr(n) for n in list(labels)[:8]) + (", ..." if len(labels) > 8 else "")
                raise InvalidArgumentError(f"{option}: {safe_text(str(value))!r} is neither a class of the model "
                                           f"({shown}) nor a class index") from None
            if not 0 <= index < len(labels):
                raise InvalidArgumentError(f"{option}: class index {value!r} is out of range: the model has "
                                           f"{len(labels)} classes, 0 to {len(labels) - 1}")
        if index not in chosen:
            chosen.append(index)
    if not chosen:
        raise InvalidArgumentError(f"{option}: no class given")
    return chosen


def default_layer(model: ResNet, image_size: int) -> str:
    """The stage explained by default: the last one whose output is at least :data:`MIN_MAP_SIDE` cells a side at
    ``image_size`` (``layer4`` from 192 px, ``layer3`` from 96, ``layer2`` below), but never the first stage, whose
    channels are edges and colours rather than anything a class is made of."""
    stages = model.feature_info[1:]
    for info in reversed(stages[1:]):
        if image_size // info["reduction"] >= MIN_MAP_SIDE:
            return str(info["module"])
    return str(stages[min(1, len(stages) - 1)]["module"])


def greyed(rgb: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """``rgb`` (``[H, W, 3]`` uint8) as an overlay shows what the model did not see: grey (ITU-R 601 luma),
    halfway to white."""
    luma = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return np.repeat(np.round(127.5 + luma / 2).astype(np.uint8)[..., None], 3, axis=2)


def heatmap_in_image(crop_map: npt.NDArray[np.float32], size: tuple[int, int],
                     preset: EvalPreset) -> tuple[npt.NDArray[np.float32], tuple[int, int, int, int]]:
    """Put a map of the model's input (the center crop) back where the crop came from in an image of ``size``.

    The preprocessing resizes the shorter side to ``preset.resize_size`` (the longer to ``int(resize * long /
    short)``, as torchvision's resize) and center-crops ``preset.crop_size`` (offsets rounded, as torchvision's
    center crop); this undoes the geometry: the crop's box in the image's pixels, the map resized into it
    (bilinear), zeros elsewhere.

    Args:
        crop_map: ``[S, S]``, ``S = preset.crop_size``.
        size: the image's ``(width, height)``.
        preset: the preprocessing.

    Returns:
        The ``[height, width]`` map and the box ``(left, top, right, bottom)``.
    """
    width, height = size
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = preset.resize_size, int(preset.resize_size * long / short)
    resized_w, resized_h = (new_short, new_long) if width <= height else (new_long, new_short)
    crop = preset.crop_size
    top, left = round((resized_h - crop) / 2.0), round((resized_w - crop) / 2.0)  # torchvision's center_crop
    sx, sy = width / resized_w, height / resized_h
    box = (round(left * sx), round(top * sy), round((left + crop) * sx), round((top + crop) * sy))
    box = (max(box[0], 0), max(box[1], 0), min(max(box[2], box[0] + 1), width), min(max(box[3], box[1] + 1), height))
    inside = Image.fromarray(np.ascontiguousarray(crop_map, dtype=np.float32), mode="F")
    inside = inside.resize((box[2] - box[0], box[3] - box[1]), Image.Resampling.BILINEAR)
    heat = np.zeros((height, width), dtype=np.float32)
    heat[box[1]:box[3], box[0]:box[2]] = np.clip(np.asarray(inside, dtype=np.float32), 0, 1)
    return heat, box


def _check_model(model: object) -> ResNet:
    if not isinstance(model, ResNet):
        raise InvalidArgumentTypeError(f"model must be a convnets ResNet (convnets.load_model, convnets.get_model), "
                                       f"got {type(model).__name__}: explanations need its stages and gradients")
    if not model.num_classes:
        raise InvalidArgumentError("model has no classifier (num_classes=0): there is no class to explain")
    return model


def _cam(model: ResNet, method: str, layer: str) -> Any:
    for keyword, value, allowed in (("method", method, list(EXPLAIN_METHODS)), ("layer", layer, model.stage_names)):
        if value not in allowed:
            why = f"must be one of {', '.join(allowed)}, got {value!r}"
            raise InvalidArgumentError(f"{keyword} {why}", cli=f"--{keyword} {why}", keyword=keyword)
    cls = getattr(_grad_cam(), EXPLAIN_METHODS[method])
    return cls(model=model, target_layers=[getattr(model, layer)[-1]])


#: What chooses the classes of one input: ``(its position among the items, its scores) -> class indices``.
Chooser = Callable[[int, npt.NDArray[np.float32]], list[int]]


def explain_items(model: ResNet, items: Iterable[InputItem], choose: Chooser, *, method: str = DEFAULT_EXPLAIN_METHOD,
                  layer: str | None = None, labels: Sequence[str] | None = None, batch_size: int = 8,
                  device: torch.device | str | None = None, preset: EvalPreset | None = None,
                  timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True) -> Iterator[ExplainedInput]:
    """Explain ``(input, error)`` items (:func:`~convnets.inputs.listing.iter_inputs`' ) a batch at a time.

    Args:
        model: the classifier (its parameters' device is where it runs; it is put in eval mode).
        items: the inputs; an item with an error is yielded with it.
        choose: the classes of each input, from its position in ``items`` and its row of :func:`class_scores`.
        method, layer: as for :func:`explain`.
        labels: the class names (default :func:`~convnets.preprocessing.classes.class_labels`).
        batch_size: images per forward pass (each class of each image is a row of the backward pass).
        device: where the batches go; default: where the model's parameters are.
        preset: the preprocessing (default: the model's, as ``convnets predict``).
        timeout, allow_private: as for :func:`~convnets.preprocessing.pipeline.prepare_batch`.
    """
    model = _check_model(model)
    preset = preset or preset_for_model(model)
    layer = layer or default_layer(model, preset.crop_size)
    names = list(labels) if labels is not None else class_labels(model)
    model.eval()
    device = torch.device(device) if device is not None else next(model.parameters()).device
    cam = _cam(model, method, layer)
    targets_of = _grad_cam().utils.model_targets.ClassifierOutputTarget
    start = 0
    try:
        for chunk in iter_chunks(items, batch_size):
            readable = [pos for pos, (_, error) in enumerate(chunk) if error is None]
            seen: dict[int, Image.Image] = {}  # by position among the readable: the images, read once
            batch = prepare_batch([chunk[pos][0] for pos in readable], on_error="collect", preset=preset,
                                  timeout=timeout, allow_private=allow_private, workers=1, on_image=seen.__setitem__)
            errors = {pos: error for pos, (_, error) in enumerate(chunk) if error is not None}
            errors.update({readable[i]: error for i, error in batch.errors})
            rows = [readable[i] for i in batch.indices]
            tensor = batch.tensor.to(device)
            explained: dict[int, list[Explanation]] = {}
            pairs: list[tuple[int, int]] = []
            scores = np.zeros((0, 0), dtype=np.float32)
            if rows:
                with torch.no_grad():
                    scores = class_scores(model, model(tensor)).cpu().numpy()
                pairs = [(r, c) for r, pos in enumerate(rows) for c in choose(start + pos, scores[r])]
            if pairs:
                # One row per (image, class): the backward pass gives each its own map.
                expanded = tensor[[r for r, _ in pairs]].requires_grad_(True)  # a frozen model still has gradients
                with torch.enable_grad():
                    maps = cam(input_tensor=expanded, targets=[targets_of(c) for _, c in pairs])
                for (r, c), crop_map in zip(pairs, maps):
                    pos, image = rows[r], seen[batch.indices[r]]
                    heat, box = heatmap_in_image(crop_map, image.size, preset)
                    explained.setdefault(pos, []).append(Explanation(
                        chunk[pos][0], c, names[c], float(scores[r][c]), method, layer, heat,
                        np.asarray(crop_map, dtype=np.float32), box, image))
            for pos, (name, _) in enumerate(chunk):
                yield ExplainedInput(name, explained.get(pos, []), errors.get(pos))
            start += len(chunk)
    finally:
        cam.activations_and_grads.release()  # the hooks leave the model


def explain(model: ResNet, inputs: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], *,
            method: str = DEFAULT_EXPLAIN_METHOD, classes: Iterable[int | str] | None = None, topk: int | None = None,
            layer: str | None = None, recursive: bool = False, batch_size: int = 8,
            device: torch.device | str | None = None,
            image_size: int | None = None, preset: EvalPreset | None = None, timeout: float = DEFAULT_TIMEOUT,
            allow_private: bool = True) -> Explanations:
    """Heat maps of where the evidence for classes lies in images (Grad-CAM and its variants, pytorch-grad-cam).

    Args:
        model: a convnets classifier (:func:`~convnets.load_model`, :func:`~convnets.get_model`), on ``device``.
        inputs: a path, directory or http(s) URL, or several (directories: their images, as ``convnets predict``).
        method: one of :data:`~convnets.constants.EXPLAIN_METHODS`: ``hirescam`` (default: Grad-CAM's own map
            at the last stage, closer to the model at earlier ones; see
            :data:`~convnets.constants.DEFAULT_EXPLAIN_METHOD`), ``gradcam``, ``gradcam++``, ``xgradcam``,
            ``layercam``, ``eigengradcam``.
        classes: the classes to explain in every image, as indices or names; default: :func:`default_targets`
            (the ``topk`` best scores of each image).
        topk: classes per image without ``classes``; default: the best one, or for a multi-label model with
            thresholds the classes that reach theirs.
        layer: the stage whose last block is the target layer (``layer4``, ...); default :func:`default_layer`.
        recursive: search directories' subfolders too.
        batch_size: images per forward pass.
        device: where the batches go; default: where the model is.
        image_size: center-crop size; default the model's (``convnets predict``'s preprocessing, exactly).
        preset: the whole preprocessing instead (sizes, interpolation, mean, std).
        timeout, allow_private: for URLs, as for ``convnets.predict``.

    Returns:
        :class:`Explanations`: one :class:`Explanation` per input and class, in input order, the classes of an
        input in the order asked (by default best first). Each holds ``heatmap`` (the image's ``[H, W]``),
        ``crop_heatmap`` (the model input's ``[S, S]``), the class, its score, and draws ``overlay()``.

    Raises:
        ImageLoadError: an input that cannot be read (or a subclass).
        InvalidArgumentError: an unknown method, layer or class, a bad ``topk``.
        MissingDependencyError: pytorch-grad-cam is not installed (the ``explain`` extra).
    """
    model = _check_model(model)
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
        raise InvalidArgumentError(f"topk must be a positive integer, got {topk!r}")
    labels = class_labels(model)
    thresholds = model_thresholds(model)
    if classes is not None and isinstance(classes, (str, int)):
        classes = [classes]
    chosen = None if classes is None else resolve_classes(classes, labels)

    def choose(position: int, scores: npt.NDArray[np.float32]) -> list[int]:
        if chosen is not None:
            return chosen
        return default_targets(scores, topk=topk, class_names=labels, thresholds=thresholds)
    if preset is None:
        preset = preset_for_model(model)
        if image_size is not None:
            preset = preset.with_crop_size(image_size)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    results = Explanations()
    for item in explain_items(model, iter_inputs([os.fspath(i) for i in inputs], recursive=recursive), choose,
                              method=method, layer=layer, labels=labels, batch_size=batch_size, device=device,
                              preset=preset, timeout=timeout, allow_private=allow_private):
        if item.error is not None:
            raise item.error
        results.extend(item.explanations)
    return results


# --- Jupyter -----------------------------------------------------------------------------------------------------

_CELL = "padding:4px 8px;vertical-align:top;text-align:left"


def picture_html(image: Image.Image, side: int, alt: str) -> str:
    """An ``<img>`` of ``image`` scaled to fit ``side`` pixels, inline as a JPEG (notebooks stay small)."""
    buffer = io.BytesIO()
    thumbnail_of(image, side).save(buffer, format="JPEG", quality=85)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img src="data:image/jpeg;base64,{data}" alt="{html.escape(alt)}" style="max-width:{side}px">'


def overlays_html(explanations: Sequence[Explanation], side: int = 128) -> str:
    """The overlays of ``explanations`` side by side, each captioned with its class and score."""
    cells = []
    for e in explanations:
        caption = f"{html.escape(e.label)} [{e.index}] {100 * e.score:.1f}%"
        cells.append(f'<td style="{_CELL}">{picture_html(e.overlay(), side, e.label)}<br>{caption}</td>')
    return f'<table style="border-collapse:collapse"><tr>{"".join(cells)}</tr></table>'


def explanations_html(explanations: Sequence[Explanation], *, side: int = 128) -> str:
    """A self-contained HTML table: per input, its name and the overlay of each class explained."""
    rows: dict[str, list[Explanation]] = {}
    for e in explanations:
        rows.setdefault(e.input, []).append(e)
    body = "".join(f'<tr><td style="{_CELL}"><b>{html.escape(safe_text(name))}</b><br>{overlays_html(group, side)}'
                   "</td></tr>" for name, group in rows.items())
    return f'<table class="convnets-explanations" style="border-collapse:collapse">{body}</table>'
