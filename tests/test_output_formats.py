"""A new output format is one file: a module in ``convnets/inference/outputs/`` with a ``FORMAT``
becomes a choice of ``--output`` (its suffix, its line in ``--help``, the file written from the run's
spool at the end), with nothing registered anywhere else."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, cli_in_process

import convnets.inference.outputs as outputs

TINY_ARCH = {"layers": [1, 1, 1, 1], "widths": [8, 16, 32, 64]}
RANDOM = ["--random-init", "--model", "resnet50", "--arch-kwargs", json.dumps(TINY_ARCH),
          "--image-size", "32", "--batch-size", "2", "--topk", "3", "--no-progress", "--engine", "torch"]

#: The whole plug-in, as a user would write it: input and top label, tab-separated.
TSV = '''
from convnets.fileio import atomic_output
from convnets.inference.outputs.base import OutputFormat
from convnets.inference.outputs.spool import read_spool


class Tsv(OutputFormat):
    name = "tsv"
    suffixes = (".tsv",)
    holds = {"predictions": "input and top label, tab-separated"}

    def write(self, path, spool, *, kind, width, batch_size):
        rows = 0
        with atomic_output(path) as out:
            for record in read_spool(spool, kind):
                label = record["top"][0]["label"] if "top" in record else "ERROR"
                out.write(f"{record['input']}\\t{label}\\n".encode())
                rows += 1
        return rows


FORMAT = Tsv()
'''


@pytest.fixture
def tsv_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tsv.py`` dropped into the package (a second directory of its ``__path__``, so that the
    source tree is left alone), and a registry that forgets it afterwards."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "tsv.py").write_text(textwrap.dedent(TSV), encoding="utf-8")
    monkeypatch.setattr(outputs, "__path__", [*outputs.__path__, str(plugins)])
    monkeypatch.setattr(outputs.OUTPUT_FORMATS, "_items", dict(outputs.OUTPUT_FORMATS._items))
    yield
    import sys

    sys.modules.pop("convnets.inference.outputs.tsv", None)


def test_a_module_in_the_package_is_a_new_output_format(tsv_plugin: None, tmp_path: Path) -> None:
    assert "tsv" in [f.name for f in outputs.output_formats("predictions")]
    assert ".tsv" in outputs.suffixes("predictions") and ".tsv" not in outputs.suffixes("embeddings")
    help_text = cli_in_process("predict", "--help").stdout
    assert ".tsv (input and top label, tab-separated)" in " ".join(help_text.split())
    images = sorted(str(p) for p in (REPO / "examples").iterdir() if p.suffix in (".jpg", ".png"))
    tsv, jsonl = tmp_path / "p.tsv", tmp_path / "p.jsonl"
    for out in (tsv, jsonl):
        done = cli_in_process("predict", *RANDOM, "--output", str(out), *images)
        assert done.returncode == 0, done.stderr
    # The same run written by the built-in JSONL format, read independently of the plug-in.
    expected = [f"{r['input']}\t{r['top'][0]['label']}" for r in map(json.loads, jsonl.read_text().splitlines())]
    assert tsv.read_text(encoding="utf-8").splitlines() == expected
    assert not list(tmp_path.glob("*.partial.jsonl"))  # the spool is gone once the file is written


def test_a_suffix_no_format_claims_is_still_refused(tsv_plugin: None, tmp_path: Path) -> None:
    done = cli_in_process("predict", *RANDOM, "--output", str(tmp_path / "p.xml"), str(REPO / "examples"))
    assert done.returncode == 2 and ".tsv" in done.stderr and "p.xml" in done.stderr
