"""Run settings shared by every feature and command: precision, device, memory format, CPU bf16.

Whether bf16 outruns fp32 on a CPU is measured (:mod:`convnets.machine`), not read from its flags.

One home for the choices that training, ``predict``, ``export`` and ``benchmark`` all make, so
that they are spelled, checked and explained the same way everywhere.

``import convnets.runtime`` is cheap: the names and validation of the settings need no PyTorch
(the command line parses its options with them before importing it); functions that return torch
objects import torch when called.

Every function that can reject an input takes ``option``: the input's name in the words of the
caller's interface. A keyword name (``"precision"``) makes messages say ``precision='bf16'``; a
command-line option (``"--precision"``) makes them say ``--precision bf16``.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from pathlib import Path
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Literal

from convnets.errors import InvalidArgumentError, UnsupportedPrecisionError
from convnets import machine

if TYPE_CHECKING:
    import torch

__all__ = ["AMP_DTYPES", "GRAD_SCALER_INIT", "MEMORY_FORMATS", "MEMORY_FORMAT_ALIASES", "PRECISIONS", "Precision",
           "PrecisionName", "check_precision", "check_precision_name", "check_workers", "cpu_has_bf16",
           "default_workers", "default_workers_text", "init_worker", "memory_format_name", "parse_memory_format",
           "precision_dtype", "precision_name", "resolve_device", "resolve_precision", "setting", "usable_cores",
           "warn_if_bf16_is_slower"]

log = logging.getLogger(__name__)

PrecisionName = Literal["fp32", "bf16", "fp16"]
#: Precision names, in the order the help texts list them.
PRECISIONS: tuple[PrecisionName, ...] = ("fp32", "bf16", "fp16")
_DTYPE_ATTRS: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: Memory format names: PyTorch's own (``torch.contiguous_format``, ``torch.channels_last``).
MEMORY_FORMATS: tuple[str, ...] = ("contiguous", "channels_last")
#: Also accepted, for NVIDIA's training scripts (``--memory-format nhwc``).
MEMORY_FORMAT_ALIASES: dict[str, str] = {"nchw": "contiguous", "nhwc": "channels_last"}
_MEMORY_FORMAT_ATTRS: dict[str, str] = {"contiguous": "contiguous_format", "channels_last": "channels_last"}

#: Native bf16 arithmetic in /proc/cpuinfo: x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO = Path("/proc/cpuinfo")


def setting(option: str, value: object) -> str:
    """``option`` set to ``value`` as the user would write it: ``--device cpu`` or ``device='cpu'``."""
    return f"{option} {value}" if option.startswith("-") else f"{option}={value!r}"


# --- precision -----------------------------------------------------------------------------------


def check_precision_name(name: str, *, option: str = "precision") -> PrecisionName:
    """Return ``name`` if it is one of :data:`PRECISIONS`, else raise :class:`InvalidArgumentError`."""
    for known in PRECISIONS:
        if name == known:
            return known  # as a PrecisionName
    raise InvalidArgumentError(f"unknown precision {setting(option, name)}; choose one of "
                               f"{', '.join(PRECISIONS)}")


def precision_dtype(name: str, *, option: str = "precision") -> torch.dtype:
    """The torch dtype of a precision name: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Raises:
        InvalidArgumentError: an unknown name (a ``ValueError``).
    """
    import torch

    return getattr(torch, _DTYPE_ATTRS[check_precision_name(name, option=option)])


def precision_name(dtype: torch.dtype) -> str:
    """The precision name of a torch dtype (the inverse of :func:`precision_dtype`)."""
    import torch

    for name, attr in _DTYPE_ATTRS.items():
        if getattr(torch, attr) == dtype:
            return name
    raise InvalidArgumentError(f"no precision name for {dtype}; the precisions are {', '.join(PRECISIONS)}")


def cpu_has_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (x86 AVX512-BF16 / AMX-BF16, Arm BF16).

    Elsewhere oneDNN emulates bf16 with fp32 instructions. This says what the CPU can do, not what is faster:
    that is measured (:func:`convnets.machine.cpu_bf16_speedup`), since bf16 instructions alone did not make
    bf16 faster than fp32 on every CPU that has them.
    """
    # The one detection for the package. Read from the CPU flags rather than from
    # torch.ops.mkldnn._is_mkldnn_bf16_supported(): that private op answers "can oneDNN run bf16
    # at all" and is True on every AVX512-BW/VL/DQ CPU (e.g. Skylake-X), which has no bf16
    # instructions -- not the question asked. It also
    # covers Arm (the `bf16` Features flag) and needs no torch. Linux only: elsewhere we cannot
    # tell, and say False.
    return bool(_cpu_flags() & _BF16_CPU_FLAGS)


