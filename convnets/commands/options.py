"""Command-line options shared by every command: one spelling, one meaning, one parser each.

Each ``add_*`` function adds options to a parser or argument group, and is the one definition of
those options (``convnets train`` adds them through the ``shared`` metadata of
:class:`convnets.train.TrainConfig` fields, with upstream's spellings ``--arch``,
``--pretrained-from-file`` as aliases). A command passes what differs (a default, what its
``--output`` names). The ``*_from_args`` functions hand the parsed values to the library inside a
command's ``run()``, in command-line words. Nothing imports PyTorch when the options are added or
parsed (so ``--help`` and usage errors answer at once); the ``*_from_args`` functions import it.

The shared options live in four modules, by what they are about:

* this one: the argparse ``type=`` functions of counts, sizes and durations (:func:`positive_int`,
  :func:`batch_size`, :func:`pixels`, ...) and the options of what a command reads and writes
  (``--image-size``, ``--output``, ``--json``);
* :mod:`convnets.commands.model_options`: which model (``--model``, ``--weights``,
  ``--pretrained`` / ``--random-init``, ``--arch-kwargs``) and :func:`~convnets.commands.model_options.load_from_args`;
* :mod:`convnets.commands.run_options`: how it runs (``--device``, ``--precision``,
  ``--memory-format``, ``--engine``, ``--cache``, ``--compile`` and the engine settings such as
  ``--threads``, generated from :class:`~convnets.deploy.engines.base.EngineSettings`);
* :mod:`convnets.commands.path_checks`: the checks of the paths that options name, inside a
  command's ``prepare`` (see :mod:`convnets.cli`), as usage errors.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, Union

from convnets.constants import MAX_BATCH_SIZE, MAX_IMAGE_SIZE
from convnets.errors import InvalidArgumentError

__all__ = ["Parser", "add_force_argument", "add_image_size_argument", "add_json_argument", "add_output_argument",
           "argparse_type", "batch_size", "bounded_int", "non_negative_int", "path_text", "pixels", "positive_int",
           "positive_seconds"]

#: What an ``add_*`` function adds options to: a parser or one of its argument groups.
Parser = Union[argparse.ArgumentParser, argparse._ArgumentGroup]


def argparse_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type=``: its :class:`InvalidArgumentError` becomes a usage error
    that shows the message itself (argparse replaces a plain ``ValueError``'s with its own)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except InvalidArgumentError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    convert.__name__ = name
    return convert


def positive_int(text: str) -> int:
    """argparse ``type=`` for a count such as ``--batch-size``: an integer of at least 1 (else a
    usage error that names the option: ``argument --batch-size: must be a positive integer, got '0'``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def bounded_int(text: str, limit: int) -> int:
    """``text`` as an integer from 1 to ``limit``, else an :class:`argparse.ArgumentTypeError` that
    states the limit (argparse adds the option's name: ``argument --image-size: must be a positive
    integer of at most 4096, got '100000'``).

    The text is checked before it is converted, so a thousand-digit number costs nothing either.
    """
    digits = text.strip()
    value = int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 18 else 0
    if not 1 <= value <= limit:
        raise argparse.ArgumentTypeError(f"must be a positive integer of at most {limit}, got {text[:40]!r}")
    return value


def pixels(text: str) -> int:
    """argparse ``type=`` for ``--image-size``: a number of pixels from 1 to
    :data:`~convnets.constants.MAX_IMAGE_SIZE` (a larger one would exhaust memory)."""
    return bounded_int(text, MAX_IMAGE_SIZE)


def batch_size(text: str) -> int:
    """argparse ``type=`` for ``--batch-size`` and other batch counts: an integer from 1 to
    :data:`~convnets.constants.MAX_BATCH_SIZE` (a larger batch of large images would exhaust memory)."""
    return bounded_int(text, MAX_BATCH_SIZE)


def positive_seconds(text: str) -> float:
    """argparse ``type=`` for a duration such as ``--timeout``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value



def non_negative_int(text: str) -> int:
    """argparse ``type=`` for a count that may be 0, such as ``--workers``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def add_image_size_argument(parser: Parser, *, default: int | None, help: str) -> None:
    """Add ``--image-size PX``: a number of pixels from 1 to :data:`~convnets.constants.MAX_IMAGE_SIZE`
    (:func:`pixels`).

    Args:
        parser: a parser or argument group.
        default: the value when the option is not given (``None``: the weights' own size).
        help: what the size is in this command, with its default.
    """
    parser.add_argument("--image-size", type=pixels, default=default, metavar="PX",
                        help=f"{help}; at most {MAX_IMAGE_SIZE}")


def add_output_argument(parser: Parser, *, metavar: str, help: str, required: bool = False) -> None:
    """Add ``--output``: what the command writes, named by ``metavar`` (``FILE``, ``DIR``, ``PNG``).

    ``predict`` and ``embed`` add it through :func:`convnets.commands.batch_options.add_output_arguments`
    (with ``--resume``).

    Args:
        parser: a parser or argument group.
        metavar: what kind of path it is.
        help: what is written there.
        required: the command writes nothing without it.
    """
    parser.add_argument("--output", type=path_text, metavar=metavar, default=None, required=required, help=help)


def path_text(text: str) -> str:
    """argparse ``type=`` for a path a command writes (``--output``): a name that is text. Bytes that
    are not UTF-8 (the shell's ``$'\\xff.json'``) are refused as a usage error naming the option,
    since the runtimes that write files take text names."""
    try:
        text.encode("utf-8")  # an undecodable byte reaches Python as a lone surrogate, which does not encode
    except UnicodeError:
        shown = repr(os.fsencode(text))[1:]
        raise argparse.ArgumentTypeError(f"{shown} holds bytes that are not UTF-8 text; give a name that is text "
                                         "(letters, digits, ...)") from None
    return text


def add_force_argument(parser: Parser, *, what: str) -> None:
    """Add ``--force``: replace ``what`` where it exists (without it an existing file is refused). Either
    way nothing is written through a symbolic link convnets did not make; a link in the file's place
    is replaced itself."""
    parser.add_argument("--force", action="store_true",
                        help=f"replace {what} if it exists (default: refuse; a symbolic link there is replaced, "
                             "never written through)")


def add_json_argument(parser: Parser, *, help: str, file_option: str | None = None) -> None:
    """Add ``--json``: print the command's result as JSON on stdout (instead of its text).

    Args:
        parser: a parser or argument group.
        help: what the JSON holds.
        file_option: the option that writes the same JSON to a file, when ``--json FILE`` once did
            (``benchmark``): ``--json FILE`` is still accepted as its older spelling (the value is
            then the file name, else ``True`` / ``False``).
    """
    text = f"print {help} as JSON on stdout instead of text"
    if file_option is None:
        parser.add_argument("--json", action="store_true", help=text)
    else:
        parser.add_argument("--json", nargs="?", const=True, default=False, metavar="FILE", type=path_text,
                            help=f"{text} (--json FILE: the older spelling of {file_option} FILE)")


