"""``convnets explain``: where in each image the evidence for its classes lies (Grad-CAM and its variants).

For each input and class it writes, in ``--output DIR`` (default ``explanations/`` of the current directory),
``STEM.INDEX-LABEL.png`` (the image with the heat map over it; outside the crop the model saw, the image greyed) and ``STEM.INDEX-LABEL.npy`` (the heat map: float32, the image's own height and width as read, upright; 0..1;
0 outside the center crop the model saw), named after the input (:func:`~convnets.inputs.names.file_stems`:
safe characters, ``cat``, ``cat-2``, ... for inputs of the same name), and ``DIR/explanations.json``, the record of
what was explained. The classes are ``--class`` (names or indices, repeatable or comma-separated), else the
``--topk`` best scores of each image, by default the best one, or a multi-label model's labels above their
thresholds (:func:`~convnets.explanations.default_targets`). Existing files are
refused without ``--force``. Inputs that cannot be read are reported on stderr, one line each, and leave the exit
status at 1; the others are still explained. The computation is :mod:`convnets.explanations`'s
(pytorch-grad-cam, the ``explain`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convnets.commands.batch_options import add_input_arguments, add_private_urls_argument
from convnets.commands.model_options import add_model_arguments, load_from_args
from convnets.commands.options import (add_force_argument, add_image_size_argument, add_output_argument, batch_size,
                                       positive_int, positive_seconds)
from convnets.commands.path_checks import check_inputs_exist, check_output_directory, usage_errors
from convnets.commands.run_options import add_device_argument, device_from_args
from convnets.constants import (DEFAULT_EXPLAIN_METHOD, DEFAULT_EXPLAIN_OUTPUT, DEFAULT_MODEL, DEFAULT_TIMEOUT,
                                EXPLAIN_METHODS, LAYERS)
from convnets.errors import InvalidArgumentError
from convnets.fileio import preflight

if TYPE_CHECKING:
    from convnets.explanations import Explanation
    from convnets.inputs.listing import Listing

__all__ = ["RECORD", "add_arguments", "prepare"]

#: The record of a run, in ``--output DIR``.
RECORD = "explanations.json"

_EPILOG = f"""\
files, in DIR, per input and class:
  STEM.INDEX-LABEL.png     the image with the heat map over it (jet colours: red is where the evidence is);
                           outside the center crop the model saw, the image in grey
  STEM.INDEX-LABEL.npy     the heat map: float32 [height, width] of the image as read (EXIF-upright), 0..1;
                           0 outside the center crop the model saw (its box is in the record)
  {RECORD}        what was explained: per input and class its index, label, score (softmax, or
                           sigmoid for a multi-label model), the files, the image size and the crop box
  STEM is the input's file name without its suffix, characters other than letters, digits, '.', '-'
  as '_'; a second input of the same STEM gets STEM-2, and so on.
examples:
  convnets explain photos/ --output heat/ --topk 2
  convnets explain cat.jpg --weights run/model_best.pth.tar --class dots,stripes    (into explanations/)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    add_input_arguments(parser)
    what = parser.add_argument_group("what is explained")
    what.add_argument("--method", choices=list(EXPLAIN_METHODS), default=DEFAULT_EXPLAIN_METHOD,
                      help=f"pytorch-grad-cam's method (default {DEFAULT_EXPLAIN_METHOD}: Grad-CAM that keeps each "
                           "position's own gradient instead of the channel's average; at layer4 the two maps are "
                           "the same, at earlier stages hirescam's follows the model more closely)")
    choose = what.add_mutually_exclusive_group()
    choose.add_argument("--class", dest="classes", action="append", default=None,
                        metavar="NAME|INDEX", help="a class to explain in every image: its name or index; several: "
                                                   "repeat the option or separate them with commas")
    choose.add_argument("--topk", type=positive_int, default=None, metavar="K",
                        help="explain the K best-scoring classes of each image (default: the best one; for a "
                             "multi-label model, the labels whose score reaches their threshold)")
    what.add_argument("--layer", choices=LAYERS, default=None,
                      help="the stage whose last block is explained (default: the last one whose feature map is at "
                           "least 6x6 at the image size, never layer1: layer4 from 192 px up, layer3 from 96, "
                           "layer2 below)")
    out = parser.add_argument_group("output")
    add_output_argument(out, metavar="DIR", help=f"directory (created) that gets the overlays, the heat maps and "
                                                 f"{RECORD} (default: {DEFAULT_EXPLAIN_OUTPUT}/ in the current directory)")
    add_force_argument(out, what="a heat map, an overlay or explanations.json in DIR")
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    run = parser.add_argument_group("run")
    add_device_argument(run)
    run.add_argument("--batch-size", type=batch_size, default=8, metavar="B",
                     help="images per forward pass (default 8; each class of each image is a row of the backward pass)")
    add_image_size_argument(run, default=None, help="center-crop size; the shorter side is resized to PX*256/224 "
                                                    "first (default: what the weights were trained for)")
    run.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                     help=f"time allowed for each URL download (default {DEFAULT_TIMEOUT:g})")
    add_private_urls_argument(run)


