"""Input names in output files, bytes-safe: every ``os.fsdecode`` name (undecodable bytes as lone surrogates,
line breaks included) survives, byte for byte. JSONL escapes lone surrogates, U+0085, U+2028 and U+2029 as
``\\uXXXX``; text cells (CSV, Parquet, ``FILE.npy.inputs.txt``) hold :func:`encode_name`'s. Error messages
are :func:`safe_text`, for people, not reversed. Names shown in a text table or written one per line (class
names from a checkpoint, input names) are :func:`convnets.text.printable`: data, never terminal control or a
line break.
"""

from __future__ import annotations

import json
import re

__all__ = ["decode_name", "encode_name", "escape_json", "safe_text"]

#: Characters a JSON encoder leaves raw but a file cannot hold, or some readers split lines at.
_RAW = re.compile(r"[\ud800-\udfff\x85\u2028\u2029]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_QUOTE = re.compile(r"[\ud800-\udfff\x00-\x1f\x7f\x85\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_json(text: str) -> str:
    """JSON text with lone surrogates, U+0085, U+2028, U+2029 as ``\\uXXXX`` escapes: one UTF-8 line."""
    return _RAW.sub(_escape, text)


def encode_name(name: str) -> str:
    """``name`` as a text cell: itself, or a JSON string literal when it holds an undecodable byte, a control
    character, U+0085, U+2028, U+2029, or starts with ``"``."""
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
    """``text`` (a message, a name for a terminal) with lone surrogates as ``\\udcXX``: encodable as UTF-8."""
    return _SURROGATE.sub(_escape, text)

