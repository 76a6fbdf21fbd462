"""``convnets plot OUT``: draw ``OUT/curves.png`` (loss and top-1 against epoch) from ``OUT/metrics.jsonl``.

The same figure ``convnets train`` draws at its end; run it during training to see the epochs so
far (again with ``--force``, which replaces the figure it drew). Needs matplotlib (the ``plots``
extra); imports no PyTorch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from convnets.commands.options import add_force_argument, path_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("run_dir", type=Path, metavar="OUT", help="the --output directory of a convnets train run")
    parser.add_argument("--output", "-o", type=path_text, default=None, metavar="PNG",
                        help="the PNG file the figure is written to (default: OUT/curves.png)")
    add_force_argument(parser, what="the PNG")


def run(args: argparse.Namespace) -> int:
    """Run ``convnets plot``."""
    from convnets.train.curves import write_curves

    print(write_curves(args.run_dir, None if args.output is None else Path(args.output), force=args.force))
    return 0
