"""Starting and stopping the ``tritonserver`` binary that the ``serve`` extra installs.

* :func:`triton_distribution`: where PyTriton put the binary, its libraries, the Python backend and
  the backend's stub for this Python version;
* :func:`launch`: the binary on a model repository, in a session (and process group) of its own,
  umask 077, with this interpreter's ``libpython`` and ``bin`` first (the stub links
  ``libpython3.X.so`` by name, PyTriton issue #51, and finds its ``site-packages`` on ``PATH``);
  with ``SIGTERM`` if this process dies (util-linux ``setpriv --pdeathsig``);
* a private ``/dev/shm`` (:func:`private_shm_prefix`): the Python backend makes its shared-memory
  region, which carries every request's images, mode 0644 whatever the umask, so in the system's
  ``/dev/shm`` another user could open it and read them. util-linux ``unshare(1)``, a fresh
  single-threaded process (this one has gRPC's threads, and a process with threads cannot enter a
  user namespace), makes a mount namespace (and a user namespace first where this user may not
  mount), mounts a tmpfs of mode 0700 on ``/dev/shm`` and execs Triton; the tmpfs goes with Triton's
  processes. Where that cannot be had, :func:`launch` logs a warning naming the risk;
* :func:`stop`: ``SIGINT`` to Triton (it finishes the requests in flight), ``SIGKILL`` after a
  timeout, then ``SIGKILL`` to its process group (its backend stubs) while Triton is still
  unreaped, so the group's number cannot belong to anyone else: no PID saved earlier is signalled.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from convnets.errors import MissingDependencyError
from convnets.extras import install_hint, serve_convnets

__all__ = ["SHARED_SHM_WARNING", "backend_processes", "exited", "launch", "private_shm_prefix", "stop",
           "triton_distribution"]

log = logging.getLogger(__name__)

STUB = "triton_python_backend_stub"
SHARED_SHM_WARNING = ("no private /dev/shm could be made for the Triton server ({why}): the Python backend's "
                      "shared memory, which holds the images clients send, is readable by other users of this machine "
                      "(mode 0644 in the system's /dev/shm); serve only on a machine whose other users you trust")
_MOUNT = "mount -t tmpfs -o mode=0700,nosuid,nodev tmpfs /dev/shm"


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
        # The fronts' HTTP parser and process tracking come with the extra too: an environment made before
        # they joined it lacks them.
        import httptools  # noqa: F401
        import psutil  # noqa: F401
        import pytriton
    except ImportError as e:
        raise MissingDependencyError(f"the serve extra (the Triton Inference Server of nvidia-pytriton, httptools, psutil) "
                                     f"cannot be imported ({e}); install the 'serve' extra (Linux) in an environment "
                                     f"of its own, as it pins numpy<2: {install_hint('serve')}; then run "
                                     f"{serve_convnets()} serve") from e
    root = Path(pytriton.__file__).parent
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    # The wheel's layout: pytriton/tritonserver/{bin,backends/python,python_backend_stubs/3.X} and the
    # libraries auditwheel put beside the package (an editable install keeps them in external_libs).
    libraries = root.parent / "nvidia_pytriton.libs"
    found = _Distribution(server=root / "tritonserver" / "bin" / "tritonserver",
                          libraries=libraries if libraries.is_dir() else root / "tritonserver" / "external_libs",
                          backend=root / "tritonserver" / "backends" / "python",
                          stub=root / "tritonserver" / "python_backend_stubs" / version / STUB)
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


@lru_cache(maxsize=1)
def private_shm_prefix() -> tuple[list[str], str]:
    """The command that runs its arguments with a private ``/dev/shm`` (see the module doc), tried once here with
    ``true``; or ``([], why)`` where none can be had."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return [], "util-linux's unshare is not installed"
    # root may mount in a mount namespace of its own; another user needs a user namespace first (as its root there).
    tries = [["--mount"], ["--user", "--map-root-user", "--mount"]] if os.geteuid() == 0 else [
        ["--user", "--map-root-user", "--mount"]]
    why = ""
    for flags in tries:
        prefix = [unshare, *flags, "--propagation", "private", "--", "sh", "-c", f'{_MOUNT} && exec "$@"',
                  "convnets-triton"]
        try:
            done = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
            continue
        if done.returncode == 0:
            return prefix, ""
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"status {done.returncode}"
    return [], f"unshare {' '.join(tries[-1])}: {why}"


def launch(command: list[str], output: Any) -> tuple[subprocess.Popen[bytes], bool]:
    """Start Triton's ``command`` (see the module doc), its output to ``output``; the process, and whether it has a
    private ``/dev/shm`` (else a warning was logged)."""
    prefix, why = private_shm_prefix()
    if not prefix:
        log.warning(SHARED_SHM_WARNING.format(why=why))
    # After unshare: entering a user namespace clears the parent-death signal.
    setpriv = shutil.which("setpriv")
    deathsig = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []
    log.debug("starting %s", " ".join(command))
    # A session of its own: a terminal's Ctrl-C reaches this process only, which stops the server in order; and a
    # process group that holds Triton's backend stubs too.
    process = subprocess.Popen([*prefix, *deathsig, *command], env=_environment(), stdin=subprocess.DEVNULL,
                               stdout=output, stderr=subprocess.STDOUT, start_new_session=True, umask=0o077)
    return process, bool(prefix)


def exited(process: subprocess.Popen[bytes]) -> int | None:
    """``process``'s exit status if it exited, else None; without reaping it (its number stays its own)."""
    if process.returncode is not None:
        return process.returncode
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return process.wait()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def backend_processes(process: subprocess.Popen[bytes]) -> list[Any]:
    """The Python backend's stub processes below Triton's ``process``, as psutil processes (which tell a process
    from a later one with its number)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if STUB in " ".join(child.cmdline()[:1]):
                found.append(child)
        except psutil.Error:
            continue
    return found


def dead(backends: list[Any]) -> list[int]:
    """Which of ``backends`` (:func:`backend_processes`) no longer run. Only "no such process" (or a zombie) counts:
    an error reading ``/proc`` (no file descriptor left, say) is not a death."""
    import psutil

    gone = []
    for backend in backends:
        try:
            if not backend.is_running() or backend.status() == psutil.STATUS_ZOMBIE:
                gone.append(backend.pid)
        except psutil.NoSuchProcess:
            gone.append(backend.pid)
        except (psutil.Error, OSError) as e:
            log.debug("cannot tell whether process %d runs: %s", backend.pid, e)
    return gone


def stop(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Stop Triton and every process of its group (see the module doc); its exit status."""
    if exited(process) is None:
        log.debug("stopping the Triton server (SIGINT)")
        process.send_signal(signal.SIGINT)  # our child, not reaped: its number is its own
        deadline = time.monotonic() + timeout_s
        while exited(process) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if exited(process) is None:
            log.warning("the Triton server did not stop in %g s; killing it", timeout_s)
            process.kill()
            while exited(process) is None:
                time.sleep(0.01)
    try:  # Triton is a zombie now, still holding its number: the group is its own
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    status = process.wait()
    log.debug("the Triton server exited (status %s)", status)
    return status
