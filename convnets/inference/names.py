"""Input names in output files, bytes-safe: every file name survives, byte for byte, and never breaks a file.

A file name is bytes; Python hands it over as ``os.fsdecode`` does (UTF-8, each byte that is not
part of valid UTF-8 kept as a lone surrogate ``U+DC80..U+DCFF``: ``surrogateescape``), and so do
directory listings, the command line and ``--from-file`` lists here. Such a string cannot be
written as UTF-8 as it is, and a name may hold a line break. So in the files a run writes:

* JSONL (``predict --output FILE.jsonl``, ``--jsonl``, every run's spool ``FILE.partial.jsonl``):
  the JSON string, with each lone surrogate (and U+0085, U+2028, U+2029, which some readers take
  for line ends) written as a ``\\uXXXX`` escape: byte ``0xFF`` is ``\\udcff``. ``json.loads``
  gives the ``os.fsdecode`` name back, and ``os.fsencode(name)`` the bytes.
* Text cells (CSV ``input``, Parquet ``input``, one name per line in ``FILE.npy.inputs.txt``):
  :func:`encode_name`. A name is written as it is unless it holds an undecodable byte, a control
  character (a line break, a tab...), U+0085, U+2028, U+2029, or starts with a double quote; then
  it is written as a JSON string literal (``"a\\nb.png"``, ``"caf\\udce9.png"``), escapes as for
  JSONL. A cell that starts with ``"`` is such a literal, any other is the name itself:
  :func:`decode_name` reverses it, and the file stays valid UTF-8.

Error messages in records are text for people: their undecodable bytes are written as ``\\udcXX``
(:func:`safe_text`), not meant to be reversed.
"""

from __future__ import annotations

import json
import re

__all__ = ["decode_name", "display_name", "encode_name", "escape_json", "safe_text"]

#: Characters a JSON encoder leaves raw but a file cannot hold as they are, or some readers split lines at.
_RAW = re.compile(r"[\ud800-\udfff\x85\u2028\u2029]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_QUOTE = re.compile(r"[\ud800-\udfff\x00-\x1f\x7f\x85\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_json(text: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``) with lone surrogates, U+0085, U+2028 and
    U+2029 written as ``\\uXXXX`` escapes: the same JSON value, encodable as UTF-8, one line."""
    return _RAW.sub(_escape, text)


def encode_name(name: str) -> str:
    """``name`` as a text cell (see the module docstring): itself, or a JSON string literal."""
    if name.startswith('"') or _QUOTE.search(name):
        return escape_json(json.dumps(name, ensure_ascii=False))
    return name


def decode_name(cell: str) -> str:
    """The name that :func:`encode_name` wrote as ``cell``."""
    if cell.startswith('"'):
        try:
            value = json.loads(cell)
        except ValueError:
            return cell
        if isinstance(value, str):
            return value
    return cell


def safe_text(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes) written as ``\\udcXX``: encodable as UTF-8."""
    return _SURROGATE.sub(_escape, text)


def display_name(name: str) -> str:
    """``name`` for a terminal: as :func:`safe_text` (the bytes of a non-UTF-8 name as ``\\udcXX``)."""
    return safe_text(name)
