"""``python -m convnets ARGS`` (or another module, or ``python -c``) as a real process, without a PyTorch import per run.

Importing torch and torchvision takes about 4.5 CPU-seconds here, most of what a small CLI run
costs, and the suite starts about a hundred such runs. A *zygote* (one per test worker and per
start-up environment) imports the two once and then only forks: each run is a child process of
the zygote that sets its standard streams, working directory, environment and arguments, runs
``convnets/__main__.py`` as ``python -m`` does, and exits through the interpreter's normal
shutdown (atexit handlers, stream flushes). Its exit status comes back through the zygote.

Why the suite keeps this (measured 2026-11-28 on the 2-core CI-sized machine, a tiny ``convnets benchmark``
run, three of each): forked 2.1 s wall per run, a fresh ``python -m convnets`` 6.1-8.2 s wall and 2.9-3.2
CPU-s more. The suite starts about a hundred such runs (``run_cli``, ``start_cli``, ``run_train``), so fresh
interpreters would add some 450 CPU-s, about 225 s of wall time on the two xdist workers, to tests that take
about 500 s of their 600 s budget: without the zygote the suite does not fit.

What differs from a fresh interpreter is only what the zygote did before the fork: imported
torch and torchvision (nothing run), under the environment variables that are read at start-up or
import (``PYTHON*``, thread counts, ``PYTORCH_*``...): runs whose values differ get their own zygote.
Tests of what start-up imports, of the console script and of an installed wheel keep fresh
interpreters (``conftest.run_cli(..., fresh=True)``, ``subprocess``).

:func:`torchrun` runs the real launcher (``python -m torch.distributed.run``) the same way, and it
starts each rank through ``PYTHON_EXEC`` (torchrun's own setting for the interpreter of its
ranks): a small stdlib-only program (:func:`python_exec_main`) that has the rank forked from the
same zygote with the environment, streams and arguments torchrun gave it, passes on the signals
torchrun sends, and exits as the rank did.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

#: Environment variables read when an interpreter starts or when torch / torchvision / OpenMP load
#: (not TORCH_HOME and the like, which torch reads when it needs them; nor PYTHON_EXEC, which only
#: torchrun reads).
STARTUP_ENV = re.compile(r"^(PYTHON(?!_EXEC$)|OMP_|GOMP_|KMP_|MKL_|OPENBLAS_|PYTORCH_|CUDA_VISIBLE_DEVICES|LD_|MALLOC_|LC_|LANG)")
#: Zygotes kept per test worker.
MAX_ZYGOTES = 3

#: The zygote: imports, then forks one child per request (argv, env, cwd, session; three fds).
ZYGOTE = r"""
import gc, json, os, select, signal, socket, sys
import torch, torchvision  # what each run would import first: once, here
gc.freeze()  # what was imported stays out of the children's collections (their exit takes 0.6 s, not 1.5 s)
listener = socket.socket(fileno=int(sys.argv[1]))
worker = int(sys.argv[2])  # a pipe the test worker holds open: at its end (EOF) the zygote ends too
exited_r, exited_w = os.pipe()  # SIGCHLD wakes the loop up: no polling while idle
os.set_blocking(exited_w, False)
signal.set_wakeup_fd(exited_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
waiting = {}  # child pid -> the connection its status goes back on


def serve():
    while True:
        ready = select.select([listener, worker, exited_r], [], [])[0]
        if worker in ready:
            sys.exit(0)
        if exited_r in ready:
            os.read(exited_r, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (listener.detach(), worker, exited_r, exited_w, conn.detach(),
                           *(other.detach() for other in waiting.values())):
                    os.close(fd)
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


request, fds = serve()
# The child: the run's process from here on, set up as `python -m MODULE ARGS` (or `python -c CODE
# ARGS`) would be.
if request["new_session"]:
    os.setsid()
for target, fd in enumerate(fds):
    os.dup2(fd, target)
    os.close(fd)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.path[0] = os.getcwd() if request["code"] is None else ""  # -m puts the working directory first, -c ""
sys.argv = request["argv"]
if request["extra_as"] is not None:  # as a preexec_fn's setrlimit would, before the run
    import resource
    with open("/proc/self/status") as status:  # what this process maps already: PyTorch, its CUDA libraries
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + request["extra_as"], mapped + request["extra_as"]))
import runpy, types
module, code = request["module"], request["code"]
del json, select, socket, listener, waiting, serve, request, fds, worker, exited_r, exited_w
if code is None:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
else:
    sys.modules["__main__"] = main = types.ModuleType("__main__")
    exec(compile(code, "<string>", "exec"), main.__dict__)
