"""Export to ONNX or TorchScript, each verified against PyTorch right after it is written.

The exported network is the BatchNorm-folded one (:func:`~convnets.deploy.optimize.fold_batchnorm`)
with a dynamic batch axis and float32 input and output; ``precision="fp16"`` stores fp16 weights
and computes in fp16 between a cast of the input and a cast of the logits, so clients always send
and receive float32. The ONNX file is also what TensorRT consumes (``trtexec --onnx=...``).

Verification runs the exported file (ONNX Runtime / ``torch.jit.load``) on a batch of real photos
and on its first image alone (so the dynamic batch axis is exercised), and compares the logits with
the original, unfolded PyTorch model. An export that disagrees beyond the tolerance is deleted and
raises :class:`~convnets.errors.ExportError`.

References: https://pytorch.org/docs/stable/onnx_torchscript.html ,
https://onnxruntime.ai/docs/api/python/api_summary.html , https://pytorch.org/docs/stable/jit.html
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convnets.deploy.optimize import error_summary, fold_batchnorm, precision_dtype
from convnets.errors import ConvnetsError, ExportError, MissingDependencyError
from processing_utils import IMAGENET_MEAN, IMAGENET_STD, prepare_input_from_uri

__all__ = ["EXPORT_FORMATS", "EXPORT_PRECISIONS", "ExportFormat", "ExportResult", "Verification",
           "export_model", "io_names", "require", "sample_batch", "verification_tolerance"]

log = logging.getLogger(__name__)

ExportFormat = Literal["onnx", "torchscript"]
EXPORT_FORMATS: tuple[str, ...] = ("onnx", "torchscript")
EXPORT_PRECISIONS: tuple[str, ...] = ("fp32", "fp16")
FILE_NAMES: dict[str, str] = {"onnx": "model.onnx", "torchscript": "model.pt"}

#: Tensor names. Triton's libtorch backend maps TorchScript inputs and outputs by the
#: ``<name>__<index>`` convention, so the TorchScript names follow it.
_IO_NAMES: dict[str, tuple[str, str]] = {"onnx": ("input", "output"), "torchscript": ("INPUT__0", "OUTPUT__0")}

FP32_MAX_REL_ERROR = 1e-4  # max |exported - pytorch| / max |pytorch logit|
FP16_MIN_COSINE = 0.99  # per sample, exported fp16 logits vs pytorch fp32 logits

_PHOTOS = ("chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg")
_EXTRA = "install the 'export' extra: pip install 'convnets[export]'"


def require(module: str) -> ModuleType:
    """Import an optional dependency, or raise :class:`MissingDependencyError` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"{module} is needed for this export but cannot be imported ({e}); "
                                     f"{_EXTRA}") from e


def io_names(fmt: str) -> tuple[str, str]:
    """The (input, output) tensor names used for format ``fmt``."""
    return _IO_NAMES[fmt]


@dataclass(frozen=True)
class Verification:
    """How the exported file's logits compare with PyTorch's.

    Attributes:
        batch_sizes: batch sizes that were run through the exported file.
        max_abs_error: largest absolute logit difference over all of them.
        max_rel_error: ``max_abs_error`` divided by the largest absolute PyTorch logit.
        min_cosine: smallest per-sample cosine similarity of the logit vectors.
        top1_agreement: fraction of samples whose arg-max class agrees.
        tolerance: the criterion applied, in words.
        passed: whether the criterion holds.
        inputs: what the batch was made of.
    """

    batch_sizes: tuple[int, ...]
    max_abs_error: float
    max_rel_error: float
    min_cosine: float
    top1_agreement: float
    tolerance: str
    passed: bool
    inputs: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return dataclasses.asdict(self) | {"batch_sizes": list(self.batch_sizes)}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        format: ``"onnx"`` or ``"torchscript"``.
        precision: ``"fp32"`` or ``"fp16"`` (weights and arithmetic; input and output stay float32).
        path: the exported file.
        input_name, output_name: tensor names inside the file.
        input_shape, output_shape: shapes with ``-1`` for the dynamic batch axis.
        verification: the check against PyTorch.
    """

    format: str
    precision: str
    path: Path
    input_name: str
    output_name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    verification: Verification

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return {"format": self.format, "precision": self.precision, "path": str(self.path),
                "input": {"name": self.input_name, "shape": list(self.input_shape), "dtype": "float32"},
                "output": {"name": self.output_name, "shape": list(self.output_shape), "dtype": "float32"},
                "verification": self.verification.to_dict()}


class _Exportable(nn.Module):
    """The folded network between float32 input and float32 output casts (for fp16)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    # The argument name becomes the TorchScript graph's input name (Triton reads it).
    def forward(self, INPUT__0: Tensor) -> Tensor:  # noqa: N803 - Triton's naming convention
        if self.dtype == torch.float32:  # decided while tracing: no cast nodes in fp32 graphs
            return self.module(INPUT__0)
        return self.module(INPUT__0.to(self.dtype)).float()


