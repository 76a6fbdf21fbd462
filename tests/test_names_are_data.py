"""Class names from a checkpoint are data, never terminal control: ``predict``'s table shows them escaped
(one line per class, no escape sequence reaches the terminal), its CSV quotes them (one record per row for
Python's csv reader, the name itself in the cell), ``labels.txt`` holds one line per class, and
``evaluate``'s table escapes them too. A real ``convnets predict`` process on a tiny checkpoint."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_cli

import convnets
from convnets.deploy.triton import write_labels
from convnets.evaluation.report import EvalTotals, EvaluationReport

#: Five class names as a hostile checkpoint could hold them: escape sequences, a forged table line, a lone
#: CR, a comma and quotes, a line separator and a bidirectional override. No backslash, no single quote:
#: then ``repr(name)[1:-1]`` is what the table must show.
NAMES = ["\x1b[2J\x1b[31mred", "cat\nexamples/rocket.jpg\n  1. 100.00%  forged  [0]", "car\rriage",
         'comma, "quoted"', "line\u2028sep\u202eevil"]
PHOTO = str(REPO / "examples" / "chelsea.png")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ResNet-50 variant with five classes named :data:`NAMES`."""
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", num_classes=len(NAMES), layers=[1, 1, 1, 1], widths=[8, 16, 32, 64])
    path = tmp_path_factory.mktemp("ckpt") / "hostile.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(), "class_names": NAMES}, path)
    return path


def _predict(checkpoint: Path, *args: str) -> str:
    done = run_cli("predict", "--weights", str(checkpoint), "--engine", "torch", "--image-size", "32", "--topk", "5",
                   "--no-progress", *args, PHOTO)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_table_shows_each_name_escaped_on_its_own_line(hostile: Path) -> None:
    table = _predict(hostile)
    assert not any(c in table for c in "\x1b\r\u2028\u202e")
    lines = table.splitlines()
    assert len(lines) == 1 + len(NAMES) and lines[0] == PHOTO  # the input, then a line per class
    rows = [re.fullmatch(r"  \d\. +\d+\.\d\d%  (.*)  \[(\d)\]", line) for line in lines[1:]]
    assert all(rows), lines
    assert all(row[1] == repr(NAMES[int(row[2])])[1:-1] for row in rows if row)


def test_the_csv_quotes_names_so_each_row_is_one_record(hostile: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    _predict(hostile, "--output", str(out))
    with open(out, newline="", encoding="utf-8") as f:  # Python's own reader, as the csv module documents it
        rows = list(csv.reader(f))
    assert rows[0] == ["input", "rank", "index", "label", "probability", "error"]
    assert [len(row) for row in rows[1:]] == [6] * len(NAMES)
    assert [row[1] for row in rows[1:]] == ["1", "2", "3", "4", "5"]
    assert all(row[0] == PHOTO and row[3] == NAMES[int(row[2])] and row[5] == "" for row in rows[1:])
    assert abs(sum(float(row[4]) for row in rows[1:]) - 1) < 1e-5
    # The same records as --json (another writer): the file reads back as what was predicted.
    records = json.loads(_predict(hostile, "--json"))
    assert [[t["index"], t["label"]] for t in records[0]["top"]] == [[int(r[2]), r[3]] for r in rows[1:]]


def test_labels_txt_has_one_line_per_class(tmp_path: Path) -> None:
    path = write_labels(tmp_path, NAMES)
    text = path.read_text(encoding="utf-8")
    assert text.count("\n") == len(NAMES) and not any(c in text for c in "\x1b\r\u2028\u202e")
    assert text.split("\n")[:-1] == [repr(name)[1:-1] for name in NAMES]


def test_evaluate_table_escapes_names() -> None:
    confusion = np.array([[2, 1], [1, 3]])
    report = EvaluationReport.from_totals(EvalTotals(1.0, 5, 7, 7, 0, confusion), ["a", "b"], NAMES[:2])
    table = report.table()
    assert "\x1b" not in table and repr(NAMES[0])[1:-1] in table
    assert "forged" not in "".join(line for line in table.splitlines() if line.startswith("  1."))
    assert f"{repr(NAMES[1])[1:-1]} -> {repr(NAMES[0])[1:-1]}: 1" in table or \
        f"{repr(NAMES[0])[1:-1]} -> {repr(NAMES[1])[1:-1]}: 1" in table
