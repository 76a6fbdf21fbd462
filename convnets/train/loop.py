"""The fine-tuning loop: :func:`fit` trains and validates epoch after epoch, or resumes a run.

Reads top to bottom: :func:`fit` (entry point) -> :func:`_train` (set-up, resume, epochs,
checkpoints) -> :func:`_train_epoch` (one pass over this rank's shard, calling
:meth:`~convnets.train.step.Trainer.step`) -> :func:`evaluate`. Runs on one CPU or GPU, or under
``torchrun`` on several processes and machines (DDP; rank 0 logs and writes files, holding
``OUT/.lock`` for the whole run, so that a second run on the same ``--output`` fails at once). Checkpoints
(:class:`~convnets.train.checkpoint.TrainingCheckpoint`) are written atomically after every
epoch, and a run resumed from one ends with the same weights as an uninterrupted run (see
:mod:`convnets.data.folders` for how data order and augmentation are seeded).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from convnets import dist
from convnets.dist import DistContext
from convnets.errors import CheckpointError, DataError, InvalidArgumentError, message_for, short_repr
from convnets.extras import install_hint
from convnets.models.resnet import ResNet, count_parameters
from convnets.registry import check_classifier_kwargs, fetch_pretrained, get_model, load_model
from convnets.train.checkpoint import (BEST, BEST_SAFETENSORS, CHECKPOINT, TrainingCheckpoint, atomic_copy, get_rng_state,
                                       restore_rng_state)
from convnets.train.config import TrainConfig
from convnets.train.curves import CURVES, write_curves
from convnets.data.folders import Batch, DataSource, make_data, to_device
from convnets.evaluation.loop import accumulate
from convnets.train.metrics import METRICS, TrainSummary, append_metrics, format_rate, write_history
from convnets.runtime import Precision, default_workers, resolve_precision
from convnets.train.recipe import MultiLabelLoss, default_warmup_epochs, scaled_lr
from convnets.train.step import Trainer, configure_backends
from convnets.train.tensorboard import TENSORBOARD_DIR, TensorBoardLog, open_tensorboard
from convnets.weights.record import is_int
from convnets.weights.safetensors_io import save_safetensors

__all__ = ["evaluate", "fit"]

log = logging.getLogger(__name__)


def fit(config: TrainConfig) -> TrainSummary:
    """Train (or with ``config.evaluate`` only validate) as :class:`TrainConfig` says.

    Under ``torchrun`` every process calls this; rank 0 writes the files.

    Returns:
        The summary (on every rank; metrics are averaged over ranks).

    Raises:
        DataError, CheckpointError, UnknownModelError, TrainingDivergedError: see their messages; the
            command line turns them into one line and exit status 1.
        InvalidArgumentError, MissingDependencyError: likewise.
    """
    ctx = dist.setup(config.device)
    try:
        configure_backends(ctx.device)
        precision = resolve_precision(ctx.device, config.amp, config.amp_dtype, config.memory_format)
        if config.evaluate:
            return _evaluate_only(config, ctx, precision)
        with _output_lock(config.output, ctx):
            return _train(config, ctx, precision)
    finally:
        dist.teardown()


#: The lock file of a run's output directory (deleted when the run ends).
LOCK = ".lock"


@contextlib.contextmanager
def _output_lock(out: Path | None, ctx: DistContext) -> Iterator[None]:
    """On rank 0, hold ``OUT/.lock`` for the whole run (created first, so a second run fails at once,
    naming the first: :func:`convnets.locking.exclusive_lock` writes the holder's PID and host)."""
    if out is None or not ctx.is_main:
        yield
        return
    from convnets.locking import LockHeldError, exclusive_lock

    lock = out / LOCK
    with contextlib.ExitStack() as stack:
        try:
            out.mkdir(parents=True, exist_ok=True)
            stack.enter_context(exclusive_lock(lock, timeout=0))
        except LockHeldError as e:
            raise InvalidArgumentError(f"--output {out} is being written by another run "
                                       f"({e.holder or 'another process'}; lock file {lock}): wait for it to "
                                       "finish, or choose another --output") from e
        except OSError as e:
            raise InvalidArgumentError(f"--output {out}: cannot lock it ({e.strerror or e})") from e
        yield


def _build_model(cfg: TrainConfig, num_classes: int | None, ctx: DistContext, *, init_only: bool) -> ResNet:
    check_classifier_kwargs(cfg.arch_kwargs)
    kwargs: dict[str, Any] = dict(cfg.arch_kwargs, num_classes=num_classes, progress=ctx.is_main)
    try:
        if init_only or not (cfg.pretrained or cfg.pretrained_from_file):
            return get_model(cfg.arch, **kwargs)
        if cfg.pretrained_from_file is not None:
            return get_model(cfg.arch, pretrained_from_file=cfg.pretrained_from_file, **kwargs)
        if ctx.local_rank == 0:
            # One process per machine downloads and verifies; the others then read its cache (with
            # a cache shared between machines, its file lock makes that one download per job).
            fetch_pretrained(cfg.arch)
        dist.barrier(ctx)
        return get_model(cfg.arch, pretrained=True, **kwargs)
    except TypeError as e:  # an unknown arch_kwargs key
        raise InvalidArgumentError(f"arch_kwargs: {message_for(e, 'python')}",
                                   cli=f"--arch-kwargs: {message_for(e, 'cli')}") from e


def _workers(cfg: TrainConfig, ctx: DistContext) -> int:
    """``workers``, or as many as ``convnets predict`` starts on this machine (its share under torchrun)."""
    return cfg.workers if cfg.workers is not None else default_workers(ctx.device.type,
                                                                        processes=dist.local_processes())


def _evaluate_only(cfg: TrainConfig, ctx: DistContext, precision: Precision) -> TrainSummary:
    start = time.perf_counter()
    data = make_data(cfg.data_backend, cfg.data, batch_size=cfg.batch_size, image_size=cfg.image_size,
                     workers=_workers(cfg, ctx), seed=cfg.seed, ctx=ctx, train=False, labels=cfg.labels)
    models = {}
    if cfg.resume is not None:
        models["val"] = load_model(cfg.resume)
        with contextlib.suppress(CheckpointError):  # a checkpoint without EMA weights
            models["ema_val"] = load_model(cfg.resume, use_ema=True)
    else:
        models["val"] = _build_model(cfg, None, ctx, init_only=False)
    metrics: dict[str, Any] = {}
    for prefix, model in models.items():
        _check_head(model, data.classes, cfg)
        model.to(ctx.device).to(memory_format=precision.memory_format)
        criterion = (MultiLabelLoss(cfg.label_smoothing) if data.multilabel
                     else nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing))
        result = evaluate(model, data.val(), precision, ctx, criterion, multilabel=data.multilabel)
        metrics.update({f"{prefix}_{k}": v for k, v in result.items() if k in ("loss", "top1", "top5", "mAP", "f1")})
        metrics["images"], metrics["unreadable_images"] = result["images"], result["unreadable"]
    return TrainSummary(0, metrics, unreadable_images=metrics["unreadable_images"], precision=precision.name,
                        seconds=time.perf_counter() - start)


