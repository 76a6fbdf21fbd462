"""Crash-safe writes, relative to a directory opened once, that follow no link they did not make.

One writer (:func:`_writing`) works relative to the destination's directory, opened once: a temporary
file ``.<name>.<host>-<pid>-<random>.tmp`` made with ``O_EXCL | O_NOFOLLOW`` (mode 0o666 minus the
umask, as ``open()`` gives), flushed to disk, renamed over the name (a reader that has the old file
open or mapped keeps the old inode) or, when nothing may be replaced, hard-linked to it. A killed
writer's temporary file (or :func:`staging` directory) is removed by the next writer of the name.

A command's output goes through :func:`write_output`: below the directory the user named (``base``;
its own links are the user's) each directory is opened with ``O_NOFOLLOW``, so no path is looked at
and then opened; a file that exists is replaced only with ``force`` (the name, never a link's target).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from convnets.errors import InvalidArgumentError
from convnets.locking import pid_alive

__all__ = ["Staging", "atomic_output", "atomic_write", "make_output_dir", "naming", "preflight", "staging",
           "write_output"]

log = logging.getLogger(__name__)

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})  # FAT, some FUSE
_A_LINK = "is a symbolic link (convnets writes nothing through a link it did not make)"


def _temp_name(name: str, suffix: str = "tmp") -> str:
    return f".{name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.{suffix}"


def _remove_stale(folder: int, path: Path, suffix: str = "tmp") -> None:
    """Delete what killed writers of ``path`` left in its ``folder`` (this host's dead pids; ``partial``: our dirs)."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.([0-9a-f]{{8}})-(\d+)-[0-9a-f]+\.{suffix}$")
    for entry in os.listdir(folder):
        m = pattern.match(entry)
        if m and m.group(1) == _HOST and not pid_alive(int(m.group(2))):
            with contextlib.suppress(OSError):
                st = os.stat(entry, dir_fd=folder, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry, dir_fd=folder)
                elif st.st_uid == os.geteuid():
                    shutil.rmtree(path.parent / entry)  # never follows a link inside (dir_fd= needs Python 3.11)
                log.info("removed %s, left by a writer of %s that was killed", entry, path)


def _refused(problem: str, option: str, *, force: bool = False) -> Exception:
    """The error of a destination refused for ``problem``: what to do, in Python's words and the command line's."""
    fix = "{}to replace it, or choose another " if force else "remove it or choose another "
    return InvalidArgumentError(f"{problem}: {fix.format('pass force=True ')}{option}", keyword="force" if force else None,
                                cli=f"--{option}: {problem}: {fix.format('pass --force ')}--{option}")


@contextlib.contextmanager
def _opened(directory: Path, base: str | os.PathLike[str] | None, *, create: bool, option: str) -> Iterator[int]:
    """``directory``'s descriptor, opened level by level with ``O_NOFOLLOW`` below ``base`` (the directory the
    user named); ``create``: missing levels (and ``base``) are made, else FileNotFoundError."""
    base = directory if base is None else Path(base)
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, _DIR)  # the user's own directory: a link there is the user's choice
    try:
        parts = directory.relative_to(base).parts
        for i, part in enumerate(parts):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                problem = _A_LINK if _is_link(fd, part) else "is not a directory"
                raise _refused(f"{base.joinpath(*parts[:i + 1])} {problem}", option) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _put(src_dir: int, src: str, dst_dir: int, dst: str, *, replace: bool) -> None:
    """Name the complete file ``src`` ``dst``: ``replace`` what is there (a link itself), else link (FileExistsError)."""
    if replace:
        os.replace(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        return
    try:
        os.link(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        os.close(os.open(dst, _NEW, 0o600, dir_fd=dst_dir))  # no hard links here: claim the name, then replace it
        try:
            os.replace(src, dst, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        except OSError:
            os.unlink(dst, dir_fd=dst_dir)  # the empty claim is ours
            raise
    else:
        os.unlink(src, dir_fd=src_dir)


@contextlib.contextmanager
def _writing(folder: int, path: Path, *, replace: bool) -> Iterator[BinaryIO]:
    """The one writer: a temporary file in ``folder`` that becomes ``path``'s name there when the block ends
    without error (:func:`_put`)."""
    _remove_stale(folder, path)
    name, tmp = path.name, _temp_name(path.name)
    try:
        try:
            # Named by its path (to read back what was written before it is committed), made relative to folder.
            f = open(path.with_name(tmp), "xb", opener=lambda _, flags: os.open(tmp, flags | _NEW, 0o666, dir_fd=folder))
        except OSError as e:
            raise _naming(e, path, tmp, always=True) from e
        try:
            try:
                yield f
            except OSError as e:
                raise _naming(e, path, tmp) from e
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                raise _naming(e, path, tmp, always=True) from e
        except BaseException:
            # Closing flushes again what could not be written, and would fail again, unnamed, in place of this error.
            with contextlib.suppress(OSError):
                f.close()
            raise
        f.close()  # flushed above: nothing left to write
        try:
            _put(folder, tmp, folder, name, replace=replace)
        except OSError as e:
            raise e if isinstance(e, FileExistsError) else _naming(e, path, tmp, always=True) from e
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)
        raise
    os.fsync(folder)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, exclusive: bool = False) -> Iterator[BinaryIO]:
    """A temporary file, open for binary writing, that replaces ``path`` (in a directory that exists) when the
    ``with`` block ends without error, else ``path`` is left as it was. Its ``name`` is its path (to read back
    what was written before it is committed). ``exclusive``: never replace; FileExistsError if ``path`` exists.
    An ``OSError`` of writing keeps its type and ``errno`` and names ``path``, also when the write that failed
    was to the temporary file: ``[Errno 28] No space left on device: 'PATH'``."""
    path = Path(path)
    try:
        folder = os.open(path.parent, _DIR)
    except OSError as e:  # named as the file it was to hold
        raise _naming(e, path, path.parent, always=True) from e
    try:
        with _writing(folder, path, replace=not exclusive) as f:
            yield f
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "it exists (created meanwhile by someone else); not replaced",
                              str(path)) from None
    finally:
        os.close(folder)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, exclusive: bool = False) -> None:
    """Write ``path`` through ``write(file)`` without ever exposing a partial file (see :func:`atomic_output`)."""
    with atomic_output(path, exclusive=exclusive) as f:
        write(f)


