"""The command line parses before it imports PyTorch: help, usage errors and mistakes in paths answer at once.

Each case runs ``python -X importtime -m convnets ...`` in a fresh process and reads the list of
imported modules from the interpreter's own report, so nothing here depends on timing.
benchmarks/bench_cli.py measures the time itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO, heavy_imports, run_cli

from convnets.cli import COMMANDS, build_parser


LIGHT_COMMANDS = [name for name in COMMANDS if name != "train"]


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in LIGHT_COMMANDS)],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_torch(args: list[str]) -> None:
    proc = run_cli(*args, fresh=True)
    imported = proc.imported
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: convnets" in proc.stdout
    assert heavy_imports(imported) == []


@pytest.mark.parametrize("args, message", [
    (["predict", "--model", "resnet05", "x.jpg"], "invalid choice: 'resnet05'"),
    (["predict"], "the following arguments are required: INPUT"),
    (["benchmark", "--memory-format", "nwhc"], "choose contiguous or channels_last"),
    (["export", "--device", "cpu", "--output", "out"], "unrecognized arguments: --device"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    # A mistyped option gets the nearest of the command's own options; an option of another command none.
    (["predict", "--top-k", "2", "x.jpg"], "unrecognized arguments: --top-k (did you mean --topk?)"),
    (["predict", "--outptu=v.csv", "x.jpg"], "unrecognized arguments: --outptu=v.csv (did you mean --output?)"),
    (["predict", "--xyzzy", "x.jpg"], "unrecognized arguments: --xyzzy"),
    # Counts are checked while parsing; --topk's upper limit (the model's classes) before PyTorch for NVIDIA's
    # weights (test_a_newcomers_three_mistakes_answer_before_torch), else once the model is loaded.
    (["predict", "--topk", "0", "x.jpg"], "argument --topk: must be a positive integer, got '0'"),
    (["predict", "--topk", "-3", "x.jpg"], "argument --topk: must be a positive integer, got '-3'"),
    (["predict", "--topk", "two", "x.jpg"], "argument --topk: must be a positive integer, got 'two'"),
    (["embed", "--batch-size", "0", "--output", "v.npy", "x.jpg"], "argument --batch-size: must be a positive"),
    (["evaluate", "--data", "d", "--workers", "-1"], "argument --workers: must be a non-negative integer"),
    (["benchmark", "--threads", "0"], "argument --threads: must be a positive integer of at most 1024, got '0'"),
    (["export", "--random-init", "--model", "resnet50", "--triton", "--max-batch-size", "0", "--output", "out"],
     "argument --max-batch-size: must be a positive integer of at most 4096, got '0'"),
    (["train", "--epochs", "0"], "argument --epochs: must be a positive integer, got '0'"),
    (["train", "--workers", "-1"], "argument --workers: must be a non-negative integer, got '-1'"),
])
def test_usage_errors_import_no_torch(args: list[str], message: str) -> None:
    proc = run_cli(*args, fresh=True)
    imported = proc.imported
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and message in lines[-1], lines
    assert heavy_imports(imported) == []


def test_version_prints_the_version_of_setup_py() -> None:
    """``convnets --version``: the version setup.py declares (read with ast), exit 0, before PyTorch."""
    import ast

    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    version = next(ast.literal_eval(k.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                   for k in node.keywords if k.arg == "version")
    proc = run_cli("--version", fresh=True)
    imported = proc.imported
    assert (proc.returncode, proc.stdout) == (0, f"convnets {version}\n"), proc.stderr
    assert heavy_imports(imported) == []


#: A directory nobody here can write in: root writes in any mode-0555 directory, but not in sysfs.
def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


#: Mistakes in paths, each with the start of its one error line and what it says. ``{tmp}``: this
#: test's temporary directory, ``{ro}``: a directory that cannot be written. Paths without them are
#: relative to the repository, where the command runs (``examples/`` exists, ``exmaples/`` does not).
PATH_MISTAKES = [
    # The three of issue 25: a misspelt input folder, an output in a missing directory, an unknown format.
    (["predict", "exmaples/"], "convnets predict: error: INPUT exmaples/ does not exist", f"in the working "
     f"directory {str(REPO)!r}"),
    (["predict", "--output", "{tmp}/no/such/out.jsonl", "examples"], "convnets predict: error: --output "
     "{tmp}/no/such/out.jsonl: ", "the directory '{tmp}/no/such' does not exist"),
    (["embed", "--output", "vec.txt", "examples"], "convnets embed: error: --output vec.txt: ",
     "unknown embedding format '.txt'; end the file name in .npy, .parquet"),
    # A URL is not looked at (its download says what is wrong), so the next mistake is the one named.
    (["predict", "http://127.0.0.1:9/cat.jpg", "--weights", "{tmp}/no.pth"], "convnets predict: error: --weights "
     "{tmp}/no.pth does not exist", ""),
    (["predict", "--from-file", "{tmp}/list.txt", "examples"], "convnets predict: error: --from-file {tmp}/list.txt "
     "does not exist", ""),
    (["predict", "--output", "{ro}/out.csv", "examples"], "convnets predict: error: --output {ro}/out.csv: ",
     "cannot write in '{ro}'"),
    (["predict", "--output", "examples", "examples"], "convnets predict: error: --output examples: ",
     "unknown format '(no suffix)'"),
    (["predict", "--show", "{tmp}/no/sheet.png", "examples"], "convnets predict: error: --show {tmp}/no/sheet.png: ",
     "the directory '{tmp}/no' does not exist"),
    (["predict", "--show", "sheet.jpg", "examples"], "convnets predict: error: --show sheet.jpg: ", "PNG"),
    (["embed", "--output", "{tmp}/no/v.npy", "examples"], "convnets embed: error: --output {tmp}/no/v.npy: ",
     "does not exist"),
    (["evaluate", "--data", "{tmp}/val"], "convnets evaluate: error: --data {tmp}/val does not exist", ""),
    (["evaluate", "--data", "examples", "--labels", "{tmp}/labels.csv"], "convnets evaluate: error: --labels "
     "{tmp}/labels.csv does not exist", ""),
    (["evaluate", "--data", "examples", "--output", "{ro}/report"], "convnets evaluate: error: --output {ro}/report: ",
     "cannot write in '{ro}'"),
    (["export", "--weights", "{tmp}/w.pth", "--output", "{tmp}/out"], "convnets export: error: --weights {tmp}/w.pth "
     "does not exist", ""),
    (["export", "--images", "examples/rocket.jpg", "{tmp}/cat.jpg", "--output", "{tmp}/out"],
     "convnets export: error: --images {tmp}/cat.jpg does not exist", ""),
    (["export", "--output", "examples/rocket.jpg/onnx"], "convnets export: error: --output examples/rocket.jpg/onnx: ",
     "'examples/rocket.jpg' is not a directory"),
    (["benchmark", "--output", "{tmp}/no/bench.json"], "convnets benchmark: error: --output {tmp}/no/bench.json: ",
     "does not exist"),
    (["benchmark", "--json", "{tmp}/no/bench.json"], "convnets benchmark: error: --json {tmp}/no/bench.json: ",
     "does not exist"),
    (["train", "--data", "{tmp}/data", "--output", "{tmp}/run"], "convnets train: error: --data {tmp}/data does "
     "not exist", ""),
    (["train", "--data", "examples", "--output", "{tmp}/run", "--resume", "{tmp}/run/checkpoint.pth.tar"],
     "convnets train: error: --resume {tmp}/run/checkpoint.pth.tar does not exist", ""),
    (["train", "--data", "examples", "--output", "{ro}/run"], "convnets train: error: --output {ro}/run: ",
     "cannot write in '{ro}'"),
]


@pytest.mark.parametrize("args, start, problem", PATH_MISTAKES, ids=[" ".join(m[0][:2]) + f" #{i}"
                                                                     for i, m in enumerate(PATH_MISTAKES)])
def test_path_mistakes_are_usage_errors_before_torch(args: list[str], start: str, problem: str,
                                                     tmp_path: Path) -> None:
    """A path that does not exist, an output that cannot be created or has an unknown format: one line
    naming the option, exit status 2, and nothing heavy imported (so it answers at once)."""
    values = {"tmp": str(tmp_path), "ro": str(_read_only_dir(tmp_path))}
    proc = run_cli(*(a.format(**values) for a in args), fresh=True)
    imported = proc.imported
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(start.format(**values)) and problem.format(**values) in lines[0], lines
    assert heavy_imports(imported) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ro"] if os.geteuid() != 0 else [])  # nothing written


def test_a_newcomers_three_mistakes_answer_before_torch(tmp_path: Path) -> None:
    """``--topk`` above the pretrained model's classes (the manifest's count), a list of paths given as an
    image, a folder without images: one line that says what to do, exit status 2, before PyTorch. A file
    Pillow recognises is an image whatever its name, and --recursive finds images in subfolders."""
    import json
    import shutil

    classes = json.loads((REPO / "weights_manifest.json").read_text())["models"]["se_resnext101_32x4d"]["num_classes"]
    notes = tmp_path / "notes.txt"
    notes.write_text("examples/chelsea.png\n")
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "README.md").write_text("no pictures here")
    nested = tmp_path / "nested"
    (nested / "sub").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "chelsea.png", nested / "sub" / "chelsea.png")
    odd_name = tmp_path / "chelsea.picture"
    shutil.copy(REPO / "examples" / "chelsea.png", odd_name)
    mistakes = [
        (["predict", "--topk", str(classes + 1), "examples"],
         f"convnets predict: error: --topk {classes + 1} is more than the {classes} classes of the model; use --topk "
         f"{classes} or less"),
        (["predict", str(notes)], f"convnets predict: error: INPUT {notes} is not an image"),
        (["predict", str(empty)], f"convnets predict: error: INPUT {empty} holds no images (--recursive also"),
        (["predict", "--recursive", str(empty)], f"convnets predict: error: INPUT {empty} holds no images nor do its "
                                                 "subfolders"),
        (["embed", "--output", str(tmp_path / "v.npy"), str(nested)], f"convnets embed: error: INPUT {nested} holds"),
        # Accepted: the next mistake (a --weights file that does not exist) is the one named.
        (["predict", "--weights", "no.pth", "--recursive", str(odd_name), str(nested)],
         "convnets predict: error: --weights no.pth does not exist"),
    ]
    for args, start in mistakes:
        proc = run_cli(*args, fresh=True)
        imported = proc.imported
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(start), (args, lines)
        assert heavy_imports(imported) == [], args
    assert f"--from-file {notes}" in run_cli("predict", str(notes), fresh=True).stderr  # what was meant


def test_help_shows_the_shared_options() -> None:
    proc = run_cli("benchmark", "--help", fresh=True)
    for option in ("--model", "--weights", "--pretrained", "--random-init", "--arch-kwargs", "--device",
                   "--precision", "--memory-format"):
        assert option in proc.stdout, option


def test_train_help_imports_no_torch() -> None:
    proc = run_cli("train", "--help", fresh=True)
    imported = proc.imported
    assert proc.returncode == 0
    assert heavy_imports(imported) == []


def test_every_command_builds_and_parses_its_options() -> None:
    parser = build_parser()  # every command module imported, every option added
    for name in COMMANDS:
        action = next(a for a in parser._subparsers._group_actions)  # type: ignore[union-attr]
        assert action.choices[name]._actions[1:], f"{name} added no options"  # type: ignore[index]


def test_the_constants_the_command_line_needs_are_defined_once() -> None:
    """``convnets.constants`` is the one module-level assignment of each of its names (a copy kept
    elsewhere to spare --help an import could drift from it), and it imports nothing."""
    import ast

    from convnets import constants

    tree = ast.parse(Path(constants.__file__).read_text(encoding="utf-8"))
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.module != "__future__"]
    names = set(constants.__all__)
    copies = []
    for path in sorted((REPO / "convnets").rglob("*.py")):
        if path.name == "constants.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            copies += [f"{path.relative_to(REPO)}:{node.lineno} {t.id}" for t in targets
                       if isinstance(t, ast.Name) and t.id.lstrip("_") in names]
    assert copies == []
