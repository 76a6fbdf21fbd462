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


class DataError(ConvnetsError, ValueError):
    """A training or validation data set is missing, empty, inconsistent or cannot be read."""


class TrainingDivergedError(ConvnetsError, RuntimeError):
    """Training stopped because the loss or the gradients stayed non-finite for too many steps."""
