"""The export-format plug-in interface: what a format declares and the two things it must do.

A format says which files it writes, the names of its input and output tensors, how Triton serves
it, which optional packages it needs (and the pip extra that brings them) and which options it
takes; it writes a BatchNorm-folded module (or, for a format that keeps the training layout such as
timm's, the model as it is) to a file and loads that file back as a callable for verification.
Everything else (folding, the float32 casts, verification against PyTorch, atomic replacement of the
files, Triton's config) is shared by :mod:`convnets.deploy.export` and :mod:`convnets.deploy.triton`.

This module imports no PyTorch, so that the command line can list the formats and their options
before anything heavy is loaded; formats import their exporters inside :meth:`ExportFormat.write`.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

from convnets.deploy.telemetry import import_without_telemetry
from convnets.errors import InvalidArgumentError, MissingDependencyError, UnknownArgumentError
from convnets.extras import install_hint

if TYPE_CHECKING:
    from torch import Tensor, nn

    from convnets.models.specs import ArchSpec

__all__ = ["EXPORT_PRECISIONS", "ExportFormat", "FormatOption", "Runner", "Signature", "quiet_export_warnings",
           "require"]

#: Weights and arithmetic of an export; input and output always stay float32.
EXPORT_PRECISIONS: tuple[str, ...] = ("fp32", "fp16")

#: Runs an exported file: float32 NCHW batch in, float32 logits out.
Runner = Callable[["Tensor"], "Tensor"]

#: (input name, input shape, output name, output shape) of an exported file; -1 is the batch axis.
Signature = tuple[str, tuple[int, ...], str, tuple[int, ...]]


def require(module: str, *, extra: str = "export", purpose: str = "this export") -> ModuleType:
    """Import an optional dependency, or raise :class:`MissingDependencyError` naming the pip extra.

    Every import of OpenVINO, NNCF, ONNX and ONNX Runtime in this package goes through here, and so
    through :func:`~convnets.deploy.telemetry.import_without_telemetry`: their third-party
    telemetry stays off unless the user opted in to it.

    Args:
        module: the module to import, e.g. ``"onnxruntime"``.
        extra: the extra of the ``convnets-hub`` distribution that installs it.
        purpose: what needs it, for the message.
    """
    try:
        return import_without_telemetry(module)
    except ImportError as e:
        raise MissingDependencyError(f"{module} is needed for {purpose} but cannot be imported ({e}); "
                                     f"install the '{extra}' extra: {install_hint(extra)}") from e


@contextmanager
def quiet_export_warnings() -> Iterator[None]:
    """Silence the deprecation notices that torch.onnx's TorchScript-based exporter and torch.jit print.

    They announce their deprecation on every call; both are still what ONNX Runtime, TensorRT and
    Triton's libtorch backend consume.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.onnx\.")
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
        yield


@dataclass(frozen=True)
class FormatOption:
    """An option that only one format takes: a keyword of ``export_model`` and a command-line flag.

    Attributes:
        name: the Python keyword (``opset``); the flag is ``--`` + name with ``-`` for ``_``.
        type: converts the command-line string (``int``).
        default: the value when the option is not given.
        help: one line for ``--help``.
        check: validates a value and returns it, raising :class:`InvalidArgumentError` (optional).
    """

    name: str
    type: Callable[[str], Any]
    default: Any
    help: str
    check: Callable[[Any], Any] | None = None

    @property
    def flag(self) -> str:
        """The command-line spelling, e.g. ``--opset``."""
        return "--" + self.name.replace("_", "-")