"""


def _key(env: dict[str, str]) -> list[tuple[str, str]]:
    """What of ``env`` a zygote was started with: runs whose keys differ need different zygotes."""
    return sorted((k, v) for k, v in env.items() if STARTUP_ENV.match(k))


#: torchrun's PYTHON_EXEC in a zygote's folder: this interpreter without site (nothing to import but
#: the standard library), running :func:`python_exec_main`.
PYTHON_EXEC = """#!{executable} -S
import sys
sys.path.insert(0, {tests!r})
import forked_cli
sys.exit(forked_cli.python_exec_main(sys.argv[1:]))
"""


class _Zygote:
    """A started zygote: its process, the socket path runs are requested on, and its key."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="convnets-zygote-")
        self.path = os.path.join(self.dir, "socket")
        with open(os.path.join(self.dir, "key.json"), "w", encoding="utf-8") as f:
            json.dump(_key(env), f)
        self.python_exec = os.path.join(self.dir, "python")
        with open(self.python_exec, "w", encoding="utf-8") as f:
            f.write(PYTHON_EXEC.format(executable=sys.executable, tests=os.path.dirname(os.path.abspath(__file__))))
        os.chmod(self.python_exec, 0o755)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(64)
        alive_r, self._alive = os.pipe()  # ours stays open as long as this process lives
        self.process = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(listener.fileno()), str(alive_r)],
                                        pass_fds=[listener.fileno(), alive_r], env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        listener.close()
        os.close(alive_r)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        os.close(self._alive)
        shutil.rmtree(self.dir)


_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_lock = threading.Lock()


def _zygote_for(env: dict[str, str]) -> _Zygote:
    key = tuple(_key(env))
    with _lock:
        if key in _zygotes and _zygotes[key].process.poll() is not None:
            _zygotes.pop(key).stop()
        if key not in _zygotes:
            while len(_zygotes) >= MAX_ZYGOTES:  # each holds ~400 MB: the least recently used goes
                _zygotes.pop(next(iter(_zygotes))).stop()
            _zygotes[key] = _Zygote(env)
        _zygotes[key] = _zygotes.pop(key)  # the most recently used last
        return _zygotes[key]


@atexit.register
def _stop_all() -> None:
    for zygote in _zygotes.values():
        zygote.stop()
    _zygotes.clear()


def _pipe_end(spec: Any, for_reading_in_child: bool) -> tuple[int, IO[bytes] | None]:
    """The child's end of a stream spec (PIPE, DEVNULL, None, a file object or fd) and our end of a pipe."""
    if spec == subprocess.PIPE:
        read, write = os.pipe()
        if for_reading_in_child:
            return read, os.fdopen(write, "wb")
        return write, os.fdopen(read, "rb")
    if spec is None or spec == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_RDONLY if for_reading_in_child else os.O_WRONLY), None
    return os.dup(spec if isinstance(spec, int) else spec.fileno()), None


