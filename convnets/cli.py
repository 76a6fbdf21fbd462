"""The ``convnets`` command line: one subcommand per feature module.

Each module listed in :data:`COMMANDS` provides ``add_arguments(parser)`` and ``run(args) -> int``,
or instead ``prepare(args, stack)``, which returns the run (a function of no arguments that
returns the exit status) or an exit status to end with at once. Arguments are parsed before
anything heavy is imported: this module lists the commands with their one-line help without
importing them, only the command named on the command line is imported to add its options, and
command modules import PyTorch inside the run. So ``convnets --help``, ``convnets predict --help``
and usage errors answer at once (a mistyped option with the nearest one: ``--top-k (did you mean
--topk?)``, :class:`CommandLineParser`; ``convnets --version`` prints the version). So do mistakes
that ``prepare`` finds, also before PyTorch: an input path that does not exist, is not an image or
is a folder without one, an output of an unknown format or in a directory that is missing or cannot
be written (:func:`convnets.commands.path_checks.usage_errors`: one line, exit status 2, as
argparse's own errors), and an output that another run holds. What ``prepare`` holds in ``stack``
(an output's lock) stays held until the run ends.

SIGTERM ends a run as SIGINT (Ctrl-C) does (:mod:`convnets.stopping`): :class:`Terminated`, a
:class:`KeyboardInterrupt`, is raised in the main thread, so decoding workers are stopped, outputs closed (what was written can be
continued with ``--resume``) and locks released; the exit status is 143 (130 for SIGINT), with one
line on stderr and no traceback.

Pillow's warnings about odd image data (one corrupt EXIF block makes it warn once per tag, thousands
of lines) are counted, decoding processes' included, into one line at the end of the run; ``-vv``
logs each.

Errors that a user can fix (:class:`~convnets.errors.ConvnetsError`, bad files, bad values) end in
one line on stderr and a non-zero exit status, never a traceback; so do sizes too large for the
machine (``MemoryError``, an allocator's out-of-memory ``RuntimeError``, ``OverflowError``,
``SystemError`` and ``RecursionError`` from absurd sizes), with advice. Set ``CONVNETS_DEBUG=1`` to
see the traceback anyway. The line is the error's message in command-line words
(:func:`convnets.errors.message_for` ``(error, "cli")``): options, never Python keywords or calls.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import gc
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TextIO

from convnets import stopping
from convnets.constants import VERSION
from convnets.errors import ConvnetsError, message_for
from convnets.stopping import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated


@dataclass(frozen=True)
class Command:
    """A subcommand: the module that implements it and its one-line help."""

    module: str
    help: str


#: subcommand -> its module and help line (the help lives here so that listing needs no import)
COMMANDS: dict[str, Command] = {
    "predict": Command("convnets.commands.predict", "classify images (files, directories of images, http(s) URLs)"),
    "embed": Command("convnets.commands.embed",
                     "write one vector per image (a stage's pooled features) to .npy or .parquet, resumable"),
    "explain": Command("convnets.commands.explain",
                       "show where in each image the evidence for a class lies: Grad-CAM heat maps (.npy) and "
                       "overlays (.png) per image and class (the explain extra)"),
    "train": Command("convnets.commands.train",
                     "fine-tune a model on an ImageFolder data set, or multi-label from a labels CSV (NVIDIA's "
                     "recipe; DDP under torchrun)"),
    "export": Command("convnets.commands.export",
                      "export a model to ONNX, OpenVINO IR, AOTInductor, ... (verified against PyTorch), "
                      "optionally as a Triton repository"),
    "benchmark": Command("convnets.commands.benchmark",
                         "measure inference or training throughput (img/s) and latency percentiles per batch size"),
    "weights": Command("convnets.commands.weights",
                       "list pretrained weights and their cache state, fetch them, or convert a checkpoint to "
                       "safetensors"),
    "evaluate": Command("convnets.commands.evaluate",
                        "top-1/top-5, per-class precision/recall/F1 and the confusion matrix on a labelled image set "
                        "(class folders or ImageNet's validation layouts); mAP and F1 of a multi-label model"),
    "cache": Command("convnets.commands.cache",
                     "list, trim or clear the engine cache (graphs converted for ONNX Runtime / OpenVINO, "
                     "and auto's checks)"),
    "serve": Command("convnets.commands.serve",
                     "serve a classifier on the Triton Inference Server: KServe v2 over HTTP and gRPC, dynamic "
                     "batching, health and metrics (the serve extra)"),
    "plot": Command("convnets.commands.plot",
                    "draw a training run's loss and top-1 curves (OUT/curves.png) from its metrics.jsonl"),
}

EXIT_ERROR = 1
EXIT_USAGE = 2  # argparse's own status for bad arguments
class CommandLineParser(argparse.ArgumentParser):
    """argparse's parser (every subcommand's too), which answers a mistyped option with the nearest
    one: ``unrecognized arguments: --top-k (did you mean --topk?)``, from the options of the command
    it was given to (:mod:`difflib`; Python 3.11's argparse has no ``suggest_on_error``)."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]  # one signature, not overloads
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = self._command_parser(parsed)
            hints = [hint for hint in map(parser._suggestion, unknown) if hint]
            parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else ""))
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> CommandLineParser:
        """The parser of the subcommand that ``parsed`` names (whose options the mistake was among), or this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, CommandLineParser):
                    return chosen
        return self

    def _suggestion(self, word: str) -> str | None:
        """``did you mean --topk?`` for an unknown option ``word`` (``--top-k``, ``--top-k=3``), else ``None``."""
        if not word.startswith("--"):
            return None
        options = [option for option in self._option_string_actions if option.startswith("--")]
        close = difflib.get_close_matches(word.partition("=")[0], options, n=1, cutoff=0.6)
        return f"did you mean {close[0]}?" if close else None


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser, listing every subcommand.

    Args:
        commands: the subcommands whose modules are imported to add their options (``None``: all
            of them). The others are listed with their help line and have no options.
    """
    selected = set(COMMANDS) if commands is None else set(commands)
    parser = CommandLineParser(
        prog="convnets",
        description="NVIDIA's ResNet-family classifiers: predict, embed, train, export, serve, benchmark, manage "
                    "weights.",
        epilog=f"exit status: 0 done; {EXIT_ERROR} an error (one line on stderr), or an input that could not be read; "
               f"{EXIT_USAGE} a usage error, also a path that does not exist, an INPUT that is not an image or a folder "
               "without images, or an output that cannot be written "
               f"(answered before anything heavy is imported); {EXIT_INTERRUPTED} interrupted (SIGINT, Ctrl-C); "
               f"{EXIT_TERMINATED} terminated (SIGTERM). A run stopped by a signal stops its workers, keeps what it "
               "wrote (predict and embed: continue it with --resume) and releases its locks")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}",
                        help="print the version of convnets and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        if name in selected:
            module = importlib.import_module(command.module)
            module.add_arguments(p)
            p.set_defaults(_prepare=getattr(module, "prepare", None) or _prepared(module.run))
    return parser


