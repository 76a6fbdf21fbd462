"""``convnets predict`` end to end in real subprocesses, and the README's upstream notebook example."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from conftest import LoopbackServer, REPO, Route, TINY, command_lines, randomize_bn, run_cli
from PIL import Image
from reference import reference_forward

import convnets
import processing_utils

SE = "se_resnext101_32x4d"
EXAMPLES = sorted(str(p.relative_to(REPO)) for p in (REPO / "examples").iterdir()
                  if p.suffix in (".png", ".jpg"))
UPSTREAM = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                      T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], list[str]]:
    """A self-describing 5-class checkpoint, as `convnets train` writes it."""
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(SE, num_classes=5, **TINY[SE]))
    names = ["ant", "bee", "cat", "dog", "eel"]
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(), "class_names": names,
                "epoch": 1}, path)
    return path, model.state_dict(), names


def _expected_top(state: dict[str, torch.Tensor], files: list[str], k: int) -> list[list[tuple[int, float]]]:
    """Top-k by an independent computation: PIL + torchvision preprocessing, functional forward."""
    batch = torch.stack([UPSTREAM(Image.open(REPO / f).convert("RGB")) for f in files])
    probabilities = torch.softmax(reference_forward(state, batch), dim=1)
    values, indices = probabilities.topk(k, dim=1)
    return [[(int(i), float(v)) for v, i in zip(vs, ids)] for vs, ids in zip(values, indices)]


def test_json_output_matches_independent_computation(tiny_checkpoint) -> None:
    path, state, names = tiny_checkpoint
    done = run_cli("predict", "--weights", str(path), "--json", "--topk", "3", *EXAMPLES)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)  # exactly one JSON document on stdout
    assert len(EXAMPLES) >= 2 and [r["input"] for r in results] == EXAMPLES
    for result, expected in zip(results, _expected_top(state, EXAMPLES, 3), strict=True):
        assert [t["index"] for t in result["top"]] == [i for i, _ in expected]
        assert [t["label"] for t in result["top"]] == [names[i] for i, _ in expected]
        np.testing.assert_allclose([t["probability"] for t in result["top"]], [p for _, p in expected], atol=1e-4)


def test_directory_input_expands_to_its_images_in_order(tiny_checkpoint) -> None:
    path, _, _ = tiny_checkpoint
    done = run_cli("predict", "--weights", str(path), "--json", "examples")
    assert done.returncode == 0, done.stderr
    assert [r["input"] for r in json.loads(done.stdout)] == [str(Path("examples") / Path(f).name) for f in EXAMPLES]


def test_table_output_lists_each_input_with_its_classes(tiny_checkpoint) -> None:
    path, state, names = tiny_checkpoint
    done = run_cli("predict", "--weights", str(path), "--topk", "2", EXAMPLES[0])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == EXAMPLES[0]
    (index, probability), _ = _expected_top(state, EXAMPLES[:1], 2)[0]
    assert re.fullmatch(rf"\s+1\.\s+{100 * probability:.2f}%\s+{names[index]}\s+\[{index}\]", lines[1])
    assert len(lines) == 3


def test_unreadable_inputs_are_reported_and_others_predicted(tiny_checkpoint, tmp_path: Path) -> None:
    path, _, _ = tiny_checkpoint
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "empty").mkdir()
    # A path that does not exist is refused on the command line (test_cli_startup.py), not in a list.
    bad = [str(tmp_path / "missing.jpg"), str(tmp_path / "notes.txt"), str(tmp_path / "empty")]
    (tmp_path / "list.txt").write_text("".join(f"{name}\n" for name in [*bad, EXAMPLES[1]]))
    done = run_cli("predict", "--weights", str(path), "--json", EXAMPLES[0], "--from-file", str(tmp_path / "list.txt"))
    assert done.returncode == 1
    assert [r["input"] for r in json.loads(done.stdout)] == [EXAMPLES[0], EXAMPLES[1]]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 3 and "Traceback" not in done.stderr
    for line, name in zip(errors, bad, strict=True):
        assert name in line


def test_url_input(tiny_checkpoint, http_server: LoopbackServer) -> None:
    path, state, _ = tiny_checkpoint
    http_server.routes["/cat.png"] = Route((REPO / EXAMPLES[0]).read_bytes(), content_type="image/png")
    url = f"{http_server.base_url}/cat.png"
    done = run_cli("predict", "--weights", str(path), "--json", "--topk", "1", url)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(done.stdout)
    assert result["input"] == url
    assert result["top"][0]["index"] == _expected_top(state, EXAMPLES[:1], 1)[0][0][0]


@pytest.mark.parametrize("args, message, status", [
    (["--weights", "/no/such/file.pth"], "--weights /no/such/file.pth does not exist", 2),  # a usage error
    (["--device", "cuda"], "cuda", 1) if not torch.cuda.is_available() else (["--topk", "0"], "topk", 2),
])
def test_bad_options_end_in_one_line(args: list[str], message: str, status: int, tiny_checkpoint) -> None:
    done = run_cli("predict", *(args if "--weights" in args else ["--weights", str(tiny_checkpoint[0]), *args]),
                   EXAMPLES[0])
    assert done.returncode == status
    assert "Traceback" not in done.stderr and re.search(message, done.stderr)
    assert len(command_lines(done.stderr)) == 1


def test_unknown_model_is_a_usage_error() -> None:
    done = run_cli("predict", "--model", "se_resnext50", EXAMPLES[0])
    assert done.returncode == 2 and "se_resnext101_32x4d" in done.stderr


def test_offline_without_weights_fails_with_advice(closed_port_url: str) -> None:
    done = run_cli("predict", EXAMPLES[0], env={"CONVNETS_WEIGHTS_MIRROR": closed_port_url})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--weights" in done.stderr and "CONVNETS_WEIGHTS_MIRROR" in done.stderr


def test_main_job_with_mirrored_ngc_weights(full_se_checkpoint, isolated_cache: Path) -> None:
    """The README's main job: classify the examples with the (mirrored) NGC SE-ResNeXt weights."""
    path, state = full_se_checkpoint
    done = run_cli("predict", "--json", "--topk", "5", "examples",
                   env={"CONVNETS_WEIGHTS_MIRROR": str(path.parent), "TORCH_HOME": str(isolated_cache.parents[1])})
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    classes = processing_utils.get_imgnet_classes()  # checked against the shared table in test_processing_results
    for result, expected in zip(results, _expected_top(state, EXAMPLES, 5), strict=True):
        assert [t["index"] for t in result["top"]] == [i for i, _ in expected]
        assert result["top"][0]["label"] == classes[expected[0][0]]


