"""Data backends: ``pytorch`` (ImageFolder + DataLoader), ``dali-cpu`` / ``dali-gpu`` and ``synthetic``.

Every backend yields batches ``(images, targets, unreadable)``: images either uint8 (normalised
later on the device, which moves 4x fewer bytes) or already-normalised float, class indices (or,
with a multi-label CSV, float multi-hot rows: :mod:`convnets.data.multilabel`), and the number of
image files that could not be read for this batch.

Exact resume: the training order is a permutation seeded by ``(seed, epoch)`` and each sample's
augmentation is seeded by ``(seed, epoch, index)``, so what an epoch sees does not depend on what
ran before it in the same process, on the number of loader workers, or on a restart.

Unreadable images (truncated files, non-images) are skipped with a warning and counted: in
training a sample is replaced by the next readable file of the data set, which keeps every
batch full (DDP ranks must run the same number of equally sized steps); in validation it is
dropped, so that accuracy is measured on real images only.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchvision.transforms import v2

from convnets.dist import DistContext
from convnets.errors import DataError, ImageLoadError, InvalidArgumentError
from convnets.preprocessing.decode import fast_decode_draft, load_image
from convnets.preprocessing.presets import DEFAULT_PRESET, IMAGENET_MEAN, IMAGENET_STD, EvalPreset
from convnets.preprocessing.transforms import normalize_uint8, resize_and_crop
from convnets.data.batches import Batch, DataSource, Target, sample_seed
from convnets.data.scan import scan_split
from convnets.constants import BACKENDS
from convnets.runtime import init_worker

__all__ = ["BACKENDS", "Batch", "DataSource", "IMAGENET_MEAN", "IMAGENET_STD", "decode_on_device", "eval_loader",
           "make_data", "sample_seed", "train_transform", "val_transform"]

log = logging.getLogger(__name__)

MAX_SUBSTITUTES = 10  # readable neighbours tried for an unreadable training image
SYNTHETIC_CLASSES = 1000
SYNTHETIC_TRAIN_BATCHES = 64
SYNTHETIC_VAL_BATCHES = 8


def train_transform(size: int) -> v2.Compose:
    """RandomResizedCrop(scale 0.08-1, ratio 3/4-4/3) and a horizontal flip, as uint8 CHW."""
    return v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(size, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                                                              antialias=True),
                       v2.RandomHorizontalFlip()])


def val_transform(size: int | EvalPreset) -> v2.Compose:
    """The evaluation resize and center crop of a preset, as uint8 CHW.

    The resize and crop run on the PIL image with the function ``prepare_batch`` uses
    (:func:`~convnets.preprocessing.transforms.resize_and_crop`), and :func:`to_device` normalises
    with its arithmetic, so a validation image is bit for bit what ``predict`` feeds the model.

    Args:
        size: a crop size (the preset :meth:`EvalPreset.for_image_size`) or a preset.
    """
    preset = size if isinstance(size, EvalPreset) else EvalPreset.for_image_size(size)
    return v2.Compose([_ResizeAndCrop(preset), v2.PILToTensor()])


class _ResizeAndCrop:
    """:func:`resize_and_crop` as a picklable transform (DataLoader workers may be spawned)."""

    def __init__(self, preset: EvalPreset) -> None:
        self.preset = preset

    def __call__(self, image: Image.Image) -> Image.Image:
        return resize_and_crop(image, self.preset)

    def __repr__(self) -> str:
        return f"ResizeAndCrop({self.preset})"


_warned: set[str] = set()


def _warn_unreadable(path: str, error: Exception) -> None:
    if path not in _warned:  # once per file and process, not once per epoch
        _warned.add(path)
        log.warning("skipping unreadable image %s: %s", path, error)


class ImageFolderDataset(Dataset[tuple[Tensor | None, Target, int]]):
    """ImageFolder samples that survive unreadable files; training items are ``(index, seed)``.

    Args:
        samples: ``(path, class index)`` pairs from :func:`~convnets.data.scan.scan_split` (or ``(path, multi-hot target)``).
        transform: PIL image -> uint8 tensor.
        substitute: replace an unreadable image with the next readable one (training) instead of
            returning ``None`` (validation).
        draft: decode large JPEGs at a reduced DCT scale keeping both sides at least ``draft``
            (``fast_decode``; see :func:`~convnets.preprocessing.decode.load_image`); ``None``: exact.
        resize: the shorter side ``transform`` resizes to: an image too thin to resize within the
            pixel limit is unreadable (see :func:`~convnets.preprocessing.decode.load_image`).
    """

    def __init__(self, samples: Sequence[tuple[str, Target]], transform: Callable[[Image.Image], Tensor],
                 substitute: bool, draft: int | None = None, resize: int | None = None) -> None:
        self.samples = list(samples)
        self.transform = transform
        self.substitute = substitute
        self.draft = draft
        self.resize = resize

    def __len__(self) -> int:
        return len(self.samples)

    def _load(self, index: int) -> Image.Image | None:
        path = self.samples[index][0]
        try:
            # The decoding that prediction uses (EXIF orientation, every mode to RGB, 16-bit scaled
            # rather than clipped), so a model is trained on the pixels it is later shown.
            return load_image(path, draft=self.draft, resize=self.resize)
        except ImageLoadError as e:
            _warn_unreadable(path, e)
            return None

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor | None, Target, int]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        unreadable = 0
        for attempt in range(MAX_SUBSTITUTES if self.substitute else 1):
            i = (index + attempt) % len(self.samples)
            image = self._load(i)
            if image is not None:
                break
            unreadable += 1
        else:
            return None, self.samples[index][1], unreadable
        if seed is None:
            return self.transform(image), self.samples[i][1], unreadable
        # The transforms draw from torch's global CPU generator: seed it for this sample only.
        # (Not torch.manual_seed: it also queues a seeding of every CUDA device, recording the call
        # stack each time, which cost 1 ms per sample, a quarter of a small training run.)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self.transform(image), self.samples[i][1], unreadable


def collate(batch: Sequence[tuple[Tensor | None, Target, int]]) -> Batch:
    """Stack the readable samples (class indices: int64 ``[N]``; multi-hot targets: float32 ``[N, C]``); the
    third element counts unreadable files."""
    kept = [(x, y) for x, y, _ in batch if x is not None]
    unreadable = sum(u for _, _, u in batch)
    if not kept:
        return torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.long), unreadable
    return torch.stack([x for x, _ in kept]), torch.tensor([y for _, y in kept]), unreadable


class SeededSampler(Sampler[tuple[int, int]]):
    """``DistributedSampler`` order (permutation seeded by seed + epoch, one shard per rank) that
    also hands each index its augmentation seed."""

    def __init__(self, dataset: Dataset[Any], ctx: DistContext, seed: int) -> None:
        self.inner: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation and the augmentation seeds of ``epoch``."""
        self.epoch = epoch
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in self.inner:
            yield index, sample_seed(self.seed, self.epoch, index)


