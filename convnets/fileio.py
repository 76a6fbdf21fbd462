"""Crash-safe file writes, the checks before a command writes, and an inter-process lock.

:func:`atomic_write` / :func:`atomic_output`: readers (and a restart after a crash) see the old file
or the new one, never a partial one. The new content goes to a temporary file beside the
destination, is flushed to disk and renamed over it (``os.replace``), so a reader that has the old
file open or memory-mapped (``torch.load(mmap=True)``) keeps reading the old bytes: the rename
gives the path a new inode and leaves the old one alone.

Written files get the permissions ``open()`` would give a new file (``0o666`` minus the umask:
0644 under umask 022, 0600 under 077), also when they replace a file that had other permissions.

Temporary files are named ``.<name>.<host>-<pid>-<random>.tmp``. One is left behind only when the
writing process is killed (SIGKILL, power loss) mid-write; the next write to the same path removes
such leftovers of dead processes of the same host (POSIX only; a live writer's file is never touched).
:func:`partial_dir` makes temporary directories named the same way (``.partial``), for writers that
write several files or whose runtime writes them, with the same clean-up.

What a command writes goes through :func:`write_new` (or :func:`check_destination` + :func:`place`
for files made elsewhere): it never follows a symbolic link it did not create (none at the file, none
among the directories below the one the user named, :func:`make_dirs`), and never replaces a file
that exists unless asked to (``force``; ``--force`` on the command line).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["LockHeldError", "atomic_output", "atomic_write", "check_destination", "directory_problem", "disk_full",
           "exclusive_lock", "file_kind", "make_dirs", "naming", "partial_dir", "pid_alive", "place", "write_new"]

log = logging.getLogger(__name__)

_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path, suffix: str = "tmp") -> Path:
    """A new temporary name beside ``path`` that :func:`_remove_stale_temps` recognises."""
    return path.with_name(f".{path.name}.{_HOST}-{os.getpid()}-{secrets.token_hex(4)}.{suffix}")


def _temp_pattern(path: Path, suffix: str = "tmp") -> re.Pattern[str]:
    return re.compile(rf"^\.{re.escape(path.name)}\.([0-9a-f]{{8}})-(\d+)-[0-9a-f]+\.{suffix}$")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (POSIX only: on Windows ``os.kill`` would end it)."""
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:
        return True  # e.g. EPERM: someone else's live process
    return True