@functools.cache  # once per process
def warn_if_bf16_is_slower() -> None:
    """Warn once when bf16 runs slower than fp32 on this CPU, as measured here
    (:func:`convnets.machine.cpu_bf16_speedup`): the advice holds on the machine that gives it."""
    if machine.bf16_slower_than_fp32():
        # In words for every interface (precision='fp32' / --precision fp32): the callers do not know which.
        log.warning("bf16 runs slower than fp32 on this CPU (measured here: %.2fx fp32's speed); run fp32 for speed",
                    machine.cpu_bf16_speedup())


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = _CPUINFO.read_text(errors="replace")
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86 / Arm spelling of the flag list
            flags.update(line.split(":", 1)[-1].split())
    return flags


def check_precision(name: str, device: torch.device | str, *, option: str = "precision") -> None:
    """Raise :class:`UnsupportedPrecisionError` if ``device`` cannot run precision ``name``.

    fp16 needs a CUDA GPU (CPUs have no fast fp16 kernels); bf16 needs a GPU that supports it, or
    a PyTorch built with oneDNN on a CPU (a CPU without native bf16 only gets a warning: it works,
    slowly). Both errors are ``ValueError`` subclasses.

    Args:
        name: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device: where it would run.
        option: the precision's name in the caller's interface, for the messages.

    Raises:
        InvalidArgumentError: an unknown precision name.
        UnsupportedPrecisionError: the device cannot run it.
    """
    import torch

    check_precision_name(name, option=option)
    kind = torch.device(device).type
    if name == "fp16" and kind != "cuda":
        raise UnsupportedPrecisionError(
            f"fp16 needs a CUDA device, not {kind}: CPUs have no fast fp16 kernels. Use "
            f"{setting(option, 'bf16')} on CPUs with native bf16 (AVX512-BF16 / AMX), or fp32")
    if name == "bf16" and kind == "cpu":
        if not torch.backends.mkldnn.is_available():
            raise UnsupportedPrecisionError(f"{setting(option, 'bf16')} on a CPU needs PyTorch built with "
                                            "oneDNN (mkldnn), which this one is not; use fp32")
    # Without CUDA there is no GPU to ask; whether the device exists is resolve_device's question.
    if name == "bf16" and kind == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise UnsupportedPrecisionError(f"this GPU does not support bf16 ({setting(option, 'bf16')}); "
                                        "use fp16 or fp32")


# --- how a forward (and backward) pass runs: autocast, loss scaling, layout ----------------------

#: Upstream's initial dynamic loss scale (fp16 training).
GRAD_SCALER_INIT = 128.0


@dataclass(frozen=True)
class Precision:
    """How the forward pass runs: autocast dtype (None = fp32), loss scaling and memory layout."""

    device: torch.device
    amp_dtype: torch.dtype | None
    memory_format: torch.memory_format

    @property
    def use_scaler(self) -> bool:
        """Dynamic loss scaling is needed for fp16 only (bf16 has fp32's exponent range)."""
        import torch

        return self.amp_dtype == torch.float16

    def autocast(self) -> torch.autocast:
        """The autocast context of a forward pass (disabled in fp32)."""
        import torch

        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    def make_scaler(self) -> torch.amp.GradScaler | None:
        """Upstream's dynamic loss scaler (initial scale 128) for fp16, else None."""
        if not self.use_scaler:
            return None
        import torch

        return torch.amp.GradScaler(self.device.type, init_scale=GRAD_SCALER_INIT)

    @property
    def name(self) -> str:
        """``"fp32"``, or the autocast dtype's name (``"bf16"``, ``"fp16"``): what the numbers were computed in."""
        return "fp32" if self.amp_dtype is None else precision_name(self.amp_dtype)

    def describe(self) -> str:
        """E.g. ``'cuda fp16 autocast, channels_last'``."""
        import torch

        dtype = "fp32" if self.amp_dtype is None else f"{precision_name(self.amp_dtype)} autocast"
        layout = "channels_last" if self.memory_format == torch.channels_last else "contiguous (NCHW)"
        return f"{self.device.type} {dtype}, {layout}"


