"""Batch inference: ``convnets predict`` / :func:`predict`, ``convnets embed`` / :func:`embed` (their modules' roles:
``docs/design.md``; explanations are :mod:`convnets.explanations`'). PyTorch is imported on first use of a name that
needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.lazy import lazy_getattr

if TYPE_CHECKING:
    from convnets.inference.embed import embed
    from convnets.inference.predict import predict

__all__ = ["embed", "predict"]

__getattr__ = lazy_getattr(__name__, {"embed": "embed", "predict": "predict"})
