"""The engine cache as a whole: its entries listed, kept within the size limit (least recently used out
first), trimmed and cleared. Only entries that :func:`~convnets.deploy.cache.disk.untrusted` passes (the
current user's alone, and marked as the cache's own) are listed, counted and ever removed; any other is
ignored with a warning. The root is read through a :class:`~convnets.deploy.cache.disk.PinnedRoot`.

Last use: the entry directory's modification time, which a fill sets and each load renews
(:func:`~convnets.deploy.cache.disk.touch`): one ``utime`` per hit, no file to rewrite.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convnets.constants import CACHE_MAX_SIZE_ENV, DEFAULT_CACHE_MAX_SIZE
from convnets.deploy.cache.disk import (ENTRY_NAME, TEMP_NAME, PinnedRoot, cache_root, ignore, read_manifest,
                                        refusal, remove, untrusted)
from convnets.errors import InvalidArgumentError
from convnets.locking import pid_alive

__all__ = ["EntryInfo", "clear", "evict", "format_size", "list_entries", "max_size", "parse_size", "trim"]

log = logging.getLogger(__name__)

_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``convnets cache list`` shows it.

    Attributes:
        path: its directory.
        fields: its key fields (:func:`~convnets.deploy.cache.key_fields`; empty when ``entry.json`` is not valid).
        size: bytes in its files.
        created: when it was written (ISO 8601), as ``entry.json`` says.
        last_used: when it was last loaded or written (seconds since the epoch).
    """

    path: Path
    fields: dict[str, Any]
    size: int
    created: str
    last_used: float


def list_entries(root: Path | None = None) -> list[EntryInfo]:
    """The entries under ``root`` (default :func:`cache_root`) that the cache trusts, least recently used
    first; each other one is ignored with a warning. None under a root that the cache refuses."""
    with PinnedRoot(cache_root() if root is None else root) as pinned:
        return _entries(pinned)


def _entries(pinned: PinnedRoot) -> list[EntryInfo]:
    """:func:`list_entries` of the opened root ``pinned`` (each entry's ``path`` under ``pinned.shown``)."""
    if pinned.path is None:
        return []
    with os.scandir(pinned.path) as children:
        names = sorted(c.name for c in children if ENTRY_NAME.fullmatch(c.name))
    found = []
    for name in names:
        path = pinned.path / name
        reason = untrusted(path)
        if reason is not None:
            ignore(pinned.shown / name, reason)
            continue
        try:
            manifest = read_manifest(path)
            fields, created = dict(manifest["fields"]), str(manifest["created"])
        except (OSError, ValueError):
            fields, created = {}, ""
        try:
            with os.scandir(path) as files:
                size = sum(f.stat(follow_symlinks=False).st_size for f in files if f.is_file(follow_symlinks=False))
            found.append(EntryInfo(pinned.shown / name, fields, size, created, os.lstat(path).st_mtime))
        except FileNotFoundError:
            continue  # removed meanwhile
    return sorted(found, key=lambda e: (e.last_used, e.path.name))


def evict(pinned: PinnedRoot, limit: int, keep: str | None = None) -> list[EntryInfo]:
    """Remove the least recently used trusted entries under the opened root ``pinned`` (never the one named
    ``keep``) until the trusted entries hold at most ``limit`` bytes. Returns the entries removed."""
    entries = _entries(pinned)
    total = sum(info.size for info in entries)
    removed = []
    for info in entries:
        if total <= limit or pinned.path is None:
            break
        if info.path.name != keep:
            remove(pinned.path / info.path.name)
            total -= info.size
            removed.append(info)
    if removed:
        log.info("engine cache: removed %d least recently used entr%s (%s) to keep %s within %s ($%s)", len(removed),
                 "y" if len(removed) == 1 else "ies", format_size(sum(i.size for i in removed)), pinned.shown,
                 format_size(limit), CACHE_MAX_SIZE_ENV)
    return removed


@contextlib.contextmanager
def _writable(root: Path) -> Iterator[PinnedRoot]:
    with PinnedRoot(root) as pinned:
        if pinned.problem is not None:
            raise InvalidArgumentError(refusal(root, pinned.problem))
        yield pinned


def trim(root: Path | None = None, limit: int | None = None) -> list[EntryInfo]:
    """Evict least recently used entries under ``root`` (default :func:`cache_root`) until they hold at
    most ``limit`` bytes (default :func:`max_size`). Returns the entries removed.

    Raises:
        InvalidArgumentError: ``root`` belongs to another user or others can write it.
    """
    with _writable(cache_root() if root is None else root) as pinned:
        return evict(pinned, max_size() if limit is None else limit)


def clear(root: Path | None = None) -> tuple[int, int]:
    """Remove every trusted entry under ``root`` (default :func:`cache_root`) and the temporary directories
    of processes that are gone; other files are left alone. Returns ``(entries removed, bytes freed)``.

    Raises:
        InvalidArgumentError: ``root`` belongs to another user or others can write it.
    """
    with _writable(cache_root() if root is None else root) as pinned:
        if pinned.path is None:
            return 0, 0
        entries = _entries(pinned)
        for info in entries:
            remove(pinned.path / info.path.name)
        with os.scandir(pinned.path) as children:
            temps = [(pinned.path / c.name, int(m.group(2))) for c in children if (m := TEMP_NAME.fullmatch(c.name))]
        for path, pid in temps:
            if untrusted(path) is None and not pid_alive(pid):
                remove(path)
    return len(entries), sum(info.size for info in entries)


def parse_size(text: str) -> int:
    """A size in bytes from ``text``: a number of bytes, or a number with K, M, G or T (powers of 1024;
    ``4G``, ``4GB`` and ``4GiB`` alike), at least one byte.

    Raises:
        ValueError: ``text`` is not such a size (the message says what is allowed).
    """
    match = _SIZE.fullmatch(text.strip())
    value = int(float(match.group(1)) * 1024 ** " kmgt".index(match.group(2).lower() or " ")) if match else 0
    if value < 1:
        raise ValueError(f"{text.strip()[:40]!r} is not a size: give a number of bytes, or a number with K, M, G or T "
                         "(powers of 1024), such as 4GiB or 500M")
    return value


def max_size() -> int:
    """The cache's size limit in bytes: ``$CONVNETS_CACHE_MAX_SIZE``, else 4 GiB
    (:data:`~convnets.constants.DEFAULT_CACHE_MAX_SIZE`).

    Raises:
        InvalidArgumentError: the variable holds something else than a size.
    """
    text = os.environ.get(CACHE_MAX_SIZE_ENV, "").strip()
    try:
        return parse_size(text) if text else DEFAULT_CACHE_MAX_SIZE
    except ValueError as e:
        raise InvalidArgumentError(f"${CACHE_MAX_SIZE_ENV}: {e}") from None


def format_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``, ``4.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover
