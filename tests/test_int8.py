"""precision="int8" (NNCF on the openvino engine): faithful on a trained model, or refused with a clear error.

The faithfulness gate of issue 9 is checked on real images with a trained network: a ResNet
(one block per stage, widths 32-256, ~1M parameters) trained here on scikit-learn's handwritten
digits (all ten, upscaled to 32 px: 1200 training / 597 validation images), then quantized with
600 training images as calibration data (300 calibrate, 300 are held out to check the result).
On the validation split, int8 must score within 0.5 points of the float model's top-1 accuracy
and agree with its top-1 class on at least 99% of the images; the float model is the reference,
its labels are the folder names.

The network is trained with a plain loop (SGD with Nesterov momentum, one-cycle learning rate, no
augmentation, fp32, one thread: about 13 CPU-seconds), not with ``convnets.train.fit``: the gate
needs a classifier with margins that hold on every CPU (issue 40). ``fit``'s recipe (random
resized crops down to 8% of a 32 px digit, label smoothing, bf16 autocast where the CPU has it)
gave 92-96% top-1 and int8 agreement of 98.3-99.8% across seeds, and the same seed trained on an
AMX CPU and on one with AVX512-BF16 only gave different networks (99.5% and 98.7%: CI failed on
the second). This loop gives 97.8-99.2% top-1. Quantized with NNCF's defaults, 0-4 of the 597
validation answers changed across 8 networks (the gate allows 5): seeds 0-5 here (an Intel Xeon
with AVX512-BF16 and VNNI, no AMX), and seeds 0 and 5 trained and quantized with oneDNN capped at
AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, which OpenVINO's CPU plugin honours too: its int8 convolutions
then ran ``jit_avx2_I8`` instead of ``brgconv_avx512_I8``; the kernels are logged). The cap changes
the trained network (seed 5: 0.35 points of top-1), not the quantization of a given network (the
same answers capped at AVX512_CORE_VNNI and AVX2_VNNI). With a learning rate of 0.05, 0-5 changed.
Each quantization takes about 6 CPU-seconds.
Speed (int8 >= 1.5x OpenVINO bf16 on ResNeXt101-32x4d) lives in benchmarks/bench_engines.py --int8.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TINY, randomize_bn
from strict_skips import require_module
from train_support import make_digits

import convnets
from convnets.deploy.calibrate import CALIBRATION_IMAGES, CHECK_IMAGES, calibration_batches, split_calibration
from convnets.deploy.engines import get_engine
from convnets.errors import InvalidArgumentError, UnsupportedPrecisionError

log = logging.getLogger(__name__)

#: The trained network: wide enough to stand for the real ones (the 16-128 wide variant of the
#: training tests is too narrow for int8: see docs/engines.md's int8 section).
ARCH = {"layers": [1, 1, 1, 1], "widths": [32, 64, 128, 256], "expansion": 1, "stem_width": 32}
N_TRAIN, N_VAL, CALIBRATION = 1200, 597, 600
#: The training loop's recipe and seed (see the module doc for what was measured).
EPOCHS, BATCH, LR, WEIGHT_DECAY, SEED = 8, 32, 0.1, 5e-4, 0


@pytest.fixture(scope="module", autouse=True)
def needs_nncf() -> None:
    require_module("openvino")
    require_module("nncf")


def load_split(folder: Path, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of ``folder/<class>/*.png`` through the evaluation preprocessing, and its class index."""
    from convnets.preprocessing import prepare_input_from_uri
    from convnets.preprocessing.presets import EvalPreset

    files = sorted(folder.glob("*/*.png"))
    classes = sorted({f.parent.name for f in files})
    images = prepare_input_from_uri(files, preset=EvalPreset.for_image_size(size), workers=1)
    return images, torch.tensor([classes.index(f.parent.name) for f in files])


