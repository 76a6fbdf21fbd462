"""``convnets evaluate`` and :func:`convnets.evaluation.loop.evaluate_model`: the report's numbers
against scikit-learn on predictions computed here, ImageNet's flat validation layouts (Kaggle CSV,
devkit) against the same images in a class tree, confusion.png, and the errors.

The model is a tiny ResNet with ImageNet's 1000 outputs whose classifier is a nearest-centroid
one for 8 of the classes (so its predictions are neither all right nor all one class); the images
are scikit-learn's handwritten digits (real scans), one digit per ImageNet class, as JPEG.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_in_process, randomize_bn, run_cli
from PIL import Image
from strict_skips import require_module
from train_support import TINY_ARCH

import convnets
from convnets import cli
from convnets.errors import DataError, InvalidArgumentError
from convnets.evaluation import EvaluationReport, evaluate_model
from convnets.evaluation.confusion import DPI, FIGSIZE, MAX_SHOWN, plot_confusion, shown_classes
from convnets.weights.safetensors_io import save_safetensors

require_module("sklearn", extra="test")
require_module("scipy", extra="imagenet")
require_module("matplotlib", extra="plots")
from sklearn import metrics  # noqa: E402

USED = [0, 1, 100, 250, 400, 600, 800, 999]  # ImageNet classes that the digits 0-7 stand for
PER_CLASS = 6
IMAGE_SIZE = 32
PNG_SIZE = (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI))
TSV = Path(convnets.__file__).parent / "preprocessing" / "imagenet_classes.tsv"


def synsets() -> list[str]:
    """The bundled class order, read here with csv (not through the package)."""
    with open(TSV, newline="") as f:
        return [row["synset"] for row in csv.DictReader(f, delimiter="\t")]


def reference_input(path: str) -> torch.Tensor:
    """The EvalPreset of a 32-pixel model, with PIL and torchvision's functional transforms."""
    import torchvision.transforms.functional as TF

    image = Image.open(path).convert("RGB")
    image = TF.resize(image, round(IMAGE_SIZE * 256 / 224), interpolation=TF.InterpolationMode.BILINEAR,
                      antialias=True)
    x = TF.to_tensor(TF.center_crop(image, IMAGE_SIZE))
    return TF.normalize(x, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def imagenet_like(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("imagenet")
    wnids = synsets()
    digits = load_digits()
    labels: list[tuple[str, str]] = []  # (ImageId, wnid) in image-number order
    for k, cls in enumerate(USED):
        for i in np.flatnonzero(digits.target == k)[:PER_CLASS]:
            name = f"ILSVRC2012_val_{len(labels) + 1:08d}"
            pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
            image = Image.fromarray(pixels).resize((40, 48), Image.BILINEAR).convert("RGB")
            folder = root / "tree" / wnids[cls]
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{name}.JPEG", quality=95)
            labels.append((name, wnids[cls]))
    files = sorted((root / "tree").glob("*/*.JPEG"))

    # Tiny 1000-class network; its classifier: nearest centroid of the 8 classes' features.
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model("resnet50", **TINY_ARCH)).eval()
    features: list[torch.Tensor] = []
    hook = model.fc.register_forward_pre_hook(lambda m, args: features.append(args[0]))
    with torch.no_grad():
        model(torch.stack([reference_input(str(f)) for f in files]))
        hook.remove()
        feats = features[0]
        feats = feats / feats.norm(dim=1, keepdim=True)
        truth = torch.tensor([wnids.index(f.parent.name) for f in files])
        model.fc.weight.zero_()
        model.fc.bias.fill_(-8.0)
        for cls in USED:
            centroid = feats[truth == cls].mean(0)
            model.fc.weight[cls] = 10 * centroid
            model.fc.bias[cls] = -5 * centroid.dot(centroid)
    weights = save_safetensors(model, root / "tiny1000.safetensors", image_size=IMAGE_SIZE)

    # Kaggle: flat images; the CSV at the download's top, four levels above them; boxes after each id.
    kaggle_val = root / "kaggle" / "ILSVRC" / "Data" / "CLS-LOC" / "val"
    kaggle_val.mkdir(parents=True)
    for f in files:
        shutil.copy(f, kaggle_val)
    with open(root / "kaggle" / "LOC_val_solution.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ImageId", "PredictionString"])
        for name, wnid in [*labels, ("ILSVRC2012_val_00049999", wnids[5])]:  # one image not in this copy
            writer.writerow([name, f"{wnid} 10 12 30 40 {wnid} 1 2 20 20"])

    # Devkit: flat images beside ILSVRC2012_devkit_t12/data/{meta.mat, ground truth}. Devkit labels
    # are ILSVRC2012_IDs, in an order of their own (here a permutation), and meta.mat also lists
    # non-leaf synsets (num_children > 0), which torchvision leaves out.
    from scipy.io import savemat

    ids = np.random.default_rng(0).permutation(1000) + 1  # ILSVRC2012_ID of class i
    fields = ["ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children", "wordnet_height",
              "num_train_images"]
    table = np.zeros(1003, dtype=[(name, object) for name in fields])
    for i, wnid in enumerate(wnids):
        table[i] = (int(ids[i]), wnid, f"words {i}", "gloss", 0, np.zeros(0), 0, 1300)
    for j in range(3):
        table[1000 + j] = (1001 + j, f"n9999999{j}", "parent", "gloss", 2, np.array([1, 2]), 1, 0)
    data_dir = root / "devkit" / "ILSVRC2012_devkit_t12" / "data"
    data_dir.mkdir(parents=True)
    savemat(str(data_dir / "meta.mat"), {"synsets": table.reshape(-1, 1)})
    (data_dir / "ILSVRC2012_validation_ground_truth.txt").write_text(
        "".join(f"{ids[wnids.index(wnid)]}\n" for _, wnid in labels))
    (root / "devkit" / "val").mkdir()
    for f in files:
        shutil.copy(f, root / "devkit" / "val")
    # The archive that torchvision.datasets.ImageNet reads, made from the same folder.
    archive = root / "archive" / "ILSVRC2012_devkit_t12.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root / "devkit" / "ILSVRC2012_devkit_t12", arcname="ILSVRC2012_devkit_t12")
    return {"root": root, "tree": root / "tree", "weights": weights, "kaggle": root / "kaggle",
            "kaggle_val": kaggle_val, "devkit_val": root / "devkit" / "val", "archive": archive}


