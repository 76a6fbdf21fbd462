"""Model names, builders and the one private function that does all building and loading.

Every way of getting a model (these builders, :func:`get_model`, the torch.hub entry points, the
command line) goes through :func:`_build`: architecture spec from :data:`MODEL_SPECS`, weights from
a file or the verified cache (:mod:`convnets.weights`), then device and memory format.

The builders themselves (``resnet50``, ``resnext101_32x4d``, ``se_resnext101_32x4d``) are explicit
functions in :mod:`convnets.builders`, each decorated with :func:`builder`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

import torch
from torch import nn

from convnets.errors import (InvalidArgumentError, UnknownArgumentError, UnknownModelError, WeightsUnavailableError,
                             message_for, short_repr)
from convnets.models.features import DEFAULT_OUT_INDICES, ResNetFeatures, resolve_out_indices
from convnets.models.resnet import ResNet, check_backbone_options, freeze_batchnorm
from convnets.models.specs import (ARCH_FIELDS, MODEL_SPECS, MODELS, ArchSpec, check_num_classes, list_models,
                                   registered_name)
from convnets.weights.record import ModelRecord
from convnets.weights.download import fetch_weights
from convnets.weights.layouts import infer_spec
from convnets.weights.load import build_model, check_fits, meta_model, read_state_dict
from convnets.weights.manifest import load_manifest

__all__ = ["Builder", "ChosenModel", "builder", "check_classifier_kwargs", "choose_model", "fetch_pretrained",
           "get_model", "list_models", "load_model"]

log = logging.getLogger(__name__)

#: The seed of :func:`choose_model`'s random weights: one set of weights per architecture, every run.
RANDOM_INIT_SEED = 0

_Model = TypeVar("_Model", bound=nn.Module)

# Upstream's model keywords. ``trt`` switched upstream's SE block to 1x1 convolutions so that
# TensorRT could import it; our SE block exports to ONNX / TensorRT as it is, so it is accepted and
# has nothing to change.
_MODEL_KWARGS = ("last_bn_0_init", "conv_init", "fused_se")
_IGNORED_KWARGS = ("trt",)
# Backbone options, as timm, torchvision and mmdetection spell them (see convnets.models.features).
_BACKBONE_MODEL_KWARGS = ("output_stride", "frozen_stages", "norm_eval")
_BACKBONE_KWARGS = ("features_only", "out_indices", "norm_layer", *_BACKBONE_MODEL_KWARGS)


def _canonical_name(name: str) -> str:
    # Upstream's training scripts spell them "se-resnext101-32x4d".
    key = str(name).strip().lower().replace("-", "_")
    if key not in MODEL_SPECS:
        raise UnknownModelError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}")
    return key


def _build(
    name: str,
    pretrained: bool = False,
    *,
    pretrained_from_file: str | os.PathLike[str] | None = None,
    num_classes: int | None = None,
    progress: bool = True,
    memory_format: torch.memory_format | None = None,
    device: torch.device | str | None = None,
    state_dict_key_map_fn: Callable[[str], str] | None = None,
    use_ema: bool = False,
    features_only: bool = False,
    out_indices: Sequence[int] | int | None = None,
    norm_layer: object = None,
    **kwargs: Any,
) -> ResNet | ResNetFeatures:
    overrides = {k: kwargs.pop(k) for k in ARCH_FIELDS if k in kwargs}
    model_kwargs = {k: kwargs.pop(k) for k in _MODEL_KWARGS + _BACKBONE_MODEL_KWARGS if k in kwargs}
    for k in _IGNORED_KWARGS:
        kwargs.pop(k, None)
    if kwargs:
        fields = (f"architecture fields are {list(ARCH_FIELDS)}, model options "
                  f"{list(_MODEL_KWARGS + _IGNORED_KWARGS)}, backbone options {list(_BACKBONE_KWARGS)}")
        raise UnknownArgumentError(f"{name}() got unexpected keyword argument(s) {sorted(kwargs)}; {fields}",
                                   cli=f"unknown field(s) {sorted(kwargs)}; {fields}")
    if num_classes is not None:  # before any allocation: a head of 10**12 outputs would exhaust memory
        check_num_classes(num_classes)
    published = MODEL_SPECS[name]
    spec = published.replace(**overrides)
    # Before anything is downloaded or allocated: a mistaken backbone option costs nothing.
    check_backbone_options(spec, **{k: model_kwargs[k] for k in _BACKBONE_MODEL_KWARGS if k in model_kwargs})
    frozen_bn = _is_frozen_norm(norm_layer)
    if not isinstance(features_only, bool):
        raise InvalidArgumentError(f"features_only must be True or False, got {short_repr(features_only)}",
                                   keyword="features_only")
    if features_only:
        out_indices = resolve_out_indices(DEFAULT_OUT_INDICES if out_indices is None else out_indices,
                                          len(spec.layers) + 1)
        if num_classes is not None:
            raise InvalidArgumentError("num_classes does not apply to features_only=True: the backbone has no "
                                       "classifier", keyword="num_classes")
    elif out_indices is not None:
        raise InvalidArgumentError("out_indices applies to features_only=True only", keyword="out_indices")

    if pretrained_from_file is not None:
        source = Path(pretrained_from_file)
    elif pretrained:
        if spec != published:
            raise InvalidArgumentError(f"the pretrained {name} weights fit only the published architecture; "
                                       f"drop the overrides {sorted(overrides)} or pass pretrained_from_file")
        source = fetch_pretrained(name, progress=progress, key_map_fn=state_dict_key_map_fn)
    else:
        with torch.device(device or "cpu"):
            model = ResNet(spec, 1000 if num_classes is None else num_classes, **model_kwargs)
        return _place(_backbone(model, features_only, out_indices, frozen_bn), device, memory_format)

    state_dict, metadata, layout = read_state_dict(source, key_map_fn=state_dict_key_map_fn, use_ema=use_ema)
    model = build_model(spec, state_dict, num_classes=num_classes, model_kwargs=model_kwargs,
                        model_name=name, source=str(source), layout=layout)
    _apply_metadata(model, ModelRecord.from_metadata(metadata))
    return _place(_backbone(model, features_only, out_indices, frozen_bn), device, memory_format)


def _is_frozen_norm(norm_layer: object) -> bool:
    """Whether ``norm_layer`` asks for torchvision's FrozenBatchNorm2d (else plain BatchNorm2d)."""
    if norm_layer is None or norm_layer is nn.BatchNorm2d or norm_layer == "batchnorm2d":
        return False
    if norm_layer == "frozenbatchnorm2d":
        return True
    from torchvision.ops import FrozenBatchNorm2d  # torchvision only when a class is passed

    if norm_layer is FrozenBatchNorm2d:
        return True
    raise InvalidArgumentError(f"norm_layer must be torch.nn.BatchNorm2d (the default) or "
                               f"torchvision.ops.FrozenBatchNorm2d (or timm's names 'batchnorm2d', "
                               f"'frozenbatchnorm2d'), got {short_repr(norm_layer)}", keyword="norm_layer")


