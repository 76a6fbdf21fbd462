"""Run the Triton Inference Server that the ``serve`` extra installs on a model repository.

``nvidia-pytriton`` ships a ``tritonserver`` binary (Triton 2.51 in PyTriton 0.7), Triton's Python
backend and its stub process built for each Python version. This module runs that binary itself,
rather than through PyTriton's ``Triton`` class: PyTriton's readiness wait does not notice a server
that exited (a model that failed to load costs its full 120 s timeout), its server log goes to
standard output, and a model bound with ``Triton.bind`` runs behind a proxy that fails every request
of a dynamically formed batch when one of them is bad. A Python-backend repository
(:mod:`convnets.serve.repository`, or ``convnets export --triton --triton-backend python``) answers
each request on its own.

Clients never reach Triton itself: :class:`TritonServer` runs it with HTTP, gRPC and metrics on
unix sockets of its own, in a new directory (mode 0700) that no other user can enter, so no other
user of the machine can send Triton anything either; it serves the endpoints asked for with the small
proxies of
:mod:`convnets.serve.front`, which refuse what would crash Triton or fill its memory (bodies above
``max_request_bytes``, form bodies, compressed bodies, JSON nested too deep) before Triton parses it.
It starts the binary with

* the interpreter's own ``libpython`` first on ``LD_LIBRARY_PATH``: the backend's stub links
  ``libpython3.X.so`` by name, and would otherwise load the system's copy, which can be another
  patch release than the standard library this interpreter runs (PyTriton issue #51:
  ``'_thread.RLock' object has no attribute '_recursion_count'``);
* this interpreter's ``bin`` first on ``PATH``: the stub finds its environment (its
  ``site-packages``) there; it ignores ``PYTHONPATH``;
* readiness only once every model is loaded, and a server that stops if one fails to load;
* the APIs that change the server (model repository, shared memory, trace, logging settings)
  closed to every client, with no secret: they ask for a header that neither HTTP/1.1 (a value
  holding a line feed) nor gRPC (a name with capitals) can carry;
* a ``/dev/shm`` of its own (a private tmpfs, mode 0700, in a mount namespace of its own; a user
  namespace first where this user may not mount): the Python backend makes its shared-memory region
  mode 0644 whatever the umask, so in the system's ``/dev/shm`` other users could read the images
  clients send. The tmpfs goes with the server's processes, so a crash leaves nothing behind. Where
  no namespace can be made, the region is made 0600 as soon as it is seen, and removed after a crash;
* umask 077: any file it makes is its user's only.

It waits until Triton's ``/v2/health/ready`` answers, or the server exits (then :class:`ServeError`
says why: the model's load error, else the server's last error lines). :meth:`TritonServer.wait`
then supervises it: if Triton exits on its own (a crash) or a model's backend process dies, it is
stopped and started again on the same ports (the fronts answer ``503`` meanwhile, readiness too);
:data:`MAX_RESTARTS` restarts within :data:`RESTART_WINDOW_S` seconds, or one that fails, end it
with :class:`ServeError`. A Triton killed by a signal while it starts is started once more.
Stopping sends Triton ``SIGINT``: it finishes the requests in flight, for :data:`EXIT_TIMEOUT_S` seconds
at most, unloads the models (their stub processes exit) and exits; anything left after that is
killed, so every process it started is gone and the ports are free. The server is also given
``PR_SET_PDEATHSIG``: if this process is killed outright, the kernel sends it ``SIGTERM``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from http.client import HTTPException
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from convnets.errors import InvalidArgumentError, MissingDependencyError, ServeError
from convnets.extras import install_hint, serve_convnets
from convnets.serve.front import GrpcFront, HttpFront, UnixHTTPConnection

__all__ = ["DEFAULT_HTTP_PORT", "DEFAULT_GRPC_PORT", "DEFAULT_METRICS_PORT", "DEFAULT_MAX_REQUEST_BYTES",
           "EXIT_TIMEOUT_S", "MAX_RESTARTS", "RESTART_WINDOW_S", "Endpoints", "TritonServer", "stop_on_signals",
           "triton_distribution"]

log = logging.getLogger(__name__)

#: Triton's own default ports.
DEFAULT_HTTP_PORT, DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT = 8000, 8001, 8002
#: Seconds Triton waits for requests in flight when told to stop (its ``--exit-timeout-secs``).
EXIT_TIMEOUT_S = 5
#: Seconds allowed for the server to load its models and answer ready.
STARTUP_TIMEOUT_S = 600.0
#: The largest request body (HTTP) or message (gRPC) passed on to Triton: the largest image, plus 16 MiB.
DEFAULT_MAX_REQUEST_BYTES = 80 * 2**20
#: Restarts allowed within :data:`RESTART_WINDOW_S` seconds before supervision gives up.
MAX_RESTARTS, RESTART_WINDOW_S = 5, 300.0
#: What no client can call: changing the server's models, shared memory, tracing and logging. The header
#: they ask for cannot be sent: gRPC refuses a name with capitals, HTTP/1.1 a value with a line feed.
_CLOSED_APIS = "model-repository,shared-memory,trace,logging:Convnets-Closed=no\nclient sends this"
_STUB = "triton_python_backend_stub"
#: The number Triton appends to its gRPC socket's path (``unix:DIR/grpc`` listens at ``DIR/grpc:2``).
_GRPC_SOCKET_PORT = 2


@dataclass(frozen=True)
class Endpoints:
    """Where the server listens.

    Attributes:
        host: the address every endpoint binds (``127.0.0.1``: this machine only; ``0.0.0.0``: all).
        http_port, grpc_port, metrics_port: the ports; 0 picks a free one (:meth:`resolved`).
    """

    host: str = "127.0.0.1"
    http_port: int = DEFAULT_HTTP_PORT
    grpc_port: int = DEFAULT_GRPC_PORT
    metrics_port: int = DEFAULT_METRICS_PORT

    def ports(self) -> dict[str, int]:
        """Option name (``--http-port``, ...) -> port."""
        return {"--http-port": self.http_port, "--grpc-port": self.grpc_port, "--metrics-port": self.metrics_port}

    def resolved(self) -> Endpoints:
        """These endpoints with each port 0 replaced by a free port, all checked to be free.

        Raises:
            InvalidArgumentError: a port that is taken, the same port twice, or a host that cannot be bound.
        """
        chosen: dict[str, int] = {}
        for option, port in self.ports().items():
            if port and port in chosen.values():
                raise InvalidArgumentError(f"{option} {port}: the port is also another endpoint's; give each its own")
            chosen[option] = _free_port(self.host, port, option)
        return replace(self, http_port=chosen["--http-port"], grpc_port=chosen["--grpc-port"],
                       metrics_port=chosen["--metrics-port"])

    def probe_host(self) -> str:
        """The address a client on this machine reaches the server at (the host, or loopback for any-address)."""
        return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)

    def urls(self) -> dict[str, str]:
        """``http``, ``grpc`` and ``metrics`` URLs (gRPC as ``host:port``, as gRPC clients take it)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {"http": f"http://{host}:{self.http_port}", "grpc": f"{host}:{self.grpc_port}",
                "metrics": f"http://{host}:{self.metrics_port}/metrics"}