def _remove_stale_temps(path: Path, suffix: str = "tmp") -> None:
    """Delete temporary files (``suffix="partial"``: directories of this user's) that killed writers of
    ``path`` left behind (same host, dead pid)."""
    if os.name != "posix":  # os.kill(pid, 0) would terminate the process on Windows
        return
    pattern = _temp_pattern(path, suffix)
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        m = pattern.match(name)
        # Another host's writer may be alive on a shared file system: only our host's pids can be checked.
        if m and m.group(1) == _HOST and not pid_alive(int(m.group(2))):
            with contextlib.suppress(OSError):
                leftover = path.parent / name
                st = os.lstat(leftover)
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
                    import shutil  # only for a killed writer's directory

                    shutil.rmtree(leftover)  # never follows a link inside
                elif not stat.S_ISDIR(st.st_mode):
                    leftover.unlink()
                log.info("removed %s, left by a writer of %s that was killed", name, path)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike[str], *, exclusive: bool = False) -> Iterator[BinaryIO]:
    """Open a temporary file that replaces ``path`` when the ``with`` block ends without error.

    The file object's ``name`` is the temporary file's path (to read back what was written before it
    is committed, e.g. to validate a download). On an exception ``path`` is left as it was.

    Args:
        path: the destination; its directory must exist.
        exclusive: put the file in place only if ``path`` does not exist then (a hard link, never a
            replace): a file someone else created there meanwhile is left alone.

    Yields:
        The temporary file, open for binary writing.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists (the new content is discarded).
        OSError: the file cannot be written (no space left, read-only file system, no permission...).
            The error keeps its type and ``errno`` and names ``path``, also when the write that
            failed was to the temporary file: ``[Errno 28] No space left on device: 'PATH'``.
    """
    path = Path(path)
    _remove_stale_temps(path)
    tmp = _temp_name(path)
    try:
        # "x" is O_CREAT | O_EXCL with mode 0o666: the umask applies, as for any new file
        # (tempfile.mkstemp would force 0600 and make checkpoints unreadable to other users).
        try:
            f = open(tmp, "xb")
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
            # Closing flushes what could not be written again (a full disk) and would fail again,
            # unnamed, in place of the error on its way.
            with contextlib.suppress(OSError):
                f.close()
            raise
        f.close()  # flushed above: nothing left to write
        try:
            if exclusive:
                _link_new(tmp, path)
            else:
                os.replace(tmp, path)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "it exists (created meanwhile by someone else); not replaced",
                                  str(path)) from None
        except OSError as e:
            raise _naming(e, path, tmp, always=True) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _link_new(tmp: Path, path: Path) -> None:
    """Give the complete file ``tmp`` the name ``path`` unless ``path`` exists (then FileExistsError)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        # A file system without hard links: claim the name first (O_EXCL), then replace the claim.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600))
        try:
            os.replace(tmp, path)
        except OSError:
            path.unlink(missing_ok=True)  # the empty claim is ours
            raise
    else:
        tmp.unlink()


#: Errors of writing a file that code inside ``atomic_output``'s block can meet (other errors there,
#: e.g. a download's connection reset, are about something else and keep their message).
_WRITE_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EIO", "EROFS")
                          if hasattr(errno, name))  # Windows has no EDQUOT
_FULL_ERRNOS = frozenset(getattr(errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(errno, name))


def _naming(error: OSError, path: Path, tmp: Path, *, always: bool = False) -> OSError:
    """``error`` naming the destination ``path`` (not the temporary file), with the same ``errno`` (so
    the same ``OSError`` subclass). Unchanged when it names another file already, is not a plain
    ``OSError`` (a ConvnetsError has its own message), or does not come from writing (``always``: it
    comes from this module's own file operations)."""
    code = error.errno
    names_other = error.filename is not None and os.fspath(error.filename) != os.fspath(tmp)
    if code is None or type(error).__module__ != "builtins" or names_other or not (always or code in _WRITE_ERRNOS):
        return error
    return OSError(code, error.strerror or os.strerror(code), str(path))


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words for a message that refuses it as not a regular
    file: ``"a FIFO (named pipe)"``, ``"a character device"``, ...; ``"a regular file"`` for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def naming(error: OSError, path: str | os.PathLike[str]) -> OSError:
    """``error``, raised by writing to the open file ``path``, naming ``path`` if it names no file.

    A write or flush to an open file raises ``[Errno 28] No space left on device`` without a name;
    this gives ``[Errno 28] No space left on device: 'PATH'`` (same type and ``errno``) for the
    errors of writing (no space, over quota, file too large, I/O error, read-only file system);
    others are returned unchanged.
    """
    return _naming(error, Path(path), Path(path))


#: Free bytes below which a failed write is put down to a full file system (:func:`disk_full`).
_NEARLY_FULL = 1 << 20


def disk_full(error: BaseException, directory: str | os.PathLike[str]) -> bool:
    """Whether ``error``, raised while writing into ``directory``, comes from a full file system.

    Runtimes that write files themselves (OpenVINO's ``save_model``: ``RuntimeError: basic_ios::clear:
    iostream error``) lose the ``errno``; so besides ``ENOSPC`` / ``EDQUOT`` in the error or its
    causes, a file system with less than 1 MiB left for unprivileged users counts as full.
    """
    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            break
        if getattr(seen, "errno", None) in _FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        info = os.statvfs(directory)
    except (OSError, AttributeError):  # no statvfs on Windows
        return False
    return info.f_bavail * info.f_frsize < _NEARLY_FULL


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, exclusive: bool = False) -> None:
    """Write ``path`` through ``write(file)`` without ever exposing a partial file.

    Args:
        path: the destination; its directory must exist.
        write: called once with a binary file open for writing.
        exclusive: never replace an existing ``path`` (see :func:`atomic_output`).

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
        OSError: the file cannot be written; it names ``path`` (see :func:`atomic_output`).
    """
    with atomic_output(path, exclusive=exclusive) as f:
        write(f)


_A_LINK = "is a symbolic link (convnets writes nothing through a link it did not make)"


def _below(path: Path, base: Path) -> list[Path]:
    """The directories strictly below ``base`` down to ``path``, outermost first."""
    return [p for p in (*reversed(path.parents), path) if base in p.parents]


