"""Explanations (``convnets explain``, ``convnets.explain``): the heat maps point at the evidence, equal
pytorch-grad-cam's own on the same model and tensor, land in the image where the crop came from, and the command
writes them named after the inputs, with a record, refusing to overwrite.

The proof: a tiny model learns four patterns, each in its own quarter of the image, any subset per image (a
multi-label task: each pattern's presence is independent of the others', so its only evidence is in its
quarter); for each pattern present, most of its class's heat must lie in that quarter.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from conftest import TINY, cli_in_process, command_lines, randomize_bn
from PIL import Image
from strict_skips import require_module

import convnets



@pytest.fixture(scope="module", autouse=True)
def grad_cam() -> None:
    """pytorch-grad-cam (the explain extra), imported by the worker that runs these tests only: it imports
    OpenCV, scikit-learn and matplotlib, seconds that every worker would pay at collection."""
    require_module("pytorch_grad_cam", extra="explain")

SIZE = 64  # px: the tiny model's input; its layer2 map is 8x8 (the default layer at this size)
HALF = SIZE // 2
SIDE = SIZE * 5 // 16  # a pattern's side: 20 px in a 32 px quarter
NAMES = ["square", "checks", "stripes", "cross"]  # pattern k lives in quarter k: 0 top-left, 1 top-right, ...
COLOURS = np.array([[0.95, 0.95, 0.95], [0.95, 0.2, 0.2], [0.2, 0.95, 0.2], [0.3, 0.3, 0.95]])
ARCH = {"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128], "expansion": 1, "stem_width": 16}
EXAMPLES = Path(convnets.__file__).parent / "assets" / "examples"


def quarter(k: int) -> tuple[slice, slice]:
    """Rows and columns of quarter ``k`` of an image of SIZE."""
    x0, y0 = (k % 2) * HALF, (k // 2) * HALF
    return slice(y0, y0 + HALF), slice(x0, x0 + HALF)


def pattern(k: int) -> np.ndarray:
    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    return [np.ones((SIDE, SIDE), bool), (yy // 4 + xx // 4) % 2 == 1, (yy // 4) % 2 == 1,
            (abs(yy - SIDE // 2) <= 2) | (abs(xx - SIDE // 2) <= 2)][k]


def picture(rng: np.random.Generator, present: list[int]) -> Image.Image:
    """Noise, and each present pattern somewhere inside its quarter."""
    pixels = rng.normal(0.4, 0.12, (SIZE, SIZE, 3))
    for k in present:
        rows, cols = quarter(k)
        y, x = rows.start + rng.integers(1, HALF - SIDE - 1), cols.start + rng.integers(1, HALF - SIDE - 1)
        pixels[y:y + SIDE, x:x + SIDE] = np.where(pattern(k)[..., None], COLOURS[k], 0.05)
    return Image.fromarray((np.clip(pixels, 0, 1) * 255).astype(np.uint8))


def draw(rng: np.random.Generator, n: int) -> list[list[int]]:
    return [[k for k in range(4) if row[k]] for row in rng.random((n, 4)) < 0.5]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny model trained in this process on one thread (BCE on logits, a few seconds), its checkpoint as
    ``convnets train`` records one (architecture, class names, image size), and 40 validation images."""
    from convnets.preprocessing.presets import EvalPreset
    from convnets.preprocessing.transforms import preprocess_image

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        model = convnets.get_model("resnet50", num_classes=4, **ARCH)
        preset = EvalPreset.for_image_size(SIZE)
        present = draw(rng, 256)
        x = torch.stack([preprocess_image(picture(rng, p), preset=preset) for p in present])
        y = torch.zeros(len(present), 4)
        for i, p in enumerate(present):
            y[i, p] = 1
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model.train()
        for _ in range(5):
            for batch in torch.randperm(len(x)).split(32):
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[batch]), y[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    finally:
        torch.set_num_threads(before)
    model.eval()
    model.class_names, model.input_size = list(NAMES), SIZE
    model.multilabel = True  # sigmoid scores (convnets.explanations.class_scores)
    folder = tmp_path_factory.mktemp("patterns")
    val = draw(rng, 40)
    paths = []
    for i, p in enumerate(val):
        paths.append(folder / f"{i:02d}.png")
        picture(rng, p).save(paths[-1])
    checkpoint = folder / "model.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(), "class_names": NAMES,
                "config": {"image_size": SIZE}}, checkpoint)
    return {"model": model, "paths": paths, "present": val, "checkpoint": checkpoint}