def write_output(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, force: bool = False,
                 base: str | os.PathLike[str] | None = None, option: str = "output") -> Path:
    """Write a command's output ``path`` atomically through ``write(file)``; returns ``path``.

    ``force``: replace a file that exists (a link: the link itself). ``base``: the directory the user named
    above ``path``, made with those between if missing, none below it reached through a link (without it,
    ``path``'s directory must exist). ``option``: the command-line option that named it (``--output``).
    Refused (InvalidArgumentError naming it and what to do) if it exists without ``force``, or a link or a
    file is in the way; an ``OSError`` names ``path``.
    """
    path = Path(path)
    with (_opened(path.parent, base, create=base is not None, option=option) as folder,
          _refusing(folder, path.parent, option), _writing(folder, path, replace=force) as f):
        write(f)
    return path


@contextlib.contextmanager
def _refusing(folder: int, directory: Path, option: str) -> Iterator[None]:
    """FileExistsError of a name in ``folder`` (``directory``) as the refusal of the user's file."""
    try:
        yield
    except FileExistsError as e:
        name = os.fspath(e.filename2 or e.filename)  # link(): the name it found taken is the second
        kind = "a symbolic link" if _is_link(folder, name) else "a file"
        raise _refused(f"{directory / name} exists ({kind})", option, force=True) from None


def _is_link(folder: int, name: str) -> bool:
    """Whether ``name`` in ``folder`` is a symbolic link now (for a message only)."""
    with contextlib.suppress(OSError):
        return stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    return False


