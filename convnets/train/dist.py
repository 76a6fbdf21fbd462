"""Process-group helpers: one code path for a single process and for ``torchrun`` jobs.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them we run as rank 0 of 1
and never touch ``torch.distributed``. GPUs use NCCL, CPUs gloo.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from convnets.errors import InvalidArgumentError
from convnets.runtime import resolve_device

__all__ = ["DistContext", "all_reduce_sum", "barrier", "setup", "teardown"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job and which device it drives."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, shows progress and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def setup(device: str | None = None) -> DistContext:
    """Join the ``torchrun`` process group, if any, and pick this process's device.

    Args:
        device: ``"auto"`` or ``None`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (:func:`convnets.runtime.resolve_device`). Under torchrun each process takes GPU
            ``LOCAL_RANK``.

    Raises:
        InvalidArgumentError: ``device`` is unknown, or CUDA was asked for and is not available.
    """
    wanted = resolve_device(device, option="--device")
    use_cuda = wanted.type == "cuda"
    if wanted.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"--device {device}: training runs on cpu or cuda")
    rank, world, local_rank = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if use_cuda and wanted.index is not None and world == 1:
        torch.cuda.set_device(wanted.index)
        dev = wanted
    elif use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise InvalidArgumentError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); "
                                       "start at most one process per GPU (torchrun --nproc_per_node)")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend, device_id=dev if use_cuda else None)
        log.info("rank %d of %d joined the %s process group on %s", rank, world, backend, dev)
    return DistContext(rank, world, local_rank, dev)


def teardown() -> None:
    """Leave the process group (safe to call when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """Wait for every process (no-op for a single process)."""
    if ctx.distributed:
        dist.barrier()


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum numbers over all processes, in float64 so that counts and sums stay exact."""
    if not ctx.distributed:
        return [float(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()