def upstream(size: int) -> T.Compose:
    """The evaluation preprocessing by torchvision alone (shorter side to size*256/224, center crop, ImageNet)."""
    return T.Compose([T.Resize(round(size * 256 / 224)), T.CenterCrop(size), T.ToTensor(),
                      T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def test_the_heat_of_each_present_pattern_lies_in_its_quarter(trained) -> None:
    model, paths, present = trained["model"], trained["paths"], trained["present"]
    with torch.no_grad():  # the model sees the patterns (else where its heat lies proves nothing)
        scores = torch.sigmoid(model(torch.stack([upstream(SIZE)(Image.open(p).convert("RGB")) for p in paths])))
    truth = torch.tensor([[k in p for k in range(4)] for p in present])
    assert ((scores > 0.5) == truth).float().mean() >= 0.9
    maps = convnets.explain(model, [str(p) for p in paths], classes=NAMES)
    assert [(e.input, e.index) for e in maps] == [(str(p), k) for p in paths for k in range(4)]
    heat = {(e.input, e.index): e.heatmap for e in maps}
    shares = []
    for path, classes in zip(paths, present):
        for k in classes:
            h = heat[str(path), k]
            assert h.shape == (SIZE, SIZE) and h.dtype == np.float32 and 0 <= h.min() and h.max() <= 1
            shares.append(h[quarter(k)].sum() / h.sum())
    shares = np.array(shares)
    assert len(shares) >= 60
    assert (shares >= 0.5).mean() >= 0.8, np.round(shares, 2)


@pytest.mark.parametrize("name", sorted(TINY))
def test_maps_equal_pytorch_grad_cams_on_the_same_model_and_tensor(name: str) -> None:
    """Every architecture: the crop's map is what pytorch-grad-cam computes itself on a tensor that torchvision
    preprocessed; the image's map is that map put back where the crop came from; the classes are the top-k."""
    from pytorch_grad_cam import GradCAM, HiResCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(name, num_classes=6, **TINY[name])).eval()
    size = 64
    files = [EXAMPLES / "chelsea.png", EXAMPLES / "rocket.jpg"]  # 451x300 and 640x427: wide, odd sizes
    maps = convnets.explain(model, [str(f) for f in files], topk=2, method="gradcam", layer="layer4", image_size=size)
    tensor = torch.stack([upstream(size)(Image.open(f).convert("RGB")) for f in files])
    with torch.no_grad():
        top = torch.softmax(model(tensor), dim=1).topk(2, dim=1)
    assert [(e.input, e.index) for e in maps] == [(str(f), int(i)) for f, row in zip(files, top.indices) for i in row]
    np.testing.assert_allclose([e.score for e in maps], top.values.flatten().numpy(), rtol=1e-4)
    expected = GradCAM(model=model, target_layers=[model.layer4[-1]])(
        input_tensor=tensor.repeat_interleave(2, dim=0), targets=[ClassifierOutputTarget(e.index) for e in maps])
    for e, want in zip(maps, expected):
        assert e.crop_heatmap.shape == (size, size)
        np.testing.assert_allclose(e.crop_heatmap, want, atol=2e-3)
        width, height = Image.open(e.input).size
        assert e.heatmap.shape == (height, width)
        # The image's map, resized and cropped as the image was (torchvision), is the crop's map again.
        again = TF.center_crop(TF.resize(torch.from_numpy(e.heatmap)[None], [round(size * 256 / 224)],
                                         antialias=True), [size, size])[0].numpy()
        assert np.abs(again - e.crop_heatmap).mean() < 0.02
        left, _, right, _ = e.box
        assert e.heatmap[:, :left].max(initial=0) == 0 and e.heatmap[:, right:].max(initial=0) == 0
    # The default method at the last stage: HiResCAM, whose map there is Grad-CAM's (the gradient is the same
    # at every position of the last stage's map).
    default = convnets.explain(model, str(files[0]), classes=[3], layer="layer4", image_size=size)[0]
    targets = [ClassifierOutputTarget(3)]
    hires = HiResCAM(model=model, target_layers=[model.layer4[-1]])(input_tensor=tensor[:1], targets=targets)[0]
    grad = GradCAM(model=model, target_layers=[model.layer4[-1]])(input_tensor=tensor[:1], targets=targets)[0]
    assert default.method == "hirescam"
    np.testing.assert_allclose(default.crop_heatmap, hires, atol=2e-3)
    np.testing.assert_allclose(hires, grad, atol=1e-4)


def test_command_writes_files_named_after_inputs_with_a_record_and_refuses_to_overwrite(trained,
                                                                                      tmp_path: Path) -> None:
    first, second = trained["paths"][:2]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    inputs = [tmp_path / "a" / "x.png", tmp_path / "b" / "x.png", tmp_path / "odd name\x01.png"]
    for source, target in zip([first, second, first], inputs):
        shutil.copyfile(source, target)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    out = tmp_path / "heat"
    args = ["explain", *map(str, inputs), str(broken), "--weights", str(trained["checkpoint"]), "--class",
            "cross,square", "--class", "2", "--output", str(out), "--device", "cpu"]
    done = cli_in_process(*args)
    assert done.returncode == 1, done.stderr  # the broken input: one line, the others explained
    errors = [line for line in command_lines(done.stderr) if "error:" in line]
    assert len(errors) == 1 and "broken.png" in errors[0], done.stderr
    record = json.loads((out / "explanations.json").read_text(encoding="utf-8"))
    assert record["method"] == "hirescam" and record["layer"] == "layer2" and record["crop_size"] == SIZE
    assert [e["error"] for e in record["errors"]] and record["errors"][0]["input"] == str(broken)
    stems = ["x", "x-2", "odd_name_"]
    classes = [(3, "cross"), (0, "square"), (2, "stripes")]
    assert [(e["input"], e["index"], e["label"]) for e in record["explanations"]] == [
        (str(i), k, n) for i in inputs for k, n in classes]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["explanations.json", *(f"{s}.{k}-{n}.{x}" for s in stems for k, n in classes for x in ("npy", "png"))])
    tensor = torch.stack([upstream(SIZE)(Image.open(i).convert("RGB")) for i in inputs])
    with torch.no_grad():  # the checkpoint does not say multi-label: softmax scores
        softmax = torch.softmax(trained["model"](tensor), dim=1)
    api = convnets.explain(trained["model"], [str(i) for i in inputs], classes=[3, 0, 2])
    for e, entry in zip(api, record["explanations"]):
        row = inputs.index(Path(entry["input"]))
        assert entry["score"] == pytest.approx(float(softmax[row, entry["index"]]), rel=1e-4)
        heat = np.load(out / entry["heatmap"])
        assert heat.shape == (SIZE, SIZE) and entry["image_size"] == [SIZE, SIZE]
        np.testing.assert_allclose(heat, e.heatmap, atol=1e-5)
        assert Image.open(out / entry["overlay"]).size == (SIZE, SIZE)
    again = cli_in_process(*args)
    assert again.returncode == 2 and "--force" in again.stderr and "explanations.json" in again.stderr
    (out / "explanations.json").unlink()
    again = cli_in_process(*args)  # a heat map of the first run is in the way
    assert again.returncode == 1 and "--force" in again.stderr and "x.3-cross" in again.stderr
    assert cli_in_process(*args, "--force").returncode == 1  # replaced; the broken input still fails


