"""What is at a path, in words for a message: :func:`file_kind`, :func:`directory_problem`, :func:`disk_full`."""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["directory_problem", "disk_full", "file_kind"]

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NEARLY_FULL = 1 << 20  # free bytes below which a failed write is put down to a full file system
_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words for a message that refuses it as not a regular file:
    ``"a FIFO (named pipe)"``, ``"a character device"``, ...; ``"a regular file"`` for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def directory_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why no file can be created in ``folder``, in words for a message with what to do; ``None``: one can.
    A real write (a temporary file, gone when closed): ``os.access`` cannot see read-only file systems,
    and root passes every access check."""
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


def disk_full(error: BaseException, directory: str | os.PathLike[str]) -> bool:
    """Whether ``error``, raised while writing into ``directory``, comes from a full file system.

    Runtimes that write files themselves (OpenVINO's ``save_model``: ``RuntimeError: basic_ios::clear:
    iostream error``) lose the ``errno``; so besides ``ENOSPC`` / ``EDQUOT`` in the error or its causes,
    a file system with less than 1 MiB left for unprivileged users counts as full.
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
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < _NEARLY_FULL
