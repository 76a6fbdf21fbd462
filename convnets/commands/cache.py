"""``convnets cache``: list, trim or empty the engine cache (:mod:`convnets.deploy.cache`).

``list`` shows one line per entry, least recently used first: the model, engine, precision, input
shape, the versions it was built with, its size, creation date and last use (entry text escaped, so
nothing in it reaches the terminal as a control sequence); ``trim`` removes the least recently used
entries until the cache fits ``--max-size``; ``clear`` removes the entries (and the temporary
directories of processes that are gone), nothing else. None of them imports PyTorch.
"""

from __future__ import annotations

import argparse
import time

from convnets.constants import CACHE_DIR_ENV, CACHE_MAX_SIZE_ENV, DEFAULT_CACHE_MAX_SIZE
from convnets.errors import InvalidArgumentError

__all__ = ["add_arguments", "run"]

_DEFAULT = f"{DEFAULT_CACHE_MAX_SIZE / (1 << 30):g}GiB"


def _max_size(text: str) -> int:
    from convnets.deploy.cache import parse_size  # no PyTorch: the cache module imports none

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.description = (f"{parser.description}. The cache is ${CACHE_DIR_ENV}, else convnets-engines under "
                          f"torch.hub.get_dir() ($TORCH_HOME/hub); its size limit is ${CACHE_MAX_SIZE_ENV} "
                          f"(default {_DEFAULT}), past which new entries evict the least recently used")
    parser.add_argument("action", choices=("list", "trim", "clear"),
                        help="list: one line per entry, least recently used first (model, engine, precision, shape, "
                             "versions, size, date, last use); trim: delete the least recently used entries until "
                             "the cache fits --max-size; clear: delete the entries, and only the files the cache "
                             "wrote")
    parser.add_argument("--max-size", type=_max_size, metavar="SIZE",
                        help=f"trim: the size to fit, in bytes or with K, M, G, T (powers of 1024), e.g. 2GiB "
                             f"(default: ${CACHE_MAX_SIZE_ENV}, else {_DEFAULT})")


def _shown(value: object) -> str:
    """``value`` as text for the terminal: each character that does not print (an escape, a line
    break, an undecodable byte) written as Python writes it in a string (``\\x1b``)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(value))


def run(args: argparse.Namespace) -> int:
    """Run ``convnets cache``."""
    from convnets.deploy.cache import cache_root, clear, list_entries, max_size, trim
    from convnets.deploy.cache.disk import root_problem
    from convnets.deploy.cache.store import format_size

    root = cache_root()
    if args.max_size is not None and args.action != "trim":
        raise InvalidArgumentError(f"--max-size is for trim only, not {args.action}")
    if args.action == "clear":
        count, freed = clear(root)
        print(f"removed {count} engine cache entr{'y' if count == 1 else 'ies'} ({format_size(freed)}) "
              f"from {_shown(root)}")
        return 0
    limit = max_size() if args.max_size is None else args.max_size
    if args.action == "trim":
        removed = trim(root, limit)
        print(f"removed {len(removed)} least recently used engine cache entr{'y' if len(removed) == 1 else 'ies'} "
              f"({format_size(sum(info.size for info in removed))}) from {_shown(root)} to fit {format_size(limit)}")
        return 0
    problem = root_problem(root)
    entries = list_entries(root)
    for info in entries:
        f = info.fields
        shape = "x".join(str(s) for s in f.get("shape", [])) or "?"
        versions = " ".join(f"{k}={v}" for k, v in sorted(f.get("versions", {}).items()))
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.last_used))
        print(_shown(f"{info.path.name}  {f.get('model', '?')}  {f.get('engine', '?')}  {f.get('precision', '?')}  "
                     f"{shape}  {format_size(info.size)}  created {info.created or '?'}  last used {used}  "
                     f"weights={str(f.get('weights', '?'))[:12]}  {versions}"))
    total = sum(info.size for info in entries)
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {format_size(total)} of at most "
          f"{format_size(limit)}, in {_shown(root)}" + (f" (not used: it {problem})" if problem else ""))
    return 0
