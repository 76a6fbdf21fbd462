"""The training step: :class:`Trainer` holds model, optimizer, schedule, loss scaler and EMA, and
updates them once per :meth:`Trainer.step`.

Recipe: https://github.com/NVIDIA/DeepLearningExamples/tree/master/PyTorch/Classification/ConvNets
(see :mod:`convnets.train.recipe`). The loop around it is :mod:`convnets.train.loop`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from convnets.errors import CheckpointError, InvalidArgumentError, TrainingDivergedError, short_repr
from convnets.runtime import Precision
from convnets.train.config import TrainConfig
from convnets.train.recipe import (LABEL_SMOOTHING, MOMENTUM, WEIGHT_DECAY, MultiLabelLoss, make_ema,
                                   make_optimizer, make_scheduler, mixup)
from convnets.train.checkpoint import TrainingCheckpoint, unlike

__all__ = ["StepResult", "Trainer", "configure_backends"]

log = logging.getLogger(__name__)


def configure_backends(device: torch.device) -> None:
    """Kernel choices for fast steps on ``device`` (called once per process before training)."""
    if device.type == "cuda":
        # TF32 tensor cores for fp32 convolutions and matmuls (Ampere and newer), as upstream.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True  # fixed input sizes: pick the fastest kernels once


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: mean loss over its micro-batches, and whether the update was skipped."""

    loss: float
    skipped: bool


