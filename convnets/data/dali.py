"""NVIDIA DALI input pipelines (``--data-backend dali-cpu`` / ``dali-gpu``), an optional dependency.

Same augmentation as the ``pytorch`` backend (random-resized crop 0.08-1, ratio 3/4-4/3, flip;
validation resize and center crop of the :class:`~convnets.preprocessing.presets.EvalPreset` for
the image size, normalised with its mean and std), decoded on the CPU (``dali-cpu``) or
with nvJPEG on the GPU (``dali-gpu``). Each epoch gets its own pipeline reading this rank's share
of the ``(seed, epoch)`` permutation that the ``pytorch`` backend uses, with a pipeline seed
derived from ``(seed, epoch, rank)``, so that a resumed run sees the same data.

DALI stops on a file it cannot decode (the ``pytorch`` backend skips those); the error says so.
DALI's decoder and resampling are its own, so its validation pixels are close to, not bit-identical
with, those of the ``pytorch`` backend and ``predict`` (which share PIL's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

from convnets.dist import DistContext
from convnets.errors import DataError, MissingDependencyError
from convnets.extras import install_hint
from convnets.preprocessing.presets import EvalPreset
from convnets.data.batches import Batch, DataSource, sample_seed

__all__ = ["DALI_PACKAGE", "make_dali_data"]

DALI_PACKAGE = "nvidia-dali-cuda130"


def _import_dali() -> Any:
    try:
        import nvidia.dali as dali
        import nvidia.dali.plugin.pytorch  # noqa: F401  (the iterator lives there)
    except ImportError as e:
        raise MissingDependencyError(f"the DALI data backends need NVIDIA DALI, which is not installed: "
                                     f"{install_hint('dali')} ({DALI_PACKAGE}; or use the pytorch data "
                                     "backend)") from e
    return dali


def _epoch_order(n: int, seed: int, epoch: int, ctx: DistContext) -> list[int]:
    # DistributedSampler's order (torch.randperm seeded with seed + epoch, padded, strided), so
    # the DALI and pytorch backends train on the same sequence of images.
    g = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=g).tolist()
    total = math.ceil(n / ctx.world_size) * ctx.world_size
    order += order[: total - n]
    return order[ctx.rank:total:ctx.world_size]


def make_dali_data(classes: list[str], train_samples: list[tuple[str, int]], val_samples: list[tuple[str, int]],
                   steps: int, *, batch_size: int, image_size: int, threads: int, seed: int, ctx: DistContext,
                   on_gpu: bool, preset: EvalPreset | None = None) -> DataSource:
    """The DALI :class:`~convnets.data.batches.DataSource`; see the module docstring.

    Args:
        preset: the validation resize, crop, interpolation, mean and std; default
            :meth:`EvalPreset.for_image_size` of ``image_size``.

    Raises:
        MissingDependencyError: DALI is not installed (an ``ImportError``).
        DataError: ``dali-gpu`` was asked for without a GPU.
    """
    dali = _import_dali()
    from nvidia.dali import fn, types
    from nvidia.dali.data_node import DataNode
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    if on_gpu and ctx.device.type != "cuda":
        raise DataError("--data-backend dali-gpu needs a CUDA GPU; use dali-cpu or pytorch on this machine")
    device_id = ctx.device.index if ctx.device.type == "cuda" else None
    decoder = "mixed" if on_gpu else "cpu"
    preset = preset if preset is not None else EvalPreset.for_image_size(image_size)
    # Training crops are normalised like validation images (one mean/std per model).
    mean = [m * 255 for m in preset.mean]
    std = [s * 255 for s in preset.std]
    interpolation = {"nearest": types.DALIInterpType.INTERP_NN, "bilinear": types.DALIInterpType.INTERP_LINEAR,
                     "bicubic": types.DALIInterpType.INTERP_CUBIC}[preset.interpolation]

    @dali.pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id)
    def train_pipe(files: list[str], labels: list[int]) -> Any:
        jpegs, label = fn.readers.file(files=files, labels=labels, name="Reader")
        images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.DALIImageType.RGB,
                                               random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                               num_attempts=100)
        # One output (fn.resize returns two only with save_attrs=True).
        images = cast(DataNode, fn.resize(images, resize_x=image_size, resize_y=image_size))
        images = fn.crop_mirror_normalize(images, dtype=types.DALIDataType.FLOAT, output_layout="CHW", mean=mean, std=std,
                                          mirror=fn.random.coin_flip(probability=0.5))
        return images, label

    @dali.pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed)
    def val_pipe() -> Any:
        jpegs, label = fn.readers.file(files=[p for p, _ in val_samples], labels=[c for _, c in val_samples],
                                       shard_id=ctx.rank, num_shards=ctx.world_size, pad_last_batch=True,
                                       name="Reader")
        images = fn.decoders.image(jpegs, device=decoder, output_type=types.DALIImageType.RGB)
        images = cast(DataNode, fn.resize(images, resize_shorter=preset.resize_size, interp_type=interpolation))
        images = fn.crop_mirror_normalize(images, dtype=types.DALIDataType.FLOAT, output_layout="CHW", mean=mean, std=std,
                                          crop=(preset.crop_size, preset.crop_size))
        return images, label

    def batches(pipe: Any, policy: Any) -> Iterator[Batch]:
        pipe.build()
        iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name="Reader", last_batch_policy=policy)
        try:
            for out in iterator:
                yield out[0]["images"], out[0]["labels"].view(-1).long(), 0
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"DALI failed to read the data ({first}); it cannot skip unreadable images, "
                            "--data-backend pytorch does") from e

    def train_epoch(epoch: int) -> Iterable[Batch]:
        order = _epoch_order(len(train_samples), seed, epoch, ctx)
        pipe = train_pipe([train_samples[i][0] for i in order], [train_samples[i][1] for i in order],
                          seed=sample_seed(seed, epoch, ctx.rank) % (2**31))
        return batches(pipe, LastBatchPolicy.DROP)

    return DataSource(classes, steps, train_epoch, lambda: batches(val_pipe(), LastBatchPolicy.PARTIAL),
                      len(train_samples), len(val_samples))
