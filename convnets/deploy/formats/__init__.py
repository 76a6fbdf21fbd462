"""The registry of export formats (``convnets export --format NAME``, ``export_model(format=NAME)``).

Each format is one module here with an :class:`~convnets.deploy.formats.base.ExportFormat`
subclass and a module-level ``FORMAT`` instance. Adding a built-in format is that module plus its
name in :data:`FORMATS` (a :class:`~convnets.plugins.Registry`); :mod:`convnets.deploy.export`,
:mod:`convnets.deploy.triton` and the command line take everything else (files, tensor names, Triton
platform, options, verification runtime) from the registry. Other code can add a format with
:func:`register_format` or the ``@FORMATS.plugin`` class decorator.

No PyTorch is imported here: formats load their exporters when they write.
"""

from __future__ import annotations

from convnets.deploy.formats.base import (EXPORT_PRECISIONS, ExportFormat, FormatOption, Runner, Signature,
                                          quiet_export_warnings, require)
from convnets.plugins import Registry

__all__ = ["EXPORT_PRECISIONS", "FORMATS", "ExportFormat", "FormatOption", "Runner", "Signature", "export_formats",
           "get_format", "quiet_export_warnings", "register_format", "require"]

#: Every export format: the built-in ones are this package's modules, each with its ``FORMAT``, in the
#: order ``--help`` lists them.
FORMATS: Registry[ExportFormat] = Registry("export format", ExportFormat, package=__name__,
                                           builtin={"onnx": "onnx", "openvino": "openvino", "aoti": "aoti",
                                                    "torchscript": "torchscript", "timm": "timm"},
                                           attribute="FORMAT")


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it (:meth:`Registry.register`)."""
    return FORMATS.register(fmt)


def get_format(name: str) -> ExportFormat:
    """The registered format called ``name``.

    Raises:
        InvalidArgumentError: no such format (the message lists the registered ones).
    """
    return FORMATS.get(name)


def export_formats() -> tuple[ExportFormat, ...]:
    """Every registered format, built-in ones first, in registration order."""
    return FORMATS.all()
