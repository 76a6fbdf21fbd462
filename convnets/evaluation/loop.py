"""Evaluation: the one loop that validates a model, and :func:`evaluate_model` around it.

:func:`accumulate` runs a model over evaluation batches and sums loss, top-1 / top-5 hits and,
when asked, the confusion matrix (summed over DDP ranks) into an :class:`EvalTotals`; on multi-label
batches (multi-hot targets) it keeps every image's sigmoid probabilities and target instead
(gathered from every rank), from which :mod:`convnets.evaluation.multilabel` computes its figures. The training
loop's per-epoch validation and ``train --evaluate`` (:func:`convnets.train.loop.evaluate`) and
:func:`evaluate_model` (``convnets evaluate``) all use it.

:func:`evaluate_model` reads a data set in any layout of :mod:`convnets.evaluation.data` (class
folders, ImageNet's flat validation images with Kaggle's or the devkit's labels), runs the model
with its own evaluation preset (:func:`~convnets.preprocessing.presets.preset_for_model`: what
``train --evaluate`` and ``predict`` use) and returns the
:class:`~convnets.evaluation.report.EvaluationReport` of the totals (its metrics, conventions,
``report.json`` and table are :mod:`convnets.evaluation.report`'s).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from convnets import dist
from convnets.dist import DistContext
from convnets.errors import DataError, InvalidArgumentError
from convnets.preprocessing.device import resolve_decode
from convnets.preprocessing.classes import NUM_CLASSES, get_imgnet_classes, get_imgnet_synsets
from convnets.preprocessing.presets import DEFAULT_PRESET, EvalPreset, preset_for_model
from convnets.data.batches import Batch
from convnets.data.folders import decode_on_device, eval_loader, to_device
from convnets.deploy.engines.base import DEFAULT_SETTINGS, EngineSettings
from convnets.evaluation.data import EvalSamples, find_eval_samples, multilabel_samples
from convnets.evaluation.multilabel import AP_CHART, MultiLabelReport
from convnets.fileio import preflight
# EvalTotals is what accumulate returns: re-exported so its callers need one import.
from convnets.evaluation.report import EvalTotals, EvaluationReport, check_report_destination
from convnets.runtime import Precision

__all__ = ["EvalTotals", "accumulate", "class_keys_and_names", "evaluate_model"]


@torch.inference_mode()
def accumulate(model: nn.Module, batches: Iterable[Batch], precision: Precision, ctx: DistContext,
               criterion: nn.Module | None = None, *, num_classes: int | None = None,
               preset: EvalPreset = DEFAULT_PRESET, progress: Any = None, multilabel: bool = False) -> EvalTotals:
    """Run ``model`` over ``batches`` and sum what evaluation reports, over all processes.

    Args:
        model: the network (put in eval mode here).
        batches: ``(images, targets, unreadable)`` batches of this process's share.
        precision: device, autocast and memory format.
        ctx: this process's place in the job (sums are all-reduced).
        criterion: the loss (e.g. label-smoothed, as in training); ``None``: cross-entropy in float64 (on
            multi-label batches: binary cross-entropy, the mean over the classes per image).
        num_classes: also count the confusion matrix of this many classes.
        preset: the mean and std that normalise uint8 batches.
        progress: a ``tqdm`` bar to advance by the images of each batch.
        multilabel: the batches have multi-hot targets (also known from the batches themselves; say so that
            a rank without images still joins the other ranks' gathering).

    Returns:
        The sums over every process's share (the confusion matrix with ``num_classes``).

    Raises:
        DataError: no image could be read.
    """
    model.eval()
    device = precision.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits
    c = 0 if num_classes is None else num_classes  # classes of the confusion matrix (read only when counted)
    confusion = None if num_classes is None else torch.zeros(c * c, dtype=torch.int64, device=device)
    images_seen = unreadable = 0
    scores: list[torch.Tensor] = []
    truths: list[torch.Tensor] = []
    for images, targets, bad in batches:
        unreadable += bad
        if len(targets) == 0:
            continue
        x = to_device(images, device, precision.memory_format, preset)
        y = targets.to(device, non_blocking=True)
        with precision.autocast():
            out = model(x)
        if y.ndim == 2:  # multi-hot targets: a multi-label model
            if criterion is None:
                loss = F.binary_cross_entropy_with_logits(out.double(), y.double(), reduction="none").mean(1).sum()
            else:
                loss = criterion(out.float(), y).double() * len(y)
            sums[0] += loss
            scores.append(torch.sigmoid(out.float()).cpu())
            truths.append(y.float().cpu())
            images_seen += len(y)
            if progress is not None:
                progress.update(len(y))
            continue
        if criterion is None:
            loss = F.cross_entropy(out.double(), y, reduction="sum")
        else:
            loss = criterion(out.float(), y).double() * len(y)
        top = out.topk(min(5, out.shape[1]), dim=1).indices
        hits = top == y[:, None]
        sums += torch.stack([loss, hits[:, 0].sum(), hits.any(1).sum()])
        if confusion is not None:
            confusion += torch.bincount(y * c + top[:, 0], minlength=c * c)
        images_seen += len(y)
        if progress is not None:
            progress.update(len(y))
    loss_sum, top1, top5 = sums.tolist()
    loss_sum, top1, top5, n, bad_files = dist.all_reduce_sum([loss_sum, top1, top5, images_seen, unreadable], ctx)
    if n == 0:
        raise DataError("no evaluation image could be read")
    if scores or multilabel:
        width = scores[0].shape[1] if scores else 0
        score = torch.cat(scores).numpy() if scores else np.zeros((0, width), np.float32)
        truth = torch.cat(truths).numpy() if truths else np.zeros((0, width), np.float32)
        if ctx.distributed:  # every rank's images (each rank has a share of its own size)
            gathered: list[Any] = [None] * ctx.world_size
            torch.distributed.all_gather_object(gathered, (score, truth))
            score = np.concatenate([g[0] for g in gathered if len(g[0])])
            truth = np.concatenate([g[1] for g in gathered if len(g[1])])
        return EvalTotals(loss_sum, 0, 0, int(n), int(bad_files), scores=score, targets=truth)
    matrix = None
    if confusion is not None:
        if ctx.distributed:
            torch.distributed.all_reduce(confusion)
        matrix = confusion.view(c, c).cpu().numpy()
    return EvalTotals(loss_sum, int(top1), int(top5), int(n), int(bad_files), matrix)


def class_keys_and_names(model: nn.Module) -> tuple[list[str], list[str]]:
    """The model's class keys (its class names, or ImageNet's WordNet ids) and readable names.

    Args:
        model: a classifier; ``class_names`` and ``num_classes`` attributes are read when present.

    Returns:
        ``(keys, names)``, one of each per output: ImageNet's short names for its 1000 classes,
        else the keys themselves (``"class i"`` without class names).
    """
    num = int(getattr(model, "num_classes", 0))
    class_names = getattr(model, "class_names", None)
    if class_names is not None:
        keys = [str(c) for c in class_names]
        if num == NUM_CLASSES and keys == [str(s) for s in get_imgnet_synsets()]:
            return keys, _short_imagenet_names()
        return keys, keys
    if num == NUM_CLASSES:
        return [str(s) for s in get_imgnet_synsets()], _short_imagenet_names()
    return [f"class {i}" for i in range(num)], [f"class {i}" for i in range(num)]


def _short_imagenet_names() -> list[str]:
    """ImageNet's readable names, first synonym only ("tench", not "tench, Tinca tinca")."""
    return [str(n).split(",")[0] for n in get_imgnet_classes()]


