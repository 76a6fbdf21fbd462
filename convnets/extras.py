"""How to install an optional part (an extra) of convnets, in words that work where this copy runs.

* From a source checkout (this package imported from a tree with ``setup.py`` and ``constraints.txt``:
  ``pip install -e .``, or ``PYTHONPATH``): ``pip install -c constraints.txt -e '.[EXTRA]'`` in the
  checkout, with the versions CI installs.
* From an installed wheel: the distribution, ``convnets-hub``, is not on the package index yet, so
  ``pip install 'convnets-hub[EXTRA]'`` cannot work; the hint names the extra's own requirements as
  the installed metadata lists them, which is what that command would add.

Every "pip install" in an error or warning of the package comes from :func:`install_hint`
(``tests/test_packaging_name.py``). Standard library only: the command line calls it before PyTorch.
"""

from __future__ import annotations

import re
import shlex
from importlib import metadata
from pathlib import Path

__all__ = ["DISTRIBUTION", "install_hint", "source_checkout"]

#: The distribution's name (``setup.py``); ``convnets`` on the package index is another project.
DISTRIBUTION = "convnets-hub"


def source_checkout() -> Path | None:
    """The source tree this package is imported from, or ``None`` for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "setup.py").is_file() and (root / "constraints.txt").is_file() else None


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` for this copy of convnets (see the module docstring).

    Args:
        extra: the extra's name in ``setup.py``, e.g. ``"export"``.

    Returns:
        A shell command: ``pip install -c constraints.txt -e '.[export]'`` (prefixed with ``cd CHECKOUT &&``
        when the working directory is elsewhere), or ``pip install 'onnx>=1.15' 'onnxruntime>=1.17'``.
    """
    root = source_checkout()
    if root is not None:
        here = "" if Path.cwd().resolve() == root else f"cd {shlex.quote(str(root))} && "
        return f"{here}pip install -c constraints.txt -e '.[{extra}]'"
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        requires = []
    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    packages = [r.partition(";")[0].strip() for r in requires if marker.search(r.partition(";")[2])]
    if not packages:  # no metadata to read (a copied tree): the extra by name
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    return "pip install " + " ".join(shlex.quote(p) for p in packages)