class ExportFormat(abc.ABC):
    """One export format. Subclass, set the class attributes, implement :meth:`write` and :meth:`load_runner`.

    Attributes:
        name: what ``format=`` / ``--format`` take, e.g. ``"onnx"``.
        description: one line for ``--help`` (who consumes the file).
        file_names: the files it writes, main file first (``path`` in the API points to it); the
            other files sit next to it, named by :meth:`files`.
        input_name, output_name: the tensor names inside the file (what Triton's config names).
        runtime: what verification runs the file with, in words (``"ONNX Runtime"``).
        triton_platform: Triton's ``platform`` for this format (``"onnxruntime_onnx"``), or None.
        triton_backend: Triton's ``backend`` when it is named by backend instead (``"openvino"``), or None.
        triton_instance_kind: Triton's ``instance_group`` kind when the backend runs on one kind of
            device only (``"KIND_CPU"``), or None for Triton's default (GPUs when there are any).
        triton_python_runtime: the module that runs the file in a Triton Python-backend repository
            (``"onnxruntime"``; :mod:`convnets.deploy.triton.python_backend`), or None: no such variant.
        extra: the pip extra that brings :attr:`requires`.
        requires: modules that must import before export starts.
        precisions: the precisions it can export.
        options: format-specific options (:class:`FormatOption`).
        deprecated: why and what replaces it, when the format is deprecated; shown in ``--help``
            and logged as a warning on export.
        folds_batchnorm: whether :meth:`write` receives the BatchNorm-folded network (the default)
            or the float32 model itself, for a format that stores the training layout.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    file_names: ClassVar[tuple[str, ...]]
    input_name: ClassVar[str] = "input"
    output_name: ClassVar[str] = "output"
    runtime: ClassVar[str]
    triton_platform: ClassVar[str | None] = None
    triton_backend: ClassVar[str | None] = None
    triton_instance_kind: ClassVar[str | None] = None
    triton_python_runtime: ClassVar[str | None] = None
    extra: ClassVar[str] = "export"
    requires: ClassVar[tuple[str, ...]] = ()
    precisions: ClassVar[tuple[str, ...]] = EXPORT_PRECISIONS
    options: ClassVar[tuple[FormatOption, ...]] = ()
    deprecated: ClassVar[str | None] = None
    folds_batchnorm: ClassVar[bool] = True

    def help_line(self) -> str:
        """What ``convnets export --help`` says about this format: its description, its precisions
        when they are not all of :data:`EXPORT_PRECISIONS`, the pip extra it needs and why it is
        deprecated, e.g. ``onnx (ONNX Runtime, TensorRT, Triton onnxruntime_onnx; extra: export)``."""
        details = "" if set(self.precisions) == set(EXPORT_PRECISIONS) else f"; {', '.join(self.precisions)} only"
        details += f"; extra: {self.extra}" if self.requires else ""
        line = f"{self.name} ({self.description}{details})"
        return line + (f" [deprecated: {self.deprecated}]" if self.deprecated else "")

    # --- what a format must do --------------------------------------------------------------------

    @abc.abstractmethod
    def write(self, module: nn.Module, path: Path, example: Tensor) -> None:
        """Write ``module`` (folded unless :attr:`folds_batchnorm` is False; float32 in and out, dynamic
        batch axis) to ``path`` and its companions.

        A format with :attr:`options` takes each as a keyword-only parameter with a default (e.g.
        ``*, opset: int = MIN_OPSET``); callers pass them checked, defaults filled in
        (:meth:`resolve_options`).

        Args:
            module: the network to export, in eval mode, on the CPU.
            path: the main file; the others go to :meth:`files` ``(path)``.
            example: a float32 batch of at least 2 images (tracing input).
        """

    @abc.abstractmethod
    def load_runner(self, path: Path) -> Runner:
        """Load the written file(s) for verification: a callable from float32 batch to float32 logits."""

    # --- optional hooks ---------------------------------------------------------------------------

    def files(self, path: Path) -> tuple[Path, ...]:
        """Every file that an export to main file ``path`` consists of (default: same stem, each suffix)."""
        return (path, *(path.with_suffix(Path(name).suffix) for name in self.file_names[1:]))

    def signature(self, path: Path, runner: Runner, example: Tensor) -> Signature:
        """Names and shapes of the written file (-1: batch axis).

        The default takes the declared names and runs ``runner`` once for the output shape; a
        format whose file declares them (ONNX) reads them back from the file instead.
        """
        out = runner(example[:1])
        return self.input_name, (-1, *example.shape[1:]), self.output_name, (-1, *out.shape[1:])

    def check_architecture(self, spec: ArchSpec | None) -> None:
        """Raise :class:`~convnets.errors.ExportError` unless this format can hold a network of ``spec``
        (``None``: a module that is not a convnets ResNet). Called before anything slow (the command
        line calls it before it downloads weights); the default accepts every network."""

    def triton_notes(self, *, input_name: str, max_batch_size: int, image_size: int) -> str:
        """Extra Markdown for the Triton repository's README (e.g. building a TensorRT engine)."""
        return ""

    # --- shared machinery -------------------------------------------------------------------------

    def check_dependencies(self) -> None:
        """Import every module in :attr:`requires`, or raise :class:`MissingDependencyError` naming :attr:`extra`."""
        for module in self.requires:
            require(module, extra=self.extra, purpose=f"the {self.name} export")

    def resolve_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` checked and completed with defaults.

        Raises:
            UnknownArgumentError: a keyword this format does not take (the message lists those it does).
            InvalidArgumentError: a value its check refuses.
        """
        declared = {o.name: o for o in self.options}
        unknown = sorted(set(options) - set(declared))
        if unknown:
            takes = f"it takes {', '.join(declared)}" if declared else "it takes no options"
            raise UnknownArgumentError(f"the {self.name} export format does not take {', '.join(unknown)}; {takes}")
        resolved = {}
        for name, option in declared.items():
            value = options.get(name, option.default)
            resolved[name] = option.check(value) if option.check else value
        return resolved

    def check_precision(self, precision: str) -> None:
        """Raise :class:`InvalidArgumentError` unless this format exports ``precision``."""
        if precision not in self.precisions:
            raise InvalidArgumentError(f"export precision must be one of {', '.join(self.precisions)} for the "
                                       f"{self.name} format, got {precision!r}")

    @property
    def serves_on_triton(self) -> bool:
        """Whether Triton has a platform or backend for this format."""
        return bool(self.triton_platform or self.triton_backend)

    def __repr__(self) -> str:
        return f"<export format {self.name!r}>"