def preflight(path: str | os.PathLike[str], *, force: bool = False, base: str | os.PathLike[str] | None = None,
              option: str = "output") -> Path:
    """:func:`write_output`'s refusal of ``path`` now, before a command's slow part (the write decides again,
    atomically): a link or a file in the way below ``base``, or ``path`` exists without ``force``."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError), _opened(path.parent, base, create=False, option=option) as folder:
        if not force:
            with _refusing(folder, path.parent, option):
                os.stat(path.name, dir_fd=folder, follow_symlinks=False)
                raise FileExistsError(errno.EEXIST, "exists", path.name)
    return path


def make_output_dir(directory: str | os.PathLike[str], *, base: str | os.PathLike[str], option: str = "output") -> Path:
    """Make ``directory`` and those missing up to ``base`` (the directory the user named), none through a link
    below ``base`` (InvalidArgumentError), for a writer that takes a path (TensorBoard's). Returns it."""
    with _opened(Path(directory), base, create=True, option=option):
        return Path(directory)


class Staging:
    """A private directory (``path``, for writers that take one) whose files :meth:`publish` moves out."""

    def __init__(self, path: Path, fd: int, folder: int, option: str) -> None:
        self.path, self._fd, self._folder, self._option = path, fd, folder, option

    def publish(self, names: Iterable[str], *, force: bool = False) -> None:
        """Move the staged files ``names`` beside it, as :func:`write_output` puts its file: ``force`` replaces
        what is there (a link itself), else a name that exists is refused (InvalidArgumentError)."""
        with _refusing(self._folder, self.path.parent, self._option):
            for name in names:
                _put(self._fd, name, self._folder, name, replace=force)
        os.fsync(self._folder)


@contextlib.contextmanager
def staging(path: str | os.PathLike[str], *, base: str | os.PathLike[str] | None = None,
            option: str = "output") -> Iterator[Staging]:
    """A :class:`Staging` directory ``.<name>.<host>-<pid>-<random>.partial`` (mode 0700) beside ``path``
    (reached as :func:`write_output` reaches it), deleted when the block ends."""
    path = Path(path)
    with _opened(path.parent, base, create=base is not None, option=option) as folder:
        _remove_stale(folder, path, "partial")
        name = _temp_name(path.name, "partial")
        os.mkdir(name, 0o700, dir_fd=folder)
        try:
            stage = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=folder)
            try:
                yield Staging(path.parent / name, stage, folder, option)
            finally:
                os.close(stage)
        finally:
            shutil.rmtree(path.parent / name, ignore_errors=True)


#: Errors of writing a file that code inside ``atomic_output``'s block can meet (other errors there,
#: e.g. a download's connection reset, are about something else and keep their message).
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def _naming(error: OSError, path: Path, tmp: str | Path, *, always: bool = False) -> OSError:
    """``error`` naming the destination ``path`` (not the temporary file), with the same ``errno`` (so the
    same ``OSError`` subclass). Unchanged when it names another file already, is not a plain ``OSError``
    (a ConvnetsError has its own message), or does not come from writing (``always``: it comes from this
    module's own file operations)."""
    code = error.errno
    names_other = error.filename is not None and os.fspath(error.filename) not in (os.fspath(tmp), str(path))
    if code is None or type(error).__module__ != "builtins" or names_other or not (always or code in _WRITE_ERRNOS):
        return error
    return OSError(code, error.strerror or os.strerror(code), str(path))


def naming(error: OSError, path: str | os.PathLike[str]) -> OSError:
    """``error``, raised by writing to the open file ``path``, naming ``path`` if it names no file: a write
    raises ``[Errno 28] No space left on device`` unnamed; this gives ``...: 'PATH'`` (same type and
    ``errno``) for the errors of writing (no space, quota, file too large, I/O, read-only file system)."""
    return _naming(error, Path(path), Path(path))
