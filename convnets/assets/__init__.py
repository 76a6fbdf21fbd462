"""Files shipped inside the package: the example photos (``examples/`` at the repository's top links to each).

The photos (a cat, a coffee cup, a rocket launch; sources and licenses in ``examples/LICENSES.md``)
are what ``convnets export`` verifies an exported model on when no ``--images`` are given, so that
verification always runs on real photos, in an installed package too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["EXAMPLES_DIR", "example_images"]

#: The folder of example photos inside the installed package.
EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"

# The formats of the shipped photos (package_data lists the same), not every format a folder input may hold.
_PHOTO_SUFFIXES = (".png", ".jpg", ".jpeg")


def example_images() -> list[Path]:
    """The example photos, sorted by file name (empty if the package was installed without its data)."""
    if not EXAMPLES_DIR.is_dir():
        return []
    return sorted(p for p in EXAMPLES_DIR.iterdir() if p.suffix.lower() in _PHOTO_SUFFIXES and p.is_file())
