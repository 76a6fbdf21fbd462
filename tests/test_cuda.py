"""The GPU paths end to end: prediction, embeddings and training with mixed precision on CUDA; JPEGs decoded on the GPU.

Skipped where there is no CUDA GPU (CI has none); ``benchmarks/gpu_checks.sh`` runs this module on a
lent GPU. Each result is compared with an independent computation on the CPU in float32/float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TINY, randomize_bn, run_cli
from test_device_decode import decoded_on_device  # noqa: F401 - a fixture: the spy on the batched decoder
from test_embed import _independent
from test_predict_cli import EXAMPLES, SE, _expected_top
from train_support import make_digits, read_metrics, reference_top1, run_train, tiny_args

import convnets

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, num_classes=5, **TINY[SE]))
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["ant", "bee", "cat", "dog", "eel"]}, path)
    return path, model.state_dict()


# Probabilities of 5 classes against float32 on the CPU: TF32 convolutions round to ~1e-3, fp16 and
# bf16 to their 11 and 8 bits; a wrong normalisation, layout or device transfer moves them by ~0.1.
@pytest.mark.parametrize("precision,atol", [("fp32", 5e-3), ("fp16", 2e-2), ("bf16", 5e-2)])
def test_predict_on_cuda_matches_the_cpu_reference(tiny_checkpoint, precision: str, atol: float) -> None:
    path, state = tiny_checkpoint
    # --decode cpu: this test is about the model's precision on the GPU; the GPU's decoding is tested below.
    done = run_cli("predict", "--weights", str(path), "--device", "cuda", "--precision", precision,
                   "--decode", "cpu", "--json", "--topk", "5", *EXAMPLES)
    assert done.returncode == 0, done.stderr
    assert f"for {precision} on cuda" in done.stderr  # auto's one line: the model ran on the GPU
    for result, expected in zip(json.loads(done.stdout), _expected_top(state, EXAMPLES, 5), strict=True):
        got = {t["index"]: t["probability"] for t in result["top"]}
        np.testing.assert_allclose([got[i] for i, _ in expected], [p for _, p in expected], atol=atol)


def test_embed_on_cuda_matches_the_float64_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, **TINY[SE])).eval()
    paths = [str(REPO / f) for f in EXAMPLES]
    got = np.stack([v for _, v in convnets.embed(model, paths, device="cuda", batch_size=2, decode="cpu")])
    expected = _independent(model, paths, 4, image_size=224)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.9999, cosine


def test_training_with_fp16_and_grad_scaler_learns_and_resumes(tmp_path: Path) -> None:
    data = make_digits(tmp_path / "data")
    out = tmp_path / "out"
    proc = run_train(*tiny_args(data, out, 8, "--device", "cuda"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert records[-1]["val_top1"] >= 90.0 and records[-1]["train_loss"] < records[0]["train_loss"] - 0.3
    ckpt = torch.load(out / "checkpoint.pth.tar", weights_only=True)
    assert ckpt["scaler"] is not None and ckpt["scaler"]["scale"] > 0  # fp16 autocast with a GradScaler
    model = convnets.load_model(out / "checkpoint.pth.tar")
    # The accuracy measured on the GPU under autocast agrees with fp32 on the CPU.
    assert abs(reference_top1(model, data / "val") - records[-1]["val_top1"]) <= 1.0

    proc = run_train(*tiny_args(data, out, 10, "--device", "cuda", "--resume", str(out / "checkpoint.pth.tar")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["epoch"] for r in read_metrics(out)] == list(range(1, 11))
    assert torch.load(out / "checkpoint.pth.tar", weights_only=True)["scaler"] is not None


# --- issue 38: JPEGs decoded and preprocessed on the GPU (convnets/preprocessing/device.py) ----------------
# nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: pixels may differ by a few uint8 levels where
# the CPU's decode_jpeg gives Pillow's bit for bit (tests/test_device_decode.py), so the bounds are wider here.
NVJPEG_MAX_LEVELS, NVJPEG_MEAN_LEVELS = 8, 0.5


def test_the_device_path_on_cuda_is_faithful_to_pillow(tmp_path: Path, decoded_on_device: list[int]) -> None:
    from processing_support import reference
    from PIL import Image
    from test_device_decode import ONE_LEVEL, cosine, photo_jpegs

    from convnets.inference.loader import Decoding, iter_batches
    from convnets.preprocessing.presets import DEFAULT_PRESET

    photos = photo_jpegs(tmp_path)
    expected = torch.stack([reference(Image.open(p).convert("RGB")) for p in photos])
    decoding = Decoding(DEFAULT_PRESET, decode="auto").for_device("cuda")
    assert decoding.decode == "device"
    (batch,) = iter_batches([(str(p), None) for p in photos], batch_size=len(photos), decoding=decoding, device="cuda")
    assert decoded_on_device == [len(photos)] and batch.tensor.is_cuda and not batch.errors
    got = batch.tensor.cpu()
    difference = (got - expected).abs()
    assert difference.max() <= NVJPEG_MAX_LEVELS * ONE_LEVEL, difference.amax(dim=(1, 2, 3))
    assert difference.mean() <= NVJPEG_MEAN_LEVELS * ONE_LEVEL
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, **TINY[SE])).eval()  # on the CPU, float32: preprocessing alone differs
    with torch.no_grad():
        logits, reference_logits = model(got), model(expected)
    assert cosine(logits, reference_logits).min() >= 0.999
    assert torch.equal(logits.argmax(1), reference_logits.argmax(1))


def test_predict_on_cuda_decodes_on_the_gpu_by_default_with_per_image_fallbacks(
        tiny_checkpoint, tmp_path: Path, decoded_on_device: list[int]) -> None:
    from conftest import cli_in_process
    from test_device_decode import fallback_inputs, photo_jpegs

    path, _ = tiny_checkpoint
    folder = tmp_path / "inputs"
    photo_jpegs(folder)
    for name, data in fallback_inputs(folder).items():
        (folder / name).write_bytes(data)
    records = {}
    for mode in ("auto", "cpu"):
        output = tmp_path / f"{mode}.jsonl"
        done = cli_in_process("predict", "--weights", str(path), "--device", "cuda", "--decode", mode, "--topk", "5",
                              "--batch-size", "16", "--no-progress", "--output", str(output), str(folder))
        assert done.returncode == 1, done.stderr[-2000:]  # the truncated and the text file
        records[mode] = {Path(r["input"]).name: r for r in map(json.loads, output.read_text().splitlines())}
    assert sum(decoded_on_device) == len(list(folder.glob("*"))) - 6  # the baseline JPEGs and the truncated one
    device, cpu = records["auto"], records["cpu"]
    assert list(device) == list(cpu)
    for name, record in cpu.items():
        if "error" in record:
            assert device[name]["error"] == record["error"]
            continue
        assert device[name]["top"][0]["index"] == record["top"][0]["index"], name
        got = {t["index"]: t["probability"] for t in device[name]["top"]}
        np.testing.assert_allclose([got[t["index"]] for t in record["top"]], [t["probability"] for t in record["top"]],
                                   atol=1e-2)


def test_evaluate_embed_and_serve_decode_on_the_gpu(tiny_checkpoint, tmp_path: Path,
                                                     decoded_on_device: list[int]) -> None:
    from test_device_decode import cosine, photo_jpegs

    from convnets.evaluation.loop import evaluate_model
    from convnets.serve.backend import Classifier
    from convnets.serve.repository import ServedModel

    path, _ = tiny_checkpoint
    photos = photo_jpegs(tmp_path / "photos", large=False)
    names = ["ant", "bee", "cat", "dog", "eel"]
    for name, photo in zip(names, photos):
        (tmp_path / "val" / name).mkdir(parents=True)
        (tmp_path / "val" / name / photo.name).write_bytes(photo.read_bytes())
    model = convnets.load_model(path)
    reports = {mode: evaluate_model(model, tmp_path / "val", workers=2, device="cuda", decode=mode)
               for mode in ("auto", "cpu")}
    assert reports["auto"].source["decode"] == "device" and decoded_on_device == [len(photos)]
    assert (reports["auto"].images, reports["auto"].top1) == (reports["cpu"].images, reports["cpu"].top1)
    vectors = {mode: np.stack([v for _, v in convnets.embed(model, [str(p) for p in photos], device="cuda",
                                                               decode=mode)]) for mode in ("auto", "cpu")}
    assert cosine(torch.from_numpy(vectors["auto"]), torch.from_numpy(vectors["cpu"])).min() >= 0.999
    decoded = {}
    for mode in ("auto", "cpu"):
        served = ServedModel(name="tiny", model="tiny", weights=str(path), pretrained=False, image_size=224,
                             engine="torch", precision="fp16", device="cuda", topk=3, threads=2, max_batch_size=8,
                             max_queue_delay_us=0, max_image_bytes=2**24, labels=tuple(names), num_features=0,
                             decode=mode)
        classifier = Classifier(served)
        decoded[mode] = classifier.decode([p.read_bytes() for p in photos] + [b"not an image"])
        assert classifier.run(decoded[mode].tensor)["probabilities"].shape == (len(photos), len(names))
    assert decoded["auto"].tensor.is_cuda and decoded["auto"].rows == decoded["cpu"].rows
    assert decoded["auto"].errors == decoded["cpu"].errors and len(photos) in decoded["cpu"].errors
    assert (decoded["auto"].tensor.cpu() - decoded["cpu"].tensor.cpu()).abs().mean() <= NVJPEG_MEAN_LEVELS / 255 / 0.225
