"""Where the benchmark scripts put their numbers: one JSON file per script under ``benchmarks/results/``.

Each file records the date, the machine (:func:`convnets.deploy.benchmark.environment`), the exact
command that produced it and the script's measurements. The docs' benchmark tables are generated
from these files (``docs/hooks.py``), so a figure on the site is always one a run wrote down.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from convnets.fileio import atomic_write  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def default_path(name: str, device: str = "cpu") -> Path:
    """``benchmarks/results/<name>.json`` (``<name>_cuda.json`` for a run on a GPU): where a run's
    results go unless ``--json`` says otherwise."""
    return RESULTS / f"{name}{'_cuda' if device.startswith('cuda') else ''}.json"


def add_output_option(parser: argparse.ArgumentParser, name: str | None, *, default_help: str | None = None) -> None:
    """``--json FILE``: where to write the results.

    Args:
        parser: the script's parser.
        name: the results name: the default is :func:`default_path` of it. ``None``: the script
            picks the file after parsing (by mode), and ``--json`` is ``None`` when not given.
        default_help: with ``name=None``, what the default is, for the help text.
    """
    shown = f"benchmarks/results/{name}.json" if name is not None else default_help
    parser.add_argument("--json", metavar="FILE", type=Path, default=None if name is None else default_path(name),
                        help=f"write all measurements as JSON (default: {shown}; the docs' tables are generated "
                             f"from benchmarks/results/)")


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(Path.cwd()))
    except ValueError:
        shown = str(script.relative_to(RESULTS.parents[1]))
    return shlex.join(["python", shown, *sys.argv[1:]])


def save(path: Path, environment: dict[str, Any], results: dict[str, Any]) -> Path:
    """Write ``{"date", "machine", "command", "results"}`` to ``path`` atomically; returns ``path``."""
    record = {"date": environment["date"], "machine": environment, "command": command_line(), "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
    print(f"results written to {path}", file=sys.stderr)
    return path
