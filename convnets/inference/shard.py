"""Sharded runs under ``torchrun ... -m convnets predict ... --output FILE``: batch ``k`` goes to rank
``k % world``, which appends it to its own part spool; rank 0 merges the parts in the run's order
(:func:`interleave`), so FILE is the one a single process writes. Without torchrun a run is rank 0 of 1.
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
    """The items of batches ``rank``, ``rank + world``, ... of ``items``, lazily: over all ranks, each once."""
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
    full, rest = divmod(total, batch_size * world)  # whole rounds of a batch per rank, then the rest
    return full * batch_size + min(max(rest - rank * batch_size, 0), batch_size)


def interleave(streams: Sequence[Iterable[T]], batch_size: int) -> Iterator[list[T]]:
    """The whole run's batches, in order, from the shards of :func:`shard_items` (rank ``r``'s in ``streams[r]``);
    refuses streams that are not the shards of one run."""
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
    """A command's run as rank ``rank`` of ``world`` (one process: everything, nothing waits): its shard of the
    inputs (:meth:`items`), joining (:meth:`join`), totals (:meth:`sum`) and leaving (:meth:`close`)."""

    def __init__(self, rank: int, world: int, *, batch_size: int) -> None:
        _check(rank, world, batch_size)
        self.rank, self.world, self.batch_size = rank, world, batch_size
        self._group: Any = None

    @classmethod
    def from_env(cls, *, output: str | os.PathLike[str] | None, batch_size: int, reads_stdin: bool = False,
                 option: str = "output") -> ShardedRun:
        """The run as torchrun started this process (no torch yet); refuses what a sharded run cannot do."""
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
        """Join torchrun's process group (rank 0 runs ``first`` before the others go on) and return this
        rank's device (CUDA: GPU ``LOCAL_RANK``)."""
        if self.world == 1:
            return device
        import torch.distributed

        if device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"device={str(device)!r}: under torchrun, each process runs on cpu or cuda",
                                       keyword="device", cli=f"--device {device}: under torchrun, each process runs "
                                                             "on cpu or cuda")
        ctx = dist.setup(device.type)
        # Gloo, with a time limit a long shard cannot reach (the default group's 10-30 minutes could be).
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
        """Wait for rank 0 to write and report, then leave the group (torchrun stops all when one fails)."""
        if self._group is not None:
            self.barrier()
            self._group = None
            dist.teardown()