def _backbone(model: ResNet, features_only: bool, out_indices: Sequence[int] | int | None,
              frozen_bn: bool) -> ResNet | ResNetFeatures:
    """The built classifier as asked: with frozen BatchNorm, and without its head (``features_only``)."""
    if frozen_bn:
        freeze_batchnorm(model)
    if not features_only:
        return model
    return ResNetFeatures(model, DEFAULT_OUT_INDICES if out_indices is None else out_indices)


def fetch_pretrained(name: str, *, progress: bool = True,
                     key_map_fn: Callable[[str], str] | None = None) -> Path:
    """Download (or find in the cache) and verify the pretrained checkpoint of model ``name``.

    Returns:
        The path of the verified cached file.

    Raises:
        UnknownModelError: no such model. WeightsUnavailableError: the model has no pretrained
            weights in the manifest, or see :func:`fetch_weights`.
    """
    name = _canonical_name(name)
    manifest = load_manifest()
    if name not in manifest:
        problem = f"no pretrained weights are published for {name} (weights exist for: {', '.join(sorted(manifest))})"
        raise WeightsUnavailableError(
            f"{problem}; build it with pretrained=False (command line: --random-init) or load your own checkpoint "
            "with pretrained_from_file=PATH (--weights PATH)",
            cli=f"{problem}; use --random-init, or load your own checkpoint with --weights FILE",
            keyword="pretrained_from_file")
    validate = functools.partial(_validate, name=name, spec=MODEL_SPECS[name], key_map_fn=key_map_fn)
    return fetch_weights(manifest[name], progress=progress, validate=validate)


