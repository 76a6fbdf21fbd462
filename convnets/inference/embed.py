"""Image embeddings: the globally average-pooled output of a ResNet stage, one vector per image.

The default, ``layer4`` pooled, is the input of the classifier (2048 values for the NGC models): the
features that transfer learning, retrieval and deduplication use. ``layer1`` .. ``layer3`` give
earlier, more local features (256, 512, 1024 values for the NGC models)::

    model = convnets.resnet50(pretrained=True)
    for name, vector in convnets.embed(model, ["photos/"], normalize=True, workers=4):
        index.add(name, vector)

The model, cut after the chosen stage (:class:`PooledFeatures`), runs through
``convnets.optimize_for_inference`` as classifiers do: the torch engine by default (BatchNorm
folded, channels_last, the precision asked for, optionally compiled), or ONNX Runtime, OpenVINO or
``engine="auto"`` (``convnets embed``'s default), which checks its pick against the torch path.
Inputs are read lazily and decoded as for predictions, in the same loop
(:func:`convnets.inference.loader.map_batches`); writing vectors to files is
:mod:`convnets.inference.outputs` (``.npy``, ``.parquet``); ``convnets embed`` runs this as a batch job
(:mod:`convnets.inference.job`).
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
from convnets.inference.inputs import InputItem, iter_inputs
from convnets.inference.loader import Decoding, Result, map_batches
from convnets.inference.predict import resolve_decoding
from convnets.models.resnet import ResNet
from convnets.preprocessing.presets import EvalPreset
from convnets.runtime import PrecisionName

__all__ = ["LAYERS", "Embedding", "PooledFeatures", "embed", "embed_items", "features_model"]

log = logging.getLogger(__name__)



class PooledFeatures(nn.Module):
    """A ResNet up to and including ``layer``, then global average pooling: ``[N, 3, H, W] -> [N, D]``.

    Shares the model's modules (no copy). The stem and the stages sit in one ``nn.Sequential``, so
    BatchNorm folding (:func:`convnets.deploy.folding.fold_batchnorm`) finds every pair.

    Args:
        model: a convnets :class:`~convnets.models.resnet.ResNet`.
        layer: ``"layer1"`` .. ``"layer4"``.

    Attributes:
        num_features: D, the channels of ``layer``'s output.
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
    """The optimized callable from a batch to pooled features ``[N, D]`` (float32).

    :class:`PooledFeatures` goes through :func:`convnets.optimize_for_inference` as a classifier
    would: every engine runs it, and ``engine="auto"`` checks the engine it picks against it (fp32:
    1e-4 relative error, so cosine >= 0.9999), with the converted graph kept in the engine cache.

    Args:
        model: a convnets ResNet in eval mode (not modified).
        layer: the stage whose output is pooled.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` (see :func:`convnets.optimize_for_inference`).
        device: where to run; default: where ``model``'s parameters are.
        compile: ``torch.compile`` it (torch engine; the first batch of each size waits for the compilation).
        engine: ``"torch"`` (default), another registered engine (``"onnxruntime"``, ``"openvino"``) or
            ``"auto"`` (``convnets embed``'s default), as for :func:`convnets.optimize_for_inference`.
        cache: use the engine cache (:mod:`convnets.deploy.cache`).
        settings: how the engine runs (threads, ...), as for :func:`convnets.optimize_for_inference`.

    Returns:
        The engine's module around :class:`PooledFeatures` (the torch engine's
        :class:`~convnets.deploy.optimize.OptimizedModel`, another's
        :class:`~convnets.deploy.engines.runner.RunnerModel`), ``num_features``, ``input_size`` and
        ``device`` set.

    Raises:
        InvalidArgumentError: not a ResNet, an unknown layer or engine, or a model in training mode.
        UnsupportedPrecisionError: a precision the device or engine cannot run.
        MissingDependencyError: the engine's optional packages are missing.
    """
    from convnets.deploy.optimize import optimize_for_inference

    features = PooledFeatures(model, layer)
    if model.training:
        raise InvalidArgumentError("embeddings need a model in eval mode: call model.eval() first")
    optimized = optimize_for_inference(features.eval(), precision, device=device, engine=engine, compile=compile,
                                       cache=cache, settings=settings)
    # Module.__setattr__ is typed for tensors and modules; these are plain ints that callers read.
    optimized.num_features = features.num_features  # type: ignore[assignment]
    optimized.input_size = features.input_size  # type: ignore[assignment]
    return optimized


@dataclass(frozen=True)
class Embedding(Result):
    """The result for one input: its vector, or why it could not be read (``ok``: see :class:`Result`)."""

    input: str
    vector: npt.NDArray[Any] | None = None
    error: ImageLoadError | None = None


