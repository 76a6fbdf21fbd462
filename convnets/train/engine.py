"""The fine-tuning loop: :func:`fit` trains and validates, :class:`Trainer` is one optimizer step.

Recipe: https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets
(see :mod:`convnets.train.recipe`). Runs on one CPU or GPU, or under ``torchrun`` on several
processes and machines (DDP; rank 0 logs and writes files). Checkpoints are written atomically
after every epoch, and a run resumed from one ends with the same weights as an uninterrupted run
(see :mod:`convnets.train.data` for how data order and augmentation are seeded).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from convnets.errors import CheckpointError, DataError, TrainingDivergedError
from convnets.fileio import atomic_write
from convnets.models.resnet import ResNet, count_parameters
from convnets.registry import fetch_pretrained, get_model, load_model
from convnets.train import dist
from convnets.train.checkpoint import (BEST, CHECKPOINT, FORMAT, atomic_copy, atomic_save, get_rng_state,
                                       read_training_checkpoint, set_rng_state)
from convnets.train.config import TrainConfig
from convnets.train.data import Batch, DataSource, make_data, to_device
from convnets.train.dist import DistContext
from convnets.train.recipe import (LABEL_SMOOTHING, MOMENTUM, WEIGHT_DECAY, Precision, default_warmup_epochs,
                                   make_ema, make_optimizer, make_scheduler, mixup, resolve_precision, scaled_lr)

__all__ = ["METRICS", "StepResult", "TrainSummary", "Trainer", "benchmark_training", "evaluate", "fit"]

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: mean loss over its micro-batches, and whether the update was skipped."""

    loss: float
    skipped: bool