class CliProcess:
    """A run of ``python -m convnets ARGS`` forked from a zygote, used as :class:`subprocess.Popen`.

    ``stdin`` / ``stdout`` / ``stderr``: ``subprocess.PIPE``, ``subprocess.DEVNULL`` or ``None`` (both
    mean /dev/null: a test worker's own streams are not a terminal), or an open file. ``env`` (default:
    this process's) and ``cwd`` are the run's; ``start_new_session`` as for Popen; ``extra_as``: the
    address space (bytes) the run may map beyond what its process maps when it starts, set as an RLIMIT_AS
    before the run, as a ``preexec_fn`` would (relative, because what ``import torch`` maps differs between
    machines and builds: 3.26 GB here, most of it CUDA libraries that are mapped, not used); ``code``:
    run ``python -c CODE ARGS`` instead of ``-m MODULE``; ``zygote``: the socket of the zygote to
    fork from (default: this process's for ``env``).
    """

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str],
                 stdin: Any = None, stdout: Any = None, stderr: Any = None, start_new_session: bool = False,
                 module: str = "convnets", code: str | None = None, extra_as: int | None = None,
                 zygote: str | None = None) -> None:
        self.args = [sys.executable, *(["-m", module] if code is None else ["-c", code]), *args]
        env = dict(os.environ if env is None else env)
        ends = [_pipe_end(stdin, True), _pipe_end(stdout, False), _pipe_end(stderr, False)]
        self.stdin, self.stdout, self.stderr = (ours for _, ours in ends)
        request = {"argv": [module if code is None else "-c", *args], "env": env, "cwd": os.fspath(cwd),
                   "new_session": start_new_session, "module": module, "code": code,
                   "extra_as": extra_as}  # runpy sets argv[0] to the module's file
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(zygote or _zygote_for(env).path)
        try:
            socket.send_fds(self._conn, [json.dumps(request).encode()], [theirs for theirs, _ in ends])
        finally:
            for theirs, _ in ends:
                os.close(theirs)
        self._buffer = b""
        self.pid: int = json.loads(self._line(None))["pid"]
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> bytes | None:
        """The zygote's next line about this run; ``None`` if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            assert chunk, "the zygote went away"
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self._finish(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._finish(line)
        assert self.returncode is not None
        return self.returncode

    def _finish(self, line: bytes) -> None:
        self.returncode = json.loads(line)["status"]
        self._conn.close()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: bytes | None = None, timeout: float | None = None) -> tuple[bytes | None, bytes | None]:
        """Write ``input`` and close stdin, read stdout and stderr to their end, wait: as Popen's."""
        read: dict[str, bytes] = {}

        def drain(name: str, stream: IO[bytes]) -> None:
            read[name] = stream.read()
            stream.close()
        readers = [threading.Thread(target=drain, args=(name, stream), daemon=True)
                   for name, stream in (("out", self.stdout), ("err", self.stderr)) if stream is not None]
        for reader in readers:
            reader.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return read.get("out"), read.get("err")  # None for a stream that is not a pipe


def run(args: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str], timeout: float,
        input: bytes | None = None, module: str = "convnets", code: str | None = None,
        extra_as: int | None = None) -> subprocess.CompletedProcess[str]:
    """Run to the end, as ``subprocess.run(..., capture_output=True, text=True, timeout=...)``; on a
    timeout the run is killed and :class:`subprocess.TimeoutExpired` raised."""
    proc = CliProcess(args, env=env, cwd=cwd, stdin=subprocess.PIPE if input is not None else None,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, module=module, code=code,
                      extra_as=extra_as)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, text(out), text(err))  # type: ignore[arg-type]


def text(data: bytes | None) -> str:
    """Bytes read from a run as ``text=True`` gives them: the locale's encoding, universal newlines."""
    return (data or b"").decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def torchrun_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for ``python -m torch.distributed.run`` forked from a zygote (``module=`` of
    :class:`CliProcess` and :func:`run`) whose ranks are forked from the same zygote."""
    env = {**env, "PYTHONUNBUFFERED": "1"}  # what torchrun's `python -u` asks of each rank, set from the start
    zygote = _zygote_for(env)
    return {**env, "PYTHON_EXEC": zygote.python_exec, "FORKED_CLI_ZYGOTE": zygote.path}


def torchrun(args: list[str], *, env: dict[str, str], cwd: str | os.PathLike[str],
             timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run ARGS`` (see :func:`torchrun_env`), as :func:`run` returns it."""
    return run(args, env=torchrun_env(env), cwd=cwd, timeout=timeout, module="torch.distributed.run")


def python_exec_main(argv: list[str]) -> int:
    """torchrun's ``PYTHON_EXEC -u -m MODULE ARGS``: the rank forked from the zygote that
    :func:`torchrun` named, with this process's environment (less the two variables
    :func:`torchrun` added), working directory and streams. A signal that reaches this process
    (torchrun stops its ranks with SIGTERM to their process group) goes on to the rank, and this
    process ends as the rank did. Anything else, or an environment the zygote was not started
    with, runs the interpreter itself."""
    env = dict(os.environ)
    zygote = env.pop("FORKED_CLI_ZYGOTE", None)
    env.pop("PYTHON_EXEC", None)
    started_with = None
    if zygote is not None:
        with open(os.path.join(os.path.dirname(zygote), "key.json"), encoding="utf-8") as f:
            started_with = [tuple(item) for item in json.load(f)]
    if argv[:2] != ["-u", "-m"] or len(argv) < 3 or started_with != _key(env):
        os.execv(sys.executable, [sys.executable, *argv])
    rank = CliProcess(argv[3:], env=env, cwd=os.getcwd(), stdin=0, stdout=1, stderr=2, module=argv[2],
                      zygote=zygote)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: rank.send_signal(signum))
    status = rank.wait()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return status