def _check_classes(root: Path, train_classes: list[str], val_classes: list[str]) -> None:
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))
        only_val = sorted(set(val_classes) - set(train_classes))
        raise DataError(f"the classes of {root}/train and {root}/val differ: only in train: "
                        f"{only_train[:5] or 'none'}, only in val: {only_val[:5] or 'none'}; both "
                        "need the same class folders (an empty one counts as missing)")


def _check_batches(num: int, batch_size: int, ctx: DistContext, what: str) -> int:
    # DistributedSampler gives each rank ceil(num / world) images (padding by repetition).
    steps = math.ceil(num / ctx.world_size) // batch_size
    if steps == 0:
        raise DataError(f"{what} has {num} images, fewer than one batch of {batch_size} per process "
                        f"for {ctx.world_size} process(es); lower --batch-size")
    return steps


def make_data(backend: str, root: Path | None, *, batch_size: int, image_size: int, workers: int,
              seed: int, ctx: DistContext, train: bool = True, labels: Path | None = None) -> DataSource:
    """Build the data source of ``backend`` for this process.

    Args:
        backend: one of :data:`BACKENDS`.
        root: directory with ``train/`` and ``val/`` (unused by ``synthetic``).
        batch_size: images per process and step.
        image_size: training crop and validation crop size.
        workers: loader processes (pytorch) or decoding threads (DALI).
        seed: base seed of order and augmentation.
        ctx: this process's place in the job.
        train: also set up the training split (``False`` for ``--evaluate``).
        labels: a multi-label CSV (:mod:`convnets.data.multilabel`): its images, splits and classes
            instead of class folders; targets are multi-hot (``pytorch`` backend only).

    Raises:
        DataError: missing or empty directories, differing classes.
        MissingDependencyError: a DALI backend without DALI installed.
    """
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"unknown data backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "synthetic":
        return _synthetic(batch_size, image_size, seed, ctx)
    if root is None:
        raise DataError(f"--data DIR is required with --data-backend {backend}")
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist")
    if labels is not None:
        return _multilabel(backend, root, labels, batch_size=batch_size, image_size=image_size, workers=workers,
                           seed=seed, ctx=ctx, train=train)
    train_classes, train_samples = scan_split(root, "train") if train else ([], [])
    val_classes, val_samples = scan_split(root, "val")
    if train:
        _check_classes(root, train_classes, val_classes)
    steps = _check_batches(len(train_samples), batch_size, ctx, f"{root}/train") if train else 0
    if backend == "pytorch":
        return _pytorch(val_classes, train_samples, val_samples, steps, batch_size=batch_size,
                        image_size=image_size, workers=workers, seed=seed, ctx=ctx)
    from convnets.data.dali import make_dali_data  # optional dependency, imported only when asked for

    return make_dali_data(val_classes, train_samples, val_samples, steps, batch_size=batch_size,
                          image_size=image_size, threads=max(1, workers), seed=seed, ctx=ctx,
                          on_gpu=backend == "dali-gpu")


def _multilabel(backend: str, root: Path, labels: Path, *, batch_size: int, image_size: int, workers: int, seed: int,
                ctx: DistContext, train: bool) -> DataSource:
    from convnets.data.multilabel import multilabel_set

    if backend != "pytorch":
        raise DataError(f"--labels (multi-label training) reads its images with --data-backend pytorch, not {backend}")
    found = multilabel_set(root, labels)
    train_samples = found.train if train else []
    steps = _check_batches(len(train_samples), batch_size, ctx, f"the train split of {labels}") if train else 0
    source = _pytorch(found.classes, train_samples, found.val, steps, batch_size=batch_size, image_size=image_size,
                      workers=workers, seed=seed, ctx=ctx)
    return dataclasses.replace(source, multilabel=True)


def _pytorch(classes: list[str], train_samples: Sequence[tuple[str, Target]], val_samples: Sequence[tuple[str, Target]],
             steps: int, *, batch_size: int, image_size: int, workers: int, seed: int,
             ctx: DistContext) -> DataSource:
    loader_kwargs: dict[str, Any] = dict(batch_size=batch_size, num_workers=workers, collate_fn=collate,
                                         pin_memory=ctx.device.type == "cuda", persistent_workers=workers > 0,
                                         worker_init_fn=init_worker)
    train_set = ImageFolderDataset(train_samples, train_transform(image_size), substitute=True)
    sampler = SeededSampler(train_set, ctx, seed)
    train_loader = DataLoader(train_set, sampler=sampler, drop_last=True, **loader_kwargs)
    val_loader = eval_loader(val_samples, EvalPreset.for_image_size(image_size), batch_size=batch_size,
                             workers=workers, ctx=ctx)

    def train_epoch(epoch: int) -> Iterable[Batch]:
        sampler.set_epoch(epoch)
        return train_loader

    return DataSource(classes, steps, train_epoch, lambda: val_loader, len(train_samples), len(val_samples))


class _EncodedFolderDataset(ImageFolderDataset):
    """Evaluation samples for the device path: ``((tensor, path), class, unreadable)``, the tensor an encoded JPEG
    or the CPU path's uint8 crop (:func:`~convnets.preprocessing.device.load_for_device`)."""

    def __init__(self, samples: Sequence[tuple[str, Target]], preset: EvalPreset, draft: int | None) -> None:
        super().__init__(samples, val_transform(preset), substitute=False, draft=draft, resize=preset.resize_size)
        self.preset = preset

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        from convnets.preprocessing.device import load_for_device

        index = key[0] if isinstance(key, tuple) else key
        path, target = self.samples[index]
        try:
            return (load_for_device(path, self.preset, draft=self.draft), path), target, 0
        except ImageLoadError as e:
            _warn_unreadable(path, e)
            return None, target, 1


def _collate_loaded(batch: Sequence[tuple[tuple[Tensor, str] | None, Target, int]]) -> Any:
    """The device path's batch: ``([(tensor, path), ...], targets, unreadable)``, decoded by :func:`decode_on_device`
    (targets as :func:`collate` stacks them)."""
    kept = [(x, y) for x, y, _ in batch if x is not None]
    targets = torch.tensor([y for _, y in kept]) if kept else torch.empty(0, dtype=torch.long)
    return [x for x, _ in kept], targets, sum(u for _, _, u in batch)


