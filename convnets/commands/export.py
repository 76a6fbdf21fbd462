"""``convnets export``: one file per registered format, verified, optionally as a Triton model repository.

The formats, their help lines and their own options (``--opset`` for ONNX) come from the registry
in :mod:`convnets.deploy.formats`; this module knows none of them by name.

Examples::

    convnets export --model se_resnext101_32x4d --format onnx --output exported/
    convnets export --model resnext101_32x4d --format openvino --triton --max-batch-size 64 --output models/
    convnets export --weights checkpoint.pth.tar --format onnx --triton --triton-backend python --output models/
    convnets export --weights checkpoint.pth.tar --format aoti --output exported/
    convnets export --weights checkpoint.pth.tar --format onnx --precision fp16 --output exported/
    convnets export --model resnext101_32x4d --format timm --output resnext101_32x4d.nvidia/
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.commands.batch_options import add_private_urls_argument
from convnets.commands.model_options import add_model_arguments, load_from_args
from convnets.commands.options import (add_force_argument, add_image_size_argument, add_json_argument,
                                       add_output_argument, batch_size)
from convnets.commands.path_checks import check_inputs_exist, check_output_directory, usage_errors
from convnets.commands.run_options import add_precision_argument
from convnets.constants import DEFAULT_IMAGE_SIZE, TRITON_BACKENDS
from convnets.deploy.formats import EXPORT_PRECISIONS, ExportFormat, export_formats, get_format
from convnets.errors import InvalidArgumentError, message_for
from convnets.models.specs import MODEL_SPECS

if TYPE_CHECKING:
    from convnets.deploy.export import ExportResult

DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_FORMAT = "onnx"


_FP16_NOTE = ("fp16 was verified on this machine's CPU: exporters' CPU runtimes may run fp16 nodes through "
              "fp32 casts, and PyTorch's CPU fp16 kernels are not a GPU's; check accuracy on the serving GPU too")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options (the format list and each format's own options come from the registry)."""
    add_model_arguments(parser, default_weights="pretrained")
    formats = export_formats()
    parser.add_argument("--format", choices=[f.name for f in formats], default=DEFAULT_FORMAT,
                        help="; ".join(f.help_line() for f in formats) + f"; default: {DEFAULT_FORMAT}")
    add_precision_argument(parser, choices=EXPORT_PRECISIONS,
                           help="weights and arithmetic; input and output stay float32 (default: fp32)")
    add_output_argument(parser, metavar="DIR", required=True,
                        help="directory (created) that gets the format's files; with --triton, the model repository")
    parser.add_argument("--triton", action="store_true",
                        help="write DIR/<name>/config.pbtxt and DIR/<name>/1/<the format's files> for Triton "
                             "(formats: " + ", ".join(f.name for f in formats if f.serves_on_triton) + ")")
    parser.add_argument("--triton-backend", choices=TRITON_BACKENDS, default=None,
                        help="with --triton: native (default) uses the format's own Triton backend, as NGC's Triton "
                             "containers run it; python writes a model.py that runs the file with ONNX Runtime or "
                             "OpenVINO in Triton's Python backend (formats: "
                             + ", ".join(f.name for f in formats if f.triton_python_runtime)
                             + "), which the Triton of the serve extra runs: convnets serve --repository DIR")
    parser.add_argument("--name", help="Triton model name (default: the model name)")
    parser.add_argument("--max-batch-size", type=batch_size, metavar="N",
                        help=f"Triton max_batch_size (default: {DEFAULT_MAX_BATCH_SIZE})")
    parser.add_argument("--images", nargs="+", metavar="IMAGE",
                        help="photos (files or http(s) URLs) to verify with (default: the example photos shipped "
                             "with convnets)")
    add_private_urls_argument(parser)
    add_image_size_argument(parser, default=None, help="input size (default: the size the --weights checkpoint was "
                                                       f"trained at, else {DEFAULT_IMAGE_SIZE})")
    add_json_argument(parser, help="the result (files, tensors, verification)")
    add_force_argument(parser, what="the files of an earlier export in DIR (model files, config.pbtxt, README.md, "
                                    "labels.txt, model.py, config.json)")
    for fmt in formats:
        if fmt.options:
            group = parser.add_argument_group(f"--format {fmt.name} options")
            for option in fmt.options:
                # default None: an option given with another --format is an error, not silently ignored
                group.add_argument(option.flag, dest=_dest(fmt, option.name), type=option.type, default=None,
                                   metavar=option.name.upper(), help=f"{option.help} (default: {option.default})")


def _dest(fmt: ExportFormat, option: str) -> str:
    return f"format_{fmt.name}_{option}"


