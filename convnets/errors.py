"""Exceptions that convnets raises for problems a user can cause or fix.

Each subclasses :class:`ConvnetsError` and also the built-in type a caller would already catch
(``ValueError`` for bad arguments or files, ``OSError`` for missing resources), so that existing
``except ValueError`` code keeps working. Messages name the input and say what to do.
"""

from __future__ import annotations


class ConvnetsError(Exception):
    """Base class of every error that convnets raises on purpose."""


class UnknownModelError(ConvnetsError, ValueError):
    """A model name that is not in the registry; the message lists the valid names."""


class ManifestError(ConvnetsError, ValueError):
    """``weights_manifest.json`` is malformed; the message names the entry and field."""


class CheckpointError(ConvnetsError, ValueError):
    """A checkpoint file cannot be read, or its tensors do not fit the requested model."""


class WeightsUnavailableError(ConvnetsError, OSError):
    """Pretrained weights could not be found in the cache, the mirror or downloaded."""


class UnsupportedPrecisionError(ConvnetsError, ValueError):
    """A precision that the device cannot run (e.g. fp16 on a CPU); the message says what can."""


class ExportError(ConvnetsError, RuntimeError):
    """An export failed, or the exported model disagrees with PyTorch beyond the tolerance."""


class MissingDependencyError(ConvnetsError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that brings it."""
