"""The engine cache on disk: its directory, what in it to trust, and reading, listing, removing, evicting entries.

The cache uses only what the current user wrote and no one else can change (the digests in
``entry.json`` cannot tell a planted entry from ours, since whoever plants the graph writes them):

* the root (:func:`cache_root`) must belong to the current user and be writable by no one else,
  since whoever can write it can swap an entry between its check and its use; otherwise the cache
  is neither read nor written (:func:`usable_root`: one warning naming ``$CONVNETS_CACHE_DIR``),
  and ``convnets cache clear`` refuses it. The root itself may be a symbolic link (the user's own
  choice); nothing under it is followed;
* an entry is a directory (not a link) directly under the root, named ``ENGINE-KEY``, that
  belongs to the current user, as does everything in it, none of it writable by group or others
  (:func:`untrusted`); any other is ignored with one warning line and never removed;
* ``entry.json`` and ``verdict.json`` are read as regular files only (no link followed, no FIFO
  waited on, 1 MiB at most) and checked against their schema; a bad one makes the entry damaged
  (:func:`damage`: removed and rebuilt) or its verdict missing. The names an entry's files have
  are plain names (:data:`FILE_NAME`: no ``/``, no ``..``), regular files checked by size and digest;
* removing an entry (:func:`remove`) unlinks plain names inside it, never anything elsewhere.

Size: :func:`evict` removes the least recently used trusted entries (last use: the entry
directory's modification time, set on each hit) once they hold more than :func:`max_size`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import secrets
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convnets.constants import CACHE_DIR_ENV, CACHE_MAX_SIZE_ENV, DEFAULT_CACHE_MAX_SIZE
from convnets.deploy.cache.keys import digest, entry_key
from convnets.errors import InvalidArgumentError
from convnets.fileio import atomic_write

__all__ = ["EntryInfo", "cache_root", "clear", "damage", "evict", "file_digest", "format_size", "list_entries",
           "max_size", "parse_size", "read_verdict", "remove", "root_problem", "seal", "trim", "untrusted",
           "usable_root", "write_private"]

log = logging.getLogger(__name__)

MANIFEST = "entry.json"
VERDICT = "verdict.json"
_ENGINE = re.compile(r"[a-z0-9_]+")
ENTRY_NAME = re.compile(r"[a-z0-9_]+-[0-9a-f]{32}")
TEMP_NAME = re.compile(r"\.([a-z0-9_]+-[0-9a-f]{32})\.(\d+)-[0-9a-f]{8}\.(tmp|old)")
#: A file of an entry: a plain name in its directory (no path, no ``..``, not hidden).
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_WRITER_TEMP = re.compile(r"\.[A-Za-z0-9_][A-Za-z0-9_.-]*\.tmp")  # atomic_write's, left by a killed writer
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_JSON = 1 << 20  # entry.json and verdict.json are a few KiB
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_FIELDS = {"layout": int, "model": str, "weights": str, "engine": str, "precision": str, "shape": list,
           "versions": dict}
_SIZE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_warned: set[str] = set()


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


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it (a run asks about one entry more than once)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _foreign(st: os.stat_result) -> str | None:
    """Why a file with status ``st`` is not the current user's alone, or ``None``."""
    user = os.geteuid() if hasattr(os, "geteuid") else None  # Windows: no owners to compare
    if user is not None and st.st_uid != user:
        return f"belongs to user id {st.st_uid}, not {user}"
    if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
        return "can be written by group or others"
    return None


def root_problem(root: Path) -> str | None:
    """Why the cache directory ``root`` must not be used, or ``None`` (also when it does not exist yet)."""
    try:
        st = root.stat()  # the root may be a link: the user chose it; nothing under it is followed
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return "is not a directory" if not stat.S_ISDIR(st.st_mode) else _foreign(st)


def refusal(root: Path, problem: str) -> str:
    """Why ``root`` is not used, and what to do, in one line."""
    return (f"the engine cache {root} {problem}, so what it holds could be someone else's; set {CACHE_DIR_ENV} "
            "to a directory that only you can write")


def usable_root(root: Path) -> bool:
    """Whether the cache may read and write ``root``; when not, says so once per process (a warning)."""
    problem = root_problem(root)
    if problem is not None:
        warn_once(f"{refusal(root, problem)}; running without the cache")
    return problem is None