class Trainer:
    """Model, optimizer, lr schedule, loss scaler and EMA, and the step that updates them.

    Args:
        model: the network (unwrapped), already on its device and memory format.
        precision: autocast dtype and loss scaling (:func:`~convnets.runtime.resolve_precision`).
        lr: peak learning rate.
        total_steps: optimizer steps of the whole run (length of the cosine schedule).
        warmup_steps: linear-warmup steps at its start.
        momentum, weight_decay, label_smoothing, mixup_alpha, ema_decay: the recipe's knobs.
        ddp: wrap the model in DistributedDataParallel (a process group must exist).
        max_nonfinite_steps: raise after this many skipped steps in a row.
        multilabel: multi-hot targets and :class:`~convnets.train.recipe.MultiLabelLoss` instead of
            cross-entropy on class indices.
    """

    def __init__(self, model: nn.Module, precision: Precision, *, lr: float, total_steps: int,
                 warmup_steps: int = 0, momentum: float = MOMENTUM, weight_decay: float = WEIGHT_DECAY,
                 label_smoothing: float = LABEL_SMOOTHING, mixup_alpha: float = 0.0, ema_decay: float | None = None,
                 ddp: bool = False, max_nonfinite_steps: int = 10, multilabel: bool = False) -> None:
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
        self.criterion: nn.Module = (MultiLabelLoss(label_smoothing) if multilabel
                                     else nn.CrossEntropyLoss(label_smoothing=label_smoothing))
        self.mixup_alpha = mixup_alpha
        self.ema = make_ema(model, ema_decay) if ema_decay else None
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, model: nn.Module, precision: Precision, *, lr: float, total_steps: int,
                    warmup_steps: int, ddp: bool) -> Trainer:
        """The trainer of a run: the recipe's knobs from ``cfg``, the schedule from the loop.

        A new knob of the step is a :class:`TrainConfig` field read here (and used in this module).
        """
        return cls(model, precision, lr=lr, total_steps=total_steps, warmup_steps=warmup_steps,
                   momentum=cfg.momentum, weight_decay=cfg.weight_decay, label_smoothing=cfg.label_smoothing,
                   mixup_alpha=cfg.mixup, ema_decay=cfg.ema, ddp=ddp, max_nonfinite_steps=cfg.max_nonfinite_steps,
                   multilabel=cfg.multilabel)

    @property
    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def loss(self, images: Tensor, targets: Tensor, rng: np.random.Generator | None = None) -> Tensor:
        """Forward pass under autocast and the (MixUp-weighted, label-smoothed) loss."""
        with self.precision.autocast():
            if self.mixup_alpha > 0:
                if rng is None:
                    raise InvalidArgumentError("MixUp needs a random generator")
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

    def to_checkpoint(self, **run: Any) -> TrainingCheckpoint:
        """This trainer's state (weights, optimizer, schedule, scaler, EMA) as a checkpoint.

        Args:
            **run: the loop's fields of :class:`TrainingCheckpoint` (``epoch``, ``history``, ...).
        """
        ema = self.ema.module.state_dict() if self.ema is not None else None
        return TrainingCheckpoint(
            state_dict=self.model.state_dict(), optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(), scaler=self.scaler.state_dict() if self.scaler else None,
            step=self.scheduler.last_epoch, skipped_steps=self.skipped_steps, state_dict_ema=ema,
            ema_updates=int(self.ema.n_averaged) if self.ema is not None else None, **run)

    def load_checkpoint(self, ckpt: TrainingCheckpoint, source: str = "checkpoint") -> None:
        """Restore what :meth:`to_checkpoint` saved, each entry checked against this trainer's own
        state first (an entry of the wrong shape would otherwise fail steps later, or never).

        Raises:
            CheckpointError: the state does not fit this trainer (other model, optimizer groups), or an
                entry is not of the shape this trainer writes.
        """
        fresh_scheduler = self.scheduler.state_dict()
        problem = (self._unlike_optimizer(ckpt.optimizer) or unlike(ckpt.scheduler, fresh_scheduler, "scheduler")
                   or (unlike(ckpt.scaler, self.scaler.state_dict(), "scaler")
                       if self.scaler is not None and ckpt.scaler else None))
        if problem is not None:
            raise CheckpointError(f"{source} is a damaged convnets training checkpoint: {problem}")
        try:
            self.model.load_state_dict(ckpt.state_dict)
            self.optimizer.load_state_dict(ckpt.optimizer)
            # Only the keys this version writes: LambdaLR copies every key into its attributes.
            self.scheduler.load_state_dict({k: v for k, v in ckpt.scheduler.items() if k in fresh_scheduler})
            if self.scaler is not None and ckpt.scaler:
                self.scaler.load_state_dict(ckpt.scaler)
            if self.ema is not None and ckpt.state_dict_ema is not None:
                self.ema.module.load_state_dict(ckpt.state_dict_ema)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{source} does not fit this run: {str(e).splitlines()[0]}") from e
        self.skipped_steps = ckpt.skipped_steps
        if (self.scaler is not None) != bool(ckpt.scaler):
            log.warning("%s: loss-scaler state %s; the precision changed since it was written", source,
                        "ignored" if ckpt.scaler else "missing, starting a new scaler")
        if self.ema is not None:
            if ckpt.state_dict_ema is not None:
                self.ema.n_averaged.fill_(ckpt.ema_updates if ckpt.ema_updates is not None else 1)
            else:
                log.warning("%s has no EMA weights; the EMA starts from the current weights", source)

    def _unlike_optimizer(self, state: dict[str, Any]) -> str | None:
        """Where the optimizer state ``state`` differs from what this optimizer writes (see
        :func:`~convnets.train.checkpoint.unlike`), its per-parameter buffers compared with the
        parameters they belong to (``load_state_dict`` checks neither)."""
        problem = unlike(state, self.optimizer.state_dict(), "optimizer")
        if problem is not None:
            return problem
        saved = [pid for group in state["param_groups"] for pid in group["params"]]
        params = {pid: p for pid, p in zip(saved, (p for g in self.optimizer.param_groups for p in g["params"]))}
        for pid, entry in state["state"].items():
            where = f"optimizer['state'][{short_repr(pid)}]"
            if pid not in params or not isinstance(entry, dict):
                return f"{where} (no parameter has this id)" if pid not in params else f"{where} (not a dict)"
            for name, value in entry.items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                    return (f"{where}[{name!r}] (a tensor of shape {list(value.shape)}, expected "
                            f"{list(params[pid].shape)}, its parameter's)")
        return None


def _finite_norm(grads: list[Tensor]) -> bool:
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
    return bool(torch.isfinite(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
