"""The Triton Inference Server model repository that ``convnets export --triton`` writes around an exported model.

Layout (https://github.com/triton-inference-server/server/blob/main/docs/user_guide/model_repository.md)::

    DIR/<name>/README.md          how to serve and query it, TensorRT command
    DIR/<name>/config.pbtxt       platform, max_batch_size, input/output, dynamic batching
    DIR/<name>/labels.txt         class names, when the model has them (Triton's classification extension)
    DIR/<name>/1/model.onnx       the format's file(s): model.onnx, model.xml + model.bin (OpenVINO), model.pt, ...
    DIR/<name>/1/model.py         the Python-backend variant only: runs the file (convnets.deploy.triton.python_backend)

Two variants (``backend``, ``convnets export --triton-backend``), with the same tensors, so the
same client works with either:

* ``native`` (default): the format's own Triton backend, named by its ``platform`` or ``backend``
  (``onnxruntime_onnx``, ``openvino``, ``pytorch_libtorch``): what NGC's Triton containers run, on
  GPUs too; a format with neither cannot be served this way;
* ``python``: Triton's Python backend running ``model.py`` (:mod:`convnets.deploy.triton.python_backend`),
  which loads ``model.onnx`` with ONNX Runtime or ``model.xml`` with OpenVINO on the CPU. The Triton
  that the ``serve`` extra installs has only this backend: ``convnets serve
  --repository DIR`` serves this variant on the machine that exported it.

At scale, either variant is served the same way: Triton's KServe v2 protocol over HTTP and gRPC
(the same client code), and on Kubernetes as a KServe ``InferenceService`` whose Triton runtime
reads the repository from storage (the README written with it shows both).

Upstream's Triton flow imported a module that was removed in 2021; this one writes the files from
the export itself, so names and shapes always match the model file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from convnets.constants import TRITON_BACKENDS
from convnets.deploy.formats import ExportFormat, export_formats, get_format
from convnets.deploy.triton.config import TensorConfig, check_model_name, config_text, write_labels
from convnets.errors import InvalidArgumentError
from convnets.extras import install_hint, serve_convnets
from convnets.fileio import preflight, write_output
from convnets.preprocessing.presets import EvalPreset

if TYPE_CHECKING:
    from convnets.deploy.export import ExportResult

__all__ = ["TRITON_BACKENDS", "check_triton_format", "model_version_dir", "triton_config", "triton_files",
           "triton_python_source", "write_triton_files"]

#: The config parameters that tell the Python variant's model.py which runtime loads which file
#: (convnets.deploy.triton.python_backend reads them under the same names).
RUNTIME_PARAMETER, FILE_PARAMETER = "runtime", "model_file"


def check_triton_format(name: str, backend: str = "native") -> ExportFormat:
    """The registered format ``name`` if Triton can serve it as the ``backend`` variant says.

    Raises:
        InvalidArgumentError: unknown format or variant, or a format that has no Triton platform or
            backend (``native``) or no runtime for the Python backend (``python``).
    """
    fmt = get_format(name)
    if backend not in TRITON_BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {', '.join(TRITON_BACKENDS)}, got {backend!r}",
                                   cli=f"--triton-backend must be one of {', '.join(TRITON_BACKENDS)}, got {backend!r}")
    if backend == "python":
        if fmt.triton_python_runtime is None:
            runnable = [f"--format {f.name}" for f in export_formats() if f.triton_python_runtime]
            raise InvalidArgumentError(f"Triton's Python backend runs no {fmt.name} files here; use "
                                       f"{' or '.join(runnable)} with --triton-backend python")
        return fmt
    if not fmt.serves_on_triton:
        servable = [f"--format {f.name}" for f in export_formats() if f.serves_on_triton]
        raise InvalidArgumentError(f"Triton has no backend for the {fmt.name} format; use {' or '.join(servable)} "
                                   "with --triton")
    return fmt


def model_version_dir(repository: str | Path, name: str, version: int = 1) -> Path:
    """``repository/<name>/<version>``, where the model file goes."""
    return Path(repository) / check_model_name(name) / str(version)


def triton_config(name: str, export: ExportResult, *, max_batch_size: int,
                  has_labels: bool = False, backend: str = "native") -> str:
    """The text of ``config.pbtxt`` (protobuf text format of Triton's ``ModelConfig``,
    :func:`~convnets.deploy.triton.config.config_text`).

    Args:
        name: the model name (must equal its directory name).
        export: the export it serves; input/output names and per-sample shapes come from it.
        max_batch_size: largest batch Triton forms; the leading batch axis is implicit in the
            ``dims`` (Triton's convention when ``max_batch_size > 0``).
        has_labels: reference ``labels.txt`` from the output.
        backend: ``"native"`` (the format's Triton backend) or ``"python"`` (``model.py`` runs it).

    Returns:
        The configuration text.

    Raises:
        InvalidArgumentError: ``max_batch_size`` below 1, an export without a dynamic batch axis,
            a bad name, or a format Triton cannot serve.
        MissingDependencyError: tritonclient, which writes it, is not installed (the ``triton`` extra).
    """
    if max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size must be at least 1, got {max_batch_size}")
    if export.input_shape[0] != -1 or export.output_shape[0] != -1:
        raise InvalidArgumentError("the exported model has no dynamic batch axis; Triton batching needs one")
    fmt = check_triton_format(export.format, backend)
    check_model_name(name)
    platform: str | None = None  # Triton names a model's runtime by platform or by backend
    runtime: str | None = "python"
    if backend == "python":
        # model.py (convnets.deploy.triton.python_backend) reads what to load from these; it runs on the CPU.
        instance_kind: str | None = "KIND_CPU"
        parameters = {RUNTIME_PARAMETER: str(fmt.triton_python_runtime), FILE_PARAMETER: fmt.file_names[0]}
        serve = ("convnets serve --repository DIR (the Triton of convnets' serve extra), or a Triton with the Python "
                 f"backend and numpy + {fmt.triton_python_runtime}")
    else:
        # Triton names a model's runtime either by platform (onnxruntime_onnx, pytorch_libtorch) or by
        # backend (openvino).
        platform, runtime = fmt.triton_platform, None if fmt.triton_platform else fmt.triton_backend
        instance_kind, parameters = fmt.triton_instance_kind, {}
        serve = "tritonserver --model-repository=DIR (NGC's nvcr.io/nvidia/tritonserver, CPU or GPU)"
    header = (f"Written by `convnets export --triton` ({export.format}, {export.precision} weights; float32 in and "
              f"out;\n{backend} backend). Serve: {serve}.\n"
              "At scale: the same KServe v2 clients (HTTP/gRPC); on Kubernetes, a KServe InferenceService with the\n"
              "Triton runtime (modelFormat triton) whose storageUri holds this repository.\n"
              "Requests wait up to 100 us to be merged into larger batches (throughput grows with the batch).")
    return config_text(
        name, max_batch_size=max_batch_size, max_queue_delay_us=100, header=header, instance_kind=instance_kind,
        inputs=[TensorConfig(export.input_name, "FP32", export.input_shape[1:], nchw=True)],
        outputs=[TensorConfig(export.output_name, "FP32", export.output_shape[1:], labels=has_labels)],
        parameters=parameters, platform=platform, backend=runtime)


def _serve_section(repository: Path, backend: str, fmt: ExportFormat) -> str:
    """How to serve the repository: on this machine (Python variant), in NGC's container, on Kubernetes."""
    docker = f"""    docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
        -v {repository.resolve()}:/models nvcr.io/nvidia/tritonserver:<yy.mm>-py3 \\
        tritonserver --model-repository=/models"""
    if backend == "python":
        here = f"""Here, with the Triton that the `serve` extra installs (Linux; its Python backend runs `1/model.py`,
which loads the file with {fmt.triton_python_runtime}; in an environment of its own, as it pins numpy<2):

    {install_hint('serve')}
    {serve_convnets()} serve --repository {repository.resolve()}

In NGC's Triton container, whose Python backend needs `pip install numpy {fmt.triton_python_runtime}` first
(or, faster and on GPUs, export the native variant: `convnets export --triton` without
`--triton-backend python`):

{docker}"""
    else:
        here = f"""With NGC's Triton container (its {fmt.triton_platform or fmt.triton_backend} backend; `convnets export --triton
--triton-backend python` writes a variant that `convnets serve --repository` runs without a container):

{docker}"""
    return f"""## Serve

{here}

At scale the client does not change: every Triton speaks the KServe v2 (Open Inference) protocol
over HTTP and gRPC. On Kubernetes, serve the repository as a KServe `InferenceService` with the
Triton runtime (`modelFormat: {{name: triton}}`, `storageUri` pointing at a copy of this directory)."""


def _readme(repository: Path, name: str, export: ExportResult, max_batch_size: int, image_size: int,
            backend: str) -> str:
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

{_serve_section(repository, backend, fmt)}

## Query (pip install 'tritonclient[http]')

```python
import numpy as np
import tritonclient.http as httpclient

client = httpclient.InferenceServerClient("localhost:8000")
batch = np.zeros((1, 3, {image_size}, {image_size}), dtype=np.float32)  # your preprocessed images
inp = httpclient.InferInput({json.dumps(export.input_name)}, list(batch.shape), "FP32")
inp.set_data_from_numpy(batch)
result = client.infer({json.dumps(name)}, [inp], outputs=[httpclient.InferRequestedOutput({json.dumps(export.output_name)})])
logits = result.as_numpy({json.dumps(export.output_name)})
print(logits.argmax(1))
```
{notes}"""


def _write_text(path: Path, text: str, *, force: bool, base: Path | None) -> Path:
    """:func:`convnets.fileio.write_output` of ``text`` (UTF-8) at ``path`` in the repository ``base``."""
    return write_output(path, lambda f: f.write(text.encode("utf-8")), force=force, base=base)


def write_triton_files(repository: str | Path, name: str, export: ExportResult, *, max_batch_size: int,
                       class_names: Sequence[str] | None = None, image_size: int = 224,
                       backend: str = "native", force: bool = False) -> list[Path]:
    """Write ``config.pbtxt``, ``labels.txt`` (if ``class_names``) and ``README.md`` for ``export``,
    and ``1/model.py`` for the ``"python"`` backend variant (a copy of :mod:`convnets.deploy.triton.python_backend`).

    Each is written atomically, never through a symbolic link below ``repository``, and replaces a
    file that exists (a hand-edited ``config.pbtxt``) only with ``force``; all are checked before
    any is written.

    The model file itself must already be at ``model_version_dir(repository, name) /`` the
    format's first file name (``model.onnx``, ``model.pt``, ...), which is where the export command
    writes it.

    Returns:
        The files written.

    Raises:
        InvalidArgumentError: the model file is not where Triton looks for it, ``class_names``
            does not match the number of outputs, or a file exists (without ``force``) or a link is
            in the way (and see :func:`triton_config`).
    """
    repository = Path(repository)
    expected = model_version_dir(repository, name) / check_triton_format(export.format, backend).file_names[0]
    if export.path.resolve() != expected.resolve():
        raise InvalidArgumentError(f"the model file must be {expected} for Triton, not {export.path}")
    labels = list(class_names or [])
    if labels and len(labels) != export.output_shape[-1]:
        raise InvalidArgumentError(f"{len(labels)} class names for {export.output_shape[-1]} outputs")
    files = triton_files(repository, name, backend, labels=bool(labels))
    for path in files:
        preflight(path, force=force, base=repository)
    texts = {"config.pbtxt": triton_config(name, export, max_batch_size=max_batch_size, has_labels=bool(labels),
                                           backend=backend),
             "model.py": triton_python_source().read_text(encoding="utf-8"),
             "README.md": _readme(repository, name, export, max_batch_size, image_size, backend)}
    return [write_labels(path.parent, labels, force=force, base=repository) if path.name == "labels.txt"
            else _write_text(path, texts[path.name], force=force, base=repository) for path in files]


def triton_files(repository: str | Path, name: str, backend: str = "native", *, labels: bool = True) -> list[Path]:
    """What :func:`write_triton_files` writes besides the model's own files: ``labels.txt`` (with
    ``labels``), ``config.pbtxt``, ``1/model.py`` (the Python variant), ``README.md``."""
    model_dir = Path(repository) / check_model_name(name)
    version = model_version_dir(repository, name)
    return [*([model_dir / "labels.txt"] if labels else []), model_dir / "config.pbtxt",
            *([version / "model.py"] if backend == "python" else []), model_dir / "README.md"]


def triton_python_source() -> Path:
    """The file that the Python-backend variant copies as ``model.py``: :mod:`convnets.deploy.triton.python_backend`
    (found, not imported: it imports Triton's backend module, which exists only where Triton runs it)."""
    return Path(__file__).with_name("python_backend.py")
