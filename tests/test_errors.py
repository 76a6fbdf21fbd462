"""Every error that a user's input causes is a ``ConvnetsError`` and still the built-in type it was.

Two halves:

* a sample of public functions, at least one per module that validates input, called with bad
  input: the exception must be the documented ``convnets.errors`` class, a ``ConvnetsError`` (so
  ``except ConvnetsError`` catches it) and keep its built-in base (so ``except ValueError`` /
  ``except TypeError`` callers keep working);
* a scan of the source for ``raise ValueError(...)`` and the other built-in types: only the
  internal invariants listed in :data:`PLAIN_RAISES` (each with why) may raise them.
"""

from __future__ import annotations

import ast
import builtins
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from train_support import TINY_ARCH, one_thread

import convnets
import processing_utils
from convnets import errors
from convnets.errors import (CheckpointError, ConvnetsError, DataError, InvalidArgumentError, InvalidArgumentTypeError,
                             MissingDependencyError, UnknownArgumentError)

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _tiny() -> nn.Module:
    return convnets.get_model("resnet50", **TINY_ARCH, num_classes=4)


def _predict_topk_zero(tmp: Path) -> Any:
    from convnets.inference.predict import iter_predict

    return next(iter_predict(_tiny().eval(), [str(tmp)], topk=0))  # a generator: checks on the first next()


def _predict_without_labels(tmp: Path) -> Any:
    from convnets.inference.predict import predict

    return predict(lambda x: x, str(tmp))


def _triton_files_elsewhere(tmp: Path) -> Any:
    from convnets.deploy.triton import write_triton_files

    export = SimpleNamespace(format="onnx", path=tmp / "model.onnx", output_shape=(-1, 4))
    return write_triton_files(tmp / "repo", "m", export, max_batch_size=8)  # not at repo/m/1/model.onnx


def _triton_labels_mismatch(tmp: Path) -> Any:
    from convnets.deploy.triton import model_version_dir, write_triton_files

    export = SimpleNamespace(format="onnx", path=model_version_dir(tmp, "m") / "model.onnx", output_shape=(-1, 4))
    return write_triton_files(tmp, "m", export, max_batch_size=8, class_names=["a", "b", "c"])


def _trainer_mixup_without_rng(tmp: Path) -> Any:
    from convnets.runtime import resolve_precision
    from convnets.train.step import Trainer

    trainer = Trainer(nn.Linear(2, 2), resolve_precision(CPU, amp=False), lr=0.1, total_steps=1, mixup_alpha=0.2)
    return trainer.loss(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))


def _fit(tmp: Path, **overrides: Any) -> Any:
    from convnets.train import TrainConfig, fit

    config = dict(data_backend="synthetic", output=tmp / "out", arch="resnet50", arch_kwargs=TINY_ARCH,
                  image_size=32, batch_size=8, epochs=1, progress=False)
    return fit(TrainConfig(**{**config, **overrides}))


def _fit_over_another_run(tmp: Path) -> Any:
    (tmp / "out").mkdir()
    (tmp / "out" / "checkpoint.pth.tar").write_bytes(b"another run")
    return _fit(tmp)


def _make_data(tmp: Path) -> Any:
    from convnets.data.folders import make_data
    from convnets.dist import DistContext

    return make_data("tfrecord", tmp, batch_size=8, image_size=32, workers=0, seed=0,
                     ctx=DistContext(rank=0, world_size=1, local_rank=0, device=CPU))


def _dali_missing(tmp: Path) -> Any:
    from convnets.data.dali import _import_dali

    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    try:
        return _import_dali()
    finally:
        mp.undo()


def _safetensors_non_tensor(tmp: Path) -> Any:
    from convnets.weights.safetensors_io import save_safetensors

    return save_safetensors({"fc.weight": [1.0]}, tmp / "x.safetensors")


def _read_missing_checkpoint(tmp: Path) -> Any:
    from convnets.weights.files import read_checkpoint

    return read_checkpoint(tmp / "missing.pth.tar")


def _not_a_training_checkpoint(tmp: Path) -> Any:
    from convnets.train.checkpoint import TrainingCheckpoint

    torch.save({"fc.weight": torch.zeros(2, 2)}, tmp / "plain.pth")
    return TrainingCheckpoint.read(tmp / "plain.pth")


