"""The engine cache on disk: its directory, what in it to trust, and reading, writing and removing an entry.

The cache uses only what the current user wrote and no one else can change (the digests in
``entry.json`` cannot tell a planted entry from ours, since whoever plants the graph writes them):

* the root (:func:`cache_root`) must belong to the current user and be writable by no one else,
  since whoever can write it can swap an entry between its check and its use; otherwise the cache
  is neither read nor written (:func:`usable`: one warning naming ``$CONVNETS_CACHE_DIR``), and
  ``convnets cache clear`` refuses it. The root itself may be a symbolic link (the user's own
  choice); nothing under it is followed. It is checked and used as one directory
  (:class:`PinnedRoot`): opened once, the directory opened is the one checked, and everything is
  then done through that open directory, so that whoever can write the root's parent cannot swap
  another directory in after the check;
* an entry is a directory (not a link) directly under the root, named ``ENGINE-KEY``, that
  belongs to the current user, as does everything in it, none of it writable by group or others,
  and that holds the cache's own marker (:data:`MARKER`, written first into every directory the
  cache makes: a folder that merely looks like an entry, e.g. with ``$CONVNETS_CACHE_DIR`` set to
  a home directory, is not one) (:func:`untrusted`); any other is ignored with one warning line and
  never used, renamed or removed;
* ``entry.json`` and ``verdict.json`` are read as regular files only (no link followed, no FIFO
  waited on, 1 MiB at most) and checked against their schema; a bad one makes the entry damaged
  (:func:`damage`: removed and rebuilt) or its verdict missing. The names an entry's files have
  are plain names (:data:`FILE_NAME`: no ``/``, no ``..``), regular files checked by size and digest;
* removing an entry (:func:`remove`) unlinks plain names inside a marked entry, the marker last,
  never anything elsewhere.

The cache as a whole (listing, size limit, eviction, clearing) is :mod:`convnets.deploy.cache.store`.
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from convnets.constants import CACHE_DIR_ENV
from convnets.deploy.cache.keys import digest, entry_key
from convnets.fileio import atomic_write
from convnets.machine import cache_root

__all__ = ["MARKER", "PinnedRoot", "cache_root", "damage", "file_digest", "ignore", "mark", "read_manifest",
           "read_verdict", "remove", "root_problem", "seal", "touch", "untrusted", "usable", "write_private"]

log = logging.getLogger(__name__)

MANIFEST = "entry.json"
VERDICT = "verdict.json"
#: The marker in each directory the cache makes: a cache directory tag (https://bford.info/cachedir/,
#: so backups skip the entry) whose text names convnets; only a directory holding it with exactly
#: :data:`MARKER_TEXT` is an entry.
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
               b"# An entry of convnets' engine cache: convnets wrote this directory and removes it "
               b"(convnets cache clear).\n"
               b"# Cache directory tags: https://bford.info/cachedir/\n")
_ENGINE = re.compile(r"[a-z0-9_]+")
ENTRY_NAME = re.compile(r"[a-z0-9_]+-[0-9a-f]{32}")
TEMP_NAME = re.compile(r"\.([a-z0-9_]+-[0-9a-f]{32})\.(\d+)-[0-9a-f]{8}\.(tmp|old)")
#: A file of an entry: a plain name in its directory (no path, no ``..``, not hidden).
FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_WRITER_TEMP = re.compile(r"\.[A-Za-z0-9_][A-Za-z0-9_.-]*\.tmp")  # atomic_write's, left by a killed writer
_HEX64 = re.compile(r"[0-9a-f]{64}")
_MAX_JSON = 1 << 20  # entry.json and verdict.json are a few KiB
_READ = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_FIELDS = {"layout": int, "model": str, "weights": str, "engine": str, "precision": str, "shape": list,
           "versions": dict}
_warned: set[str] = set()


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


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class PinnedRoot:
    """The cache directory ``root``, opened once and checked as opened (a context manager; closes it).

    The root may be a symbolic link (the user's choice): it is followed once, by the open, and the
    directory opened is the one checked (owner, permissions). Work then goes through :attr:`path`:
    on Linux ``/proc/self/fd/N``, which names the opened directory itself, whatever is renamed to
    ``root`` meanwhile by whoever can write its parent; where there is no ``/proc``, ``root`` itself,
    checked again to name the directory opened.

    Attributes:
        shown: ``root``, for messages.
        path: where to work (see above); ``None`` when the root does not exist or is refused.
        problem: why the root is refused, in words (:func:`refusal`); ``None``: it is usable or missing.
    """

    def __init__(self, root: Path, *, create: bool = False) -> None:
        self.shown, self.path, self.problem = root, None, None
        self._fd: int | None = None
        try:
            if create:
                root.mkdir(mode=0o755, parents=True, exist_ok=True)  # never writable by others, whatever the umask
            self._fd = os.open(root, _DIRECTORY)
            st = os.fstat(self._fd)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            self.problem = "is not a directory"
            return
        except OSError as e:
            if os.name != "nt":
                self.problem = f"cannot be read ({e.strerror})"
                return
            st = os.stat(root)  # Windows opens no directories: checked by path (no owners there)
        self.problem = "is not a directory" if not stat.S_ISDIR(st.st_mode) else _foreign(st)
        if self.problem is None:
            self.path = self._through(st)
            if self.path is None:
                self.problem = "was replaced by another directory while it was opened"

    def _through(self, st: os.stat_result) -> Path | None:
        """The path that names the directory of status ``st`` that was opened (see the class)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                pinned = Path(f"/proc/self/fd/{self._fd}")
                if _same(os.stat(pinned), st):
                    return pinned
        try:
            return self.shown if _same(os.stat(self.shown), st) else None
        except OSError:
            return None

    def close(self) -> None:
        """Close the directory (:attr:`path` no longer names it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.path = None

    def __enter__(self) -> PinnedRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def root_problem(root: Path) -> str | None:
    """Why the cache directory ``root`` must not be used, or ``None`` (also when it does not exist yet)."""
    with PinnedRoot(root) as pinned:
        return pinned.problem


def refusal(root: Path, problem: str) -> str:
    """Why ``root`` is not used, and what to do, in one line."""
    return f"the engine cache {root} {problem}; set {CACHE_DIR_ENV} to a directory that only you can write"


def usable(pinned: PinnedRoot) -> bool:
    """Whether the cache may read and write the ``pinned`` root (refused: says so once per process, a warning)."""
    if pinned.problem is not None:
        warn_once(f"{refusal(pinned.shown, pinned.problem)}; running without the cache")
    return pinned.problem is None


def untrusted(path: Path) -> str | None:
    """Why the entry (or fill) directory ``path`` is not to be trusted, or ``None`` (also when it is gone):
    it is not a directory, or it or anything in it belongs to another user or can be written by others,
    or it holds no :data:`MARKER` of the cache's (the cache did not make it)."""
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
        if not marked(path):
            return f"holds no {MARKER} of convnets' (not a directory the cache made)"
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    return None


def mark(path: Path) -> None:
    """Put the cache's :data:`MARKER` into the directory ``path`` that the cache has just made."""
    write_private(path / MARKER, MARKER_TEXT)


def marked(path: Path) -> bool:
    """Whether the directory ``path`` holds the cache's :data:`MARKER`: a regular file of exactly its text."""
    try:
        with open(os.open(path / MARKER, _READ), "rb") as f:
            return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(MARKER_TEXT) + 1) == MARKER_TEXT
    except OSError:
        return False


def ignore(path: Path, reason: str) -> None:
    """Say (once) that the entry ``path`` is ignored for ``reason`` (:func:`untrusted`)."""
    warn_once(f"engine cache: ignoring {path}: it {reason} (the cache uses and removes only what it wrote and no "
              "one else can change; delete it yourself to have it rebuilt)")


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
    """Remove the marked entry or fill directory ``path`` (:func:`marked`; one without the marker is
    left as it is): the plain-named files its ``entry.json`` records or ``files`` names, its verdict
    and manifest, the marker last, then the directory if nothing else is in it. An entry is renamed
    away first, so that no process sees it half removed."""
    doomed = path
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not marked(path):
            return  # a link, a file or a folder the cache did not make: not ours to remove
        if ENTRY_NAME.fullmatch(path.name):
            doomed = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.old")
            os.rename(path, doomed)
        names = {*files, VERDICT, MANIFEST, *(n for n in os.listdir(doomed) if _WRITER_TEMP.fullmatch(n))}
    except OSError:  # FileNotFoundError: another process removed it first
        return
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        names.update(name for name in read_json(doomed / MANIFEST)["files"] if isinstance(name, str))
    names.discard(MARKER)
    for name in [*names, MARKER]:  # the marker last: a removal cut short leaves a directory still marked
        if FILE_NAME.fullmatch(name) or _WRITER_TEMP.fullmatch(name):  # never a path: nothing outside it
            with contextlib.suppress(OSError):
                os.unlink(doomed / name)
    try:
        doomed.rmdir()
    except OSError:
        log.warning("engine cache: left %s in place: it holds files the cache did not write", doomed)