def _exportable(model: nn.Module, precision: str) -> _Exportable:
    module = fold_batchnorm(copy.deepcopy(model).eval().cpu().float())
    dtype = precision_dtype(precision)
    return _Exportable(module.to(dtype), dtype).eval().requires_grad_(False)


def _skimage_photos() -> list[Path]:
    # Located without importing scikit-image (slow, and only its data files are needed).
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        return []
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return [data / name for name in _PHOTOS if (data / name).is_file()]


def sample_batch(images: Sequence[str | os.PathLike[str]] | None = None,
                 image_size: int = 224) -> tuple[Tensor, str]:
    """A preprocessed batch of real photos for verification, and a description of it.

    Args:
        images: image files; default: four ImageNet-like photos shipped with scikit-image
            (cat, coffee, astronaut, rocket) when it is installed.
        image_size: crop size; images are resized to ``image_size * 256 / 224`` first, as in the
            NVIDIA evaluation pipeline.

    Returns:
        ``([N, 3, image_size, image_size] float tensor, description)``. Without any photo, a
        smooth random batch with the statistics of normalized images (described as synthetic).

    Raises:
        ImageLoadError: an image cannot be read (the message names it).
    """
    paths = [Path(p) for p in images] if images else _skimage_photos()
    if not paths:
        log.warning("no photos for verification (pass images, or install scikit-image); using a synthetic batch")
        gen = torch.Generator().manual_seed(0)
        low = torch.rand(4, 3, image_size // 16, image_size // 16, generator=gen)
        batch = F.interpolate(low, size=(image_size, image_size), mode="bilinear", align_corners=False)
        mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
        return (batch - mean) / std, "4 synthetic smooth random images (no photos available)"
    batch = prepare_input_from_uri(paths, image_size=image_size, resize_size=round(image_size * 256 / 224))
    return batch, f"{len(paths)} photos: " + ", ".join(p.name for p in paths)


@contextmanager
def _quiet_export_warnings() -> Iterator[None]:
    # torch.onnx's TorchScript-based exporter and torch.jit announce their deprecation on every
    # call; both are still what ONNX Runtime / TensorRT / Triton's libtorch backend consume.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx\.")
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


def _write_onnx(module: _Exportable, path: Path, example: Tensor, opset: int) -> None:
    onnx = require("onnx")
    input_name, output_name = io_names("onnx")
    with _quiet_export_warnings():
        # dynamo=False: the TorchScript-based exporter, which needs no onnxscript and produces a
        # plain static graph (BatchNorm already folded, so no training-mode branches).
        torch.onnx.export(module, (example,), str(path), dynamo=False, opset_version=opset,
                          input_names=[input_name], output_names=[output_name],
                          dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
                          do_constant_folding=True)
    onnx.checker.check_model(str(path))


def _write_torchscript(module: _Exportable, path: Path, example: Tensor) -> None:
    with _quiet_export_warnings():
        # Tracing records the network as it runs; there is no data-dependent control flow in
        # these models, and check_trace reruns it to make sure. Not frozen: Triton moves the
        # parameters to its GPU with the module.
        traced = torch.jit.trace(module, example, check_trace=True)
        torch.jit.save(traced, str(path))


class _Runner:
    """Runs an exported file on a float32 batch and returns float32 logits."""

    def __init__(self, fmt: str, path: Path) -> None:
        self.fmt = fmt
        if fmt == "onnx":
            ort = require("onnxruntime")
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            self.input_name = self.session.get_inputs()[0].name
        else:
            with _quiet_export_warnings():
                self.module = torch.jit.load(str(path), map_location="cpu")

    def __call__(self, batch: Tensor) -> Tensor:
        if self.fmt == "onnx":
            out = self.session.run(None, {self.input_name: batch.numpy()})[0]
            return torch.from_numpy(out).float()
        with torch.no_grad():
            return self.module(batch).float()


def verification_tolerance(precision: str) -> str:
    """The criterion an export of ``precision`` must meet, in words."""
    if precision == "fp32":
        return f"max_rel_error <= {FP32_MAX_REL_ERROR:g}"
    return f"min_cosine >= {FP16_MIN_COSINE:g} per sample"


def _verify(runner: _Runner, reference: nn.Module, batch: Tensor, precision: str, inputs: str) -> Verification:
    with torch.no_grad():
        expected = reference(batch).float()
    chunks = [(batch, expected), (batch[:1], expected[:1])] if len(batch) > 1 else [(batch, expected)]
    got = [(runner(x), ref) for x, ref in chunks]
    abs_err = max(float((g - r).abs().max()) for g, r in got)
    scale = float(expected.abs().max()) or 1.0
    cosine = min(float(F.cosine_similarity(g.double(), r.double(), dim=1).min()) for g, r in got)
    top1 = float((got[0][0].argmax(1) == expected.argmax(1)).float().mean())
    rel = abs_err / scale
    passed = rel <= FP32_MAX_REL_ERROR if precision == "fp32" else cosine >= FP16_MIN_COSINE
    # NaN compares False above, so a NaN output fails.
    return Verification(tuple(len(x) for x, _ in chunks), abs_err, rel, cosine, top1,
                        verification_tolerance(precision), bool(passed), inputs)


Signature = tuple[str, tuple[int, ...], str, tuple[int, ...]]


def _io_signature(fmt: str, path: Path, runner: _Runner, example: Tensor) -> Signature:
    """(input name, input shape, output name, output shape) of the exported file, -1 = batch axis."""
    if fmt == "onnx":
        # Read back from the file, so that what we report (and put into Triton's config) is what
        # the graph declares; the dynamic batch axis is a symbolic dimension.
        graph = require("onnx").load(str(path), load_external_data=False).graph

        def dims(value_info: Any) -> tuple[int, ...]:
            return tuple(d.dim_value if d.HasField("dim_value") else -1
                         for d in value_info.type.tensor_type.shape.dim)
        return graph.input[0].name, dims(graph.input[0]), graph.output[0].name, dims(graph.output[0])
    # TorchScript graphs carry no output names and no declared shapes: Triton's libtorch backend
    # maps INPUT__0 / OUTPUT__0 by position, and the output shape is what the module returns.
    out = runner(example[:1])
    input_name, output_name = io_names(fmt)
    return input_name, (-1, *example.shape[1:]), output_name, (-1, *out.shape[1:])


def export_model(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    format: ExportFormat = "onnx",
    precision: Literal["fp32", "fp16"] = "fp32",
    batch: Tensor | None = None,
    batch_description: str | None = None,
    image_size: int = 224,
    opset: int = 17,
) -> ExportResult:
    """Export ``model`` (BatchNorm folded, dynamic batch axis) and verify the file against it.

    Args:
        model: the classifier; it is not modified (a folded copy is exported).
        path: the file to write (e.g. ``model.onnx`` / ``model.pt``); its directory must exist.
        format: ``"onnx"`` (checked with ONNX Runtime) or ``"torchscript"`` (traced, checked
            after ``torch.jit.load``).
        precision: ``"fp32"`` or ``"fp16"`` weights and arithmetic; input and output are float32.
        batch: verification inputs ``[N, 3, image_size, image_size]``; default
            :func:`sample_batch` (real photos).
        batch_description: what ``batch`` is, for the report.
        image_size: input height and width (fixed in the graph; only the batch axis is dynamic).
        opset: ONNX opset (17 or newer).

    Returns:
        An :class:`ExportResult`, verification included.

    Raises:
        ExportError: export failed, or the file's logits disagree with PyTorch (fp32: relative
            error above 1e-4; fp16: a per-sample cosine below 0.99); the file is then removed.
        MissingDependencyError: ``onnx`` / ``onnxruntime`` are not installed (ONNX only).
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    if precision not in EXPORT_PRECISIONS:
        raise ValueError(f"export precision must be one of {', '.join(EXPORT_PRECISIONS)}, got {precision!r}")
    if format == "onnx" and opset < 17:
        raise ValueError(f"opset {opset} is too old; use 17 or newer")
    if format == "onnx":
        require("onnx")  # fail before the slow part
        require("onnxruntime")
    path = Path(path)
    if batch is None:
        batch, batch_description = sample_batch(image_size=image_size)
    batch = batch.detach().cpu().float()
    reference = copy.deepcopy(model).eval().cpu().float()
    module = _exportable(model, precision)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        try:
            if format == "onnx":
                _write_onnx(module, tmp, batch[:2], opset)
            else:
                _write_torchscript(module, tmp, batch[:2])
            runner = _Runner(format, tmp)
            verification = _verify(runner, reference, batch, precision, batch_description or f"{len(batch)} images")
            input_name, input_shape, output_name, output_shape = _io_signature(format, tmp, runner, batch)
        except ConvnetsError:
            raise
        except Exception as e:  # noqa: BLE001 - exporters, checker and runtimes raise many types: one line
            raise ExportError(f"{format} export failed: {error_summary(e)}") from e
        if not verification.passed:
            raise ExportError(
                f"the exported {format} model disagrees with PyTorch: max abs error "
                f"{verification.max_abs_error:.3g}, relative {verification.max_rel_error:.3g}, min cosine "
                f"{verification.min_cosine:.6f} (required: {verification.tolerance}); nothing was written")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("exported %s (%s), verified: %s", path, precision, verification)
    return ExportResult(format, precision, path, input_name, output_name, input_shape, output_shape, verification)
