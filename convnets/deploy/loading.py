"""Model selection shared by the ``export`` and ``benchmark`` commands.

``--model NAME`` picks the architecture; the weights come from ``--weights FILE`` (any checkpoint
:func:`convnets.load_model` reads; it also carries the architecture), NVIDIA's pretrained weights,
or ``--random-init`` (no download: for trying the tools offline or timing; the outputs mean nothing,
but the BatchNorm statistics are measured on random inputs so that the numbers stay in range).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from convnets.models.specs import MODEL_SPECS, registered_name
from convnets.registry import get_model, list_models, load_model

__all__ = ["LoadedModel", "add_model_arguments", "calibrate_batchnorm", "load_from_args"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model picked on the command line and where its weights came from.

    Attributes:
        model: the network, in eval mode.
        name: the registry name, or a name derived from the checkpoint.
        weights: ``"pretrained"``, ``"random-init"`` or the checkpoint path.
    """

    model: nn.Module
    name: str
    weights: str


def add_model_arguments(parser: argparse.ArgumentParser, *, default_weights: str) -> None:
    """Add ``--model``, ``--weights``, ``--pretrained`` / ``--random-init`` and ``--arch-kwargs``.

    Args:
        parser: the subcommand's parser.
        default_weights: ``"pretrained"`` or ``"random-init"``, used when no weights option is given.
    """
    group = parser.add_argument_group("model")
    group.add_argument("--model", choices=list_models(), metavar="NAME",
                       help=f"architecture: {', '.join(list_models())} (optional with --weights)")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--weights", metavar="FILE",
                        help="checkpoint to load (any layout convnets.load_model reads; it sets the architecture)")
    source.add_argument("--pretrained", dest="weight_source", action="store_const", const="pretrained",
                        help="NVIDIA's ImageNet weights (downloaded once and verified)"
                             + (" [default]" if default_weights == "pretrained" else ""))
    source.add_argument("--random-init", dest="weight_source", action="store_const", const="random-init",
                        help="random weights, BatchNorm statistics measured on random inputs: no download, "
                             "meaningless outputs (testing, timing)"
                             + (" [default]" if default_weights == "random-init" else ""))
    group.add_argument("--arch-kwargs", metavar="JSON", type=_json_object, default={},
                       help='architecture overrides with --random-init, e.g. \'{"layers": [1, 1, 1, 1]}\'')
    parser.set_defaults(weight_source=default_weights)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"layers\": [1, 1, 1, 1]}'")
    return value


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """Build the model that the options of :func:`add_model_arguments` describe, in eval mode.

    Raises:
        ValueError: inconsistent options (e.g. ``--arch-kwargs`` with pretrained weights, or a
            checkpoint whose architecture is not ``--model``'s).
        CheckpointError, WeightsUnavailableError: from loading.
    """
    if args.weights:
        if args.arch_kwargs:
            raise ValueError("--arch-kwargs does not apply to --weights: the checkpoint defines the architecture")
        model = load_model(args.weights)
        if args.model and model.spec != MODEL_SPECS[args.model]:
            raise ValueError(f"{args.weights} holds a different architecture than {args.model} "
                             f"({model.spec}); drop --model to use the checkpoint as it is")
        name = args.model or registered_name(model.spec) or "resnet_custom"
        return LoadedModel(model.eval(), name, str(args.weights))
    if not args.model:
        raise ValueError("--model is required unless --weights is given")
    if args.weight_source == "pretrained":
        if args.arch_kwargs:
            raise ValueError("--arch-kwargs changes the architecture, so it needs --random-init or --weights")
        return LoadedModel(get_model(args.model, pretrained=True).eval(), args.model, "pretrained")
    log.warning("using randomly initialised weights (--random-init): the outputs mean nothing")
    try:
        model = get_model(args.model, **args.arch_kwargs)
    except TypeError as e:  # an unknown field name
        raise ValueError(f"--arch-kwargs: {e}") from e
    calibrate_batchnorm(model, image_size=getattr(args, "image_size", 224))
    return LoadedModel(model.eval(), args.model, "random-init")


def calibrate_batchnorm(model: nn.Module, *, image_size: int = 224, batch_size: int = 8, batches: int = 2) -> None:
    """Give every BatchNorm the running statistics of random normal inputs; leaves eval mode.

    A freshly initialised network's BatchNorms are identities (mean 0, variance 1), so activations
    grow block after block: in SE-ResNeXt101 the logits reach thousands, float32 itself is off
    by 6e-4 relative to float64, and fp16 overflows. With measured statistics the activations stay
    in range as in a trained network, so export verification and reduced precision behave as they
    would with real weights.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    generator = torch.Generator().manual_seed(0)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.randn(batch_size, 3, image_size, image_size, generator=generator))
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.eval()
