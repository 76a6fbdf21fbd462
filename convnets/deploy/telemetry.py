"""Third-party telemetry stays off unless the user opted in to it with that tool itself.

:func:`import_without_telemetry` is the one way this package imports the optional runtimes
(:func:`convnets.deploy.formats.base.require` calls it, and every import of OpenVINO, NNCF, ONNX and
ONNX Runtime goes through ``require``). What each of them does, as read in their sources and
seen running (openvino 2026.4, openvino-telemetry 2025.2, nncf 3.4, onnxruntime 1.32, onnx 1.23,
torch 2.14):

* **OpenVINO and NNCF** report usage to Google Analytics through the ``openvino_telemetry``
  package. ``import openvino`` imports ``openvino.tools.ovc``, whose ``__init__`` builds the
  ``openvino_telemetry.Telemetry`` singleton with ``enable_opt_in_dialog=False``: with no consent
  file (``~/intel/openvino_telemetry``; ``%LOCALAPPDATA%\\Intel Corporation`` on Windows) that
  counts as consent, so the import writes ``~/intel/openvino_ga_cid`` and ``~/intel/stats`` and
  sends an event; ``convert_model`` sends more, and so does ``nncf`` (its own ``Telemetry``
  instance, same consent). The only switches it honours are ``CI=true`` / ``TF_BUILD`` /
  ``JENKINS_URL`` (meant for CI machines; setting them would misinform every other tool) and
  NNCF's ``NNCF_CI`` / ``NNCF_DEV`` (NNCF only). A client-id file that is not text (bad bytes, a
  directory) makes ``import openvino`` itself raise ``UnicodeDecodeError`` / ``IsADirectoryError``,
  and a ``stats`` file that is not JSON is silently overwritten.

  Both packages treat ``openvino_telemetry`` as optional (``try: import openvino_telemetry``,
  ``except ImportError:`` a no-op stub), so before OpenVINO or NNCF is first imported this module
  puts ``None`` under that name in :data:`sys.modules`, which makes the import raise
  ``ImportError`` (the import system's documented way of blocking a module): both run exactly as
  they do without the package installed. Nothing under ``~/intel`` is read beyond the consent
  file, nor created, changed or deleted. This relies on no private name of theirs, unlike
  building or patching the ``Telemetry`` singleton (``openvino.tools.ovc`` re-initialises it,
  re-reading consent, whenever its application name changes).

  A user who opted in (``opt_in_out --opt_in`` wrote ``1`` into the consent file) is left alone:
  their telemetry runs as OpenVINO made it, unless its client-id file cannot be read, in which case
  it is off for this process (with a warning) rather than failing the run; the file is left as it is.
  If ``openvino_telemetry`` was already imported when this package first needs OpenVINO (the
  calling program imported ``openvino`` or ``nncf`` itself), the process's telemetry was set up by
  that import under OpenVINO's own rules, and is left as it is.

  The block is process-wide and lasts for the process: OpenVINO used later in the same process,
  by other code, sends nothing either. Processes started with ``spawn`` do not inherit it.

* **ONNX Runtime** (1.32 here) has telemetry of its own on Linux too (Microsoft's 1DS client,
  ``core/platform/posix/telemetry_1ds.cc``): ``import onnxruntime`` writes a device id and an
  event queue (``~/.cache/Microsoft/DeveloperTools/.onnxruntime/deviceid``, ``onnxruntime.db``)
  and queues a ``ProcessInfo`` event (OS, CPU, memory, container kind, the Python executable's
  path) for upload to ``mobile.events.data.microsoft.com``, which a process that lives a few
  seconds longer then looks up. ``onnxruntime.disable_telemetry_events()`` comes too late (after
  the import) and stops none of this; the environment variable
  ``ORT_DISABLE_TELEMETRY``, read when the module loads, does (``1``: nothing is written or
  queued; ``0``, ``false``, ``no`` or empty: on). So before ONNX Runtime is imported it is set to ``1`` in
  ``os.environ``, unless the user set it (to anything: ``0`` is how one opts in); child processes
  inherit it, which keeps their ONNX Runtime quiet too. While it says off,
  ``disable_telemetry_events()`` is called after the import as well: it is the switch for the
  Windows builds' ETW events (a no-op on Linux). ONNX Runtime has no consent file.

* **Ray** (2.60 here, the ``ray`` extra) reports usage statistics to Anyscale from the head node of a
  cluster (its dashboard's ``usage_stats_head`` module), enabled by default. A cluster started by
  this package (``--ray local``, ``convnets.ray.connect("local")``) is started by this process, which
  passes on its environment: before ``ray`` is imported, ``RAY_USAGE_STATS_ENABLED`` is set to ``0``
  unless the user set it or opted in with ``ray enable-usage-stats`` (``"usage_stats": true`` in
  ``~/.ray/config.json``, or ``RAY_USAGE_STATS_CONFIG_PATH``). A cluster the user started
  (``ray start``) is theirs and follows its own setting; a driver that joins it sends nothing itself.

* **ONNX** and **PyTorch** collect nothing: no telemetry code (``torch._C._log_api_usage_once``
  only calls a handler that a program installs; none is, by default). Nothing to turn off.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["ORT_DISABLE_TELEMETRY", "OPENVINO_TELEMETRY", "RAY_USAGE_STATS_ENABLED", "USES_OPENVINO_TELEMETRY",
           "import_without_telemetry", "openvino_telemetry_dir", "openvino_telemetry_opted_in",
           "ray_usage_stats_opted_in"]

log = logging.getLogger(__name__)

#: The package through which OpenVINO (``openvino.tools.ovc``) and NNCF report usage.
OPENVINO_TELEMETRY = "openvino_telemetry"

#: Top-level packages that import :data:`OPENVINO_TELEMETRY`: it is blocked before the first of them is imported.
USES_OPENVINO_TELEMETRY = ("openvino", "nncf")

#: Client-id files (current and legacy name) that ``openvino_telemetry`` reads, errors uncaught, once consent is given.
_CLIENT_ID_FILES = ("openvino_ga_cid", "openvino_ga_uid")

#: Ray's switch for its usage statistics (``0``: off; ``1``: on), read by the processes of a cluster it starts.
RAY_USAGE_STATS_ENABLED = "RAY_USAGE_STATS_ENABLED"

#: ONNX Runtime's switch for its telemetry, read when ``onnxruntime`` is imported (``1``/``true``: off; ``0``: on).
ORT_DISABLE_TELEMETRY = "ORT_DISABLE_TELEMETRY"

_lock = threading.Lock()
_openvino_decided = False


def import_without_telemetry(name: str) -> ModuleType:
    """Import module ``name`` with its third-party telemetry off, unless the user opted in to it.

    OpenVINO / NNCF: ``openvino_telemetry`` is blocked for the process first (decided once, on the
    first such import). ONNX Runtime: :data:`ORT_DISABLE_TELEMETRY` is set to ``1`` first unless the
    user set it, and its Windows ETW events are disabled after the import. Ray:
    :data:`RAY_USAGE_STATS_ENABLED` is set to ``0`` first unless the user set it or opted in. Other modules are
    imported as they are. See the module documentation for why and how.

    Raises:
        ImportError: ``name`` cannot be imported.
    """
    top = name.partition(".")[0]
    if top in USES_OPENVINO_TELEMETRY:
        _openvino_telemetry_off()
    if top == "onnxruntime" and top not in sys.modules:
        os.environ.setdefault(ORT_DISABLE_TELEMETRY, "1")  # a value the user set is theirs (0: opted in)
    if top == "ray" and not ray_usage_stats_opted_in():
        os.environ.setdefault(RAY_USAGE_STATS_ENABLED, "0")
    module = importlib.import_module(name)
    if name == "onnxruntime" and os.environ.get(ORT_DISABLE_TELEMETRY, "").strip().lower() in ("1", "true", "yes"):
        # The same switch for the Windows builds' ETW events (a no-op elsewhere).
        disable = getattr(module, "disable_telemetry_events", None)
        if callable(disable):
            disable()
    return module


def ray_usage_stats_opted_in() -> bool:
    """Whether the user opted in to Ray's usage statistics in its config file (``ray enable-usage-stats``)."""
    import json

    path = os.environ.get("RAY_USAGE_STATS_CONFIG_PATH") or os.path.expanduser("~/.ray/config.json")
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file).get("usage_stats") is True
    except (OSError, ValueError, AttributeError):
        return False


