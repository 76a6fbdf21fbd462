"""``convnets serve``: a classifier behind the Triton Inference Server (KServe v2 over HTTP and gRPC).

Examples::

    convnets serve --weights checkpoint.pth.tar
    convnets serve --model resnet50 --host 0.0.0.0 --max-batch-size 32
    convnets serve --repository models/       # what `convnets export --triton --triton-backend python` wrote

The model is loaded here first, with the options ``convnets predict`` takes, so that a bad option
fails at once and the engine's converted graph is in the engine cache; then a model repository
(:mod:`convnets.serve.repository`) is written to a temporary directory and served
(:mod:`convnets.serve.server`), whose backend loads the same model again, from the cache. One line
on stdout names the endpoints once the server is ready; SIGINT or SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from convnets.commands.batch_options import add_decode_argument, add_fast_decode_argument
from convnets.commands.model_options import (add_model_arguments, add_topk_argument, known_classes, load_from_args,
                                             resolve_topk)
from convnets.commands.options import add_image_size_argument, batch_size, non_negative_int, positive_int
from convnets.commands.run_options import (add_cache_argument, add_device_argument, add_engine_argument,
                                           add_precision_argument, device_from_args)
from convnets.constants import DEFAULT_MODEL
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    from convnets.serve.repository import ServedModel
    from convnets.serve.server import Endpoints

__all__ = ["add_arguments", "run"]

DEFAULT_MAX_BATCH_SIZE = 16
DEFAULT_QUEUE_DELAY_MS = 5.0


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60_000:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds from 0 to 60000, got {text!r}")
    return value


def _port(text: str) -> int:
    value = int(text) if text.strip().isdigit() and len(text.strip()) <= 5 else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535 (0: any free port), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    from convnets.runtime import usable_cores  # no PyTorch: os only
    from convnets.serve.server import (DEFAULT_GRPC_PORT, DEFAULT_HTTP_PORT, DEFAULT_MAX_REQUEST_BYTES,
                                       DEFAULT_METRICS_PORT)

    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    model = parser.add_argument_group("served model")
    model.add_argument("--repository", metavar="DIR", default=None,
                       help="serve this Triton model repository instead of a model (no model options): one that "
                            "`convnets export --triton --triton-backend python` wrote")
    model.add_argument("--name", default=None,
                       help="the model's name on the server, /v2/models/NAME (default: the architecture's name)")
    add_topk_argument(model, what="classes in the top_labels / top_indices / top_probabilities outputs")
    model.add_argument("--embedding", action="store_true",
                       help="also output `embedding`: the pooled layer4 features the classifier reads "
                            "(computed in the same pass)")
    add_device_argument(model)
    add_precision_argument(model, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs)")
    add_engine_argument(model)
    add_cache_argument(model)
    add_image_size_argument(model, default=None,
                            help="center-crop size; the shorter side is resized to PX*256/224 first (default: what "
                                 "the weights were trained for, 224 for the NGC weights)")
    add_fast_decode_argument(model)
    add_decode_argument(model)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    server.add_argument("--http-port", type=_port, default=DEFAULT_HTTP_PORT, metavar="PORT",
                        help=f"KServe v2 HTTP/REST (default {DEFAULT_HTTP_PORT}; 0: any free port, named when ready)")
    server.add_argument("--grpc-port", type=_port, default=DEFAULT_GRPC_PORT, metavar="PORT",
                        help=f"KServe v2 gRPC (default {DEFAULT_GRPC_PORT}; 0: any free port)")
    server.add_argument("--metrics-port", type=_port, default=DEFAULT_METRICS_PORT, metavar="PORT",
                        help=f"Prometheus metrics at /metrics (default {DEFAULT_METRICS_PORT}; 0: any free port)")
    server.add_argument("--max-request-mb", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES >> 20, metavar="MB",
                        help="the largest request body (HTTP) or message (gRPC) accepted; a larger one is refused "
                             f"before it is read (default {DEFAULT_MAX_REQUEST_BYTES >> 20})")
    server.add_argument("--max-batch-size", type=batch_size, default=DEFAULT_MAX_BATCH_SIZE, metavar="N",
                        help="the most images the model runs at once, from one request or several put together "
                             f"by the dynamic batcher; also the most a request may send (default "
                             f"{DEFAULT_MAX_BATCH_SIZE})")
    server.add_argument("--max-queue-delay-ms", type=_milliseconds, default=DEFAULT_QUEUE_DELAY_MS, metavar="MS",
                        help="how long a request may wait for others to form a larger batch; requests that "
                             "arrive while the model runs are batched anyway (default "
                             f"{DEFAULT_QUEUE_DELAY_MS:g})")
    server.add_argument("--threads", type=non_negative_int, default=0, metavar="N",
                        help="threads of the model instance, for PyTorch and for decoding a batch's images (0, the "
                             f"default: the usable cores, here {usable_cores()}). One instance runs one batch at a "
                             "time, so concurrent requests share these cores instead of competing for them")


def run(args: argparse.Namespace) -> int:
    """Run ``convnets serve`` until SIGINT or SIGTERM; 0 when stopped by one of them."""
    from convnets.serve.server import Endpoints, TritonServer, stop_on_signals, triton_distribution

    endpoints = Endpoints(args.host, args.http_port, args.grpc_port, args.metrics_port).resolved()
    given = _check_repository(args) if args.repository is not None else None
    if args.name is not None:
        _check_name(args.name)
    if given is None and args.topk is not None and (classes := known_classes(args)) is not None:
        resolve_topk(args.topk, classes)  # before the model loads (seconds): the checkpoint's head, or the manifest
    triton_distribution()  # the serve extra is installed: checked before a model loads
    with tempfile.TemporaryDirectory(prefix="convnets-serve-") as workspace:
        if given is not None:
            repository = given
            names = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
        else:
            from convnets.serve.repository import write_repository

            served = _served_model(args)
            repository = Path(workspace) / "models"
            repository.mkdir()
            write_repository(repository, served)
            names = [served.name]
        stopped = stop_on_signals()
        try:
            with TritonServer(repository, endpoints, verbose=args.verbose > 0, workspace=workspace,
                              max_request_bytes=args.max_request_mb << 20) as server:
                print(_listening(names, server.endpoints), flush=True)
                server.wait()  # until a signal; restarts a crashed server, raises ServeError if it cannot
        except stopped as signal_name:
            print(f"convnets serve: stopped ({signal_name})", file=sys.stderr, flush=True)
    return 0


def _listening(names: list[str], endpoints: Endpoints) -> str:
    urls = endpoints.urls()
    models = ", ".join(repr(n) for n in names)
    return (f"convnets serve: model {models} ready (KServe v2): HTTP {urls['http']}, gRPC {urls['grpc']}, "
            f"metrics {urls['metrics']}")


_MODEL_OPTIONS = ("model", "weights", "name", "topk", "embedding", "image_size", "fast_decode")


def _check_repository(args: argparse.Namespace) -> Path:
    """``--repository DIR``, checked: a directory with at least one model, and no model options."""
    given = [f"--{o.replace('_', '-')}" for o in _MODEL_OPTIONS if getattr(args, o)]
    given += ["--decode"] if args.decode != "auto" else []
    if given:
        raise InvalidArgumentError(f"--repository serves the models it holds as they are; drop {', '.join(given)}")
    repository = Path(args.repository)
    if not repository.is_dir() or not any(repository.glob("*/config.pbtxt")):
        raise InvalidArgumentError(f"--repository {args.repository}: not a Triton model repository (no "
                                   "NAME/config.pbtxt in it); write one with convnets export --triton")
    return repository


def _check_name(name: str) -> None:
    from convnets.deploy.triton.config import check_model_name

    try:
        check_model_name(name)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"--name {name!r}: {e}") from e


def _served_model(args: argparse.Namespace) -> ServedModel:
    """Load the model as the options say (here, so that their errors come at once and the engine's graph is
    cached for the server) and describe it for the repository."""
    import gc

    from convnets.deploy.optimize import optimize_for_inference
    from convnets.inference.embed import features_model
    from convnets.preprocessing.classes import class_labels
    from convnets.preprocessing.io import DEFAULT_MAX_BYTES
    from convnets.runtime import usable_cores
    from convnets.serve.repository import ServedModel

    device = device_from_args(args)
    loaded = load_from_args(args, device=device)
    model = loaded.model
    labels = class_labels(model)
    topk = resolve_topk(args.topk, len(labels))  # the default: 5, or all the classes of a smaller model
    if args.embedding:
        net = features_model(model, "layer4", precision=args.precision, device=device, engine=args.engine,
                             cache=args.cache)
    else:
        net = optimize_for_inference(model, args.precision, device=device, engine=args.engine, compile=False,
                                     cache=args.cache)
    served = ServedModel(
        name=args.name or loaded.name, model=loaded.name,
        weights=str(Path(loaded.weights).resolve()) if args.weights else None,
        pretrained=args.weight_source == "pretrained", arch_kwargs=args.arch_kwargs,
        image_size=args.image_size or model.input_size,
        # The engine auto picked: the server builds that one (from the cache), without checking again.
        engine=str(getattr(net, "engine", args.engine)), precision=args.precision, device=str(device),
        cache=args.cache, fast_decode=args.fast_decode, decode=args.decode, topk=topk, embedding=args.embedding,
        threads=args.threads or usable_cores(), max_batch_size=args.max_batch_size,
        max_queue_delay_us=round(args.max_queue_delay_ms * 1000), max_image_bytes=DEFAULT_MAX_BYTES,
        labels=tuple(labels), num_features=int(getattr(model, "num_features", 0)),
        thresholds=None if (cuts := model.decision_thresholds()) is None else tuple(cuts))
    del net, model, loaded
    gc.collect()  # the server's own copy is loaded in its process; this one is not needed any more
    return served
