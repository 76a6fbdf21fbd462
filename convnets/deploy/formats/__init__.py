"""The registry of export formats (``convnets export --format NAME``, ``export_model(format=NAME)``).

Each format is one module here with an :class:`~convnets.deploy.formats.base.ExportFormat`
subclass and a module-level ``FORMAT`` instance. Adding a built-in format is that module plus its
name in :data:`_BUILTIN`; :mod:`convnets.deploy.export`, :mod:`convnets.deploy.triton` and the
command line take everything else (files, tensor names, Triton platform, options, verification
runtime) from the registry. Other code can add a format with :func:`register_format`.

No PyTorch is imported here: formats load their exporters when they write.
"""

from __future__ import annotations

import importlib

from convnets.deploy.formats.base import (EXPORT_PRECISIONS, ExportFormat, FormatOption, Runner, Signature,
                                          quiet_export_warnings, require)
from convnets.errors import InvalidArgumentError

__all__ = ["EXPORT_PRECISIONS", "ExportFormat", "FormatOption", "Runner", "Signature", "export_formats",
           "get_format", "quiet_export_warnings", "register_format", "require"]

#: Built-in formats: module names in this package, in the order ``--help`` lists them.
_BUILTIN: tuple[str, ...] = ("onnx", "openvino", "aoti", "torchscript", "timm")

_REGISTRY: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Add ``fmt`` to the registry under ``fmt.name`` and return it.

    Raises:
        InvalidArgumentError: another format already has that name.
    """
    if not isinstance(fmt, ExportFormat):
        raise InvalidArgumentError(f"register_format takes an ExportFormat instance, got {fmt!r}")
    if fmt.name in _REGISTRY and type(_REGISTRY[fmt.name]) is not type(fmt):
        raise InvalidArgumentError(f"an export format named {fmt.name!r} is already registered "
                                   f"({type(_REGISTRY[fmt.name]).__qualname__})")
    _REGISTRY[fmt.name] = fmt
    return fmt


def get_format(name: str) -> ExportFormat:
    """The registered format called ``name``.

    Raises:
        InvalidArgumentError: no such format (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown export format {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def export_formats() -> tuple[ExportFormat, ...]:
    """Every registered format, built-in ones first, in registration order."""
    return tuple(_REGISTRY.values())


for _module in _BUILTIN:
    register_format(importlib.import_module(f"{__name__}.{_module}").FORMAT)
