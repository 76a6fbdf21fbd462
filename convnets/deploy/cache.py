"""The persistent engine cache: what an engine other than ``torch`` converted, kept on disk for the next process.

Converting a model for ONNX Runtime or OpenVINO (``torch.onnx.export`` / ``torch.export`` +
``openvino.convert_model``) costs seconds, and ``engine="auto"`` then checks the result against
the model. Both are done once: the engine's files and ``auto``'s verdict go to an *entry*, and a
later process with the same weights, engine, precision and input shape loads the entry instead.

Key: SHA-256 of the fields :func:`key_fields` lists: a digest of the model (its class, its
``repr`` and every tensor of its ``state_dict``: names, dtypes, shapes and bytes; folding is done
by this package's code, whose version is part of the key, so the unfolded weights are as exact as
the folded ones and cheaper), the engine, the precision, the per-image input shape, and the
versions of convnets, PyTorch and the engine's runtime packages (``Engine.requires``). Any change
gives another key: nothing is invalidated, a new entry is made.

Layout: :func:`cache_root` (``$CONVNETS_CACHE_DIR``, else ``convnets-engines`` beside the weights
cache under ``torch.hub.get_dir()``, i.e. ``$TORCH_HOME/hub``), one directory per entry,
``<engine>-<key[:32]>/``, holding the engine's files (``model.xml`` + ``model.bin``: an OpenVINO IR;
``model.onnx``: the ONNX graph), ``entry.json`` (the key, its fields, each file's size and
SHA-256, the creation time) and, once ``auto`` has checked the entry, ``verdict.json``.

Integrity: an entry is used only when ``entry.json`` reads, names this key, and every file it lists
has its recorded size and digest (hashed in parallel threads). Anything else (a missing or
truncated file, flipped bytes, a file that the runtime cannot load) is logged in one line, the
entry is removed and rebuilt: never used, never fatal.

Concurrency and permissions: an entry is filled in a private temporary directory
(``.<entry>.<pid>-<random>.tmp``, files written with :func:`convnets.fileio.atomic_write` or by the
runtime's own writer, so with the umask's permissions), then renamed into place in one step. Of two
processes filling one entry at once, the first rename wins and the other drops its copy and keeps
the graph it built: both succeed. ``verdict.json`` is replaced atomically.

Turned off with ``optimize_for_inference(..., cache=False)`` (and ``features_model`` /
``embed``) or the commands' ``--no-cache``; listed and emptied with ``convnets cache list|clear``.
int8 models are not cached (their graph depends on the calibration images).

Nothing here imports PyTorch at module level (``convnets cache`` lists entries without it).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.constants import CACHE_DIR_ENV
from convnets.fileio import atomic_write, disk_full

if TYPE_CHECKING:
    from torch import Tensor, nn

    from convnets.deploy.formats.base import Runner

__all__ = ["CACHE_DIR_ENV", "CachedRunner", "Entry", "EntryInfo", "cache_root", "cached_runner", "clear",
           "entry_of", "key_fields", "list_entries", "model_digest", "recorded_verdict", "use_cache", "versions"]

log = logging.getLogger(__name__)

#: The layout of an entry; part of the key (a new layout never reads an old entry).
LAYOUT = 1
MANIFEST = "entry.json"
VERDICT = "verdict.json"
_ENTRY_NAME = re.compile(r"[a-z0-9_]+-[0-9a-f]{32}")
_TEMP_NAME = re.compile(r"\.([a-z0-9_]+-[0-9a-f]{32})\.(\d+)-[0-9a-f]{8}\.(tmp|old)")
_CHUNK = 16 << 20

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("convnets_engine_cache", default=True)
_digests: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("convnets_model_digests",
                                                                                 default=None)


@contextlib.contextmanager
def use_cache(enabled: bool) -> Iterator[None]:
    """Within the block, engines use the cache (``enabled``) or build in a temporary directory.

    The block also remembers each model's digest, so that ``auto`` trying several engines hashes
    the weights once (the weights must not change inside the block).
    """
    token = _enabled.set(bool(enabled))
    memo = _digests.set({})
    try:
        yield
    finally:
        _digests.reset(memo)
        _enabled.reset(token)


def cache_root() -> Path:
    """The cache directory: ``$CONVNETS_CACHE_DIR``, else ``torch.hub.get_dir()/convnets-engines``
    (``$TORCH_HOME/hub/convnets-engines``; worked out without importing PyTorch when it is not loaded)."""
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    torch_module = sys.modules.get("torch")
    if torch_module is not None and hasattr(torch_module, "hub"):
        hub = Path(torch_module.hub.get_dir())
    else:  # torch.hub.get_dir()'s rule
        home = os.environ.get("TORCH_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "torch")
        hub = Path(os.path.expanduser(home)) / "hub"
    return hub / "convnets-engines"


def versions(runtimes: Sequence[str]) -> dict[str, str]:
    """The versions that an entry depends on: convnets, torch and each of ``runtimes`` (module names)."""
    import importlib
    import importlib.metadata

    # The package is loaded (this module is part of it); read from sys.modules, not imported back.
    found = {"convnets": str(getattr(sys.modules["convnets"], "__version__", "unknown"))}
    for name in ("torch", *runtimes):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                version = getattr(importlib.import_module(name), "__version__", "unknown")
        found[name] = str(version)
    return found


def _digest(views: Iterable[memoryview]) -> str:
    """SHA-256 over the SHA-256 of each ``_CHUNK`` of ``views``, hashed in threads (hashlib releases the GIL)."""
    chunks = [view[i:i + _CHUNK] for view in views for i in range(0, len(view), _CHUNK)]
    workers = max(1, min(8, os.cpu_count() or 1, len(chunks)))
    outer = hashlib.sha256()
    if workers == 1:
        parts: Iterable[bytes] = (hashlib.sha256(chunk).digest() for chunk in chunks)
    else:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(lambda chunk: hashlib.sha256(chunk).digest(), chunks))
    for chunk, part in zip(chunks, parts):
        outer.update(len(chunk).to_bytes(8, "little") + part)
    return outer.hexdigest()


def model_digest(model: nn.Module) -> str:
    """A digest of ``model``: its class, ``repr`` (the structure) and every ``state_dict`` tensor.

    Inside :func:`use_cache` the result is remembered per model object.
    """
    import torch

    memo = _digests.get()
    if memo is not None and id(model) in memo:
        return memo[id(model)]
    header = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n".encode())
    views = []
    for name, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            header.update(f"{name}={value!r}\n".encode())
            continue
        tensor = value.detach().to("cpu").contiguous()
        header.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode())
        if tensor.numel():
            views.append(tensor.reshape(-1).view(torch.uint8).numpy().data)
    digest = hashlib.sha256((header.hexdigest() + _digest(views)).encode()).hexdigest()
    if memo is not None:
        memo[id(model)] = digest
    return digest


def key_fields(model: nn.Module, *, engine: str, precision: str, shape: Sequence[int],
               runtimes: Sequence[str]) -> dict[str, Any]:
    """What an entry's key is made of (see the module's docstring)."""
    spec = getattr(model, "spec", None)
    return {"layout": LAYOUT, "model": str(getattr(spec, "name", type(model).__name__)),
            "weights": model_digest(model), "engine": engine, "precision": precision,
            "shape": [int(s) for s in shape], "versions": versions(runtimes)}


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _entry(fields: dict[str, Any]) -> Entry:
    """The entry that ``fields`` (:func:`key_fields`) name: ``ENGINE-KEY`` under :func:`cache_root`."""
    return Entry(cache_root() / f"{fields['engine']}-{_key(fields)[:32]}", fields)


@dataclass(frozen=True)
class Entry:
    """A cache entry that a runner came from: its directory and key fields."""

    path: Path
    fields: dict[str, Any]

    def verdict(self, check: str = "auto") -> dict[str, Any] | None:
        """What ``check`` (``engine="auto"``'s faithfulness check) found for this entry, or ``None``."""
        try:
            found = json.loads((self.path / VERDICT).read_text(encoding="utf-8"))
            verdict = found[check]
            if found.get("key") != _key(self.fields) or not isinstance(verdict.get("passed"), bool):
                return None
            return dict(verdict)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def record_verdict(self, result: dict[str, Any], check: str = "auto") -> None:
        """Store ``check``'s result (a JSON-able dict with a bool ``passed``); failures to write are logged only."""
        text = json.dumps({"key": _key(self.fields), check: result}, sort_keys=True).encode()
        try:
            atomic_write(self.path / VERDICT, lambda f: f.write(text))
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
    skipped without being loaded again. ``None``: the cache is off, or no verdict is recorded.
    """
    if not _enabled.get():
        return None
    return _entry(key_fields(source, engine=engine, precision=precision, shape=shape, runtimes=runtimes)).verdict(check)


def entry_of(module: object) -> Entry | None:
    """The cache entry of the first runner (the model's input size) of an engine's module, if any."""
    runners = getattr(module, "__dict__", {}).get("_runners", {})
    first = next(iter(runners.values()), None)
    return first.entry if isinstance(first, CachedRunner) else None


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return _digest([])
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return _digest([view])
            finally:
                view.release()


def _problem(path: Path, key: str, files: Sequence[str]) -> str | None:
    """Why the entry at ``path`` cannot be used, or ``None`` when it is complete and intact."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        recorded = manifest["files"]
        if manifest.get("key") != key:
            return f"{MANIFEST} names another key"
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for name in files:
        file = path / name
        if not isinstance(recorded, dict) or name not in recorded:
            return f"{name} is not recorded"
        try:
            size = file.stat().st_size
            if size != recorded[name]["size"]:
                return f"{name} has {size} bytes, not {recorded[name]['size']}"
            if _file_digest(file) != recorded[name]["sha256"]:
                return f"{name} does not match its digest"
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, KeyError, TypeError) as e:
            return f"{name} is unreadable ({type(e).__name__})"
    return None


def _remove(path: Path, files: Iterable[str] = ()) -> None:
    """Remove an entry (or a temporary one): the files it records or ``files``, its verdict and
    manifest, then the directory if nothing else is in it. Renamed away first, so that no process
    sees it half removed."""
    doomed = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.old") if _ENTRY_NAME.fullmatch(
        path.name) else path
    if doomed != path:
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return  # another process removed it first
    names = set(files)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        names |= set(json.loads((doomed / MANIFEST).read_text(encoding="utf-8"))["files"])
    for name in (*names, VERDICT, MANIFEST):
        with contextlib.suppress(OSError):
            (doomed / name).unlink()
    for leftover in doomed.glob(".*.tmp"):  # atomic_write's temporaries, left by a killed writer
        with contextlib.suppress(OSError):
            leftover.unlink()
    try:
        doomed.rmdir()
    except OSError:
        log.warning("engine cache: left %s in place: it holds files the cache did not write", doomed)


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

    With the cache off (:func:`use_cache`), ``write`` and ``load`` run in a temporary directory.
    """
    if not _enabled.get():
        with tempfile.TemporaryDirectory(prefix=f"convnets-{engine}-") as scratch:
            write(Path(scratch))
            return CachedRunner(load(Path(scratch)), None)
    fields = key_fields(source, engine=engine, precision=precision, shape=shape, runtimes=runtimes)
    key, entry = _key(fields), _entry(fields)
    root = entry.path.parent
    if entry.path.exists():
        problem = _problem(entry.path, key, files)
        if problem is None:
            try:
                run = load(entry.path)
                log.debug("engine cache: loaded %s", entry.path)
                return CachedRunner(run, entry)
            except Exception as e:  # noqa: BLE001 - a file the runtime refuses: rebuild it
                problem = f"does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        log.warning("engine cache: %s %s; rebuilding it", entry.path, problem)
        _remove(entry.path, files)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{entry.path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    tmp.mkdir()
    try:
        try:
            write(tmp)
            recorded = {name: {"size": (tmp / name).stat().st_size, "sha256": _file_digest(tmp / name)}
                        for name in files}
            manifest = json.dumps({"key": key, "fields": fields, "files": recorded,
                                   "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1, sort_keys=True)
            atomic_write(tmp / MANIFEST, lambda f: f.write(manifest.encode()))
        except Exception as e:  # noqa: BLE001 - runtimes that write files (OpenVINO) raise RuntimeError on a full disk
            if not disk_full(e, root):
                raise
            raise OSError(errno.ENOSPC, f"No space left on device to convert the model for {engine} in the engine "
                                        f"cache (free some, set {CACHE_DIR_ENV} to another directory, or turn the "
                                        "engine cache off)", str(entry.path)) from e
        run = load(tmp)
        try:
            os.rename(tmp, entry.path)
            log.debug("engine cache: wrote %s", entry.path)
        except OSError:  # another process put the same entry in place first: keep ours in memory only
            log.debug("engine cache: %s was filled by another process meanwhile", entry.path)
    finally:
        if tmp.exists():
            _remove(tmp, files)
    return CachedRunner(run, entry)


@dataclass(frozen=True)
class EntryInfo:
    """One entry as ``convnets cache list`` shows it."""

    path: Path
    fields: dict[str, Any]
    size: int
    created: str


def _is_ours(path: Path) -> bool:
    return path.is_dir() and (_ENTRY_NAME.fullmatch(path.name) is not None) and (path / MANIFEST).is_file()


def list_entries(root: Path | None = None) -> list[EntryInfo]:
    """The entries under ``root`` (default :func:`cache_root`), oldest first."""
    root = cache_root() if root is None else root
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if not _is_ours(path):
            continue
        try:
            manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
            fields = dict(manifest["fields"])
            created = str(manifest.get("created", ""))
        except (OSError, ValueError, KeyError, TypeError):
            fields, created = {}, ""
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        found.append(EntryInfo(path, fields, size, created))
    return sorted(found, key=lambda e: e.created)


def clear(root: Path | None = None) -> tuple[int, int]:
    """Remove every entry under ``root`` (default :func:`cache_root`) and the temporary directories of
    processes that are gone; other files are left alone. Returns ``(entries removed, bytes freed)``."""
    root = cache_root() if root is None else root
    entries = list_entries(root)
    for info in entries:
        _remove(info.path)
    for path in root.iterdir() if root.is_dir() else ():
        match = _TEMP_NAME.fullmatch(path.name)
        if match and path.is_dir() and not _pid_alive(int(match.group(2))):
            _remove(path)
    return len(entries), sum(info.size for info in entries)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
