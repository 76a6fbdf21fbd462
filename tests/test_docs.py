"""Every Python block of the README and the docs runs here, or says on the line before it why it
cannot (``<!-- not run: REASON -->``: a GPU, the network, a dataset).

The blocks run in one fresh interpreter, each block in a fresh namespace and a fresh working
directory that holds the repository's ``examples/``. NGC's SE-ResNeXt101-32x4d and
ResNeXt101-32x4d weights come from a local mirror (``CONVNETS_WEIGHTS_MIRROR``: full-size
checkpoints of conftest, random weights in NGC's layout), as in the README's main-job test;
nothing is downloaded.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import REPO, ngc_checkpoint, run_cli

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]*?\S)\s*-->")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`]*)$")

#: Runs the blocks given as JSON on stdin: one namespace and one working directory per block.
RUNNER = r"""
import json, os, sys, tempfile
blocks = json.load(sys.stdin)
for block in blocks:
    where = tempfile.mkdtemp(dir=os.getcwd(), prefix="block-")
    os.symlink(os.environ["CONVNETS_DOCS_EXAMPLES"], os.path.join(where, "examples"))
    os.chdir(where)
    print(f"--- {block['where']}", flush=True)
    exec(compile(block["code"], block["where"], "exec"), {"__name__": "__main__"})
    os.chdir("..")
"""


@dataclass(frozen=True)
class Block:
    """A fenced ``python`` block: where it starts, its code, and the reason it is not run (or ``None``)."""

    where: str
    code: str
    not_run: str | None


def python_blocks(page: Path) -> list[Block]:
    """The ``python`` blocks of a Markdown page (fences of three or more backticks, not indented)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == opening["fence"]), len(lines))
        if opening["info"].strip().split(" ")[0] == "python":
            marker = NOT_RUN.search(lines[i - 1]) if i > 0 else None
            name = page.relative_to(REPO) if page.is_relative_to(REPO) else page
            blocks.append(Block(f"{name}:{i + 1}", "\n".join(lines[i + 1:end]) + "\n",
                                marker["reason"] if marker else None))
        i = end + 1
    return blocks


RUNNABLE = {page: [b for b in python_blocks(page) if b.not_run is None] for page in PAGES}


def test_blocks_are_found_and_every_one_that_is_not_run_says_why(tmp_path: Path) -> None:
    blocks = [b for page in PAGES for b in python_blocks(page)]
    assert sum(b.not_run is None for b in blocks) >= 8, [b.where for b in blocks]
    for block in blocks:
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 3, f"{block.where}: say why it cannot run here"
    # The parser itself: a marked block, a runnable one, and a shell block that is not Python.
    page = tmp_path / "sample.md"
    page.write_text("<!-- not run: needs a CUDA GPU -->\n```python\nimport gpu\n```\n\n"
                    "```bash\nls\n```\n\n````python\nprint('`' * 3)\n````\n")
    found = python_blocks(page)
    assert [(b.code, b.not_run) for b in found] == [("import gpu\n", "needs a CUDA GPU"),
                                                    ("print('`' * 3)\n", None)]


@pytest.mark.slow
def test_the_python_blocks_of_every_page_run(full_se_checkpoint: tuple[Path, dict[str, torch.Tensor]],
                                             tmp_path: Path, isolated_cache: Path) -> None:
    """All runnable blocks in one interpreter (a fresh namespace and directory each): one import of
    PyTorch instead of one per page. A failure names its block (``--- README.md:57``)."""
    checkpoint, _ = full_se_checkpoint
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / checkpoint.name).symlink_to(checkpoint)
    ngc_checkpoint("resnext101_32x4d", mirror)  # docs/backbones.md: the backbone detectors use
    env = {"CONVNETS_WEIGHTS_MIRROR": str(mirror),
           "TORCH_HOME": str(isolated_cache.parents[1]), "CONVNETS_DOCS_EXAMPLES": str(REPO / "examples"),
           "MPLBACKEND": "Agg"}
    blocks = [{"where": b.where, "code": b.code} for page in PAGES for b in RUNNABLE[page]]
    done = run_cli(code=RUNNER, input=json.dumps(blocks).encode(), cwd=tmp_path, env=env, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    assert [line[4:] for line in done.stdout.splitlines() if line.startswith("--- ")] == [b["where"] for b in blocks]