def decode_on_device(batches: Iterable[Any], preset: EvalPreset, device: torch.device,
                     fast_decode: bool = False) -> Iterator[Batch]:
    """The device path's evaluation batches (``eval_loader(..., decode="device")``) as uint8 batches on ``device``:
    JPEGs decoded, resized and cropped there (:func:`~convnets.preprocessing.device.crops_on_device`); a JPEG that
    neither path decodes is dropped and counted as unreadable, as on the CPU path."""
    from convnets.preprocessing.device import crops_on_device

    for loaded, targets, unreadable in batches:
        paths = [path for _, path in loaded]
        crops = crops_on_device([tensor for tensor, _ in loaded], paths, preset, device,
                                draft=fast_decode_draft(preset) if fast_decode else None)
        kept = [i for i, crop in enumerate(crops) if isinstance(crop, Tensor)]
        for path, crop in zip(paths, crops):
            if isinstance(crop, ImageLoadError):
                _warn_unreadable(path, crop)
        images = (torch.stack([crops[i] for i in kept]) if kept  # type: ignore[misc]
                  else torch.empty(0, dtype=torch.uint8, device=device))
        yield images, targets[kept], unreadable + len(crops) - len(kept)


def eval_loader(samples: Sequence[tuple[str, Target]], preset: EvalPreset, *, batch_size: int, workers: int,
                ctx: DistContext, fast_decode: bool = False, decode: str = "cpu") -> DataLoader[Any]:
    """Evaluation batches of ``samples`` for this process: uint8, resized and cropped as ``preset`` says.

    Every rank takes every ``world_size``-th image, without ``DistributedSampler``'s padding, so
    that metrics summed over ranks cover each image exactly once. Unreadable images are dropped
    and counted (see :func:`collate`).

    Args:
        samples: ``(path, class index)`` pairs (or ``(path, multi-hot target)``).
        preset: the evaluation resize and crop (normalise later with :func:`to_device`).
        batch_size: images per batch.
        workers: loader processes.
        ctx: this process's place in the job.
        fast_decode: decode large JPEGs at a reduced DCT scale first, as ``prepare_batch(fast_decode=True)``
            does (same pixels); default: exact.
        decode: ``"cpu"`` (Pillow); ``"device"``: the workers only read the files (and decode what goes the CPU
            path), the batches are for :func:`decode_on_device` (:mod:`convnets.preprocessing.device`).
    """
    draft = fast_decode_draft(preset) if fast_decode else None
    device_path = decode == "device"
    dataset = (_EncodedFolderDataset(samples, preset, draft) if device_path else
               ImageFolderDataset(samples, val_transform(preset), substitute=False, draft=draft,
                                  resize=preset.resize_size))
    return DataLoader(dataset, sampler=list(range(ctx.rank, len(dataset), ctx.world_size)), batch_size=batch_size,
                      num_workers=workers, collate_fn=_collate_loaded if device_path else collate,
                      pin_memory=ctx.device.type == "cuda" and not device_path,
                      persistent_workers=workers > 0, worker_init_fn=init_worker)


def _synthetic(batch_size: int, image_size: int, seed: int, ctx: DistContext) -> DataSource:
    """One fixed random batch on the device, repeated: measures the step alone, not the input."""
    g = torch.Generator().manual_seed(seed + ctx.rank)
    images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    targets = torch.randint(0, SYNTHETIC_CLASSES, (batch_size,), generator=g)
    batch = (images.to(ctx.device), targets.to(ctx.device), 0)

    def repeat(n: int) -> list[Batch]:
        return [batch] * n

    classes = [f"class_{i:04d}" for i in range(SYNTHETIC_CLASSES)]
    return DataSource(classes, SYNTHETIC_TRAIN_BATCHES, lambda epoch: repeat(SYNTHETIC_TRAIN_BATCHES),
                      lambda: repeat(SYNTHETIC_VAL_BATCHES), SYNTHETIC_TRAIN_BATCHES * batch_size * ctx.world_size,
                      SYNTHETIC_VAL_BATCHES * batch_size * ctx.world_size)


def to_device(images: Tensor, device: torch.device, memory_format: torch.memory_format,
              preset: EvalPreset = DEFAULT_PRESET) -> Tensor:
    """Move a batch to ``device`` and normalise it there if it is still uint8.

    Args:
        images: a batch from a backend, uint8 or already-normalised float.
        device: where the step runs.
        memory_format: layout of the result.
        preset: the mean and std (those of ``prepare_batch``, with the same float32 arithmetic).
    """
    images = images.to(device, non_blocking=True)
    if images.dtype == torch.uint8:
        images = normalize_uint8(images, preset)
    return images.contiguous(memory_format=memory_format)
