"""Crash-safe writes (old file or new file, never a mix), permissions that follow the umask, and
an inter-process lock that leaves no file behind without losing mutual exclusion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO

from convnets.fileio import atomic_output, atomic_write
from convnets.locking import exclusive_lock

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions, signals and flock")


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(umask: int, mode: int, tmp_path: Path) -> None:
    """As open() would: checkpoints and digest records must be readable by the Triton user or a colleague."""
    path = tmp_path / "checkpoint.pth.tar"
    path.write_bytes(b"old")
    path.chmod(0o600)  # e.g. written by an earlier version: the rewrite gets the umask's mode
    old = os.umask(umask)
    try:
        atomic_write(path, lambda f: f.write(b"new"))
        with open(tmp_path / "reference", "wb"):
            pass
    finally:
        os.umask(old)
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == mode == (tmp_path / "reference").stat().st_mode & 0o777


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"old content\n")

    def write(f) -> None:
        f.write(b"half of the new")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(path, write)
    assert path.read_bytes() == b"old content\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from convnets.fileio import atomic_write
def write(f):
    f.write(b"new" * 100000)
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
atomic_write(Path(sys.argv[1]), write)
"""


def test_write_killed_midway_leaves_the_old_file_and_the_next_write_cleans_up(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pth.tar"
    path.write_bytes(b"old checkpoint")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert path.read_bytes() == b"old checkpoint"
    stray = _temps(tmp_path)
    # Documented: a killed writer leaves its temporary file, named after the destination and the pid.
    assert len(stray) == 1 and stray[0].startswith(".checkpoint.pth.tar.") and f"-{proc.pid}-" in stray[0]
    atomic_write(path, lambda f: f.write(b"next"))
    assert path.read_bytes() == b"next"
    assert _temps(tmp_path) == []


def test_temporary_files_of_live_writers_are_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    with atomic_output(path) as f:  # a write in flight (this process is alive) ...
        f.write(b"first")
        atomic_write(path, lambda g: g.write(b"second"))  # ... survives another write's cleanup
        assert len(_temps(tmp_path)) == 1
    assert path.read_bytes() == b"first" and _temps(tmp_path) == []


_MMAP_READER = """
import sys, torch
from pathlib import Path
from convnets.fileio import atomic_write
path = Path(sys.argv[1])
old = torch.load(path, mmap=True, weights_only=True)           # tensors point into the file mapping
atomic_write(path, lambda f: torch.save({"w": torch.full((256, 1024), 2.0)}, f))
assert torch.equal(old["w"], torch.full((256, 1024), 1.0)), "the mapped tensors changed"
assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((256, 1024), 2.0))
print("ok")
"""


def test_reader_that_mmaps_the_old_checkpoint_survives_a_rewrite(tmp_path: Path) -> None:
    """Rewriting in place would change the mapped tensors under the reader, or kill it with SIGBUS."""
    import torch

    path = tmp_path / "checkpoint.pth.tar"
    torch.save({"w": torch.full((256, 1024), 1.0)}, path)
    result = subprocess.run([sys.executable, "-c", _MMAP_READER, str(path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.returncode, result.stderr[-2000:])


def test_lock_file_is_deleted_on_release_and_on_error(tmp_path: Path) -> None:
    lock = tmp_path / "w.pth.lock"
    with exclusive_lock(lock, timeout=5):
        assert lock.exists()
    assert not lock.exists()
    with pytest.raises(KeyError), exclusive_lock(lock, timeout=5):
        raise KeyError("boom")
    assert list(tmp_path.iterdir()) == []


def test_lock_times_out_while_another_holder_has_it(tmp_path: Path) -> None:
    lock = tmp_path / "w.pth.lock"
    with exclusive_lock(lock, timeout=5):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="w.pth.lock"), exclusive_lock(lock, timeout=0.3):
            pass
        assert time.monotonic() - start < 30  # without the timeout: for ever


def test_deleting_the_lock_file_keeps_mutual_exclusion(tmp_path: Path) -> None:
    """The race that makes filelock keep its files: a waiter holding the deleted inode must not run
    together with a newcomer that locked the new file under the same name."""
    import fcntl

    lock = tmp_path / "w.pth.lock"
    # flock locks belong to open files, so descriptors in one process act as separate holders.
    fd_a = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd_a, fcntl.LOCK_EX)
    b_inside = threading.Event()

    def waiter_b() -> None:
        with exclusive_lock(lock, timeout=20, poll_s=0.01):  # opens A's inode and waits on it
            b_inside.set()

    thread = threading.Thread(target=waiter_b, daemon=True)
    thread.start()
    time.sleep(0.3)
    os.unlink(lock)  # A releases as exclusive_lock does: delete the file ...
    fd_c = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)  # ... C creates a new one and locks it ...
    fcntl.flock(fd_c, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd_a)  # ... then A unlocks the deleted inode, which B has been waiting on
    try:
        assert not b_inside.wait(0.5), "B entered on the deleted inode while C holds the lock file"
    finally:
        os.unlink(lock)
        os.close(fd_c)
    assert b_inside.wait(10)
    thread.join(10)
    assert not lock.exists()


_KILLED_HOLDER = r"""
import os, sys, time
from pathlib import Path
from convnets.locking import LockHeldError, exclusive_lock
lock = Path(sys.argv[1])
r, w = os.pipe()
holder = os.fork()
if holder == 0:  # a run holding its output's lock, with a forked decoding worker
    with exclusive_lock(lock, timeout=0):
        if os.fork() == 0:  # the worker says it is running (its at-fork handlers have run) ...
            os.write(w, b"x")
            time.sleep(5)  # ... and outlives its killed parent for a moment
            os._exit(0)
        time.sleep(60)
    os._exit(0)
os.read(r, 1)
os.kill(holder, 9)
os.waitpid(holder, 0)
try:
    with exclusive_lock(lock, timeout=0):
        print("acquired")
except LockHeldError as e:
    print("held:", e)
"""


def test_a_killed_holders_forked_child_does_not_keep_its_lock(tmp_path: Path) -> None:
    """`predict --workers 1` killed, then resumed at once: the DataLoader worker it forked, still
    alive for a moment, must not hold the killed run's lock (an flock belongs to the open file)."""
    done = subprocess.run([sys.executable, "-c", _KILLED_HOLDER, str(tmp_path / "out.jsonl.lock")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "acquired", done.stdout
