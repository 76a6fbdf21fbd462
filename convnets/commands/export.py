"""``convnets export``: ONNX or TorchScript files, verified, optionally as a Triton model repository.

Examples::

    convnets export --model se_resnext101_32x4d --format onnx --output exported/
    convnets export --model resnext101_32x4d --format torchscript --triton --max-batch-size 64 --output models/
    convnets export --weights checkpoint.pth.tar --format onnx --precision fp16 --output exported/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from convnets.commands.options import add_model_arguments, add_precision_argument, load_from_args
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    from convnets.deploy.export import ExportResult

DEFAULT_MAX_BATCH_SIZE = 64

# The choices of convnets.deploy.export (EXPORT_FORMATS, EXPORT_PRECISIONS), spelled out here
# because that module imports PyTorch and `--help` must not wait for it;
# tests/test_cli_startup.py checks that the two agree.
FORMATS: tuple[str, ...] = ("onnx", "torchscript")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16")

_FP16_NOTE = ("fp16 was verified on this machine's CPU: ONNX Runtime's CPU provider may run fp16 nodes "
              "through fp32 casts, and PyTorch's CPU fp16 kernels are not a GPU's; check accuracy on the "
              "serving GPU too")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_model_arguments(parser, default_weights="pretrained")
    parser.add_argument("--format", choices=FORMATS, default="onnx",
                        help="onnx (ONNX Runtime, TensorRT, Triton onnxruntime_onnx) or torchscript "
                             "(Triton pytorch_libtorch); default: onnx")
    add_precision_argument(parser, choices=PRECISIONS,
                           help="weights and arithmetic; input and output stay float32 (default: fp32)")
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="output directory (created); with --triton, the model repository")
    parser.add_argument("--triton", action="store_true",
                        help="write DIR/<name>/config.pbtxt and DIR/<name>/1/model.{onnx,pt} for Triton")
    parser.add_argument("--name", help="Triton model name (default: the model name)")
    parser.add_argument("--max-batch-size", type=int, metavar="N",
                        help=f"Triton max_batch_size (default: {DEFAULT_MAX_BATCH_SIZE})")
    parser.add_argument("--images", nargs="+", metavar="IMAGE",
                        help="photos to verify with (default: scikit-image's sample photos when installed)")
    parser.add_argument("--image-size", type=int, default=224, metavar="PX", help="input size (default: 224)")
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``convnets export``."""
    from convnets.deploy.export import FILE_NAMES, export_model, sample_batch
    from convnets.deploy.triton import check_model_name, model_version_dir, write_triton_files

    if (args.name or args.max_batch_size is not None) and not args.triton:
        raise InvalidArgumentError("--name and --max-batch-size apply to --triton")
    max_batch_size = DEFAULT_MAX_BATCH_SIZE if args.max_batch_size is None else args.max_batch_size
    if max_batch_size < 1:
        raise InvalidArgumentError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    loaded = load_from_args(args)
    name = check_model_name(args.name or loaded.name)
    output = Path(args.output)
    path = (model_version_dir(output, name) if args.triton else output) / FILE_NAMES[args.format]
    batch, description = sample_batch(args.images, image_size=args.image_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = export_model(loaded.model, path, format=args.format, precision=args.precision, batch=batch,
                          batch_description=description, image_size=args.image_size, opset=args.opset)
    triton_files = []
    if args.triton:
        triton_files = write_triton_files(output, name, result, max_batch_size=max_batch_size,
                                          class_names=getattr(loaded.model, "class_names", None),
                                          image_size=args.image_size)
    if args.json:
        report = {"model": loaded.name, "weights": loaded.weights, **result.to_dict()}
        if args.precision == "fp16":
            report["note"] = _FP16_NOTE
        if args.triton:
            report["triton"] = {"repository": str(output), "name": name, "max_batch_size": max_batch_size,
                                "files": [str(p) for p in triton_files]}
        print(json.dumps(report, indent=2))
        return 0
    _print_summary(loaded.name, loaded.weights, result)
    if args.precision == "fp16":
        print(f"note: {_FP16_NOTE}")
    if args.triton:
        print(f"Triton model repository {output}: model {name!r}, max_batch_size {max_batch_size}; "
              f"see {output / name / 'README.md'}")
        print(f"  serve: tritonserver --model-repository={output.resolve()}")
    return 0


def _print_summary(model: str, weights: str, result: ExportResult) -> None:
    v = result.verification
    runtime = "ONNX Runtime" if result.format == "onnx" else "torch.jit.load"
    print(f"exported {model} ({weights} weights) to {result.path} [{result.format}, {result.precision}]")
    print(f"  input  {result.input_name!r}: float32 {list(result.input_shape)}   (-1: dynamic batch)")
    print(f"  output {result.output_name!r}: float32 {list(result.output_shape)}")
    print(f"  verified with {runtime} at batch sizes {list(v.batch_sizes)} on {v.inputs}: max abs error "
          f"{v.max_abs_error:.3g}, relative {v.max_rel_error:.3g}, min cosine {v.min_cosine:.6f}, "
          f"top-1 agreement {v.top1_agreement:.0%} (required: {v.tolerance})")
