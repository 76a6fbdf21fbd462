"""Sharded runs over processes and machines: ``torchrun ... -m convnets predict ... --output FILE``.

Every process lists all the inputs (cheap) and keeps its shard of them: the run's inputs in order,
cut into batches of ``batch_size`` (the boundaries that a single process uses), batch ``k`` going to
rank ``k % world``. Rank ``r`` writes its records to :func:`part_path` (``FILE.part-0000r-of-0000W.SUFFIX``);
at the end every rank waits for the others and rank 0 merges the parts into ``FILE`` (batch 0 from
part 0, batch 1 from part 1, ...: :func:`interleave`), atomically, then removes them. The merged
file is the file a single process writes: the same records in the same order, each computed in the
same batch, so byte for byte the same for JSONL and CSV and the same table for Parquet.

``--resume`` continues each rank's own part. When there are no parts but ``FILE`` exists (a run of
one process, or a finished sharded one), rank 0 first splits ``FILE``'s complete records into parts
(:func:`split_into_parts`), so that its work is kept; ``FILE`` is replaced only by the final merge.

Rank and world size come from torchrun's environment (``RANK``, ``WORLD_SIZE``); without it a run
is rank 0 of 1 and never touches ``torch.distributed``. The process group is the training one
(:func:`convnets.dist.setup`: gloo on CPUs, NCCL on GPUs with GPU ``LOCAL_RANK`` per process);
waiting for the slowest rank and summing counts use a gloo group without a practical time limit,
since a shard may finish hours before the last one.

Multi-machine runs need the inputs under the same paths on every machine and ``FILE``'s folder on a
file system that they share (rank 0 reads every part).

This module imports PyTorch only when a process group is joined.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from convnets import dist
from convnets.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["PartFiles", "ShardedRun", "interleave", "merge_parts", "part_path", "part_paths", "shard_count",
           "shard_items", "split_into_parts"]

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class PartFiles:
    """How :func:`merge_parts` reads a part back, writes the whole output, and finds and removes parts.

    The default (:meth:`records`) is the prediction records of :mod:`convnets.inference.records`; ``convnets
    embed`` passes its embedding files (parts are spools, see :func:`convnets.inference.spool.read_embedding_records`).
    """

    read: Callable[[Path], Iterable[dict[str, Any]]]
    write: Callable[[Path, Iterable[list[dict[str, Any]]]], int]
    exists: Callable[[Path], bool] = Path.exists
    remove: Callable[[Path], None] = Path.unlink

    @classmethod
    def records(cls, fmt: str | None = None) -> PartFiles:
        """Prediction records in ``fmt`` (default: from each file's suffix)."""
        from convnets.inference.records import read_records, write_records

        return cls(read=lambda path: read_records(path, fmt), write=lambda path, batches: write_records(path, batches, fmt))

    @classmethod
    def embeddings(cls, dim: int) -> PartFiles:
        """Embedding files of ``dim`` values per vector: a part is its spool (never assembled)."""
        from convnets.inference.spool import read_embedding_records, spool_path, write_embedding_records

        return cls(read=read_embedding_records,
                   write=lambda path, batches: write_embedding_records(path, batches, dim=dim),
                   exists=lambda path: spool_path(path).exists(), remove=lambda path: spool_path(path).unlink())


def part_path(output: str | os.PathLike[str], rank: int, world: int) -> Path:
    """Where rank ``rank`` of ``world`` writes its records: ``out.jsonl`` -> ``out.jsonl.part-00001-of-00002.jsonl``.

    The format's suffix stays last, so that the part is a file of the same format.
    """
    _check(rank, world)
    path = Path(output)
    return path.with_name(f"{path.name}.part-{rank:05d}-of-{world:05d}{path.suffix}")


def part_paths(output: str | os.PathLike[str], world: int) -> list[Path]:
    """The parts of every rank, in rank order."""
    return [part_path(output, rank, world) for rank in range(world)]


def merge_parts(output: str | os.PathLike[str], world: int, batch_size: int, *, fmt: str | None = None,
                option: str = "output", files: PartFiles | None = None) -> int:
    """Merge the parts of ``world`` ranks into ``output`` in the run's order, then remove them.

    ``output`` is written atomically (a crash leaves the parts, or the finished file); the parts
    are removed only once it is in place.

    Args:
        output: the run's file; its suffix picks the format unless ``fmt`` is given.
        world: the number of ranks that wrote parts.
        batch_size: the run's batch size (each part holds whole batches but for the run's last).
        fmt: the format (:data:`convnets.inference.records.FORMATS`' values); default: from ``output``'s suffix.
        option: the interface's name of ``output`` in messages.
        files: how parts and the output are read and written; default: prediction records in ``fmt``.

    Returns:
        The number of records written.

    Raises:
        InvalidArgumentError: a part is missing (on several machines: ``output``'s folder must be shared)
            or the parts are not the shards of one run.
    """
    files = files or PartFiles.records(fmt)
    parts = part_paths(output, world)
    missing = [str(p) for p in parts if not files.exists(p)]
    if missing:
        problem = f"cannot merge {output}: {', '.join(missing)} not found; on several machines, "
        raise InvalidArgumentError(f"{problem}{option} must be in a folder that all of them share", keyword=option,
                                   cli=f"{problem}--{option} must be in a folder that all of them share")
    count = files.write(Path(output), interleave([files.read(p) for p in parts], batch_size))
    for p in parts:
        files.remove(p)
    log.info("merged %d parts into %s (%d records)", world, output, count)
    return count


def split_into_parts(output: str | os.PathLike[str], world: int, batch_size: int, *,
                     fmt: str | None = None) -> list[int]:
    """Write the records of a complete ``output`` as the parts that ``world`` ranks would have written.

    The inverse of :func:`merge_parts`; ``output`` is left in place. Used to resume a file of a
    single-process (or finished sharded) run with several processes.

    Returns:
        The number of records in each part.
    """
    from convnets.inference.records import read_records, write_records

    counts = []
    for rank, part in enumerate(part_paths(output, world)):
        records = shard_items(read_records(output, fmt), rank, world, batch_size)
        counts.append(write_records(part, _batched(records, batch_size), fmt))
    return counts


def _batched(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


class ShardedRun:
    """A command's run as rank ``rank`` of ``world``: what it reads, where it writes, and the end.

    A single process (``world == 1``) is the degenerate case: its shard is everything, its part is
    the output, and :meth:`finish` merges nothing. Typical use::

        run = ShardedRun.from_env(output=args.output, batch_size=args.batch_size)
        device = run.join(device)                        # before the model loads
        part = run.part(args.output)                     # write records here
        items = run.items(all_items)                     # predict these
        failed, done = run.finish([failed, done])        # totals over ranks; rank 0 merged
        ...report (rank 0)...; run.close()

    Args:
        rank, world: this process and the number of processes (:func:`convnets.dist.rank_world`).
        output: the run's output file (required when ``world > 1``).
        batch_size: the run's batch size (the unit of sharding).
        fmt: the output's format, for :func:`merge_parts`; default: from its suffix.
        option: the interface's name of ``output`` in messages.
    """

    def __init__(self, rank: int, world: int, *, output: str | os.PathLike[str] | None, batch_size: int,
                 fmt: str | None = None, option: str = "output") -> None:
        _check(rank, world, batch_size)
        self.rank, self.world, self.batch_size, self.fmt, self.option = rank, world, batch_size, fmt, option
        self.output = None if output is None else Path(output)
        self._group: Any = None

    @classmethod
    def from_env(cls, *, output: str | os.PathLike[str] | None, batch_size: int, reads_stdin: bool = False,
                 fmt: str | None = None, option: str = "output") -> ShardedRun:
        """The run as torchrun started this process; checks what a sharded run cannot do (no torch yet).

        Args:
            output: the run's output file.
            batch_size: the run's batch size.
            reads_stdin: the inputs come from standard input (``--from-file -``).
            fmt: the output's format; default: from its suffix.
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
            raise InvalidArgumentError(f"{why}: pass {option}=FILE (.jsonl, .csv or .parquet)", keyword=option,
                                       cli=f"{why}: pass --{option} FILE (.jsonl, .csv or .parquet)")
        if world > 1 and reads_stdin:
            why = f"{under} every process lists all the inputs, so they cannot come from standard input"
            raise InvalidArgumentError(f"{why}: write them to a file and read that", keyword="from_file",
                                       cli=f"{why}: write them to a file and pass --from-file FILE")
        return cls(rank, world, output=output, batch_size=batch_size, fmt=fmt, option=option)

    @property
    def is_main(self) -> bool:
        """Rank 0: it shows progress, merges and reports totals."""
        return self.rank == 0

    def part(self, output: str | os.PathLike[str]) -> Path:
        """Where this rank writes: :func:`part_path`, or ``output`` itself for a single process."""
        return Path(output) if self.world == 1 else part_path(output, self.rank, self.world)

    def items(self, items: Iterable[T]) -> Iterator[T]:
        """This rank's shard of the run's ``items`` (:func:`shard_items`)."""
        return shard_items(items, self.rank, self.world, self.batch_size)

    def count(self, total: int | None) -> int | None:
        """How many of ``total`` inputs this rank handles (``None`` stays unknown)."""
        return None if total is None else shard_count(total, self.rank, self.world, self.batch_size)

    def join(self, device: torch.device, *, resume: bool = False,
             repair: Callable[[Path], object] | None = None) -> torch.device:
        """Join torchrun's process group and return this rank's device (``device`` itself for one process).

        With ``resume``, when no part exists but the output does, rank 0 splits the output's records
        into parts first (after ``repair(output)`` cut away a torn tail), so that every rank resumes its own.

        Args:
            device: the ``torch.device`` asked for: under torchrun a CUDA device becomes GPU
                ``LOCAL_RANK`` (NCCL), a CPU stays the CPU (gloo).
            resume: the run continues earlier parts.
            repair: checks and repairs the output before it is split (e.g. :func:`convnets.inference.records.scan`).

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
        if resume and self.is_main and self.output is not None:
            self._split_for_resume(repair)
        self.barrier()
        return ctx.device

    def _split_for_resume(self, repair: Callable[[Path], object] | None) -> None:
        assert self.output is not None
        parts = part_paths(self.output, self.world)
        if any(p.exists() for p in parts) or not self.output.exists():
            return  # the parts are continued (an existing output is replaced by their merge)
        if repair is not None:
            repair(self.output)
        counts = split_into_parts(self.output, self.world, self.batch_size, fmt=self.fmt)
        log.warning("%s: split its %d records into %d parts to resume them", self.output, sum(counts), self.world)

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

    def finish(self, counts: Sequence[int], *, files: PartFiles | None = None) -> list[int]:
        """After this rank's part is complete and closed: wait for all ranks, sum ``counts``, and on
        rank 0 merge the parts into the output (:func:`merge_parts`, with ``files``).

        Returns:
            ``counts`` summed over the ranks.
        """
        totals = self.sum(counts)
        if self._group is not None and self.is_main and self.output is not None:
            merge_parts(self.output, self.world, self.batch_size, fmt=self.fmt, option=self.option, files=files)
        return totals

    def close(self) -> None:
        """After rank 0 has merged and reported: wait for it, then leave the process group.

        No rank may exit before that: torchrun stops the others when one exits with a failure status.
        """
        if self._group is not None:
            self.barrier()
            self._group = None
            dist.teardown()
