"""``examples/quickstart.ipynb``, the notebook a new user opens first, runs top to bottom in a fresh
kernel, offline (NGC's weights from a local mirror: the full-size random checkpoint of conftest),
and shows what it promises: pictures, top-5 lists, a table of predictions. It runs again in the same
folder (Restart & Run All), as a user does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = REPO / "examples" / "quickstart.ipynb"
PHOTOS = ("chelsea.png", "coffee.png", "rocket.jpg")


def test_the_notebook_is_stored_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


def _clone(root: Path) -> Path:
    """What the notebook needs of a clone (links to this checkout's files); returns its examples/."""
    for name in ("hubconf.py", "convnets", "processing_utils", "weights_manifest.json"):
        (root / name).symlink_to(REPO / name)
    examples = root / "examples"
    examples.mkdir()
    for photo in PHOTOS:
        (examples / photo).symlink_to((REPO / "examples" / photo).resolve())
    return examples


def _outputs(notebook: object) -> list[dict]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


@pytest.mark.slow
def test_quickstart_runs_offline_twice_and_shows_pictures_top5_and_a_table(
        full_se_checkpoint: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path, isolated_cache: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, _ = full_se_checkpoint
    examples = _clone(tmp_path)
    # The kernel inherits this environment: the weights from the mirror, this checkout's package,
    # matplotlib's inline backend (as in Jupyter), one thread per core.
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(checkpoint.parent))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    for _ in range(2):  # the second run finds the first one's tiny-data and tiny-run beside it
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(examples)}}).execute()
        _check_outputs(notebook, examples)


def _check_outputs(notebook: object, examples: Path) -> None:
    """What one run of the notebook shows, and that everything it wrote is beside it."""
    outputs = _outputs(notebook)
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert not errors, errors
    text = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    # Upstream's flow: pick_n_best prints five (class, percent) pairs per image.
    samples = re.findall(r"^sample (\d): (\[.*\])$", text, re.M)
    assert [int(i) for i, _ in samples] == [0, 1, 2]
    assert all(len(re.findall(r"\d+\.\d%", pairs)) == 5 for _, pairs in samples)
    # Each image drawn beside its top 5 (matplotlib's inline figures).
    pictures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pictures) == len(PHOTOS)
    # convnets.predict as the last expression: an HTML table with a thumbnail per photo (and again
    # after the fine-tune); between them the first photo explained: its thumbnail and its heat map.
    tables = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert len(tables) == 3 and all('class="convnets-predictions"' in t for t in tables)
    listed, explained, tuned = tables
    assert all(t.count("<img ") == len(PHOTOS) and all(p in t for p in PHOTOS) for t in (listed, tuned))
    assert explained.count("<img ") == 2 and PHOTOS[0] in explained
    assert re.search(rf"^\S*{re.escape(PHOTOS[0])} .+ \(300, 451\)$", text, re.M)  # the heat map: the photo's size
    assert "cat" in tuned and "rocket" in tuned  # the fine-tuned model's own classes
    # The nearest neighbour of each photo, and the optimized copy agreeing with the model.
    assert len(re.findall(r"^\S+: nearest is \S+ \(cosine -?[01]\.\d{3}\)$", text, re.M)) == len(PHOTOS)
    difference = re.search(r"largest difference (\S+) of the largest logit", text)
    assert difference and float(difference[1]) < 1e-4
    # Everything it wrote is beside it, in the clone.
    assert {p.name for p in examples.iterdir()} == {*PHOTOS, "tiny-data", "tiny-run"}
