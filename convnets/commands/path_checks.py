"""The checks of the paths named on the command line, run by a command's ``prepare(args, stack)``
(see :mod:`convnets.cli`) before anything heavy is imported, so that a misspelt input or an output
that cannot be written answers at once; under :func:`usage_errors` what they refuse is a usage
error (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from convnets.errors import InvalidArgumentError, message_for
from convnets.preprocessing.sources import is_url

__all__ = ["check_inputs_exist", "check_output_directory", "check_output_file", "usage_errors"]


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Report the :class:`InvalidArgumentError` of the checks inside as a usage error
    (:class:`argparse.ArgumentError`): the command line prints its message in one line and exits
    with status 2, as for argparse's own errors."""
    try:
        yield
    except InvalidArgumentError as e:
        raise argparse.ArgumentError(None, message_for(e, "cli")) from e


def check_inputs_exist(name: str, *values: str | os.PathLike[str] | None) -> None:
    """Each of ``values`` that is a local path must exist; URLs and ``None`` are skipped (a
    download says what is wrong with a URL), and so are paths that cannot be looked at (a
    permission denied: the run reports it, naming the input).

    Args:
        name: the option as the command line spells it (``--weights``, ``INPUT``).
        values: its values.

    Raises:
        InvalidArgumentError: a path that does not exist.
    """
    from convnets.inputs.listing import look

    for value in values:
        if value is not None and not is_url(value):
            look(name, value)


def check_output_file(path: str | os.PathLike[str], *, option: str = "output",
                      formats: Mapping[str, str] | None = None, kind: str = "format") -> None:
    """The file ``path`` can be created: its suffix names one of ``formats``, it is not a
    directory, and its directory exists and can be written in.

    Args:
        path: the output file.
        option: the option without its dashes (``output`` names ``--output``).
        formats: suffix -> format (``None``: any suffix).
        kind: what the message calls a format (``"embedding format"``).

    Raises:
        InvalidArgumentError: what is wrong, naming the option.
    """
    from convnets.paths import directory_problem
    from convnets.inference.outputs import suffix_format

    if formats is not None:
        suffix_format(path, dict(formats), option=option, kind=kind)
    if os.path.isdir(path):
        raise InvalidArgumentError(f"--{option} {os.fspath(path)} is a directory; give a file name")
    problem = directory_problem(os.path.dirname(path) or os.curdir)
    if problem is not None:
        raise InvalidArgumentError(f"--{option} {os.fspath(path)}: {problem}")


def check_output_directory(path: str | os.PathLike[str], *, option: str = "output") -> None:
    """The directory ``path`` can be written, or created with its missing parents (as the commands
    that take an ``--output DIR`` do): the nearest existing one of it and its parents is a
    directory that can be written in.

    Raises:
        InvalidArgumentError: what is wrong, naming the option.
    """
    from convnets.paths import directory_problem

    existing = Path(path)
    while not os.path.lexists(existing) and existing.parent != existing:  # "a/b" -> "a" -> "."; "/a" -> "/"
        existing = existing.parent
    problem = directory_problem(existing)
    if problem is not None:
        raise InvalidArgumentError(f"--{option} {os.fspath(path)}: {problem}")
