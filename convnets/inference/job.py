"""The batch-job driver that ``convnets predict`` and ``convnets embed`` run, a :class:`BatchJob` plug-in each.

:func:`claim_output` locks and checks the output before PyTorch loads; :func:`run_job` reads, resumes,
decodes, writes and reports (a job's :meth:`BatchJob.results` may compute elsewhere: ``--ray`` sends the
batches to a Ray cluster's actors, :mod:`convnets.ray`). Nothing heavy is imported at module level.
"""

from __future__ import annotations

import errno
import itertools
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.errors import ConvnetsError, InvalidArgumentError, message_for

if TYPE_CHECKING:
    import torch

    from convnets.inputs.listing import InputItem, Listing
    from convnets.inference.loader import Decoding, Result
    from convnets.inference.outputs import Output
    from convnets.inference.outputs.spool import Record, SpoolWriter
    from convnets.models.resnet import ResNet

__all__ = ["BatchJob", "Destination", "JobSettings", "claim_output", "input_error_message", "lock_output",
           "progress", "run_job", "skip_recorded"]


@dataclass(frozen=True)
class JobSettings:
    """The options every batch job shares (``inputs``: the command line's, listed and checked once;
    ``from_file="-"``: standard input; ``progress=None``: on a terminal)."""

    inputs: Listing
    decoding: Decoding
    recursive: bool = False
    from_file: str | None = None
    output: str | None = None
    resume: bool = False
    batch_size: int = 16
    image_size: int | None = None
    progress: bool | None = None


class BatchJob(ABC):
    """The per-job part of a batch job. Hooks run in order: :meth:`check`, :meth:`device`, :meth:`load` (which
    sets :attr:`width`, the values per record), :meth:`open`, :meth:`results` with :meth:`record` and
    :meth:`show` per result, :meth:`close`."""

    command: str = "job"
    kind: str = "predictions"
    unreadable: str = ""
    width: int = 0

    def check(self) -> None:
        """Before PyTorch loads: check the job's own options, so that a wrong one fails at once."""

    @abstractmethod
    def device(self) -> torch.device:
        """Where :meth:`load` puts the model (checked to exist)."""

    @abstractmethod
    def load(self, device: torch.device) -> ResNet:
        """Load the model onto ``device`` and set :attr:`width`; returns the model (for its preset and classes).
        What runs it is built by :meth:`results`."""

    def open(self, stack: ExitStack) -> SpoolWriter | None:
        """Open what the job writes besides ``--output``; returns where records go without it (default: nowhere)."""
        return None

    @abstractmethod
    def results(self, items: Iterator[InputItem], *, decoding: Decoding, batch_size: int, device: torch.device,
                start: int, on_batch: Callable[[int], None]) -> Iterator[Result]:
        """The library loop of this job (e.g. :func:`convnets.inference.predict.predict_items`)."""

    @abstractmethod
    def record(self, result: Any, error: str) -> Record:
        """The record written for ``result``; ``error``: its message in command-line words, if it failed."""

    def show(self, result: Any, record: Record) -> None:
        """Anything else done with each result (print it, draw it); default: nothing."""

    def close(self) -> None:
        """After the last result: what the job prints at the end; default: nothing."""


@dataclass(frozen=True)
class Destination:
    """What :func:`claim_output` claimed: the output (``None``: none)."""

    output: Output | None


def claim_output(job: BatchJob, *, output: str | None, resume: bool, stack: ExitStack) -> Destination | None:
    """Before PyTorch: the output's lock (held until ``stack`` unwinds) and checks, and the job's; returns
    where to write, or ``None`` when there is nothing to do (exit status 0)."""
    from convnets.dist import rank_world
    from convnets.inference.outputs import Output

    if rank_world()[1] > 1:
        raise InvalidArgumentError(f"convnets {job.command} runs as one process, not under torchrun (which is for "
                                   "training); to spread it over processes or machines, pass --ray ADDRESS")
    if resume and output is None:
        raise InvalidArgumentError("--resume continues an --output FILE: pass --output too")
    target = None if output is None else Output.of(output, job.kind)
    if target is not None:
        lock_output(target.path, stack)  # held to the end: a second run on the same output fails at once
        if not target.claim(resume=resume):
            print(f"convnets {job.command}: {output} is complete (no {target.spool().name} to continue); "
                  "nothing to do", file=sys.stderr)
            return None
    job.check()
    return Destination(target)


def run_job(job: BatchJob, settings: JobSettings, destination: Destination | None = None) -> int:
    """Run a batch job (``destination``: :func:`claim_output`'s, else claimed here); returns the exit status,
    1 if any input could not be read (now or in the resumed run)."""
    if destination is not None:
        return _run_locked(job, settings, destination)
    with ExitStack() as locks:
        destination = claim_output(job, output=settings.output, resume=settings.resume, stack=locks)
        return 0 if destination is None else _run_locked(job, settings, destination)


