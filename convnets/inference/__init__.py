"""Batch inference at scale: ``convnets predict`` / :func:`predict`, ``convnets embed`` / :func:`embed`.

* :mod:`~convnets.inference.job`: the batch-job driver that both commands run (a plug-in each);
* :mod:`~convnets.inference.inputs`: inputs (files, folders, URLs, list files), lazily;
* :mod:`~convnets.inference.predict`: top-k predictions;
* :mod:`~convnets.inference.embed`: pooled stage outputs, one vector per image;
* :mod:`~convnets.inference.loader`: decoding settings, batch boundaries, decoding in worker
  processes, and the loop predict and embed share;
* :mod:`~convnets.inference.outputs`: output files: one resumable spool while a run goes, then the
  format asked for (a registry: ``.jsonl``, ``.csv``, ``.parquet``, ``.npy``);
* :mod:`~convnets.inference.shard`: runs under ``torchrun`` (a shard per rank, parts merged);
* :mod:`~convnets.inference.sheet`: contact sheets (``predict --show``).

PyTorch is imported on first use of a name that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convnets.lazy import lazy_getattr

if TYPE_CHECKING:
    from convnets.inference.embed import embed
    from convnets.inference.predict import predict

__all__ = ["embed", "predict"]

__getattr__ = lazy_getattr(__name__, {"embed": "embed", "predict": "predict"})
