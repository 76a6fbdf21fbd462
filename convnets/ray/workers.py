"""The callable classes of :mod:`convnets.ray` for ``Dataset.map_batches``: :class:`Classifier`, :class:`Embedder`
(the model loaded once per actor) and :class:`Preprocessor` (decoding in CPU tasks). The columns they take and
return: :mod:`convnets.ray`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from PIL import Image

from convnets.constants import DEFAULT_MODEL, DEFAULT_TIMEOUT
from convnets.deploy.engines.base import DEFAULT_SETTINGS, EngineSettings
from convnets.errors import ImageLoadError, InvalidArgumentError, message_for
from convnets.inference.embed import Embedding, features_model, pooled_vectors
from convnets.inference.loader import Result
from convnets.preprocessing.classes import class_labels
from convnets.inference.predict import Prediction, TopClass, top_classes
from convnets.models.resnet import ResNet
from convnets.preprocessing.pipeline import prepare_batch
from convnets.preprocessing.presets import EvalPreset, preset_for_model
from convnets.preprocessing.sources import is_url
from convnets.runtime import PrecisionName

__all__ = ["Classifier", "Embedder", "Preprocessor", "Worker"]

log = logging.getLogger(__name__)

Batch = dict[str, npt.NDArray[Any]]
R = TypeVar("R", bound=Result)
Interface = Literal["python", "cli"]


def _names(batch: Batch) -> tuple[str, npt.NDArray[Any]]:
    """The column that names the rows, and its values (row numbers when there is none)."""
    for column in ("path", "input"):
        if column in batch:
            return column, batch[column]
    size = len(next(iter(batch.values()))) if batch else 0
    return "row", np.arange(size)


def _sources(batch: Batch) -> list[Any]:
    """What each row's image is read from: encoded bytes, a decoded array or a path/URL."""
    if "bytes" in batch:
        return [bytes(b) for b in batch["bytes"]]
    if "image" in batch:
        return [Image.fromarray(np.asarray(a)) for a in batch["image"]]
    if "input" in batch:
        return [str(name) for name in batch["input"]]
    if "path" in batch:
        return [str(name) for name in batch["path"]]
    raise InvalidArgumentError(f"a batch needs a 'bytes', 'image', 'tensor', 'input' or 'path' column, got "
                               f"{sorted(batch)}")


def _message(error: BaseException, interface: Interface) -> str:
    if interface == "cli":
        from convnets.inference.job import input_error_message

        return input_error_message(error)
    return message_for(error, interface)


class _Decode:
    """Decoding and preprocessing of a batch's images on this CPU, as ``convnets predict`` does."""

    def __init__(self, preset: EvalPreset, *, timeout: float, allow_private: bool, fast_decode: bool,
                 interface: Interface) -> None:
        self.preset, self.timeout, self.allow_private = preset, timeout, allow_private
        self.fast_decode, self.interface = fast_decode, interface

    def tensors(self, batch: Batch) -> tuple[torch.Tensor, list[int], list[str]]:
        """The preprocessed batch of the rows that were read, their positions, and every row's error ("" if none)."""
        if "tensor" in batch:
            errors = [str(e) for e in batch["error"]]
            rows = [i for i, e in enumerate(errors) if not e]
            return torch.from_numpy(np.asarray(batch["tensor"])[rows]), rows, errors
        sources = _sources(batch)
        urls = any(isinstance(s, str) and is_url(s) for s in sources)
        prepared = prepare_batch(sources, on_error="collect", preset=self.preset, timeout=self.timeout,
                                 workers=None if urls else 1, allow_private=self.allow_private,
                                 fast_decode=self.fast_decode)
        errors = [""] * len(sources)
        for position, error in prepared.errors:
            errors[position] = _message(error, self.interface)
        return prepared.tensor, list(prepared.indices), errors


def _load(model: ResNet | str, weights: str | os.PathLike[str] | None, pretrained: bool) -> ResNet:
    if isinstance(model, ResNet):
        return model.eval()
    from convnets.registry import choose_model

    # Messages in this class's keywords: model=, weights= (a missing download advises weights=PATH).
    return choose_model(None if weights is not None and model == DEFAULT_MODEL else model, path=weights,
                        pretrained=pretrained, names={"name": "model", "path": "weights"}).model


def _actor_cpus() -> int | None:
    """The CPUs that Ray gave this actor; ``None`` outside a Ray worker, or for an actor that asked for none."""
    import sys

    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return None
    cpus = sys.modules["ray"].get_runtime_context().get_assigned_resources().get("CPU")
    return max(1, int(cpus)) if cpus else None


