"""Run the Triton Inference Server that the ``serve`` extra installs on a model repository, behind its fronts.

``nvidia-pytriton`` ships a ``tritonserver`` binary (Triton 2.51 in PyTriton 0.7), Triton's Python
backend and its stub process built for each Python version. This module runs that binary itself
(:mod:`convnets.serve.launch`), rather than through PyTriton's ``Triton`` class: PyTriton's readiness
wait does not notice a server that exited (a model that failed to load costs its full 120 s
timeout), its server log goes to standard output, and a model bound with ``Triton.bind`` runs behind
a proxy that fails every request of a dynamically formed batch when one of them is bad. A
Python-backend repository (:mod:`convnets.serve.repository`, or ``convnets export --triton
--triton-backend python``) answers each request on its own.

Clients never reach Triton itself: :class:`TritonServer` runs it with HTTP, gRPC and metrics on
unix sockets of its own, in a new directory (mode 0700) that no other user can enter, and serves the
endpoints asked for with the fronts of :mod:`convnets.serve.front`, which send Triton only requests
they built themselves. Triton runs with

* readiness only once every model is loaded, and a server that stops if one fails to load;
* the APIs that change the server (model repository, shared memory, trace, logging settings)
  closed to every client, with no secret: they ask for a header that neither HTTP/1.1 (a value
  holding a line feed) nor gRPC (a name with capitals) can carry;
* a private ``/dev/shm``, umask 077 and a parent-death signal (:mod:`convnets.serve.launch`);
* the soft limit on open files raised to the hard one (:func:`raise_open_files_limit`), which sets
  how many connections the fronts hold.

It waits until Triton's ``/v2/health/ready`` answers, or the server exits (then :class:`ServeError`
says why: the model's load error, else the server's last error lines). :meth:`TritonServer.wait`
then supervises it: if Triton exits on its own (a crash) or a model's backend process dies, it is
stopped and started again on the same ports (the fronts answer ``503`` meanwhile, readiness too);
:data:`MAX_RESTARTS` restarts within :data:`RESTART_WINDOW_S` seconds, or one that fails, end it
with :class:`ServeError`. A Triton killed by a signal while it starts is started once more.
Stopping sends Triton ``SIGINT``: it finishes the requests in flight, for :data:`EXIT_TIMEOUT_S` seconds
at most, and exits; then its process group is killed, so every process it started is gone and the
ports are free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from http.client import HTTPException
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any

from convnets.errors import InvalidArgumentError, ServeError
from convnets.serve import launch
from convnets.serve.front import DEFAULT_MAX_CONNECTIONS, Limits, UnixHTTPConnection
from convnets.serve.launch import triton_distribution

if TYPE_CHECKING:
    from convnets.serve.fronts import Fronts

__all__ = ["DEFAULT_HTTP_PORT", "DEFAULT_GRPC_PORT", "DEFAULT_METRICS_PORT", "DEFAULT_MAX_REQUEST_BYTES",
           "EXIT_TIMEOUT_S", "MAX_RESTARTS", "RESTART_WINDOW_S", "Endpoints", "TritonServer",
           "raise_open_files_limit", "stop_on_signals", "triton_distribution"]

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
        # Each probe stays bound until all are chosen: a port picked and let go can be picked again at once.
        with contextlib.ExitStack() as probes:
            for option, port in self.ports().items():
                if port and port in chosen.values():
                    raise InvalidArgumentError(f"{option} {port}: the port is also another endpoint's; give each "
                                               "its own")
                chosen[option] = _free_port(self.host, port, option, probes)
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


def _free_port(host: str, port: int, option: str, probes: contextlib.ExitStack) -> int:
    """``port`` if ``host`` can bind it, or a free port for 0; the probing socket stays bound until ``probes`` closes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = probes.enter_context(socket.socket(family, socket.SOCK_STREAM))
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
        #: Whether Triton runs with a /dev/shm of its own (else a warning said so).
        self.private_shm = False
        self._log: IO[bytes] | None = None
        self._backends: list[Any] = []
        self._sockets: Path | None = None
        self._fronts: Fronts | None = None
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
        # The fronts' parser (httptools) comes with the serve extra, which triton_distribution has just checked.
        from convnets.serve.fronts import Fronts
        self.endpoints = self.endpoints.resolved()
        open_files = raise_open_files_limit()
        # Each HTTP connection holds two descriptors (the client's, Triton's), each gRPC one (one channel to Triton
        # serves them all, and a unix connection per inference in flight, at most Limits.max_rpcs: 64 by default),
        # as many connections of each kind; 256 descriptors are kept for the rest.
        connections = max(64, min(DEFAULT_MAX_CONNECTIONS, (open_files - 256) // 3))
        if connections < DEFAULT_MAX_CONNECTIONS:
            log.info("the fronts hold %d HTTP and %d gRPC connections at most (open files limit %d)", connections,
                     connections, open_files)
        # Triton's own endpoints: unix sockets in a directory of its own (mkdtemp: 0700), which only the
        # fronts use; short, for the 107-byte limit of a socket's path.
        self._sockets = Path(tempfile.mkdtemp(prefix="convnets-triton-"))
        # The backend directory Triton loads: the Python backend with this Python's stub.
        backend = self.workspace / "backends" / "python"
        backend.mkdir(parents=True)
        for source in (*distribution.backend.iterdir(), distribution.stub):
            if source.is_file():
                shutil.copy2(source, backend / source.name)
        e = self.endpoints
        try:
            self._fronts = Fronts(e.host, {"http": e.http_port, "grpc": e.grpc_port, "metrics": e.metrics_port},
                                  self._inner_sockets(), Limits(self.max_request_bytes, max_connections=connections,
                                                                max_grpc_connections=connections))
        except OSError as error:
            raise InvalidArgumentError(f"--host {e.host}: cannot listen there ({error})") from error
        self._launch()
        try:
            self._fronts.start()
        except OSError as error:
            raise InvalidArgumentError(f"--host {e.host}: cannot listen there ({error})") from error

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
            if self.process is None or (launch.exited(self.process) or 0) >= 0:
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
        self.process, self.private_shm = launch.launch(command, output)
        self._wait_ready()
        self._backends = launch.backend_processes(self.process)

    def _remove_shared_memory(self) -> None:
        """Remove what a Triton that shared this machine's ``/dev/shm`` left there (its own names only)."""
        for region in Path("/dev/shm").glob(f"{self._shm_prefix}*") if self._shm_prefix and not self.private_shm else ():
            region.unlink(missing_ok=True)

    def _wait_ready(self) -> None:
        assert self.process is not None
        http = self._inner_sockets()["http"]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if (status := launch.exited(self.process)) is not None:
                raise ServeError(f"the Triton server exited while starting (status {status}): {self._failure()}")
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
        return self.process is not None and launch.exited(self.process) is None

    def wait(self, interval_s: float = 0.5) -> None:
        """Supervise the server until a signal's handler raises (see :func:`stop_on_signals`): restart it
        when it exits on its own or a model's backend process dies. Only a process that is gone counts as
        dead: an error while looking (no file descriptor left, say) does not.

        Raises:
            ServeError: it stopped more than :data:`MAX_RESTARTS` times in :data:`RESTART_WINDOW_S`
                seconds, or could not start again.
        """
        while True:
            assert self.process is not None
            time.sleep(interval_s)
            if (status := launch.exited(self.process)) is not None:
                why = f"the Triton server stopped on its own (status {status})"
            elif dead := launch.dead(self._backends):
                why = f"a model's backend process ({', '.join(map(str, dead))}) died"
            else:
                continue
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
        fronts, self._fronts = self._fronts, None
        if fronts is not None:
            fronts.stop()
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
        """Stop Triton and every process it started (:func:`convnets.serve.launch.stop`); remove its shared memory."""
        process, self.process, self._backends = self.process, None, []
        if process is not None:
            launch.stop(process, EXIT_TIMEOUT_S + 10)
        self._remove_shared_memory()


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (Triton inherits it); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, wanted, e)
    return int(soft if soft != resource.RLIM_INFINITY else 1 << 20)


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
