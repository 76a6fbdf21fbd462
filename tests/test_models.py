"""Architecture: parameter counts, the forward math, builder options and the model's public methods."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, randomize_bn
from reference import reference_forward

import convnets
from convnets.models.resnet import MODEL_SPECS, ArchSpec, ResNet, count_parameters
from convnets.models.specs import MODELS, register_model
from convnets.weights.manifest import load_manifest

# Published parameter counts (SPEC §2), not derived from the code.
PUBLISHED_PARAMS = {"resnet50": 25_557_032, "resnext101_32x4d": 44_177_704, "se_resnext101_32x4d": 45_251_128}


def test_registry_lists_the_published_models() -> None:
    """The three published models are registered; list_models() is the registry, sorted."""
    assert set(PUBLISHED_PARAMS) <= set(convnets.list_models())
    assert convnets.list_models() == sorted(MODELS) == sorted(MODEL_SPECS)
    assert set(load_manifest()) <= set(convnets.list_models())  # every weights entry has an architecture


@pytest.mark.parametrize("name", convnets.list_models())
def test_every_registered_model_has_a_documented_builder(name: str) -> None:
    from convnets import builders

    builder = getattr(convnets, name)
    assert builder is getattr(builders, name) and builder.__name__ == name
    assert name in convnets.__all__ and name in builders.__all__
    # Its own summary first (the parameter count it states is the published one), then the shared keywords.
    if name in PUBLISHED_PARAMS:
        assert f"{PUBLISHED_PARAMS[name]:,} parameters" in builder.__doc__.splitlines()[0]
    assert "pretrained_from_file:" in builder.__doc__
    with torch.device("meta"):
        model = builder()
    assert model.spec == MODEL_SPECS[name]
    if name in load_manifest():
        assert count_parameters(model) == load_manifest()[name].num_params


def test_registration_is_checked() -> None:
    spec = MODEL_SPECS["resnet50"]
    for name, hub_names in [("resnet50", ()), ("ResNet-7", ()), ("resnet7", ("nvidia_resneXt",)),
                            ("resnet7", ("_private",))]:
        with pytest.raises(convnets.InvalidArgumentError, match="cannot register"):
            register_model(name, spec, hub_names=hub_names)
    assert "resnet7" not in MODELS


def test_pretrained_without_published_weights_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered model without a manifest entry builds, but refuses pretrained=True with advice."""
    from convnets import registry

    monkeypatch.setattr(registry, "load_manifest", lambda: {})
    with pytest.raises(convnets.WeightsUnavailableError, match="no pretrained weights .* resnet50") as info:
        convnets.resnet50(pretrained=True)
    assert "pretrained=False" in str(info.value) and "pretrained_from_file" in str(info.value)
    assert convnets.resnet50(**TINY["resnet50"]).training


def test_pretrained_with_overrides_is_an_invalid_argument() -> None:
    with pytest.raises(convnets.InvalidArgumentError, match="published architecture"):
        convnets.resnet50(pretrained=True, **TINY["resnet50"])


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_published_and_manifest(name: str) -> None:
    with torch.device("meta"):
        model = convnets.get_model(name)
    assert count_parameters(model) == PUBLISHED_PARAMS[name]
    assert load_manifest()[name].num_params == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(TINY))
