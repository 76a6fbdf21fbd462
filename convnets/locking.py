"""An inter-process lock whose file its holder deletes (:func:`exclusive_lock`), who holds it, whether a process lives."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from convnets.stopping import keep_signals_out_of_fork_hooks

__all__ = ["LockHeldError", "exclusive_lock", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: someone else's live process
        pass
    return True


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


@functools.cache
def _filelock() -> ModuleType:
    """filelock, imported on first use; its at-fork hooks, run in Python, kept out of signals' reach (see
    :func:`convnets.stopping.keep_signals_out_of_fork_hooks`)."""
    import filelock

    keep_signals_out_of_fork_hooks()
    return filelock


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
    filelock = _filelock()
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