def _actor_settings(settings: EngineSettings) -> EngineSettings:
    """``settings`` for an actor that Ray gave CPUs: as many threads as those CPUs (OpenVINO and ONNX Runtime would
    take every core in every actor), and OpenVINO's threads not pinned to cores unless the user asked. OpenVINO pins
    a process's threads to the first cores it may use, so the actors on one node all pinned theirs to the same
    core: two one-CPU actors on two cores ran at half speed each (measured, benchmarks/bench_ray.py)."""
    if not (cpus := _actor_cpus()):
        return settings
    openvino = {"ENABLE_CPU_PINNING": False, **settings.runtime.get("openvino", {})}
    return dataclasses.replace(settings, threads=settings.threads or cpus,
                               runtime={**settings.runtime, "openvino": openvino})


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


class Worker(Generic[R]):
    """The base of :class:`Classifier` and :class:`Embedder`: the model, loaded once per actor, and decoding.

    Args:
        model: a registered model's name (NVIDIA's weights with ``pretrained``, else random ones) or a convnets
            ResNet (sent to every actor: no weights file is needed where they run).
        weights: a checkpoint to load instead (its architecture is the file's).
        pretrained: NVIDIA's weights for a model given by name.
        device: where the model runs (default: CUDA when this actor has a GPU, else the CPU).
        precision, engine, compile, cache, settings: as for :func:`convnets.optimize_for_inference`.
        image_size: the center crop (default: the model's input size).
        timeout, allow_private, fast_decode: as for :class:`convnets.inference.loader.Decoding`.
        interface: the words of the ``error`` messages: Python's or the command line's.
    """

    def __init__(self, model: ResNet | str = DEFAULT_MODEL, *, weights: str | os.PathLike[str] | None = None,
                 pretrained: bool = True, device: torch.device | str | None = None,
                 precision: PrecisionName = "fp32", engine: str = "torch", compile: bool = False,
                 cache: bool = True, settings: EngineSettings = DEFAULT_SETTINGS, image_size: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True, fast_decode: bool = False,
                 interface: Interface = "python") -> None:
        self.model = _load(model, weights, pretrained)
        self.device = _device(device)
        settings = _actor_settings(settings)
        self.precision, self.engine, self.compile, self.cache, self.settings = precision, engine, compile, cache, settings
        preset = preset_for_model(self.model).with_crop_size(image_size or self.model.input_size)
        self.decode = _Decode(preset, timeout=timeout, allow_private=allow_private, fast_decode=fast_decode,
                              interface=interface)

    @classmethod
    def result(cls, name: str, row: dict[str, Any] | None, error: ImageLoadError | None = None) -> R:
        """The per-input result (:class:`~convnets.inference.loader.Result`) of an output row, or of ``error``."""
        raise NotImplementedError

    def _run(self, batch: Batch, compute: Callable[[torch.Tensor], Iterable[Any]]) -> tuple[list[Any | None], Batch]:
        """Each row's value (``None`` where it failed) and the output's name and ``error`` columns."""
        column, names = _names(batch)
        tensor, rows, errors = self.decode.tensors(batch)
        values: list[Any | None] = [None] * len(errors)
        if rows:
            with torch.inference_mode():
                for row, value in zip(rows, compute(tensor.to(self.device))):
                    values[row] = value
        return values, {column: np.asarray(names), "error": np.asarray(errors, dtype=object)}


class Classifier(Worker[Prediction]):
    """A callable class for ``Dataset.map_batches``: the top classes of each image.

    Args:
        model: as for :class:`Worker`.
        topk: classes per image, at most the model's.
        **options: :class:`Worker`'s other keywords.

    Returns (from a call):
        ``path``/``input`` (as given), ``top_indices`` (int64, rows x ``topk``; -1 where the row failed),
        ``top_labels`` (a list of ``topk`` names per row; empty where it failed), ``top_probabilities``
        (float32, rows x ``topk``; NaN where it failed; a multi-label model's sigmoids), ``error``, and for a
        multi-label model ``labels`` (the names above their thresholds, most probable first).
    """

    def __init__(self, model: ResNet | str = DEFAULT_MODEL, *, topk: int = 5, **options: Any) -> None:
        from convnets.deploy.optimize import optimize_for_inference

        super().__init__(model, **options)
        self.labels = class_labels(self.model)
        # A multi-label model's thresholds: sigmoid probabilities, and each row's labels above them.
        self.thresholds = self.model.decision_thresholds()
        if not isinstance(topk, int) or not 1 <= topk <= len(self.labels):
            raise InvalidArgumentError(f"topk must be an integer from 1 to the model's {len(self.labels)} classes, "
                                       f"got {topk!r}", keyword="topk")
        self.topk = topk
        self.net = optimize_for_inference(self.model, self.precision, device=self.device, engine=self.engine,
                                          compile=self.compile, cache=self.cache, settings=self.settings)

    def __call__(self, batch: Batch) -> Batch:
        values, out = self._run(batch, lambda x: top_classes(self.net(x), self.labels, self.topk, self.thresholds))
        size, k = len(values), self.topk
        indices, probabilities = np.full((size, k), -1, np.int64), np.full((size, k), np.nan, np.float32)
        names, above = np.empty(size, dtype=object), np.empty(size, dtype=object)  # lists: Arrow's list<string>
        for row, value in enumerate(values):
            top, chosen = value if value is not None else ([], [])
            names[row], above[row] = [t.label for t in top], chosen
            for rank, t in enumerate(top):
                indices[row, rank], probabilities[row, rank] = t.index, t.probability
        out = {**out, "top_indices": indices, "top_labels": names, "top_probabilities": probabilities}
        return out if self.thresholds is None else {**out, "labels": above}

    @classmethod
    def result(cls, name: str, row: dict[str, Any] | None, error: ImageLoadError | None = None) -> Prediction:
        """The :class:`~convnets.inference.predict.Prediction` of an output row, or of ``error``."""
        if row is None or row["error"]:
            return Prediction(name, error=error or ImageLoadError(str(row and row["error"])))
        top = [TopClass(int(i), str(label), float(p))
               for i, label, p in zip(row["top_indices"], row["top_labels"], row["top_probabilities"])]
        return Prediction(name, top, labels=[str(label) for label in row["labels"]] if "labels" in row else None)


