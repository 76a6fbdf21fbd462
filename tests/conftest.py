"""Shared fixtures: tiny architectures, generated checkpoints, an isolated cache, a loopback server."""

from __future__ import annotations

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/reference.py

# Importing the hooks registers them: under CI, skips for missing test dependencies fail.
from strict_skips import pytest_make_collect_report, pytest_runtest_makereport, require_module  # noqa: E402, F401
import forked_cli  # noqa: E402

from convnets.models.specs import MODEL_SPECS, ArchSpec  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads these options
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Parallel workers, as ``-n N --maxprocesses 4 --dist loadscope`` would ask, when pytest-xdist is installed and
    the command line does not choose (``-n 0`` runs everything in this process, one test after another). Here
    rather than in pyproject's ``addopts``, so that ``python -m pytest tests/test_x.py`` also works with pytest alone.

    One worker more than the CPUs this process may use, at most 4 (each holds PyTorch and its models): with one
    per CPU, the tests left 0.38 of the 2 cores here idle (waiting on the servers, clusters and command-line
    processes they start), and three workers took the suite from 521 s to 474 s (2026-11-28); from fresh clones on
    an AMD EPYC (Zen 4), 410 s on three against 431 s on two (2026-11-29). Each module runs
    on one worker, in order (loadscope): its module-scoped fixtures (a trained model, a running server, a built
    wheel) are made once, and test_typing's second mypy run reuses the first one's cache. (Not loadgroup: with
    pytest 9.2, pytest-xdist 3.8 cannot tag a test with its group, and the groups are ignored.)
    """
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.option.numprocesses is not None):
        return
    config.option.maxprocesses = config.option.maxprocesses or 4
    config.option.numprocesses = min(len(os.sched_getaffinity(0)) + 1, config.option.maxprocesses)
    if config.option.dist == "no":
        config.option.dist = "loadscope"
        config.option.loadscopereorder = False  # the collection's order (SLOW_MODULES first), not the largest first


#: The slowest modules, slowest first (seconds on one worker, 2026-11-28: 97, 64, 58, 56, 43, 42, 41; test_typing's
#: mypy takes 30 s more without the .mypy_cache of earlier runs, as in CI): they start the run. Workers take modules
#: in collection order (loadscope without its reordering, which puts the modules of most tests first), and a slow
#: one taken late ran alone at the end: test_ray.py finished 42 s after the others.
SLOW_MODULES = ("test_ray.py", "test_serve.py", "test_notebook.py", "test_docs.py", "test_int8.py", "test_bounds.py",
                "test_hub_and_packaging.py", "test_typing.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the :data:`SLOW_MODULES` first; each module keeps its own order (its tests pass in any order too:
    ``-p randomly`` shuffles them)."""
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    """With parallel workers (one per core, and one more), every process of the run computes on one thread
    unless OMP_NUM_THREADS says otherwise: the workers, and what they start, inherit it. Idle OpenMP threads
    spin before they sleep, so two processes of two threads on two cores mostly wait for each other:
    the docs' blocks took 55 CPU-s with two threads and 36 with one, beside a busy core. Tests of
    thread counts set their own."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def tiny_arch(spec: ArchSpec) -> dict:
    """Architecture overrides for a small variant of ``spec``: the same kind of blocks (grouping,
    SE gate, expansion, stem) at an eighth of the width, with one block per stage and two in the
    second stage, so that both downsampling and identity-shortcut blocks run."""
    cardinality = max(1, spec.cardinality // 8)
    widths = [max(cardinality, w // 8 // cardinality * cardinality) for w in spec.widths]
    layers = [min(n, 2 if i == 1 else 1) for i, n in enumerate(spec.layers)]
    return dict(layers=layers, widths=widths, cardinality=cardinality)


#: Small variants of each registered model (list_models()): same block structure, a fraction of the size.
TINY: dict[str, dict] = {name: tiny_arch(spec) for name, spec in sorted(MODEL_SPECS.items())}


def randomize_bn(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every BatchNorm non-trivial statistics and affine terms, so that tests exercise them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def run_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary directory, common to its pytest-xdist workers (their base temporary
    directories are its children); without workers, the session's base temporary directory."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built once per run as CI builds it: ``mkdocs build --strict`` with the
    real benchmark results (a test's CONVNETS_RESULTS_DIR removed). Under pytest-xdist the first
    worker to need it builds it, under a lock, into the run's common temporary directory; the others
    read that copy."""
    from convnets.locking import exclusive_lock

    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python", "matplotlib"):
        require_module(module, extra="docs")
    common = run_temp_dir(tmp_path_factory)
    site = common / "docs_site"
    with exclusive_lock(common / "docs_site.lock", timeout=900):
        if not site.is_dir():
            building = common / "docs_site.building"
            env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
            env.pop("CONVNETS_RESULTS_DIR", None)  # docs/hooks.py's RESULTS_DIR_ENV
            done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(building)],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-5000:]
            building.rename(site)  # only a complete, strict build is shared
    return site