class Trainer:
    """Model, optimizer, lr schedule, loss scaler and EMA, and the step that updates them.

    Args:
        model: the network (unwrapped), already on its device and memory format.
        precision: autocast dtype and loss scaling (:func:`~convnets.train.recipe.resolve_precision`).
        lr: peak learning rate.
        total_steps: optimizer steps of the whole run (length of the cosine schedule).
        warmup_steps: linear-warmup steps at its start.
        momentum, weight_decay, label_smoothing, mixup_alpha, ema_decay: the recipe's knobs.
        ddp: wrap the model in DistributedDataParallel (a process group must exist).
        max_nonfinite_steps: raise after this many skipped steps in a row.
    """

    def __init__(self, model: nn.Module, precision: Precision, *, lr: float, total_steps: int,
                 warmup_steps: int = 0, momentum: float = MOMENTUM, weight_decay: float = WEIGHT_DECAY,
                 label_smoothing: float = LABEL_SMOOTHING, mixup_alpha: float = 0.0, ema_decay: float | None = None,
                 ddp: bool = False, max_nonfinite_steps: int = 10) -> None:
        self.model = model
        self.precision = precision
        if ddp:
            device_ids = [precision.device.index] if precision.device.type == "cuda" else None
            self.net: nn.Module = DistributedDataParallel(model, device_ids=device_ids)
        else:
            self.net = model
        self.optimizer = make_optimizer(model, lr, momentum=momentum, weight_decay=weight_decay)
        self.scheduler = make_scheduler(self.optimizer, warmup_steps=warmup_steps, total_steps=total_steps)
        self.scaler = precision.make_scaler()
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.mixup_alpha = mixup_alpha
        self.ema = make_ema(model, ema_decay) if ema_decay else None
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def loss(self, images: Tensor, targets: Tensor, rng: np.random.Generator | None = None) -> Tensor:
        """Forward pass under autocast and the (MixUp-weighted, label-smoothed) loss."""
        with self.precision.autocast():
            if self.mixup_alpha > 0:
                if rng is None:
                    raise ValueError("MixUp needs a random generator")
                images, targets_a, targets_b, lam = mixup(images, targets, self.mixup_alpha, rng)
                out = self.net(images)
                return lam * self.criterion(out, targets_a) + (1 - lam) * self.criterion(out, targets_b)
            return self.criterion(self.net(images), targets)

    def step(self, micro_batches: Sequence[tuple[Tensor, Tensor]], rng: np.random.Generator | None = None
             ) -> StepResult:
        """Accumulate gradients over ``micro_batches`` (on the device), then update once.

        DDP averages gradients only on the last micro-batch (``no_sync`` before). A step whose
        loss or gradients are not finite is skipped (the GradScaler does this under fp16 and also
        lowers its scale); :class:`TrainingDivergedError` ends the run after
        ``max_nonfinite_steps`` skipped steps in a row.
        """
        self.net.train()
        # The forward pass updates BatchNorm statistics even when the step is then skipped; keep
        # a copy (a few small tensors) so that a non-finite batch cannot poison them.
        buffers = list(self.model.buffers())
        saved = [b.detach().clone() for b in buffers]
        total = torch.zeros((), device=self.precision.device)
        for i, (images, targets) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = self.net.no_sync() if isinstance(self.net, DistributedDataParallel) and not last \
                else contextlib.nullcontext()
            with sync:
                loss = self.loss(images, targets, rng)
                scaled = loss / len(micro_batches)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            total += loss.detach()
        applied = self._update()
        if not applied:
            with torch.no_grad():
                for b, copy in zip(buffers, saved):
                    b.copy_(copy)
        self.scheduler.step()  # the schedule follows steps taken, skipped or not, as upstream
        loss_value = float(total) / len(micro_batches)
        if applied:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
            # fp16 loss scaling skips a step now and then by design; anything else is worth a
            # warning, once per streak (the error below gives the count).
            first = self.nonfinite_in_a_row == 1 and self.scaler is None
            log.log(logging.WARNING if first else logging.DEBUG,
                    "skipped optimizer step %d: non-finite loss or gradients (loss %s)",
                    self.scheduler.last_epoch, loss_value)
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
                hint = ", or train in fp32 (--no-amp)" if self.precision.amp_dtype is not None else ""
                raise TrainingDivergedError(
                    f"training diverged: {self.nonfinite_in_a_row} optimizer steps in a row had a non-finite "
                    f"loss or gradients (last loss {loss_value}, step {self.scheduler.last_epoch}); lower "
                    f"--lr or check the data{hint}")
        return StepResult(loss_value, not applied)

    def _update(self) -> bool:
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            applied = self.scaler.get_scale() >= scale  # the scaler backs off when it skipped
        else:
            # After DDP's all-reduce every rank holds the same gradients, so all decide alike.
            applied = _finite_norm([p.grad for p in params])
            if applied:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if applied and self.ema is not None:
            self.ema.update_parameters(self.model)
        return applied

    def sync_buffers(self) -> None:
        """Give every rank rank 0's BatchNorm statistics (model and EMA).

        DDP broadcasts them before each training forward, but each rank's last forward leaves its
        own; without this the ranks would validate slightly different models, none of them the
        one that rank 0 saves.
        """
        if not isinstance(self.net, DistributedDataParallel):
            return
        modules = [self.model] + ([self.ema.module] if self.ema is not None else [])
        for module in modules:
            for b in module.buffers():
                torch.distributed.broadcast(b, src=0)

    def state_dict(self) -> dict[str, Any]:
        """Weights and optimizer / schedule / scaler / EMA state, ``weights_only``-loadable."""
        state: dict[str, Any] = {
            "state_dict": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "step": self.scheduler.last_epoch,
            "skipped_steps": self.skipped_steps,
        }
        if self.ema is not None:
            state["state_dict_ema"] = self.ema.module.state_dict()
            state["ema_updates"] = int(self.ema.n_averaged)
        return state

    def load_state_dict(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            CheckpointError: the state does not fit this trainer (other model, optimizer groups).
        """
        try:
            self.model.load_state_dict(state["state_dict"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"{source} does not fit this run: {str(e).splitlines()[0]}") from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        elif self.scaler is not None or state.get("scaler"):
            log.warning("%s: loss-scaler state %s; the precision changed since it was written", source,
                        "ignored" if state.get("scaler") else "missing, starting a new scaler")
        if self.ema is not None:
            if "state_dict_ema" in state:
                self.ema.module.load_state_dict(state["state_dict_ema"])
                self.ema.n_averaged.fill_(int(state.get("ema_updates", 1)))
            else:
                log.warning("%s has no EMA weights; the EMA starts from the current weights", source)


def _finite_norm(grads: list[Tensor]) -> bool:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
    return bool(torch.isfinite(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))


@torch.inference_mode()
def evaluate(model: nn.Module, batches: Iterable[Batch], precision: Precision, ctx: DistContext,
             criterion: nn.Module | None = None) -> dict[str, float]:
    """Validation loss, top-1 and top-5 accuracy (percent) over all processes' batches.

    Sums (not means) are all-reduced, so the result is that of the whole validation set.

    Returns:
        ``{"loss", "top1", "top5", "images", "unreadable"}``.

    Raises:
        DataError: no validation image could be read.
    """
    model.eval()
    criterion = criterion or nn.CrossEntropyLoss()
    device = precision.device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits
    images_seen = unreadable = 0
    for images, targets, bad in batches:
        unreadable += bad
        if len(targets) == 0:
            continue
        x = to_device(images, device, precision.memory_format)
        y = targets.to(device, non_blocking=True)
        with precision.autocast():
            out = model(x)
        hits = out.topk(min(5, out.shape[1]), dim=1).indices == y[:, None]
        sums += torch.stack([criterion(out.float(), y).double() * len(y), hits[:, 0].sum(), hits.any(1).sum()])
        images_seen += len(y)
    loss_sum, top1, top5 = sums.tolist()
    loss_sum, top1, top5, n, unreadable = dist.all_reduce_sum([loss_sum, top1, top5, images_seen, unreadable], ctx)
    if n == 0:
        raise DataError("no validation image could be read")
    return {"loss": loss_sum / n, "top1": 100 * top1 / n, "top5": 100 * top5 / n, "images": int(n),
            "unreadable": int(unreadable)}


@dataclass
class TrainSummary:
    """What :func:`fit` returns (and ``convnets train`` prints as its last line)."""

    epochs: int
    metrics: dict[str, Any]
    best_top1: float | None = None
    best_epoch: int | None = None
    checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    metrics_file: Path | None = None
    unreadable_images: int = 0
    skipped_steps: int = 0
    seconds: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)

    def line(self) -> str:
        """One human-readable line."""
        m = self.metrics
        if self.checkpoint is None:  # --evaluate
            text = (f"evaluated {m['images']} images: loss {m['val_loss']:.4f}, top-1 {m['val_top1']:.2f}%, "
                    f"top-5 {m['val_top5']:.2f}%")
            if "ema_val_top1" in m:
                text += f"; EMA top-1 {m['ema_val_top1']:.2f}%, top-5 {m['ema_val_top5']:.2f}%"
        else:
            text = (f"trained {self.epochs} epochs in {self.seconds:.0f} s: val top-1 {m.get('val_top1', 0):.2f}% "
                    f"(best {self.best_top1 or 0:.2f}% at epoch {self.best_epoch}), "
                    f"{m.get('img_per_s', 0):.0f} img/s; checkpoint {self.checkpoint}")
            if self.skipped_steps:
                text += f"; {self.skipped_steps} steps skipped (non-finite)"
        if self.unreadable_images:
            text += f"; {self.unreadable_images} unreadable images skipped"
        return text


def fit(config: TrainConfig) -> TrainSummary:
    """Train (or with ``config.evaluate`` only validate) as :class:`TrainConfig` says.

    Under ``torchrun`` every process calls this; rank 0 writes the files.

    Returns:
        The summary (on every rank; metrics are averaged over ranks).

    Raises:
        DataError, CheckpointError, UnknownModelError, TrainingDivergedError, ValueError: see their
        messages; the command line turns them into one line and exit status 1.
    """
    ctx = dist.setup(config.device)
    try:
        _configure_backends(ctx.device)
        precision = resolve_precision(ctx.device, config.amp, config.amp_dtype, config.memory_format)
        if config.evaluate:
            return _evaluate_only(config, ctx, precision)
        return _train(config, ctx, precision)
    finally:
        dist.teardown()


def _configure_backends(device: torch.device) -> None:
    if device.type == "cuda":
        # TF32 tensor cores for fp32 convolutions and matmuls (Ampere and newer), as upstream.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # fixed input sizes: pick the fastest kernels once


def _build_model(cfg: TrainConfig, num_classes: int | None, ctx: DistContext, *, init_only: bool) -> ResNet:
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
    except TypeError as e:  # an unknown --arch-kwargs key
        raise ValueError(f"--arch-kwargs: {e}") from e


def _evaluate_only(cfg: TrainConfig, ctx: DistContext, precision: Precision) -> TrainSummary:
    start = time.perf_counter()
    data = make_data(cfg.data_backend, cfg.data, batch_size=cfg.batch_size, image_size=cfg.image_size,
                     workers=cfg.workers, seed=cfg.seed, ctx=ctx, train=False)
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
        model.to(ctx.device, memory_format=precision.memory_format)
        result = evaluate(model, data.val(), precision, ctx, nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing))
        metrics.update({f"{prefix}_{k}": v for k, v in result.items() if k in ("loss", "top1", "top5")})
        metrics["images"], metrics["unreadable_images"] = result["images"], result["unreadable"]
    return TrainSummary(0, metrics, unreadable_images=metrics["unreadable_images"],
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
        raise ValueError(f"{out} already holds {CHECKPOINT} of another run; continue it with --resume "
                         f"{out / CHECKPOINT} or choose another --output")


def _write_history(path: Path, history: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from a checkpoint's history (on resume, drops later epochs)."""
    text = "".join(json.dumps(r) + "\n" for r in history)
    atomic_write(path, lambda f: f.write(text.encode()))


def _append_metrics(path: Path, record: Mapping[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _train(cfg: TrainConfig, ctx: DistContext, precision: Precision) -> TrainSummary:
    start = time.perf_counter()
    out = cfg.output
    if out is None:
        raise ValueError("--output DIR is required for training")
    ckpt = read_training_checkpoint(cfg.resume) if cfg.resume is not None else None
    if ctx.is_main:
        _prepare_output(out, resuming=ckpt is not None)
    data = make_data(cfg.data_backend, cfg.data, batch_size=cfg.batch_size, image_size=cfg.image_size,
                     workers=cfg.workers, seed=cfg.seed, ctx=ctx)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every run
    model = _build_model(cfg, len(data.classes), ctx, init_only=ckpt is not None)
    model.class_names = list(data.classes)
    if ckpt is not None:
        _check_resume(ckpt, model, data.classes, cfg)
    model.to(ctx.device, memory_format=precision.memory_format)

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
    trainer = Trainer(model, precision, lr=lr, total_steps=steps_per_epoch * cfg.epochs,
                      warmup_steps=round(warmup_epochs * steps_per_epoch), momentum=cfg.momentum,
                      weight_decay=cfg.weight_decay, label_smoothing=cfg.label_smoothing, mixup_alpha=cfg.mixup,
                      ema_decay=cfg.ema, ddp=ctx.distributed, max_nonfinite_steps=cfg.max_nonfinite_steps)
    history: list[dict[str, Any]] = []
    first_epoch, best_top1, best_epoch = 0, -math.inf, 0
    if ckpt is not None:
        trainer.load_state_dict(ckpt, str(cfg.resume))
        set_rng_state(ckpt["rng"])
        first_epoch, history = int(ckpt["epoch"]), list(ckpt.get("history", []))
        best_top1, best_epoch = float(ckpt.get("best_top1", -math.inf)), int(ckpt.get("best_epoch", 0))
        if ctx.is_main:
            _write_history(out / METRICS, history)
    elif ctx.is_main:
        _write_history(out / METRICS, [])
    if ctx.is_main:
        log.info("%s (%s parameters, %d classes), %s; %d x %d process(es) x %d accumulation = batch %d, "
                 "lr %.4g, warmup %.3g epochs; %d train / %d val images; resuming at epoch %d",
                 cfg.arch, f"{count_parameters(model):,}", len(data.classes), precision.describe(), cfg.batch_size,
                 ctx.world_size, cfg.grad_accum, global_batch, lr, warmup_epochs, data.num_train, data.num_val,
                 first_epoch)

    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    for epoch in range(first_epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        record: dict[str, Any] = {"epoch": epoch + 1}
        record.update(_train_epoch(trainer, data, epoch, steps_per_epoch, cfg, ctx))
        trainer.sync_buffers()
        val = evaluate(model, data.val(), precision, ctx, criterion)
        record.update(val_loss=val["loss"], val_top1=val["top1"], val_top5=val["top5"], val_images=val["images"])
        record["unreadable_images"] += val["unreadable"]
        if trainer.ema is not None:
            ema = evaluate(trainer.ema.module, data.val(), precision, ctx, criterion)
            record.update(ema_val_loss=ema["loss"], ema_val_top1=ema["top1"], ema_val_top5=ema["top5"])
        record["epoch_seconds"] = time.perf_counter() - epoch_start
        history.append(record)
        if record["val_top1"] > best_top1:
            best_top1, best_epoch = record["val_top1"], epoch + 1
        if ctx.is_main:
            atomic_save(trainer.state_dict() | {
                "format": FORMAT, "epoch": epoch + 1, "best_top1": best_top1, "best_epoch": best_epoch,
                "history": history, "rng": get_rng_state(), "config": cfg.to_dict(), "arch": cfg.arch,
                "arch_spec": model.spec.to_dict(), "class_names": list(data.classes),
                "world_size": ctx.world_size}, out / CHECKPOINT)
            if best_epoch == epoch + 1:
                atomic_copy(out / CHECKPOINT, out / BEST)
            # After the checkpoint: a crash in between loses this line, and --resume rewrites
            # metrics.jsonl from the checkpoint's history anyway.
            _append_metrics(out / METRICS, record)

    last = history[-1] if history else {}
    return TrainSummary(
        epochs=len(history), metrics=last, best_top1=best_top1 if history else None, best_epoch=best_epoch or None,
        checkpoint=out / CHECKPOINT, best_checkpoint=out / BEST, metrics_file=out / METRICS,
        unreadable_images=sum(r.get("unreadable_images", 0) for r in history),
        skipped_steps=sum(r.get("skipped_steps", 0) for r in history), seconds=time.perf_counter() - start,
        history=history)


def _check_resume(ckpt: Mapping[str, Any], model: ResNet, classes: list[str], cfg: TrainConfig) -> None:
    if ckpt["arch_spec"] != model.spec.to_dict():
        raise CheckpointError(
            f"{cfg.resume} was trained as {ckpt.get('arch', '?')} {ckpt['arch_spec']}, but this run builds "
            f"{cfg.arch} {model.spec.to_dict()}; pass the --arch / --arch-kwargs of that run (its config is "
            "stored in the checkpoint), or start a new run with --pretrained-from-file")
    if list(ckpt["class_names"]) != list(classes):
        raise CheckpointError(f"{cfg.resume} was trained on other classes ({len(ckpt['class_names'])}, e.g. "
                              f"{list(ckpt['class_names'])[:3]}) than {cfg.data} has ({len(classes)}, e.g. "
                              f"{classes[:3]}); fine-tune from it with --pretrained-from-file instead")


def _train_epoch(trainer: Trainer, data: DataSource, epoch: int, steps: int, cfg: TrainConfig,
                 ctx: DistContext) -> dict[str, Any]:
    """One pass over this rank's shard; returns the epoch's training metrics (averaged over ranks)."""
    precision = trainer.precision
    rng = np.random.default_rng((cfg.seed, epoch, ctx.rank))  # MixUp draws: a function of (seed, epoch, rank)
    batches = iter(data.train_epoch(epoch))
    bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step", file=sys.stderr,
               disable=not (ctx.is_main and cfg.progress), dynamic_ncols=True)
    loss_sum = finite_steps = images = unreadable = skipped = 0
    lr = trainer.lr
    start = time.perf_counter()
    with bar:
        for _ in range(steps):
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
            bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{lr:.4g}", img_s=f"{rate:.0f}", refresh=False)
            bar.update()
    seconds = time.perf_counter() - start
    loss_sum, finite_steps, images, unreadable = dist.all_reduce_sum([loss_sum, finite_steps, images, unreadable], ctx)
    return {"train_loss": loss_sum / finite_steps if finite_steps else float("nan"), "lr": lr,
            "img_per_s": images / seconds, "train_images": int(images), "skipped_steps": skipped,
            "unreadable_images": int(unreadable)}


def benchmark_training(model_name: str, *, batch_size: int, device: str | torch.device = "cpu",
                       amp_dtype: str | None = None, memory_format: str = "nchw", steps: int = 10,
                       warmup: int = 3, arch_kwargs: Mapping[str, Any] | None = None, image_size: int = 224,
                       num_classes: int = 1000) -> dict[str, Any]:
    """Time the fine-tuning loop's real optimizer step (:meth:`Trainer.step`) on synthetic data.

    Forward under autocast, label-smoothed loss, backward (scaled under fp16), SGD update with the
    recipe's weight decay, lr schedule step; the batch already sits on the device, normalised.

    Args:
        model_name: a registered model, e.g. ``"resnext101_32x4d"``.
        batch_size: images per step.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        amp_dtype: ``None`` (fp32 / TF32), ``"fp16"`` or ``"bf16"``.
        memory_format: ``"nchw"`` or ``"nhwc"``.
        steps: timed steps.
        warmup: untimed steps first (allocator, cuDNN autotuning, oneDNN primitive caches).
        arch_kwargs: architecture overrides, e.g. ``{"layers": [1, 1, 1, 1]}``.
        image_size: input height and width.
        num_classes: classifier outputs.

    Returns:
        ``{"img_per_s", "step_ms" (list), "median_ms", "mean_ms", ...the arguments}``.
    """
    dev = torch.device(device)
    _configure_backends(dev)
    precision = resolve_precision(dev, amp=amp_dtype is not None, amp_dtype=amp_dtype, memory_format=memory_format)
    torch.manual_seed(0)
    model = get_model(model_name, num_classes=num_classes, **dict(arch_kwargs or {}))
    model.to(dev, memory_format=precision.memory_format)
    trainer = Trainer(model, precision, lr=scaled_lr(batch_size), total_steps=warmup + steps,
                      max_nonfinite_steps=warmup + steps + 1)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    batch = [(to_device(images, dev, precision.memory_format),
              torch.randint(0, num_classes, (batch_size,), generator=g).to(dev))]
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        trainer.step(batch)  # returns a Python float: the step has finished on the device
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"model": model_name, "device": str(dev), "amp_dtype": amp_dtype, "memory_format": memory_format,
            "batch_size": batch_size, "image_size": image_size, "steps": steps,
            "img_per_s": batch_size * len(times) / sum(times), "step_ms": [1000 * t for t in times],
            "median_ms": 1000 * statistics.median(times), "mean_ms": 1000 * statistics.fmean(times)}