#: Autocast dtypes (of :data:`convnets.runtime.PRECISIONS`): fp32 means no autocast.
AMP_DTYPES: tuple[str, ...] = tuple(p for p in PRECISIONS if p != "fp32")


def resolve_precision(device: torch.device, amp: bool | None = None, amp_dtype: str | None = None,
                      memory_format: str | None = None, *, option: str = "--amp-dtype") -> Precision:
    """Choose autocast and layout; ``None`` means "where it helps".

    Rules: on CUDA, AMP is on by default with fp16 and a GradScaler (bf16 on request, without a
    scaler). On CPU, AMP (always bf16: CPU autocast has no fp16 training path) is on by default
    only where bf16 is measured faster than fp32 (:func:`convnets.machine.cpu_bf16_speedup`; an explicit bf16
    where it is slower logs a warning). The layout defaults to ``channels_last``
    (NHWC) under AMP, where tensor cores and oneDNN's bf16 kernels want it, and to ``contiguous``
    (NCHW) in fp32.

    Args:
        device: where the step runs.
        amp: autocast on / off; ``None``: where it helps.
        amp_dtype: ``"fp16"`` or ``"bf16"``; ``None``: fp16 on CUDA, bf16 elsewhere.
        memory_format: ``"channels_last"`` / ``"contiguous"`` (or ``"nhwc"`` / ``"nchw"``); ``None``:
            see above.
        option: the name of ``amp_dtype`` in the caller's interface, for the messages.

    Raises:
        InvalidArgumentError: an unknown dtype or layout.
        UnsupportedPrecisionError: a dtype the device cannot run, e.g. fp16 on a CPU (both are
            ``ValueError``).
    """
    import torch

    if amp_dtype is not None and amp_dtype not in AMP_DTYPES:
        raise InvalidArgumentError(f"amp dtype must be one of {', '.join(AMP_DTYPES)}, got {amp_dtype!r}")
    layout = None if memory_format is None else parse_memory_format(memory_format)
    if amp is None:
        amp = (device.type == "cuda" or (device.type == "cpu" and not machine.bf16_slower_than_fp32())
               or amp_dtype is not None)
    dtype: torch.dtype | None = None
    if amp:
        name = amp_dtype or ("fp16" if device.type == "cuda" else "bf16")
        check_precision(name, device, option=option)
        if name == "bf16" and device.type == "cpu":
            warn_if_bf16_is_slower()
        dtype = precision_dtype(name)
    if layout is None:
        layout = torch.channels_last if dtype is not None else torch.contiguous_format
    return Precision(device, dtype, layout)


# --- memory format -------------------------------------------------------------------------------


def memory_format_name(name: str, *, option: str = "memory_format") -> str:
    """The canonical name (``"contiguous"`` or ``"channels_last"``) of a memory format or alias.

    Raises:
        InvalidArgumentError: not one of :data:`MEMORY_FORMATS` or :data:`MEMORY_FORMAT_ALIASES`.
    """
    canonical = MEMORY_FORMAT_ALIASES.get(name, name)
    if canonical not in MEMORY_FORMATS:
        raise InvalidArgumentError(
            f"unknown memory format {setting(option, name)}; choose {' or '.join(MEMORY_FORMATS)} "
            f"(aliases: {', '.join(f'{a} = {c}' for a, c in MEMORY_FORMAT_ALIASES.items())})")
    return canonical


def parse_memory_format(name: str, *, option: str = "memory_format") -> torch.memory_format:
    """``torch.contiguous_format`` or ``torch.channels_last`` for a name or alias (see
    :func:`memory_format_name`)."""
    import torch

    return getattr(torch, _MEMORY_FORMAT_ATTRS[memory_format_name(name, option=option)])


