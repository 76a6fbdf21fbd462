"""No third-party telemetry from what this package runs, unless the user opted in to it (convnets.deploy.telemetry).

Each run is a real subprocess (forked from an interpreter that has imported PyTorch under the
probe: tests/forked_cli.py) with a fresh ``HOME`` and without ``CI`` (openvino_telemetry turns
itself off under ``CI=true``, which ``.ci/run`` sets) or the other switches the tools honour. The
child loads a ``sitecustomize`` (so every Python process it starts loads it too, whatever the
multiprocessing start method) that records, and refuses, every attempt to resolve or connect to
a host other than the loopback one: openvino_telemetry posts each event from a forked process
through ``urllib``, which is caught there. ONNX Runtime's telemetry is native code, out of the
probe's reach: it is caught by the device id and event queue it writes into ``HOME`` at import,
before it sends anything. Nothing can reach the network either way.

This module imports neither OpenVINO nor ONNX Runtime itself (that would start their telemetry
in the test process, under the developer's own ``HOME`` when run outside CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import forked_cli
import pytest
from conftest import REPO
from strict_skips import require_module

#: Records, then refuses, every non-loopback name lookup or connection of the process it is loaded into.
PROBE = '''
import os, socket

_LOCAL = {None, "", "localhost", "127.0.0.1", "::1"}

def _record(kind, target):  # into the log of the run at hand (a run forked from a process that loaded this)
    with open(os.environ["TELEMETRY_PROBE_LOG"], "a", encoding="utf-8") as log:
        log.write(f"{os.getpid()} {kind} {target!r}\\n")


_getaddrinfo = socket.getaddrinfo


def getaddrinfo(host, *args, **kwargs):
    if host not in _LOCAL:
        _record("getaddrinfo", host)
        raise socket.gaierror(socket.EAI_NONAME, "refused by the test's network probe")
    return _getaddrinfo(host, *args, **kwargs)


_connect = socket.socket.connect


def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
        _record("connect", address)
        raise OSError("refused by the test's network probe")
    return _connect(self, address)


socket.getaddrinfo = getaddrinfo
socket.socket.connect = connect
'''


# Every test here starts from an empty engine cache of its own.
pytestmark = pytest.mark.usefixtures("cold_engine_cache")


#: Switches that turn telemetry off by themselves: the child runs without them, as on a user's machine.
TELEMETRY_SWITCHES = ("CI", "TF_BUILD", "JENKINS_URL", "NNCF_CI", "NNCF_DEV", "ORT_DISABLE_TELEMETRY",
                      "XDG_CACHE_HOME")

#: What each tool's telemetry writes under HOME (openvino_telemetry; ONNX Runtime's 1DS client).
TELEMETRY_STATE = ("intel", ".cache/Microsoft")

#: A tiny ResNet: each run takes seconds.
ARCH = json.dumps({"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]})
TINY_RANDOM = ("--model", "resnet50", "--random-init", "--arch-kwargs", ARCH, "--image-size", "64")

#: The int8 path through the API: NNCF quantization calibrated on random images.
INT8_SCRIPT = """
import torch
import convnets
model = convnets.get_model("resnet50", num_classes=10, layers=[1, 1, 1, 1], widths=[8, 16, 32, 64]).eval()
model.input_size = 32
images = torch.randn(8, 3, 32, 32)
quantized = convnets.optimize_for_inference(model, "int8", engine="openvino", calibration_data=images)
print("int8 logits", tuple(quantized(images).shape))
"""


def needs(module: str, extra: str) -> None:
    """Skip (fail under CI) without ``module``, without importing it here (see the module docstring)."""
    if importlib.util.find_spec(module) is None:
        require_module(module, extra=extra)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the probe's ``sitecustomize``: one for the module, so that its runs share a zygote."""
    folder = tmp_path_factory.mktemp("probe")
    (folder / "sitecustomize.py").write_text(PROBE, encoding="utf-8")
    return folder


