"""Run settings (convnets.runtime) and the shared command-line options (convnets.commands.options)."""

from __future__ import annotations

import argparse
import json
import logging
import platform
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import convnets
from convnets import runtime
from convnets.commands import model_options, run_options
from convnets.errors import ConvnetsError, InvalidArgumentError, UnsupportedPrecisionError
from convnets.runtime import resolve_precision

CPU = torch.device("cpu")
TINY = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}

# --- CPU bf16 detection --------------------------------------------------------------------------

X86_NATIVE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
X86_AMX = "flags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"
X86_AVX512_ONLY = "flags\t\t: fpu sse avx2 avx512f avx512bw avx512vl avx512dq\n"  # Skylake-X: bf16 emulated
ARM_NATIVE = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve bf16 i8mm\n"
ARM_PLAIN = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n"


@pytest.mark.parametrize("text, expected", [(X86_NATIVE, True), (X86_AMX, True), (X86_AVX512_ONLY, False),
                                            (ARM_NATIVE, True), (ARM_PLAIN, False), ("", False)])
def test_cpu_has_bf16_reads_the_cpu_flags(text: str, expected: bool, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    monkeypatch.setattr(runtime, "_CPUINFO", cpuinfo)
    assert runtime.cpu_has_bf16() is expected


def test_cpu_has_bf16_without_cpuinfo_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_CPUINFO", tmp_path / "missing")
    assert runtime.cpu_has_bf16() is False


def test_cpu_has_bf16_agrees_with_cpuid() -> None:
    """Against an independent source: PyTorch's CPUID-based ISA checks (x86 Linux only)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not Path("/proc/cpuinfo").is_file():
        pytest.skip("needs x86 Linux")
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if None in checks:
        pytest.skip("this PyTorch has no CPUID checks for AVX512-BF16 / AMX")
    assert runtime.cpu_has_bf16() == any(check() for check in checks)


# --- precision -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_precision_dtype_and_name_are_inverse(name: str, dtype: torch.dtype) -> None:
    assert runtime.precision_dtype(name) == dtype and runtime.precision_name(dtype) == name
    assert name in runtime.PRECISIONS


def test_unknown_precision_names_the_option() -> None:
    with pytest.raises(InvalidArgumentError, match=r"--precision int8; choose one of fp32, bf16, fp16"):
        runtime.precision_dtype("int8", option="--precision")
    with pytest.raises(InvalidArgumentError, match=r"precision='int8'"):
        runtime.check_precision("int8", CPU)


def test_fp16_on_cpu_is_refused_in_the_callers_words() -> None:
    with pytest.raises(UnsupportedPrecisionError, match="fp16 needs a CUDA device") as python:
        runtime.check_precision("fp16", CPU)
    assert "precision='bf16'" in str(python.value) and isinstance(python.value, ValueError)
    with pytest.raises(UnsupportedPrecisionError) as cli:
        runtime.check_precision("fp16", "cpu", option="--precision")
    assert "--precision bf16" in str(cli.value) and "precision='" not in str(cli.value)
    runtime.check_precision("fp16", torch.device("cuda"))  # the device's existence is resolve_device's concern


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], None]]:
    """Set what this CPU measures for bf16 against fp32 (convnets.machine.cpu_bf16_speedup), in a process that has
    not warned yet."""
    def measure(speedup: float) -> None:
        monkeypatch.setattr("convnets.machine.cpu_bf16_speedup", lambda: speedup)
        runtime.warn_if_bf16_is_slower.cache_clear()  # as in a new process
    yield measure
    runtime.warn_if_bf16_is_slower.cache_clear()


@pytest.mark.parametrize("speedup, slow", [(0.62, True), (0.99, True), (1.0, False), (2.9, False)])
def test_bf16_on_the_torch_engine_warns_once_where_it_is_measured_slower(
        speedup: float, slow: bool, measured: Callable[[float], None], caplog: pytest.LogCaptureFixture) -> None:
    """Where bf16 is measured slower than fp32 (an Intel Xeon with AVX512-BF16 and no AMX: ResNeXt101 at 0.55x),
    optimize_for_inference says so once, with the measurement, naming fp32; where it is faster (an AMD Zen 4
    with the same flags: 1.9-2.1x), nothing."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch without oneDNN refuses CPU bf16")
    measured(speedup)
    model = convnets.get_model("resnet50", num_classes=4, **TINY).eval()
    with caplog.at_level(logging.WARNING, logger="convnets.runtime"):
        for _ in range(2):
            convnets.optimize_for_inference(model, "bf16", compile=False)
        convnets.optimize_for_inference(model, "fp32", compile=False)
    warnings = [r.getMessage() for r in caplog.records if "slower than fp32" in r.getMessage()]
    if slow:
        assert warnings == [f"bf16 runs slower than fp32 on this CPU (measured here: {speedup:.2f}x fp32's speed); "
                            "run fp32 for speed"]
    else:
        assert warnings == []