#: A command's ``prepare(args, stack)``: the run, or an exit status to end with at once.
Prepare = Callable[[argparse.Namespace, ExitStack], "Callable[[], int] | int"]


def _prepared(run: Callable[[argparse.Namespace], int]) -> Prepare:
    """The ``prepare`` of a command that only has ``run(args)``: nothing to check or hold first."""
    return lambda args, stack: lambda: run(args)


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the first word that is not an option, if it is one.

    The top-level options take no values, so the first such word is the subcommand's name.
    """
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    Called without ``argv`` (the console script, ``python -m convnets``), it is the program: once the run
    is over, a Ctrl-C while the interpreter shuts down ends the process at once, quietly
    (:func:`convnets.stopping.interrupt_ends_the_exit`).
    """
    try:
        return _interruptible(sys.argv[1:] if argv is None else list(argv))
    finally:
        if argv is None:
            stopping.interrupt_ends_the_exit()


def _interruptible(argv: list[str]) -> int:
    """:func:`_main`, with SIGTERM and SIGINT ending it as an interruption (one line, status 143 or 130)."""
    with stopping.signals_as_interrupts():
        try:
            return _main(argv)
        except KeyboardInterrupt as stop:
            terminated = isinstance(stop, Terminated)
            line, status = ("terminated", EXIT_TERMINATED) if terminated else ("interrupted", EXIT_INTERRUPTED)
            say = stopping.end_by_force_after(stopping.STOP_TIMEOUT_S, f"convnets: {line}", status)
            # The signal stopped the run wherever it was, maybe half-way through building an object
            # (a DataLoader's iterator whose workers had just started): its finalizer fails when the
            # traceback goes, at the end of this block, and would print a traceback. Not worth one.
            previous, sys.unraisablehook = sys.unraisablehook, _ignore
        try:
            gc.collect()  # what the stopped run left in reference cycles goes too, as quietly
        finally:
            sys.unraisablehook = previous
        say()  # the clean-up may still hang later, in the interpreter's exit: the timer does not say it again
        return status


def _ignore(unraisable: object) -> None:
    """A :data:`sys.unraisablehook` that prints nothing."""