def reference_predictions(data: dict[str, Path]) -> tuple[np.ndarray, np.ndarray, list[Path]]:
    """True classes and softmax probabilities of every image, computed here in one batch."""
    model = convnets.load_model(data["weights"])
    files = sorted(data["tree"].glob("*/*.JPEG"))
    wnids = synsets()
    with torch.no_grad():
        logits = model(torch.stack([reference_input(str(f)) for f in files])).double()
    y_true = np.array([wnids.index(f.parent.name) for f in files])
    return y_true, torch.softmax(logits, 1).numpy(), files


def test_report_equals_scikit_learn_on_the_same_predictions(imagenet_like: dict[str, Path], tmp_path: Path) -> None:
    report = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], output=tmp_path, batch_size=16,
                            workers=0, device="cpu")
    y_true, probs, files = reference_predictions(imagenet_like)
    y_pred = probs.argmax(1)
    labels = np.arange(1000)
    assert 0.3 < metrics.accuracy_score(y_true, y_pred) < 0.95  # neither trivial nor perfect
    assert report.images == len(files) == len(USED) * PER_CLASS and report.unreadable == 0
    assert report.top1 == pytest.approx(100 * metrics.accuracy_score(y_true, y_pred), abs=1e-9)
    assert report.top5 == pytest.approx(100 * metrics.top_k_accuracy_score(y_true, probs, k=5, labels=labels),
                                        abs=1e-9)
    assert report.loss == pytest.approx(metrics.log_loss(y_true, probs, labels=labels), rel=1e-5)
    np.testing.assert_array_equal(report.confusion, metrics.confusion_matrix(y_true, y_pred, labels=labels))
    p, r, f, s = metrics.precision_recall_fscore_support(y_true, y_pred, labels=labels, zero_division=0)
    np.testing.assert_allclose([c.precision for c in report.classes], p, atol=1e-12)
    np.testing.assert_allclose([c.recall for c in report.classes], r, atol=1e-12)
    np.testing.assert_allclose([c.f1 for c in report.classes], f, atol=1e-12)
    np.testing.assert_array_equal([c.support for c in report.classes], s)
    macro = metrics.precision_recall_fscore_support(y_true, y_pred, labels=USED, average="macro", zero_division=0)
    assert (report.macro_precision, report.macro_recall, report.macro_f1) == pytest.approx(macro[:3], abs=1e-12)
    # The most confused pair is the largest off-diagonal cell.
    off = metrics.confusion_matrix(y_true, y_pred, labels=labels)
    np.fill_diagonal(off, 0)
    top = report.confused_pairs[0]
    assert top.count == off.max() and off[top.true, top.predicted] == off.max()
    assert top.fraction == pytest.approx(off.max() / PER_CLASS)
    assert report.classes[0].key == "n01440764" and report.classes[0].name == "tench"

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved == json.loads(json.dumps(report.to_dict()))
    assert saved["layout"] == "folders" and saved["preset"]["crop_size"] == IMAGE_SIZE
    assert np.array_equal(np.array(saved["confusion_matrix"]), report.confusion)
    assert not list(tmp_path.glob(".*.tmp"))
    with Image.open(tmp_path / "confusion.png") as image:
        assert image.format == "PNG" and image.size == PNG_SIZE


