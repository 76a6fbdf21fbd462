"""``convnets cache``: list or empty the engine cache (:mod:`convnets.deploy.cache`).

``list`` shows one line per entry: the model, engine, precision, input shape, the versions it was
built with, its size and date; ``clear`` removes the entries (and the temporary directories of
processes that are gone), nothing else. Neither imports PyTorch.
"""

from __future__ import annotations

import argparse

from convnets.constants import CACHE_DIR_ENV

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.description = (f"{parser.description}. The cache is ${CACHE_DIR_ENV}, else convnets-engines under "
                          "torch.hub.get_dir() ($TORCH_HOME/hub)")
    parser.add_argument("action", choices=("list", "clear"),
                        help="list: one line per entry (model, engine, precision, shape, versions, size, date); "
                             "clear: delete the entries, and only the files the cache wrote")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def run(args: argparse.Namespace) -> int:
    """Run ``convnets cache``."""
    from convnets.deploy.cache import cache_root, clear, list_entries

    root = cache_root()
    if args.action == "clear":
        count, freed = clear(root)
        print(f"removed {count} engine cache entr{'y' if count == 1 else 'ies'} ({_size(freed)}) from {root}")
        return 0
    entries = list_entries(root)
    for info in entries:
        f = info.fields
        shape = "x".join(str(s) for s in f.get("shape", [])) or "?"
        versions = " ".join(f"{k}={v}" for k, v in sorted(f.get("versions", {}).items()))
        print(f"{info.path.name}  {f.get('model', '?')}  {f.get('engine', '?')}  {f.get('precision', '?')}  {shape}  "
              f"{_size(info.size)}  {info.created}  weights={str(f.get('weights', '?'))[:12]}  {versions}")
    total = sum(info.size for info in entries)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {_size(total)}, in {root}")
    return 0