def _format_options(args: argparse.Namespace, fmt: ExportFormat) -> dict[str, Any]:
    """The chosen format's options given on the command line; an option of another format is an error."""
    for other in export_formats():
        for option in other.options:
            if other is not fmt and getattr(args, _dest(other, option.name), None) is not None:
                raise InvalidArgumentError(f"{option.flag} applies to --format {other.name}, not {fmt.name}")
    given = {o.name: value for o in fmt.options if (value := getattr(args, _dest(fmt, o.name), None)) is not None}
    for option in fmt.options:
        if option.name in given and option.check:
            try:
                option.check(given[option.name])
            except InvalidArgumentError as e:  # the format's message names the keyword: name the flag too
                raise InvalidArgumentError(f"{option.flag} {given[option.name]}: {message_for(e, 'cli')}") from e
    return given


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int]:
    """Before anything heavy is imported: ``--weights`` and the local ``--images`` exist, ``--output``
    can be written (usage errors, see :mod:`convnets.cli`); returns the run."""
    with usage_errors():
        check_inputs_exist("--weights", args.weights)
        check_inputs_exist("--images", *(args.images or ()))
        check_output_directory(args.output)
    return lambda: run(args)


def run(args: argparse.Namespace) -> int:
    """Run ``convnets export``."""
    from convnets.deploy.export import export_model, sample_batch
    from convnets.deploy.triton import (check_model_name, check_triton_format, model_version_dir, triton_files,
                                        write_triton_files)
    from convnets.deploy.triton.config import model_config_pb2
    from convnets.fileio import preflight

    fmt = get_format(args.format)
    options = fmt.resolve_options(_format_options(args, fmt))  # bad values fail before the model loads
    if (args.name or args.max_batch_size is not None or args.triton_backend) and not args.triton:
        raise InvalidArgumentError("--name, --max-batch-size and --triton-backend apply to --triton")
    backend = args.triton_backend or TRITON_BACKENDS[0]
    if args.triton:
        check_triton_format(fmt.name, backend)
        model_config_pb2()  # what writes config.pbtxt (the triton extra): missing, say so before the export
    if args.name is not None:  # before the model loads, and named as the option
        try:
            check_model_name(args.name)
        except ValueError as e:
            raise InvalidArgumentError(f"--name {args.name!r}: {message_for(e, 'cli')}") from e
    max_batch_size = DEFAULT_MAX_BATCH_SIZE if args.max_batch_size is None else args.max_batch_size
    fmt.check_precision(args.precision)
    if args.model in MODEL_SPECS and not (args.weights or args.arch_kwargs):  # else checked once it is loaded
        fmt.check_architecture(MODEL_SPECS[args.model])
    fmt.check_dependencies()  # before loading (or downloading) the model
    # --random-init measures its BatchNorm statistics at --image-size, else at 224, which is also
    # what a freshly built model records.
    loaded = load_from_args(args)
    # A checkpoint records the size it was trained at (model.input_size): export that graph unless
    # --image-size says otherwise.
    image_size = args.image_size or getattr(loaded.model, "input_size", DEFAULT_IMAGE_SIZE)
    name = check_model_name(args.name or loaded.name)
    output = Path(args.output)
    path = (model_version_dir(output, name) if args.triton else output) / fmt.file_names[0]
    # Every file this run writes is free (or --force) and reached through no link, before any is written.
    for target in [*fmt.files(path), *(triton_files(output, name, backend) if args.triton else ())]:
        preflight(target, force=args.force, base=output)
    batch, description = sample_batch(args.images, image_size=image_size, allow_private=args.allow_private)
    result = export_model(loaded.model, path, format=fmt.name, precision=args.precision, batch=batch,
                          batch_description=description, image_size=image_size, force=args.force, base=output,
                          **options)
    written = []
    if args.triton:
        written = write_triton_files(output, name, result, max_batch_size=max_batch_size,
                                     class_names=getattr(loaded.model, "class_names", None),
                                     image_size=image_size, backend=backend, force=args.force)
    if args.json:
        report = {"model": loaded.name, "weights": loaded.weights, **result.to_dict()}
        if args.precision == "fp16":
            report["note"] = _FP16_NOTE
        if args.triton:
            report["triton"] = {"repository": str(output), "name": name, "max_batch_size": max_batch_size,
                                "backend": backend, "files": [str(p) for p in written]}
        print(json.dumps(report, indent=2))
        return 0
    _print_summary(loaded.name, loaded.weights, result)
    if args.precision == "fp16":
        print(f"note: {_FP16_NOTE}")
    if args.triton:
        print(f"Triton model repository {output}: model {name!r}, max_batch_size {max_batch_size}; "
              f"see {output / name / 'README.md'}")
        if backend == "python":
            print(f"  serve: convnets serve --repository {output.resolve()}")
        else:
            print(f"  serve: tritonserver --model-repository={output.resolve()}")
    return 0


def _print_summary(model: str, weights: str, result: ExportResult) -> None:
    v = result.verification
    runtime = get_format(result.format).runtime
    written = ", ".join(str(p) for p in result.files)
    print(f"exported {model} ({weights} weights) to {written} [{result.format}, {result.precision}]")
    print(f"  input  {result.input_name!r}: float32 {list(result.input_shape)}   (-1: dynamic batch)")
    print(f"  output {result.output_name!r}: float32 {list(result.output_shape)}")
    print(f"  verified with {runtime} at batch sizes {list(v.batch_sizes)} on {v.inputs}: max abs error "
          f"{v.max_abs_error:.3g}, relative {v.max_rel_error:.3g}, min cosine {v.min_cosine:.6f}, "
          f"top-1 agreement {v.top1_agreement:.0%} (required: {v.tolerance})")