def embed_items(features: Callable[[Tensor], Tensor], items: Iterable[InputItem], *,
                preset: EvalPreset | None = None, normalize: bool = False, batch_size: int = 32,
                device: torch.device | str = "cpu", timeout: float = DEFAULT_TIMEOUT, workers: int | None = 0,
                start: int = 0, on_batch: Callable[[int], None] | None = None,
                decoding: Decoding | None = None, allow_private: bool = True) -> Iterator[Embedding]:
    """Embed expanded inputs (:func:`convnets.inference.inputs.iter_inputs`), one :class:`Embedding` each, in order.

    Args:
        features: from a normalised batch to ``[N, D]`` features (e.g. :func:`features_model`).
        items: ``(input, error)`` pairs in order; those with an error are reported, not read.
        preset: the preprocessing (required unless ``decoding`` holds it).
        normalize: divide each vector by its L2 norm.
        batch_size, device, timeout, workers, start, on_batch, decoding, allow_private: as for
            :func:`convnets.inference.predict.predict_items`.

    Yields:
        An :class:`Embedding` per input: a float32 vector, or the input's error.
    """
    def vectors(batch: Tensor) -> npt.NDArray[Any]:
        out = features(batch).float()
        return (nn.functional.normalize(out, dim=1) if normalize else out).cpu().numpy()
    chosen = decoding or Decoding(preset=preset, timeout=timeout, workers=workers, allow_private=allow_private)
    for name, vector, error, _ in map_batches(vectors, items, batch_size=batch_size, decoding=chosen, device=device,
                                           start=start, on_batch=on_batch):
        yield Embedding(name, vector, error)


def embed(
    model: ResNet,
    inputs: Iterable[str],
    *,
    layer: str = "layer4",
    normalize: bool = False,
    batch_size: int = 32,
    workers: int = 0,
    precision: PrecisionName = "fp32",
    device: torch.device | str | None = None,
    compile: bool = False,
    engine: str = "torch",
    cache: bool = True,
    settings: EngineSettings = DEFAULT_SETTINGS,
    recursive: bool = False,
    image_size: int | None = None,
    resize_size: int | None = None,
    preset: EvalPreset | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    on_error: Literal["skip", "raise"] = "skip",
    allow_private: bool = True,
    fast_decode: bool = False,
) -> Iterator[tuple[str, npt.NDArray[Any]]]:
    """Embed images: yields ``(input, vector)`` per readable input, in input order.

    Args:
        model: a convnets ResNet in eval mode, e.g. ``convnets.resnet50(pretrained=True)``.
        inputs: paths, directories (their images) and http(s) URLs; any iterable, read lazily.
        layer: ``"layer4"`` (default: the classifier's input, 2048 values for the NGC models) or
            ``"layer1"`` .. ``"layer3"``; its output is averaged over the image.
        normalize: L2-normalise each vector (for cosine similarity by dot product).
        batch_size: images per forward pass.
        workers: processes that decode the next batches while the model runs (0: decode here).
        precision, device, compile, engine, cache, settings: how the model runs (see :func:`features_model`).
        recursive: search directories' subfolders too.
        image_size, resize_size, preset: preprocessing, as for :func:`convnets.inference.predict.predict`.
        timeout: total seconds allowed for each URL download.
        allow_private: download URLs whose host is a loopback, private or link-local address
            (default); ``False`` refuses them.
        on_error: an input that cannot be read is logged and skipped (``"skip"``) or raises its
            :class:`~convnets.errors.ImageLoadError` (``"raise"``).
        fast_decode: decode large JPEGs at a reduced DCT scale first (see
            :func:`~convnets.preprocessing.pipeline.prepare_batch`); default: exact.

    Yields:
        ``(input, vector)``: ``vector`` is a float32 numpy array of D values.

    Raises:
        InvalidArgumentError: bad options (on the first ``next``).
        ImageLoadError: with ``on_error="raise"``, for the first unreadable input.
    """
    if on_error not in ("skip", "raise"):
        raise InvalidArgumentError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    net: Any = features_model(model, layer, precision=precision, device=device, compile=compile, engine=engine,
                              cache=cache, settings=settings)
    chosen = resolve_decoding(model, None, preset=preset, image_size=image_size, resize_size=resize_size,
                              timeout=timeout, workers=workers, allow_private=allow_private, fast_decode=fast_decode)
    for result in embed_items(net, iter_inputs(inputs, recursive=recursive), normalize=normalize,
                              batch_size=batch_size, device=net.device, decoding=chosen):
        if result.error is not None:
            if on_error == "raise":
                raise result.error
            log.warning("skipping %s: %s", result.input, result.error)
            continue
        assert result.vector is not None
        yield result.input, result.vector
