"""What an engine-cache entry is keyed by: a digest of the model, the engine, precision, shape and versions.

Nothing here touches the cache directory (:mod:`convnets.deploy.cache.disk` does), and nothing
imports PyTorch at module level.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["LAYOUT", "digest", "entry_key", "key_fields", "model_digest", "versions"]

#: The layout of an entry; part of the key (a new layout never reads an old entry).
LAYOUT = 1
_CHUNK = 16 << 20

#: Each model's digest, per model object, inside :func:`convnets.deploy.cache.use_cache`'s block.
digests: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("convnets_model_digests",
                                                                                default=None)


def versions(runtimes: Sequence[str]) -> dict[str, str]:
    """The versions that an entry depends on: convnets, torch and each of ``runtimes`` (module names)."""
    import importlib
    import importlib.metadata

    # The package is loaded (this module is part of it); read from sys.modules, not imported back.
    found = {"convnets": str(getattr(sys.modules["convnets"], "__version__", "unknown"))}
    for name in ("torch", *runtimes):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = getattr(importlib.import_module(name), "__version__", "unknown")
        found[name] = str(version)
    return found


def digest(views: Iterable[memoryview]) -> str:
    """SHA-256 over the SHA-256 of each ``_CHUNK`` of ``views``, hashed in threads (hashlib releases the GIL)."""
    chunks = [view[i:i + _CHUNK] for view in views for i in range(0, len(view), _CHUNK)]
    workers = max(1, min(8, os.cpu_count() or 1, len(chunks)))
    outer = hashlib.sha256()
    if workers == 1:
        parts: Iterable[bytes] = (hashlib.sha256(chunk).digest() for chunk in chunks)
    else:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))
    for chunk, part in zip(chunks, parts):
        outer.update(len(chunk).to_bytes(8, "little") + part)
    return outer.hexdigest()


def model_digest(model: nn.Module) -> str:
    """A digest of ``model``: its class, ``repr`` (the structure) and every ``state_dict`` tensor.

    Inside :func:`~convnets.deploy.cache.use_cache` the result is remembered per model object.
    """
    import torch

    memo = digests.get()
    if memo is not None and id(model) in memo:
        return memo[id(model)]
    header = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n".encode())
    views = []
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            header.update(f"{name}={value!r}\n".encode())
            continue
        tensor = value.detach().to("cpu").contiguous()
        header.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        if tensor.numel():
            views.append(tensor.reshape(-1).view(torch.uint8).numpy().data)
    result = hashlib.sha256((header.hexdigest() + digest(views)).encode()).hexdigest()
    if memo is not None:
        memo[id(model)] = result
    return result


def key_fields(model: nn.Module, *, engine: str, precision: str, shape: Sequence[int],
               runtimes: Sequence[str]) -> dict[str, Any]:
    """What an entry's key is made of (see :mod:`convnets.deploy.cache`)."""
    spec = getattr(model, "spec", None)
    return {"layout": LAYOUT, "model": str(getattr(spec, "name", type(model).__name__)),
            "weights": model_digest(model), "engine": engine, "precision": precision,
            "shape": [int(s) for s in shape], "versions": versions(runtimes)}


def entry_key(fields: dict[str, Any]) -> str:
    """The key (SHA-256, hex) of the entry that ``fields`` (:func:`key_fields`) describe."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
