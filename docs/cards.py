"""The model cards of ``docs/models.md`` (``<!-- model-cards -->``), made when the site is built.

Per registered model: the published accuracy and file size as ``weights_manifest.json`` states them,
the parameters and GFLOPs at 224 px counted on the model itself (built on the meta device: no
weights, no memory), the recipe that ``convnets train`` defaults to, the evaluation transform of the
weights' preset, and one line per benchmark results file that measured the model. Nothing in a
card is typed by hand.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MARKER = "<!-- model-cards -->"


@functools.cache
def complexity(name: str, size: int = 224) -> tuple[int, float, int]:
    """``(parameters, GFLOPs, state-dict bytes)`` of model ``name`` at ``size`` x ``size``, one
    multiply-add counted once, as torchvision's model pages count them (``torch.utils.flop_counter``
    counts two); the bytes are its parameters' and buffers' as float32."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import convnets

    with torch.device("meta"):
        model = convnets.get_model(name).eval()
    model = model.to("meta")  # buffers made outside the device context too
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, size, size, device="meta"))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return sum(p.numel() for p in model.parameters()), counter.get_total_flops() / 2 / 1e9, weights


def _slug(title: str) -> str:
    from markdown.extensions.toc import slugify

    return str(slugify(title, "-"))


def results_sections(page: Path) -> dict[str, str]:
    """results name -> the anchor of the heading above its ``<!-- results: NAME -->`` on ``page``."""
    sections, heading = {}, ""
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{2,4} (.+)", line):
            heading = m.group(1).strip()
        elif m := re.match(r"<!--\s*results:\s*([\w.-]+)\s*-->", line):
            sections[m.group(1)] = _slug(heading)
    return sections


def benchmark_line(model: str, record: Mapping[str, Any]) -> str | None:
    """What one results file measured of ``model``: the fastest variant per batch size (img/s), or
    each variant's median seconds; ``None`` where the file did not measure the full model."""
    r = record["results"]
    if r.get("tiny_kwargs"):
        return None  # a reduced network: its speed says nothing of this model's
    default = r.get("model", r.get("arch"))
    rows = [row for row in r.get("rows", []) if row.get("model", default) == model]
    if rows and "img_per_s" in rows[0]:
        parts = []
        for batch in dict.fromkeys(row.get("batch_size", r.get("batch_size")) for row in rows):
            best = max((row for row in rows if row.get("batch_size", r.get("batch_size")) == batch),
                       key=lambda row: row["img_per_s"])
            what = " ".join(str(best[k]) for k in ("variant", "amp_dtype", "memory_format") if best.get(k))
            parts.append(f"{'' if batch is None else f'batch {batch}: '}{what} {best['img_per_s']:.1f} img/s")
        return "fastest " + "; ".join(parts)
    if rows and "median_s" in rows[0]:
        return ", ".join(f"{row['variant']} {row['median_s']:.2f} s" for row in rows)
    if rows and "seconds_median" in rows[0]:
        return ", ".join(f"{row['variant']} {row['seconds_median']:.2f} s" for row in rows)
    if default == model and "end_to_end" in r:
        return ", ".join(f"{label} {statistics.median(values):.1f} img/s"
                         for label, values in r["end_to_end"].items())
    return None


def _machine(record: Mapping[str, Any]) -> str:
    m = record["machine"]
    return str(m["device_name"] if str(m.get("device", "cpu")) != "cpu" else m["cpu_model"])


def card(name: str, root: Path, results: Path, names: list[str], table: Callable[..., str]) -> str:
    """The Markdown card of model ``name``; ``names``: the results files to take a line from."""
    from convnets.train import config
    from convnets.weights.manifest import load_manifest

    entry = load_manifest()[name]
    params, gflops, weights = complexity(name)
    if params != entry.num_params:
        raise ValueError(f"weights_manifest.json says {name} has {entry.num_params} parameters; the model has "
                         f"{params}")
    preset = entry.preset
    accuracy = (f"top-1 {entry.top1:.2f} % ({entry.top1_note}); top-5 not published"
                if entry.top1 is not None else f"not published ({entry.top1_note})")
    size = (f"{entry.size_bytes / 2**20:.1f} MiB" if entry.size_bytes is not None
            else f"not recorded (NGC publishes none; `{entry.file_name}`); its weights as float32 are "
                 f"{weights / 2**20:.1f} MiB (parameters and buffers, computed)")
    transform = (f"`Resize({preset.resize_size}, {preset.interpolation}, antialias=True)`, "
                 f"`CenterCrop({preset.crop_size})`, `ToTensor()`, "
                 f"`Normalize(mean={list(preset.mean)}, std={list(preset.std)})`")
    recipe = (f"NVIDIA's, as `convnets train` defaults to it ([Fine-tuning](training.md)): SGD, momentum "
              f"{config.MOMENTUM}, lr {config.BASE_LR_PER_256} per 256 images, cosine, label smoothing "
              f"{config.LABEL_SMOOTHING}, weight decay 1/{1 / config.WEIGHT_DECAY:.0f} on conv/linear weights")
    rows: list[list[object]] = [
        ["ImageNet accuracy", accuracy],
        ["parameters", f"{params:,}"],
        ["GFLOPs at 224 px", f"{gflops:.2f} (one multiply-add counted once, as torchvision counts)"],
        ["file size", size],
        ["recipe", recipe],
        ["eval transform", transform],
    ]
    sections = results_sections(root / "docs" / "benchmarks.md")
    for result in names:
        path = results / f"{result}.json"
        if result not in sections or not path.is_file():
            continue
        record = json.loads(path.read_text(encoding="utf-8"))
        line = benchmark_line(name, record)
        if line is not None:
            rows.append([f"[{result}](benchmarks.md#{sections[result]})",
                         f"{line} ({record['date'][:10]}, {_machine(record)})"])
    return f"### `{name}`\n\n" + table(["what", "value"], rows) + "\n"