# --- device --------------------------------------------------------------------------------------


def resolve_device(value: str | torch.device | None, *, option: str = "device") -> torch.device:
    """The device that ``value`` asks for, checked to exist here.

    Args:
        value: ``"auto"`` or ``None`` (CUDA when available, else the CPU), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``, any other name :class:`torch.device` accepts, or a device.
        option: the device's name in the caller's interface, for the messages.

    Raises:
        InvalidArgumentError: not a device name, or a CUDA device that this machine does not have.
    """
    import torch

    if value is None or value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{setting(option, value)} is not a device: use auto, cpu, cuda or "
                                   f"cuda:N") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"{setting(option, value)} was given but no CUDA GPU is available here; "
                                       f"use {setting(option, 'cpu')}")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InvalidArgumentError(f"{setting(option, value)}: this machine has {count} CUDA device(s), "
                                       f"cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"{setting(option, value)} was given but MPS is not available here; "
                                   f"use {setting(option, 'cpu')}")
    return device


# --- decoding processes ----------------------------------------------------------------------------


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_workers(device_type: str = "cpu", *, processes: int = 1) -> int:
    """Decoding (data-loader) processes when none are asked for: ``convnets predict``, ``embed``, ``evaluate``
    and ``train``, so that every command decodes with as many on the same machine (never more than the cores
    PyTorch's DataLoader warns about).

    For a model on the CPU, ``min(4, cores - 2)``: the model's own threads keep two cores, and a
    small machine decodes in-process between batches (one decoding process beside the model lost
    end-to-end speed to oversubscription on 2 cores: benchmarks/bench_predict_pipeline.py). For a
    model on a GPU, ``min(16, cores - 1)``: the CPU only decodes, and the more processes decode the
    less the GPU waits (benchmarks/bench_fast_decode.py ``--device cuda --workers N``); 16 at most,
    as each process costs memory.

    Args:
        device_type: where the model runs (``torch.device.type``).
        processes: the processes on this machine that each start as many (``torchrun``'s local world
            size): they share the cores.
    """
    cores = usable_cores() // max(1, processes)
    if device_type == "cpu":
        return max(0, min(4, cores - 2))
    return max(0, min(16, cores - 1))


def default_workers_text() -> str:
    """:func:`default_workers` in words, with this machine's numbers, for the ``--workers`` help of every command."""
    return (f"min(4, cores - 2) for a model on the CPU, here {default_workers()} of {usable_cores()} cores; "
            "min(16, cores - 1) on a GPU, where decoding is the bottleneck")


def check_workers(workers: object, *, option: str = "workers") -> int:
    """``workers`` as a count of decoding processes (0: decode in the calling process).

    Raises:
        InvalidArgumentError: not a non-negative integer.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise InvalidArgumentError(f"{setting(option, workers)}: the number of decoding processes must be a "
                                   "non-negative integer (0: decode in this process)")
    return workers


def init_worker(worker_id: int) -> None:
    """Set up a decoding process (the ``worker_init_fn`` of every DataLoader here: predict, embed,
    evaluate, train) so that it stops quietly with the main process, which says why it stopped:

    * SIGTERM ends it at once with status 0, whoever sends it. PyTorch does so only when the main
      process sends it; from anyone else (``kill`` of the process group, a service manager) the
      worker would die of the signal, and the main process's SIGCHLD handler would raise an error
      about it in the middle of its own clean stop.
    * A connection reset is not printed. The main process fetches each batch's tensor through a
      connection that :mod:`multiprocessing`'s resource sharer serves in a thread of the worker; when
      the main process stops (SIGINT, SIGTERM) during such a fetch, that thread prints the reset
      through :func:`sys.excepthook`.
    """
    signal.signal(signal.SIGTERM, _stop_worker)
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if not issubclass(kind, (ConnectionError, EOFError)):
            previous(kind, error, trace)
    sys.excepthook = excepthook


def _stop_worker(signum: int, frame: FrameType | None) -> None:
    os._exit(0)  # as PyTorch's own handler: no cleanup, the main process owns the queues
