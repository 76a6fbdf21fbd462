"""Backbones: features_only in timm's spelling, output_stride, freezing as mmdetection does, fpn_backbone.

References are independent of the code under test: the classifier's own stage outputs (forward
hooks), timm's ``features_only`` models (same weights loaded), torchvision's ``resnet_fpn_backbone``
for which parameters ``trainable_layers`` leaves trainable, and torchvision's detectors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, randomize_bn
from strict_skips import require_module
from torch import nn

import convnets
from convnets.models.features import FeatureInfo, ResNetFeatures

SIZE = 64


def _checkpoint(name: str, tmp_path: Path, **arch: object) -> tuple[convnets.ResNet, Path]:
    """A tiny classifier with non-trivial BatchNorm, and its state dict saved to a file."""
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model(name, **(arch or TINY[name]))).eval()
    path = tmp_path / f"{name}.pth"
    torch.save(model.state_dict(), path)
    return model, path


def _stage_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The stem's activation and each stage's output of a classifier's forward pass, by hooks."""
    seen: list[torch.Tensor] = []
    hooks = [getattr(model, name).register_forward_hook(lambda m, i, o: seen.append(o.clone()))
             for name in ("relu", "layer1", "layer2", "layer3", "layer4")]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return seen


# --- features_only ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", convnets.list_models())
def test_features_are_the_classifier_stage_outputs_with_its_weights(name: str, tmp_path: Path) -> None:
    classifier, path = _checkpoint(name, tmp_path)
    features = convnets.get_model(name, pretrained_from_file=path, features_only=True, out_indices=(0, 1, 2, 3, 4),
                                  **TINY[name])
    assert isinstance(features, ResNetFeatures) and not features.training  # loaded weights: eval mode
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        got = features(x)
    expected = _stage_outputs(classifier, x)
    assert len(got) == 5
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    # The head is dropped; every other tensor is the classifier's, under the same name.
    state = features.state_dict()
    assert not any(k.startswith("fc.") for k in state)
    assert set(state) == {k for k in classifier.state_dict() if not k.startswith("fc.")}
    # Default: the stages C2..C5, from the builder and the hub entry point alike.
    import hubconf

    hub_name = convnets.models.MODELS[name].hub_names[0]
    default = getattr(hubconf, hub_name)(pretrained=False, pretrained_from_file=path, features_only=True, **TINY[name])
    assert default.out_indices == (1, 2, 3, 4) and default.feature_info.reduction() == [4, 8, 16, 32]
    with torch.no_grad():
        for g, e in zip(default(x), expected[1:]):
            torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_only_the_stages_needed_are_kept() -> None:
    model = convnets.resnet50(features_only=True, out_indices=(1, 2), **TINY["resnet50"])
    assert model.stage_names == ("layer1", "layer2") and not hasattr(model, "layer3")
    assert [o.shape[1] for o in model(torch.randn(1, 3, SIZE, SIZE))] == model.feature_info.channels() == [32, 64]
    # An int N is timm's "the last N"; negative indices count from the end.
    assert convnets.resnet50(features_only=True, out_indices=2, **TINY["resnet50"]).out_indices == (3, 4)
    assert convnets.resnet50(features_only=True, out_indices=(-1, 0), **TINY["resnet50"]).out_indices == (0, 4)


@pytest.mark.parametrize("output_stride, reductions", [(32, [2, 4, 8, 16, 32]), (16, [2, 4, 8, 16, 16]),
                                                       (8, [2, 4, 8, 8, 8])])