def _main(argv: list[str]) -> int:
    command = command_in(argv)
    args = build_parser([command] if command else []).parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # --engine auto says which engine it picked, one line on stderr, also without -v.
    logging.getLogger("convnets.auto").setLevel(min(level, logging.INFO))
    # What prepare holds (an output's lock) stays held until the run has ended.
    with ExitStack() as held:
        try:
            run = args._prepare(args, held)
            if isinstance(run, int):
                return run
            # Around the run only: prepare's answers (usage errors, a held output) need no shared memory.
            with _pillow_warnings_counted(args.command):
                return int(run() or 0)
        except argparse.ArgumentError as e:  # prepare's usage errors: one line, argparse's status
            sys.stderr.write(f"convnets {args.command}: error: {e}\n")
            return EXIT_USAGE
        except BrokenPipeError:
            # The reader of our output went away (`convnets predict ... | head`): not worth a message.
            # Point stdout at devnull so that the interpreter's final flush does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_ERROR
        except Exception as e:
            message = _error_line(e)
            if message is None or os.environ.get("CONVNETS_DEBUG"):
                raise
            # One write: print() writes the text and the newline separately, and under torchrun the ranks
            # share stderr, so their lines could interleave.
            sys.stderr.write(f"convnets {args.command}: error: {message}\n")
            return EXIT_ERROR


@contextlib.contextmanager
def _pillow_warnings_counted(command: str) -> Iterator[None]:
    """Count Pillow's warnings instead of printing them; one line on stderr at the end says how many.

    The count lives in shared memory, so that the decoding processes forked from this one (they
    inherit the hook) add theirs. The warning filters and hook are this process's own for the
    duration of the run, restored after it.
    """
    from ctypes import c_char, c_longlong
    from multiprocessing import Array, Value

    try:
        count = Value(c_longlong, 0)
        first = Array(c_char, 240)
    except OSError:  # no shared memory or semaphores here (some sandboxes): Pillow prints as it does
        yield
        return
    log = logging.getLogger("convnets.pillow")
    marker = f"{os.sep}PIL{os.sep}"
    with warnings.catch_warnings():
        show = warnings.showwarning
        warnings.filterwarnings("always", module=r"PIL\.")  # each one counted, not only the first of its kind

        def count_pillows(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                          file: TextIO | None = None, line: str | None = None) -> None:
            if marker not in filename:
                show(message, category, filename, lineno, file, line)
                return
            log.debug("%s: %s (%s:%d)", category.__name__, message, filename, lineno)
            with count.get_lock():
                count.value += 1
                if not first.value:
                    first.value = " ".join(str(message).split()).encode("utf-8", "replace")[:len(first) - 1]
        warnings.showwarning = count_pillows
        try:
            yield
        finally:
            if count.value:
                example = first.value.decode("utf-8", "replace")
                sys.stderr.write(f"convnets {command}: Pillow warned {count.value} time(s) about odd image data "
                                 f"(first: {example}); -vv shows each\n")


def _error_line(error: Exception) -> str | None:
    """The message for an error a user can do something about; ``None``: a bug, for the traceback."""
    if isinstance(error, (ConvnetsError, OSError, ValueError)):
        return message_for(error, "cli")
    if isinstance(error, (MemoryError, OverflowError, SystemError, RecursionError)) or (
            isinstance(error, RuntimeError) and _is_allocation_failure(error)):
        return _too_large(error)
    return None


#: What the allocators say when a tensor does not fit (PyTorch's CPU allocator, CUDA, MPS).
_ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "not enough memory")


def _is_allocation_failure(error: RuntimeError) -> bool:
    # torch.OutOfMemoryError (CUDA) is a RuntimeError; this module does not import torch to name it.
    text = str(error).lower()
    return type(error).__name__ == "OutOfMemoryError" or any(s in text for s in _ALLOCATION_FAILURES)


def _too_large(error: BaseException) -> str:
    """A one-line message for a size that exceeds the machine (memory, integer range)."""
    detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    what = f"{type(error).__name__}{': ' + detail if detail else ''}"
    if isinstance(error, RecursionError):
        problem = "a value is nested too deeply"
    elif isinstance(error, (OverflowError, SystemError)):
        problem = "a size or number is too large to compute with"
    else:
        problem = "out of memory"
    return (f"{problem} ({what}). Use smaller sizes (--batch-size, --batch-sizes, --image-size, --arch-kwargs) "
            "or a machine with more memory; if a --weights file records the sizes, check that it is the right "
            "file. Set CONVNETS_DEBUG=1 for the traceback")


if __name__ == "__main__":
    sys.exit(main())