def _link_in_the_way(path: Path, base: Path | None) -> Path | None:
    """The first symbolic link among the directories strictly below ``base`` down to ``path``'s parent."""
    return None if base is None else next((d for d in _below(path.parent, base) if os.path.islink(d)), None)


def check_destination(path: str | os.PathLike[str], *, force: bool = False, base: str | os.PathLike[str] | None = None,
                      option: str = "output") -> Path:
    """That ``path`` may be written: no symbolic link stands in its way, and it does not exist unless ``force``.

    Links in the directory the user named (``base``, else ``path``'s parent) are the user's own;
    below it, a link among the directories or at ``path`` is never written through (one at ``path``
    counts as a file that exists: ``force`` replaces the link itself, not what it points to).

    Args:
        path: the file to write.
        force: replace a file that exists.
        base: the directory the user named, above ``path``.
        option: the command-line option that named it, for the message (``output``: ``--output``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        InvalidArgumentError: it exists (and not ``force``), or a link is in the way; the message
            names it and what to do (``force=True`` / ``--force``).
    """
    path = Path(path)
    link = _link_in_the_way(path, None if base is None else Path(base))
    if link is not None:
        raise _refused(f"{link} {_A_LINK}", option)
    if not force and os.path.lexists(path):
        raise _refused(f"{path} exists ({'a symbolic link' if os.path.islink(path) else 'a file'})", option,
                       force=True)
    return path


def _refused(problem: str, option: str, *, force: bool = False) -> Exception:
    """The error of a destination refused for ``problem``: what to do, in Python's words and the command line's."""
    from convnets.errors import InvalidArgumentError

    if force:
        advice = (f"pass force=True to replace it, or choose another {option}",
                  f"pass --force to replace it, or choose another --{option}")
    else:
        advice = (f"remove it or choose another {option}", f"remove it or choose another --{option}")
    return InvalidArgumentError(f"{problem}: {advice[0]}", keyword="force" if force else None,
                                cli=f"--{option}: {problem}: {advice[1]}")


def make_dirs(directory: str | os.PathLike[str], *, base: str | os.PathLike[str], option: str = "output") -> Path:
    """Create ``directory`` and its missing parents up to ``base`` (the directory the user named, created
    too if missing), none of them through a symbolic link below ``base``.

    Raises:
        InvalidArgumentError: a link, or a file, is in the way (the message names it).
        OSError: a directory cannot be created.
    """
    directory, base = Path(directory), Path(base)
    base.mkdir(parents=True, exist_ok=True)
    for part in _below(directory, base):
        with contextlib.suppress(FileExistsError):
            part.mkdir()
        if os.path.islink(part) or not part.is_dir():
            raise _refused(f"{part} {_A_LINK if os.path.islink(part) else 'is not a directory'}", option)
    return directory


def write_new(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, force: bool = False,
              base: str | os.PathLike[str] | None = None, option: str = "output") -> Path:
    """Write ``path`` atomically through ``write(file)`` (:func:`atomic_write`), after :func:`check_destination`;
    without ``force`` a file that someone creates there meanwhile is left alone too (and refused).

    Returns:
        ``path``.

    Raises:
        InvalidArgumentError: as :func:`check_destination` (also for a file created meanwhile).
        OSError: it cannot be written (it names ``path``).
    """
    path = check_destination(path, force=force, base=base, option=option)
    try:
        atomic_write(path, write, exclusive=not force)
    except FileExistsError:
        check_destination(path, force=False, base=base, option=option)  # raises: it exists now
        raise
    return path


def place(complete: str | os.PathLike[str], path: str | os.PathLike[str], *, force: bool = False) -> None:
    """Give the complete file ``complete`` (in the same directory, or one on the same file system) the name
    ``path``: ``force`` replaces what is there (a link itself, never its target), else a file that
    exists is left alone (FileExistsError). Check first with :func:`check_destination`."""
    if force:
        os.replace(complete, path)
    else:
        _link_new(Path(complete), Path(path))


