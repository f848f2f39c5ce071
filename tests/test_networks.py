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
