"""Image embeddings: the globally average-pooled output of a ResNet stage, one vector per image::

    for name, vector in convnets.embed(model, ["photos/"], normalize=True, workers=4):
        index.add(name, vector)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy.typing as npt
import torch
from torch import Tensor, nn

from convnets.constants import DEFAULT_TIMEOUT, LAYERS
from convnets.deploy.engines.base import DEFAULT_SETTINGS, EngineSettings
from convnets.errors import ImageLoadError, InvalidArgumentError
from convnets.inputs.listing import InputItem, iter_inputs
from convnets.inference.loader import Decoding, Result, map_batches
from convnets.inference.predict import resolve_decoding
from convnets.models.resnet import ResNet
from convnets.preprocessing.presets import EvalPreset
from convnets.runtime import PrecisionName

__all__ = ["LAYERS", "Embedding", "PooledFeatures", "embed", "embed_items", "features_model", "pooled_vectors"]

log = logging.getLogger(__name__)


class PooledFeatures(nn.Module):
    """A ResNet up to and including ``layer``, then global average pooling: ``[N, 3, H, W] -> [N, num_features]``.

    Shares the model's modules, in one ``nn.Sequential`` so that BatchNorm folding finds every pair.
    """

    def __init__(self, model: ResNet, layer: str = "layer4") -> None:
        super().__init__()
        if not isinstance(model, ResNet):
            raise InvalidArgumentError(f"embeddings need a convnets ResNet (its stages), got {type(model).__name__}; "
                                       "build it with convnets.get_model or convnets.load_model")
        if layer not in model.stage_names:
            raise InvalidArgumentError(f"layer={layer!r} is not a stage of this model; choose one of "
                                       f"{', '.join(model.stage_names)}", keyword="layer",
                                       cli=f"--layer {layer} is not a stage of this model; choose one of "
                                           f"{', '.join(model.stage_names)}")
        stages = model.stages()[:model.stage_names.index(layer) + 1]
        self.body = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, *stages)
        self.layer = layer
        last = stages[-1][-1]
        self.num_features = int(getattr(last, "conv3").out_channels)
        self.input_size = model.input_size

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(nn.functional.adaptive_avg_pool2d(self.body(x), 1), 1)


def features_model(model: ResNet, layer: str = "layer4", *, precision: PrecisionName = "fp32",
                   device: torch.device | str | None = None, compile: bool = False, engine: str = "torch",
                   cache: bool = True, settings: EngineSettings = DEFAULT_SETTINGS) -> nn.Module:
    """:class:`PooledFeatures` of ``model`` (in eval mode, not modified) through ``optimize_for_inference``
    (the other options are its own): a module from a batch to float32 ``[N, D]``, with ``num_features``,
    ``input_size`` and ``device``."""
    from convnets.deploy.optimize import optimize_for_inference

    features = PooledFeatures(model, layer)
    if model.training:
        raise InvalidArgumentError("embeddings need a model in eval mode: call model.eval() first")
    optimized = optimize_for_inference(features.eval(), precision, device=device, engine=engine, compile=compile,
                                       cache=cache, settings=settings)
    # Module.__setattr__ is typed for tensors and modules; these are plain ints.
    optimized.num_features = features.num_features  # type: ignore[assignment]
    optimized.input_size = features.input_size  # type: ignore[assignment]
    return optimized


def pooled_vectors(features: Tensor, normalize: bool = False) -> npt.NDArray[Any]:
    """``features`` (``[N, D]``) as float32 NumPy rows, L2-normalised with ``normalize``."""
    out = features.float()
    return (nn.functional.normalize(out, dim=1) if normalize else out).cpu().numpy()


@dataclass(frozen=True)
class Embedding(Result):
    """The result for one input: its vector, or why it could not be read."""

    input: str
    vector: npt.NDArray[Any] | None = None
    error: ImageLoadError | None = None


def embed_items(features: Callable[[Tensor], Tensor], items: Iterable[InputItem], *,
                preset: EvalPreset | None = None, normalize: bool = False, batch_size: int = 32,
                device: torch.device | str = "cpu", timeout: float = DEFAULT_TIMEOUT, workers: int | None = 0,
                start: int = 0, on_batch: Callable[[int], None] | None = None,
                decoding: Decoding | None = None, allow_private: bool = True,
                decode: str = "auto") -> Iterator[Embedding]:
    """Embed expanded inputs (:func:`convnets.inputs.listing.iter_inputs`), one :class:`Embedding` each, in order.

    Args:
        features: from a normalised batch to ``[N, D]`` features (e.g. :func:`features_model`).
        preset: the preprocessing (required unless ``decoding`` holds it).
        normalize: divide each vector by its L2 norm.
        batch_size, device, timeout, workers, start, on_batch, decoding, allow_private, decode: as for
            :func:`convnets.inference.predict.predict_items`.
    """
    chosen = decoding or Decoding(preset=preset, timeout=timeout, workers=workers, allow_private=allow_private,
                                  decode=decode)
    for name, vector, error, _ in map_batches(lambda batch: pooled_vectors(features(batch), normalize), items,
                                              batch_size=batch_size, decoding=chosen, device=device, start=start,
                                              on_batch=on_batch):
        yield Embedding(name, vector, error)


def embed(model: ResNet, inputs: Iterable[str], *, layer: str = "layer4", normalize: bool = False,
          batch_size: int = 32, workers: int = 0, precision: PrecisionName = "fp32",
          device: torch.device | str | None = None, compile: bool = False, engine: str = "torch", cache: bool = True,
          settings: EngineSettings = DEFAULT_SETTINGS, recursive: bool = False, image_size: int | None = None,
          resize_size: int | None = None, preset: EvalPreset | None = None, timeout: float = DEFAULT_TIMEOUT,
          on_error: Literal["skip", "raise"] = "skip", allow_private: bool = True,
          fast_decode: bool = False, decode: str = "auto") -> Iterator[tuple[str, npt.NDArray[Any]]]:
    """Embed images: yields ``(input, float32 vector)`` per readable input, in input order.

    Args:
        model: a convnets ResNet in eval mode.
        inputs: paths, directories and http(s) URLs; any iterable, read lazily.
        layer: ``"layer1"`` .. ``"layer4"`` (default: the classifier's input); pooled over the image.
        normalize: L2-normalise each vector.
        precision, device, compile, engine, cache, settings: as for :func:`features_model`.
        on_error: an unreadable input is logged and skipped (``"skip"``) or raises (``"raise"``).
        batch_size, workers, recursive, image_size, resize_size, preset, timeout, allow_private, fast_decode, decode:
            as for :func:`convnets.inference.predict.predict_items` and :class:`~convnets.inference.loader.Decoding`.

    """
    if on_error not in ("skip", "raise"):
        raise InvalidArgumentError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    net: Any = features_model(model, layer, precision=precision, device=device, compile=compile, engine=engine,
                              cache=cache, settings=settings)
    chosen = resolve_decoding(model, None, preset=preset, image_size=image_size, resize_size=resize_size,
                              timeout=timeout, workers=workers, allow_private=allow_private, fast_decode=fast_decode,
                              decode=decode)
    for result in embed_items(net, iter_inputs(inputs, recursive=recursive), normalize=normalize,
                              batch_size=batch_size, device=net.device, decoding=chosen):
        if result.error is not None:
            if on_error == "raise":
                raise result.error
            log.warning("skipping %s: %s", result.input, result.error)
            continue
        assert result.vector is not None
        yield result.input, result.vector
