"""How a run of the ``convnets`` command stops on a signal (:mod:`convnets.cli`): SIGTERM as SIGINT (Ctrl-C) does,
with :class:`Terminated`, a :class:`KeyboardInterrupt`, raised in the main thread, never inside a fork's hooks;
after the interruption, a watchdog that ends a clean-up that hangs (:func:`end_by_force_after`); and a Ctrl-C
during the interpreter's exit that ends it quietly (:func:`interrupt_ends_the_exit`).
"""

from __future__ import annotations

import contextlib
import functools
import logging  # noqa: F401 (imported first: its at-fork hooks run before this module's, see _FORKING)
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["EXIT_INTERRUPTED", "EXIT_TERMINATED", "STOP_TIMEOUT_S", "Terminated", "end_by_force_after",
           "interrupt_ends_the_exit", "keep_signals_out_of_fork_hooks", "signals_as_interrupts"]

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a process that SIGINT ended
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread, as SIGINT raises :class:`KeyboardInterrupt`, so
    that a run stops the same way (code that handles an interrupt handles this too)."""


#: Non-empty while os.fork() runs its hooks (os.register_at_fork), from before logging's to after them: logging holds
#: its module lock in between. An exception that a signal raises in a hook is printed as "Exception ignored in
#: _releaseLock" and lost: the run went on as if SIGTERM had not come, or hung on the lock left held (seen in 1 of
#: 10 evaluate runs stopped as their decoding processes started). Appended and popped by builtins, registered after
#: logging's hooks (which this module imports first): no Python code of ours runs inside the window. Hooks
#: registered later are outside it: :func:`keep_signals_out_of_fork_hooks` opens it again around them (windows nest:
#: one entry each).
_FORKING: list[None] = []


def _after_fork_in_child() -> None:
    """A forked child (a decoding process) inherits the handlers, and a SIGTERM before its worker_init_fn sets its
    own (from PyTorch, stopping a process that had just started with the run) raised :class:`Terminated` there,
    with a traceback: it exits quietly instead, as :func:`convnets.runtime.init_worker` then makes it."""
    _FORKING.clear()
    if signal.getsignal(signal.SIGTERM) is _terminate:
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))


_WINDOW: dict[str, Callable[[], object]] = {"before": functools.partial(_FORKING.append, None),
                                            "after_in_parent": _FORKING.pop, "after_in_child": _after_fork_in_child}
os.register_at_fork(**_WINDOW)


def keep_signals_out_of_fork_hooks() -> None:
    """Open :data:`_FORKING`'s window again, around every at-fork hook registered so far. Call it once after
    importing a module that registers hooks in Python on its import, as filelock 4 does
    (:mod:`convnets.locking`): its ``_resume_parent_after_fork`` ran after the window had closed, and a SIGTERM
    handled there was lost as in logging's (a run stopped as its decoding processes started went on to the end)."""
    os.register_at_fork(**_WINDOW)


def _send_after_fork(signum: int) -> None:
    """Send ``signum`` to this process again once the fork under way is done, from a thread of its own."""
    def send() -> None:
        while _FORKING:
            time.sleep(0.001)
        os.kill(os.getpid(), signum)
    threading.Thread(target=send, name=f"convnets-signal-{signum}", daemon=True).start()


def _terminate(signum: int, frame: FrameType | None) -> None:
    if _FORKING:
        _send_after_fork(signum)
    else:
        raise Terminated(f"signal {signum}")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if _FORKING:
        _send_after_fork(signum)
    else:
        raise KeyboardInterrupt


@contextlib.contextmanager
def signals_as_interrupts() -> Iterator[None]:
    """Handle SIGTERM with :class:`Terminated` and SIGINT with :class:`KeyboardInterrupt` inside the block, as
    Python's own SIGINT handler does, except while a fork is under way (:data:`_FORKING`): then the signal comes
    again after it. A signal that something else (a host application, ``SIG_IGN``) already handles stays as it is;
    the previous handlers are restored at the end."""
    if threading.current_thread() is not threading.main_thread():  # signal() works in the main thread only
        yield
        return
    ours = {signal.SIGTERM: (signal.SIG_DFL, _terminate), signal.SIGINT: (signal.default_int_handler, _interrupt)}
    taken = {signum: signal.signal(signum, handler) for signum, (default, handler) in ours.items()
             if signal.getsignal(signum) == default}
    try:
        yield
    finally:
        for signum, previous in taken.items():
            signal.signal(signum, previous)


def interrupt_ends_the_exit() -> None:
    """From now to the process's end, SIGINT ends it with status 130 and no output: the run is over, its
    output flushed here, and what is left is the interpreter's shutdown, whose atexit callbacks (joining
    decoding processes, flushing logs) would print ``Exception ignored in atexit callback ...
    KeyboardInterrupt`` where a Ctrl-C lands. A SIGINT handler set by someone else (ignored under
    ``nohup``) stays."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader gone away: main has already handled it
            stream.flush()
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(EXIT_INTERRUPTED))


#: The longest a stopped run's clean-up may take (a DataLoader stopping its workers, the interpreter's exit).
STOP_TIMEOUT_S = 20.0


def end_by_force_after(seconds: float, line: str, status: int) -> Callable[[], None]:
    """If the process still runs ``seconds`` from now, kill its child processes, print ``line`` and exit with
    ``status``. The interruption landed wherever the run was, and once inside a lock that the clean-up then
    waited for (multiprocessing's queue of a DataLoader, stopping its workers: the run hung, seen in 1 of
    about 50 evaluate runs SIGTERMed as their workers started). Outputs and locks are released before this
    clean-up, as the exception went up.

    Returns:
        The function that prints ``line`` on stderr: once, by the caller or by the timer, whichever comes first.
    """
    saying, said = threading.Lock(), threading.Event()

    def say() -> None:
        if saying.acquire(blocking=False):
            try:
                print(line, file=sys.stderr, flush=True)
            finally:
                said.set()

    def end() -> None:
        processes = sys.modules.get("multiprocessing")  # not imported: no child of its to kill
        children = processes.active_children() if processes is not None else []
        for child in children:
            with contextlib.suppress(Exception):
                child.kill()
        # SIGKILL is delivered when the child is next scheduled: reap each, so that none outlives the run.
        deadline = time.monotonic() + 5.0
        for child in children:
            with contextlib.suppress(Exception):
                child.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(Exception):
            say()
        said.wait(1.0)  # the main thread may be printing it right now
        os._exit(status)
    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return say