def _imported(module: str, name: str) -> Callable[..., Any]:
    import importlib

    return getattr(importlib.import_module(module), name)


#: (id, call(tmp_path), expected class, built-in base, part of the message).
CASES: list[tuple[str, Callable[[Path], Any], type[ConvnetsError], type[Exception], str]] = [
    # deploy
    ("benchmark.benchmark_inference", lambda t: _imported("convnets.deploy.benchmark", "benchmark_inference")(
        lambda x: x, [1], warmup=0), InvalidArgumentError, ValueError, "at least 1"),
    ("triton.check_model_name", lambda t: _imported("convnets.deploy.triton", "check_model_name")("a/b"),
     InvalidArgumentError, ValueError, "invalid Triton model name"),
    ("triton.triton_config", lambda t: _imported("convnets.deploy.triton", "triton_config")(
        "m", None, max_batch_size=0), InvalidArgumentError, ValueError, "max_batch_size must be at least 1"),
    ("triton.write_triton_files path", _triton_files_elsewhere, InvalidArgumentError, ValueError,
     "the model file must be"),
    ("triton.write_triton_files labels", _triton_labels_mismatch, InvalidArgumentError, ValueError,
     "3 class names for 4 outputs"),
    ("formats.get_format", lambda t: _imported("convnets.deploy.formats", "get_format")("tflite"),
     InvalidArgumentError, ValueError, "unknown export format"),
    ("optimize.optimize_for_inference", lambda t: convnets.optimize_for_inference(_tiny().train()),
     InvalidArgumentError, ValueError, "eval mode"),
    # predict
    ("predict.predict topk", _predict_topk_zero, InvalidArgumentError, ValueError, "topk must be"),
    ("predict.predict labels", _predict_without_labels, InvalidArgumentError, ValueError, "pass labels="),
    # preprocessing, directly and through the upstream-compatible facade
    ("transforms.preprocess_image", lambda t: _imported("convnets.preprocessing.transforms", "preprocess_image")(
        Image.new("L", (8, 8))), InvalidArgumentError, ValueError, "needs an RGB image"),
    ("results.pick_n_best type", lambda t: processing_utils.pick_n_best("scores"),
     InvalidArgumentTypeError, TypeError, "must be a torch.Tensor or numpy array"),
    ("results.pick_n_best dtype", lambda t: processing_utils.pick_n_best(np.zeros(1000, dtype=bool)),
     InvalidArgumentTypeError, TypeError, "real scores"),
    ("results.pick_n_best shape", lambda t: processing_utils.pick_n_best(torch.zeros(3)),
     InvalidArgumentError, ValueError, "must have shape"),
    ("results.pick_n_best n", lambda t: processing_utils.get_utils().pick_n_best(torch.zeros(1000), n=0),
     InvalidArgumentError, ValueError, "n must be an int"),
    ("io.open_image", lambda t: processing_utils.open_image(3.5), InvalidArgumentTypeError, TypeError,
     "expected a path, an http(s) URL, bytes or a PIL image"),
    ("pipeline.prepare_batch not a list", lambda t: processing_utils.prepare_batch("cat.jpg"),
     InvalidArgumentTypeError, TypeError, "inputs must be a list or tuple"),
    ("pipeline.prepare_batch item", lambda t: processing_utils.prepare_batch([3]),
     InvalidArgumentTypeError, TypeError, "input 0 has type int"),
    ("pipeline.prepare_input_from_uri cuda", lambda t: processing_utils.prepare_input_from_uri([], cuda="yes"),
     InvalidArgumentTypeError, TypeError, "cuda must be True or False"),
    ("pipeline.prepare_batch timeout", lambda t: processing_utils.prepare_batch([], timeout=0),
     InvalidArgumentError, ValueError, "timeout must be"),
    ("presets.EvalPreset", lambda t: _imported("convnets.preprocessing.presets", "EvalPreset")(
        crop_size=0, resize_size=8), InvalidArgumentError, ValueError, "must be a positive int"),
    # train
    ("config.TrainConfig", lambda t: _imported("convnets.train", "TrainConfig")(epochs=0, output=t),
     InvalidArgumentError, ValueError, "epochs must be a positive integer"),
    ("recipe.param_groups", lambda t: _imported("convnets.train.recipe", "param_groups")(
        nn.Sequential(nn.LayerNorm(3)), 1e-4), InvalidArgumentTypeError, TypeError, "no weight-decay rule"),
    ("runtime.resolve_precision", lambda t: _imported("convnets.runtime", "resolve_precision")(
        CPU, True, "fp8"), InvalidArgumentError, ValueError, "amp dtype must be one of"),
    ("step.Trainer.loss", _trainer_mixup_without_rng, InvalidArgumentError, ValueError, "MixUp needs a random"),
    # In Python's words: the keyword (resume=...), not the command line's option.
    ("loop.fit output", _fit_over_another_run, InvalidArgumentError, ValueError,
     "already holds checkpoint.pth.tar of another run; continue it with resume='"),
    ("loop.fit arch_kwargs", lambda t: _fit(t, arch_kwargs={**TINY_ARCH, "depth": 3}), InvalidArgumentError,
     ValueError, "arch_kwargs: resnet50() got unexpected keyword argument(s) ['depth']"),
    ("data.make_data", _make_data, InvalidArgumentError, ValueError, "unknown data backend"),
    ("data.make_data directory", lambda t: _fit(t, data_backend="pytorch", data=t / "missing"), DataError,
     ValueError, "does not exist"),
    ("dali without DALI", _dali_missing, MissingDependencyError, ImportError, "-m pip install -c constraints.txt -e '.[dali]' (nvidia-dali-cuda130"),
    # models
    ("specs.ArchSpec.replace", lambda t: _tiny().spec.replace(depth=3), UnknownArgumentError, TypeError,
     "unknown architecture field"),
    ("resnet.ResNet", lambda t: convnets.ResNet(_tiny().spec, num_classes=-1), InvalidArgumentError, ValueError,
     "num_classes must be"),
    # weights
    ("safetensors_io.save_safetensors", _safetensors_non_tensor, InvalidArgumentError, ValueError,
     "not a tensor"),
    ("files.read_checkpoint", _read_missing_checkpoint, CheckpointError, ValueError, "does not exist"),
    ("checkpoint.TrainingCheckpoint.read", _not_a_training_checkpoint, CheckpointError, ValueError,
     "not a convnets training checkpoint"),
    ("download.show_progress", lambda t: _imported("convnets.weights.download", "show_progress")("sometimes"),
     InvalidArgumentError, ValueError, "progress must be"),
]


