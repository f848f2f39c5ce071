"""Observable networks: taps, registry, save/load."""

from __future__ import annotations

import json

import pytest
import torch

from detector import networks
from detector.errors import ArtefactError, ConfigError
from detector.taps import ResidualTaps, default_tap_names

# Small arguments for every registered architecture, so each builds and runs in milliseconds.
TINY_ARGUMENTS = {
    "resnet9_mnist": ({"width": 4, "depth": 2, "hidden": 8}, (1, 28, 28)),
    "resnet110": ({"depth": 8, "base_width": 4}, (3, 32, 32)),
    "resnext50": (
        {"layers": [1, 1, 1, 1], "cardinality": 2, "group_width": 2, "base_width": 8},
        (3, 32, 32),
    ),
    "wide_resnet": ({"depth": 10, "widen_factor": 1}, (3, 64, 64)),
}


def test_every_registered_architecture_is_covered() -> None:
    assert sorted(TINY_ARGUMENTS) == networks.list_models()


@pytest.mark.parametrize("name", sorted(TINY_ARGUMENTS))
def test_architecture_builds_and_runs_forward(name: str) -> None:
    arguments, shape = TINY_ARGUMENTS[name]
    model = networks.get_model(
        name,
        num_classes=7,
        in_channels=shape[0],
        mean=[0.5] * shape[0],
        std=[0.25] * shape[0],
        **arguments,
    ).eval()
    x = torch.rand(2, *shape)
    with ResidualTaps(model) as taps:
        logits = model(x)
        residuals = taps.outputs
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()
    assert len(residuals) == len(model.blocks) == len(model.tap_names())


@pytest.mark.parametrize("h", [1.0, 0.5])
def test_taps_equal_hand_computed_residuals(tiny_network: torch.nn.Module, h: float) -> None:
    for block in tiny_network.blocks:
        block.h = h
    x = torch.rand(3, 1, 28, 28)
    with ResidualTaps(tiny_network) as taps:
        tiny_network(x)
        tapped = taps.outputs
    # Hand computation: run the blocks one by one; r_m = (x_{m+1} - x_m) / h for identity shortcuts.
    with torch.no_grad():
        state = tiny_network.stem(tiny_network.normalize(x))
        for m, block in enumerate(tiny_network.blocks):
            following = block(state)
            torch.testing.assert_close(tapped[m], (following - state) / h, rtol=1e-5, atol=1e-5)
            state = following


def test_hooks_are_removed_after_use(tiny_network: torch.nn.Module) -> None:
    with ResidualTaps(tiny_network):
        pass
    assert all(not module._forward_hooks for module in tiny_network.modules())


def test_torchvision_resnet_taps() -> None:
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=5).eval()
    names = default_tap_names(model)
    assert len(names) == 8 and all(n.endswith(".bn2") for n in names)
    with ResidualTaps(model, names) as taps:
        model(torch.rand(1, 3, 64, 64))
        assert len(taps.outputs) == 8


def test_unknown_model_without_taps_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="pass tap names explicitly"):
        default_tap_names(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_unknown_architecture_and_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="unknown architecture 'nope'"):
        networks.get_model("nope")
    with pytest.raises(ConfigError, match="bad arguments"):
        networks.get_model("resnet9_mnist", colour="blue")
    with pytest.raises(ConfigError, match="6n\\+2"):
        networks.get_model("resnet110", depth=11)


