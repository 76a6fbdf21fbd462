"""Command-line errors speak the command line: each names the option at fault, in one line, with no
Python advice (``timeout=``, ``convnets.resnet50(...)``, keyword arguments).

The mechanism (``ConvnetsError.cli``, ``keyword``, ``add_cli_advice``, :func:`convnets.errors.message_for`)
is tested here too; see :mod:`convnets.errors`.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import LoopbackServer, REPO, Route, TINY, cli_in_process, command_lines
from PIL import Image

import convnets
import convnets.train
from convnets.errors import (CheckpointError, ConvnetsError, ImageDownloadError, ImageNotFoundError,
                             UnknownArgumentError, message_for)
from convnets.models.specs import MODEL_SPECS

SE = "se_resnext101_32x4d"
IMAGE = "examples/rocket.jpg"
# What Python advice looks like: a keyword set to a value, a call into the package, the word itself.
PYTHON_ADVICE = re.compile(r"\b[a-z_]+=[\w'\"(\[]|convnets\.\w+\(|keyword")


def _error_line(done, *, status: int = 1, python_words: re.Pattern[str] = PYTHON_ADVICE) -> str:
    """The one error line of a failed command (usage errors: the last line, after the usage; log
    records such as --random-init's warning or auto's pick are not errors)."""
    lines = command_lines(done.stderr)
    assert done.returncode == status, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    if status == 1:
        assert len(lines) == 1, lines
    line = lines[-1]
    assert not python_words.search(line), line
    return line


@pytest.fixture(scope="module")
def five_classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A self-describing 5-class checkpoint of a tiny SE-ResNeXt."""
    torch.manual_seed(0)
    model = convnets.get_model(SE, num_classes=5, **TINY[SE])
    path = tmp_path_factory.mktemp("ckpt") / "five.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["ant", "bee", "cat", "dog", "eel"]}, path)
    return path