def _check_head(model: ResNet, classes: list[str], cfg: TrainConfig) -> None:
    source = cfg.resume or cfg.pretrained_from_file or f"the pretrained {cfg.arch}"
    if model.num_classes != len(classes):
        raise DataError(f"{source} classifies {model.num_classes} classes but {cfg.data}/val has "
                        f"{len(classes)}; evaluate on a data set with the classes it was trained on")
    if model.class_names is not None and model.class_names != classes:
        raise DataError(f"the class names of {source} differ from the folders of {cfg.data}/val "
                        f"(e.g. {model.class_names[:3]} vs {classes[:3]})")


def _prepare_output(out: Path, resuming: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if not resuming and (out / CHECKPOINT).exists():
        held = f"{out} already holds {CHECKPOINT} of another run; continue it with"
        raise InvalidArgumentError(f"{held} resume={str(out / CHECKPOINT)!r} or choose another output directory",
                                   cli=f"{held} --resume {out / CHECKPOINT} or choose another --output",
                                   keyword="resume")


def _train(cfg: TrainConfig, ctx: DistContext, precision: Precision) -> TrainSummary:
    start = time.perf_counter()
    out = cfg.output
    if out is None:
        raise InvalidArgumentError("--output DIR is required for training")
    ckpt = None
    if cfg.resume is not None:
        ckpt = TrainingCheckpoint.read(cfg.resume, hint="to fine-tune from its weights use --pretrained-from-file "
                                                         "instead of --resume")
    if ctx.is_main:
        _prepare_output(out, resuming=ckpt is not None)
    data = make_data(cfg.data_backend, cfg.data, batch_size=cfg.batch_size, image_size=cfg.image_size,
                     workers=_workers(cfg, ctx), seed=cfg.seed, ctx=ctx, labels=cfg.labels)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
    model = _build_model(cfg, len(data.classes), ctx, init_only=ckpt is not None)
    model.class_names = list(data.classes)
    # A model fine-tuned from a multi-label checkpoint on single-label data is single-label, and back.
    model.multilabel, model.thresholds = data.multilabel, None
    if ckpt is not None:
        _check_resume(ckpt, model, data.classes, cfg)
    model.to(ctx.device).to(memory_format=precision.memory_format)

    steps_per_epoch = data.steps_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise DataError(f"--grad-accum {cfg.grad_accum} needs at least that many batches per epoch; "
                        f"there are {data.steps_per_epoch}")
    if data.steps_per_epoch % cfg.grad_accum:
        log.warning("%d batches per epoch are not a multiple of --grad-accum %d; the last %d are skipped",
                    data.steps_per_epoch, cfg.grad_accum, data.steps_per_epoch % cfg.grad_accum)
    global_batch = cfg.batch_size * ctx.world_size * cfg.grad_accum
    lr = cfg.lr if cfg.lr is not None else scaled_lr(global_batch)
    warmup_epochs = cfg.warmup_epochs if cfg.warmup_epochs is not None else default_warmup_epochs(global_batch, cfg.epochs)
    trainer = Trainer.from_config(cfg, model, precision, lr=lr, total_steps=steps_per_epoch * cfg.epochs,
                                  warmup_steps=round(warmup_epochs * steps_per_epoch), ddp=ctx.distributed)
    history: list[dict[str, Any]] = []
    first_epoch, best_top1, best_epoch = 0, -math.inf, 0
    if ckpt is not None:
        trainer.load_checkpoint(ckpt, str(cfg.resume))
        if ckpt.rng is not None:
            restore_rng_state(ckpt.rng, str(cfg.resume))
        else:
            log.warning("%s records no random state; the global generators are not restored", cfg.resume)
        first_epoch, history = ckpt.epoch, list(ckpt.history)
        best_top1, best_epoch = float(ckpt.best_top1), ckpt.best_epoch
        if ctx.is_main:
            write_history(out / METRICS, history)
    elif ctx.is_main:
        write_history(out / METRICS, [])
    if ctx.is_main:
        log.info("%s (%s parameters, %d classes), %s; %d x %d process(es) x %d accumulation = batch %d, "
                 "lr %.4g, warmup %.3g epochs; %d train / %d val images; resuming at epoch %d",
                 cfg.arch, f"{count_parameters(model):,}", len(data.classes), precision.describe(), cfg.batch_size,
                 ctx.world_size, cfg.grad_accum, global_batch, lr, warmup_epochs, data.num_train, data.num_val,
                 first_epoch)

    criterion = trainer.criterion  # validation loss = training loss (label-smoothed, multi-label or not)
    headline = "val_mAP" if data.multilabel else "val_top1"  # what the best epoch is chosen by
    # Fed the very records of metrics.jsonl (after each is appended), so the two cannot disagree.
    board = (open_tensorboard(out / TENSORBOARD_DIR, history, first_step=first_epoch * steps_per_epoch)
             if ctx.is_main and cfg.tensorboard else None)
    try:
        for epoch in range(first_epoch, cfg.epochs):
            epoch_start = time.perf_counter()
            record: dict[str, Any] = {"epoch": epoch + 1}
            record.update(_train_epoch(trainer, data, epoch, steps_per_epoch, cfg, ctx, board))
            trainer.sync_buffers()
            val = evaluate(model, data.val(), precision, ctx, criterion, multilabel=data.multilabel)
            if data.multilabel:
                record.update(val_loss=val["loss"], val_mAP=val["mAP"], val_f1=val["f1"], val_images=val["images"])
            else:
                record.update(val_loss=val["loss"], val_top1=val["top1"], val_top5=val["top5"],
                              val_images=val["images"])
            record["unreadable_images"] += val["unreadable"]
            if trainer.ema is not None:
                ema = evaluate(trainer.ema.module, data.val(), precision, ctx, criterion, multilabel=data.multilabel)
                record.update({f"ema_{k}": ema[k[4:]] for k in record if k.startswith("val_") and k != "val_images"})
            if trainer.scaler is not None:  # fp16 loss scaling: the scale after the epoch's last step
                record["loss_scale"] = float(trainer.scaler.get_scale())
            record["epoch_seconds"] = time.perf_counter() - epoch_start
            history.append(record)
            if record[headline] > best_top1:
                best_top1, best_epoch = record[headline], epoch + 1
            thresholds = val.get("thresholds") if data.multilabel else None
            if ctx.is_main:
                trainer.to_checkpoint(
                    epoch=epoch + 1, best_top1=best_top1, best_epoch=best_epoch, history=history, rng=get_rng_state(),
                    config=cfg.to_dict(), arch=cfg.arch, arch_spec=model.spec.to_dict(), class_names=list(data.classes),
                    world_size=ctx.world_size, multilabel=data.multilabel, thresholds=thresholds).write(out / CHECKPOINT)
                if best_epoch == epoch + 1:
                    atomic_copy(out / CHECKPOINT, out / BEST)
                    # The same weights as BEST's state_dict (the unwrapped model, not its EMA), pickle-free
                    # and self-describing. image_size is explicit: the model's input_size stays 224.
                    save_safetensors(trainer.model, out / BEST_SAFETENSORS, arch_spec=model.spec,
                                     class_names=list(data.classes), image_size=cfg.image_size, thresholds=thresholds)
                # After the checkpoint: a crash in between loses this line, and --resume rewrites
                # metrics.jsonl from the checkpoint's history anyway.
                append_metrics(out / METRICS, record)
                if board is not None:
                    board.add_record(record)
                    board.flush()
    finally:
        if board is not None:
            board.close()
    if ctx.is_main and history:
        _draw_curves(out)

    last = history[-1] if history else {}
    return TrainSummary(
        epochs=len(history), metrics=last, best_top1=best_top1 if history else None, best_epoch=best_epoch or None,
        checkpoint=out / CHECKPOINT, best_checkpoint=out / BEST, metrics_file=out / METRICS,
        unreadable_images=sum(r.get("unreadable_images", 0) for r in history),
        skipped_steps=sum(r.get("skipped_steps", 0) for r in history), seconds=time.perf_counter() - start,
        history=history, precision=precision.name)


def _draw_curves(out: Path) -> None:
    """``OUT/curves.png`` from ``OUT/metrics.jsonl``; a convenience that never fails the finished run."""
    try:
        write_curves(out, force=True)  # the run's own figure, redrawn
    except ImportError:  # MissingDependencyError too
        log.warning("%s not drawn: matplotlib is not installed (%s)", CURVES, install_hint("plots"))
    except Exception as e:  # the checkpoints and metrics are complete; a figure problem must not fail the run
        log.warning("%s not drawn: %s", CURVES, e)


def _check_resume(ckpt: TrainingCheckpoint, model: ResNet, classes: list[str], cfg: TrainConfig) -> None:
    if ckpt.epoch > cfg.epochs:  # else nothing would run, and a damaged count would pass for a finished run
        planned = ckpt.config.get("epochs")
        advice = (f"resume with --epochs {planned} as its run did" if is_int(planned) and planned >= ckpt.epoch
                  else "resume with at least as many --epochs")
        raise CheckpointError(f"{cfg.resume} records {short_repr(ckpt.epoch)} completed epochs, more than --epochs "
                              f"{cfg.epochs}: {advice}, or start a new run from it with --pretrained-from-file")
    if ckpt.arch_spec != model.spec.to_dict():
        raise CheckpointError(
            f"{cfg.resume} was trained as {ckpt.arch or '?'} {ckpt.arch_spec}, but this run builds "
            f"{cfg.arch} {model.spec.to_dict()}; pass the --arch / --arch-kwargs of that run (its config is "
            "stored in the checkpoint), or start a new run with --pretrained-from-file")
    if ckpt.multilabel != cfg.multilabel:
        raise CheckpointError(f"{cfg.resume} is of a {'multi' if ckpt.multilabel else 'single'}-label run; resume it "
                              f"{'with' if ckpt.multilabel else 'without'} --multilabel, or fine-tune from it with "
                              "--pretrained-from-file instead")
    if ckpt.class_names != list(classes):
        raise CheckpointError(f"{cfg.resume} was trained on other classes ({len(ckpt.class_names)}, e.g. "
                              f"{ckpt.class_names[:3]}) than {cfg.data} has ({len(classes)}, e.g. "
                              f"{classes[:3]}); fine-tune from it with --pretrained-from-file instead")


def _train_epoch(trainer: Trainer, data: DataSource, epoch: int, steps: int, cfg: TrainConfig,
                 ctx: DistContext, board: TensorBoardLog | None = None) -> dict[str, Any]:
    """One pass over this rank's shard; returns the epoch's training metrics (averaged over ranks).

    Every ``cfg.print_freq`` steps of the epoch (counted from its start, so a resumed run logs the
    steps an uninterrupted one does) the interval's loss, lr and img/s go to ``board`` (rank 0)
    and, when no progress bar shows them, to the log (INFO: ``convnets train -v``).
    """
    precision = trainer.precision
    rng = np.random.default_rng((cfg.seed, epoch, ctx.rank))  # MixUp draws: a function of (seed, epoch, rank)
    batches = iter(data.train_epoch(epoch))
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step", file=sys.stderr,
               disable=not (ctx.is_main and cfg.progress), dynamic_ncols=True)
    loss_sum = 0.0
    finite_steps = images = unreadable = skipped = 0
    lr = trainer.lr
    start = time.perf_counter()
    interval = _Interval(start)
    with bar:
        for i in range(steps):
            micro = []
            for _ in range(cfg.grad_accum):
                x, y, bad = next(batches)
                unreadable += bad
                if len(y) == 0:
                    raise DataError(f"no image of a training batch of {cfg.data}/train could be read")
                micro.append((to_device(x, precision.device, precision.memory_format),
                              y.to(precision.device, non_blocking=True)))
                images += len(y)
            lr = trainer.lr
            result = trainer.step(micro, rng)
            if result.skipped:
                skipped += 1
            elif math.isfinite(result.loss):
                loss_sum += result.loss
                finite_steps += 1
            rate = images * ctx.world_size / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr:.4g}", img_s=format_rate(rate), refresh=False)
            bar.update()
            interval.add(result, sum(len(y) for _, y in micro))
            if (i + 1) % cfg.print_freq == 0:
                interval.log(board, epoch * steps + i + 1, lr, ctx, to_log=not cfg.progress)
    seconds = time.perf_counter() - start
    # Over all ranks (floats: all_reduce_sum sums in float64).
    all_loss, all_finite, all_images, all_unreadable = dist.all_reduce_sum(
        [loss_sum, finite_steps, images, unreadable], ctx)
    return {"train_loss": all_loss / all_finite if all_finite else float("nan"), "lr": lr,
            "img_per_s": all_images / seconds, "train_images": int(all_images), "skipped_steps": skipped,
            "unreadable_images": int(all_unreadable)}