def openvino_telemetry_dir() -> Path | None:
    """Where ``openvino_telemetry`` keeps its consent, client-id and stats files, or None when unknown.

    ``~/intel`` on Linux and macOS, ``%LOCALAPPDATA%\\Intel Corporation`` on Windows (as its
    ``OptInChecker`` computes it).
    """
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        return Path(base) / "Intel Corporation" if base else None
    try:
        return Path.home() / "intel"
    except RuntimeError:  # no HOME and no password-database entry
        return None


def openvino_telemetry_opted_in(directory: Path | None = None) -> bool:
    """Whether the user opted in to OpenVINO's telemetry: its consent file's first line is ``1``.

    That is what ``opt_in_out --opt_in`` writes (``--opt_out`` writes ``0``). A missing, unreadable
    or malformed consent file (a directory, bad bytes, anything else) is no opt-in. Only reads.

    Args:
        directory: the telemetry directory; default :func:`openvino_telemetry_dir`.
    """
    directory = directory if directory is not None else openvino_telemetry_dir()
    if directory is None:
        return False
    try:
        with open(directory / "openvino_telemetry", encoding="utf-8", errors="replace") as file:
            return file.readline().strip() == "1"
    except (OSError, ValueError):
        return False


def _unreadable_client_id(directory: Path) -> str | None:
    """What is wrong with a client-id file that ``openvino_telemetry`` would fail on, or None.

    It reads them as text in the locale's encoding, without catching errors (2025.2 ``utils/cid.py``).
    """
    for name in _CLIENT_ID_FILES:
        path = directory / name
        if not os.path.exists(path):
            continue
        try:
            with open(path, encoding="locale") as file:
                file.readline()
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            return f"{path} cannot be read ({e})"
    return None


def _openvino_telemetry_off() -> None:
    """Block ``openvino_telemetry`` for this process unless the user opted in; decided once."""
    global _openvino_decided
    with _lock:
        if _openvino_decided:
            return
        _openvino_decided = True
        if OPENVINO_TELEMETRY in sys.modules:
            log.debug("openvino_telemetry was imported before convnets needed OpenVINO; left as it is")
            return
        directory = openvino_telemetry_dir()
        if directory is not None and openvino_telemetry_opted_in(directory):
            problem = _unreadable_client_id(directory)
            if problem is None:
                log.debug("OpenVINO telemetry: opted in (%s), left on", directory / "openvino_telemetry")
                return
            log.warning("OpenVINO telemetry, which you opted in to, is off for this run: %s, and OpenVINO "
                        "would fail on it; the file is left as it is", problem)
        # None in sys.modules makes ``import openvino_telemetry`` raise ImportError: OpenVINO and
        # NNCF then use their no-op stubs, as when the package is not installed.
        sys.modules[OPENVINO_TELEMETRY] = None  # type: ignore[assignment]  # None blocks the import (see above)
