"""Sharded runs over processes and machines: ``torchrun ... -m convnets predict ... --output FILE``.

Every process lists all the inputs (cheap) and keeps its shard of them: the run's inputs in order,
cut into batches of ``batch_size`` (the boundaries that a single process uses), batch ``k`` going to
rank ``k % world``. Rank ``r`` appends its records to its own part spool; at the end every rank waits
for the others and rank 0 merges the parts in the run's order (:func:`interleave`) and writes FILE
(:meth:`convnets.inference.outputs.Output.finish`): the file a single process writes, byte for byte.
``--resume`` continues each rank's part; without parts, rank 0 first splits what one process left
(:meth:`~convnets.inference.outputs.Output.split`), so that its work is kept.

Rank and world size come from torchrun's environment (``RANK``, ``WORLD_SIZE``); without it a run
is rank 0 of 1 and never touches ``torch.distributed``. The process group is the training one
(:func:`convnets.dist.setup`: gloo on CPUs, NCCL on GPUs with GPU ``LOCAL_RANK`` per process);
waiting for the slowest rank and summing counts use a gloo group without a practical time limit,
since a shard may finish hours before the last one. Multi-machine runs need the inputs under the
same paths on every machine and FILE's folder on a file system that they share (rank 0 reads every
part). This module imports PyTorch only when a process group is joined.
"""

from __future__ import annotations

import datetime
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from convnets import dist
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["ShardedRun", "interleave", "shard_count", "shard_items"]

T = TypeVar("T")

#: How long a rank waits for the others at the end (a shard may finish long before the slowest one).
WAIT_TIMEOUT = datetime.timedelta(days=7)


def _check(rank: int, world: int, batch_size: int = 1) -> None:
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise InvalidArgumentError(f"rank {rank!r} of world {world!r}: need 0 <= rank < world")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")


