"""Feature squeezing: the squeezers' known answers, the distances, and the squeeze feature group
(its own extra pass leaves every other group of the same pass untouched)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import ndimage

from detector.features import FeatureSpec, TransportFeatureExtractor, extract_features
from detector.squeeze import SQUEEZE_NAMES, SQUEEZERS, bit_depth, median_filter, squeeze_distances


def test_bit_depth_quantises_to_its_levels() -> None:
    x = torch.tensor([0.0, 0.2, 0.49, 0.51, 0.8, 1.0])
    np.testing.assert_array_equal(bit_depth(1)(x), [0, 0, 0, 1, 1, 1])
    np.testing.assert_allclose(bit_depth(2)(x), [0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1])
    levels = torch.unique(
        bit_depth(4)(torch.rand(10_000, generator=torch.Generator().manual_seed(0)))
    )
    assert len(levels) == 16 and torch.allclose(levels * 15, torch.round(levels * 15))


def test_median_filters_match_scipy_and_a_hand_example() -> None:
    x = torch.rand(2, 3, 9, 7, generator=torch.Generator().manual_seed(1))
    # torch's "reflect" leaves the edge pixel out: scipy calls that "mirror".
    expected = ndimage.median_filter(x.numpy(), size=(1, 1, 3, 3), mode="mirror")
    np.testing.assert_allclose(median_filter(3)(x), expected, rtol=0, atol=0)
    # 2x2: each output is the lower median of the window ending at it (one padded row/column
    # before, reflected).
    image = torch.tensor([[[[0.0, 4.0], [8.0, 2.0]]]])
    np.testing.assert_array_equal(median_filter(2)(image), [[[[2.0, 2.0], [2.0, 2.0]]]])
    assert median_filter(2)(x).shape == x.shape


class _Linear(torch.nn.Module):
    """Logits that read the image's mean only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.flatten(1).mean(1, keepdim=True)
        return torch.cat([10 * mean, 10 * (1 - mean)], 1)


def test_squeeze_distances_are_zero_where_squeezing_changes_nothing_and_l1_otherwise() -> None:
    model = _Linear()
    flat = torch.ones(2, 1, 6, 6)  # on every bit-depth grid, and a median's fixed point
    assert torch.equal(squeeze_distances(model, flat, model(flat)), torch.zeros(2, len(SQUEEZERS)))
    x = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(2))
    distances = squeeze_distances(model, x, model(x))
    p = model(x).softmax(1)
    for column, squeeze in enumerate(SQUEEZERS.values()):
        q = model(squeeze(x)).softmax(1)
        np.testing.assert_allclose(distances[:, column], (p - q).abs().sum(1), rtol=1e-5)
    assert ((distances >= 0) & (distances <= 2)).all()


class _Wide(torch.nn.Module):
    """A model of images in [-2, 2] that answers as ``inner`` on their [0, 1] form."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner((x + 2) / 4)


def test_squeezers_act_on_the_value_range_mapped_to_unit() -> None:
    model = _Linear()
    x = torch.rand(3, 1, 6, 6, generator=torch.Generator().manual_seed(3))
    wide = x * 4 - 2  # the same images in [-2, 2]
    scaled = _Wide(model)
    np.testing.assert_allclose(
        squeeze_distances(scaled, wide, scaled(wide), value_range=(-2.0, 2.0)),
        squeeze_distances(model, x, model(x)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_the_squeeze_group_leaves_the_other_groups_of_its_pass_untouched(
    tiny_network: torch.nn.Module,
) -> None:
    x = np.random.default_rng(4).random((9, 1, 28, 28), dtype=np.float32)
    others = FeatureSpec(
        embeddings=True, image=True, start=True, head=True, extra_directions=1, line_shape=True
    )
    with_squeeze = FeatureSpec(**{**others.__dict__, "squeeze": True})
    plain, _ = extract_features(tiny_network, x, spec=others)
    full, logits = extract_features(tiny_network, x, spec=with_squeeze, batch_size=4)
    assert with_squeeze.names(2)[-len(SQUEEZE_NAMES) :] == list(SQUEEZE_NAMES)
    assert with_squeeze.label().endswith("+head+squeeze")
    np.testing.assert_allclose(full[:, : plain.shape[1]], plain, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        tensor = torch.from_numpy(x)
        expected = squeeze_distances(tiny_network, tensor, tiny_network(tensor))
    np.testing.assert_allclose(full[:, plain.shape[1] :], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, tiny_network(tensor).detach(), rtol=1e-6)


def test_squeeze_columns_describe_the_last_pass_and_no_hook_is_left(
    tiny_network: torch.nn.Module,
) -> None:
    a, b = torch.rand(2, 3, 1, 28, 28, generator=torch.Generator().manual_seed(6))
    extractor = TransportFeatureExtractor(tiny_network, FeatureSpec(squeeze=True))
    with torch.no_grad(), extractor as fx:
        tiny_network(a)
        first = fx.features()
        assert torch.equal(fx.features(), first)  # computed once per pass
        tiny_network(b)
        second = fx.features()
    with torch.no_grad():
        np.testing.assert_allclose(
            second[:, -5:], squeeze_distances(tiny_network, b, tiny_network(b)), rtol=1e-5
        )
    assert not torch.allclose(first, second)
    assert torch.equal(fx.features(), second)  # still the last pass after the block
    for module in tiny_network.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


@pytest.mark.parametrize("name", SQUEEZE_NAMES)
def test_every_squeezer_keeps_shape_and_range(name: str) -> None:
    x = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(7))
    out = SQUEEZERS[name](x)
    assert out.shape == x.shape and out.min() >= 0 and out.max() <= 1