def _validate(path: Path, *, name: str, spec: ArchSpec, key_map_fn: Callable[[str], str] | None) -> None:
    """Check that a downloaded file holds ``spec``'s tensors before it enters the cache."""
    state_dict, _, layout = read_state_dict(path, key_map_fn=key_map_fn)
    check_fits(meta_model(spec, state_dict), state_dict, model_name=name, source=path.name, layout=layout)


def _place(model: _Model, device: torch.device | str | None, memory_format: torch.memory_format | None) -> _Model:
    if device is not None:
        model = model.to(device)
    if memory_format is not None:
        model = model.to(memory_format=memory_format)
    return model


def _apply_metadata(model: ResNet, record: ModelRecord) -> None:
    """Keep what a self-describing checkpoint says about its head and input size."""
    if record.class_names is not None and len(record.class_names) == model.num_classes:
        model.class_names = list(record.class_names)
    if record.image_size is not None:
        model.input_size = record.image_size
    if record.multilabel:
        model.multilabel = True
        thresholds = record.thresholds
        # A file without (fitting) thresholds: the sigmoid's natural cut.
        model.thresholds = list(thresholds) if thresholds is not None and len(thresholds) == model.num_classes \
            else [0.5] * model.num_classes


_BUILDER_DOC = """
    Args:
        pretrained: load NVIDIA's ImageNet weights (downloaded once, verified, cached under
            ``torch.hub.get_dir()/checkpoints``; ``CONVNETS_WEIGHTS_MIRROR`` replaces the host).
        pretrained_from_file: load the weights from this checkpoint instead (no download, whatever
            ``pretrained`` says). Any known layout: NGC 20.06, upstream ``layers.N``, training
            checkpoints, timm's ``resnext101_32x4d``.
        num_classes: classifier outputs. ``None`` keeps the checkpoint's head (1000 without
            weights); another number keeps the pretrained backbone and starts a fresh head.
        progress: show a download progress bar.
        memory_format: e.g. ``torch.channels_last``.
        device: where the model's tensors go.
        state_dict_key_map_fn: upstream's hook, applied to each checkpoint key before conversion.
        use_ema: load ``state_dict_ema`` from a training checkpoint.
        features_only: return the backbone alone (a ``ResNetFeatures``: ``model(x)`` is a list of
            feature maps, ``model.feature_info`` describes them), as timm's ``features_only``; the
            weights load as for the classifier and its head is dropped.
        out_indices: with ``features_only``, the feature maps to return: 0 the stem's (stride 2),
            1 .. 4 the stages' (C2 .. C5); default ``(1, 2, 3, 4)``; an int N: the last N.
        output_stride: 32 (default), 16 or 8: the last stages dilate instead of striding.
        frozen_stages: -1 (default) nothing, 0 the stem, N the stem and the first N stages get no
            gradient and stay in eval mode (mmdetection's meaning).
        norm_eval: BatchNorm statistics stay fixed when the model is put in train mode.
        norm_layer: ``torchvision.ops.FrozenBatchNorm2d`` (or ``"frozenbatchnorm2d"``) replaces
            every BatchNorm with a frozen one, as torchvision's and detectron2's detectors do;
            default ``torch.nn.BatchNorm2d``.
        **kwargs: architecture overrides (``layers``, ``widths``, ``expansion``, ``cardinality``,
            ``se_squeeze``, ``stem_width``) and upstream's model options (``last_bn_0_init``,
            ``conv_init``, ``fused_se``, ``trt``). Anything else raises ``UnknownArgumentError``
            (a ``TypeError``).

    Returns:
        The model (a ``ResNet``; with ``features_only``, a ``ResNetFeatures``); in eval mode when
        weights were loaded, in train mode otherwise.

    Raises:
        WeightsUnavailableError: the weights could not be downloaded and are not cached, or this
            model has no published weights.
        InvalidArgumentError: ``pretrained=True`` with architecture overrides.
        CheckpointError: the checkpoint is unreadable or does not fit the architecture.
"""


class Builder(Protocol):
    """What type checkers know of every generated builder (``convnets.resnet50``, ...): a ``ResNet``,
    or with ``features_only=True`` a ``ResNetFeatures``."""

    @overload
    def __call__(self, pretrained: bool = False, *, features_only: Literal[False] = False,
                 **kwargs: Any) -> ResNet: ...
    @overload
    def __call__(self, pretrained: bool = False, *, features_only: Literal[True], **kwargs: Any) -> ResNetFeatures: ...
    @overload
    def __call__(self, pretrained: bool = False, *, features_only: bool,
                 **kwargs: Any) -> ResNet | ResNetFeatures: ...


