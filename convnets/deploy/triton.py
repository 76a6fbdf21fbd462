"""A Triton Inference Server model repository around an exported model.

Layout (https://github.com/triton-inference-server/server/blob/main/docs/user_guide/model_repository.md)::

    DIR/<name>/README.md          how to serve and query it, TensorRT command
    DIR/<name>/config.pbtxt       platform, max_batch_size, input/output, dynamic batching
    DIR/<name>/labels.txt         class names, when the model has them (Triton's classification extension)
    DIR/<name>/1/model.onnx       the format's file(s): model.onnx, model.xml + model.bin (OpenVINO), model.pt, ...

Each export format (:mod:`convnets.deploy.formats`) names its Triton ``platform`` or ``backend``
and its file names; a format with neither cannot be served this way.

Upstream's Triton flow imported a module that was removed in 2021; this one writes the files from
the export itself, so names and shapes always match the model file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from convnets.deploy.export import ExportResult
from convnets.preprocessing.presets import EvalPreset
from convnets.deploy.formats import ExportFormat, export_formats, get_format
from convnets.errors import InvalidArgumentError

__all__ = ["check_model_name", "check_triton_format", "model_version_dir", "triton_config", "write_triton_files"]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def check_model_name(name: str) -> str:
    """Return ``name`` if it is usable as a Triton model (directory) name, else raise InvalidArgumentError."""
    if not _NAME.match(name) or name in (".", ".."):
        raise InvalidArgumentError(f"invalid Triton model name {name!r}: use letters, digits, '_', '-', '.'")
    return name


def check_triton_format(name: str) -> ExportFormat:
    """The registered format ``name`` if Triton can serve it.

    Raises:
        InvalidArgumentError: unknown format, or one that has no Triton platform or backend.
    """
    fmt = get_format(name)
    if not fmt.serves_on_triton:
        servable = [f"--format {f.name}" for f in export_formats() if f.serves_on_triton]
        raise InvalidArgumentError(f"Triton has no backend for the {fmt.name} format; use {' or '.join(servable)} "
                                   "with --triton")
    return fmt


def model_version_dir(repository: str | Path, name: str, version: int = 1) -> Path:
    """``repository/<name>/<version>``, where the model file goes."""
    return Path(repository) / check_model_name(name) / str(version)


def _dims(shape: Sequence[int]) -> str:
    return "[ " + ", ".join(str(d) for d in shape) + " ]"


def triton_config(name: str, export: ExportResult, *, max_batch_size: int,
                  has_labels: bool = False) -> str:
    """The text of ``config.pbtxt`` (protobuf text format of Triton's ``ModelConfig``).

    Args:
        name: the model name (must equal its directory name).
        export: the export it serves; input/output names and per-sample shapes come from it.
        max_batch_size: largest batch Triton forms; the leading batch axis is implicit in the
            ``dims`` (Triton's convention when ``max_batch_size > 0``).
        has_labels: reference ``labels.txt`` from the output.

    Returns:
        The configuration text.

    Raises:
        InvalidArgumentError: ``max_batch_size`` below 1, an export without a dynamic batch axis,
            a bad name, or a format Triton cannot serve.
    """
    if max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}")
    if export.input_shape[0] != -1 or export.output_shape[0] != -1:
        raise InvalidArgumentError("the exported model has no dynamic batch axis; Triton batching needs one")
    fmt = check_triton_format(export.format)
    label = '\n    label_filename: "labels.txt"' if has_labels else ""
    # Triton names a model's runtime either by platform (onnxruntime_onnx, pytorch_libtorch) or by
    # backend (openvino, python).
    runtime = f'platform: "{fmt.triton_platform}"' if fmt.triton_platform else f'backend: "{fmt.triton_backend}"'
    instances = f"instance_group [ {{ kind: {fmt.triton_instance_kind} }} ]\n" if fmt.triton_instance_kind else ""
    return f"""\
# Written by `convnets export --triton` ({export.format}, {export.precision} weights; float32 in and out).
name: "{check_model_name(name)}"
{runtime}
max_batch_size: {max_batch_size}
input [
  {{
    name: "{export.input_name}"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: {_dims(export.input_shape[1:])}
  }}
]
output [
  {{
    name: "{export.output_name}"
    data_type: TYPE_FP32
    dims: {_dims(export.output_shape[1:])}{label}
  }}
]
# Requests wait up to 100 us to be merged into larger batches (throughput grows with the batch).
dynamic_batching {{
  max_queue_delay_microseconds: 100
}}
{instances}"""


def _readme(repository: Path, name: str, export: ExportResult, max_batch_size: int, image_size: int) -> str:
    fmt = get_format(export.format)
    files = ", ".join(f"`{name}/1/{p.name}`" for p in export.files)
    resize_size = EvalPreset.for_image_size(image_size).resize_size
    notes = fmt.triton_notes(input_name=export.input_name, max_batch_size=max_batch_size, image_size=image_size)
    return f"""# Triton model repository: {name}

{files} ({export.format}, {export.precision}), exported and verified by `convnets export`
(max |error| {export.verification.max_abs_error:.3g} vs PyTorch on {export.verification.inputs}).
Input `{export.input_name}`: float32 `[N, {", ".join(str(d) for d in export.input_shape[1:])}]`, normalized
RGB (resize {resize_size}, center crop {image_size}, ImageNet mean/std); output `{export.output_name}`:
float32 logits `[N, {", ".join(str(d) for d in export.output_shape[1:])}]`; N up to {max_batch_size}.

## Serve

    docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
        -v {repository.resolve()}:/models nvcr.io/nvidia/tritonserver:<yy.mm>-py3 \\
        tritonserver --model-repository=/models

## Query (pip install 'tritonclient[http]')

```python
import numpy as np
import tritonclient.http as httpclient

client = httpclient.InferenceClient("localhost:8000")
batch = np.zeros((1, 3, {image_size}, {image_size}), dtype=np.float32)  # your preprocessed images
inp = httpclient.InferInput({json.dumps(export.input_name)}, list(batch.shape), "FP32")
inp.set_data_from_numpy(batch)
result = client.infer({json.dumps(name)}, [inp], outputs=[httpclient.InferRequestedOutput({json.dumps(export.output_name)})])
logits = result.as_numpy({json.dumps(export.output_name)})
print(logits.argmax(1))
```
{notes}"""


def write_triton_files(repository: str | Path, name: str, export: ExportResult, *, max_batch_size: int,
                       class_names: Sequence[str] | None = None, image_size: int = 224) -> list[Path]:
    """Write ``config.pbtxt``, ``labels.txt`` (if ``class_names``) and ``README.md`` for ``export``.

    The model file itself must already be at ``model_version_dir(repository, name) /`` the
    format's first file name (``model.onnx``, ``model.pt``, ...), which is where the export command
    writes it.

    Returns:
        The files written.

    Raises:
        InvalidArgumentError: the model file is not where Triton looks for it, or ``class_names``
            does not match the number of outputs (and see :func:`triton_config`).
    """
    repository = Path(repository)
    model_dir = repository / check_model_name(name)
    expected = model_version_dir(repository, name) / check_triton_format(export.format).file_names[0]
    if export.path.resolve() != expected.resolve():
        raise InvalidArgumentError(f"the model file must be {expected} for Triton, not {export.path}")
    written = []
    labels = list(class_names or [])
    if labels and len(labels) != export.output_shape[-1]:
        raise InvalidArgumentError(f"{len(labels)} class names for {export.output_shape[-1]} outputs")
    if labels:
        written.append(model_dir / "labels.txt")
        written[-1].write_text("\n".join(labels) + "\n", encoding="utf-8")
    written.append(model_dir / "config.pbtxt")
    written[-1].write_text(triton_config(name, export, max_batch_size=max_batch_size, has_labels=bool(labels)),
                           encoding="utf-8")
    written.append(model_dir / "README.md")
    written[-1].write_text(_readme(repository, name, export, max_batch_size, image_size), encoding="utf-8")
    return written
