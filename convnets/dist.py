"""Where this process sits in a ``torchrun`` job, and the process group: one home for both.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them a run is rank 0 of 1
and never touches ``torch.distributed``. GPUs use NCCL, CPUs gloo. Training
(:mod:`convnets.train.loop`), evaluation and sharded inference (:mod:`convnets.inference.shard`) all read
the job from here. PyTorch is imported only by the functions that need it, so that reading the
rank stays cheap for the command line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["DistContext", "all_reduce_sum", "barrier", "rank_world", "setup", "teardown"]

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
    value = os.environ.get(name, "")
    return int(value) if value else default


def rank_world() -> tuple[int, int]:
    """This process's rank and the number of processes, from torchrun's ``RANK`` and ``WORLD_SIZE``.

    Returns:
        ``(rank, world)``; ``(0, 1)`` outside torchrun.

    Raises:
        InvalidArgumentError: they are not ``0 <= RANK < WORLD_SIZE``.
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not (world >= 1 and 0 <= rank < world):
        raise InvalidArgumentError(f"RANK={rank} and WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE "
                                   "(start the job with torchrun)")
    return rank, world


def local_processes() -> int:
    """The processes of this job on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun)."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", 1))


def setup(device: str | None = None) -> DistContext:
    """Join the ``torchrun`` process group, if any, and pick this process's device.

    Args:
        device: ``"auto"`` or ``None`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
            (:func:`convnets.runtime.resolve_device`). Under torchrun each process takes GPU
            ``LOCAL_RANK``.

    Raises:
        InvalidArgumentError: ``device`` is unknown, or CUDA was asked for and is not available.
    """
    import torch
    import torch.distributed as dist

    from convnets.runtime import resolve_device

    wanted = resolve_device(device, option="--device")
    use_cuda = wanted.type == "cuda"
    if wanted.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"--device {device}: training runs on cpu or cuda")
    (rank, world), local_rank = rank_world(), _env_int("LOCAL_RANK", 0)
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
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext) -> None:
    """Wait for every process (no-op for a single process)."""
    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(values: Sequence[float], ctx: DistContext) -> list[float]:
    """Sum numbers over all processes, in float64 so that counts and sums stay exact."""
    if not ctx.distributed:
        return [float(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()
