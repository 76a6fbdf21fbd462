"""Read a checkpoint file safely: ``torch.load(weights_only=True)`` or the safetensors library.

The one place that opens checkpoint files. A checkpoint can never run code: pickles are read with
``weights_only=True`` (plus numpy scalars, which only rebuild numbers), ``.safetensors`` files
never reach the unpickler. Zip-format files are memory-mapped, so no tensor is copied into memory
before it is needed; legacy (pre-1.6) files fall back to a normal read.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import zipfile
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from convnets.errors import CheckpointError
from convnets.weights.safetensors_io import is_safetensors, read_safetensors

__all__ = ["read_checkpoint"]

# Upstream training checkpoints store metrics such as best_prec1 as numpy scalars; these
# reconstructors only rebuild numbers and dtypes, so allowing them keeps weights_only safe.
# Pickles name the scalar reconstructor by the module path of the numpy that wrote them.
try:  # numpy >= 1.26 (1.26's numpy._core is an alias, importable but no attribute of numpy until imported)
    _np_scalar = importlib.import_module("numpy._core.multiarray").scalar
except ImportError:  # numpy < 1.26
    _np_scalar = importlib.import_module("numpy.core.multiarray").scalar
_SAFE_NUMPY: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    (_np_scalar, "numpy.core.multiarray.scalar"), (_np_scalar, "numpy._core.multiarray.scalar"),
    np.dtype, *{type(np.dtype(t)) for t in "?bBhHiIlLqQefdgFD"}]


def read_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Load a checkpoint file with ``weights_only=True``, memory-mapped when the format allows.

    A safetensors file is returned as ``{"state_dict": tensors, ...metadata}``, the shape of a
    self-describing training checkpoint (see :func:`~convnets.weights.safetensors_io.read_safetensors`).

    Raises:
        CheckpointError: the file is missing, unreadable, not a PyTorch or safetensors checkpoint,
            or holds objects other than tensors and plain containers.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    if is_safetensors(path):
        return read_safetensors(path)
    try:
        # Only the zip format (torch >= 1.6) can be memory-mapped; legacy files are read whole.
        mmap = zipfile.is_zipfile(path)
        with torch.serialization.safe_globals(_SAFE_NUMPY):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        culprit = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
        if culprit:
            raise CheckpointError(
                f"refusing to load {path}: it references {culprit.group(1)}, a Python object other than "
                "tensors and plain containers, which could run code when unpickled. Re-save it as "
                "torch.save(model.state_dict(), path) from a trusted environment") from e
        raise _not_a_checkpoint(path, e) from e
    except Exception as e:  # noqa: BLE001 -- on arbitrary bytes the unpickler fails with any exception type
        raise _not_a_checkpoint(path, e) from e


def _not_a_checkpoint(path: Path, e: Exception) -> CheckpointError:
    if isinstance(e, pickle.UnpicklingError):
        reason = "unreadable pickle data"  # torch's own text here is advice about weights_only
    else:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"{path} is not a PyTorch checkpoint (truncated, or another kind of file): "
                           f"{type(e).__name__}: {reason[:200]}")