def test_save_load_round_trip_is_bit_exact(tmp_path, tiny_network, tiny_config) -> None:
    # Give BatchNorm non-trivial running statistics first.
    tiny_network.train()
    tiny_network(torch.rand(16, 1, 28, 28))
    tiny_network.eval()
    networks.save(tiny_network, tmp_path / "net", tiny_config)
    loaded = networks.load(tmp_path / "net")
    for (name, a), (_, b) in zip(
        tiny_network.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(tiny_network(x), loaded(x))
    assert loaded.config == tiny_config


def test_load_refuses_broken_artefacts(tmp_path, tiny_network, tiny_config) -> None:
    directory = networks.save(tiny_network, tmp_path / "net", tiny_config)
    with pytest.raises(ArtefactError, match="no network config"):
        networks.load(tmp_path / "elsewhere")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architecture": "vgg"}))
    with pytest.raises(ArtefactError, match="unknown architecture 'vgg'"):
        networks.load(directory)
    (directory / "config.json").write_text(json.dumps({**config, "format_version": 99}))
    with pytest.raises(ArtefactError, match="unknown network format version 99"):
        networks.load(directory)
    (directory / "config.json").write_text(
        json.dumps({**config, "arguments": {**config["arguments"], "width": 8}})
    )
    with pytest.raises(ArtefactError, match="do not match"):
        networks.load(directory)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ArtefactError, match="cannot read weights"):
        networks.load(directory)


def test_input_spec_validation() -> None:
    with pytest.raises(ValueError, match="one value per channel"):
        networks.InputSpec(channels=3, height=32, width=32, mean=[0.5], std=[0.5])


def test_rce_networks_return_negated_logits(tiny_config) -> None:
    torch.manual_seed(0)
    plain = networks.build_network(tiny_config).eval()
    negated = networks.build_network(
        tiny_config.model_copy(
            update={"arguments": {**tiny_config.arguments, "negate_logits": True}}
        )
    ).eval()
    negated.load_state_dict(plain.state_dict())
    x = torch.rand(2, 1, 28, 28)
    assert torch.equal(negated(x), -plain(x))


# ---- unitization (seed 004, Algorithms 1-2) and the plain variant (seed 001) -----------------
@pytest.mark.parametrize("spatial", [True, False])
def test_unitization_with_alpha_zero_is_batch_norm(spatial: bool) -> None:
    torch.manual_seed(0)
    shape = (8, 3, 5, 5) if spatial else (8, 3)
    reference = torch.nn.BatchNorm2d(3) if spatial else torch.nn.BatchNorm1d(3)
    unit = networks.Unitization(3, spatial=spatial)
    with torch.no_grad():
        for layer in (reference, unit):
            layer.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
            layer.bias.copy_(torch.tensor([0.1, 0.0, 3.0]))
    for _ in range(3):  # training passes update the running moments identically
        x = 2.0 * torch.randn(*shape) + 1.0
        torch.testing.assert_close(unit(x), reference(x))
    torch.testing.assert_close(unit.running_mean, reference.running_mean)
    torch.testing.assert_close(unit.running_var, reference.running_var)
    unit.eval()
    reference.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(unit(x), reference(x))


def test_unitization_follows_algorithm_2_by_hand() -> None:
    torch.manual_seed(1)
    unit = networks.Unitization(2, norm_divisor=3.0)
    with torch.no_grad():
        unit.alpha.copy_(torch.tensor([0.25, 0.75]))
        unit.weight.copy_(torch.tensor([2.0, 0.5]))
        unit.bias.copy_(torch.tensor([-1.0, 1.0]))
    x = torch.randn(4, 2, 3, 3)
    y = unit(x)
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    var = x.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
    x_hat = (x - mean) / torch.sqrt(var + unit.eps)  # line 5
    for k in range(4):
        s = x_hat[k].square().sum() / (3.0 * 9)  # lines 6-9, n = 3, HW = 9
        p = 1 / torch.sqrt(s + unit.eps)  # line 10
        for i, (alpha, gamma, beta) in enumerate([(0.25, 2.0, -1.0), (0.75, 0.5, 1.0)]):
            expected = gamma * (p * alpha + (1 - alpha)) * x_hat[k, i] + beta  # lines 13-14
            torch.testing.assert_close(y[k, i], expected)


def _w1(a: torch.Tensor, b: torch.Tensor) -> float:
    from detector.dynamics import wasserstein_samples

    return wasserstein_samples(a.detach().numpy(), b.detach().numpy(), p=1.0)