def test_output_stride_gives_the_right_shapes(output_stride: int, reductions: list[int]) -> None:
    for name in convnets.list_models():
        model = convnets.get_model(name, features_only=True, out_indices=(0, 1, 2, 3, 4), output_stride=output_stride,
                                   **TINY[name]).eval()
        with torch.no_grad():
            shapes = [tuple(o.shape) for o in model(torch.randn(1, 3, SIZE, SIZE))]
        channels = model.feature_info.channels()
        assert shapes == [(1, c, SIZE // r, SIZE // r) for c, r in zip(channels, reductions)], name
        assert model.feature_info.reduction() == reductions
    # The classifier takes it too (timm's create_model does): same weights, a finer last map.
    classifier = convnets.resnet50(output_stride=output_stride, **TINY["resnet50"]).eval()
    assert classifier.forward_features(torch.randn(1, 3, SIZE, SIZE)).shape[-1] == SIZE // reductions[-1]


@pytest.mark.slow
@pytest.mark.parametrize("output_stride", [8, 16, 32])
def test_dilated_features_equal_timms_with_the_same_weights(output_stride: int) -> None:
    """Full-size ResNet-50: timm's features_only model at the same output_stride, our weights loaded."""
    require_module("timm")
    import timm

    torch.manual_seed(1)
    ours = randomize_bn(convnets.resnet50(features_only=True, out_indices=(0, 1, 2, 3, 4),
                                          output_stride=output_stride)).eval()
    theirs = timm.create_model("resnet50", features_only=True, pretrained=False, output_stride=output_stride).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 3, SIZE, SIZE)
    with torch.no_grad():
        for a, b in zip(ours(x), theirs(x), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ours.feature_info.reduction() == theirs.feature_info.reduction()


@pytest.mark.parametrize("name", ["resnet50", "resnext101_32x4d"])
def test_feature_info_matches_timms(name: str) -> None:
    require_module("timm")
    import timm

    theirs = timm.create_model(name, features_only=True, pretrained=False).feature_info  # timm's default: 0..4
    with torch.device("meta"):
        ours = convnets.get_model(name, features_only=True, out_indices=(0, 1, 2, 3, 4), device="meta").feature_info
        default = convnets.get_model(name, features_only=True, device="meta").feature_info
    assert isinstance(ours, FeatureInfo) and len(ours) == len(theirs) == 5
    assert ours.out_indices == theirs.out_indices
    assert (ours.channels(), ours.reduction()) == (theirs.channels(), theirs.reduction())
    # timm calls the stem's activation act1; ours is relu. The stages have the same names.
    assert ours.module_name()[1:] == theirs.module_name()[1:]
    subset = timm.create_model(name, features_only=True, pretrained=False, out_indices=(1, 2, 3, 4)).feature_info
    assert (default.channels(), default.reduction(), default.out_indices) == (
        subset.channels(), subset.reduction(), subset.out_indices)
    assert default.get_dicts(keys=["num_chs", "reduction"]) == subset.get_dicts(keys=["num_chs", "reduction"])
    assert (ours.channels(2), ours.reduction([0, 4]), ours[3]["module"]) == (
        theirs.channels(2), theirs.reduction([0, 4]), theirs[3]["module"])


@pytest.mark.parametrize("kwargs, keyword", [
    (dict(features_only=True, out_indices=(1, 5)), "out_indices"),
    (dict(features_only=True, out_indices=(2, 2)), "out_indices"),
    (dict(features_only=True, out_indices=[]), "out_indices"),
    (dict(features_only=True, out_indices="1234"), "out_indices"),
    (dict(out_indices=(1, 2)), "out_indices"),
    (dict(features_only=True, num_classes=10), "num_classes"),
    (dict(features_only="yes"), "features_only"),
    (dict(output_stride=4), "output_stride"),
    (dict(output_stride=True), "output_stride"),
    (dict(frozen_stages=5), "frozen_stages"),
    (dict(frozen_stages=-2), "frozen_stages"),
    (dict(norm_eval=1), "norm_eval"),
    (dict(norm_layer=nn.GroupNorm), "norm_layer"),
])
def test_bad_backbone_options_fail_before_any_download(kwargs: dict, keyword: str) -> None:
    """pretrained=True with an empty cache and no network: the option is refused first."""
    with pytest.raises(convnets.InvalidArgumentError, match=keyword) as info:
        convnets.resnet50(pretrained=True, **kwargs)
    assert info.value.keyword == keyword


def test_commands_refuse_arch_kwargs_that_drop_the_classifier() -> None:
    from convnets.registry import choose_model

    with pytest.raises(convnets.InvalidArgumentError, match="arch_kwargs: features_only"):
        choose_model("resnet50", arch_kwargs=dict(TINY["resnet50"], features_only=True))


# --- freezing ------------------------------------------------------------------------------------

def _bn_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if "running_" in k}


def _train_step(model: nn.Module) -> None:
    model.train()
    out = model(torch.randn(4, 3, SIZE, SIZE))
    loss = sum(o.float().mean() for o in out) if isinstance(out, list) else out.square().mean()
    loss.backward()


@pytest.mark.parametrize("frozen_stages", [-1, 0, 1, 3])
def test_frozen_stages_get_no_gradient_and_keep_their_statistics(frozen_stages: int, tmp_path: Path) -> None:
    """mmdetection's ResNet._freeze_stages: stem at 0, then layer1 .. layerN; frozen parts stay in eval mode."""
    _, path = _checkpoint("resnext101_32x4d", tmp_path)
    model = convnets.resnext101_32x4d(pretrained_from_file=path, frozen_stages=frozen_stages,
                                      **TINY["resnext101_32x4d"])
    frozen = ["conv1", "bn1", *(f"layer{i}" for i in range(1, frozen_stages + 1))] if frozen_stages >= 0 else []
    before = _bn_stats(model)
    _train_step(model)
    after = _bn_stats(model)
    for name, param in model.named_parameters():
        part = name.split(".")[0]
        assert (param.grad is None) == (part in frozen), name
        assert param.requires_grad == (part not in frozen), name
    for key in before:
        unchanged = torch.equal(before[key], after[key])
        assert unchanged == (key.split(".")[0] in frozen), key
    assert all(not getattr(model, part).training for part in frozen)
    assert model.layer4.training and model.fc.training


def test_norm_eval_keeps_batchnorm_statistics_but_trains_their_affine_terms() -> None:
    model = convnets.resnet50(norm_eval=True, **TINY["resnet50"])
    randomize_bn(model)
    before = _bn_stats(model)
    _train_step(model)
    assert model.training and all(not m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert all(torch.equal(before[k], v) for k, v in _bn_stats(model).items())
    assert model.bn1.weight.grad is not None and model.layer1[0].bn1.bias.grad is not None
    # Without it, train mode updates them.
    plain = convnets.resnet50(**TINY["resnet50"])
    _train_step(plain)
    assert not torch.equal(plain.bn1.running_mean, torch.zeros_like(plain.bn1.running_mean))


def test_a_features_only_backbone_keeps_its_frozen_stages_in_eval_mode() -> None:
    model = convnets.se_resnext101_32x4d(features_only=True, frozen_stages=2, norm_eval=False,
                                         **TINY["se_resnext101_32x4d"])
    before = _bn_stats(model)
    _train_step(model)
    assert not model.layer2.training and model.layer3.training
    assert model.layer1[0].conv1.weight.grad is None and model.layer3[0].conv1.weight.grad is not None
    changed = {k.split(".")[0] for k, v in _bn_stats(model).items() if not torch.equal(before[k], v)}
    assert changed == {"layer3", "layer4"}


@pytest.mark.parametrize("norm_layer", ["frozenbatchnorm2d", "torchvision"])
def test_frozen_batchnorm_replaces_every_batchnorm(norm_layer: str, tmp_path: Path) -> None:
    from torchvision.ops import FrozenBatchNorm2d

    classifier, path = _checkpoint("se_resnext101_32x4d", tmp_path)
    layer = FrozenBatchNorm2d if norm_layer == "torchvision" else norm_layer
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, norm_layer=layer, **TINY["se_resnext101_32x4d"])
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in model.modules()) == sum(
        isinstance(m, nn.BatchNorm2d) for m in classifier.modules())
    x = torch.randn(2, 3, SIZE, SIZE)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    out = model(x)
    out.square().mean().backward()
    # Train mode computes what the BatchNorm classifier computes in eval mode, and changes nothing.
    with torch.no_grad():
        torch.testing.assert_close(out, classifier(x), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.conv1.weight.grad is not None  # the convolutions still train


# --- fpn_backbone and torchvision's detectors -------------------------------------------------------

@pytest.mark.parametrize("trainable_layers", [0, 1, 2, 3, 4, 5])
def test_trainable_layers_free_what_torchvisions_resnet_fpn_backbone_frees(trainable_layers: int) -> None:
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    theirs = resnet_fpn_backbone(backbone_name="resnet50", weights=None, trainable_layers=trainable_layers)
    ours = convnets.fpn_backbone("resnet50", trainable_layers=trainable_layers)
    trainable = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == trainable
    assert ours.out_channels == theirs.out_channels == 256
    with torch.no_grad():
        x = torch.randn(1, 3, SIZE, SIZE)
        assert {k: v.shape for k, v in ours.eval()(x).items()} == {k: v.shape for k, v in theirs.eval()(x).items()}


def _synthetic_detection_batch() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Two images with bright boxes on a dark background, and those boxes as targets."""
    g = torch.Generator().manual_seed(3)
    images, targets = [], []
    for boxes, labels in [([[8, 8, 40, 36]], [1]), ([[20, 12, 56, 60], [2, 40, 22, 62]], [2, 1])]:
        image = torch.rand(3, SIZE, SIZE, generator=g) * 0.1
        for x0, y0, x1, y1 in boxes:
            image[:, y0:y1, x0:x1] += 0.8
        images.append(image)
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)})
    return images, targets


@pytest.mark.slow
def test_a_faster_rcnn_on_fpn_backbone_trains(tmp_path: Path) -> None:
    from torchvision.models.detection import FasterRCNN

    _, path = _checkpoint("resnext101_32x4d", tmp_path)
    backbone = convnets.fpn_backbone("resnext101_32x4d", pretrained_from_file=path, trainable_layers=3,
                                     out_channels=32, **TINY["resnext101_32x4d"])
    torch.manual_seed(0)  # the heads' initialisation and the RPN's sampling
    detector = FasterRCNN(backbone, num_classes=3, min_size=SIZE, max_size=SIZE)
    images, targets = _synthetic_detection_batch()
    trainable = [p for p in detector.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.005)
    frozen = {k: v.clone() for k, v in backbone.body.state_dict().items()
              if k.split(".")[0] in ("conv1", "bn1", "layer1")}
    losses = []
    detector.train()
    for _ in range(8):
        optimizer.zero_grad()
        loss = sum(detector(images, targets).values())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)  # random weights: keep the first steps tame
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and max(losses[-3:]) < losses[0], losses
    for name, param in backbone.body.named_parameters():
        stage = name.split(".")[0]
        assert (param.grad is None) == (stage in ("conv1", "bn1", "layer1")), name
    assert all(torch.equal(v, backbone.body.state_dict()[k]) for k, v in frozen.items())
    assert all(p.grad is not None for p in backbone.fpn.parameters())
    detector.eval()
    with torch.no_grad():
        detections = detector(images)
    assert [set(d) for d in detections] == [{"boxes", "labels", "scores"}] * 2


def test_mask_rcnn_and_retinanet_accept_it() -> None:
    from torchvision.models.detection import MaskRCNN, RetinaNet
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    images, _ = _synthetic_detection_batch()
    mask_rcnn = MaskRCNN(convnets.fpn_backbone("resnet50", out_channels=32, **TINY["resnet50"]), num_classes=3,
                         min_size=SIZE, max_size=SIZE).eval()
    # torchvision's retinanet_resnet50_fpn: stages 2..4 and P6/P7 from the pyramid.
    retina_backbone = convnets.fpn_backbone("resnet50", returned_layers=[2, 3, 4], out_channels=32,
                                            extra_blocks=LastLevelP6P7(32, 32), **TINY["resnet50"])
    retinanet = RetinaNet(retina_backbone, num_classes=3, min_size=SIZE, max_size=SIZE).eval()
    with torch.no_grad():
        assert "masks" in mask_rcnn(images)[0]
        assert list(retina_backbone(torch.zeros(1, 3, SIZE, SIZE))) == ["0", "1", "2", "p6", "p7"]
        assert "scores" in retinanet(images)[0]


@pytest.mark.parametrize("kwargs, keyword", [(dict(trainable_layers=6), "trainable_layers"),
                                             (dict(returned_layers=[0, 1]), "returned_layers"),
                                             (dict(frozen_stages=1), "frozen_stages"),
                                             (dict(norm_layer=nn.LayerNorm), "norm_layer")])
def test_fpn_backbone_refuses_bad_arguments(kwargs: dict, keyword: str) -> None:
    with pytest.raises(convnets.InvalidArgumentError, match=keyword):
        convnets.fpn_backbone("resnet50", **kwargs, **TINY["resnet50"])
