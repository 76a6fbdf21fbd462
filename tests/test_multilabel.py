"""Multi-label fine-tuning end to end: ``convnets train --multilabel`` on a synthetic set whose labels are
decided by patterns in known regions (tests/multilabel_support.py), then ``evaluate`` checked against
scikit-learn on ``predict``'s outputs, ``predict`` in every format and in Python, ``embed`` and the serve
backend; exact resume; the figures (AP, thresholds) against scikit-learn on random scores with ties."""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_process
from multilabel_support import MultiLabelData, make_multilabel
from sklearn.metrics import average_precision_score, f1_score, precision_score, recall_score

import convnets
from convnets.data.multilabel import multilabel_set
from convnets.errors import DataError
from convnets.evaluation.multilabel import average_precision, choose_thresholds
from convnets.train import TrainConfig, fit
from convnets.train.recipe import MultiLabelLoss, mixup

TINY = {"layers": [1, 1, 1, 1], "widths": [16, 32, 64, 128], "expansion": 1, "stem_width": 16}
EPOCHS = 10


def train_args(data: MultiLabelData, out: Path, epochs: int = EPOCHS) -> list[str]:
    return ["--data", str(data.root), "--labels", str(data.labels), "--multilabel", "--output", str(out),
            "--arch", "resnet50", "--arch-kwargs", json.dumps(TINY), "--image-size", "32", "--batch-size", "16",
            "--epochs", str(epochs), "--lr", "0.1", "--warmup-epochs", "1", "--workers", "0", "--no-progress",
            "--no-tensorboard", "--no-amp"]  # fp32: validation scores are predict's (bf16 where the CPU has it)