def _same_results(a: EvaluationReport, b: EvaluationReport) -> None:
    np.testing.assert_array_equal(a.confusion, b.confusion)
    assert (a.images, a.top1, a.top5) == (b.images, b.top1, b.top5)
    assert a.loss == pytest.approx(b.loss, rel=1e-6)
    assert [(c.precision, c.recall, c.support) for c in a.classes] == [(c.precision, c.recall, c.support)
                                                                       for c in b.classes]


def test_flat_imagenet_layouts_evaluate_like_the_class_tree(imagenet_like: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tree = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], batch_size=16, workers=0, device="cpu")
    for data, layout, labels_file in (
        (imagenet_like["kaggle_val"], "kaggle", "LOC_val_solution.csv"),  # the CSV four levels up
        (imagenet_like["kaggle"], "kaggle", "LOC_val_solution.csv"),  # the download's top folder
        (imagenet_like["devkit_val"], "devkit", "ILSVRC2012_validation_ground_truth.txt"),
    ):
        flat = evaluate_model(imagenet_like["weights"], data, batch_size=16, workers=0, device="cpu")
        assert (flat.source["layout"], Path(flat.source["labels_file"]).name) == (layout, labels_file), data
        _same_results(flat, tree)
    assert evaluate_model(imagenet_like["weights"], imagenet_like["kaggle"], workers=0, device="cpu").source[
        "unlabelled_images"] == 0

    # The devkit archive, parsed by torchvision's own ImageNet code (which checks the real
    # archive's MD5: this one is generated, so its MD5 stands in for the official one).
    from torchvision.datasets import imagenet

    archive = imagenet_like["archive"]
    monkeypatch.setitem(imagenet.ARCHIVE_META, "devkit",
                        (archive.name, hashlib.md5(archive.read_bytes()).hexdigest()))
    flat = evaluate_model(imagenet_like["weights"], imagenet_like["devkit_val"], labels=archive, batch_size=16,
                          workers=0, device="cpu")
    assert flat.source["layout"] == "devkit" and flat.source["labels_file"] == str(archive)
    _same_results(flat, tree)
    assert sorted(p.name for p in archive.parent.iterdir()) == [archive.name]  # no meta.bin left beside it


def test_cli_tree_and_kaggle_layouts_write_the_same_report(imagenet_like: dict[str, Path], tmp_path: Path) -> None:
    reports = {}
    for name, data, workers in (("tree", imagenet_like["tree"], "0"), ("kaggle", imagenet_like["kaggle_val"], "1")):
        done = cli_in_process("evaluate", "--data", str(data), "--weights", str(imagenet_like["weights"]),
                              "--output", str(tmp_path / name), "--batch-size", "16", "--workers", workers,
                              "--no-progress", "--device", "cpu")
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        lines = done.stdout.splitlines()
        assert lines[0].startswith(f"{len(USED) * PER_CLASS} images ({name if name == 'kaggle' else 'folders'} layout")
        assert lines[1].startswith("top-1 ") and "most confused (true -> predicted" in done.stdout
        assert "tench" in done.stdout and lines[-1].startswith("wrote ")
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
        with Image.open(tmp_path / name / "confusion.png") as image:
            assert image.size == PNG_SIZE
    tree, kaggle = reports["tree"], reports["kaggle"]
    assert tree["confusion_matrix"] == kaggle["confusion_matrix"] and tree["top1"] == kaggle["top1"]
    assert tree["loss"] == pytest.approx(kaggle["loss"], rel=1e-6)
    assert kaggle["layout"] == "kaggle" and kaggle["labels_file"].endswith("kaggle/LOC_val_solution.csv")