@pytest.mark.usefixtures(one_thread.__name__)
@pytest.mark.parametrize(("call", "cls", "base", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_a_convnets_error_with_its_builtin_base(
        call: Callable[[Path], Any], cls: type[ConvnetsError], base: type[Exception], match: str,
        tmp_path: Path) -> None:
    with pytest.raises(cls, match=re.escape(match)) as info:
        call(tmp_path)
    assert type(info.value).__module__ == errors.__name__  # raised on purpose, not by a library
    assert isinstance(info.value, ConvnetsError) and isinstance(info.value, base)


#: The built-in exceptions a `raise` in the package may not use for a user's input.
BUILTIN = {name for name, obj in vars(builtins).items()
           if isinstance(obj, type) and issubclass(obj, Exception)} - {"AttributeError", "StopIteration"}

#: Plain built-in raises that remain, per file and type: internal invariants, not input errors.
#: (AttributeError is not scanned: a module's ``__getattr__`` must raise it.)
PLAIN_RAISES: dict[tuple[str, str], tuple[int, str]] = {
    ("convnets/deploy/engines/__init__.py", "ValueError"): (
        1, "check_int8 without held-out images: optimize_for_inference always splits them first"),
    ("convnets/serve/grpc_front.py", "OSError"): (
        2, "the gRPC front cannot listen (server.py names --host and --grpc-port)"),
    ("convnets/serve/kserve.py", "ValueError"): (
        2, "Triton's answer is not a JSON object or lacks an output's data: the gRPC front answers INTERNAL, logs it"),
    ("convnets/weights/safetensors_io.py", "ValueError"): (
        4, "caught in read_safetensors and re-raised as CheckpointError naming the file"),
    ("convnets/weights/load.py", "RuntimeError"): (
        1, "every tensor comes from the file or the new head; a leftover one is a bug"),
    ("convnets/preprocessing/classes.py", "RuntimeError"): (
        1, "the installed class table is damaged: an installation fault, not an input"),
    ("convnets/train/config.py", "ValueError"): (
        1, "option() declares TrainConfig fields: a developer's mistake at import time"),
    ("convnets/commands/train.py", "TypeError"): (
        1, "a TrainConfig field type without a 'parse' function: a developer's mistake"),
    ("convnets/locking.py", "OSError"): (
        2, "a lock path that is a symbolic link or not a regular file: the file system's state, raised with "
           "its errno as the open() that found it would (a held lock is LockHeldError, a TimeoutError)"),
    ("convnets/fileio.py", "FileExistsError"): (
        2, "an exclusive write found its name taken by someone else meanwhile: the file system's state, raised as "
           "the link() that found it does, naming the file (the contact sheet turns it into its own message); "
           "and preflight's, which _refusing turns into the refusal at once"),
    ("convnets/deploy/cache/__init__.py", "OSError"): (
        1, "a full disk while the engine cache is filled: raised as the OSError(ENOSPC) that the runtime's write "
           "lost (OpenVINO raises RuntimeError without an errno), naming the entry"),
    ("convnets/deploy/cache/disk.py", "ValueError"): (
        4, "an engine cache file that is not a regular file, is too large or is off its schema: caught where "
           "entries are read, and the entry counts as missing (rebuilt)"),
    ("convnets/deploy/cache/store.py", "ValueError"): (
        1, "parse_size: both callers re-raise it naming what the user set ($CONVNETS_CACHE_MAX_SIZE as an "
           "InvalidArgumentError, --max-size as argparse's usage error)"),
    ("convnets/deploy/export.py", "ValueError"): (
        1, "Verification.from_dict on a verdict.json off its schema: the engine cache reads it as no verdict"),
    ("convnets/urls.py", "TimeoutError"): (
        2, "a download's deadline passed: both callers (preprocessing.io, weights.download) catch it and "
           "raise ImageDownloadError / WeightsUnavailableError naming the URL and the limit"),
    ("hubconf.py", "RuntimeError"): (1, "two registered models claim one hub name: a developer's mistake"),
    ("convnets/inference/outputs/base.py", "NotImplementedError"): (
        2, "OutputFormat's methods that a plug-in must define (write) or may (read, for the kinds it lists as "
           "readable; Output only reads those): a developer's mistake"),
    ("convnets/inference/outputs/csv.py", "ValueError"): (
        2, "a row of the wrong width, or one that does not continue its record: caught a few lines below and "
           "re-raised as InvalidArgumentError naming the file and line"),
    ("convnets/ray/workers.py", "NotImplementedError"): (
        1, "Worker.result, which Classifier and Embedder define: a developer's mistake"),
    ("convnets/deploy/engines/base.py", "ValueError"): (
        1, "an engine setting's argparse type: argparse turns it into the option's usage error (exit 2)"),
    ("convnets/deploy/triton/python_backend.py", "ValueError"): (
        1, "the model.py that export copies into Python-backend repositories imports nothing from convnets; "
           "a config naming no known runtime fails the model's load, which Triton reports"),
}


def _plain_raises() -> Counter[tuple[str, str]]:
    found: Counter[tuple[str, str]] = Counter()
    files = [REPO / "hubconf.py", *sorted((REPO / "convnets").rglob("*.py")),
             *sorted((REPO / "processing_utils").rglob("*.py"))]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id in BUILTIN:
                found[(path.relative_to(REPO).as_posix(), target.id)] += 1
    return found


def test_only_internal_invariants_raise_plain_builtin_exceptions() -> None:
    found = _plain_raises()
    allowed = Counter({key: count for key, (count, _why) in PLAIN_RAISES.items()})
    assert found == allowed, (
        "a `raise` of a built-in exception was added or removed; if a user's input causes it, raise the "
        "convnets.errors class with the same built-in base instead, else list it in PLAIN_RAISES with why")


def test_every_error_class_keeps_a_builtin_base_callers_catch() -> None:
    for name in errors.__dict__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, ConvnetsError) and cls is not ConvnetsError:
            assert any(issubclass(cls, b) for b in (ValueError, TypeError, OSError, ImportError, RuntimeError)), name
    assert issubclass(InvalidArgumentTypeError, TypeError) and not issubclass(InvalidArgumentTypeError, ValueError)
    assert convnets.InvalidArgumentTypeError is InvalidArgumentTypeError