def run_isolated(tmp_path: Path, probe: Path, *args: str,
                 script: str | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python -m convnets ARGS`` (or ``python -c SCRIPT``) with ``HOME`` = ``tmp_path/"home"``
    (made if missing) and the network ``probe``; returns the process and the attempts it recorded."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    log = tmp_path / "network.log"
    env = {k: v for k, v in os.environ.items() if k not in TELEMETRY_SWITCHES}
    env.update(HOME=str(home), TELEMETRY_PROBE_LOG=str(log), PYTHONPATH=os.pathsep.join([str(probe), str(REPO)]))
    proc = forked_cli.run(list(args), code=script, env=env, cwd=REPO, timeout=300)
    attempts = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return proc, attempts


def snapshot(home: Path) -> dict[str, bytes | None]:
    """Every path under ``home``: file contents, None for directories."""
    return {str(p.relative_to(home)): (p.read_bytes() if p.is_file() else None) for p in sorted(home.rglob("*"))}


def assert_no_telemetry(tmp_path: Path, proc: subprocess.CompletedProcess[str], attempts: list[str]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert attempts == [], f"network attempts: {attempts[:5]}"
    home = tmp_path / "home"
    assert [p for p in TELEMETRY_STATE if (home / p).exists()] == [], snapshot(home).keys()


# --- runs of a user who never opted in --------------------------------------------------------------

@pytest.mark.parametrize("engine", ["openvino", "auto"])
def test_predict_with_openvino_sends_and_writes_nothing(tmp_path: Path, probe: Path, engine: str) -> None:
    needs("openvino", "openvino")
    proc, attempts = run_isolated(tmp_path, probe, "predict", *TINY_RANDOM, "--engine", engine, "--device", "cpu",
                                  "--topk", "1", "--json", "examples/chelsea.png")
    assert_no_telemetry(tmp_path, proc, attempts)
    assert len(json.loads(proc.stdout)) == 1


def test_predict_with_onnxruntime_writes_no_device_id(tmp_path: Path, probe: Path) -> None:
    needs("onnxruntime", "export")
    proc, attempts = run_isolated(tmp_path, probe, "predict", *TINY_RANDOM, "--engine", "onnxruntime", "--device", "cpu",
                                  "--topk", "1", "examples/chelsea.png")
    assert_no_telemetry(tmp_path, proc, attempts)


def test_openvino_export_sends_and_writes_nothing(tmp_path: Path, probe: Path) -> None:
    needs("openvino", "openvino")
    out = tmp_path / "ir"
    proc, attempts = run_isolated(tmp_path, probe, "export", *TINY_RANDOM, "--format", "openvino", "--output", str(out))
    assert_no_telemetry(tmp_path, proc, attempts)
    assert (out / "model.xml").is_file() and (out / "model.bin").is_file()


def test_int8_quantization_sends_and_writes_nothing(tmp_path: Path, probe: Path) -> None:
    needs("openvino", "openvino")
    needs("nncf", "openvino")
    proc, attempts = run_isolated(tmp_path, probe, script=INT8_SCRIPT)
    assert_no_telemetry(tmp_path, proc, attempts)
    assert "int8 logits (8, 10)" in proc.stdout


# --- a user who opted in, and damaged state files ---------------------------------------------------

def test_a_user_who_opted_in_keeps_openvino_telemetry(tmp_path: Path, probe: Path) -> None:
    """Consent ``1`` (``opt_in_out --opt_in``): the package leaves OpenVINO's telemetry as it is (it
    tries to send, which the probe refuses) and the consent file as it was."""
    needs("openvino", "openvino")
    consent = tmp_path / "home" / "intel" / "openvino_telemetry"
    consent.parent.mkdir(parents=True)
    consent.write_text("1")
    before = consent.stat().st_mtime_ns
    proc, attempts = run_isolated(tmp_path, probe, "predict", *TINY_RANDOM, "--engine", "openvino", "--device", "cpu",
                                  "examples/chelsea.png")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any("google-analytics" in a for a in attempts), attempts
    assert consent.read_text() == "1" and consent.stat().st_mtime_ns == before


#: Damaged or odd openvino_telemetry state: HOME-relative path -> bytes (a file) or None (a directory).
#: The first (the audit's case) is run as ``convnets predict --engine openvino``; the others, to
#: keep the suite fast, as OpenVINO's and NNCF's import the way the package does it (the telemetry
#: reads all its state there).
DAMAGED: dict[str, dict[str, bytes | None]] = {
    "bad bytes in stats and client id": {"intel/stats": b"\xff\xfe\x00{", "intel/openvino_ga_cid": b"\xff\xfe\x00"},
    "opted in, client id unreadable": {"intel/openvino_telemetry": b"1", "intel/openvino_ga_cid": b"\xff\x00"},
    "opted in, client id a directory": {"intel/openvino_telemetry": b"1", "intel/openvino_ga_cid": None},
    "consent file is a directory": {"intel/openvino_telemetry": None},
    "intel is a file": {"intel": b"my notes\n"},
}

#: What the package does before it uses OpenVINO or NNCF.
IMPORT_SCRIPT = """
from convnets.deploy.formats.base import require
require("openvino")
require("nncf")
print("imported")
"""


@pytest.mark.parametrize("state", list(DAMAGED), ids=list(DAMAGED))
def test_damaged_openvino_telemetry_state_neither_breaks_a_run_nor_is_touched(tmp_path: Path, probe: Path,
                                                                              state: str) -> None:
    needs("openvino", "openvino")
    home = tmp_path / "home"
    for relative, content in DAMAGED[state].items():
        path = home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
    before = snapshot(home)
    if state == next(iter(DAMAGED)):
        proc, attempts = run_isolated(tmp_path, probe, "predict", *TINY_RANDOM, "--engine", "openvino", "--device", "cpu",
                                      "examples/chelsea.png")
    else:
        needs("nncf", "openvino")
        proc, attempts = run_isolated(tmp_path, probe, script=IMPORT_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported" in proc.stdout or "chelsea.png" in proc.stdout
    assert "Traceback" not in proc.stderr
    assert attempts == [], attempts[:5]
    assert snapshot(home) == before
    if state.startswith("opted in"):
        assert "OpenVINO telemetry, which you opted in to, is off for this run" in proc.stderr


# --- the consent check itself ----------------------------------------------------------------------

@pytest.mark.parametrize("content, opted_in", [
    (b"1", True), (b"1\n", True), (b"0", False), (b"", False), (b"yes", False), (b"\xff\xfe", False),
    (None, False),  # a directory
])
def test_only_a_consent_file_that_says_1_is_an_opt_in(tmp_path: Path, content: bytes | None, opted_in: bool) -> None:
    from convnets.deploy.telemetry import openvino_telemetry_opted_in

    consent = tmp_path / "openvino_telemetry"
    if content is None:
        consent.mkdir()
    else:
        consent.write_bytes(content)
    assert openvino_telemetry_opted_in(tmp_path) is opted_in
    assert openvino_telemetry_opted_in(tmp_path / "missing") is False


@pytest.mark.parametrize("config, env, expected", [
    (None, None, "0"),  # Ray's default is on: off for the clusters this package starts
    ({"usage_stats": True}, None, None),  # `ray enable-usage-stats`: the user's choice is kept
    ({"usage_stats": False}, None, "0"),
    (None, "1", "1"),  # a value the user set is theirs
])
def test_ray_usage_statistics_are_off_unless_the_user_opted_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  config: dict | None, env: str | None,
                                                                  expected: str | None) -> None:
    """What :func:`~convnets.deploy.telemetry.import_without_telemetry` leaves in the environment that a cluster
    started by ``--ray local`` inherits (Ray's head node reads it: ``usage_lib._usage_stats_enabledness``)."""
    from convnets.deploy import telemetry

    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(json.dumps(config))
    monkeypatch.setenv("RAY_USAGE_STATS_CONFIG_PATH", str(path))
    monkeypatch.delenv(telemetry.RAY_USAGE_STATS_ENABLED, raising=False)
    if env is not None:
        monkeypatch.setenv(telemetry.RAY_USAGE_STATS_ENABLED, env)
    monkeypatch.setattr(telemetry.importlib, "import_module", lambda name: None)  # the switch only, not Ray itself
    telemetry.import_without_telemetry("ray.data")
    assert os.environ.get(telemetry.RAY_USAGE_STATS_ENABLED) == expected