class _Interval:
    """The training figures of the steps since the last ``--print-freq`` point."""

    def __init__(self, start: float) -> None:
        self.start, self.loss_sum, self.finite, self.images = start, 0.0, 0, 0

    def add(self, result: Any, images: int) -> None:
        if not result.skipped and math.isfinite(result.loss):
            self.loss_sum += result.loss
            self.finite += 1
        self.images += images

    def log(self, board: TensorBoardLog | None, step: int, lr: float, ctx: DistContext, *, to_log: bool) -> None:
        """Write the interval at global ``step`` and start the next one (every rank calls this:
        the sums are all-reduced, as the epoch's are)."""
        now = time.perf_counter()
        loss_sum, finite, images = dist.all_reduce_sum([self.loss_sum, self.finite, self.images], ctx)
        loss = loss_sum / finite if finite else float("nan")
        rate = images / max(now - self.start, 1e-9)
        if board is not None:
            board.add_interval(step, loss, lr, rate)
        if to_log and ctx.is_main:  # no progress bar shows them
            log.info("step %d: loss %.4f, lr %.4g, %s img/s", step, loss, lr, format_rate(rate))
        self.start, self.loss_sum, self.finite, self.images = now, 0.0, 0, 0


def evaluate(model: nn.Module, batches: Iterable[Batch], precision: Precision, ctx: DistContext,
             criterion: nn.Module | None = None, *, multilabel: bool = False) -> dict[str, Any]:
    """Validation loss, top-1 and top-5 accuracy (percent) over all processes' batches; of a multi-label
    model, its loss, mAP, per-class thresholds and macro F1 at them instead.

    Sums (not means) are all-reduced (:func:`convnets.evaluation.loop.accumulate`, the loop that
    ``convnets evaluate`` runs too), so the result is that of the whole validation set.

    Returns:
        ``{"loss", "top1", "top5", "images", "unreadable"}``; multi-label: ``{"loss", "mAP", "f1",
        "thresholds", "images", "unreadable"}``, the thresholds maximising each class's F1 on these
        batches (:func:`~convnets.evaluation.multilabel.choose_thresholds`) and ``f1`` the macro F1 at
        them (fractions).

    Raises:
        DataError: no validation image could be read.
    """
    totals = accumulate(model, batches, precision, ctx, criterion, multilabel=multilabel)
    n = totals.images
    if totals.scores is not None and totals.targets is not None:
        from convnets.evaluation.multilabel import MultiLabelReport, choose_thresholds

        thresholds = choose_thresholds(totals.scores, totals.targets)
        names = [str(i) for i in range(totals.scores.shape[1])]
        report = MultiLabelReport.from_scores(totals.scores, totals.targets, thresholds, names)
        return {"loss": totals.loss_sum / n, "mAP": report.metrics["mAP"], "f1": report.metrics["macro_f1"],
                "thresholds": thresholds, "images": n, "unreadable": totals.unreadable}
    return {"loss": totals.loss_sum / n, "top1": 100 * totals.top1 / n, "top5": 100 * totals.top5 / n, "images": n,
            "unreadable": totals.unreadable}