class Embedder(Worker[Embedding]):
    """A callable class for ``Dataset.map_batches``: one vector per image, the pooled output of a stage.

    Args:
        model: as for :class:`Worker`.
        layer: ``"layer1"`` .. ``"layer4"`` (default: the classifier's input).
        normalize: L2-normalise each vector.
        **options: :class:`Worker`'s other keywords.

    Returns (from a call):
        ``path``/``input`` (as given), ``embedding`` (float32, rows x D; NaN where the row failed) and ``error``.
    """

    def __init__(self, model: ResNet | str = DEFAULT_MODEL, *, layer: str = "layer4", normalize: bool = False,
                 **options: Any) -> None:
        super().__init__(model, **options)
        self.normalize = normalize
        self.net = features_model(self.model, layer, precision=self.precision, device=self.device,
                                  compile=self.compile, engine=self.engine, cache=self.cache, settings=self.settings)
        self.width = int(getattr(self.net, "num_features"))

    def __call__(self, batch: Batch) -> Batch:
        values, out = self._run(batch, lambda x: pooled_vectors(self.net(x), self.normalize))
        vectors = np.full((len(values), self.width), np.nan, np.float32)
        for row, vector in enumerate(values):
            if vector is not None:
                vectors[row] = vector
        return {**out, "embedding": vectors}

    @classmethod
    def result(cls, name: str, row: dict[str, Any] | None, error: ImageLoadError | None = None) -> Embedding:
        """The :class:`~convnets.inference.embed.Embedding` of an output row, or of ``error``."""
        if row is None or row["error"]:
            return Embedding(name, error=error or ImageLoadError(str(row and row["error"])))
        return Embedding(name, np.asarray(row["embedding"], dtype=np.float32))


class Preprocessor:
    """A callable for ``Dataset.map_batches`` in CPU tasks: decode and preprocess, so that GPU actors only run
    the model. Its ``tensor`` (float32, rows x 3 x S x S; zeros where the row failed) and ``error`` columns
    are what :class:`Classifier` and :class:`Embedder` take::

        ds.map_batches(Preprocessor(model), batch_size=32, num_cpus=1)   # an instance: Ray runs it in tasks

    Args:
        model: the model (its preset, :func:`convnets.preset_for_model`) or a preset.
        image_size: the center crop (default: the model's input size, or the preset's).
        timeout, allow_private, fast_decode, interface: as for :class:`Classifier`.
    """

    def __init__(self, model: ResNet | EvalPreset, *, image_size: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT, allow_private: bool = True, fast_decode: bool = False,
                 interface: Interface = "python") -> None:
        preset = model if isinstance(model, EvalPreset) else preset_for_model(model)
        if image_size is not None:
            preset = preset.with_crop_size(image_size)
        self.decode = _Decode(preset, timeout=timeout, allow_private=allow_private, fast_decode=fast_decode,
                              interface=interface)

    def __call__(self, batch: Batch) -> Batch:
        column, names = _names(batch)
        tensor, rows, errors = self.decode.tensors(batch)
        size = self.decode.preset.crop_size
        out = np.zeros((len(errors), 3, size, size), np.float32)
        out[rows] = tensor.numpy()
        return {column: np.asarray(names), "tensor": out, "error": np.asarray(errors, dtype=object)}