def shard_items(items: Iterable[T], rank: int, world: int, batch_size: int) -> Iterator[T]:
    """The items of batches ``rank``, ``rank + world``, ``rank + 2 * world``, ... of ``items``, lazily.

    Args:
        items: the whole run's inputs, in order (every rank passes the same ones).
        rank: this process, ``0 <= rank < world``.
        world: the number of processes.
        batch_size: items per batch; batch ``k`` holds items ``k * batch_size`` to ``(k + 1) * batch_size - 1``.

    Yields:
        This rank's items in their order; over all ranks, every item exactly once.
    """
    _check(rank, world, batch_size)
    if world == 1:
        yield from items
        return
    for position, item in enumerate(items):
        if (position // batch_size) % world == rank:
            yield item


def shard_count(total: int, rank: int, world: int, batch_size: int) -> int:
    """How many of ``total`` items :func:`shard_items` gives ``rank``."""
    _check(rank, world, batch_size)
    full, rest = divmod(total, batch_size * world)  # whole rounds of one batch per rank, then the rest
    return full * batch_size + min(max(rest - rank * batch_size, 0), batch_size)


def interleave(streams: Sequence[Iterable[T]], batch_size: int) -> Iterator[list[T]]:
    """The batches of the whole run from the shards of :func:`shard_items` (rank ``r``'s in ``streams[r]``).

    Batch ``k`` is the next ``batch_size`` items of stream ``k % len(streams)``; only the run's last
    batch may be short, after which every stream must be exhausted.

    Yields:
        Batches in the order of the whole run.

    Raises:
        InvalidArgumentError: the streams are not the shards of one run (one ends early, or holds
            items after the run's short last batch).
    """
    _check(0, len(streams), batch_size)
    iterators = [iter(s) for s in streams]
    for k in itertools.count():
        batch = list(itertools.islice(iterators[k % len(iterators)], batch_size))
        if batch:
            yield batch
        if len(batch) < batch_size:
            extra = [r for r, it in enumerate(iterators) if next(it, None) is not None]
            if extra:
                raise InvalidArgumentError(f"shard {k % len(iterators)} ends at batch {k} but shard(s) "
                                           f"{', '.join(map(str, extra))} hold more: these are not the parts "
                                           "of one run")
            return


class ShardedRun:
    """A command's run as rank ``rank`` of ``world``: its shard of the inputs, joining and leaving the job.

    A single process (``world == 1``) is the degenerate case: its shard is everything, and nothing
    waits. Typical use::

        run = ShardedRun.from_env(output=args.output, batch_size=args.batch_size)
        device = run.join(device)                        # before the model loads
        items = run.items(all_items)                     # predict these
        failed, done = run.sum([failed, done])           # totals over ranks
        ...rank 0 writes the output and reports...; run.close()

    Args:
        rank, world: this process and the number of processes (:func:`convnets.dist.rank_world`).
        batch_size: the run's batch size (the unit of sharding).
    """

    def __init__(self, rank: int, world: int, *, batch_size: int) -> None:
        _check(rank, world, batch_size)
        self.rank, self.world, self.batch_size = rank, world, batch_size
        self._group: Any = None

    @classmethod
    def from_env(cls, *, output: str | os.PathLike[str] | None, batch_size: int, reads_stdin: bool = False,
                 option: str = "output") -> ShardedRun:
        """The run as torchrun started this process; checks what a sharded run cannot do (no torch yet).

        Args:
            output: the run's output file.
            batch_size: the run's batch size.
            reads_stdin: the inputs come from standard input (``--from-file -``).
            option: the interface's name of ``output`` in messages.

        Raises:
            InvalidArgumentError: under torchrun without ``output`` (the ranks' stdout would
                interleave), or with inputs on standard input (every rank must list them all).
        """
        rank, world = dist.rank_world()
        under = f"under torchrun ({world} processes)"
        if world > 1 and output is None:
            why = f"{under} each process writes its share of the records to a part of the output file, which rank 0 " \
                  "merges at the end"
            raise InvalidArgumentError(f"{why}: pass {option}=FILE", keyword=option, cli=f"{why}: pass --{option} FILE")
        if world > 1 and reads_stdin:
            why = f"{under} every process lists all the inputs, so they cannot come from standard input"
            raise InvalidArgumentError(f"{why}: write them to a file and read that", keyword="from_file",
                                       cli=f"{why}: write them to a file and pass --from-file FILE")
        return cls(rank, world, batch_size=batch_size)

    @property
    def is_main(self) -> bool:
        """Rank 0: it shows progress, writes the output and reports totals."""
        return self.rank == 0

    def items(self, items: Iterable[T]) -> Iterator[T]:
        """This rank's shard of the run's ``items`` (:func:`shard_items`)."""
        return shard_items(items, self.rank, self.world, self.batch_size)

    def count(self, total: int | None) -> int | None:
        """How many of ``total`` inputs this rank handles (``None`` stays unknown)."""
        return None if total is None else shard_count(total, self.rank, self.world, self.batch_size)

    def join(self, device: torch.device, *, first: Callable[[], object] | None = None) -> torch.device:
        """Join torchrun's process group and return this rank's device (``device`` itself for one process).

        Args:
            device: the ``torch.device`` asked for: under torchrun a CUDA device becomes GPU
                ``LOCAL_RANK`` (NCCL), a CPU stays the CPU (gloo).
            first: what rank 0 does before the other ranks go on (splitting a resumed output into parts).

        Raises:
            InvalidArgumentError: a device other than CPU or CUDA under torchrun.
        """
        if self.world == 1:
            return device
        import torch.distributed

        if device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"device={str(device)!r}: under torchrun, each process runs on cpu or cuda",
                                       keyword="device", cli=f"--device {device}: under torchrun, each process runs "
                                                             "on cpu or cuda")
        ctx = dist.setup(device.type)
        # Waiting for the slowest rank and summing counts: CPU tensors over gloo, with a time limit
        # that a long shard cannot reach (the default group's, 10 to 30 minutes, could be).
        self._group = torch.distributed.new_group(backend="gloo", timeout=WAIT_TIMEOUT)
        if first is not None and self.is_main:
            first()
        self.barrier()
        return ctx.device

    def barrier(self) -> None:
        """Wait for every rank (nothing for a single process)."""
        if self._group is not None:
            import torch.distributed

            torch.distributed.barrier(group=self._group)

    def sum(self, values: Sequence[int]) -> list[int]:
        """Sum counts over the ranks (every rank gets the totals); waits for every rank."""
        if self._group is None:
            return list(values)
        import torch
        import torch.distributed

        tensor = torch.tensor(list(values), dtype=torch.int64)
        torch.distributed.all_reduce(tensor, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def close(self) -> None:
        """After rank 0 has written the output and reported: wait for it, then leave the process group.

        No rank may exit before that: torchrun stops the others when one exits with a failure status.
        """
        if self._group is not None:
            self.barrier()
            self._group = None
            dist.teardown()
