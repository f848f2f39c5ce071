"""Network dynamics (seeds 000, 001/002, 004): every measure against a case with a known answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import wasserstein_distance

from detector import dynamics
from detector.errors import InputError
from detector.features import LINE_SHAPE, FeatureSpec, TransportFeatureExtractor
from detector.networks import get_model


# ---- optimal transport between samples ---------------------------------------------------------
def test_wasserstein_between_identical_samples_is_zero() -> None:
    x = np.random.default_rng(0).normal(size=(40, 3))
    shuffled = x[np.random.default_rng(1).permutation(40)]
    assert dynamics.wasserstein_samples(x, shuffled) == pytest.approx(0.0, abs=1e-12)
    assert dynamics.wasserstein_samples(x, shuffled, p=1) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_wasserstein_of_a_translated_sample_is_the_shift_length(p: float) -> None:
    # Translating a sample by s: the identity coupling is optimal and costs exactly ||s||.
    x = np.random.default_rng(2).normal(size=(50, 4))
    shift = np.array([0.3, -1.2, 0.5, 2.0])
    assert dynamics.wasserstein_samples(x, x + shift, p=p) == pytest.approx(
        np.linalg.norm(shift), rel=1e-9
    )


def test_wasserstein_of_two_gaussians_matches_the_closed_form() -> None:
    rng = np.random.default_rng(3)
    a = rng.normal(1.0, 1.0, size=(1500, 1))
    b = rng.normal(-0.5, 2.0, size=(1500, 1))
    closed = dynamics.gaussian_wasserstein(np.array([1.0]), 1.0, np.array([-0.5]), 4.0)
    assert closed == pytest.approx(np.sqrt(1.5**2 + 1.0**2))
    assert dynamics.wasserstein_samples(a, b) == pytest.approx(closed, rel=0.05)
    # In 1-D the exact assignment is the sorted matching, which scipy's W_1 also computes.
    assert dynamics.wasserstein_samples(a, b, p=1) == pytest.approx(
        wasserstein_distance(a[:, 0], b[:, 0]), rel=1e-9
    )


def test_gaussian_closed_form_in_several_dimensions() -> None:
    cov = np.diag([1.0, 4.0])
    same = dynamics.gaussian_wasserstein(np.zeros(2), cov, np.zeros(2), cov)
    assert same == pytest.approx(0.0, abs=1e-7)
    # Commuting covariances: W^2 = ||m_a - m_b||^2 + ||sqrt(S_a) - sqrt(S_b)||_F^2.
    other = np.diag([9.0, 1.0])
    expected = np.sqrt(1.0 + (1 - 3) ** 2 + (2 - 1) ** 2)
    assert dynamics.gaussian_wasserstein(
        np.zeros(2), cov, np.array([1.0, 0.0]), other
    ) == pytest.approx(expected)


def test_samples_of_different_sizes_are_refused() -> None:
    with pytest.raises(InputError, match="same"):
        dynamics.wasserstein_samples(np.zeros((3, 2)), np.zeros((4, 2)))


# ---- seed 001: line shape and optimal transport score ----------------------------------------
def test_a_straight_line_track_has_line_shape_one() -> None:
    start, direction = np.array([1.0, -2.0, 0.5]), np.array([0.2, 0.4, -0.1])
    steps = np.array([0.0, 0.5, 2.0, 2.1, 5.0])  # uneven steps along one line
    track = start + steps[:, None] * direction
    assert dynamics.line_shape_score(track) == pytest.approx([1.0])
    assert dynamics.line_shape_ratio(track) == pytest.approx([1.0])


def test_line_shape_of_known_polylines() -> None:
    # Right angle of two unit steps: LSS = 2 / sqrt(2); going back and forth: LSR = 3.
    corner = np.array([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    assert dynamics.line_shape_score(corner) == pytest.approx([np.sqrt(2)])
    back_and_forth = np.array([[0.0], [2.0], [1.0]])
    assert dynamics.line_shape_ratio(back_and_forth) == pytest.approx([3.0])
    # LSS normalises segment lengths: one long segment no longer hides the turn.
    long_then_turn = np.array([[0.0, 0.0], [100.0, 0.0], [100.0, 1.0]])
    assert dynamics.line_shape_ratio(long_then_turn) == pytest.approx([101 / np.hypot(100, 1)])
    assert dynamics.line_shape_score(long_then_turn) == pytest.approx([np.sqrt(2)])


def test_ots_of_the_exact_optimal_transport_map_is_one() -> None:
    # The gradient of a convex function, x -> A x + b with A symmetric positive definite, is the
    # optimal transport map for the quadratic cost (Brenier), so its own matching is optimal.
    rng = np.random.default_rng(4)
    x = rng.normal(size=(60, 3))
    root = rng.normal(size=(3, 3))
    y = x @ (root @ root.T + 0.5 * np.eye(3)) + np.array([1.0, 2.0, -1.0])
    assert dynamics.optimal_transport_score(x, y) == 1.0
    assert np.array_equal(dynamics.optimal_assignment(x, y), np.arange(60))


def test_ots_of_a_reversing_map_is_low() -> None:
    # x -> -x in 1-D reverses the order; the optimal (monotone) matching keeps it.
    x = np.linspace(-1.0, 1.0, 21)[:, None]
    assert dynamics.optimal_transport_score(x, -x) == pytest.approx(1 / 21)


# ---- seed 000: W-distance between label distributions -------------------------------------
def test_label_wasserstein_known_answers() -> None:
    predicted = np.array([[0.7, 0.2, 0.1], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    target = np.array([[0.7, 0.2, 0.1], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    # Discrete cost: W is the total variation distance.
    discrete = dynamics.label_wasserstein(predicted, target, dynamics.label_cost(3))
    assert discrete == pytest.approx(0.5 * np.abs(predicted - target).sum(1), abs=1e-9)
    # Ordinal cost |k - k'|: W_1 is the L1 distance of the cumulative histograms.
    ordinal = dynamics.label_wasserstein(predicted, target, dynamics.label_cost(3, kind="ordinal"))
    cumulative = np.abs(np.cumsum(predicted - target, axis=1)).sum(1)
    assert ordinal == pytest.approx(cumulative, abs=1e-9)
    assert ordinal[1] == pytest.approx(2.0)  # all mass moves from label 0 to label 2


def test_layer_label_distances_average_over_samples_per_layer() -> None:
    target = np.eye(3)[[0, 1, 2, 0]]
    blurred = 0.5 * target + 0.5 / 3
    layers = [np.full((4, 3), 1 / 3), blurred, target]
    curve = dynamics.layer_label_distances(layers, target, dynamics.label_cost(3))
    assert curve == pytest.approx([2 / 3, 1 / 3, 0.0], abs=1e-9)


def test_probe_on_the_last_block_reads_the_network_prediction() -> None:
    torch.manual_seed(0)
    model = get_model("resnet9_mnist", width=4, depth=2, hidden=8).eval()
    x = torch.rand(5, 1, 28, 28)
    uniform = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 14 * 14, 10))
    with torch.no_grad():
        uniform[1].weight.zero_()
        uniform[1].bias.zero_()
    first, last = dynamics.probe_predictions(model, x, [uniform, model.head])
    np.testing.assert_allclose(first, np.full((5, 10), 0.1))
    with torch.no_grad():
        expected = torch.softmax(model(x), dim=1).double().numpy()
    np.testing.assert_allclose(last, expected, rtol=1e-6)
    target = np.eye(10)[expected.argmax(1)]
    curve = dynamics.layer_label_distances([first, last], target, dynamics.label_cost(10))
    assert curve[0] == pytest.approx(0.9) and curve[1] < curve[0]
    with pytest.raises(InputError, match="one probe per block"):
        dynamics.probe_predictions(model, x, [model.head])


def test_label_histograms_must_be_probabilities() -> None:
    with pytest.raises(InputError, match="probability"):
        dynamics.label_wasserstein(np.array([0.5, 0.6]), np.array([0.5, 0.5]), np.ones((2, 2)))


# ---- seed 004: internal covariate shift --------------------------------------------------------
def test_internal_covariate_shift_of_a_shifted_layer_output() -> None:
    outputs = np.random.default_rng(5).normal(size=(30, 2, 3))
    assert dynamics.internal_covariate_shift(outputs, outputs) == 0.0
    shift = np.full((2, 3), 0.5)
    assert dynamics.internal_covariate_shift(outputs, outputs + shift) == pytest.approx(
        np.linalg.norm(shift)
    )


def test_layer_covariate_shift_between_two_snapshots() -> None:
    torch.manual_seed(0)
    before = get_model("resnet9_mnist", width=4, depth=2, hidden=8).eval()
    after = get_model("resnet9_mnist", width=4, depth=2, hidden=8).eval()
    after.load_state_dict(before.state_dict())
    x = torch.rand(12, 1, 28, 28)
    assert dynamics.layer_covariate_shift(before, after, x, "blocks.1") == 0.0
    # Moving the last BN's bias by b moves every output of the block by exactly b per pixel.
    with torch.no_grad():
        after.blocks[1].branch[4].bias += 0.25
    side = 14 * 14 * 4
    assert dynamics.layer_covariate_shift(before, after, x, "blocks.1") == pytest.approx(
        0.25 * np.sqrt(side), rel=1e-5
    )


# ---- tapped networks --------------------------------------------------------------------------
def test_block_states_follow_the_blocks_by_hand() -> None:
    torch.manual_seed(0)
    model = get_model("resnet9_mnist", width=4, depth=3, hidden=8).eval()
    x = torch.rand(5, 1, 28, 28)
    states = dynamics.block_states(model, x)
    with torch.no_grad():
        state = model.stem(model.normalize(x))
        expected = [state]
        for block in model.blocks:
            state = block(state)
            expected.append(state)
    assert len(states) == 4
    for got, want in zip(states, expected, strict=True):
        np.testing.assert_allclose(got, want.flatten(1).double().numpy(), rtol=1e-6)


def test_network_line_shape_equals_the_detector_feature() -> None:
    torch.manual_seed(0)
    model = get_model("resnet9_mnist", width=4, depth=4, hidden=8).eval()
    x = torch.rand(6, 1, 28, 28)
    (lss,) = dynamics.network_line_shape(model, x)
    with (
        torch.no_grad(),
        TransportFeatureExtractor(model, FeatureSpec(line_shape=True)) as extractor,
    ):
        model(x)
        features = extractor.features()
    column = extractor.feature_names.index(LINE_SHAPE)
    np.testing.assert_allclose(lss, features[:, column].double().numpy(), rtol=1e-4)
    assert np.all(lss >= 1.0)


def test_data_tracks_split_at_shape_changes() -> None:
    torch.manual_seed(0)
    model = get_model("resnet110", depth=8, base_width=4).eval()  # 3 stages of 1 block
    tracks = dynamics.data_tracks(model, torch.rand(3, 3, 32, 32))
    # Stage 0 keeps its shape (input + 1 output); the downsampling blocks each start a new stage
    # with a single state, which is no track.
    assert [t.shape[:2] for t in tracks] == [(3, 2)]
    scores = dynamics.network_transport_score(model, torch.rand(8, 3, 32, 32))
    assert len(scores) == 1 and 0.0 <= scores[0] <= 1.0


def test_dirac_target_matches_the_linear_programme() -> None:
    rng = np.random.default_rng(7)
    predicted = rng.dirichlet(np.ones(4), size=6)
    labels = np.array([0, 3, 1, 2, 2, 0])
    for kind in ("discrete", "ordinal"):
        cost = dynamics.label_cost(4, kind=kind)
        exact = dynamics.label_wasserstein(predicted, np.eye(4)[labels], cost)
        assert dynamics.dirac_label_wasserstein(predicted, labels, cost) == pytest.approx(exact)
    discrete = dynamics.dirac_label_wasserstein(predicted, labels, dynamics.label_cost(4))
    assert discrete == pytest.approx(1 - predicted[np.arange(6), labels])


def test_assignment_on_wide_samples_matches_the_distance_matrix() -> None:
    # The p = 2 cost is computed by a matrix product; the matching must equal cdist's.
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist

    rng = np.random.default_rng(8)
    x, y = rng.normal(size=(40, 500)), rng.normal(size=(40, 500)) + 3.0
    _, expected = linear_sum_assignment(cdist(x, y) ** 2)
    assert np.array_equal(dynamics.optimal_assignment(x, y), expected)