def test_layout_errors_name_the_option(imagenet_like: dict[str, Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in sorted(imagenet_like["tree"].glob("*/*.JPEG"))[:3]:
        shutil.copy(f, flat)
    weights = str(imagenet_like["weights"])
    assert cli.main(["evaluate", "--data", str(flat), "--weights", weights, "--workers", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"convnets evaluate: error: --data {flat} has 3 images but no labels")
    assert "LOC_val_solution.csv" in err[0] and "--labels FILE" in err[0] and "labels=" not in err[0]
    with pytest.raises(DataError, match=r"data=.*labels=FILE"):
        evaluate_model(weights, flat, workers=0, device="cpu")
    (tmp_path / "labels.json").write_text("{}")
    with pytest.raises(InvalidArgumentError, match="labels="):
        evaluate_model(weights, flat, labels=tmp_path / "labels.json", workers=0, device="cpu")
    # Class folders that are neither the checkpoint's classes nor WordNet ids.
    wrong = tmp_path / "wrong" / "cats"
    wrong.mkdir(parents=True)
    shutil.copy(next(imagenet_like["tree"].glob("*/*.JPEG")), wrong)
    with pytest.raises(DataError, match="WordNet-id folders"):
        evaluate_model(weights, wrong.parent, workers=0, device="cpu")
    assert cli.main(["evaluate", "--data", str(tmp_path / "nowhere"), "--weights", weights]) == 2  # a usage error
    assert f"--data {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err


def test_many_classes_show_the_most_confused_submatrix(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = 200
    cm = np.diag(rng.integers(20, 50, n))
    for _ in range(400):  # scattered single confusions, and a few large ones
        cm[rng.integers(n), rng.integers(n)] += 1
    big = [(3, 150, 30), (150, 3, 25), (77, 78, 20), (10, 190, 18), (42, 43, 15)]
    for t, p, count in big:
        cm[t, p] += count
    pairs = [(t, p) for t, p, _ in big]
    shown = shown_classes(cm, pairs + [(int(i), int(i) + 1) for i in range(100, 140)])
    assert len(shown) <= MAX_SHOWN and shown == sorted(shown)
    assert {3, 150, 77, 78, 10, 190, 42, 43} <= set(shown)
    # A report of 200 classes draws the sub-matrix at the fixed size.
    from convnets.evaluation.loop import EvalTotals

    names = [f"class {i}" for i in range(n)]
    report = EvaluationReport.from_totals(EvalTotals(0.0, int(np.trace(cm)), int(np.trace(cm)), int(cm.sum()), 0, cm),
                                          names, names)
    assert [(p.true, p.predicted) for p in report.confused_pairs[:5]] == pairs
    plot_confusion(report.confusion, [c.name for c in report.classes], tmp_path / "c.png")
    if os.environ.get("CONVNETS_KEEP_PNG"):  # to look at it
        shutil.copy(tmp_path / "c.png", os.environ["CONVNETS_KEEP_PNG"])
    with Image.open(tmp_path / "c.png") as image:
        assert image.size == PNG_SIZE
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int)
    assert (pixels > 235).all(1).mean() > 0.5  # mostly (near) white: a light matrix, not a dark block
    assert (np.abs(pixels - (8, 48, 107)).sum(1) < 40).sum() > 1000  # Blues' darkest: the diagonal


def test_class_names_of_a_checkpoint_and_train_evaluate_agree(tmp_path: Path) -> None:
    """A fine-tuned checkpoint's class names map the folders of DIR/val (convnets train's DIR), and
    convnets evaluate measures what train --evaluate measures on them (one loop)."""
    from train_support import make_digits

    from convnets.train import TrainConfig, fit

    digits = make_digits(tmp_path / "digits", n_train=32, n_val=40)
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model("resnet50", num_classes=4, **TINY_ARCH)).eval()
    names = ["digit0", "digit1", "digit2", "digit3"]
    weights = save_safetensors(model, tmp_path / "digits.safetensors", class_names=names[::-1], image_size=32)
    report = evaluate_model(weights, digits, batch_size=16, workers=0, device="cpu")
    assert report.source["layout"] == "folders" and report.source["images_dir"] == str(digits / "val")
    assert [c.key for c in report.classes] == names[::-1]  # the checkpoint's order, not the folders'
    for c in report.classes:
        assert c.support == len(list((digits / "val" / c.key).iterdir()))
    # train --evaluate needs the folders' own order: the same weights with the head in that order.
    model.fc.weight.data, model.fc.bias.data = model.fc.weight.data.flip(0), model.fc.bias.data.flip(0)
    sorted_weights = save_safetensors(model, tmp_path / "sorted.safetensors", class_names=names, image_size=32)
    summary = fit(TrainConfig(data=digits, evaluate=True, pretrained_from_file=sorted_weights, arch="resnet50",
                              arch_kwargs=TINY_ARCH, image_size=32, batch_size=16, workers=0, progress=False,
                              device="cpu"))
    assert summary.metrics["val_top1"] == pytest.approx(report.top1, abs=1e-9)
    assert summary.metrics["images"] == report.images == 40


def test_without_matplotlib_the_report_is_written_with_one_line_about_the_figure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import sys

    from convnets.evaluation.loop import EvalTotals

    cm = np.array([[3, 1], [0, 2]])
    report = EvaluationReport.from_totals(EvalTotals(1.5, 5, 6, 6, 0, cm), ["a", "b"], ["a", "b"])
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError
    with caplog.at_level(logging.WARNING, logger="convnets"):
        written = report.write(tmp_path)
    assert written == [tmp_path / "report.json"] and not (tmp_path / "confusion.png").exists()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pip install -c constraints.txt -e '.[plots]'" in lines[0]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["confusion_matrix"] == [[3, 1], [0, 2]] and saved["top1"] == pytest.approx(500 / 6)
    assert [c["precision"] for c in saved["classes"]] == [1.0, pytest.approx(2 / 3)]


def test_engines_evaluate_like_the_model_and_the_second_run_reads_the_engine_cache(
        imagenet_like: dict[str, Path], tmp_path: Path) -> None:
    """``convnets evaluate`` runs ``--engine auto`` by default: it names its pick in one line on
    stderr (no -v), its numbers are the eager model's, and the second run takes the converted graph
    and auto's check from the engine cache (this test's own, empty at first)."""
    require_module("openvino")
    eager = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], batch_size=16, workers=0, device="cpu")
    assert eager.source["engine"] is None
    picks = []
    for run in ("first", "second"):
        done = cli_in_process("evaluate", "--data", str(imagenet_like["tree"]), "--weights",
                              str(imagenet_like["weights"]), "--output", str(tmp_path / run), "--batch-size", "16",
                              "--workers", "0", "--no-progress", "--device", "cpu",
                              env={"CONVNETS_CACHE_DIR": str(tmp_path / "engine-cache")})
        assert done.returncode == 0, done.stderr
        picks.append([line for line in done.stderr.splitlines() if "picked" in line])
        saved = json.loads((tmp_path / run / "report.json").read_text())
        assert saved["engine"] == "openvino" and "(openvino)" in done.stdout.splitlines()[0]
        # fp32 OpenVINO against eager PyTorch: the same predictions, the loss to float32's precision
        np.testing.assert_array_equal(np.array(saved["confusion_matrix"]), eager.confusion)
        assert saved["loss"] == pytest.approx(eager.loss, rel=1e-4)
    assert [len(p) for p in picks] == [1, 1]
    assert "openvino" in picks[0][0] and "engine cache" not in picks[0][0]
    assert "its check read from the engine cache" in picks[1][0]


