"""Transport features: equal to a hand computation, any ResNet, hooks removed, batching-invariant."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from detector.errors import ConfigError, InputError
from detector.features import (
    FeatureSpec,
    TransportFeatureExtractor,
    check_features,
    extract_features,
    feature_names,
    head_statistics,
    sign_directions,
    spatial_statistics,
)
from detector.opinion import OPINION_NAMES
from detector.scene_statistics import scene_statistics
from detector.taps import Tap, Taps


def _hand_residuals(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """r_m = x_{m+1} - x_m, running the blocks one by one (h = 1, identity shortcuts)."""
    with torch.no_grad():
        state = model.stem(model.normalize(x))
        residuals = []
        for block in model.blocks:
            following = block(state)
            residuals.append((following - state).flatten(1).double())
            state = following
    return residuals


def test_features_equal_hand_computation(tiny_network: torch.nn.Module) -> None:
    assert all(block.h == 1.0 for block in tiny_network.blocks)
    x = torch.rand(6, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with (
        torch.no_grad(),
        TransportFeatureExtractor(
            tiny_network, FeatureSpec(extra_directions=2, line_shape=True)
        ) as fx,
    ):
        logits = tiny_network(x)
        features = fx.features()
    assert torch.allclose(logits, tiny_network(x))
    assert features.dtype == torch.float32
    assert fx.feature_names == feature_names(2, extra_directions=2, line_shape=True)

    residuals = _hand_residuals(tiny_network, x)
    d = residuals[0].shape[1]
    expected = []
    for r in residuals:
        norm = r.norm(dim=1)
        expected += [norm**2 / d, r.sum(dim=1) / (norm * math.sqrt(d))]
    directions = sign_directions(d, 2).double()
    for r in residuals:
        norm = r.norm(dim=1)
        expected += list((r @ directions / (norm[:, None] * math.sqrt(d))).T)
    unit_sum = sum(r / r.norm(dim=1, keepdim=True) for r in residuals)
    expected.append(len(residuals) / unit_sum.norm(dim=1))
    expected_matrix = torch.stack(expected, dim=1).float()
    assert torch.allclose(features, expected_matrix, rtol=1e-4, atol=1e-6)
    assert (features[:, -1] >= 1.0 - 1e-5).all()  # LSS >= 1


def test_start_embedding_and_head_groups_equal_hand_computation(
    tiny_network: torch.nn.Module,
) -> None:
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    spec = FeatureSpec(embeddings=True, start=True, head=True)
    with torch.no_grad(), TransportFeatureExtractor(tiny_network, spec) as fx:
        logits = tiny_network(x)
        features = fx.features()
        start = tiny_network.stem(tiny_network.normalize(x))
        states = [start]
        for block in tiny_network.blocks:
            states.append(block(states[-1]))
    names = fx.feature_names
    assert names == spec.names(2) and features.shape == (5, len(names))
    for m, state in enumerate(states[1:]):
        flat = state.flatten(1).double()
        d = flat.shape[1]
        np.testing.assert_allclose(
            features[:, names.index(f"emb_msq_{m}")], flat.square().mean(1), rtol=1e-4
        )
        np.testing.assert_allclose(
            features[:, names.index(f"emb_cos_{m}")],
            flat.sum(1) / (flat.norm(dim=1) * math.sqrt(d)),
            rtol=1e-4,
            atol=1e-6,
        )
    first_start = names.index("start_msq")
    np.testing.assert_allclose(
        features[:, first_start : first_start + 12], spatial_statistics(start), rtol=1e-5
    )
    np.testing.assert_allclose(features[:, -3:], head_statistics(logits), rtol=1e-5)


def _banded_images(seed: int) -> torch.Tensor:
    """Four random 28x28 images with a flat top band, as Fashion-MNIST's background."""
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(seed))
    x[:, :, :8] = 0.0
    return x


def _extracted(
    network: torch.nn.Module,
    spec: FeatureSpec,
    x: torch.Tensor,
    value_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, list[str]]:
    """(features, column names) of one forward pass of ``x`` through ``network``."""
    with torch.no_grad(), TransportFeatureExtractor(network, spec, value_range=value_range) as fx:
        network(x)
        return fx.features(), fx.feature_names


