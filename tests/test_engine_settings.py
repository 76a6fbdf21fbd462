"""Engine settings (EngineSettings, ``--threads``): one object from the command line through
optimize_for_inference to each engine's build, read back from each runtime.

Each engine's thread count is read from the runtime itself, not from what convnets recorded:
``torch.get_num_threads()`` inside the torch engine's forward, the ONNX Runtime session's options,
the OpenVINO compiled model's ``INFERENCE_NUM_THREADS``. One thread is asked for: on a machine with
two cores or more every runtime's default differs from it (ONNX Runtime's option reads 0).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, randomize_bn
from strict_skips import require_module

import convnets
from convnets import cli
from convnets.deploy import EngineSettings
from convnets.deploy.cache import CachedRunner, entry_of
from convnets.deploy.engines import engine_names, get_engine
from convnets.errors import InvalidArgumentError
from convnets.runtime import usable_cores

SIZE = 64
ONE_BLOCK = json.dumps(dict(layers=[1], widths=[16], cardinality=4, stem_width=16))
EXAMPLES = Path(convnets.__file__).parent / "assets" / "examples"

pytestmark = pytest.mark.usefixtures("cold_engine_cache")


def _runtime(module: Any) -> Any:
    """The runtime object behind an engine's :class:`RunnerModel` (its runner at the model's size)."""
    runner = module.runner((3, SIZE, SIZE))
    return runner.run if isinstance(runner, CachedRunner) else runner


def _torch_threads(module: Any) -> int:
    seen: list[int] = []
    hook = module.module.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        module(torch.zeros(1, 3, SIZE, SIZE))
    finally:
        hook.remove()
    return seen[0]


#: How each registered engine's runtime says how many threads it computes with.
THREADS_READ_BACK: dict[str, Callable[[Any], int]] = {
    "torch": _torch_threads,
    "onnxruntime": lambda m: _runtime(m).session.get_session_options().intra_op_num_threads,
    "openvino": lambda m: int(_runtime(m).compiled.get_property("INFERENCE_NUM_THREADS")),
}

def _require(engine: str) -> None:
    """Skip (fail under CI) unless ``engine``'s optional packages are installed (``all``: every engine's)."""
    for name in engine_names() if engine == "all" else (engine,):
        for module in get_engine(name).requires:
            require_module(module, extra=get_engine(name).extra)


def tiny(arch: str = "resnext101_32x4d") -> torch.nn.Module:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(arch, num_classes=10, **TINY[arch])).eval()
    model.input_size = SIZE
    return model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny()


def test_every_registered_engine_has_a_read_back() -> None:
    assert set(THREADS_READ_BACK) == set(engine_names())


@pytest.mark.parametrize("engine", engine_names())
def test_each_engine_runs_with_the_threads_it_was_built_with(engine: str, model: torch.nn.Module) -> None:
    _require(engine)
    before = torch.get_num_threads()
    built = convnets.optimize_for_inference(model, engine=engine, compile=False, settings=EngineSettings(threads=1))
    assert THREADS_READ_BACK[engine](built) == 1
    assert torch.get_num_threads() == before  # the torch engine's count is the call's, not the process's
    if usable_cores() >= 2:
        # Unset, each runtime picks its own count; torch's is the process's (one thread per test worker
        # in a parallel run: conftest), so the process is given every core for this part.
        torch.set_num_threads(usable_cores())
        try:
            default = convnets.optimize_for_inference(model, engine=engine, compile=False)
            assert THREADS_READ_BACK[engine](default) != 1
        finally:
            torch.set_num_threads(before)


def test_the_torch_engine_sets_its_threads_for_each_call_only(model: torch.nn.Module) -> None:
    built = convnets.optimize_for_inference(model, engine="torch", compile=False, settings=EngineSettings(threads=3))
    before = torch.get_num_threads()
    assert _torch_threads(built) == 3 and torch.get_num_threads() == before
    with pytest.raises(RuntimeError):  # a failing call puts the process's count back too
        built(torch.zeros(1, 5, SIZE, SIZE))
    assert torch.get_num_threads() == before


def test_auto_builds_its_pick_with_the_settings(model: torch.nn.Module) -> None:
    built = convnets.optimize_for_inference(model, engine="auto", compile=False, settings=EngineSettings(threads=1))
    assert THREADS_READ_BACK[built.engine](built) == 1


def test_a_runtimes_own_settings_reach_it_over_the_fields(model: torch.nn.Module) -> None:
    require_module("onnxruntime", extra="export")
    settings = EngineSettings(threads=1, runtime={"onnxruntime": {"intra_op_num_threads": 3},
                                                  "openvino": {"NUM_STREAMS": "1"}})
    built = convnets.optimize_for_inference(model, engine="onnxruntime", settings=settings)
    assert THREADS_READ_BACK["onnxruntime"](built) == 3


@pytest.mark.parametrize("engine", [name for name in engine_names() if name != "torch"])
def test_the_engine_cache_shares_the_graph_but_not_the_threads(engine: str, model: torch.nn.Module,
                                                               conversions: dict[str, int]) -> None:
    """The converted graph does not depend on the thread count: one entry, one conversion; each
    model loaded from it runs with its own count."""
    _require(engine)
    one = convnets.optimize_for_inference(model, engine=engine, settings=EngineSettings(threads=1))
    other = convnets.optimize_for_inference(model, engine=engine)
    first, second = entry_of(one), entry_of(other)
    assert first is not None and second is not None and first.path == second.path
    assert conversions[engine] == 1
    assert THREADS_READ_BACK[engine](one) == 1
    if usable_cores() >= 2:
        assert THREADS_READ_BACK[engine](other) != 1


@pytest.mark.parametrize("value", [0, -1, 1025, True, 1.5, "2"])
def test_a_thread_count_that_is_not_a_positive_integer_is_refused(value: object) -> None:
    with pytest.raises(InvalidArgumentError,
                       match=rf"threads must be a positive integer of at most 1024 or None, got {value!r}"):
        EngineSettings(threads=value)  # type: ignore[arg-type]


def test_settings_must_be_engine_settings(model: torch.nn.Module) -> None:
    with pytest.raises(InvalidArgumentError, match=r"settings must be an EngineSettings, got \{'threads': 2\}"):
        convnets.optimize_for_inference(model, settings={"threads": 2})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="runtime must map engine names"):
        EngineSettings(runtime={"openvino": 2})  # type: ignore[dict-item]


def test_evaluate_model_refuses_settings_without_an_engine(model: torch.nn.Module, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="settings are how an engine runs the model: give engine="):
        convnets.evaluate_model(model, tmp_path, engine=None, settings=EngineSettings(threads=1))


# --- the command line ----------------------------------------------------------------------------


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every module an engine builds during the test, as the engine returned it."""
    modules: list[Any] = []
    for name in engine_names():
        engine = get_engine(name)
        original = engine.build

        def spy(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            modules.append(_original(*args, **kwargs))
            return modules[-1]
        monkeypatch.setattr(engine, "build", spy)
    return modules


def _wnid_folders(root: Path) -> Path:
    """Two ImageNet classes' folders (WordNet ids, the classes of a 1000-class model), a photo each."""
    for wnid, photo in (("n01440764", "chelsea.png"), ("n01443537", "coffee.png")):
        (root / wnid).mkdir(parents=True)
        shutil.copy(EXAMPLES / photo, root / wnid / photo)
    return root


MODEL = ["--model", "resnext101_32x4d", "--random-init", "--arch-kwargs", ONE_BLOCK, "--device", "cpu"]


def _command(name: str, engine: str, tmp_path: Path) -> list[str]:
    photos = [str(EXAMPLES / "chelsea.png"), str(EXAMPLES / "rocket.jpg")]
    if name == "predict":
        args = ["--image-size", str(SIZE), "--json", *photos]
    elif name == "embed":
        args = ["--layer", "layer1", "--image-size", str(SIZE), "--output", str(tmp_path / "e.npy"), *photos]
    elif name == "evaluate":
        data = tmp_path / "data"
        args = ["--data", str(data if data.exists() else _wnid_folders(data)), "--workers", "0"]
    else:
        args = ["--image-size", str(SIZE), "--batch-sizes", "1", "--warmup", "1", "--iterations", "1", "--no-compile"]
    return [name, *MODEL, *args, "--engine", engine]


@pytest.mark.parametrize("command, engine", [("predict", "onnxruntime"), ("embed", "openvino"),
                                             ("evaluate", "torch"), ("benchmark", "all")])
def test_threads_reaches_the_engines_from_every_command(command: str, engine: str, built: list[Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    _require(engine)
    before = torch.get_num_threads()
    assert cli.main([*_command(command, engine, tmp_path), "--threads", "1"]) == 0, capsys.readouterr().err
    # benchmark --engine all: auto's pick first (its row reuses it), then each other installed engine.
    installed = [name for name in engine_names() if get_engine(name).available("fp32", torch.device("cpu"))]
    assert sorted(m.engine for m in built) == sorted(installed if engine == "all" else [engine])
    for module in built:
        assert THREADS_READ_BACK[module.engine](module) == 1, module.engine
    assert torch.get_num_threads() == before  # not left set in the process that ran the command
    if command == "benchmark":  # its report says so
        capsys.readouterr()
        assert cli.main([*_command(command, "torch", tmp_path), "--threads", "1", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["config"]["threads"] == 1


@pytest.mark.parametrize("command", ["predict", "embed", "evaluate", "benchmark"])
@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", "1_000", "1025"])
def test_threads_must_be_a_positive_integer(command: str, value: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, before the command runs
        cli.main([*_command(command, "torch", tmp_path), "--threads", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"convnets {command}: error: argument --threads: must be a positive integer of at most 1024, "
                       f"got {value!r}")