def test_unitized_outputs_obey_the_seed_bound() -> None:
    # Theorem 3.1: with alpha = 1 every output lies in the unit ball, so the EM distance between
    # the outputs of any two input distributions is at most 2; BatchNorm's (alpha = 0) is not.
    torch.manual_seed(2)
    unit = networks.Unitization(64, spatial=False)
    with torch.no_grad():
        unit.alpha.fill_(1.0)
    unit.eval()  # fixed moments, as between two training steps
    before = torch.randn(50, 64)
    after = 5.0 * torch.randn(50, 64) ** 3 + 4.0  # heavier tails, shifted: a large shift
    out_before, out_after = unit(before), unit(after)
    for out in (out_before, out_after):
        assert out.norm(dim=1).max() <= 1.0 + 1e-6
    assert _w1(out_before, out_after) <= 2.0
    with torch.no_grad():
        unit.alpha.fill_(0.0)
    assert _w1(unit(before), unit(after)) > 2.0
    # Convolutional layers: norms are taken per image and divided by n H W (Algorithm 2).
    conv = networks.Unitization(4).eval()
    with torch.no_grad():
        conv.alpha.fill_(1.0)
    images = 10.0 * torch.randn(20, 4, 6, 6)
    bound = (36.0 * 36.0) ** 0.5
    assert conv(images).flatten(1).norm(dim=1).max() <= bound * (1 + 1e-6)
    assert _w1(conv(images), conv(-images + 3.0)) <= 2 * bound


def test_unitization_alpha_is_trained() -> None:
    unit = networks.Unitization(3)
    unit(torch.randn(4, 3, 2, 2)).square().sum().backward()
    assert unit.alpha.grad is not None and unit.alpha.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(TINY_ARGUMENTS))
def test_unitized_architectures_build_run_and_round_trip(tmp_path, name: str) -> None:
    arguments, shape = TINY_ARGUMENTS[name]
    config = networks.NetworkConfig(
        architecture=name,
        arguments={**arguments, "norm": "unit"},
        class_names=[str(k) for k in range(5)],
        input_spec=networks.InputSpec(
            channels=shape[0],
            height=shape[1],
            width=shape[2],
            mean=[0.5] * shape[0],
            std=[0.25] * shape[0],
        ),
    )
    model = networks.build_network(config)
    assert any(isinstance(m, networks.Unitization) for m in model.modules())
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    model.train()(torch.rand(4, *shape))  # move the running moments
    loaded = networks.load(networks.save(model.eval(), tmp_path / name, config))
    x = torch.rand(2, *shape)
    assert torch.equal(model(x), loaded(x))


def test_default_normalization_is_batch_norm() -> None:
    torch.manual_seed(0)
    default = networks.get_model("resnet9_mnist", width=4, depth=2, hidden=8)
    torch.manual_seed(0)
    explicit = networks.get_model("resnet9_mnist", width=4, depth=2, hidden=8, norm="batch")
    assert not any(isinstance(m, networks.Unitization) for m in default.modules())
    for (name, a), (_, b) in zip(
        default.state_dict().items(), explicit.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="unknown normalization 'layer'"):
        networks.get_model("resnet9_mnist", norm="layer")


def test_plain_variant_drops_the_skip_connections(tiny_network: torch.nn.Module) -> None:
    plain = networks.get_model("resnet9_mnist", width=4, depth=2, hidden=8, skip=False).eval()
    plain.load_state_dict(tiny_network.state_dict())  # same weights, same names
    x = torch.rand(3, 1, 28, 28)
    with torch.no_grad():
        state = plain.stem(plain.normalize(x))
        for block in plain.blocks:
            state = block.h * block.branch(state)  # x_{m+1} = h r(x_m), no identity
        expected = plain.head(state)
        assert torch.equal(plain(x), expected)
        assert not torch.allclose(plain(x), tiny_network(x))
    with ResidualTaps(plain) as taps:
        plain(x)
        assert len(taps.outputs) == 2