@pytest.fixture(scope="module")
def resnet50_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A resnet50 state dict, and the same tensors recorded as a resnext101_32x4d (a wrong record)."""
    root = tmp_path_factory.mktemp("r50")
    state = convnets.resnet50(num_classes=3).state_dict()
    plain, wrong = root / "resnet50.pth", root / "wrong_record.pth.tar"
    torch.save(state, plain)
    torch.save({"state_dict": state, "arch_spec": MODEL_SPECS["resnext101_32x4d"].to_dict()}, wrong)
    return plain, wrong


# --- each invalid option is named on its own -------------------------------------------------------


@pytest.mark.parametrize("option, value", [("--batch-size", "0"), ("--image-size", "0"), ("--timeout", "0"),
                                           ("--batch-size", "two")])
def test_a_bad_count_is_a_usage_error_naming_its_option(option: str, value: str) -> None:
    done = cli_in_process("predict", "--random-init", "--model", "resnet50", option, value, IMAGE)
    line = _error_line(done, status=2)
    assert f"argument {option}: must be a positive" in line and repr(value) in line
    others = {"--topk", "--batch-size", "--image-size", "--timeout"} - {option}
    assert not any(other in line for other in others), line


@pytest.mark.parametrize("option", ["--warmup", "--iterations", "--image-size"])
def test_benchmark_counts_are_named_on_their_own(option: str) -> None:
    line = _error_line(cli_in_process("benchmark", "--model", "resnet50", option, "0"), status=2)
    limit = " of at most 4096" if option == "--image-size" else ""  # sizes state their bound
    assert line.endswith(f"argument {option}: must be a positive integer{limit}, got '0'")


def test_a_format_option_is_named_as_a_flag(tmp_path: Path) -> None:
    line = _error_line(cli_in_process("export", "--random-init", "--model", "resnet50", "--opset", "3", "--output",
                                      str(tmp_path)))
    assert line.startswith("convnets export: error: --opset 3: ") and "17 or newer" in line


def test_a_bad_triton_name_names_the_option(tmp_path: Path) -> None:
    line = _error_line(cli_in_process("export", "--random-init", "--model", "resnet50", "--format", "torchscript",
                                      "--triton", "--name", "bad name", "--output", str(tmp_path)))
    assert line.startswith("convnets export: error: --name 'bad name': ")


def test_topk_below_one_names_topk_alone(five_classes: Path) -> None:
    line = _error_line(cli_in_process("predict", "--weights", str(five_classes), "--topk", "0", IMAGE), status=2)
    assert line == "convnets predict: error: argument --topk: must be a positive integer, got '0'"


def test_topk_above_the_number_of_classes_names_the_limit(five_classes: Path) -> None:
    line = _error_line(cli_in_process("predict", "--weights", str(five_classes), "--topk", "6", IMAGE))
    assert "--topk 6" in line and "5 classes" in line and "--topk 5 or less" in line
    assert cli_in_process("predict", "--weights", str(five_classes), "--topk", "5", IMAGE).returncode == 0


# --- advice in command-line words ----------------------------------------------------------------


def test_download_timeout_names_the_timeout_option(five_classes: Path, http_server: LoopbackServer) -> None:
    http_server.routes["/slow.png"] = Route((REPO / "examples" / "coffee.png").read_bytes(),
                                            content_type="image/png", delay_s=3.0)
    url = f"{http_server.base_url}/slow.png"
    done = cli_in_process("predict", "--weights", str(five_classes), "--timeout", "0.5", url)
    lines = command_lines(done.stderr)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith(f"convnets predict: error: Cannot load image '{url}'")
    assert "within 0.5 s" in lines[0] and "--timeout" in lines[0] and not PYTHON_ADVICE.search(lines[0])
    assert lines[1:] == ["convnets predict: 1 of 1 inputs could not be read"]


def test_checkpoint_of_another_architecture_advises_the_arch_option(resnet50_files: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    plain, _ = resnet50_files
    # The Python message keeps its Python advice.
    with pytest.raises(CheckpointError, match=r"load it with convnets\.resnet50\(\.\.\.\)") as caught:
        convnets.resnext101_32x4d(pretrained_from_file=plain)
    assert caught.value.architecture == "resnet50"
    data = tmp_path / "data"
    for split in ("train", "val"):
        for i, name in enumerate(("a", "b")):
            (data / split / name).mkdir(parents=True)
            for k in range(2):
                Image.new("RGB", (40, 40), (80 * i, 40 * k, 20)).save(data / split / name / f"{k}.png")
    done = cli_in_process("train", "--data", str(data), "--output", str(tmp_path / "out"), "--arch", "resnext101_32x4d",
                          "--pretrained-from-file", str(plain), "--epochs", "1", "--batch-size", "2",
                          "--image-size", "32", "--workers", "0")
    line = _error_line(done)
    assert "The file holds a resnet50." in line and line.endswith("To fine-tune it, use --arch resnet50.")


def test_checkpoint_with_a_wrong_record_says_so_without_python(resnet50_files: tuple[Path, Path]) -> None:
    _, wrong = resnet50_files
    line = _error_line(cli_in_process("predict", "--weights", str(wrong), IMAGE))
    assert "does not fit resnext101_32x4d" in line and "The file holds a resnet50." in line
    assert "recorded architecture is wrong" in line


def test_unknown_arch_kwargs_field_is_not_a_keyword_argument() -> None:
    line = _error_line(cli_in_process("predict", "--random-init", "--model", "resnet50", "--arch-kwargs",
                                      '{"depth": 3}', IMAGE))
    assert line.startswith("convnets predict: error: --arch-kwargs: unknown field(s) ['depth']")


def test_train_configuration_errors_name_the_flags(tmp_path: Path) -> None:
    """TrainConfig's checks speak in flags on the command line, in field names in Python."""
    line = _error_line(cli_in_process("train", "--data", str(tmp_path), "--output", str(tmp_path / "out"),
                                      "--warmup-epochs", "100", "--label-smoothing", "1.5"))
    assert line == ("convnets train: error: invalid training configuration: --warmup-epochs is out of range: "
                    "100.0; --label-smoothing is out of range: 1.5")
    # Counts are checked while parsing, before PyTorch: a usage error naming the flag.
    line = _error_line(cli_in_process("train", "--data", str(tmp_path), "--output", str(tmp_path / "out"),
                                      "--batch-size", "0"), status=2)
    assert line == "convnets train: error: argument --batch-size: must be a positive integer, got '0'"
    with pytest.raises(ValueError, match=r"configuration: batch_size must be a positive integer, got 0$"):
        convnets.train.TrainConfig(data=tmp_path, output=tmp_path, batch_size=0)