def test_without_output_it_writes_to_explanations_and_greys_what_the_crop_left_out(trained, tmp_path: Path) -> None:
    """A wide image: the center crop leaves out its sides. Where they are is found with torchvision's own resize and
    crop of an image whose red channel is each pixel's column; there the overlay is the image in grey (R = G = B,
    halfway to white), inside it pytorch-grad-cam's blend of the image and the heat map."""
    from pytorch_grad_cam.utils.image import show_cam_on_image

    rng = np.random.default_rng(1)
    width, height = 2 * SIZE, SIZE
    wide = np.concatenate([np.asarray(picture(rng, [0, 3])), np.asarray(picture(rng, [1, 2]))], axis=1)
    Image.fromarray(wide).save(tmp_path / "wide.png")
    done = cli_in_process("explain", str(tmp_path / "wide.png"), "--weights", str(trained["checkpoint"]), "--class",
                          "checks", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "explanations"  # the default --output, in the current directory
    assert sorted(p.name for p in out.iterdir()) == ["explanations.json", "wide.1-checks.npy", "wide.1-checks.png"]
    overlay = np.asarray(Image.open(out / "wide.1-checks.png").convert("RGB")).astype(int)
    heat = np.load(out / "wide.1-checks.npy")
    columns = np.repeat(np.arange(width, dtype=np.uint8)[None, :, None], height, axis=0)
    seen = np.asarray(TF.center_crop(TF.resize(Image.fromarray(np.repeat(columns, 3, axis=2)),
                                               round(SIZE * 256 / 224)), [SIZE, SIZE]))[..., 0]
    first, last = int(seen.min()), int(seen.max())  # the columns the model saw
    assert 10 < first and last < width - 10
    outside = np.r_[0:first - 2, last + 3:width]
    luma = wide[:, outside].astype(np.float64) @ [0.299, 0.587, 0.114]
    expected = np.round(127.5 + luma / 2)
    for channel in range(3):
        np.testing.assert_allclose(overlay[:, outside, channel], expected, atol=1)
    inside = np.s_[8:height - 8, first + 3:last - 2]
    blend = show_cam_on_image(wide.astype(np.float32) / 255, heat, use_rgb=True)
    np.testing.assert_array_equal(overlay[inside], blend[inside])
    assert (np.ptp(overlay[inside], axis=-1) > 8).mean() > 0.9  # in colour, unlike the grey outside


def test_bad_classes_and_a_missing_extra_are_one_clear_error(trained, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(trained["paths"][0])
    base = ["explain", path, "--weights", str(trained["checkpoint"]), "--output", str(tmp_path / "o")]
    done = cli_in_process(*base, "--class", "dots")
    assert done.returncode == 1 and command_lines(done.stderr) == [
        ("convnets explain: error: --class: 'dots' is neither a class of the model ('square', 'checks', 'stripes', "
         "'cross') nor a class index")]
    done = cli_in_process(*base, "--class", "4")
    assert done.returncode == 1 and "--class: class index '4' is out of range" in done.stderr
    assert cli_in_process(*base, "--class", "0", "--topk", "2").returncode == 2  # one or the other
    with pytest.raises(convnets.InvalidArgumentError, match="method must be one of"):
        convnets.explain(trained["model"], path, method="scorecam")
    monkeypatch.setitem(sys.modules, "pytorch_grad_cam", None)
    with pytest.raises(convnets.MissingDependencyError, match="install the 'explain' extra"):
        convnets.explain(trained["model"], path)


def test_predictions_show_their_heat_maps_beside_the_thumbnails(trained) -> None:
    model, paths = trained["model"], [str(p) for p in trained["paths"][:3]]
    predictions = convnets.predict(model, paths, topk=3)
    explained = predictions.explain(model, topk=2)
    assert [p.top for p in explained] == [p.top for p in predictions]
    assert [[e.index for e in p.explanations] for p in explained] == [[t.index for t in p.top[:2]] for p in predictions]
    # each row: its thumbnail, then an overlay per explained class
    assert explained._repr_html_().count("<img") == predictions._repr_html_().count("<img") + 2 * len(paths)


def test_default_classes_are_the_best_or_a_multilabel_models_labels_above_their_thresholds(trained,
                                                                                        monkeypatch) -> None:
    from convnets.explanations import default_targets

    scores = [0.2, 0.9, 0.6, 0.1]
    assert default_targets(scores) == [1]
    assert default_targets(scores, topk=3) == [1, 2, 0]
    assert default_targets(scores, thresholds=[0.5, 0.5, 0.5, 0.05]) == [1, 2, 3]
    assert default_targets(scores, thresholds=[0.95] * 4) == [1]  # none reaches its threshold: the best one
    model, paths = trained["model"], [str(p) for p in trained["paths"][:4]]
    monkeypatch.setattr(model, "thresholds", [0.5] * 4, raising=False)
    with torch.no_grad():
        sigmoid = torch.sigmoid(model(torch.stack([upstream(SIZE)(Image.open(p).convert("RGB")) for p in paths])))
    expected = [(p, int(k)) for p, row in zip(paths, sigmoid) for k in row.argsort(descending=True) if row[k] >= 0.5]
    assert len(expected) > len(paths)  # several labels in some image
    assert [(e.input, e.index) for e in convnets.explain(model, paths)] == expected
