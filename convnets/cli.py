"""The ``convnets`` command line: one subcommand per feature module.

Each module listed in :data:`COMMANDS` provides ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors that a user can fix (:class:`~convnets.errors.ConvnetsError`, bad
files, bad values) end in one line on stderr and a non-zero exit status, never a traceback; set
``CONVNETS_DEBUG=1`` to see the traceback anyway.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from convnets.errors import ConvnetsError

#: subcommand -> module that implements it
COMMANDS: dict[str, str] = {
    "predict": "convnets.commands.predict",
    "train": "convnets.commands.train",
    "export": "convnets.commands.export",
    "benchmark": "convnets.commands.benchmark",
    "weights": "convnets.commands.weights",
}

EXIT_ERROR = 1
EXIT_USAGE = 2  # argparse's own status for bad arguments
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="convnets",
        description="NVIDIA's ResNet-family classifiers: predict, train, export, benchmark, manage weights.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("convnets: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`convnets predict ... | head`): not worth a message.
        # Point stdout at devnull so that the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    except (ConvnetsError, OSError, ValueError) as e:
        if os.environ.get("CONVNETS_DEBUG"):
            raise
        print(f"convnets {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