@dataclass(frozen=True)
class Run:
    data: MultiLabelData
    out: Path
    predictions: list[dict]  # predict's JSONL records of the val images, every class


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = tmp_path_factory.mktemp("multilabel")
    data = make_multilabel(root / "data", n_train=64, n_val=32)
    out = root / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        proc = cli_in_process("train", *train_args(data, out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "val mAP" in proc.stdout
        val = [str(p) for p, _ in data.images["val"]]
        proc = cli_in_process("predict", *val, "--weights", str(out / "model_best.pth.tar"), "--topk", "4",
                              "--engine", "torch", "--workers", "0", "--output", str(root / "val.jsonl"))
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    return Run(data, out, records)


def probabilities(records: list[dict], classes: list[str]) -> np.ndarray:
    """``[images, classes]`` from records whose ``top`` holds every class."""
    out = np.zeros((len(records), len(classes)))
    for i, r in enumerate(records):
        for t in r["top"]:
            assert classes[t["index"]] == t["label"]
            out[i, t["index"]] = t["probability"]
    return out


def truth(data: MultiLabelData, split: str = "val") -> np.ndarray:
    return np.array([[c in labels for c in data.classes] for _, labels in data.images[split]], dtype=int)


def test_the_checkpoints_record_the_classes_and_the_thresholds_that_maximise_each_class_f1(run: Run) -> None:
    ckpt = torch.load(run.out / "model_best.pth.tar", weights_only=True)
    assert ckpt["multilabel"] is True and ckpt["class_names"] == sorted(run.data.classes)
    thresholds = ckpt["thresholds"]
    assert len(thresholds) == 4
    for path in (run.out / "model_best.pth.tar", run.out / "model_best.safetensors"):
        model = convnets.load_model(path)
        assert model.multilabel and model.thresholds == pytest.approx(thresholds, abs=1e-12)
    # The stored thresholds: of every cut of the validation scores, one of highest F1 (scikit-learn's).
    scores, y = probabilities(run.predictions, run.data.classes), truth(run.data)
    for c in range(4):
        best = max(f1_score(y[:, c], scores[:, c] >= t) for t in [*np.unique(scores[:, c]), 1.1])
        assert f1_score(y[:, c], scores[:, c] >= thresholds[c]) == pytest.approx(best, abs=1e-9)
    # The best epoch was chosen by the validation mAP that metrics.jsonl records: model_best's, by scikit-learn.
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == EPOCHS and all("val_mAP" in r and "val_top1" not in r for r in records)
    best_record = records[ckpt["best_epoch"] - 1]
    assert best_record["val_mAP"] == max(r["val_mAP"] for r in records) == pytest.approx(ckpt["best_top1"])
    assert best_record["val_mAP"] == pytest.approx(average_precision_score(y, scores, average="macro"), abs=1e-5)
    assert best_record["val_mAP"] > 0.85  # it learned the patterns


def test_evaluate_reports_what_scikit_learn_computes_from_predict_s_outputs(run: Run, tmp_path: Path) -> None:
    proc = cli_in_process("evaluate", "--data", str(run.data.root), "--labels", str(run.data.labels), "--weights",
                          str(run.out / "model_best.pth.tar"), "--engine", "torch", "--workers", "0",
                          "--output", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mAP" in proc.stdout and "threshold" in proc.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert (tmp_path / "report" / "ap.png").read_bytes().startswith(b"\x89PNG")
    assert report["multilabel"] is True and report["images"] == 32 and report["split"] == "val"
    thresholds = torch.load(run.out / "model_best.pth.tar", weights_only=True)["thresholds"]
    scores, y = probabilities(run.predictions, run.data.classes), truth(run.data)
    predicted = scores >= np.array(thresholds)
    # predict's labels are the classes at or above their thresholds, most probable first.
    for i, r in enumerate(run.predictions):
        assert sorted(r["labels"]) == [c for k, c in enumerate(run.data.classes) if predicted[i, k]]
        assert [scores[i, run.data.classes.index(c)] for c in r["labels"]] == sorted(
            scores[i, predicted[i]], reverse=True)
    expected = {
        "mAP": average_precision_score(y, scores, average="macro"),
        "micro_AP": average_precision_score(y, scores, average="micro"),
        "macro_f1": f1_score(y, predicted, average="macro", zero_division=0),
        "micro_f1": f1_score(y, predicted, average="micro", zero_division=0),
        "macro_precision": precision_score(y, predicted, average="macro", zero_division=0),
        "micro_precision": precision_score(y, predicted, average="micro", zero_division=0),
        "macro_recall": recall_score(y, predicted, average="macro", zero_division=0),
        "micro_recall": recall_score(y, predicted, average="micro", zero_division=0),
    }
    for key, value in expected.items():
        assert report[key] == pytest.approx(value, abs=1e-6), key
    per_class = {"ap": average_precision_score(y, scores, average=None),
                 "f1": f1_score(y, predicted, average=None, zero_division=0),
                 "precision": precision_score(y, predicted, average=None, zero_division=0),
                 "recall": recall_score(y, predicted, average=None, zero_division=0)}
    assert [c["name"] for c in report["classes"]] == run.data.classes
    for key, values in per_class.items():
        assert [c[key] for c in report["classes"]] == pytest.approx(list(values), abs=1e-6), key
    assert [c["support"] for c in report["classes"]] == list(y.sum(0))
    assert [c["threshold"] for c in report["classes"]] == pytest.approx(thresholds)


def test_predict_gives_the_several_labels_of_images_with_several_patterns(run: Run) -> None:
    expected = [set(labels) for _, labels in run.data.images["val"]]
    given = [set(r["labels"]) for r in run.predictions]
    several = [i for i, e in enumerate(expected) if len(e) >= 2]
    assert len(several) >= 8
    assert sum(len(given[i]) >= 2 for i in several) >= 0.8 * len(several)
    assert sum(given[i] == expected[i] for i in range(len(expected))) >= 0.6 * len(expected)
    # The top classes keep their sigmoid probabilities: they need not sum to 1.
    assert any(abs(sum(t["probability"] for t in r["top"]) - 1) > 0.1 for r in run.predictions)


def test_every_output_format_and_the_python_api_carry_the_labels(run: Run, tmp_path: Path) -> None:
    val = [str(p) for p, _ in run.data.images["val"][:6]]
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    jsonl = {r["input"]: r for r in run.predictions}
    for suffix in (".csv", ".parquet"):
        out = tmp_path / f"p{suffix}"
        proc = cli_in_process("predict", *val, str(bad), "--weights", str(run.out / "model_best.pth.tar"),
                              "--topk", "2", "--engine", "torch", "--workers", "0", "--output", str(out))
        assert proc.returncode == 1 and "bad.png" in proc.stderr  # the unreadable input; the others predicted
        if suffix == ".csv":
            with open(out, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            assert list(rows[0]) == ["input", "rank", "index", "label", "probability", "error", "labels"]
            labels = {r["input"]: r["labels"].split(";") if r["labels"] else [] for r in rows if r["rank"] == "1"}
        else:
            import pyarrow.parquet as pq

            labels = {r["input"]: r["labels"] for r in pq.read_table(out).to_pylist() if r["error"] is None}
        assert labels == {name: jsonl[name]["labels"] for name in val}
    model = convnets.load_model(run.out / "model_best.pth.tar")
    results = convnets.predict(model, val, topk=2)
    assert [p.labels for p in results] == [jsonl[name]["labels"] for name in val]
    np.testing.assert_allclose([[t.probability for t in p.top] for p in results],
                               [[t["probability"] for t in jsonl[name]["top"][:2]] for name in val], atol=1e-6)
    with_two = next(p for p in results if len(p.labels or []) >= 2)
    html = with_two._repr_html_()
    assert "labels:" in html and all(f"<b>{name}</b>" in html for name in with_two.labels)
    assert f"labels: {', '.join(with_two.labels)}" in str(with_two)


def test_embed_and_the_serve_backend_answer_as_predict(run: Run) -> None:
    from convnets.serve.backend import Classifier
    from convnets.serve.repository import ServedModel

    checkpoint = run.out / "model_best.pth.tar"
    model = convnets.load_model(checkpoint)
    val = [p for p, _ in run.data.images["val"][:8]]
    jsonl = {r["input"]: r for r in run.predictions}
    # embed: the pooled features, whose classifier and sigmoid give predict's probabilities.
    vectors = np.stack([v for _, v in convnets.embed(model, [str(p) for p in val])])
    with torch.no_grad():
        from_features = torch.sigmoid(model.fc(torch.from_numpy(vectors))).numpy()
    expected = probabilities([jsonl[str(p)] for p in val], run.data.classes)
    np.testing.assert_allclose(from_features, expected, atol=1e-5)
    # The served model (the backend's Classifier, in this process): sigmoid probabilities and the labels.
    served = ServedModel(name="tiny", model="tiny", weights=str(checkpoint), pretrained=False, image_size=32,
                         engine="torch", precision="fp32", device="cpu", topk=2, threads=1, max_batch_size=8,
                         max_queue_delay_us=0, max_image_bytes=2**20, labels=tuple(model.class_names),
                         num_features=model.num_features, thresholds=tuple(model.thresholds))
    assert served.outputs()[-1] == "labels" and ServedModel.from_json(served.to_json()) == served
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from convnets.serve.repository import model_config

    config = text_format.Parse(model_config(served), model_config_pb2.ModelConfig())
    assert [(o.name, list(o.dims)) for o in config.output][-1] == ("labels", [4])
    assert json.loads(config.parameters["thresholds"].string_value) == pytest.approx(model.thresholds)
    classifier = Classifier(served)
    decoded = classifier.decode([p.read_bytes() for p in val])
    outputs = classifier.run(decoded.tensor)
    np.testing.assert_allclose(outputs["probabilities"], expected, atol=1e-5)
    answered = [[b.decode() for b in row if b] for row in outputs["labels"]]
    assert answered == [jsonl[str(p)]["labels"] for p in val]


def test_a_resumed_multilabel_run_ends_as_an_uninterrupted_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped right after its first checkpoint (as a crash would), resumed: the same weights, EMA,
    thresholds and metrics as a run that was not stopped; MixUp on."""
    from convnets.train import loop

    data = make_multilabel(tmp_path / "data", n_train=32, n_val=16)
    common = dict(data=data.root, labels=data.labels, multilabel=True, arch="resnet50", arch_kwargs=TINY,
                  image_size=32, batch_size=16, epochs=3, lr=0.1, workers=0, amp=False, progress=False,
                  tensorboard=False, mixup=0.2, ema=0.9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fit(TrainConfig(output=tmp_path / "whole", **common))
        real = loop.append_metrics

        def crash(*args: object) -> None:
            real(*args)
            raise KeyboardInterrupt  # after epoch 1's checkpoint and metrics line

        monkeypatch.setattr(loop, "append_metrics", crash)
        with pytest.raises(KeyboardInterrupt):
            fit(TrainConfig(output=tmp_path / "broken", **common))
        monkeypatch.setattr(loop, "append_metrics", real)
        assert torch.load(tmp_path / "broken" / "checkpoint.pth.tar", weights_only=True)["epoch"] == 1
        torch.manual_seed(99)  # as a new process: other global states
        fit(TrainConfig(output=tmp_path / "broken", resume=tmp_path / "broken" / "checkpoint.pth.tar", **common))
        # train --evaluate: the checkpoint's weights and EMA validated again, as the run's last epoch did.
        only = fit(TrainConfig(evaluate=True, resume=tmp_path / "whole" / "checkpoint.pth.tar",
                               **{k: v for k, v in common.items() if k not in ("epochs", "mixup", "ema", "lr")}))
    finally:
        torch.set_num_threads(threads)
    a = torch.load(tmp_path / "whole" / "checkpoint.pth.tar", weights_only=True)
    b = torch.load(tmp_path / "broken" / "checkpoint.pth.tar", weights_only=True)
    assert a["epoch"] == b["epoch"] == 3 and a["multilabel"] and b["multilabel"]
    for key in ("state_dict", "state_dict_ema"):
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=0, atol=1e-6, msg=f"{key} {name}")
    assert b["thresholds"] == pytest.approx(a["thresholds"], abs=1e-6)
    timing = {"img_per_s", "epoch_seconds"}
    assert [{k: v for k, v in r.items() if k not in timing} for r in b["history"]] == \
        [{k: v for k, v in r.items() if k not in timing} for r in a["history"]]
    last = a["history"][-1]
    for key in ("val_mAP", "val_f1", "ema_val_mAP", "ema_val_f1"):
        assert only.metrics[key] == pytest.approx(last[key], abs=1e-9), key
    assert "mAP" in only.line()


# --- the figures, against scikit-learn ---------------------------------------------------------------

def test_average_precision_and_thresholds_equal_scikit_learn_s_on_scores_with_ties() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random((60, 5)) < 0.4).astype(int)
    y[:, 4] = 0  # a class without positives: AP 0, as scikit-learn says (with a warning)
    scores = np.round(rng.random((60, 5)) * 0.5 + 0.4 * y, 1)  # rounded: many ties
    with pytest.warns(UserWarning):
        expected = average_precision_score(y, scores, average=None)
    np.testing.assert_allclose(average_precision(scores, y), expected, atol=1e-12)
    thresholds = choose_thresholds(scores, y)
    assert thresholds[4] == 0.5
    for c in range(4):
        best = max(f1_score(y[:, c], scores[:, c] >= t) for t in [*np.unique(scores[:, c]), 1.1])
        assert f1_score(y[:, c], scores[:, c] >= thresholds[c]) == pytest.approx(best, abs=1e-12)
        assert not np.isin(thresholds[c], scores[:, c])  # between two scores: new images near them side with them


def test_the_loss_is_binary_cross_entropy_with_smoothed_and_mixed_multi_hot_targets() -> None:
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(6, 4, generator=g), (torch.rand(6, 4, generator=g) < 0.5).float()
    expected = torch.nn.BCEWithLogitsLoss()(logits, targets * 0.9 + 0.1 / 4)
    torch.testing.assert_close(MultiLabelLoss(0.1)(logits, targets), expected)
    torch.testing.assert_close(MultiLabelLoss(0.0)(logits, targets), torch.nn.BCEWithLogitsLoss()(logits, targets))
    # MixUp's two weighted losses are the loss of the mixed multi-hot targets.
    images = torch.randn(6, 3, 8, 8, generator=g)
    _, a, b, lam = mixup(images, targets, 0.2, np.random.default_rng(0))
    loss = MultiLabelLoss(0.1)
    torch.testing.assert_close(lam * loss(logits, a) + (1 - lam) * loss(logits, b),
                               loss(logits, lam * a + (1 - lam) * b))


def test_the_labels_csv_gives_sorted_classes_splits_and_clear_errors(tmp_path: Path) -> None:
    data = make_multilabel(tmp_path / "data", n_train=8, n_val=4)
    found = multilabel_set(data.root, data.labels)
    assert found.classes == ["blue", "green", "red", "yellow"] and len(found.train) == 8 and len(found.val) == 4
    assert [tuple(int(v) for v in t) for _, t in found.val] == [
        tuple(int(c in labels) for c in found.classes) for _, labels in data.images["val"]]
    # A split column instead of the folders: everything in one folder.
    flat = tmp_path / "flat.csv"
    shutil.copytree(data.root / "train", tmp_path / "images")
    flat.write_text("path,labels,split\n" + "".join(f"{p.name},{';'.join(labels)},{'val' if i < 3 else 'train'}\n"
                                                  for i, (p, labels) in enumerate(data.images["train"])))
    split = multilabel_set(tmp_path / "images", flat)
    assert len(split.val) == 3 and len(split.train) == 5
    for text, message in (("file,labels\n", "columns path and labels"),
                          ("path,labels\ntrain/missing.png,red\n", "missing.png is not a file"),
                          ("path,labels\ntrain/000.png,red\n", "no val images")):
        bad = tmp_path / "bad.csv"
        bad.write_text(text)
        with pytest.raises(DataError, match=message):
            multilabel_set(data.root, bad)
    proc = cli_in_process("train", "--data", str(data.root), "--multilabel", "--output", str(tmp_path / "o"))
    assert proc.returncode != 0 and "--multilabel needs --labels" in proc.stderr


def test_explain_puts_each_present_label_s_heat_on_its_pattern(run: Run, tmp_path: Path) -> None:
    """``convnets explain`` on the ``train --multilabel`` checkpoint: by default it explains the labels above their
    thresholds, and for most present patterns their class has at least half its heat inside the pattern's quarter.

    At 32 px the default layer's map is 4x4 (layer2): 75 % of them here; tests/test_explain.py's proof, at 64 px,
    reaches 99 %."""
    pytest.importorskip("pytorch_grad_cam")  # the explain extra; CI installs it (tests/strict_skips.py)
    several = [(p, labels) for p, labels in run.data.images["val"] if len(labels) >= 2][:8]
    assert len(several) >= 4
    out = tmp_path / "explained"
    proc = cli_in_process("explain", *[str(p) for p, _ in several], "--weights", str(run.out / "model_best.pth.tar"),
                          "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "explanations.json").read_text())
    size = 32
    shares, explained = [], 0
    for path, labels in several:
        entries = {e["label"]: e for e in record["explanations"] if e["input"] == str(path)}
        explained += len(set(labels) & set(entries))
        for label in set(labels) & set(entries):
            heat = np.load(out / entries[label]["heatmap"])
            left, top, right, bottom = run.data.regions[label]
            # the pattern's quarter of the image
            rows = slice(0, size // 2) if top < size // 2 else slice(size // 2, size)
            cols = slice(0, size // 2) if left < size // 2 else slice(size // 2, size)
            shares.append(heat[rows, cols].sum() / max(heat.sum(), 1e-12))
    present = sum(len(labels) for _, labels in several)
    assert explained >= 0.8 * present  # the labels above their thresholds are what is explained
    assert np.mean(np.array(shares) >= 0.5) >= 0.6, shares