def _group_features(
    network: torch.nn.Module, n: int, spec: FeatureSpec, label: str
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(images, features, column names) of ``n`` banded images under ``spec``, whose columns are
    ``spec.names(2)`` and whose label is ``label``."""
    x = _banded_images(n)
    features, names = _extracted(network, spec, x)
    assert names == spec.names(2) and spec.label() == label
    return x, features, names


def test_image_group_is_the_spatial_statistics_of_the_network_input(
    tiny_network: torch.nn.Module,
) -> None:
    spec = FeatureSpec(image=True, start=True, head=True)
    x, features, names = _group_features(tiny_network, 5, spec, "residues+image+start+head")
    assert names.index("image_msq") < names.index("start_msq") < names.index("head_margin")
    first = names.index("image_msq")
    np.testing.assert_allclose(
        features[:, first : first + 12], spatial_statistics(x), rtol=1e-5, atol=1e-7
    )
    # The raw image, not the normalized stem input: msq is the image's own mean square.
    np.testing.assert_allclose(features[:, first], x.square().flatten(1).mean(1), rtol=1e-5)


def test_nss_group_is_the_scene_statistics_of_the_image_in_the_networks_range(
    tiny_network: torch.nn.Module,
) -> None:
    spec = FeatureSpec(image=True, nss=True, head=True)
    x, features, names = _group_features(tiny_network, 6, spec, "residues+image+nss+head")
    assert names.index("image_spread_q50") + 1 == names.index("nss_s0_ggd_shape")
    assert names.index("nss_s1_d2_right_var") + 1 == names.index("head_margin")
    first = names.index("nss_s0_ggd_shape")
    np.testing.assert_allclose(
        features[:, first : first + 36], scene_statistics(x), rtol=1e-6, atol=1e-7
    )
    # The same images as a network reading [-1, 1] sees them: the same statistics.
    centred, _ = _extracted(tiny_network, spec, x * 2 - 1, (-1.0, 1.0))
    np.testing.assert_allclose(
        centred[:, first : first + 36], features[:, first : first + 36], rtol=1e-4, atol=1e-5
    )


def test_spatial_statistics_known_answers() -> None:
    constant = torch.full((2, 3, 6, 6), 2.0)
    stats = spatial_statistics(constant)
    #        msq cos kurt rough peak l1 energy quantiles  spread quantiles
    expected = [4, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    np.testing.assert_allclose(stats, [expected, expected], atol=1e-6)
    np.testing.assert_array_equal(spatial_statistics(torch.zeros(1, 2, 4, 4)), np.zeros((1, 12)))

    # One hot position in a flat map: energy all at the peak, low quantiles 0, kurtosis = HW.
    spike = torch.zeros(1, 1, 4, 4)
    spike[0, 0, 1, 2] = 3.0
    msq, cos, kurt, rough, peak, l1, q05, q25, q50, s10, s25, s50 = spatial_statistics(spike)[0]
    assert msq == pytest.approx(9 / 16) and cos == pytest.approx(3 / (3 * 4))
    assert kurt == pytest.approx(16) and peak == pytest.approx(16) and l1 == pytest.approx(0.25)
    assert rough == pytest.approx((18 / 12 + 18 / 12) / (2 * 9 / 16))
    assert (q05, q25, q50, s10, s25, s50) == (0, 0, 0, 0, 0, 0)

    # Noise on a flat background raises the low quantiles the clean map has at 0.
    background = torch.zeros(1, 2, 8, 8)
    background[..., 2:6, 2:6] = 1.0
    noisy = background + 0.03 * torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    assert spatial_statistics(background)[0, 6] == 0 and spatial_statistics(noisy)[0, 6] > 0
    with pytest.raises(ConfigError, match=r"\[N, C, H, W\] or \[N, T, D\] state"):
        spatial_statistics(torch.zeros(2, 3, 4, 5, 6))


def test_sign_directions_are_balanced_fixed_and_nearly_orthogonal() -> None:
    directions = sign_directions(1000, 3)
    assert directions.shape == (1000, 3)
    assert set(directions.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(directions.sum(dim=0), torch.zeros(3))  # orthogonal to the ones vector
    assert torch.equal(directions, sign_directions(1000, 3))
    gram = directions.T @ directions / 1000
    assert (gram - torch.eye(3)).abs().max() < 0.15


def test_zero_residual_gives_zero_cosine_not_nan(tiny_network: torch.nn.Module) -> None:
    last_bn = tiny_network.blocks[0].branch[-1]
    with torch.no_grad():
        last_bn.weight.zero_()
        last_bn.bias.zero_()
    features, _ = extract_features(
        tiny_network, np.random.default_rng(0).random((3, 1, 28, 28), dtype=np.float32)
    )
    assert np.isfinite(features).all()
    assert np.all(features[:, 0] == 0) and np.all(features[:, 1] == 0)


def test_torchvision_resnet18_has_two_features_per_block_and_hooks_are_removed() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = np.random.default_rng(0).random((2, 3, 64, 64), dtype=np.float32)
    features, logits = extract_features(model, x)
    assert features.shape == (2, 2 * 8) and logits.shape == (2, 1000)
    assert np.isfinite(features).all()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_extract_features_is_batch_invariant_and_restores_mode(
    tiny_network: torch.nn.Module,
) -> None:
    x = np.random.default_rng(2).random((10, 1, 28, 28), dtype=np.float32)
    tiny_network.train()
    small, logits_small = extract_features(
        tiny_network, x, batch_size=3, spec=FeatureSpec(line_shape=True)
    )
    whole, logits_whole = extract_features(
        tiny_network, x, batch_size=256, spec=FeatureSpec(line_shape=True)
    )
    assert tiny_network.training
    assert small.shape == (10, 5)
    np.testing.assert_allclose(small, whole, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(logits_small, logits_whole, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(
            logits_whole, tiny_network.eval()(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5
        )


def test_bad_inputs_are_refused(tiny_network: torch.nn.Module) -> None:
    with pytest.raises(InputError, match=r"\[N, C, H, W\]"):
        extract_features(tiny_network, np.zeros((1, 28, 28), np.float32))
    with pytest.raises(InputError, match="NaN"):
        extract_features(tiny_network, np.full((1, 1, 28, 28), np.nan, np.float32))
    with pytest.raises(
        InputError, match="fitted on 4 features, got 6: this detector belongs to another network"
    ):
        check_features(np.zeros((2, 6)), 4)


def test_feature_spec_is_typed_and_names_its_columns(tiny_network: torch.nn.Module) -> None:
    spec = FeatureSpec(taps=["blocks.0.residual"], extra_directions=1, line_shape=True)  # type: ignore[arg-type]
    assert spec.taps == ("blocks.0.residual",)
    assert spec.tap_names(tiny_network) == ["blocks.0.residual"]
    assert FeatureSpec().tap_names(tiny_network) == ["blocks.0.residual", "blocks.1.residual"]
    assert spec.names(1) == ["msq_0", "cos_0", "cos_0_dir1", "line_shape"]
    assert spec.names(2) == feature_names(2, extra_directions=1, line_shape=True)
    with pytest.raises(InputError, match="extra_directions must be >= 0"):
        FeatureSpec(extra_directions=-1)


def test_taps_record_inputs_and_outputs_and_leave_no_hook(tiny_network: torch.nn.Module) -> None:
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(4))
    block = tiny_network.blocks[1]
    with torch.no_grad(), Taps(tiny_network, [Tap("blocks.1", "input"), "blocks.1"]) as taps:
        tiny_network(x)
        seen_input, seen_output = taps.outputs
    with torch.no_grad():
        state = tiny_network.blocks[0](tiny_network.stem(tiny_network.normalize(x)))
        assert torch.equal(seen_input, state) and torch.equal(seen_output, block(state))
    with torch.no_grad(), TransportFeatureExtractor(tiny_network, FeatureSpec(line_shape=True)):
        tiny_network(x)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in tiny_network.modules())
    with pytest.raises(ConfigError, match="tap modules not found"):
        Taps(tiny_network, ["blocks.9"])


@pytest.fixture
def second_network(tiny_network: torch.nn.Module) -> torch.nn.Module:
    """Another network: ``tiny_network`` with seeded noise on every weight (so the two agree on
    some images and not on others)."""
    other = copy.deepcopy(tiny_network)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    return other.eval()


def test_second_opinion_group_is_the_other_networks_reading_of_the_prediction(
    tiny_network: torch.nn.Module, second_network: torch.nn.Module
) -> None:
    """The three columns: the second network's top class is the first's prediction, the log of
    its probability of that class, its max probability; after every other group."""
    x = np.random.default_rng(4).random((12, 1, 28, 28), dtype=np.float32)
    spec = FeatureSpec(head=True, second=True)
    features, logits = extract_features(tiny_network, x, spec=spec, second=second_network)
    assert spec.names(2)[-4:] == ["head_logsumexp", *OPINION_NAMES]
    assert spec.label() == "residues+head+second"
    with torch.no_grad():
        p = second_network(torch.from_numpy(x)).softmax(1).numpy()
    predicted = logits.argmax(1)
    expected = np.stack(
        [p.argmax(1) == predicted, np.log(p[np.arange(12), predicted] + 1e-6), p.max(1)], 1
    )
    np.testing.assert_allclose(features[:, -3:], expected, rtol=1e-5, atol=1e-6)
    assert 0 < features[:, -3].sum() < 12  # two untrained networks agree on some images only
    without, _ = extract_features(tiny_network, x, spec=FeatureSpec(head=True))
    np.testing.assert_allclose(features[:, :-3], without, rtol=1e-5, atol=1e-6)


def test_second_opinion_keeps_the_graph_through_the_second_network(
    tiny_network: torch.nn.Module, second_network: torch.nn.Module
) -> None:
    """An adaptive attacker's gradient of the opinion columns reaches the input through the
    second network."""
    x = torch.rand(3, 1, 28, 28, requires_grad=True)
    with TransportFeatureExtractor(
        tiny_network, FeatureSpec(second=True), second=second_network
    ) as fx:
        tiny_network(x)
        log_prob = fx.features()[:, -2].sum()
    (gradient,) = torch.autograd.grad(log_prob, x)
    assert gradient.abs().sum() > 0


def test_second_opinion_needs_another_network(tiny_network: torch.nn.Module) -> None:
    spec = FeatureSpec(second=True)
    with pytest.raises(ConfigError, match="holds a second network's opinion: pass that network"):
        TransportFeatureExtractor(tiny_network, spec)
    with pytest.raises(ConfigError, match="another network than the deployed one"):
        TransportFeatureExtractor(tiny_network, spec, second=tiny_network)
