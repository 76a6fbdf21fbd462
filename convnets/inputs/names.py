"""Input names in output files, bytes-safe: every ``os.fsdecode`` name (undecodable bytes as lone surrogates,
line breaks included) survives, byte for byte. JSONL escapes lone surrogates, U+0085, U+2028 and U+2029 as
``\\uXXXX``; text cells (CSV, Parquet, ``FILE.npy.inputs.txt``) hold :func:`encode_name`'s. Error messages
are :func:`safe_text`, for people, not reversed. Names shown in a text table or written one per line (class
names from a checkpoint, input names) are :func:`convnets.text.printable`: data, never terminal control or a
line break. Files named after inputs (``convnets explain``'s) take :func:`file_stems`: safe, distinct names.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

from convnets.preprocessing.sources import is_url

__all__ = ["decode_name", "encode_name", "escape_json", "file_stem", "file_stems", "safe_text"]

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



#: What a file name made from an input keeps: letters and digits of any script, ``_``, ``.``, ``-`` (not a
#: lone surrogate, which no file system takes as text); the rest becomes ``_``.
_UNSAFE = re.compile(r"[^\w.-]")
_LONGEST_STEM = 100  # characters: room for the suffixes under the 255 bytes most file systems allow


def file_stem(name: str) -> str:
    """The start of a file name made from an input's name: its last path (or URL path) component without the
    suffix, every character other than letters, digits, ``.`` and ``-`` as ``_`` (separators, spaces, control
    characters, undecodable bytes), no leading ``.`` (not hidden), at most 100 characters; ``input`` if
    nothing is left."""
    if is_url(name):
        name = unquote(urlsplit(name).path)
    base = os.path.splitext(re.split(r"[\\/]", name.rstrip("/\\"))[-1])[0]
    stem = _UNSAFE.sub("_", base).lstrip(".")[:_LONGEST_STEM]
    return stem if stem.strip("_") else "input"


def file_stems(names: Iterable[str]) -> list[str]:
    """:func:`file_stem` of each name, made distinct in order: the second ``cat`` is ``cat-2``, then ``cat-3``
    (compared case-insensitively, as macOS's and Windows' file systems do)."""
    taken: set[str] = set()
    stems = []
    for name in names:
        stem = candidate = file_stem(name)
        n = 1
        while candidate.casefold() in taken:
            n += 1
            candidate = f"{stem}-{n}"
        taken.add(candidate.casefold())
        stems.append(candidate)
    return stems
