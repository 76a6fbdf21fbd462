"""The NVIDIA DALI backends: DALI's CPU pipeline feeds the loop the same epoch order as the
pytorch backend, shards validation without duplicates, and a missing DALI is a clear error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from train_support import TINY_ARCH, make_digits, one_thread

from convnets.dist import DistContext
from convnets.errors import DataError, MissingDependencyError
from convnets.train import TrainConfig, fit
from convnets.data.folders import DataSource, make_data, to_device

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
needs_dali = pytest.mark.skipif(importlib.util.find_spec("nvidia.dali") is None,
                                reason="NVIDIA DALI is not installed (pip install nvidia-dali-cuda130)")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_digits(tmp_path_factory.mktemp("digits"), n_train=128, n_val=45)


def source(backend: str, data: Path, rank: int = 0, world: int = 1) -> DataSource:
    return make_data(backend, data, batch_size=16, image_size=32, workers=1, seed=3,
                     ctx=DistContext(rank, world, 0, CPU))


@needs_dali
def test_dali_cpu_batches_follow_the_pytorch_order(digits: Path) -> None:
    dali, ref = source("dali-cpu", digits), source("pytorch", digits)
    assert dali.classes == ref.classes and dali.steps_per_epoch == ref.steps_per_epoch == 8
    for epoch in (0, 1):
        got, want = list(dali.train_epoch(epoch)), list(ref.train_epoch(epoch))
        assert len(got) == len(want) == 8
        for (x, y, bad), (_, y_ref, _) in zip(got, want):
            assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and bad == 0
            assert torch.equal(y, y_ref)  # the same images, in the same (seed, epoch) order
            assert -3 < x.mean() < 3 and x.std() > 0.1  # normalised, not raw 0-255 pixels
    first = [torch.cat([y for _, y, _ in source("dali-cpu", digits).train_epoch(e)]) for e in (0, 1)]
    assert not torch.equal(first[0], first[1])


@needs_dali
def test_dali_cpu_validation_matches_resize_and_center_crop(digits: Path) -> None:
    got, want = list(source("dali-cpu", digits).val()), list(source("pytorch", digits).val())
    x = torch.cat([b[0] for b in got])
    x_ref = torch.cat([to_device(b[0], CPU, torch.contiguous_format) for b in want])
    assert torch.equal(torch.cat([b[1] for b in got]), torch.cat([b[1] for b in want]))
    assert x.shape == x_ref.shape == (45, 3, 32, 32)
    # Resampling kernels differ slightly; the pictures must still be the same crops.
    corr = torch.stack([torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] for a, b in zip(x, x_ref)])
    assert corr.min() > 0.9


@needs_dali
def test_dali_cpu_shards_validation_without_duplicates(digits: Path) -> None:
    shards = [source("dali-cpu", digits, rank, 2) for rank in (0, 1)]
    sizes = [sum(len(y) for _, y, _ in s.val()) for s in shards]
    assert sorted(sizes) == [22, 23]
    assert shards[0].steps_per_epoch == shards[1].steps_per_epoch == 4
    assert all(len(list(s.train_epoch(0))) == 4 for s in shards)


@needs_dali
def test_dali_cpu_backend_trains(digits: Path, tmp_path: Path) -> None:
    summary = fit(TrainConfig(data=digits, output=tmp_path, data_backend="dali-cpu", arch="resnet50",
                              arch_kwargs=TINY_ARCH, image_size=32, batch_size=16, epochs=1, workers=1,
                              progress=False))
    assert summary.metrics["train_images"] == 128 and summary.metrics["val_images"] == 45


def test_missing_dali_names_the_pip_package(digits: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    # A missing optional package is a MissingDependencyError (an ImportError), not a DataError:
    # the data are fine, the installation is not.
    # The interpreter's own pip with the constraints file (the extra), and the package it brings.
    with pytest.raises(MissingDependencyError,
                       match=r"-m pip install -c constraints\.txt -e '\.\[dali\]' \(nvidia-dali-cuda130") as info:
        source("dali-cpu", digits)
    assert isinstance(info.value, ImportError) and not isinstance(info.value, DataError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
@needs_dali
def test_dali_gpu_without_gpu_is_a_clear_error(digits: Path) -> None:
    with pytest.raises(DataError, match="dali-gpu needs a CUDA GPU"):
        source("dali-gpu", digits)