def train(images: torch.Tensor, labels: torch.Tensor) -> torch.nn.Module:
    """A classifier of :data:`ARCH` trained on ``images`` (see the module doc), in eval mode."""
    torch.manual_seed(SEED)
    model = convnets.get_model("resnet50", num_classes=10, **ARCH)
    steps = EPOCHS * (len(images) // BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY, nesterov=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=steps, pct_start=0.15)
    order = torch.Generator().manual_seed(SEED)
    model.train()
    for _ in range(EPOCHS):
        shuffled = torch.randperm(len(images), generator=order)
        for batch in shuffled[:steps // EPOCHS * BATCH].split(BATCH):
            loss = torch.nn.functional.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    data = make_digits(tmp_path_factory.mktemp("digits10"), N_TRAIN, N_VAL, digits=tuple(range(10)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores stall each other
    try:
        model = train(*load_split(data / "train"))
    finally:
        torch.set_num_threads(before)
    images, labels = load_split(data / "val")
    with torch.no_grad():
        top1 = 100 * float((model(images).argmax(1) == labels).float().mean())
    assert top1 >= 97.0, top1  # it learned: int8 is judged on a real classifier
    return model, data


def calibration(data: Path) -> list[torch.Tensor]:
    images, _ = load_split(data / "train")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:CALIBRATION]
    return list(images[order].split(32))


def int8_kernels(quantized: torch.nn.Module, shape: tuple[int, ...]) -> Counter[str]:
    """The kernels OpenVINO's CPU plugin runs the int8 model's convolutions with, for images of
    ``shape`` (their names say the instruction set: ``brgconv_avx512_I8``, ``..._amx_I8``, ``jit_avx2_I8``)."""
    compiled = quantized.runner(shape).compiled  # type: ignore[operator]
    return Counter(op.get_rt_info()["primitiveType"].astype(str) for op in compiled.get_runtime_model().get_ops()
                   if op.get_rt_info()["layerType"].astype(str) == "Convolution")


@pytest.mark.parametrize("engine", ["openvino", "auto"])
def test_int8_keeps_the_accuracy_and_the_answers_of_the_trained_model(
        trained: tuple[torch.nn.Module, Path], engine: str) -> None:
    model, data = trained
    quantized = convnets.optimize_for_inference(model, "int8", engine=engine, calibration_data=calibration(data))
    assert quantized.engine == "openvino" and quantized.precision == "int8"
    assert quantized.calibration_check.passed and quantized.calibration_check.top1_agreement >= 0.99
    images, labels = load_split(data / "val")
    with torch.no_grad():
        expected = model(images).argmax(1)
    got = quantized(images).argmax(1)
    fp32_top1 = 100 * float((expected == labels).float().mean())
    int8_top1 = 100 * float((got == labels).float().mean())
    agreement = float((got == expected).float().mean())
    # What was measured, and on which kernels: in the failure's message, since CI runs on more than one CPU.
    measured = (f"fp32 {fp32_top1:.2f}%, int8 {int8_top1:.2f}%, agreement {100 * agreement:.2f}% "
                f"({int((got != expected).sum())} of {len(got)} changed); held-out check "
                f"{100 * quantized.calibration_check.top1_agreement:.2f}% on {quantized.calibration_check.inputs}; "
                f"int8 convolutions ran {dict(int8_kernels(quantized, tuple(images.shape[1:])))}")
    log.info("%s", measured)
    assert abs(int8_top1 - fp32_top1) <= 0.5, measured
    assert agreement >= 0.99, measured
    # Any batch size at the calibrated image size; the first image alone gives its row of the batch.
    torch.testing.assert_close(quantized(images[:1]), quantized(images[:5])[:1], rtol=1e-4, atol=1e-4)


def test_auto_refuses_an_int8_model_that_changes_the_answers(trained: tuple[torch.nn.Module, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = trained
    engine = get_engine("openvino")
    build = engine.build

    def shuffled(*args: object, **kwargs: object) -> torch.nn.Module:
        built = build(*args, **kwargs)
        forward = built.forward
        built.forward = lambda x: forward(x).roll(1, dims=1)  # every answer moves to the next class
        return built
    monkeypatch.setattr(engine, "build", shuffled)
    with pytest.raises(UnsupportedPrecisionError, match=r"openvino agreed with the model's top-1 class on 0\.0% .*"
                                                        r"use precision='bf16'"):
        convnets.optimize_for_inference(model, "int8", engine="auto", calibration_data=calibration(data)[:2])


# --- errors (small random models: no training needed) -------------------------------------------

def tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model("resnext101_32x4d", num_classes=10, **TINY["resnext101_32x4d"])).eval()
    model.input_size = 32
    return model


def test_int8_without_calibration_data_names_the_keyword() -> None:
    for engine in ("openvino", "auto"):
        with pytest.raises(InvalidArgumentError, match=r"precision='int8' needs calibration_data") as info:
            convnets.optimize_for_inference(tiny(), "int8", engine=engine)
        assert info.value.keyword == "calibration_data"


def test_int8_on_an_engine_without_it_points_to_the_ones_with_it() -> None:
    for engine in ("torch", "onnxruntime"):
        with pytest.raises(UnsupportedPrecisionError, match=r"runs no precision='int8'; int8 runs on "
                                                            r"engine='openvino' or 'auto'"):
            convnets.optimize_for_inference(tiny(), "int8", engine=engine, calibration_data=torch.randn(2, 3, 32, 32))


def test_calibration_data_takes_a_tensor_batches_or_labelled_batches() -> None:
    x = torch.randn(5, 3, 8, 8)
    for data in (x, list(x.split(2)), [(b, torch.zeros(len(b))) for b in x.split(2)], iter(x.split(3))):
        batches = calibration_batches(data)
        torch.testing.assert_close(torch.cat(batches), x, rtol=0, atol=0)
    bad = {"no images": [], "must hold float": [torch.zeros(2, 3, 8, 8, dtype=torch.uint8)],
           r"got a \(3, 8, 8\) torch.float32 tensor": torch.zeros(3, 8, 8), "mixes image sizes": [x, torch.randn(1, 3, 9, 9)],
           "must be an": 3.5}
    for message, data in bad.items():
        with pytest.raises(InvalidArgumentError, match=message) as info:
            calibration_batches(data)
        assert "calibration_data" in str(info.value)


def test_calibration_data_with_another_precision_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"calibration_data is for precision='int8' only, not "
                                                   r"precision='fp32'"):
        convnets.optimize_for_inference(tiny(), "fp32", calibration_data=torch.randn(2, 3, 32, 32))


def test_the_int8_model_runs_its_calibration_size_only() -> None:
    quantized = convnets.optimize_for_inference(tiny(), "int8", engine="openvino",
                                                calibration_data=torch.randn(4, 3, 32, 32))
    assert quantized(torch.randn(3, 3, 32, 32)).shape == (3, 10)
    with pytest.raises(InvalidArgumentError, match=r"calibrated on 32x32 images and runs that size only, not 40x40"):
        quantized(torch.randn(1, 3, 40, 40))


def test_an_explicit_int8_engine_that_changes_the_answers_is_reported(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    engine = get_engine("openvino")
    build = engine.build

    def shuffled(*args: object, **kwargs: object) -> torch.nn.Module:
        built = build(*args, **kwargs)
        forward = built.forward
        built.forward = lambda x: forward(x).roll(1, dims=1)
        return built
    monkeypatch.setattr(engine, "build", shuffled)
    with caplog.at_level(logging.WARNING, logger="convnets.deploy.optimize"):
        quantized = convnets.optimize_for_inference(tiny(), "int8", engine="openvino",
                                                    calibration_data=torch.randn(8, 3, 32, 32))
    assert not quantized.calibration_check.passed and quantized.calibration_check.top1_agreement == 0.0
    assert any("changes the model's answers: use precision='bf16'" in r.getMessage() for r in caplog.records)


def test_split_calibration_holds_out_a_seeded_random_half() -> None:
    images = torch.arange(10.0)[:, None, None, None].expand(10, 3, 2, 2)  # image i is all i
    calibrate, held_out = split_calibration(list(images.split(3)))
    calibrated = torch.cat(calibrate)[:, 0, 0, 0].tolist()
    checked = held_out[:, 0, 0, 0].tolist()
    assert len(calibrated) == len(checked) == 5
    assert sorted(calibrated + checked) == list(range(10))  # each image in exactly one part
    assert calibrated == sorted(calibrated) and checked == sorted(checked)  # in the given order
    assert checked != [1, 3, 5, 7, 9] and checked != list(range(5, 10))  # neither every other one nor the tail
    again = split_calibration(list(images.split(4)))  # the same images in other batches: the same split
    assert torch.equal(again[1], held_out)
    many = torch.randn(1000, 3, 2, 2)
    calibrate, held_out = split_calibration([many])
    assert sum(len(b) for b in calibrate) == CALIBRATION_IMAGES and len(held_out) == CHECK_IMAGES
    assert [len(b) for b in split_calibration([many[:2]])[0]] == [1]
    with pytest.raises(InvalidArgumentError, match=r"calibration_data holds 1 image; int8 needs at least 2") as info:
        split_calibration([many[:1]])
    assert info.value.keyword == "calibration_data"


@pytest.mark.parametrize("engine", ["openvino", "auto"])
def test_the_int8_check_runs_on_images_the_quantizer_never_saw(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import convnets.deploy.engines as engines
    import convnets.deploy.optimize as optimize
    from convnets.deploy.engines import openvino

    calibrated: list[torch.Tensor] = []
    checked: list[torch.Tensor] = []
    quantize, check = openvino.quantize_int8, engines.check_int8

    def recording_quantize(ov_model: object, batches: list[torch.Tensor]) -> object:
        calibrated.extend(batches)
        return quantize(ov_model, batches)

    def recording_check(built: torch.nn.Module, model: torch.nn.Module, images: torch.Tensor) -> object:
        checked.append(images)
        return check(built, model, images)
    monkeypatch.setattr(openvino, "quantize_int8", recording_quantize)
    monkeypatch.setattr(engines, "check_int8", recording_check)
    monkeypatch.setattr(optimize, "check_int8", recording_check)
    images = torch.randn(12, 3, 32, 32)
    quantized = convnets.optimize_for_inference(tiny(), "int8", engine=engine, calibration_data=images, cache=False)
    seen, held = torch.cat(calibrated), torch.cat(checked)
    assert len(seen) == len(held) == 6 and quantized.calibration_check.batch_sizes[0] == 6
    assert "6 calibration images held out of the calibration" in quantized.calibration_check.inputs
    # Every given image went to exactly one of the two.
    given = images.flatten(1)
    hits = [(given[:, None] == part.flatten(1)[None]).all(2).any(1) for part in (seen, held)]
    assert torch.equal(hits[0] ^ hits[1], torch.ones(12, dtype=torch.bool))