def untrusted(path: Path) -> str | None:
    """Why the entry (or fill) directory ``path`` is not to be trusted, or ``None`` (also when it is gone):
    it is not a directory, or it or anything in it belongs to another user or can be written by others."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
        problem = _foreign(st)
        if problem is not None:
            return problem
        with os.scandir(path) as children:
            for child in children:
                problem = _foreign(child.stat(follow_symlinks=False))
                if problem is not None:
                    return f"holds {child.name!r}, which {problem}"
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None


def ignore(path: Path, reason: str) -> None:
    """Say (once) that the entry ``path`` is ignored for ``reason`` (:func:`untrusted`)."""
    warn_once(f"engine cache: ignoring {path}: it {reason} (the cache uses only what you wrote and no one else "
              "can change)")


def read_json(path: Path) -> Any:
    """The JSON value in the small regular file ``path``, read without following a link or waiting on a FIFO.

    Raises:
        OSError: it is missing, a symbolic link (``ELOOP``) or unreadable.
        ValueError: it is not a regular file, larger than 1 MiB, or not JSON.
    """
    with open(os.open(path, _READ), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        data = f.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise ValueError(f"{path.name} is larger than {_MAX_JSON} bytes")
    return json.loads(data)


def file_digest(path: Path) -> str:
    """:func:`~convnets.deploy.cache.keys.digest` of the regular file ``path`` (not followed if a link).

    Raises:
        OSError: it is missing, a link or unreadable.  ValueError: it is not a regular file.
    """
    fd = os.open(path, _READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        if st.st_size == 0:
            return digest([])
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return digest([view])
            finally:
                view.release()
    finally:
        os.close(fd)


def _check(ok: object, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _valid_fields(fields: object) -> bool:
    return (isinstance(fields, dict) and set(fields) == set(_FIELDS)
            and all(type(fields[k]) is t for k, t in _FIELDS.items())  # type(): a bool is no layout
            and _ENGINE.fullmatch(fields["engine"]) is not None
            and all(type(s) is int for s in fields["shape"])
            and all(isinstance(k, str) and isinstance(v, str) for k, v in fields["versions"].items()))


def _valid_record(record: object) -> bool:
    return (isinstance(record, dict) and set(record) == {"size", "sha256"} and type(record["size"]) is int
            and record["size"] >= 0 and isinstance(record["sha256"], str) and bool(_HEX64.fullmatch(record["sha256"])))


def read_manifest(path: Path) -> dict[str, Any]:
    """The ``entry.json`` of the entry directory ``path``, checked against its schema: ``key`` (SHA-256 of
    ``fields``, which name ``path``), ``fields`` (:func:`~convnets.deploy.cache.keys.key_fields`), ``files``
    (plain name -> ``{"size": int, "sha256": hex}``) and ``created`` (text).

    Raises:
        OSError: it is missing or unreadable.  ValueError: anything else (the message says what).
    """
    data = read_json(path / MANIFEST)
    _check(isinstance(data, dict) and set(data) == {"key", "fields", "files", "created"},
           "not an object of key, fields, files and created")
    _check(_valid_fields(data["fields"]), "its fields are not an entry's")
    key = entry_key(data["fields"])
    _check(data["key"] == key, "its key is not its fields'")
    _check(path.name == f"{data['fields']['engine']}-{key[:32]}", "it describes another entry")
    files = data["files"]
    _check(isinstance(files, dict) and all(FILE_NAME.fullmatch(name) and _valid_record(record)
                                           for name, record in files.items()),
           "its files are not plain names with a size and a SHA-256")
    _check(isinstance(data["created"], str), "its creation time is not text")
    return data


def damage(path: Path, key: str, files: Sequence[str]) -> str | None:
    """Why the trusted entry ``path`` cannot be used, or ``None`` when it is complete and intact: a valid
    ``entry.json`` naming ``key`` and exactly ``files``, each a regular file of its recorded size and digest."""
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as e:
        return f"{MANIFEST} is not valid ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if manifest["key"] != key:
        return f"{MANIFEST} names another key"
    if set(manifest["files"]) != set(files):
        return f"{MANIFEST} lists other files"
    for name in files:
        recorded = manifest["files"][name]
        try:
            st = os.lstat(path / name)
            if not stat.S_ISREG(st.st_mode):
                return f"{name} is not a regular file"
            if st.st_size != recorded["size"]:
                return f"{name} has {st.st_size} bytes, not {recorded['size']}"
            if file_digest(path / name) != recorded["sha256"]:
                return f"{name} does not match its digest"
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, ValueError) as e:
            return f"{name} is unreadable ({type(e).__name__})"
    return None


def read_verdict(path: Path, key: str, check: str) -> dict[str, Any] | None:
    """What ``check`` recorded in the entry ``path``'s ``verdict.json`` for ``key`` (a dict with a bool
    ``passed``); ``None``: none, or not one of this schema (a bad record counts as none)."""
    try:
        found = read_json(path / VERDICT)
    except (OSError, ValueError):
        return None
    if not (isinstance(found, dict) and found.get("key") == key and isinstance(found.get(check), dict)
            and isinstance(found[check].get("passed"), bool)):
        return None
    return dict(found[check])


def seal(path: Path) -> None:
    """Take group's and others' write permission from the file ``path`` (written with the umask's
    permissions): :func:`untrusted` would refuse the entry otherwise."""
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    if mode & 0o022:
        os.chmod(path, mode & ~0o022)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`convnets.fileio.atomic_write`), then :func:`seal` it."""
    atomic_write(path, lambda f: f.write(data))
    seal(path)