def _resolve_model(model: nn.Module | str | os.PathLike[str]) -> tuple[nn.Module, str, str]:
    """``(model, its name, where its weights came from)`` for a module, a registered name or a checkpoint."""
    from convnets.models.specs import MODEL_SPECS, registered_name
    from convnets.registry import get_model, load_model

    if isinstance(model, nn.Module):
        spec = getattr(model, "spec", None)
        return model, (registered_name(spec) if spec is not None else None) or type(model).__name__, "given"
    text = str(model)
    if not Path(text).exists() and text.replace("-", "_") in MODEL_SPECS:
        return get_model(text, pretrained=True), text, "pretrained"
    loaded = load_model(text)
    return loaded, registered_name(loaded.spec) or "custom ResNet", text


def evaluate_model(model: nn.Module | str | os.PathLike[str], data: str | os.PathLike[str], *,
                   labels: str | os.PathLike[str] | None = None, output: str | os.PathLike[str] | None = None,
                   batch_size: int = 64, workers: int | None = None, device: str | torch.device | None = None,
                   precision: str = "fp32", memory_format: str | None = None, progress: bool = False,
                   fast_decode: bool = False, engine: str | None = None, compile: bool = False,
                   cache: bool = True, settings: EngineSettings = DEFAULT_SETTINGS,
                   force: bool = False, decode: str = "auto") -> EvaluationReport | MultiLabelReport:
    """Evaluate a model on a labelled image set and (with ``output``) write its report.

    Example::

        report = evaluate_model("se_resnext101_32x4d", "imagenet/val", output="report/")
        print(report.top1, report.confused_pairs[0])

    Args:
        model: a model (moved to ``device``, in eval mode), a checkpoint path (any layout
            :func:`convnets.load_model` reads), or a registered name (its pretrained weights).
        data: the data set, in any layout of :mod:`convnets.evaluation.data`.
        labels: the labels file of a flat ImageNet layout (default: searched for); for a multi-label model
            (``model.multilabel``) the labels CSV (required), whose ``val`` rows (or all rows, without a
            ``val`` split) are evaluated.
        output: the report directory: ``report.json`` and ``confusion.png`` (multi-label: ``report.json`` and
            the per-class chart ``ap.png``); ``None``: none written.
            Files of an earlier report there are refused before the evaluation, unless ``force``.
        batch_size: images per forward pass.
        workers: data-loader processes; ``None``: as many as :func:`convnets.predict` starts for ``device``
            (:func:`convnets.runtime.default_workers`).
        device: ``"auto"`` / ``None`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (autocast).
        memory_format: ``"channels_last"`` / ``"contiguous"``; ``None``: channels_last under autocast.
        progress: show a progress bar on stderr.
        fast_decode: decode large JPEGs at a reduced DCT scale, as ``predict --fast-decode`` does
            (:func:`~convnets.preprocessing.pipeline.prepare_batch`): evaluate with and without it to
            see what it costs in accuracy on your data. Recorded in the report's ``source``.
        engine: ``None`` (default): the model as given, under autocast (what training's validation
            runs); else an engine of :func:`~convnets.deploy.optimize.optimize_for_inference`
            (``"torch"``, ``"onnxruntime"``, ``"openvino"``, or ``"auto"``: ``convnets evaluate``'s
            default) runs it, with its graph from the engine cache when one is there. Recorded in
            the report's ``source``.
        compile: with ``engine="torch"``: ``torch.compile`` the model.
        cache: with an engine other than torch: use the engine cache (see ``optimize_for_inference``).
        settings: with an engine: how it runs (threads, ...; see ``optimize_for_inference``).
        force: replace the report files of an earlier evaluation in ``output``.
        decode: where JPEGs are decoded: ``"auto"`` (on ``device`` when it is a CUDA GPU, else with Pillow),
            ``"cpu"`` or ``"device"`` (as for :func:`convnets.predict`). Recorded in the report's ``source``.

    Returns:
        The report: an :class:`EvaluationReport`, or for a multi-label model a
        :class:`~convnets.evaluation.multilabel.MultiLabelReport` (``mAP``, ``micro_AP``, per-class AP and
        precision / recall / F1 at the model's thresholds).

    Raises:
        DataError: no layout matches ``data``, its classes are not the model's, or no image is readable.
        InvalidArgumentError, UnsupportedPrecisionError: a bad setting; a report file in ``output``
            exists (without ``force``).
        CheckpointError, WeightsUnavailableError: from loading the model.
    """
    from convnets.runtime import PRECISIONS, default_workers, resolve_device, resolve_precision

    if output is not None:
        check_report_destination(output, force=force)  # before the evaluation, not after it
    for name, value in (("batch_size", batch_size), ("workers", 0 if workers is None else workers)):
        if not isinstance(value, int) or value < (1 if name == "batch_size" else 0):
            raise InvalidArgumentError(f"{name} must be a {'positive' if name == 'batch_size' else 'non-negative'} "
                                       f"integer, got {value!r}")
    resolve_decode(decode, "cpu")  # a bad value refused before the model loads
    if precision not in PRECISIONS:
        raise InvalidArgumentError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if engine is None and settings != DEFAULT_SETTINGS:
        raise InvalidArgumentError(f"settings are how an engine runs the model: give engine= too (e.g. 'auto'), "
                                   f"or leave settings out; got {settings!r}", keyword="settings")
    start = time.perf_counter()
    net, model_name, weights = _resolve_model(model)
    dev = resolve_device(device, option="device")
    workers = default_workers(dev.type) if workers is None else workers
    decode = resolve_decode(decode, dev)
    amp = precision != "fp32"
    run = resolve_precision(dev, amp=amp, amp_dtype=precision if amp else None, memory_format=memory_format,
                            option="precision")
    keys, names = class_keys_and_names(net)
    multilabel = bool(getattr(net, "multilabel", False))
    if multilabel:
        if output is not None:
            preflight(Path(output) / AP_CHART, force=force)
        found: EvalSamples = multilabel_samples(data, labels, keys)
    else:
        found = find_eval_samples(data, class_names=getattr(net, "class_names", None), num_classes=len(keys),
                                  labels=labels)
    preset = preset_for_model(net)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=dev)
    net.to(dev)
    net.to(memory_format=run.memory_format)  # torch's stubs lack to(device, memory_format=)
    runner: nn.Module = net
    if engine is not None:
        from convnets.deploy.optimize import optimize_for_inference

        runner = optimize_for_inference(net.eval(), precision, device=dev, engine=engine, compile=compile,
                                        cache=cache, settings=settings)
    batches: Iterable[Batch] = eval_loader(found.samples, preset, batch_size=batch_size, workers=workers, ctx=ctx,
                                           fast_decode=fast_decode, decode=decode)
    if decode == "device":
        batches = decode_on_device(batches, preset, dev, fast_decode)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(found.samples), unit="img", file=sys.stderr, dynamic_ncols=True)
    try:
        totals = accumulate(runner, batches, run, ctx, num_classes=None if multilabel else len(keys), preset=preset,
                            progress=bar, multilabel=multilabel)
    finally:
        if bar is not None:
            bar.close()
    source = {"data": str(data), "layout": found.layout, "images_dir": str(found.images),
              "labels_file": None if found.labels_file is None else str(found.labels_file),
              "unlabelled_images": found.skipped, "model": model_name, "weights": weights,
              "preset": asdict(preset), "fast_decode": fast_decode, "decode": decode, "precision": precision, "device": str(dev),
              "engine": getattr(runner, "engine", None),
              "seconds": round(time.perf_counter() - start, 3)}
    report: EvaluationReport | MultiLabelReport
    if multilabel and totals.scores is not None and totals.targets is not None:
        source["split"] = found.split
        source["rows_of_other_splits"] = source.pop("unlabelled_images")
        thresholds = getattr(net, "thresholds", None) or [0.5] * len(keys)
        report = MultiLabelReport.from_scores(totals.scores, totals.targets, thresholds, names,
                                              loss=totals.loss_sum / totals.images, unreadable=totals.unreadable,
                                              source=source)
    else:
        report = EvaluationReport.from_totals(totals, keys, names, source)
    if output is not None:
        report.write(output, force=force)
    return report
