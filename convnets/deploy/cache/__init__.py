"""The persistent engine cache: what an engine other than ``torch`` converted, kept on disk for the next process.

Converting a model for ONNX Runtime or OpenVINO (``torch.onnx.export`` / ``torch.export`` +
``openvino.convert_model``) costs seconds, and ``engine="auto"`` then checks the result against
the model. Both are done once: the engine's files and ``auto``'s verdict go to an *entry*, and a
later process with the same weights, engine, precision and input shape loads the entry instead.

Key (:mod:`~convnets.deploy.cache.keys`): SHA-256 of the fields :func:`key_fields` lists: a digest
of the model (its class, its ``repr`` and every tensor of its ``state_dict``: names, dtypes, shapes
and bytes; folding is done by this package's code, whose version is part of the key, so the
unfolded weights are as exact as the folded ones and cheaper), the engine, the precision, the
per-image input shape, and the versions of convnets, PyTorch and the engine's runtime packages
(``Engine.requires``). Any change gives another key: nothing is invalidated, a new entry is made.

Layout: :func:`cache_root` (``$CONVNETS_CACHE_DIR``, else ``convnets-engines`` beside the weights
cache under ``torch.hub.get_dir()``, i.e. ``$TORCH_HOME/hub``), one directory per entry,
``<engine>-<key[:32]>/``, holding its marker ``CACHEDIR.TAG``, the engine's files (``model.xml`` + ``model.bin``: an OpenVINO IR;
``model.onnx``: the ONNX graph), ``entry.json`` (the key, its fields, each file's size and
SHA-256, the creation time) and, once ``auto`` has checked the entry, ``verdict.json``.

Trust and integrity (:mod:`~convnets.deploy.cache.disk`): the cache uses only what the current user
wrote and no one else can change. A root that another user owns or others can write is not used
(one warning naming ``$CONVNETS_CACHE_DIR``; the run goes on without the cache); the root is opened
once and checked and used as that one directory, so a directory swapped in after the check is never
read. An entry that is a link, that (or anything in it) another user owns or others can write, or
that lacks the marker the cache writes into every entry (``CACHEDIR.TAG``, a cache directory tag
naming convnets), is ignored with one warning and never removed: a user's own folder that merely
looks like an entry is left alone. A trusted entry is used only when ``entry.json`` is valid, names this key, and
every file it lists is a regular file of its recorded size and digest (hashed in parallel threads).
Anything else (a missing or truncated file, flipped bytes, a FIFO, a file the runtime cannot load)
is logged in one line, the entry is removed and rebuilt: never used, never fatal.

Size: after each new entry the least recently used ones are removed while the cache holds more than
``$CONVNETS_CACHE_MAX_SIZE`` (default 4 GiB); each load records a use (the entry directory's time).

Concurrency and permissions: an entry is filled in a private (0700) temporary directory
(``.<entry>.<pid>-<random>.tmp``, files written with :func:`convnets.fileio.atomic_write` or by the
runtime's own writer, with the umask's permissions less group and others' write), then renamed
into place in one step; it stays private to its owner, whom alone it serves. Of two processes
filling one entry at once, the first rename wins and the other drops its copy and keeps the graph
it built: both succeed. ``verdict.json`` is replaced atomically.

Turned off with ``optimize_for_inference(..., cache=False)`` (and ``features_model`` /
``embed``) or the commands' ``--no-cache``; listed, trimmed and emptied with
``convnets cache list|trim|clear``. int8 models are not cached (their graph depends on the
calibration images).

Nothing here imports PyTorch at module level (``convnets cache`` lists entries without it).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.constants import CACHE_DIR_ENV, CACHE_MAX_SIZE_ENV
from convnets.deploy.cache.disk import (MANIFEST, VERDICT, PinnedRoot, cache_root, damage, file_digest, ignore, mark,
                                        read_verdict, remove, seal, touch, untrusted, usable, write_private)
from convnets.deploy.cache.keys import digests, entry_key, key_fields, model_digest, versions
from convnets.deploy.cache.store import EntryInfo, clear, evict, list_entries, max_size, parse_size, trim
from convnets.paths import disk_full

if TYPE_CHECKING:
    from torch import Tensor, nn

    from convnets.deploy.formats.base import Runner

__all__ = ["CACHE_DIR_ENV", "CACHE_MAX_SIZE_ENV", "CachedRunner", "Entry", "EntryInfo", "cache_root", "cached_runner",
           "clear", "entry_of", "key_fields", "list_entries", "max_size", "model_digest", "parse_size",
           "recorded_verdict", "trim", "use_cache", "versions"]

log = logging.getLogger(__name__)

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("convnets_engine_cache", default=True)


@contextlib.contextmanager
def use_cache(enabled: bool) -> Iterator[None]:
    """Within the block, engines use the cache (``enabled``) or build in a temporary directory.

    The block also remembers each model's digest, so that ``auto`` trying several engines hashes
    the weights once (the weights must not change inside the block).

    Raises:
        InvalidArgumentError: ``enabled``, and ``$CONVNETS_CACHE_MAX_SIZE`` is not a size (said
            before anything is built).
    """
    if enabled:
        max_size()
    token = _enabled.set(bool(enabled))
    memo = digests.set({})
    try:
        yield
    finally:
        digests.reset(memo)
        _enabled.reset(token)


def _entry(fields: dict[str, Any]) -> Entry:
    """The entry that ``fields`` (:func:`key_fields`) name: ``ENGINE-KEY`` under :func:`cache_root`."""
    return Entry(cache_root() / f"{fields['engine']}-{entry_key(fields)[:32]}", fields)


@dataclass(frozen=True)
class Entry:
    """A cache entry that a runner came from: its directory and key fields."""

    path: Path
    fields: dict[str, Any]

    def verdict(self, check: str = "auto") -> dict[str, Any] | None:
        """What ``check`` (``engine="auto"``'s faithfulness check) found for this entry, or ``None``
        (none recorded, not of the schema, or the entry is not trusted)."""
        with PinnedRoot(self.path.parent) as pinned:
            here = None if pinned.path is None else pinned.path / self.path.name
            if here is None or untrusted(here) is not None:
                return None
            return read_verdict(here, entry_key(self.fields), check)

    def record_verdict(self, result: dict[str, Any], check: str = "auto") -> None:
        """Store ``check``'s result (a JSON-able dict with a bool ``passed``); failures to write are logged only."""
        text = json.dumps({"key": entry_key(self.fields), check: result}, sort_keys=True).encode()
        with PinnedRoot(self.path.parent) as pinned:
            here = None if pinned.path is None else pinned.path / self.path.name
            if here is None or untrusted(here) is not None:
                return  # gone, or no longer one the cache trusts: nothing to record into
            try:
                write_private(here / VERDICT, text)
            except OSError as e:
                log.warning("engine cache: could not record the check of %s (%s)", self.path, e)


class CachedRunner:
    """A runner that knows the cache entry it was loaded from (``entry``; ``None``: the cache was off)."""

    def __init__(self, run: Runner, entry: Entry | None) -> None:
        self.run = run
        self.entry = entry

    def __call__(self, batch: Tensor) -> Tensor:
        return self.run(batch)


def recorded_verdict(source: nn.Module, *, engine: str, precision: str, shape: Sequence[int],
                     runtimes: Sequence[str], check: str = "auto") -> dict[str, Any] | None:
    """What ``check`` recorded for the entry that :func:`cached_runner` would use, without loading it.

    ``engine="auto"`` reads this first, so that an engine whose cached graph failed its check is
    skipped without being loaded again. ``None``: the cache is off or not trusted, or no valid
    verdict is recorded.
    """
    if not _enabled.get():
        return None
    entry = _entry(key_fields(source, engine=engine, precision=precision, shape=shape, runtimes=runtimes))
    with PinnedRoot(entry.path.parent) as pinned:
        if not usable(pinned) or pinned.path is None:
            return None
        here = pinned.path / entry.path.name
        reason = untrusted(here)
        if reason is not None:
            ignore(entry.path, reason)
            return None
        return read_verdict(here, entry_key(entry.fields), check)


def entry_of(module: object) -> Entry | None:
    """The cache entry of the first runner (the model's input size) of an engine's module, if any."""
    runners = getattr(module, "__dict__", {}).get("_runners", {})
    first = next(iter(runners.values()), None)
    return first.entry if isinstance(first, CachedRunner) else None


def _uncached(engine: str, write: Callable[[Path], object], load: Callable[[Path], Runner]) -> CachedRunner:
    """The runner built in a temporary directory, as with the cache off."""
    with tempfile.TemporaryDirectory(prefix=f"convnets-{engine}-") as scratch:
        write(Path(scratch))
        return CachedRunner(load(Path(scratch)), None)


def cached_runner(source: nn.Module, *, engine: str, precision: str, shape: Sequence[int], runtimes: Sequence[str],
                  files: Sequence[str], write: Callable[[Path], object], load: Callable[[Path], Runner]) -> CachedRunner:
    """The engines' hook: the runner for ``source`` at per-image ``shape``, loaded from the cache or built.

    Args:
        source: the model as the caller gave it (its digest is part of the key; ``write`` converts it).
        engine, precision, shape: what the runner computes (part of the key).
        runtimes: the modules whose versions are part of the key (the engine's ``requires``).
        files: the names that ``write`` creates in its directory (checked by digest when loaded).
        write: converts the model into files in the directory it is given (the expensive part).
        load: a runner from such a directory; what it reads must be read by the time it returns.

    With the cache off (:func:`use_cache`), or a cache directory or entry it does not trust,
    ``write`` and ``load`` run in a temporary directory.
    """
    if not _enabled.get():
        return _uncached(engine, write, load)
    fields = key_fields(source, engine=engine, precision=precision, shape=shape, runtimes=runtimes)
    key, entry = entry_key(fields), _entry(fields)
    with PinnedRoot(entry.path.parent, create=True) as pinned:
        if not usable(pinned) or pinned.path is None:
            return _uncached(engine, write, load)
        return _cached(pinned, entry, key, files, write, load)


def _cached(pinned: PinnedRoot, entry: Entry, key: str, files: Sequence[str], write: Callable[[Path], object],
            load: Callable[[Path], Runner]) -> CachedRunner:
    """:func:`cached_runner` in the opened, checked root ``pinned``: every file is reached through it."""
    assert pinned.path is not None
    here, engine = pinned.path / entry.path.name, entry.fields["engine"]
    reason = untrusted(here)
    if reason is not None:  # not ours to use, nor to remove: its name stays taken
        ignore(entry.path, reason)
        return _uncached(engine, write, load)
    if os.path.lexists(here):
        problem = damage(here, key, files)
        if problem is None:
            try:
                run = load(here)
                touch(here)
                log.debug("engine cache: loaded %s", entry.path)
                return CachedRunner(run, entry)
            except Exception as e:  # noqa: BLE001 - a file the runtime refuses: rebuild it
                problem = f"does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        log.warning("engine cache: %s %s; rebuilding it", entry.path, problem)
        remove(here, files)
    tmp = pinned.path / f".{entry.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.mkdir(mode=0o700)  # private until complete and renamed into place (and after: it serves its owner only)
    try:
        try:
            mark(tmp)  # first: whatever a kill leaves of it is the cache's to remove
            write(tmp)
            for name in files:
                seal(tmp / name)
            recorded = {name: {"size": os.lstat(tmp / name).st_size, "sha256": file_digest(tmp / name)}
                        for name in files}
            manifest = json.dumps({"key": key, "fields": entry.fields, "files": recorded,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1, sort_keys=True)
            write_private(tmp / MANIFEST, manifest.encode())
        except Exception as e:  # noqa: BLE001 - runtimes that write files (OpenVINO) raise RuntimeError on a full disk
            if not disk_full(e, tmp):
                raise
            raise OSError(errno.ENOSPC, f"No space left on device to convert the model for {engine} in the engine "
                                        f"cache (free some, set {CACHE_DIR_ENV} to another directory, or turn the "
                                        "engine cache off)", str(entry.path)) from e
        run = load(tmp)
        try:
            os.rename(tmp, here)
            log.debug("engine cache: wrote %s", entry.path)
        except OSError:  # another process put the same entry in place first: keep ours in memory only
            log.debug("engine cache: %s was filled by another process meanwhile", entry.path)
    finally:
        if tmp.exists():
            remove(tmp, files)
            with contextlib.suppress(OSError):
                tmp.rmdir()  # killed before its marker was written: empty
    try:
        evict(pinned, max_size(), keep=entry.path.name)
    except OSError as e:
        log.warning("engine cache: could not remove old entries from %s (%s)", pinned.shown, e)
    return CachedRunner(run, entry)