def builder(function: Callable[..., ResNet | ResNetFeatures]) -> Builder:
    """Declare ``function`` the builder of the registered model of the same name: it gets the shared
    keywords' documentation and :class:`Builder`'s types (a classifier, or with ``features_only=True``
    a backbone), which it returns by calling :func:`_build`.

    Raises:
        InvalidArgumentError: no model of that name is registered (``register_model`` first).
    """
    if function.__name__ not in MODELS:
        raise InvalidArgumentError(f"builder {function.__name__!r} has no registered model; call "
                                   "convnets.models.specs.register_model first")
    function.__doc__ = (function.__doc__ or "").rstrip() + "\n" + _BUILDER_DOC
    return function  # type: ignore[return-value]  # its overloads are the keywords' documented meaning


@overload
def get_model(name: str, pretrained: bool = False, *, features_only: Literal[False] = False,
              **kwargs: Any) -> ResNet: ...
@overload
def get_model(name: str, pretrained: bool = False, *, features_only: Literal[True],
              **kwargs: Any) -> ResNetFeatures: ...
@overload
def get_model(name: str, pretrained: bool = False, *, features_only: bool,
              **kwargs: Any) -> ResNet | ResNetFeatures: ...
def get_model(name: str, pretrained: bool = False, **kwargs: Any) -> ResNet | ResNetFeatures:
    """Build a registered model by name (see :func:`list_models`).

    Args:
        name: e.g. ``"se_resnext101_32x4d"`` (upstream's ``"se-resnext101-32x4d"`` also works).
        pretrained, **kwargs: as for the builders, e.g. ``help(convnets.se_resnext101_32x4d)``;
            ``features_only=True`` returns the backbone (a ``ResNetFeatures``), as timm's
            ``create_model`` does.

    Raises:
        UnknownModelError: ``name`` is not registered; the message lists the valid names.
    """
    return _build(_canonical_name(name), pretrained, **kwargs)


def load_model(path: str | os.PathLike[str], *, device: torch.device | str | None = None,
               memory_format: torch.memory_format | None = None, use_ema: bool = False) -> ResNet:
    """Rebuild a model from a checkpoint alone: architecture, head and class names.

    Works with this package's training checkpoints (which record ``arch_spec`` and
    ``class_names``) and, by reading the architecture off the tensor shapes, with any other
    checkpoint layout that the builders accept.

    Args:
        path: the checkpoint.
        device: where the model's tensors go.
        memory_format: e.g. ``torch.channels_last``.
        use_ema: load ``state_dict_ema`` from a training checkpoint.

    Returns:
        The model in eval mode; ``model.class_names`` holds the class names if the file has them.
    """
    # A training checkpoint (TrainingCheckpoint) records its architecture; any other layout has
    # it read off the tensor shapes.
    state_dict, metadata, layout = read_state_dict(path, use_ema=use_ema)
    record = ModelRecord.from_metadata(metadata)
    spec = record.spec(source=str(path))
    if spec is None:
        spec, _ = infer_spec(state_dict, source=str(path))
    name = registered_name(spec) or "custom ResNet"
    model = build_model(spec, state_dict, model_name=name, source=str(path), layout=layout)
    _apply_metadata(model, record)
    return _place(model, device, memory_format)


def check_classifier_kwargs(kwargs: Mapping[str, Any], option: str = "arch_kwargs") -> None:
    """Raise :class:`InvalidArgumentError` if ``kwargs`` would build a backbone where a classifier is needed.

    Args:
        kwargs: keywords for :func:`get_model` (e.g. ``--arch-kwargs``).
        option: how the caller's interface spells them, for the message.
    """
    if kwargs.get("features_only") or "out_indices" in kwargs:
        problem = "features_only and out_indices build a backbone without a classifier; this needs the classifier"
        raise InvalidArgumentError(f"{option}: {problem}", cli=f"--arch-kwargs: {problem}", keyword="arch_kwargs")


@dataclass(frozen=True)
class ChosenModel:
    """A model picked by :func:`choose_model` and where its weights came from.

    Attributes:
        model: the network, in eval mode.
        name: the registry name, or ``"resnet_custom"`` for a checkpoint of an unregistered architecture.
        weights: ``"pretrained"``, ``"random-init"`` or the checkpoint path.
    """

    model: ResNet
    name: str
    weights: str


