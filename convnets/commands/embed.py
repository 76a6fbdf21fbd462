"""``convnets embed``: one vector per image, the pooled output of a ResNet stage, written to a file.

``--output FILE.npy`` writes float32 ``[N, D]`` with the inputs in ``FILE.npy.inputs.txt`` (same
order); ``--output FILE.parquet`` columns ``input`` and ``embedding``. Records stream into
``FILE.partial.jsonl`` as batches finish and FILE is written from it at the end, so a killed run
continues with ``--resume`` (see :mod:`convnets.inference.outputs`). Inputs that cannot be read are reported on stderr, get
no vector and leave the exit status at 1. The inputs, batches, workers and output options are
``convnets predict``'s (:mod:`convnets.commands.batch_options`), and so is the run around the model
(:mod:`convnets.inference.job`, of which this module is a plug-in), ``--ray ADDRESS`` included: the model
runs on a Ray cluster's actors, this process writes the vectors (:mod:`convnets.ray`).
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from convnets.commands.batch_options import (add_batch_arguments, add_input_arguments, add_output_arguments,
                                             add_progress_argument, add_ray_argument, prepare_job, ray_results)
from convnets.commands.model_options import add_model_arguments, load_from_args
from convnets.commands.run_options import (add_cache_argument, add_compile_argument, add_device_argument,
                                           add_engine_argument, add_engine_settings_arguments, add_precision_argument,
                                           device_from_args, engine_settings_from_args)
from convnets.constants import DEFAULT_MODEL, LAYERS
from convnets.inference.job import BatchJob

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import torch

    from convnets.inference.embed import Embedding
    from convnets.inputs.listing import InputItem
    from convnets.inference.loader import Decoding
    from convnets.inference.outputs.spool import Record
    from convnets.models.resnet import ResNet

__all__ = ["add_arguments", "prepare"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_input_arguments(parser)
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    group = parser.add_argument_group("embedding")
    group.add_argument("--layer", choices=LAYERS, default="layer4",
                       help="the stage whose output is averaged over the image: layer4 (default; the classifier's "
                            "input, 2048 values for the NGC models), layer3 (1024), layer2 (512), layer1 (256)")
    group.add_argument("--normalize", action="store_true", help="L2-normalise each vector")
    add_device_argument(parser)
    add_precision_argument(parser, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). "
                                        "The network runs through --engine as predict's does (torch: "
                                        "BatchNorm folded, channels_last); vectors are float32")
    add_engine_argument(parser, help="what runs the network, cut after --layer (other engines than torch are "
                                     "checked against it as predict's are)")
    add_engine_settings_arguments(parser)
    add_cache_argument(parser)
    add_compile_argument(parser, default=False, help="faster per image, but the first batch waits for the "
                                                     "compilation")
    add_batch_arguments(parser, default_batch_size=16)
    add_output_arguments(
        parser, kind="embeddings", what="the vectors", required=True,
        resume_help="continue the FILE.partial.jsonl that a stopped or killed run left: its torn last record is cut "
                    "away and the inputs it records are skipped")
    add_progress_argument(parser)
    add_ray_argument(parser)


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int] | int:
    """Check the paths on the command line and claim ``--output`` (see
    :func:`~convnets.commands.batch_options.prepare_job`); the run's exit status is 1 if any input could
    not be read."""
    return prepare_job(EmbedJob(args), args, stack)


class EmbedJob(BatchJob):
    """``convnets embed`` as a batch job: a vector per input, spooled, written into ``.npy`` or ``.parquet``."""

    command = "embed"
    kind = "embeddings"
    unreadable = " and have no vector"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model: Any = None

    def device(self) -> torch.device:
        import torch

        # With --ray the model is read here for its width and preset; the actors load it onto their device.
        return torch.device("cpu") if self.args.ray is not None else device_from_args(self.args)

    def load(self, device: torch.device) -> ResNet:
        from convnets.inference.embed import PooledFeatures

        self.model = load_from_args(self.args, device=device).model
        self.width = PooledFeatures(self.model, self.args.layer).num_features
        return self.model

    def results(self, items: Iterator[InputItem], *, decoding: Decoding, batch_size: int, device: torch.device,
                start: int, on_batch: Callable[[int], None]) -> Iterator[Embedding]:
        from convnets.inference.embed import embed_items, features_model

        args = self.args
        if args.ray is not None:
            from convnets.ray import Embedder

            return ray_results(args, Embedder, {"model": self.model, "layer": args.layer, "normalize": args.normalize},
                               items, decoding=decoding, batch_size=batch_size, on_batch=on_batch)
        net = features_model(self.model, args.layer, precision=args.precision, device=device, compile=args.compile,
                             engine=args.engine, cache=args.cache, settings=engine_settings_from_args(args))
        return embed_items(net, items, normalize=self.args.normalize, batch_size=batch_size, device=device,
                           decoding=decoding, start=start, on_batch=on_batch)

    def record(self, result: Embedding, error: str) -> Record:
        """A vector, or the input's error: the spool's records (:mod:`convnets.inference.outputs.spool`)."""
        if result.ok:
            return {"input": result.input, "embedding": result.vector}
        return {"input": result.input, "error": error}