def prepare(args: argparse.Namespace, stack: ExitStack) -> Callable[[], int]:
    """Before anything heavy is imported: the inputs and ``--weights`` exist, ``--output`` (default
    :data:`~convnets.constants.DEFAULT_EXPLAIN_OUTPUT`) can be written and its record is not there (without
    ``--force``); returns the run."""
    if args.output is None:
        args.output = DEFAULT_EXPLAIN_OUTPUT
    from convnets.inputs.listing import Listing

    with usage_errors():
        inputs = Listing(args.inputs, recursive=args.recursive)  # each looked at once: the run resumes the walk
        check_inputs_exist("--from-file", None if args.from_file == "-" else args.from_file)
        check_inputs_exist("--weights", args.weights)
        check_output_directory(args.output)
        preflight(Path(args.output) / RECORD, force=args.force)
    return lambda: run(args, inputs, stack)


def run(args: argparse.Namespace, inputs: Listing, stack: ExitStack) -> int:
    """Run ``convnets explain`` on ``inputs`` (and ``--from-file``'s); 1 if an input could not be read."""
    from convnets.fileio import write_output
    from convnets.explanations import (default_layer, default_targets, explain_items, model_thresholds,
                                       resolve_classes)
    from convnets.inputs.listing import iter_inputs, read_sources
    from convnets.inference.job import input_error_message
    from convnets.inputs.names import escape_json, file_stems
    from convnets.preprocessing.classes import class_labels
    from convnets.preprocessing.presets import preset_for_model

    device = device_from_args(args)
    loaded = load_from_args(args, device=device)
    model = loaded.model
    labels = class_labels(model)
    if args.topk is not None and args.topk > len(labels):
        raise InvalidArgumentError(f"--topk {args.topk} is more than the {len(labels)} classes of the model")
    asked = None if args.classes is None else resolve_classes(_flat(args.classes, labels), labels, option="--class")
    thresholds = model_thresholds(model)

    def choose(position: int, scores: Any) -> list[int]:
        if asked is not None:
            return asked
        return default_targets(scores, topk=args.topk, class_names=labels, thresholds=thresholds)
    preset = preset_for_model(model)
    if args.image_size is not None:
        preset = preset.with_crop_size(args.image_size)
    layer = args.layer or default_layer(model, preset.crop_size)
    items = [*inputs, *iter_inputs(read_sources((), args.from_file, stack), recursive=args.recursive)]
    stems = file_stems(name for name, _ in items)
    output = Path(args.output)  # made by the first write_output
    records: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    for position, result in enumerate(explain_items(model, items, choose, method=args.method, layer=layer,
                                                    labels=labels, batch_size=args.batch_size, device=device,
                                                    preset=preset, timeout=args.timeout,
                                                    allow_private=args.allow_private)):
        if result.error is not None:
            message = input_error_message(result.error)
            sys.stderr.write(f"convnets explain: error: {message}\n")
            failed.append({"input": result.input, "error": message})
            continue
        for e in result.explanations:
            files = _write(e, output, f"{stems[position]}.{e.index}-{_label_part(e.label)}", force=args.force)
            records.append({"input": e.input, "index": e.index, "label": e.label, "score": e.score,
                            "heatmap": files[0], "overlay": files[1], "image_size": list(e.heatmap.shape[::-1]),
                            "crop_box": list(e.box)})
    record = {"method": args.method, "layer": layer, "model": loaded.name, "weights": loaded.weights,
              "crop_size": preset.crop_size,
              "heatmap": "float32 [height, width] of the input image as read (upright), 0..1; 0 outside crop_box "
                         "(left, top, right, bottom), the part of the image the model saw",
              "explanations": records, "errors": failed}
    text = escape_json(json.dumps(record, indent=2, ensure_ascii=False)) + "\n"
    write_output(output / RECORD, lambda f: f.write(text.encode("utf-8")), force=args.force, base=output)
    print(f"convnets explain: {len(records)} heat map(s) of {len(items) - len(failed)} image(s) in {output}, "
          f"recorded in {output / RECORD}")
    return 1 if failed else 0


def _flat(values: list[str], labels: list[str]) -> list[str]:
    """The classes of every ``--class``: a value that names a class is that class, else its comma-separated parts."""
    known = set(labels)
    return [part.strip() for value in values for part in ([value] if value in known else value.split(","))]


def _label_part(label: str) -> str:
    """A class name as a part of a file name (the index before it keeps names apart)."""
    from convnets.inputs.names import file_stem

    return file_stem(label.replace(".", "_") + ".x")[:40]


def _write(explanation: Explanation, output: Path, stem: str, *, force: bool) -> tuple[str, str]:
    """Write the heat map (``.npy``) and the overlay (``.png``) of one explanation; returns their names."""
    import numpy as np

    from convnets.fileio import write_output

    heatmap, overlay = f"{stem}.npy", f"{stem}.png"
    write_output(output / heatmap, lambda f: np.save(f, explanation.heatmap, allow_pickle=False), force=force,
                 base=output)
    picture = explanation.overlay()
    write_output(output / overlay, lambda f: picture.save(f, format="PNG"), force=force, base=output)
    return heatmap, overlay