def choose_model(name: str | None = None, *, path: str | os.PathLike[str] | None = None, pretrained: bool = False,
                 arch_kwargs: Mapping[str, Any] | None = None, device: torch.device | str | None = None,
                 image_size: int = 224, names: Mapping[str, str] | None = None) -> ChosenModel:
    """The model that a name, a checkpoint or both describe, in eval mode: what every command builds.

    * ``path``: :func:`load_model` of the checkpoint, which defines the architecture; ``name`` is then
      optional and, when given, must name that same architecture (a check, never a conversion).
    * otherwise ``name`` with NVIDIA's weights (``pretrained=True``) or random weights whose
      BatchNorm statistics are measured on random ``image_size`` inputs (meaningless outputs, for
      trying the tools offline and timing); ``arch_kwargs`` changes the architecture of the latter.
      Random weights are the same on every call (seed :data:`RANDOM_INIT_SEED`, the global random
      state left as it was), so that the engine cache reuses their entry; their ``input_size`` is
      ``image_size``.

    Args:
        name: a registered model (:func:`list_models`); required without ``path``.
        path: a checkpoint in any layout :func:`load_model` reads.
        pretrained: NVIDIA's ImageNet weights instead of random ones (without ``path``).
        arch_kwargs: architecture overrides (:func:`get_model`'s), random weights only.
        device: where the model goes (default: the CPU).
        image_size: the input size at which random weights' BatchNorm statistics are measured.
        names: how the caller's interface spells these keywords in messages (``{"name": "--model",
            ...}``, also ``"random_init"`` for ``pretrained=False``); default: the keywords.

    Raises:
        InvalidArgumentError: inconsistent arguments (``arch_kwargs`` with a checkpoint or
            pretrained weights, a checkpoint whose architecture is not ``name``'s, no model at all,
            overrides the architecture refuses).
        CheckpointError, WeightsUnavailableError: from loading.
    """
    words = {"name": "name", "path": "path", "arch_kwargs": "arch_kwargs", "random_init": "pretrained=False",
             **(names or {})}
    if path is not None:
        if arch_kwargs:
            raise InvalidArgumentError(f"{words['arch_kwargs']} does not apply to {words['path']}: the checkpoint "
                                       "defines the architecture", keyword="arch_kwargs")
        loaded = load_model(path, device=device)
        if name and loaded.spec != MODEL_SPECS[_canonical_name(name)]:
            raise InvalidArgumentError(f"{path} holds a different architecture than {words['name']} {name} "
                                       f"({loaded.spec}); drop {words['name']} to use the checkpoint as it is",
                                       keyword="name")
        return ChosenModel(loaded.eval(), name or registered_name(loaded.spec) or "resnet_custom", str(path))
    if not name:
        raise InvalidArgumentError(f"{words['name']} is required unless {words['path']} is given", keyword="name")
    if pretrained:
        if arch_kwargs:
            raise InvalidArgumentError(f"{words['arch_kwargs']} changes the architecture, so it needs "
                                       f"{words['random_init']} or {words['path']}", keyword="arch_kwargs")
        try:
            return ChosenModel(get_model(name, pretrained=True, device=device).eval(), name, "pretrained")
        except WeightsUnavailableError as e:  # its advice in the caller's words: its keyword for a checkpoint
            if not words["path"].isidentifier():  # the command line's --weights: the error's cli message says it
                raise
            raise e.for_keyword(words["path"]) from None
    log.warning("using randomly initialised weights: the outputs mean nothing")
    check_classifier_kwargs(arch_kwargs or {}, words["arch_kwargs"])
    try:
        # The same weights on every run (the caller's random state untouched): the engine cache's key
        # is the weights' digest, so each run would otherwise convert anew and add an entry.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_INIT_SEED)
            model = get_model(name, **(arch_kwargs or {}))
    except (TypeError, ValueError) as e:  # an unknown field name, or a value the spec refuses
        if isinstance(e, UnknownModelError):
            raise
        raise InvalidArgumentError(f"{words['arch_kwargs']}: {message_for(e, 'python' if names is None else 'cli')}",
                                   keyword="arch_kwargs") from e
    from convnets.deploy.calibrate import calibrate_batchnorm  # torch only; keeps deploy out of model building

    calibrate_batchnorm(model, image_size=image_size)
    model.input_size = image_size  # measured there; engines build their graph for it (one, not also 224)
    if device is not None:
        model = model.to(device)
    return ChosenModel(model.eval(), name, "random-init")