@pytest.fixture(scope="session")
def shared_engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One engine cache for the session: what --engine auto (every command's default) converts for a
    test's checkpoint is loaded, not converted again, by the next test with the same weights, as a
    user's runs share it. Tests of the cache itself use :func:`cold_engine_cache`.

    Under pytest-xdist the workers share it too (it is made for concurrent runs: they lock its
    entries), so a model that one worker converted is not converted again by the other."""
    shared = run_temp_dir(tmp_path_factory) / "engine_cache"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                   shared_engine_cache: Path) -> Path:
    """Every test gets its own empty TORCH_HOME (so its own weights cache) and no weights mirror;
    the engine cache is the session's (``CONVNETS_CACHE_DIR``)."""
    home = tmp_path_factory.mktemp("torch_home")
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.delenv("CONVNETS_WEIGHTS_MIRROR", raising=False)
    monkeypatch.setenv("CONVNETS_CACHE_DIR", str(shared_engine_cache))
    return home / "hub" / "checkpoints"


@pytest.fixture
def cold_engine_cache(isolated_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's own empty engine cache (under its TORCH_HOME): for tests that count conversions or
    watch what a conversion does (``pytestmark = pytest.mark.usefixtures("cold_engine_cache")``)."""
    monkeypatch.delenv("CONVNETS_CACHE_DIR")


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times each engine converted a model (OnnxFormat.write / OpenVinoFormat.convert):
    for the engine cache's tests, which count what it spares."""
    from convnets.deploy.formats.onnx import OnnxFormat
    from convnets.deploy.formats.openvino import OpenVinoFormat

    counts = {"onnxruntime": 0, "openvino": 0}

    def counting(cls: type, attr: str, engine: str) -> None:
        original = getattr(cls, attr)

        def wrapper(*args: object, **kwargs: object) -> object:
            counts[engine] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(cls, attr, wrapper)
    counting(OnnxFormat, "write", "onnxruntime")
    counting(OpenVinoFormat, "convert", "openvino")
    return counts


@dataclass
class Route:
    """What the loopback server answers for one path."""

    body: bytes = b""
    status: int = 200
    content_type: str = "application/octet-stream"
    declared_length: int | None = None  # Content-Length to announce (a larger one truncates)
    delay_s: float = 0.0
    gate: threading.Event | None = None  # the answer waits until the test sets it (at most 120 s)


@dataclass
class LoopbackServer:
    """A real HTTP server on 127.0.0.1 whose routes the test sets; counts the requests per path."""

    base_url: str
    routes: dict[str, Route] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)


@pytest.fixture
def http_server() -> Iterator[LoopbackServer]:
    state = LoopbackServer(base_url="")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            state.hits[self.path] += 1
            route = state.routes.get(self.path, Route(b"not found", status=404, content_type="text/plain"))
            time.sleep(route.delay_s)
            if route.gate is not None:
                route.gate.wait(120)
            self.send_response(route.status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(route.declared_length or len(route.body)))
            self.end_headers()
            try:
                self.wfile.write(route.body)
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def closed_port_url() -> str:
    """A loopback URL on which nothing listens (connections are refused at once)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def ngc_checkpoint(name: str, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A full-size checkpoint of ``name`` with random weights in NGC 20.06 layout (``module.`` prefix,
    2-D SE), written to ``folder`` under its NGC file name (``weights_manifest.json``).

    Returns the file and its state dict without the prefix.
    """
    from convnets.models.resnet import MODEL_SPECS, Bottleneck, ResNet
    from convnets.weights.manifest import load_manifest

    torch.manual_seed(0)
    model = randomize_bn(ResNet(MODEL_SPECS[name]))
    with torch.no_grad():
        # Small last-BN gammas, as in trained networks: with random ones the activations of 33
        # residual blocks grow to ~1e5 and float32 rounding alone changes the logits visibly.
        for block in model.modules():
            if isinstance(block, Bottleneck):
                block.bn3.weight.mul_(0.2)
    state = model.state_dict()
    path = folder / load_manifest()[name].file_name
    torch.save({f"module.{k}": v for k, v in state.items()}, path)
    return path, state


@pytest.fixture(scope="session")
def full_se_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A full-size SE-ResNeXt101-32x4d checkpoint in NGC 20.06 layout (see :func:`ngc_checkpoint`)."""
    return ngc_checkpoint("se_resnext101_32x4d", tmp_path_factory.mktemp("ngc"))


#: A log record as the command line formats them (``convnets.cli``: "LEVEL logger: message"), such
#: as ``--engine auto``'s "INFO convnets.auto: engine='auto' picked ..." line.
_LOG_RECORD = re.compile(r"^(DEBUG|INFO|WARNING) [\w.]+: ")


def command_lines(stderr: str) -> list[str]:
    """The lines a command wrote to stderr itself (errors, summaries), without log records."""
    return [line for line in stderr.strip().splitlines() if not _LOG_RECORD.match(line)]


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 300,
            code: str | None = None, fresh: bool = False, **run: Any) -> "subprocess.CompletedProcess[str]":
    """Run ``python -m convnets ARGS`` (``code``: ``python -c CODE ARGS``) in a real process and return the
    completed process: the one way of the tests to run the command line as a process (:func:`cli_in_process`
    is the one in this process; :func:`start_cli` starts a run without waiting, for signals).

    The process is forked from an interpreter that has imported torch and torchvision and nothing
    else (tests/forked_cli.py, whose docstring says why, with the measurement): the run, its exit and its exit status are its
    own, without the 4.5 CPU-seconds of those imports per call. ``run``: :func:`forked_cli.run`'s
    ``input``, ``extra_as``.

    ``fresh``: a new interpreter under ``python -X importtime`` instead, for tests of what a command imports
    before it answers: the result's ``imported`` is the set of modules the interpreter's own report
    lists (its stderr is without that report), so nothing depends on timing.
    """
    if not fresh:
        return forked_cli.run(list(args), env=_cli_env(env), cwd=cwd or REPO, timeout=timeout, code=code, **run)
    what = ["-c", code] if code is not None else ["-m", "convnets"]
    proc = subprocess.run([sys.executable, "-X", "importtime", *what, *args], capture_output=True, env=_cli_env(env),
                          cwd=cwd or REPO, timeout=timeout, **run)
    stderr = proc.stderr.decode(errors="replace").splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr if line.startswith("import time:")}
    assert code is not None or "convnets.cli" in imported, stderr[-20:]  # the report is there at all
    text = "".join(f"{line}\n" for line in stderr if not line.startswith("import time:"))
    done = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(errors="replace"), text)
    done.imported = imported  # type: ignore[attr-defined]
    return done


def start_cli(*args: str, env: dict[str, str] | None = None, **popen: Any) -> forked_cli.CliProcess:
    """Start ``python -m convnets ARGS`` as :func:`run_cli` runs it, and return it at once: a
    :class:`forked_cli.CliProcess` (``popen``: its ``stdin``, ``stderr``, ``start_new_session``,
    ``code`` for ``python -c CODE``...)."""
    return forked_cli.CliProcess(list(args), env=_cli_env(env), cwd=REPO, **popen)


def _cli_env(env: dict[str, str] | None) -> dict[str, str]:
    """A command-line run's environment: this one, this checkout importable, ``env`` over it."""
    return {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}


def cli_in_process(*args: str, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> "subprocess.CompletedProcess[str]":
    """Run ``convnets.cli.main(ARGS)`` in this process, as :func:`run_cli` runs ``python -m convnets ARGS``.

    The same parsing, checks and messages (``main`` is what the console script calls), without an
    interpreter start-up and a PyTorch import per call: for tests of what a command answers. Returns
    a completed process: ``main``'s status (a usage error's ``SystemExit`` status), its stdout and
    stderr text. ``env`` is set and ``cwd`` entered for the call only. The logging configuration is
    the one a new process has (none: ``main`` sets it up, so its log records are on stderr as in a
    subprocess), and restored afterwards. Unlike a subprocess, Python warnings go to pytest, and an
    unexpected exception is raised here instead of printing a traceback. Keep :func:`run_cli` where
    the process itself is tested (start-up imports, signals, the console script, decoding processes).
    """
    import contextlib
    import io
    import logging
    from unittest import mock

    from convnets.cli import main

    out, err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    root = logging.getLogger()
    levels = {name: logging.getLogger(name).level for name in ("", "convnets.auto")}
    handlers, root.handlers = root.handlers, []  # pytest's own: with them, main's basicConfig does nothing
    try:
        with mock.patch.dict(os.environ, env or {}), contextlib.chdir(cwd or REPO), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(list(args))
            except SystemExit as e:  # argparse's usage errors and --help
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers = handlers
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    texts = []
    for stream in (out, err):
        stream.flush()
        texts.append(stream.buffer.getvalue().decode("utf-8", errors="replace"))
    return subprocess.CompletedProcess(["convnets", *args], status, texts[0], texts[1])


#: Modules that the command line must not import before it has checked its arguments (each costs
#: seconds or pulls in PyTorch).
HEAVY_MODULES = ("torch", "torchvision", "numpy", "convnets.registry")


def heavy_imports(imported: set[str]) -> list[str]:
    """The modules of :data:`HEAVY_MODULES` (and their submodules) among ``imported``."""
    return sorted(m for m in imported if any(m == h or m.startswith(h + ".") for h in HEAVY_MODULES))


Factory = Callable[..., torch.nn.Module]


@pytest.fixture
def patch_inductor(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Change ``torch._inductor.config`` keys (dotted, e.g. ``"cpp.cxx"``) for one test.

    Through the config's own ``patch()``, which restores each key exactly: ``monkeypatch.setattr``
    on ``config.cpp`` (a proxy object) makes pytest >= 9 *delete* the key on undo, which breaks
    inductor for every later test in the process.
    """
    import contextlib

    import torch._inductor.config as config

    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)

    def patch(changes: dict[str, object]) -> None:
        stack.enter_context(config.patch(changes))
    return patch


def kill_midway(command: list[str], watched: Path, lines: list[str], *, after_bytes: int, extra_s: float,
                deadline_s: float = 120) -> None:
    """Run ``python -m convnets COMMAND... --from-file -``, feed it ``lines`` on a stdin that stays
    open, wait until ``watched`` holds ``after_bytes``, sleep ``extra_s``, then SIGKILL it.

    The open stdin means the process cannot finish before the kill, however fast it runs, so every
    kill lands mid-run (pass ``--workers 1``: the read-ahead of more decoding processes waits on stdin).
    """
    proc = start_cli(*command, "--from-file", "-", stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        proc.stdin.write("".join(f"{line}\n" for line in lines).encode())
        proc.stdin.flush()
        deadline = time.monotonic() + deadline_s
        while (not watched.exists() or watched.stat().st_size < after_bytes) and proc.poll() is None:
            assert time.monotonic() < deadline, "no batch was written"
            time.sleep(0.005)
        time.sleep(extra_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