def test_train_unknown_arch_kwargs_field_names_the_flag(tmp_path: Path) -> None:
    from train_support import make_digits

    data = make_digits(tmp_path / "digits", n_train=16, n_val=16)
    line = _error_line(cli_in_process("train", "--data", str(data), "--output", str(tmp_path / "out"), "--epochs", "1",
                                      "--batch-size", "4", "--workers", "0", "--arch-kwargs", '{"depth": 3}'))
    assert line.startswith("convnets train: error: --arch-kwargs: unknown field(s) ['depth']"), line


def test_offline_advice_names_the_weights_option(closed_port_url: str, tmp_path: Path) -> None:
    done = cli_in_process("predict", IMAGE,
                          env={"CONVNETS_WEIGHTS_MIRROR": closed_port_url, "TORCH_HOME": str(tmp_path)})
    # (The reason quotes urllib3's error, "HTTPConnection(host='127.0.0.1', ...)": not advice.)
    line = _error_line(done, python_words=re.compile(r"pretrained_from_file|=PATH"))
    assert "pass --weights FILE" in line and "CONVNETS_WEIGHTS_MIRROR" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on CPUs only")
@pytest.mark.parametrize("command", [["predict", "--random-init", "--model", "resnet50", IMAGE],
                                     ["benchmark", "--model", "resnet50", "--batch-sizes", "1"]])
def test_precision_advice_uses_the_option(command: list[str]) -> None:
    line = _error_line(cli_in_process(*command, "--precision", "fp16", "--device", "cpu"))
    assert "Use --precision bf16" in line


# --- the mechanism ---------------------------------------------------------------------------------


def test_message_for_chooses_the_interface() -> None:
    plain = ConvnetsError("the same everywhere")
    assert message_for(plain, "cli") == message_for(plain, "python") == "the same everywhere"
    assert message_for(ValueError("built-in"), "cli") == "built-in"
    error = ImageDownloadError("within timeout=1 s; pass a larger timeout.", cli="within 1 s.", keyword="timeout")
    assert str(error) == message_for(error, "python") == "within timeout=1 s; pass a larger timeout."
    error.add_cli_advice("Pass a larger --timeout.")
    assert message_for(error, "cli") == "within 1 s. Pass a larger --timeout."
    assert str(error) == "within timeout=1 s; pass a larger timeout."  # Python's message is untouched


def test_interface_messages_survive_pickling_and_builtin_bases() -> None:
    error = ImageNotFoundError("no such file", cli="no such file (cli)", keyword="path")
    assert isinstance(error, FileNotFoundError) and str(error) == "no such file"
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.cli, copy.keyword) == ("no such file", "no such file (cli)", "path")
    ckpt = pickle.loads(pickle.dumps(CheckpointError("x", architecture="resnet50")))
    assert ckpt.architecture == "resnet50" and ckpt.cli is None


def test_unknown_keyword_keeps_its_python_message() -> None:
    with pytest.raises(UnknownArgumentError, match=r"resnet50\(\) got unexpected keyword argument\(s\) \['depth'\]"):
        convnets.resnet50(depth=3)