def _readme_notebook_code() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"<!-- upstream-notebook -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README lost its upstream notebook example"
    return match.group(1)


def test_readme_upstream_notebook_example_runs(full_se_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The upstream notebook cell, with only the repository argument changed, runs on this checkout."""
    path, state = full_se_checkpoint
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(path.parent))
    monkeypatch.chdir(REPO)
    code = _readme_notebook_code().replace('"path/to/convnets"', repr(str(REPO)))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 (our own README)
    printed = capsys.readouterr().out
    assert printed.count("sample ") == len(namespace["uris"])
    expected = _expected_top(state, [str(Path(u).relative_to(REPO)) if Path(u).is_absolute() else u
                                     for u in namespace["uris"]], 5)
    names = namespace["utils"].get_imgnet_classes()
    for result, top in zip(namespace["results"], expected, strict=True):
        assert [name for name, _ in result] == [names[i] for i, _ in top]
        assert [pct for _, pct in result] == [f"{100 * p:.1f}%" for _, p in top]


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no native bf16")
def test_bf16_precision_agrees_with_fp32(tiny_checkpoint) -> None:
    path, state, _ = tiny_checkpoint
    done = run_cli("predict", "--weights", str(path), "--json", "--topk", "5", "--precision", "bf16", *EXAMPLES)
    assert done.returncode == 0, done.stderr
    for result, expected in zip(json.loads(done.stdout), _expected_top(state, EXAMPLES, 5), strict=True):
        by_index = {t["index"]: t["probability"] for t in result["top"]}
        for index, probability in expected:
            assert by_index[index] == pytest.approx(probability, abs=0.03)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on CPUs only")
def test_fp16_on_cpu_is_refused_in_one_line(tiny_checkpoint) -> None:
    done = run_cli("predict", "--weights", str(tiny_checkpoint[0]), "--precision", "fp16", "--device", "cpu",
                   EXAMPLES[0])
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(command_lines(done.stderr)) == 1 and "bf16" in done.stderr