def touch(path: Path) -> None:
    """Record a use of the entry ``path`` (its directory's modification time) for the eviction order."""
    with contextlib.suppress(OSError):
        os.utime(path)


def remove(path: Path, files: Iterable[str] = ()) -> None:
    """Remove the trusted entry or fill directory ``path``: the plain-named files its ``entry.json``
    records or ``files`` names, its verdict and manifest, then the directory if nothing else is in it.
    An entry is renamed away first, so that no process sees it half removed."""
    doomed = path
    if ENTRY_NAME.fullmatch(path.name):
        doomed = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.old")
        try:
            os.rename(path, doomed)  # renames a link itself, never its target
        except FileNotFoundError:
            return  # another process removed it first
    try:
        if not stat.S_ISDIR(os.lstat(doomed).st_mode):
            return
        names = {*files, VERDICT, MANIFEST, *(n for n in os.listdir(doomed) if _WRITER_TEMP.fullmatch(n))}
    except OSError:
        return
    with contextlib.suppress(OSError, ValueError, TypeError):
        names.update(name for name in read_json(doomed / MANIFEST)["files"] if isinstance(name, str))
    for name in names:
        if FILE_NAME.fullmatch(name) or _WRITER_TEMP.fullmatch(name):  # never a path: nothing outside it
            with contextlib.suppress(OSError):
                os.unlink(doomed / name)
    try:
        doomed.rmdir()
    except OSError:
        log.warning("engine cache: left %s in place: it holds files the cache did not write", doomed)


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
    first; each other one is ignored with a warning."""
    root = cache_root() if root is None else root
    try:
        with os.scandir(root) as children:
            paths = sorted(Path(c.path) for c in children if ENTRY_NAME.fullmatch(c.name))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for path in paths:
        reason = untrusted(path)
        if reason is not None:
            ignore(path, reason)
            continue
        try:
            manifest = read_manifest(path)
            fields, created = dict(manifest["fields"]), str(manifest["created"])
        except (OSError, ValueError):
            fields, created = {}, ""
        try:
            with os.scandir(path) as files:
                size = sum(f.stat(follow_symlinks=False).st_size for f in files if f.is_file(follow_symlinks=False))
            found.append(EntryInfo(path, fields, size, created, os.lstat(path).st_mtime))
        except FileNotFoundError:
            continue  # removed meanwhile
    return sorted(found, key=lambda e: (e.last_used, e.path.name))


def evict(root: Path, limit: int, keep: Path | None = None) -> list[EntryInfo]:
    """Remove the least recently used trusted entries under ``root`` (never ``keep``) until the trusted
    entries hold at most ``limit`` bytes. Returns the entries removed."""
    entries = list_entries(root)
    total = sum(info.size for info in entries)
    removed = []
    for info in entries:
        if total <= limit:
            break
        if info.path != keep:
            remove(info.path)
            total -= info.size
            removed.append(info)
    if removed:
        log.info("engine cache: removed %d least recently used entr%s (%s) to keep %s within %s ($%s)", len(removed),
                 "y" if len(removed) == 1 else "ies", format_size(sum(i.size for i in removed)), root,
                 format_size(limit), CACHE_MAX_SIZE_ENV)
    return removed


def _writable(root: Path) -> Path:
    problem = root_problem(root)
    if problem is not None:
        raise InvalidArgumentError(refusal(root, problem))
    return root


def trim(root: Path | None = None, limit: int | None = None) -> list[EntryInfo]:
    """Evict least recently used entries under ``root`` (default :func:`cache_root`) until they hold at
    most ``limit`` bytes (default :func:`max_size`). Returns the entries removed.

    Raises:
        InvalidArgumentError: ``root`` belongs to another user or others can write it.
    """
    return evict(_writable(cache_root() if root is None else root), max_size() if limit is None else limit)


def clear(root: Path | None = None) -> tuple[int, int]:
    """Remove every trusted entry under ``root`` (default :func:`cache_root`) and the temporary directories
    of processes that are gone; other files are left alone. Returns ``(entries removed, bytes freed)``.

    Raises:
        InvalidArgumentError: ``root`` belongs to another user or others can write it.
    """
    root = _writable(cache_root() if root is None else root)
    entries = list_entries(root)
    for info in entries:
        remove(info.path)
    try:
        with os.scandir(root) as children:
            temps = [(Path(c.path), int(m.group(2))) for c in children if (m := TEMP_NAME.fullmatch(c.name))]
    except (FileNotFoundError, NotADirectoryError):
        temps = []
    for path, pid in temps:
        if untrusted(path) is None and not _pid_alive(pid):
            remove(path)
    return len(entries), sum(info.size for info in entries)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


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