def test_benchmark_of_bf16_where_it_is_slower_shows_the_warning(measured: Callable[[float], None]) -> None:
    """`convnets benchmark --precision bf16 --engine torch` where bf16 is slower prints the same line above its table."""
    from conftest import cli_in_process

    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch without oneDNN refuses CPU bf16")
    measured(0.55)
    done = cli_in_process("benchmark", "--model", "resnet50", "--random-init", "--arch-kwargs", json.dumps(TINY),
                          "--device", "cpu", "--precision", "bf16", "--engine", "torch", "--no-compile",
                          "--batch-sizes", "1", "--warmup", "1", "--iterations", "1", "--image-size", "32",
                          "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert "bf16 runs slower than fp32 on this CPU (measured here: 0.55x" in done.stderr
    assert "run fp32 for speed" in done.stderr and "| Batch size |" in done.stdout


def test_explicit_bf16_training_where_it_is_slower_warns(measured: Callable[[float], None],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch without oneDNN refuses CPU bf16")
    measured(0.7)
    with caplog.at_level(logging.WARNING, logger="convnets.runtime"):
        assert resolve_precision(CPU, amp=True, amp_dtype="bf16").amp_dtype == torch.bfloat16
    assert "bf16 runs slower than fp32 on this CPU (measured here: 0.70x" in caplog.text


def test_training_precision_uses_the_same_device_check() -> None:
    with pytest.raises(UnsupportedPrecisionError, match="--amp-dtype bf16"):
        resolve_precision(CPU, amp=True, amp_dtype="fp16")
    with pytest.raises(InvalidArgumentError, match="amp dtype"):
        resolve_precision(CPU, amp=True, amp_dtype="fp32")


@pytest.mark.parametrize("name, layout", [("channels_last", torch.channels_last), ("nhwc", torch.channels_last),
                                          ("contiguous", torch.contiguous_format), ("nchw", torch.contiguous_format)])
def test_training_precision_accepts_every_memory_format_spelling(name: str, layout: torch.memory_format) -> None:
    assert resolve_precision(CPU, amp=False, memory_format=name).memory_format == layout
    assert runtime.parse_memory_format(name) == layout


def test_unknown_memory_format_names_the_option_and_the_choices() -> None:
    with pytest.raises(InvalidArgumentError, match=r"--memory-format nwhc; choose contiguous or channels_last"):
        runtime.parse_memory_format("nwhc", option="--memory-format")


# --- device --------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "auto"])
def test_auto_device_prefers_cuda(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.resolve_device(value) == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.resolve_device(value) == torch.device("cuda")


def test_cuda_device_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidArgumentError, match="--device cuda was given but no CUDA GPU is available here; "
                                                   "use --device cpu"):
        runtime.resolve_device("cuda", option="--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert runtime.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(InvalidArgumentError, match=r"device='cuda:2': this machine has 2 CUDA device"):
        runtime.resolve_device("cuda:2")


def test_bad_device_name() -> None:
    with pytest.raises(InvalidArgumentError, match="device='gpu0' is not a device"):
        runtime.resolve_device("gpu0")
    assert runtime.resolve_device(torch.device("cpu")) == CPU


# --- shared command-line options -----------------------------------------------------------------


def _parser(**model_kwargs: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    model_options.add_model_arguments(parser, **model_kwargs)  # type: ignore[arg-type]
    run_options.add_device_argument(parser)
    run_options.add_precision_argument(parser)
    run_options.add_memory_format_argument(parser)
    return parser


def test_options_defaults_and_aliases() -> None:
    args = _parser().parse_args([])
    assert (args.model, args.weights, args.weight_source, args.arch_kwargs) == (None, None, "pretrained", {})
    assert (args.device, args.precision, args.memory_format) == ("auto", "fp32", "contiguous")
    args = _parser(default_weights="random-init").parse_args(
        ["--model", "resnet50", "--memory-format", "nhwc", "--device", "cuda:1", "--arch-kwargs", json.dumps(TINY)])
    assert (args.weight_source, args.memory_format, args.device, args.arch_kwargs) == (
        "random-init", "channels_last", "cuda:1", TINY)


@pytest.mark.parametrize("argv, message", [
    (["--arch-kwargs", "{layers: [1]}"], "--arch-kwargs is not valid JSON"),
    (["--arch-kwargs", "[1, 2]"], "--arch-kwargs must be a JSON object"),
    (["--memory-format", "nwhc"], "choose contiguous or channels_last"),
    (["--device", "GPU 0"], "--device 'GPU 0' is not a device"),
    (["--precision", "int8"], "invalid choice"),
    (["--model", "resnet05"], "invalid choice"),
])
def test_bad_option_values_are_usage_errors_that_say_why(argv: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_parse_arch_kwargs_is_a_convnets_error() -> None:
    with pytest.raises(InvalidArgumentError):
        model_options.parse_arch_kwargs("nope")
    assert issubclass(InvalidArgumentError, ConvnetsError)
    assert model_options.parse_arch_kwargs('{"layers": [1]}') == {"layers": [1]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-describing resnet50-family checkpoint of a tiny architecture."""
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", num_classes=4, **TINY)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(), "class_names": list("abcd")},
               path)
    return path


def test_weights_define_the_architecture_and_model_must_match(checkpoint: Path) -> None:
    """The one meaning of --model X --weights F, in every command: F's architecture, X a check."""
    loaded = model_options.load_from_args(_parser().parse_args(["--weights", str(checkpoint)]))
    assert (loaded.name, loaded.weights) == ("resnet_custom", str(checkpoint))
    assert loaded.model.class_names == list("abcd") and not loaded.model.training
    with pytest.raises(InvalidArgumentError, match="different architecture than --model resnet50"):
        model_options.load_from_args(_parser().parse_args(["--weights", str(checkpoint), "--model", "resnet50"]))
    with pytest.raises(InvalidArgumentError, match="--arch-kwargs does not apply to --weights"):
        model_options.load_from_args(_parser().parse_args(["--weights", str(checkpoint), "--arch-kwargs", '{"layers": [1]}']))


def test_random_init_builds_the_default_or_named_model() -> None:
    parser = _parser(default_weights="random-init", default_model="resnet50")
    loaded = model_options.load_from_args(parser.parse_args(["--arch-kwargs", json.dumps(TINY)]))
    assert (loaded.name, loaded.weights) == ("resnet50", "random-init") and not loaded.model.training
    assert list(loaded.model.spec.layers) == TINY["layers"]
    with pytest.raises(InvalidArgumentError, match="--model is required unless --weights is given"):
        model_options.load_from_args(_parser(default_weights="random-init").parse_args([]))
    with pytest.raises(InvalidArgumentError, match="--arch-kwargs: .*depth"):
        model_options.load_from_args(parser.parse_args(["--arch-kwargs", '{"depth": 3}']))
    with pytest.raises(InvalidArgumentError, match="needs --random-init or --weights"):
        model_options.load_from_args(parser.parse_args(["--pretrained", "--arch-kwargs", json.dumps(TINY)]))


def test_device_from_args_checks_the_precision_in_cli_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = _parser().parse_args(["--precision", "fp16"])
    with pytest.raises(UnsupportedPrecisionError, match="--precision bf16"):
        run_options.device_from_args(args)
    with pytest.raises(InvalidArgumentError, match="--device cuda was given"):
        run_options.device_from_args(_parser().parse_args(["--device", "cuda"]))
    assert run_options.device_from_args(_parser().parse_args([])) == CPU


@pytest.mark.parametrize("cores,cpu,cuda", [(1, 0, 0), (2, 0, 1), (6, 4, 5), (16, 4, 15), (64, 4, 16)])
def test_default_workers_leave_the_model_its_cores(cores: int, cpu: int, cuda: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU model keeps two cores for its own threads; beside a GPU, every core but the main
    # process's decodes (runtime.default_workers has the measurements), 16 processes at most.
    monkeypatch.setattr(runtime, "usable_cores", lambda: cores)
    assert (runtime.default_workers("cpu"), runtime.default_workers("cuda")) == (cpu, cuda)


@pytest.mark.parametrize("cores,processes,cuda", [(64, 8, 7), (16, 8, 1), (8, 8, 0), (16, 1, 15)])
def test_default_workers_share_the_cores_between_a_machine_s_processes(cores: int, processes: int, cuda: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's processes on one machine (train) each start their share: 8 GPUs on 64 cores, 7 loaders each.
    monkeypatch.setattr(runtime, "usable_cores", lambda: cores)
    assert runtime.default_workers("cuda", processes=processes) == cuda
