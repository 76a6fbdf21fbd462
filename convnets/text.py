"""Text from files (class names from a checkpoint, input names) shown as data: never terminal control.

Standard library only, imported by every layer that prints or writes such names one per line (the
inference tables, the evaluation report, Triton's ``labels.txt``).
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """``text`` with each character that :meth:`str.isprintable` refuses written as :func:`repr` writes it
    (``\\x1b``, ``\\n``, ``\\r``, ``\\u2028``, ``\\udcff``): control characters, line and paragraph
    separators, format characters (bidirectional overrides) and lone surrogates. The result is one line
    that a terminal shows as it is, and UTF-8 can encode; backslashes are left as they are, so it is for
    reading, not to be reversed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