def test_the_torch_engine_evaluates_like_the_model(imagenet_like: dict[str, Path]) -> None:
    eager = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], batch_size=16, workers=0, device="cpu")
    folded = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], batch_size=16, workers=0, device="cpu",
                            engine="torch")
    assert folded.source["engine"] == "torch"
    np.testing.assert_array_equal(folded.confusion, eager.confusion)
    assert folded.loss == pytest.approx(eager.loss, rel=1e-4)


def test_a_spreadsheets_utf8_csv_with_a_byte_order_mark_is_read(imagenet_like: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """Spreadsheet programs save "CSV UTF-8" with a BOM first; the header is still ImageId,PredictionString."""
    shutil.copytree(imagenet_like["kaggle_val"], tmp_path / "val")
    text = (imagenet_like["kaggle"] / "LOC_val_solution.csv").read_text(encoding="utf-8")
    (tmp_path / "LOC_val_solution.csv").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    flat = evaluate_model(imagenet_like["weights"], tmp_path / "val", batch_size=16, workers=0, device="cpu")
    tree = evaluate_model(imagenet_like["weights"], imagenet_like["tree"], batch_size=16, workers=0, device="cpu")
    assert flat.source["layout"] == "kaggle" and flat.source["labels_file"] == str(tmp_path / "LOC_val_solution.csv")
    _same_results(flat, tree)


@pytest.mark.parametrize("command", ["evaluate", "train"])
def test_class_folders_with_links_to_themselves_are_scanned_once(command: str, tmp_path: Path) -> None:
    """A class folder holding two links to itself: ``os.walk(followlinks=True)`` (torchvision's
    ``make_dataset``) walked about 2**40 paths until MemoryError; each real directory is scanned once.
    A link to the split's folder (or above) counted the other classes' images again, as this class's."""
    rng = np.random.default_rng(0)
    counts = {"cat": 3, "dog": 2}
    for split in ("train", "val"):
        for name, count in counts.items():
            folder = tmp_path / "data" / split / name
            (folder / "more").mkdir(parents=True)
            for i in range(count):
                where = folder / "more" if i == 0 else folder
                Image.fromarray(rng.integers(0, 255, (36, 36, 3), dtype=np.uint8)).save(where / f"{i}.png")
        (tmp_path / "data" / split / "cat" / "again").symlink_to(".")
        (tmp_path / "data" / split / "cat" / "more" / "up").symlink_to("..")
        (tmp_path / "data" / split / "dog" / "cats").symlink_to("../cat")  # a link to another class: its files
        (tmp_path / "data" / split / "cat" / "split").symlink_to("..")  # to the split's folder: not dog's files too
        (tmp_path / "data" / split / "dog" / "root").symlink_to("../..")  # nor, from data/, the other split's
    arch = json.dumps({**TINY_ARCH, "num_classes": 2})
    # With 2 GB of address space beyond what the process maps at start: a runaway scan ends in MemoryError there, not
    # in the machine's OOM killer.
    limits = {"extra_as": 2 << 30, "timeout": 120, "cwd": tmp_path}
    if command == "evaluate":
        done = run_cli("evaluate", "--random-init", "--model", "resnet50", "--arch-kwargs", arch, "--engine", "torch",
                       "--workers", "0", "--no-progress", "--data", str(tmp_path / "data" / "val"), "--output",
                       str(tmp_path / "report"), **limits)
    else:
        code = ("import sys\nfrom pathlib import Path\nfrom convnets.data.scan import scan_split\n"
                "for split in ('train', 'val'):\n    classes, samples = scan_split(Path(sys.argv[1]), split)\n"
                "    print(split, len(samples), sorted(classes[i] for _, i in samples))\n")
        done = run_cli(str(tmp_path / "data"), code=code, **limits)
    assert done.returncode == 0, done.stderr[-2000:]
    # "cat" once (3 images), "dog" 2 + the 3 of "cat" through its link (as torchvision counts a linked folder).
    expected = ["cat"] * 3 + ["dog"] * 5
    if command == "evaluate":
        assert json.loads((tmp_path / "report" / "report.json").read_text())["images"] == len(expected)
    else:
        assert done.stdout.splitlines() == [f"{split} {len(expected)} {expected}" for split in ("train", "val")]
    skipped = [line for line in done.stderr.splitlines() if "already scanned" in line]
    assert any(str(Path("cat") / "again") in line for line in skipped), done.stderr[-2000:]
    assert any(str(Path("more") / "up") in line for line in skipped), done.stderr[-2000:]
    assert any(str(Path("cat") / "split") in line for line in skipped), done.stderr[-2000:]
    assert any(str(Path("dog") / "root") in line for line in skipped), done.stderr[-2000:]
