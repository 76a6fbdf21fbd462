"""The options of how a command runs its model: ``--device``, ``--precision``, ``--memory-format``,
``--engine``, ``--cache``, ``--compile``, and the engine settings (``--threads``, ...).

The engine settings options are generated from the fields of
:class:`~convnets.deploy.engines.base.EngineSettings` (their ``SettingOption``: flag, help, parsing,
the valid values) by :func:`add_engine_settings_arguments`, and :func:`engine_settings_from_args`
turns them back into one ``EngineSettings`` that the command passes on (``settings=``): an engine
setting is added in that class alone. Engine choices come from the registry
(:mod:`convnets.deploy.engines`), which imports nothing heavy either.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from convnets.commands.options import Parser, argparse_type
from convnets.constants import CACHE_DIR_ENV, CACHE_MAX_SIZE_ENV
from convnets.deploy.engines.base import EngineSettings, SettingOption, setting_options
from convnets.errors import InvalidArgumentError
from convnets.runtime import (MEMORY_FORMAT_ALIASES, MEMORY_FORMATS, PRECISIONS, check_precision, memory_format_name,
                              resolve_device)

if TYPE_CHECKING:
    import torch

__all__ = ["add_cache_argument", "add_compile_argument", "add_device_argument", "add_engine_argument",
           "add_engine_settings_arguments", "add_memory_format_argument", "add_precision_argument", "device_from_args",
           "engine_settings_from_args"]

_DEVICE = re.compile(r"auto|[a-z_]+(:\d+)?")


def _device_name(text: str) -> str:
    # Only the spelling here (no PyTorch while parsing); device_from_args checks that it exists.
    if not _DEVICE.fullmatch(text):
        raise InvalidArgumentError(f"--device {text!r} is not a device: use auto, cpu, cuda or cuda:N")
    return text


def add_device_argument(parser: Parser, *, default: str | None = "auto", help: str | None = None) -> None:
    """Add ``--device``: ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.

    Args:
        parser: a parser or argument group.
        default: ``"auto"``; ``None`` means the same (for configurations that store "not given").
        help: replaces the default help text.
    """
    parser.add_argument("--device", type=argparse_type(_device_name, "device"), default=default, metavar="DEVICE",
                        help=help or "auto (default): cuda when available, else cpu; or cpu, cuda, cuda:N")


def add_engine_argument(parser: Parser, *, extra_choices: Mapping[str, str] | None = None,
                        help: str | None = None) -> None:
    """Add ``--engine``: a registered inference engine or ``auto`` (the default); the choices and
    each engine's line of help come from the registry (:func:`convnets.deploy.engines.engines`).

    Args:
        parser: a parser or argument group.
        extra_choices: values this command adds and what each means (``benchmark``: ``all``).
        help: what the engine runs (default: "what runs the model"); the engines' lines follow it.
    """
    from convnets.deploy.engines import AUTO, engine_names, engines  # the engine modules import no torch

    extra = dict(extra_choices or {})
    lines = [e.help_line() for e in engines()]
    lines.append(f"{AUTO} (the fastest installed engine for the device and precision, checked against the model; "
                 "falls back to torch)")
    lines += [f"{name} ({meaning})" for name, meaning in extra.items()]
    parser.add_argument("--engine", choices=(*engine_names(), AUTO, *extra), default=AUTO,
                        help=f"{help or 'what runs the model'} (default: {AUTO}, which names its pick on stderr): "
                             + "; ".join(lines))


def add_cache_argument(parser: Parser) -> None:
    """Add ``--cache`` / ``--no-cache``: the engine cache (:mod:`convnets.deploy.cache`), on by default."""
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the graphs that engines other than torch convert, and auto's check of them, in "
                             f"the engine cache (${CACHE_DIR_ENV}, default $TORCH_HOME/hub/convnets-engines; at most "
                             f"${CACHE_MAX_SIZE_ENV}) and load them from there next time; --no-cache "
                             "converts again (default: on; see convnets cache list|trim|clear)")


def add_precision_argument(parser: Parser, *, choices: Sequence[str] = PRECISIONS, default: str | None = "fp32",
                           aliases: Sequence[str] = (), dest: str = "precision",
                           action: type[argparse.Action] | None = None, help: str | None = None) -> None:
    """Add ``--precision``: names from :data:`convnets.runtime.PRECISIONS` (a command may offer fewer).

    Args:
        parser: a parser or argument group.
        choices: the precisions this command offers, a subset of ``PRECISIONS``.
        default: the value when the option is not given (``None``: the command decides).
        aliases: other spellings of the same option.
        dest: the attribute of the parsed namespace.
        action: an argparse action that stores the value (``train``: into its AMP settings).
        help: replaces the default help text.
    """
    unknown = sorted(set(choices) - set(PRECISIONS))
    if unknown:
        raise InvalidArgumentError(f"choices {unknown} are not precisions; use some of {', '.join(PRECISIONS)}")
    extra: dict[str, Any] = {} if action is None else {"action": action}
    parser.add_argument("--precision", *aliases, dest=dest, choices=tuple(choices), default=default, **extra,
                        help=help or f"{default} (default); bf16 (GPUs, CPUs with AVX512-BF16 or AMX); fp16 (GPUs)")


def add_memory_format_argument(parser: Parser, *, default: str | None = "contiguous", help: str | None = None) -> None:
    """Add ``--memory-format``: ``contiguous`` or ``channels_last``; ``nchw`` / ``nhwc`` are accepted
    and stored as those (:func:`convnets.runtime.memory_format_name`).

    Args:
        parser: a parser or argument group.
        default: the value when the option is not given (``None``: the command decides).
        help: replaces the default help text.
    """
    aliases = ", ".join(f"{a} = {c}" for a, c in MEMORY_FORMAT_ALIASES.items())
    parser.add_argument("--memory-format", choices=MEMORY_FORMATS, default=default,
                        type=argparse_type(lambda text: memory_format_name(text, option="--memory-format"),
                                            "memory_format"),
                        help=help or f"layout of the model and its input batches (default: {default}; "
                                     f"aliases {aliases})")


def add_compile_argument(parser: Parser, *, default: bool, help: str) -> None:
    """Add ``--compile`` / ``--no-compile``: ``torch.compile`` the torch engine's model.

    Args:
        parser: a parser or argument group.
        default: on or off (``predict`` / ``embed``: off, the first batch would wait; ``benchmark``: on).
        help: what compiling costs and buys in this command; the default is added.
    """
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=default,
                        help=f"torch.compile the model: {help} (default: {'on' if default else 'off'})")


def _setting_type(option: SettingOption) -> Callable[[str], Any]:
    """argparse ``type=`` of an engine setting: its text parsed and checked (else a usage error that
    names the option: ``argument --threads: must be a positive integer of at most 1024, got '0'``)."""
    def convert(text: str) -> Any:
        try:
            value = option.parse(text)
        except ValueError:
            value = None
        if value is None or not option.valid(value):
            raise argparse.ArgumentTypeError(f"must be {option.expected}, got {text[:40]!r}")
        return value
    convert.__name__ = option.flag.lstrip("-")
    return convert


def add_engine_settings_arguments(parser: Parser) -> None:
    """Add an option per :class:`~convnets.deploy.engines.base.EngineSettings` field that has one
    (``--threads N``, ...), each stored under the field's name, default ``None`` (the runtimes' own);
    :func:`engine_settings_from_args` collects them."""
    for field, option in setting_options():
        parser.add_argument(option.flag, dest=field.name, type=_setting_type(option), default=None,
                            metavar=option.metavar, help=option.help)


def engine_settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """The :class:`~convnets.deploy.engines.base.EngineSettings` of the options that
    :func:`add_engine_settings_arguments` added (already checked by argparse)."""
    return EngineSettings(**{field.name: getattr(args, field.name) for field, _ in setting_options()})


def device_from_args(args: argparse.Namespace) -> torch.device:
    """The device of ``--device``, checked to exist and, if the command has ``--precision``, to run it.

    Raises:
        InvalidArgumentError: a device this machine does not have.
        UnsupportedPrecisionError: a precision the device cannot run.
    """
    device = resolve_device(args.device, option="--device")
    if getattr(args, "precision", None) is not None:
        check_precision(args.precision, device, option="--precision")
    return device
