"""Export through the registered formats (:mod:`convnets.deploy.formats`), each file verified against PyTorch.

The exported network is the BatchNorm-folded one (:func:`~convnets.deploy.folding.fold_batchnorm`;
timm's format keeps the training layout instead) with a dynamic batch axis and float32 input and
output; ``precision="fp16"`` stores fp16 weights and computes in fp16 between a cast of the input
and a cast of the logits, so clients always send and receive float32. The ONNX file is also what
TensorRT consumes (``trtexec --onnx=...``).

Verification runs the exported file (each format's runtime: ONNX Runtime, ``torch.jit.load``, ...)
on a batch of real photos (by default the example photos shipped in the package) and on its first
image alone (so the dynamic batch axis is exercised), and compares the logits with the original,
unfolded PyTorch model. An export that disagrees beyond the tolerance is deleted and raises
:class:`~convnets.errors.ExportError`.

This module knows no format by name: adding one is a module in :mod:`convnets.deploy.formats`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convnets.assets import example_images
from convnets.deploy.formats import (EXPORT_PRECISIONS, ExportFormat, Runner, export_formats, get_format,
                                     require)
from convnets.deploy.folding import error_summary, fold_batchnorm
from convnets.errors import ConvnetsError, ExportError, InvalidArgumentError
from convnets.fileio import preflight, staging
from convnets.paths import disk_full
from convnets.preprocessing import prepare_input_from_uri
from convnets.preprocessing.io import DEFAULT_TIMEOUT, is_url
from convnets.preprocessing.presets import EvalPreset
from convnets.runtime import precision_dtype

__all__ = ["EXPORT_PRECISIONS", "ExportFormat", "ExportResult", "Verification", "export_formats",
           "export_model", "get_format", "require", "sample_batch", "verification_tolerance", "verify_runner"]

log = logging.getLogger(__name__)

FP32_MAX_REL_ERROR = 1e-4  # max |exported - pytorch| / max |pytorch logit|
FP16_MIN_COSINE = 0.99  # per sample, exported fp16 logits vs pytorch fp32 logits
INT8_MIN_AGREEMENT = 0.99  # int8 (optimize_for_inference): share of images whose top-1 class is the model's


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

    @classmethod
    def from_dict(cls, data: object) -> Verification:
        """The verification that :meth:`to_dict` gave ``data`` (e.g. as the engine cache recorded it).

        Raises:
            ValueError: ``data`` does not have exactly these fields, of these types.
        """
        numbers = ("max_abs_error", "max_rel_error", "min_cosine", "top1_agreement")
        if not (isinstance(data, dict) and set(data) == {f.name for f in dataclasses.fields(cls)}
                and isinstance(data["batch_sizes"], (list, tuple)) and all(type(b) is int for b in data["batch_sizes"])
                and all(type(data[k]) in (int, float) for k in numbers)  # type(): a bool is no number here
                and isinstance(data["tolerance"], str) and isinstance(data["inputs"], str)
                and isinstance(data["passed"], bool)):
            raise ValueError("not a verification record")
        return cls(**{**data, "batch_sizes": tuple(data["batch_sizes"])})


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        format: the format's registered name (``"onnx"``, ``"torchscript"``, ...).
        precision: ``"fp32"`` or ``"fp16"`` (weights and arithmetic; input and output stay float32).
        path: the exported (main) file.
        input_name, output_name: tensor names inside the file.
        input_shape, output_shape: shapes with ``-1`` for the dynamic batch axis.
        verification: the check against PyTorch.
        files: every file written, ``path`` first (a format may write several, e.g. graph + weights).
    """

    format: str
    precision: str
    path: Path
    input_name: str
    output_name: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    verification: Verification
    files: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if not self.files:
            object.__setattr__(self, "files", (self.path,))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict."""
        return {"format": self.format, "precision": self.precision, "path": str(self.path),
                "files": [str(p) for p in self.files],
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


def _exportable(model: nn.Module, precision: str) -> nn.Module:
    module = fold_batchnorm(copy.deepcopy(model).eval().cpu().float())
    dtype = precision_dtype(precision)
    return _Exportable(module.to(dtype), dtype).eval().requires_grad_(False)


def sample_batch(images: Sequence[str | os.PathLike[str]] | None = None,
                 image_size: int = 224, *, timeout: float = DEFAULT_TIMEOUT,
                 allow_private: bool = True) -> tuple[Tensor, str]:
    """A preprocessed batch of real photos for verification, and a description of it.

    Args:
        images: image files or http(s) URLs (downloaded as ``convnets predict`` downloads them);
            default: the example photos shipped in the package (cat, coffee cup, rocket launch;
            :func:`convnets.assets.example_images`).
        image_size: crop size; the rest of the preprocessing is
            :meth:`EvalPreset.for_image_size` (NVIDIA's evaluation pipeline).
        timeout: total seconds allowed for each URL download.
        allow_private: download URLs whose host is a loopback, private or link-local address (the
            default, as upstream); ``False`` refuses them (``--deny-private-urls``).

    Returns:
        ``([N, 3, image_size, image_size] float tensor, description)``.

    Raises:
        ImageLoadError: an image cannot be read (the message names it).
        ExportError: no ``images`` and the package's example photos are missing (a broken install).
    """
    # A URL stays a string: Path() would fold its "//" and turn it into a (missing) local path.
    paths = [p if is_url(p) else Path(p) for p in images] if images else example_images()
    if not paths:
        raise ExportError("the example photos that verify exports are missing from the installed convnets "
                          "package (convnets/assets/examples); reinstall it, or pass images to verify with "
                          "(--images on the command line)")
    batch = prepare_input_from_uri(paths, preset=EvalPreset.for_image_size(image_size), timeout=timeout,
                                   allow_private=allow_private)
    return batch, f"{len(paths)} photos: " + ", ".join(p if isinstance(p, str) else p.name for p in paths)


def verification_tolerance(precision: str) -> str:
    """The criterion an export of ``precision`` must meet, in words."""
    if precision == "fp32":
        return f"max_rel_error <= {FP32_MAX_REL_ERROR:g}"
    if precision == "int8":
        return f"top1_agreement >= {INT8_MIN_AGREEMENT:g}"
    return f"min_cosine >= {FP16_MIN_COSINE:g} per sample"


def verify_runner(runner: Runner, reference: nn.Module, batch: Tensor, precision: str, inputs: str) -> Verification:
    """Compare ``runner`` (float32 batch -> float32 logits) with ``reference`` on ``batch`` and on its first image.

    The check that exports pass (fp32: relative error <= 1e-4; otherwise: per-sample cosine >= 0.99),
    also applied by ``optimize_for_inference(engine="auto")`` to the engine it picks; int8
    (``optimize_for_inference`` only): the top-1 class agrees on at least 99% of ``batch``.
    """
    with torch.no_grad():
        expected = reference(batch).float()
    chunks = [(batch, expected), (batch[:1], expected[:1])] if len(batch) > 1 else [(batch, expected)]
    got = [(runner(x), ref) for x, ref in chunks]
    abs_err = max(float((g - r).abs().max()) for g, r in got)
    scale = float(expected.abs().max()) or 1.0
    cosine = min(float(F.cosine_similarity(g.double(), r.double(), dim=1).min()) for g, r in got)
    top1 = float((got[0][0].argmax(1) == expected.argmax(1)).float().mean())
    rel = abs_err / scale
    if precision == "fp32":
        passed = rel <= FP32_MAX_REL_ERROR
    elif precision == "int8":
        # Quantization moves every logit a little; what must hold is the answer (checked on the
        # calibration images: real-looking inputs, unlike random ones whose top classes are near ties).
        passed = top1 >= INT8_MIN_AGREEMENT and not math.isnan(rel)
    else:
        passed = cosine >= FP16_MIN_COSINE
    # NaN compares False above, so a NaN output fails.
    return Verification(tuple(len(x) for x, _ in chunks), abs_err, rel, cosine, top1,
                        verification_tolerance(precision), bool(passed), inputs)


def export_model(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    format: str = "onnx",
    precision: Literal["fp32", "fp16"] = "fp32",
    batch: Tensor | None = None,
    batch_description: str | None = None,
    image_size: int = 224,
    force: bool = False,
    base: str | os.PathLike[str] | None = None,
    **options: Any,
) -> ExportResult:
    """Export ``model`` (BatchNorm folded unless the format keeps it) and verify the file against it.

    Args:
        model: the classifier; it is not modified (a folded copy is exported).
        path: the main file to write (e.g. ``model.onnx`` / ``model.pt``); its directory must
            exist (or see ``base``). A format that writes several files puts the others next to it.
        format: a registered format name (:func:`~convnets.deploy.formats.export_formats`):
            ``"onnx"`` (checked with ONNX Runtime), ``"torchscript"`` (traced, checked after
            ``torch.jit.load``), ``"timm"`` (a folder: ``path`` is its ``model.safetensors``,
            ``config.json`` goes next to it; checked with timm), ...
        precision: ``"fp32"`` or ``"fp16"`` weights and arithmetic; input and output are float32.
        batch: verification inputs ``[N, 3, image_size, image_size]``; default
            :func:`sample_batch` (real photos).
        batch_description: what ``batch`` is, for the report.
        image_size: input height and width (fixed in the graph; only the batch axis is dynamic).
        force: replace the files that exist at ``path`` (and its companion files); without it an
            existing one is refused. A symbolic link there is never written through (``force``
            replaces the link itself).
        base: the directory the user named above ``path`` (``convnets export --output``): it and the
            directories between are made if missing, and none below it is reached through a
            symbolic link.
        options: the format's own options, e.g. ``opset=17`` (ONNX opset, 17 or newer).

    Returns:
        An :class:`ExportResult`, verification included.

    Raises:
        InvalidArgumentError: unknown format, a precision it cannot export, a bad option value; a
            file to write exists (without ``force``).
        UnknownArgumentError: an option the format does not take.
        ExportError: the format cannot hold this network (timm: SE-ResNeXt, changed architectures).
        ExportError: export failed, or the file's logits disagree with PyTorch (fp32: relative
            error above 1e-4; fp16: a per-sample cosine below 0.99); nothing is then left behind.
        MissingDependencyError: the format's packages (e.g. ``onnx`` / ``onnxruntime``) are not
            installed; the message names the pip extra.
    """
    fmt = get_format(format)
    if precision not in EXPORT_PRECISIONS:
        raise InvalidArgumentError(f"export precision must be one of {', '.join(EXPORT_PRECISIONS)}, got {precision!r}")
    fmt.check_precision(precision)
    options = fmt.resolve_options(options)
    fmt.check_architecture(getattr(model, "spec", None))
    fmt.check_dependencies()  # fail before the slow part
    if fmt.deprecated:
        log.warning("the %s export format is deprecated: %s", fmt.name, fmt.deprecated)
    path = Path(path)
    if batch is None:
        batch, batch_description = sample_batch(image_size=image_size)
    batch = batch.detach().cpu().float()
    reference = copy.deepcopy(model).eval().cpu().float()
    # A format of the training layout (timm's; fp32 only) gets the model as it is, BatchNorm kept.
    module = _exportable(model, precision) if fmt.folds_batchnorm else reference
    files = fmt.files(path)
    for target in files:  # before the slow part; publish decides again
        preflight(target, force=force, base=base, option="path")
    # Written into a hidden folder next to the target and moved into place only once verified, so
    # that a failed export leaves neither a partial file nor a stale companion file (nor, once the
    # next export has run, the folder of one that was killed).
    with staging(path, base=base, option="path") as stage:
        tmp = stage.path / path.name
        try:
            fmt.write(module, tmp, batch[:2], **options)
            runner = fmt.load_runner(tmp)
            verification = verify_runner(runner, reference, batch, precision, batch_description or f"{len(batch)} images")
            input_name, input_shape, output_name, output_shape = fmt.signature(tmp, runner, batch)
        except ConvnetsError:
            raise
        except Exception as e:  # noqa: BLE001 - exporters, checkers and runtimes raise many types: one line
            if disk_full(e, stage.path):  # runtimes that write files themselves often lose the errno
                raise ExportError(f"{fmt.name} export failed writing {path}: no space left on its file system "
                                  f"({error_summary(e)}); nothing was written") from e
            raise ExportError(f"{fmt.name} export failed: {error_summary(e)}") from e
        if not verification.passed:
            raise ExportError(
                f"the exported {fmt.name} model disagrees with PyTorch: max abs error "
                f"{verification.max_abs_error:.3g}, relative {verification.max_rel_error:.3g}, min cosine "
                f"{verification.min_cosine:.6f} (required: {verification.tolerance}); nothing was written")
        stage.publish([target.name for target in files], force=force)  # the same names in the stage
    log.info("exported %s (%s), verified: %s", path, precision, verification)
    return ExportResult(fmt.name, precision, path, input_name, output_name, input_shape, output_shape,
                        verification, files)
