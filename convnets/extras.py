"""How to install an optional part (an extra) of convnets, in words that work where this copy runs.

Each hint runs pip with the interpreter that runs convnets (``/path/to/.venv/bin/python -m pip``,
:data:`sys.executable`): a bare ``pip`` is whichever one the shell finds first, the system's when the
environment is not activated.

* From a source checkout (this package imported from a tree with ``setup.py`` and ``constraints.txt``:
  ``pip install -e .``, or ``PYTHONPATH``): ``PYTHON -m pip install -c constraints.txt -e '.[EXTRA]'`` in
  the checkout, with the versions CI installs.
* From an installed wheel: the distribution, ``convnets-hub``, is not on the package index yet, so
  installing ``convnets-hub[EXTRA]`` from it cannot work; the hint names the extra's own requirements as
  the installed metadata lists them, which is what that command would add, with the constraints file the
  wheel ships (``convnets/constraints.txt``, a copy of the checkout's).
* The ``serve`` extra pins ``numpy<2``, which other extras do not run on: its hint makes an environment
  of its own, :data:`SERVE_ENV` (``PYTHON -m venv .venv-serve && .venv-serve/bin/python -m pip install
  ...``), where ``.venv-serve/bin/convnets serve`` then runs.

Every "pip install" in an error or warning of the package comes from :func:`install_hint`
(``tests/test_packaging_name.py``). Standard library only: the command line calls it before PyTorch.
"""

from __future__ import annotations

import re
import shlex
import sys
from importlib import metadata
from pathlib import Path

__all__ = ["DISTRIBUTION", "SERVE_ENV", "install_hint", "serve_convnets", "source_checkout"]

#: The distribution's name (``setup.py``); ``convnets`` on the package index is another project.
DISTRIBUTION = "convnets-hub"
#: The environment of the ``serve`` extra, in the checkout (or the working directory), beside the other one.
SERVE_ENV = ".venv-serve"


def source_checkout() -> Path | None:
    """The source tree this package is imported from, or ``None`` for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.py").is_file() and (root / "constraints.txt").is_file() else None


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` for this copy of convnets (see the module docstring).

    Args:
        extra: the extra's name in ``setup.py``, e.g. ``"export"``.

    Returns:
        A shell command: ``/path/to/python -m pip install -c constraints.txt -e '.[export]'`` (prefixed with
        ``cd CHECKOUT &&`` when the working directory is elsewhere), or ``/path/to/python -m pip install -c
        /path/to/site-packages/convnets/constraints.txt 'onnx>=1.15' 'onnxruntime>=1.17'``; for ``serve``, the same in a new environment, :data:`SERVE_ENV`.
    """
    python = shlex.quote(sys.executable)
    if extra == "serve":  # numpy<2: an environment of its own, made with this interpreter (its Python version)
        python = f"{python} -m venv {SERVE_ENV} && {SERVE_ENV}/bin/python"
    root = source_checkout()
    if root is not None:
        here = "" if Path.cwd().resolve() == root else f"cd {shlex.quote(str(root))} && "
        return f"{here}{python} -m pip install -c constraints.txt -e '.[{extra}]'"
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        requires = []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    packages = [r.partition(";")[0].strip() for r in requires if marker.search(r.partition(";")[2])]
    shipped = Path(__file__).with_name("constraints.txt")
    constraints = f"-c {shlex.quote(str(shipped))} " if shipped.is_file() else ""
    if not packages:  # no metadata to read (a copied tree): the extra by name
        return f"{python} -m pip install {constraints}'{DISTRIBUTION}[{extra}]'"
    wheel = "path/to/convnets_hub-VERSION-py3-none-any.whl " if extra == "serve" else ""  # the new environment's
    return f"{python} -m pip install {constraints}{wheel}" + " ".join(shlex.quote(p) for p in packages)


def serve_convnets() -> str:
    """The ``convnets`` command of the environment that :func:`install_hint` ``("serve")`` makes, for the hint's
    next step (``/path/to/checkout/.venv-serve/bin/convnets``)."""
    return shlex.quote(str((source_checkout() or Path.cwd().resolve()) / SERVE_ENV / "bin" / "convnets"))
