"""The Guard's cost: what each feature group declares, the budget a pipeline's feature choice
keeps to, and the ratio measured on a real Guard and recorded in its bundle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from detector.bundle import read_manifest
from detector.cost import (
    DEFAULT_BUDGET,
    EXTRA_PASSES,
    declared_ratio,
    feature_costs,
    measure_cost,
    noise_batch,
    within_budget,
    within_measured_budget,
)
from detector.errors import ConfigError
from detector.features import (
    DIRECTION_ELEMENTS,
    ORDER_POSITIONS,
    FeatureSpec,
    TransportFeatureExtractor,
    sign_directions,
    spatial_statistics,
)
from detector.guard import Guard
from detector.networks import InputSpec
from training.pipeline.steps import preset_config
from training.presets.pipelines import FeatureOptions, PipelineConfig, get_pipeline_preset


def test_each_group_declares_its_extra_forward_passes() -> None:
    assert EXTRA_PASSES == {"squeeze": 5, "second": 1}
    assert declared_ratio(FeatureSpec(image=True, start=True, head=True, embeddings=True)) == 1
    assert declared_ratio(FeatureSpec(squeeze=True)) == 6
    assert declared_ratio(FeatureSpec(squeeze=True, second=True)) == 7
    specs = [FeatureSpec(), FeatureSpec(second=True), FeatureSpec(squeeze=True)]
    assert within_budget(specs, DEFAULT_BUDGET) == specs[:1]
    assert within_budget(specs, 2.0) == specs[:2]


def test_a_pipeline_offers_only_the_candidates_within_its_budget(tmp_path: Path) -> None:
    quick = get_pipeline_preset("quick")
    assert quick.cost_budget is None and len(quick.affordable_candidates()) == 10  # knowingly
    (tmp_path / "model.safetensors").touch()
    imported = quick.on_network(tmp_path)
    offered = imported.affordable_candidates()
    assert offered and all(declared_ratio(spec) == 1 for spec in offered)
    assert imported.cost_budget == DEFAULT_BUDGET and not imported.models
    raised = preset_config("quick", network=tmp_path, cost_budget=6.0)
    assert any(spec.squeeze for spec in raised.affordable_candidates())
    with pytest.raises(ValueError, match="no feature candidate fits cost_budget 1.1"):
        PipelineConfig(
            name="dear",
            models={"a": "smoke-lap"},
            attacks=[],
            deploy_model="a",
            feature_candidates=[FeatureOptions(squeeze=True)],
        )
    with pytest.raises(ConfigError, match="cost_budget: Input should be greater than or equal"):
        preset_config("smoke", cost_budget=0.5)


def test_candidates_are_measured_on_the_network_and_kept_within_the_budget(
    service_bundle: Path,
) -> None:
    network = Guard.from_bundle(service_bundle, device="cpu").model
    specs = [FeatureSpec(), FeatureSpec(head=True), FeatureSpec(image=True, start=True)]
    costs = feature_costs(network, specs, noise_batch(network.config.input_spec, 8), rounds=2)
    assert len(costs) == 3 and all(np.isfinite(c) and c > 0 for c in costs)
    assert within_measured_budget(specs, [9.0, 1.0, 1.2], 1.1) == specs[:2]  # the first stays
    assert within_measured_budget(specs, [1.0, 1.3, 1.05], 1.1) == [specs[0], specs[2]]


def test_the_measured_cost_is_recorded_in_the_bundle(service_bundle: Path) -> None:
    guard = Guard.from_bundle(service_bundle, device="cpu")
    batch = noise_batch(guard.input_spec, 16)
    assert batch.shape == (16, *guard.input_spec.shape) and 0 <= batch.min() <= batch.max() <= 1
    cost = measure_cost(guard, batch, rounds=3, budget=1.5)
    assert cost.ratio > 0 and np.isfinite(cost.ratio)
    assert (cost.batch_size, cost.device, cost.rounds, cost.budget) == (16, "cpu", 3, 1.5)
    assert read_manifest(service_bundle).cost is None  # a bundle written without one reads


def test_noise_batches_follow_the_value_range() -> None:
    spec = InputSpec(channels=3, height=4, width=5, mean=[0, 0, 0], std=[1, 1, 1],
                     value_range=(-1.0, 2.0))  # fmt: skip
    batch = noise_batch(spec, 64, seed=3)
    assert batch.shape == (64, 3, 4, 5) and batch.min() >= -1 and batch.max() <= 2
    assert batch.min() < 0 < 1 < batch.max()  # the whole range, not [0, 1]
    torch.testing.assert_close(batch, noise_batch(spec, 64, seed=3))


def test_start_statistics_read_a_token_sequence_as_positions() -> None:
    """A ViT's x_0 is [N, T, D]: T positions of D channels, like an [N, D, T, 1] map."""
    tokens = torch.randn(3, 17, 8)
    torch.testing.assert_close(
        spatial_statistics(tokens), spatial_statistics(tokens.transpose(1, 2)[..., None])
    )
    with pytest.raises(ConfigError, match=r"\[N, C, H, W\] or \[N, T, D\]"):
        spatial_statistics(torch.randn(2, 3, 4, 5, 6))


def test_order_statistics_read_a_bounded_grid_of_a_large_map() -> None:
    """Up to ORDER_POSITIONS positions every one counts; a 224x224 map's quantiles come from an
    evenly strided grid (stride 7: 1,024 positions), its moments from every position."""
    assert ORDER_POSITIONS >= 28 * 28  # the LAP networks' maps are read whole
    large = torch.rand(2, 3, 224, 224)
    grid = large[..., ::7, ::7]
    full, strided = spatial_statistics(large), spatial_statistics(grid)
    scale = (large.square().mean((1, 2, 3)) / grid.square().mean((1, 2, 3)))[:, None]
    torch.testing.assert_close(full[:, 6:], strided[:, 6:] / scale)  # quantiles: the grid's
    assert not torch.allclose(full[:, :1], strided[:, :1])  # msq: every position


class _OneBlock(torch.nn.Module):
    """x + r(x) with r the identity, then a linear head: its residual is its input."""

    def __init__(self) -> None:
        super().__init__()
        self.r = torch.nn.Identity()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.r(x)).mean((2, 3)))

    def tap_names(self) -> list[str]:
        return ["r"]


def test_direction_cosines_of_a_large_residual_read_its_leading_elements() -> None:
    x = torch.randn(2, 8, 160, 160)  # 204,800 elements per sample, past the bound
    assert x[0].numel() > DIRECTION_ELEMENTS
    network = _OneBlock()
    with (
        torch.inference_mode(),
        TransportFeatureExtractor(network, FeatureSpec(extra_directions=2)) as fx,
    ):
        network(x)
        features = fx.features()
    lead = x.reshape(2, -1)[:, :DIRECTION_ELEMENTS]
    norm = lead.norm(dim=1, keepdim=True) * DIRECTION_ELEMENTS**0.5
    expected = lead @ sign_directions(DIRECTION_ELEMENTS, 2) / norm
    torch.testing.assert_close(features[:, 2:4], expected, rtol=1e-4, atol=1e-6)