@contextlib.contextmanager
def partial_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A private temporary directory beside ``path`` for its writer, deleted when the block ends.

    Named ``.<name>.<host>-<pid>-<random>.partial``: one that a killed writer left is removed by the
    next writer of ``path`` (this host, a dead pid, a directory of this user's), not tripped over.
    """
    import shutil

    path = Path(path)
    _remove_stale_temps(path, "partial")
    tmp = _temp_name(path, "partial")
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def directory_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why no file can be created in ``folder``, in words for a message; ``None``: one can.

    A real write (a temporary file, gone when closed): ``os.access`` cannot see read-only file
    systems, and root passes every access check.

    Returns:
        ``"the directory 'F' does not exist; ..."``, ``"'F' is not a directory; ..."`` or
        ``"cannot write in 'F' (Permission denied); ..."``, each with what to do; or ``None``.
    """
    import tempfile  # only when a destination is checked

    name = repr(os.fspath(folder))
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            return f"{name} is not a directory; choose a directory"
        return f"the directory {name} does not exist; create it or choose another one"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot write in {name} ({e.strerror or e}); choose a writable directory"
    return None


class LockHeldError(TimeoutError):
    """Another process holds the lock (a :class:`TimeoutError`, as a wait that ran out raises).

    Attributes:
        path: the lock file.
        holder: who holds it, as its holder wrote it into the file (``"PID 123 on host h"``), or
            ``""`` when that cannot be read.
    """

    def __init__(self, message: str, *, path: Path, holder: str) -> None:
        super().__init__(message)
        self.path, self.holder = path, holder


def _holder(path: Path) -> str:
    """Who holds the lock file ``path``, as its holder wrote it (``""``: unknown)."""
    for _ in range(10):  # a holder that has just locked the file writes its name a moment later
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            return ""
        try:
            text = os.read(fd, 512).decode("utf-8", "replace") if stat.S_ISREG(os.fstat(fd).st_mode) else ""
        finally:
            os.close(fd)
        pid, _, host = text.strip().partition(" ")
        if pid.isdigit():
            return f"PID {pid} on host {host or '?'}"
        time.sleep(0.02)
    return ""


def _busy(path: Path, waited: float) -> LockHeldError:
    holder = _holder(path)
    who = holder or "another process"
    message = f"waited {waited:.0f} s for {who} holding the lock {path}" if waited > 0 else f"{who} holds the lock {path}"
    return LockHeldError(message, path=path, holder=holder)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike[str], timeout: float, poll_s: float = 0.05) -> Iterator[None]:
    """Hold an inter-process lock on ``path`` (created if needed) and delete that file on release.

    ``filelock.FileLock``: an ``flock`` on Unix, never through a symbolic link (``O_NOFOLLOW``), that
    a forked child (a DataLoader's decoding worker) does not keep holding. The holder writes
    ``"PID HOST"`` into the file, which :class:`LockHeldError` reports to the others, and deletes it
    *before* unlocking, while ``path`` still names the file it locked: a waiter that then locks the
    deleted inode sees it has no name left and starts over on the path (filelock checks that, and
    tests/test_fileio.py's race test pins it), so nothing stays on disk once no one holds the lock
    (after a kill, an empty or stale file stays until the next holder deletes it). filelock itself
    keeps its file; deleting it without that check breaks mutual exclusion (tox-dev/filelock#574).

    Args:
        path: the lock file.
        timeout: seconds to wait for another holder; ``0``: try once (fail at once if held).
        poll_s: interval between attempts while another process holds the lock.

    Raises:
        LockHeldError: another process held the lock for ``timeout`` seconds (a ``TimeoutError``).
        OSError: the file system cannot lock files (its ``errno`` says why), or ``path`` is a symbolic
            link or not a regular file, or cannot be created.
    """
    import filelock

    path = Path(path)
    existed = os.path.lexists(path)
    with contextlib.suppress(FileNotFoundError):  # clearer than open()'s ELOOP, and no FIFO is ever opened
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, not a lock file; remove it")
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file, so not a lock file; remove it")
    held: list[int] = []
    lock = filelock.FileLock(path, timeout=timeout, poll_interval=poll_s, fallback_to_soft=False,
                             on_acquired=held.append)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise _busy(path, timeout) from None
    except OSError:
        if not existed:  # e.g. a file system that cannot lock: no one holds the file this call made
            path.unlink(missing_ok=True)
        raise
    locked = os.fstat(held[0])
    try:
        with contextlib.suppress(OSError):  # who holds it, for the others' messages
            os.lseek(held[0], 0, os.SEEK_SET)
            os.write(held[0], f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        try:  # delete while still holding it (see above), only the file this process locked (Windows: cannot)
            with contextlib.suppress(OSError):
                if os.path.samestat(os.lstat(path), locked):
                    path.unlink()
        finally:
            lock.release()