def lock_output(path: Path, stack: ExitStack, *, option: str = "output") -> None:
    """Hold ``FILE.lock`` beside the output ``path`` until ``stack`` unwinds; a second run is refused, naming
    the holder. Creating it is the first write in the directory, so a missing or read-only one fails here."""
    from convnets.paths import directory_problem
    from convnets.locking import LockHeldError, exclusive_lock

    lock = path.with_name(path.name + ".lock")
    where = f"--{option} {path}"
    try:
        stack.enter_context(exclusive_lock(lock, timeout=0))
    except LockHeldError as e:
        holder = e.holder or "another process"
        raise InvalidArgumentError(f"{where} is being written by another run ({holder}; lock file {lock}): wait for "
                                   f"it to finish, or choose another --{option}") from e
    except OSError as e:
        problem = directory_problem(path.parent) if e.errno in _DIRECTORY_ERRNOS else None
        raise InvalidArgumentError(f"{where}: {problem or f'cannot lock it ({e.strerror or e})'}") from e


#: Errors of creating a lock file that its directory explains.
_DIRECTORY_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS})


def _run_locked(job: BatchJob, settings: JobSettings, destination: Destination) -> int:
    """:func:`run_job` once the output is checked and locked."""
    from tqdm.auto import tqdm

    from convnets.inputs.listing import iter_inputs, read_sources
    from convnets.inference.outputs.spool import read_spool
    from convnets.preprocessing.presets import preset_for_model

    output = destination.output
    device = job.device()
    model = job.load(device)
    preset = preset_for_model(model).with_crop_size(settings.image_size or model.input_size)
    decoding = settings.decoding.with_preset(preset).for_device(device)
    with ExitStack() as stack:
        writer, found = job.open(stack), None
        spool = None if output is None else output.spool()
        if output is not None and spool is not None:
            writer, found = output.open(spool, resume=settings.resume, width=job.width, stack=stack)
        # The INPUTs were listed (and checked) in prepare; the --from-file list is read as it goes.
        items: Iterator[InputItem] = itertools.chain(settings.inputs, iter_inputs(
            read_sources((), settings.from_file, stack), recursive=settings.recursive))
        done = found.records if found else 0
        if done and spool is not None:
            items = skip_recorded(items, (r["input"] for r in read_spool(spool, job.kind)), str(spool))
        total, show = progress(settings, sys.stderr.isatty())
        failed = 0

        def on_batch(count: int) -> None:
            if writer is not None:
                writer.flush()
            bar.update(count)
        with tqdm(total=total, initial=done, unit="img", disable=not show, file=sys.stderr) as bar:
            for result in job.results(items, decoding=decoding, batch_size=settings.batch_size, device=device,
                                      start=done, on_batch=on_batch):
                done += 1
                error = input_error_message(result.error)  # once: it adds command-line advice to the error
                record = job.record(result, error)
                if writer is not None:
                    writer.write(record)
                job.show(result, record)
                if not result.ok:
                    failed += 1
                    bar.clear()
                    sys.stderr.write(f"convnets {job.command}: error: {error}\n")
    job.close()
    earlier = found.errors if found else 0
    if output is not None:
        output.finish(batch_size=settings.batch_size, width=job.width)
    if failed or earlier:
        also = f" ({earlier} recorded by the earlier run)" if earlier else ""
        print(f"convnets {job.command}: {failed + earlier} of {done} inputs could not be read{job.unreadable}{also}",
              file=sys.stderr)
    return 1 if failed or earlier else 0


def progress(settings: JobSettings, stderr_is_terminal: bool) -> tuple[int | None, bool]:
    """``(total, show)``: the number of inputs (``None``: unknown) and whether to show a progress bar.

    The total is known only when every input is a file or URL (listing a tree twice costs time).
    """
    total = None if settings.recursive or settings.from_file is not None else settings.inputs.total
    show = settings.progress if settings.progress is not None else (
        stderr_is_terminal and (total is None or total > settings.batch_size))
    return total, show


def skip_recorded(items: Iterator[InputItem], recorded: Iterable[str], output: str) -> Iterator[InputItem]:
    """``items`` after those that ``recorded`` (a resumed file's inputs) holds; refused unless they are a prefix."""
    for position, name in enumerate(recorded, 1):
        item = next(items, None)
        if item is None or item[0] != name:
            now = f"the inputs now give {item[0]!r} there" if item else "the inputs now end before it"
            raise InvalidArgumentError(f"--resume: {output} records {name!r} as input {position} but {now}; "
                                       "resume with the same inputs and options, or write a new --output")
    return items


def input_error_message(error: BaseException | None) -> str:
    """An input's error in command-line words, with ``--timeout`` advice; ``""`` for none."""
    if isinstance(error, ConvnetsError) and error.keyword == "timeout":
        error.add_cli_advice("Retry, or pass a larger --timeout.")
    return message_for(error, "cli") if error is not None else ""
