"""How results show themselves to a person: ``convnets.predict``'s list as HTML in Jupyter and as text
elsewhere, ``--topk``'s default for models with few classes, and rates below one image per second."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from conftest import REPO, TINY, randomize_bn
from PIL import Image
from reference import reference_forward

import convnets
from convnets.cli import main
from convnets.inference.predict import predictions_html
from convnets.train.metrics import format_rate

SE = "se_resnext101_32x4d"
PHOTOS = [REPO / "examples" / name for name in ("chelsea.png", "coffee.png", "rocket.jpg")]
UPSTREAM = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                      T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
LABELS = ["<b>bold</b> & co", "plain", "third"]


@pytest.fixture(scope="module")
def model() -> convnets.ResNet:
    torch.manual_seed(0)
    return randomize_bn(convnets.get_model(SE, num_classes=3, **TINY[SE])).eval()


def _images(html: str) -> list[Image.Image]:
    return [Image.open(io.BytesIO(base64.b64decode(data)))
            for data in re.findall(r'<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)"', html)]


def test_predictions_show_as_a_table_of_thumbnails_classes_and_bars(model: convnets.ResNet) -> None:
    results = convnets.predict(model, [str(p) for p in PHOTOS], labels=LABELS, topk=3)
    html = results._repr_html_()
    # One thumbnail per photo: upstream's display (img.thumbnail((128, 128)), LANCZOS), up to JPEG's loss.
    thumbnails = _images(html)
    assert len(thumbnails) == len(PHOTOS)
    for photo, shown in zip(PHOTOS, thumbnails):
        expected = Image.open(photo).convert("RGB")
        expected.thumbnail((128, 128), Image.LANCZOS)
        assert shown.size == expected.size
        squared = (np.asarray(shown, dtype=np.float64) - np.asarray(expected, dtype=np.float64)) ** 2
        assert 10 * np.log10(255 ** 2 / squared.mean()) > 28, photo  # PSNR in dB: the same picture
    # The classes and their probabilities, by an independent forward pass (PIL + torchvision, functional).
    batch = torch.stack([UPSTREAM(Image.open(p).convert("RGB")) for p in PHOTOS])
    probabilities = torch.softmax(reference_forward(model.state_dict(), batch), dim=1)
    percents = [float(p) for p in re.findall(r">(\d+\.\d\d)%<", html)]
    widths = [float(w) for w in re.findall(r"width:(\d+\.\d)%", html)]
    expected = [float(p) for row in probabilities for p in row.sort(descending=True).values]
    np.testing.assert_allclose(percents, [100 * p for p in expected], atol=0.011)
    np.testing.assert_allclose(widths, [100 * p for p in expected], atol=0.051)  # the bars' lengths
    # Names are text, never markup.
    assert "<b>bold</b>" not in html and "&lt;b&gt;bold&lt;/b&gt; &amp; co" in html
    assert all(p.name in html for p in PHOTOS)
    # A single prediction shows the same way, as its own table.
    assert _images(results[0]._repr_html_())[0].size == thumbnails[0].size


def test_elsewhere_they_print_as_the_command_line_does(model: convnets.ResNet) -> None:
    results = convnets.predict(model, str(PHOTOS[0]), labels=LABELS, topk=2)
    lines = str(results).splitlines()
    assert lines[0] == str(PHOTOS[0]) and len(lines) == 3
    top = results[0].top[0]
    assert re.fullmatch(rf"\s+1\.\s+{100 * top.probability:.2f}%\s+{re.escape(top.label)}\s+\[{top.index}\]", lines[1])
    assert repr(results) == str(results)  # what a terminal's REPL shows


def test_an_unreadable_input_keeps_its_row_with_the_reason(model: convnets.ResNet, tmp_path: Path) -> None:
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a picture")
    results = convnets.predict(model, [str(PHOTOS[0]), str(broken)], labels=LABELS)
    html = results._repr_html_()
    assert len(_images(html)) == 1
    (row,) = [r for r in html.split("<tr") if "broken.png" in r and "#fadede" in r]  # tinted, as on a sheet
    assert "not a recognised image format" in row
    assert "error:" in str(results).splitlines()[-1]


def test_a_long_list_shows_its_first_rows_and_counts_the_rest(model: convnets.ResNet) -> None:
    results = convnets.predict(model, [str(PHOTOS[0])] * 3, labels=LABELS)
    html = predictions_html(results, max_rows=2)
    assert len(_images(html)) == 2 and "and 1 more" in html


@pytest.fixture(scope="module")
def two_classes(tmp_path_factory: pytest.TempPathFactory, model: convnets.ResNet) -> Path:
    """A checkpoint fine-tuned on two classes, as `convnets train` writes it."""
    torch.manual_seed(1)
    small = randomize_bn(convnets.get_model(SE, num_classes=2, **TINY[SE]))
    path = tmp_path_factory.mktemp("two") / "checkpoint.pth.tar"
    torch.save({"state_dict": small.state_dict(), "arch_spec": small.spec.to_dict(), "class_names": ["no", "yes"],
                "epoch": 1}, path)
    return path


def test_topk_defaults_to_every_class_of_a_small_model(two_classes: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "--weights", str(two_classes), "--engine", "torch", "--jsonl", str(PHOTOS[0])]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(t["label"] for t in record["top"]) == ["no", "yes"]


def test_an_explicit_topk_above_the_classes_is_still_an_error(two_classes: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["predict", "--weights", str(two_classes), "--engine", "torch", "--topk", "3", str(PHOTOS[0])]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "convnets predict: error: --topk 3 is more than the 2 classes of the model; use --topk 2 or less")


@pytest.mark.parametrize("rate, shown", [(123.4, "123"), (1.0, "1"), (0.37, "0.37"), (0.0041, "0.0041"),
                                         (0.999, "1"), (0.0, "0")])
def test_rates_below_one_keep_two_significant_digits(rate: float, shown: str) -> None:
    assert format_rate(rate) == shown


def test_the_default_topk_is_what_a_resumed_csv_holds(two_classes: Path, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A CSV record is complete with topk rows: with a default above the model's 2 classes, --resume would
    take the first run's complete record for a torn one and cut it away."""
    out = tmp_path / "p.csv"
    first = ["predict", "--weights", str(two_classes), "--engine", "torch", "--output", str(out)]
    assert main([*first, str(PHOTOS[0])]) == 0
    assert main([*first, "--resume", str(PHOTOS[0]), str(PHOTOS[1])]) == 0
    rows = out.read_text().splitlines()[1:]
    assert len(rows) == 2 * 2  # two inputs, two classes each
    assert "torn tail" not in caplog.text