def _free_port(host: str, port: int, option: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Triton binds with SO_REUSEADDR too: a port in TIME_WAIT after a previous server is usable.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if port and e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
                raise InvalidArgumentError(f"{option} {port}: {host}:{port} is already in use; choose another "
                                           "port (0: any free port)") from e
            raise InvalidArgumentError(f"--host {host}: cannot listen there ({e.strerror or e})") from e
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class _Distribution:
    server: Path
    libraries: Path
    backend: Path
    stub: Path


def triton_distribution() -> _Distribution:
    """Where the ``serve`` extra's Triton is: the server binary, its libraries, the Python backend and
    the backend's stub for this Python version.

    Raises:
        MissingDependencyError: ``nvidia-pytriton`` is not installed, or has no stub for this Python.
    """
    try:
        import pytriton
    except ImportError as e:
        raise MissingDependencyError(f"the Triton Inference Server comes with nvidia-pytriton, which cannot be "
                                     f"imported ({e}); install the 'serve' extra (Linux) in an environment of its "
                                     f"own, as it pins numpy<2: {install_hint('serve')}; then run "
                                     f"{serve_convnets()} serve") from e
    root = Path(pytriton.__file__).parent
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # The wheel's layout: pytriton/tritonserver/{bin,backends/python,python_backend_stubs/3.X} and the
    # libraries auditwheel put beside the package (an editable install keeps them in external_libs).
    libraries = root.parent / "nvidia_pytriton.libs"
    found = _Distribution(server=root / "tritonserver" / "bin" / "tritonserver",
                          libraries=libraries if libraries.is_dir() else root / "tritonserver" / "external_libs",
                          backend=root / "tritonserver" / "backends" / "python",
                          stub=root / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub")
    if not found.stub.is_file():
        raise MissingDependencyError(f"nvidia-pytriton {getattr(pytriton, '__version__', '')} has no Triton Python "
                                     f"backend for Python {version}; use a Python it supports (3.8 to 3.13 in 0.7)")
    if not found.server.is_file():
        raise MissingDependencyError(f"nvidia-pytriton is installed without its server binary ({found.server}); "
                                     "reinstall the 'serve' extra")
    return found


def _environment() -> dict[str, str]:
    """The server's environment: this interpreter's libpython and bin first (see the module doc)."""
    env = dict(os.environ)
    distribution = triton_distribution()
    libraries = [str(distribution.libraries)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libraries.insert(0, str(sysconfig.get_config_var("LIBDIR")))
    env["LD_LIBRARY_PATH"] = os.pathsep.join([*libraries, *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    return env


_CLONE_NEWNS, _CLONE_NEWUSER = 0x20000, 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000


def _child_setup() -> Callable[[], None]:
    """What the server process runs before exec (see the module doc): a private ``/dev/shm`` where it can
    (best effort: :func:`_private_shm` tells afterwards), SIGTERM when this process dies (prctl
    PR_SET_PDEATHSIG, set last: entering a user namespace clears it) and umask 077. Everything is
    looked up here, before the fork: the child only calls it."""
    libc = ctypes.CDLL(None, use_errno=True)
    unshare, mount, prctl, umask = libc.unshare, libc.mount, libc.prctl, os.umask
    maps = {"setgroups": b"deny", "uid_map": f"{os.getuid()} {os.getuid()} 1".encode(),
            "gid_map": f"{os.getgid()} {os.getgid()} 1".encode()}

    def own_user_namespace() -> bool:
        if unshare(_CLONE_NEWUSER | _CLONE_NEWNS) != 0:
            return False
        for name, text in maps.items():  # this user, mapped to itself
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
            try:
                os.write(fd, text)
            finally:
                os.close(fd)
        return True

    def setup() -> None:
        if (unshare(_CLONE_NEWNS) == 0 or own_user_namespace()) and mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE,
                                                                          None) == 0:
            mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0700")
        prctl(1, signal.SIGTERM)
        umask(0o077)
    return setup


def _stubs(pid: int) -> set[int]:
    """The Python backend's stub processes below ``pid``."""
    found = set()
    for child in _descendants(pid):
        try:
            if _STUB in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"):
                found.add(child)
        except OSError:
            continue
    return found


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (Linux: /proc), found now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited; its parent has not reaped it yet


class TritonServer:
    """The Triton Inference Server on a model repository, behind its fronts, as a context manager (stopped on exit).

    Args:
        repository: the model repository (every model in it is loaded).
        endpoints: where clients reach it; ports 0 are picked when the server starts.
        verbose: Triton's log on this process's stderr (default: in a file, shown when it fails).
        workspace: where the backend directory and the log go (default: a new temporary directory,
            removed when the server stops).
        max_request_bytes: the largest HTTP body or gRPC message passed on to Triton.
    """

    def __init__(self, repository: str | Path, endpoints: Endpoints = Endpoints(), *, verbose: bool = False,
                 workspace: str | Path | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.repository = Path(repository).resolve()
        self.endpoints = endpoints
        self.verbose = verbose
        self.max_request_bytes = max_request_bytes
        self._own_workspace = workspace is None
        self.workspace = Path(tempfile.mkdtemp(prefix="convnets-serve-") if workspace is None else workspace)
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._started: set[int] = set()
        self._stub_pids: set[int] = set()
        self._sockets: Path | None = None
        self._fronts: list[HttpFront | GrpcFront] = []
        self._shm_prefix = ""
        self._restarts: list[float] = []

    @property
    def log_path(self) -> Path:
        """Triton's log (without ``verbose``)."""
        return self.workspace / "triton.log"

    def __enter__(self) -> TritonServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start the server and its fronts, and wait until it is ready (its models loaded).

        Raises:
            ServeError: the server exited while starting (a model failed to load, ...), or was not
                ready in time.
            InvalidArgumentError: a port is taken.
            MissingDependencyError: the ``serve`` extra is not installed.
        """
        distribution = triton_distribution()
        self.endpoints = self.endpoints.resolved()
        # Triton's own endpoints: unix sockets in a directory of its own (mkdtemp: 0700), which only the
        # fronts use; short, for the 107-byte limit of a socket's path.
        self._sockets = Path(tempfile.mkdtemp(prefix="convnets-triton-"))
        # The backend directory Triton loads: the Python backend with this Python's stub.
        backend = self.workspace / "backends" / "python"
        backend.mkdir(parents=True)
        for source in (*distribution.backend.iterdir(), distribution.stub):
            if source.is_file():
                shutil.copy2(source, backend / source.name)
        e, inner = self.endpoints, self._inner_sockets()
        try:
            self._fronts = [HttpFront((e.host, e.http_port), inner["http"], self.max_request_bytes),
                            GrpcFront(e.host, e.grpc_port, inner["grpc"], self.max_request_bytes),
                            HttpFront((e.host, e.metrics_port), inner["metrics"], self.max_request_bytes,
                                      metrics=True)]
        except OSError as error:
            raise InvalidArgumentError(f"--host {e.host}: cannot listen there ({error})") from error
        self._launch()
        for front in self._fronts:
            front.start()

    def _inner_sockets(self) -> dict[str, str]:
        """The paths of Triton's own HTTP, gRPC and metrics sockets (gRPC's: Triton appends ``:PORT``)."""
        assert self._sockets is not None
        return {"http": str(self._sockets / "http"), "grpc": f"{self._sockets / 'grpc'}:{_GRPC_SOCKET_PORT}",
                "metrics": str(self._sockets / "metrics")}

    def _launch(self) -> None:
        """Start Triton on its unix sockets and wait until it is ready; once more if a signal killed it meanwhile,
        as a crash later would be (its gRPC poller once aborted it under load: "epoll_wait error: Bad file
        descriptor"). Its own exits (a model that fails to load) and the startup timeout are not retried."""
        try:
            self._start()
        except ServeError as error:
            if self.process is None or (self.process.returncode or 0) >= 0:
                raise
            log.warning("%s; starting it again", error)
            self._stop_triton()
            self._start()

    def _start(self) -> None:
        distribution = triton_distribution()
        assert self._sockets is not None
        for stale in self._sockets.iterdir():  # a crashed Triton's sockets: binding them again would fail
            stale.unlink()
        # Shared memory names of its own, so that several servers on one machine do not collide.
        self._shm_prefix = f"convnets-{os.getpid()}-{secrets.token_hex(4)}-"
        command = [str(distribution.server), f"--model-repository={self.repository}",
                   f"--backend-directory={self.workspace / 'backends'}", "--model-control-mode=none",
                   # The configs are complete: no stub process started just to ask model.py for one.
                   "--disable-auto-complete-config",
                   "--strict-readiness=true", "--exit-on-error=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
                   # unix:PATH (libevhtp's and gRPC's form); the HTTP and metrics ports are then unused.
                   f"--http-address=unix:{self._sockets / 'http'}", "--http-port=1",
                   f"--grpc-address=unix:{self._sockets / 'grpc'}", f"--grpc-port={_GRPC_SOCKET_PORT}",
                   f"--metrics-address=unix:{self._sockets / 'metrics'}", "--metrics-port=3",
                   "--allow-gpu-metrics=false",
                   f"--http-restricted-api={_CLOSED_APIS}", f"--grpc-restricted-protocol={_CLOSED_APIS}",
                   f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}"]
        if self.verbose:
            output: Any = sys.stderr.fileno()  # stdout keeps only the line naming the endpoints
        else:
            if self._log is not None:
                self._log.close()
            self._log = output = self.log_path.open("ab")
        log.debug("starting %s", " ".join(command))
        # A session of its own: a terminal's Ctrl-C reaches this process only, which stops the server in order.
        self.process = subprocess.Popen(command, env=_environment(), stdin=subprocess.DEVNULL, stdout=output,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_child_setup())
        self._wait_ready()
        self._started = _descendants(self.process.pid) | {self.process.pid}
        self._stub_pids = _stubs(self.process.pid)
        self._guard_shared_memory()

    def _guard_shared_memory(self) -> None:
        """Make Triton's shared-memory regions 0600, in the ``/dev/shm`` it sees (see the module doc)."""
        if self.process is None:
            return
        for region in Path(f"/proc/{self.process.pid}/root/dev/shm").glob(f"{self._shm_prefix}*"):
            try:
                region.chmod(0o600)
            except OSError:
                pass

    def _remove_shared_memory(self) -> None:
        """Remove what a Triton that shared this machine's ``/dev/shm`` left there."""
        for region in Path("/dev/shm").glob(f"{self._shm_prefix}*") if self._shm_prefix else ():
            region.unlink(missing_ok=True)

    def _wait_ready(self) -> None:
        assert self.process is not None
        http = self._inner_sockets()["http"]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise ServeError(f"the Triton server exited while starting (status {self.process.returncode}): "
                                 f"{self._failure()}")
            self._guard_shared_memory()
            connection = UnixHTTPConnection(http, timeout=2)
            try:
                connection.request("GET", "/v2/health/ready")
                if connection.getresponse().status == 200:
                    return
            except (OSError, HTTPException):
                pass
            finally:
                connection.close()
            if time.monotonic() > deadline:
                raise ServeError(f"the Triton server was not ready after {STARTUP_TIMEOUT_S:g} s: {self._failure()}")
            time.sleep(0.1)

    def _failure(self) -> str:
        """Why the server did not start: a model's load error, else Triton's error lines."""
        from convnets.serve.backend import LOAD_ERROR_FILE

        reasons = [f"model {path.parent.name!r} failed to load: {path.read_text(encoding='utf-8').strip()}"
                   for path in sorted(self.repository.glob(f"*/{LOAD_ERROR_FILE}"))]
        if reasons:
            return "; ".join(reasons)
        if self.verbose:
            return "see its log above"
        if self._log is not None:
            self._log.flush()
        lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        # Triton's error lines: 'E1126 10:07:51.479 15854 model_lifecycle.cc:642] "failed to load ...\n\nAt: ..."'
        # (a Python traceback follows the first escaped newline).
        errors = [line.split("] ", 1)[-1].split("\\n")[0].strip('" ') for line in lines if re.match(r"E\d{4} ", line)]
        return " / ".join(dict.fromkeys(errors)) or "its log says nothing more"

    def alive(self) -> bool:
        """Whether the server process runs."""
        return self.process is not None and self.process.poll() is None

    def wait(self, interval_s: float = 0.5) -> None:
        """Supervise the server until a signal's handler raises (see :func:`stop_on_signals`): restart it
        when it exits on its own or a model's backend process dies.

        Raises:
            ServeError: it stopped more than :data:`MAX_RESTARTS` times in :data:`RESTART_WINDOW_S`
                seconds, or could not start again.
        """
        while True:
            assert self.process is not None
            try:
                status = self.process.wait(timeout=interval_s)
            except subprocess.TimeoutExpired:
                dead = sorted(pid for pid in self._stub_pids if not _alive(pid))
                if not dead:
                    continue
                why = f"a model's backend process ({', '.join(map(str, dead))}) died"
            else:
                why = f"the Triton server stopped on its own (status {status})"
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self._restarts) > MAX_RESTARTS:
                raise ServeError(f"{why}, the {len(self._restarts)}th time in {RESTART_WINDOW_S:g} s; giving up "
                                 "(run with -v to see its log)")
            log.warning("%s; restarting it", why)
            self._stop_triton()
            self._launch()
            log.warning("the Triton server is ready again")

    def stop(self) -> None:
        """Stop the fronts, the server (SIGINT: Triton finishes requests in flight) and every process it
        started; then remove the workspace if it made one. Safe to call twice."""
        fronts, self._fronts = self._fronts, []
        for front in fronts:
            front.stop()
        self._stop_triton()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None
        if self._own_workspace:
            shutil.rmtree(self.workspace, ignore_errors=True)

    def _stop_triton(self) -> None:
        """Stop Triton and every process it started (see :meth:`stop`), and remove its shared memory."""
        process, self.process = self.process, None
        if process is None:
            return
        started = self._started | _descendants(process.pid) | {process.pid}
        if process.poll() is None:
            log.debug("stopping the Triton server (SIGINT)")
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=EXIT_TIMEOUT_S + 10)
            except subprocess.TimeoutExpired:
                log.warning("the Triton server did not stop in %d s; killing it", EXIT_TIMEOUT_S + 10)
                process.kill()
                process.wait()
        log.debug("the Triton server exited (status %s)", process.returncode)
        # Its stub processes exit when their models unload or their parent goes; wait a little, then make sure.
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        log.debug("processes left: %s", [pid for pid in started if _alive(pid)])
        for pid in started:
            if _alive(pid):
                log.warning("killing process %d that the Triton server left", pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._remove_shared_memory()


class _Stop(Exception):
    """Raised in the main thread by :func:`stop_on_signals`' handler."""


def stop_on_signals() -> type[BaseException]:
    """Make SIGINT and SIGTERM raise an exception in the main thread (returned, to catch), so that a
    server's blocking waits end and its ``with`` block stops it."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stop(signal.Signals(signum).name)
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return _Stop
