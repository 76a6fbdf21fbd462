"""What a string input names: a URL (``scheme://...``) or a local path.

Standard library only, so that the command line can tell its local inputs from URLs, and check
that they exist, before anything heavy is imported (:mod:`convnets.commands.path_checks`).
"""

from __future__ import annotations

import re
from typing import TypeGuard

__all__ = ["is_url", "url_scheme"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def url_scheme(source: str) -> str | None:
    """The scheme of ``source`` in lower case (``"https"``), or ``None`` if it is not a URL."""
    match = _SCHEME.match(source)
    return match.group(1).lower() if match else None


def is_url(source: object) -> TypeGuard[str]:
    """Whether ``source`` is a string with a URL scheme (``scheme://...``), i.e. not a local path.

    Args:
        source: a candidate image input.

    Returns:
        True for any ``scheme://`` string; :func:`~convnets.preprocessing.decode.open_image` downloads
        only ``http``/``https``.
    """
    return isinstance(source, str) and url_scheme(source) is not None