def test_forward_matches_functional_reference(name: str) -> None:
    torch.manual_seed(1)
    model = randomize_bn(convnets.get_model(name, **TINY[name])).eval()
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        got = model(x)
    expected = reference_forward(model.state_dict(), x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_se_squeeze_is_fixed_16_in_every_stage() -> None:
    model = convnets.se_resnext101_32x4d(**TINY["se_resnext101_32x4d"])
    gates = [m for m in model.modules() if isinstance(m, convnets.models.SqueezeExcitation)]
    assert gates and {g.squeeze.out_features for g in gates} == {16}
    assert not any(isinstance(m, convnets.models.SqueezeExcitation) for m in convnets.resnext101_32x4d().modules())


def test_resnext_matches_timm_forward() -> None:
    """timm's resnext101_32x4d is the same network: its random weights, loaded here, give its outputs."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(2)
    ref = randomize_bn(timm.create_model("resnext101_32x4d")).eval()
    ours = convnets.resnext101_32x4d()
    ours.load_state_dict(ref.state_dict())
    ours.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(TINY))
def test_channels_last_equals_nchw(name: str) -> None:
    torch.manual_seed(3)
    model = randomize_bn(convnets.get_model(name, **TINY[name])).eval()
    cl = convnets.get_model(name, memory_format=torch.channels_last, **TINY[name]).eval()
    cl.load_state_dict(model.state_dict())
    assert cl.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(cl(x.to(memory_format=torch.channels_last)), model(x), rtol=1e-4, atol=1e-5)


def test_fused_se_false_gives_same_result() -> None:
    torch.manual_seed(4)
    a = randomize_bn(convnets.se_resnext101_32x4d(**TINY["se_resnext101_32x4d"])).eval()
    b = convnets.se_resnext101_32x4d(fused_se=False, **TINY["se_resnext101_32x4d"]).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 64, 64)
    # In float64: the two SE forms are the same function, and float32 rounding differs between CPU
    # kernels (1.5e-6 apart on some machines), which is not what this test is about.
    with torch.no_grad():
        torch.testing.assert_close(a.double()(x.double()), b.double()(x.double()), rtol=1e-10, atol=1e-12)


def test_upstream_model_keywords_are_accepted() -> None:
    model = convnets.resnext101_32x4d(last_bn_0_init=True, conv_init="fan_out", trt=True, fused_se=True,
                                      **TINY["resnext101_32x4d"])
    bn3 = [m.bn3.weight for m in model.modules() if isinstance(m, convnets.models.Bottleneck)]
    assert all(torch.count_nonzero(w) == 0 for w in bn3)
    # fan_out Kaiming init: std = sqrt(2 / (out_channels * k * k)) for the 7x7 stem conv.
    std = model.conv1.weight.std().item()
    assert abs(std - (2 / (64 * 49)) ** 0.5) < 0.2 * std


def test_unknown_keyword_raises_type_error() -> None:
    with pytest.raises(TypeError, match="colour") as info:
        convnets.resnet50(colour="red")
    assert isinstance(info.value, convnets.UnknownArgumentError)


def test_bad_conv_init_is_rejected() -> None:
    with pytest.raises(ValueError, match="conv_init") as info:
        convnets.resnet50(conv_init="xavier", **TINY["resnet50"])
    assert isinstance(info.value, convnets.InvalidArgumentError)


def test_unknown_model_name_lists_the_valid_ones() -> None:
    with pytest.raises(convnets.UnknownModelError) as info:
        convnets.get_model("se_resnext50")
    for name in convnets.list_models():
        assert name in str(info.value)


def test_upstream_hyphenated_names_resolve() -> None:
    model = convnets.get_model("SE-ResNeXt101-32x4d", **TINY["se_resnext101_32x4d"])
    assert model.spec.se_squeeze == 16


@pytest.mark.parametrize("overrides, message", [
    (dict(layers=[1, 1], widths=[16, 32, 64]), "same length"),
    (dict(layers=[0, 1, 1, 1]), "positive integers"),
    (dict(widths=[30, 60, 120, 240], cardinality=32), "divisible by cardinality"),
    (dict(se_squeeze=0), "se_squeeze"),
    (dict(layers=3), "list of integers"),
])
def test_invalid_architecture_overrides(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        convnets.se_resnext101_32x4d(**overrides)


def test_arch_spec_round_trips_through_a_dict() -> None:
    spec = MODEL_SPECS["se_resnext101_32x4d"]
    assert ArchSpec(**spec.to_dict()) == spec
    assert spec.num_features == 2048


def test_extract_features_returns_requested_stages() -> None:
    torch.manual_seed(5)
    model = randomize_bn(convnets.se_resnext101_32x4d(**TINY["se_resnext101_32x4d"])).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        everything = model.extract_features(x)
        some = model.extract_features(x, layers=["layer2"])
        logits = model(x)
        features = model.forward_features(x)
    assert list(everything) == ["layer1", "layer2", "layer3", "layer4", "classifier"]
    assert list(some) == ["layer2"]
    assert everything["layer1"].shape == (2, 32, 16, 16)
    assert everything["layer4"].shape == (2, 256, 2, 2)
    torch.testing.assert_close(some["layer2"], everything["layer2"])
    torch.testing.assert_close(everything["classifier"], logits)
    torch.testing.assert_close(everything["layer4"], features)
    with pytest.raises(convnets.InvalidArgumentError, match="layer9"):
        model.extract_features(x, layers=["layer9"])


def test_forward_head_and_reset_classifier() -> None:
    model = convnets.resnet50(**TINY["resnet50"]).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        pooled = model.forward_head(model.forward_features(x), pre_logits=True)
    assert pooled.shape == (2, model.num_features)
    model.reset_classifier(7)
    assert model.get_classifier().out_features == 7 and model.num_classes == 7
    assert model(x).shape == (2, 7)
    model.reset_classifier(0)
    assert model(x).shape == (2, model.num_features)


def test_device_argument_places_the_model() -> None:
    model = convnets.resnet50(device="meta")
    assert model.fc.weight.is_meta


def test_random_init_model_is_in_train_mode() -> None:
    assert convnets.resnet50(**TINY["resnet50"]).training


def test_resnet_constructor_validates_num_classes() -> None:
    with pytest.raises(convnets.InvalidArgumentError, match="num_classes"):
        ResNet(MODEL_SPECS["resnet50"], num_classes=-1)
    with pytest.raises(convnets.InvalidArgumentError, match="num_classes"):
        convnets.resnet50(**TINY["resnet50"]).reset_classifier(-1)
