"""This machine: where convnets keeps what it works out for it, and what it measured there.

A CPU's flags say whether it has bf16 instructions, not whether PyTorch's bf16 kernels outrun its fp32 ones:
ResNeXt101 through the torch engine ran bf16 at 0.55-0.7x its fp32 speed on an Intel Xeon with AVX512-BF16
and no AMX, and at 1.9-2.1x on an AMD EPYC (Zen 4) with the same flags (docs/engines.md). So the speed
advice (the torch engine's bf16 warning, training's default precision on a CPU) comes from a measurement:
:func:`cpu_bf16_speedup` times one ResNeXt101 bottleneck (stage 2: 512 channels at 28x28, 32 groups, a batch
of 8, ``channels_last``, on one thread) in fp32 and in bf16, in turns, and divides the best times (about a
second). It is measured once per CPU model and library version: the answer is kept in ``measured.json`` in
the engine cache's directory (:func:`cache_root`; ``convnets cache`` leaves the file alone), read back only
when it is a regular file of the current user's, and measured again when it cannot be read or written.

Nothing here imports PyTorch at module level.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

from convnets.constants import CACHE_DIR_ENV, VERSION
from convnets.fileio import atomic_write

__all__ = ["bf16_slower_than_fp32", "cache_root", "cpu_bf16_speedup"]

log = logging.getLogger(__name__)

#: The file of measurements in :func:`cache_root`: ``{key: {"bf16_speedup": float, "measured": seconds}}``.
MEASURED = "measured.json"
_ROUNDS = 5


def cache_root() -> Path:
    """The engine cache's directory: ``$CONVNETS_CACHE_DIR``, else ``torch.hub.get_dir()/convnets-engines``
    (``$TORCH_HOME/hub/convnets-engines``; worked out without importing PyTorch when it is not loaded)."""
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    torch_module = sys.modules.get("torch")
    if torch_module is not None and hasattr(torch_module, "hub"):
        hub = Path(torch_module.hub.get_dir())
    else:  # torch.hub.get_dir()'s rule
        home = os.environ.get("TORCH_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "torch")
        hub = Path(os.path.expanduser(home)) / "hub"
    return hub / "convnets-engines"


def bf16_slower_than_fp32() -> bool:
    """Whether bf16 runs slower than fp32 on this CPU through PyTorch, as measured (:func:`cpu_bf16_speedup`)."""
    return cpu_bf16_speedup() < 1.0


@functools.cache  # once per process; across processes, measured.json
def cpu_bf16_speedup() -> float:
    """How many times faster bf16 runs than fp32 on this CPU through PyTorch (below 1: slower), measured here
    once per CPU model and library version (see the module's documentation).

    Returns:
        The ratio of the best fp32 time to the best bf16 time of a ResNeXt101 block.
    """
    key = _key()
    path = cache_root() / MEASURED
    known = _read(path)
    entry = known.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("bf16_speedup"), float) and entry["bf16_speedup"] > 0:
        return float(entry["bf16_speedup"])
    speedup = _measure()
    log.info("bf16 runs at %.2fx fp32's speed on this CPU (measured once for %s)", speedup, key)
    known[key] = {"bf16_speedup": speedup, "measured": round(time.time())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(json.dumps(known, indent=1, sort_keys=True).encode()))
    except OSError as e:  # a read-only cache: measured again by the next process
        log.debug("cannot keep the measurement in %s: %s", path, e)
    return speedup


def _key() -> str:
    """The CPU model (its name and flags) and the versions of PyTorch and convnets: what the measurement holds for."""
    import torch

    name, flags = "unknown CPU", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            field, _, value = line.partition(":")
            if field.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif field.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
    return f"{name} (flags {digest}), torch {torch.__version__}, convnets {VERSION}"


def _read(path: Path) -> dict[str, object]:
    """The measurements in ``path``; empty when it is missing, not a regular file of this user's, or not valid."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()) \
                or st.st_size > 1 << 20:
            return {}
        try:
            known = json.loads(f.read())
        except ValueError:
            return {}
    return known if isinstance(known, dict) else {}


def _measure() -> float:
    """Time a block in fp32 and bf16, in turns, on one thread; the ratio of the best times."""
    import torch
    from torch import nn

    def block() -> nn.Module:  # ResNeXt101's stage-2 bottleneck with its BatchNorms folded, as inference runs it
        return nn.Sequential(nn.Conv2d(512, 256, 1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1, groups=32),
                             nn.ReLU(), nn.Conv2d(256, 512, 1), nn.ReLU()).eval()

    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(0)
    fp32 = block().to(memory_format=torch.channels_last)
    bf16 = block().to(torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(8, 512, 28, 28, generator=generator).contiguous(memory_format=torch.channels_last)
    inputs = {fp32: x, bf16: x.to(torch.bfloat16)}
    best = {fp32: float("inf"), bf16: float("inf")}
    torch.set_num_threads(1)  # a core's speed: what other processes do on the other cores matters least
    try:
        with torch.inference_mode():
            for block in (fp32, bf16):  # the first call sets oneDNN's kernels up
                block(inputs[block])
            for _ in range(_ROUNDS):
                for block in (fp32, bf16):
                    start = time.perf_counter()
                    block(inputs[block])
                    best[block] = min(best[block], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return round(best[fp32] / best[bf16], 3)
