"""Adaptive attacks on a tiny seeded network: valid images within budget, the evasion metric by
hand, the distilled surrogate against its detector, the random detector pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.calibration import Calibration
from detector.features import extract_features
from detector.forest import TransportDetector
from detector.networks import InputSpec, NetworkConfig, build_network
from tests.service_helpers import synthetic_images
from training.adaptive.attacks import (
    Attacker,
    get_adaptive_spec,
    list_adaptive_attacks,
    matched_features,
    run_adaptive,
)
from training.adaptive.experiment import evasion_metrics, perturbation_metrics
from training.adaptive.surrogate import agreement, distill
from training.adaptive.target import DetectorPool, TargetSpec, assemble_target
from training.attacks.registry import generate
from training.data.datasets import FASHION_CLASSES

N_FIT = 120


@pytest.fixture(scope="module")
def network() -> torch.nn.Module:
    """The conftest's tiny network, built once for the module (the system fixture is costly)."""
    torch.manual_seed(0)
    config = NetworkConfig(
        architecture="resnet9_mnist",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        class_names=list(FASHION_CLASSES),
        input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.2860], std=[0.3530]),
    )
    return build_network(config).eval()


@pytest.fixture(scope="module")
def system(network: torch.nn.Module) -> dict:
    """A TR detector fitted on clean blobs vs their FGM images against the tiny network, and
    its target (calibrated at 10% FPR on held-out clean blobs)."""
    tiny_network = network
    x = synthetic_images(N_FIT + 40, seed=1)
    with torch.no_grad():
        y = tiny_network(torch.from_numpy(x)).argmax(1).numpy()
    x_adv = generate(tiny_network, x, y, "fgm", {"eps": 0.1}, progress=False)
    f_clean, logits_clean = extract_features(tiny_network, x)
    f_adv, logits_adv = extract_features(tiny_network, x_adv)
    fit = slice(0, N_FIT)
    detector = TransportDetector(n_estimators=10, min_class_samples=5).fit(
        np.concatenate([f_clean[fit], f_adv[fit]]),
        np.r_[np.zeros(N_FIT), np.ones(N_FIT)].astype(int),
        np.concatenate([logits_clean[fit].argmax(1), logits_adv[fit].argmax(1)]),
    )
    held = slice(N_FIT, None)
    calibration = Calibration.from_scores(
        detector.score(f_clean[held], logits_clean[held].argmax(1)), 0.1
    )
    target = assemble_target(tiny_network, TargetSpec(), [detector], [calibration])
    features = np.concatenate([f_clean[fit], f_adv[fit]])
    predicted = np.concatenate([logits_clean[fit].argmax(1), logits_adv[fit].argmax(1)])
    margins = detector.score(features, predicted) - calibration.threshold
    attacker = Attacker(
        tiny_network,
        target,
        x[fit],
        f_clean[fit],
        logits_clean[fit].argmax(1),
        surrogate=distill(features, predicted, margins, 10, epochs=300),
    )
    return {
        "x": x[held][:4],
        "x_adv": x_adv[held][:4],
        "y": y[held][:4],
        "attacker": attacker,
        "fit": (features, predicted, margins),
        "detector": detector,
    }


FAST = {
    "system-hsj": {"max_iter": 2, "max_eval": 40, "init_eval": 10},
    "feature-match": {"hsj_max_iter": 2, "hsj_max_eval": 40, "c1": [1.0, 10.0], "lbfgs_iter": 5},
    "surrogate-pgd": {"eps": 0.03, "steps": 5},
    "surrogate-opgd": {"eps": 0.1, "steps": 5},
}


def test_registry_holds_the_three_attacks_with_the_seeds_budgets() -> None:
    assert set(list_adaptive_attacks()) == set(FAST)
    hsj = get_adaptive_spec("system-hsj").make_params()
    assert (hsj.max_iter, hsj.max_eval) == (50, 10000)  # type: ignore[attr-defined]
    assert get_adaptive_spec("surrogate-opgd").make_params().orthogonal  # type: ignore[attr-defined]


@pytest.mark.parametrize("attack", sorted(FAST))
def test_adaptive_attacks_return_valid_images_within_budget(system: dict, attack: str) -> None:
    x, x_start, y = system["x"], system["x_adv"], system["y"]
    out = run_adaptive(attack, system["attacker"], x, x_start, y, FAST[attack], seed=0)
    assert out.shape == x.shape and out.dtype == np.float32
    assert np.isfinite(out).all() and out.min() >= 0.0 and out.max() <= 1.0
    eps = FAST[attack].get("eps")
    if eps is not None:
        assert np.abs(out - x).max() <= eps + 1e-6
    again = run_adaptive(attack, system["attacker"], x, x_start, y, FAST[attack], seed=0)
    if attack.startswith("surrogate"):  # deterministic given the seed
        np.testing.assert_array_equal(out, again)


@pytest.mark.parametrize("init", ["nearest-clean", "random"])
def test_system_hsj_returns_the_start_or_an_image_the_system_passes(
    system: dict, init: str
) -> None:
    """HopSkipJump on the system only moves along images the system answers with the start's
    network label unflagged; where it finds no such start (the seed's noise draws are all
    flagged), the detected start comes back unchanged."""
    a, x, x_start, y = system["attacker"], system["x"], system["x_adv"], system["y"]
    out = run_adaptive("system-hsj", a, x, x_start, y, {**FAST["system-hsj"], "init": init})
    wanted = a.target.flagged(x_start)[0]
    labels, flagged = a.target.flagged(out)
    moved = np.abs(out - x_start).reshape(len(x), -1).max(axis=1) > 1e-6
    assert ((labels == wanted) & ~flagged)[moved].all()
    assert (np.abs(out - x_start)[~moved] <= 1e-6).all()


def test_feature_matching_also_matches_the_penultimate_embedding_of_its_clean_start(
    system: dict,
) -> None:
    """Against a detector that does not read the penultimate embedding, eq. (42) matches the
    target's columns as they are, followed by the embedding of the clean reference row
    HopSkipJump started from (a row without one keeps its own); 'none' matches the target's
    columns only."""
    a, x_start = system["attacker"], system["x_adv"]
    z, _ = a.features(x_start)
    starts = np.array([0, 5, -1, 7])
    matched = matched_features(a, x_start, z, starts, "penultimate")
    width = a.reference_embedding().shape[1]
    assert matched.spec.penultimate == width and not a.target.features.penultimate
    assert matched.z_star.shape == (len(z), z.shape[1] + width) == (len(z), len(matched.scale))
    np.testing.assert_array_equal(matched.z_star[:, : z.shape[1]], z)
    embedding = matched.z_star[:, z.shape[1] :]
    np.testing.assert_allclose(embedding[[0, 1, 3]], a.reference_embedding()[[0, 5, 7]])
    own = a.features(x_start, matched.spec)[0]
    np.testing.assert_allclose(own[:, : z.shape[1]], z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(embedding[2], own[2, z.shape[1] :])
    plain = matched_features(a, x_start, z, starts, "none")
    assert plain.spec == a.target.features and plain.z_star is z


def test_evasion_metric_by_hand() -> None:
    y = np.array([0, 0, 0, 0, 0])
    # starts: rows 0-2 successful and flagged (the pool), row 3 successful unflagged, row 4 failed
    start = (np.array([1, 1, 1, 1, 0]), np.array([True, True, True, False, True]))
    attacked = np.array([True, True, False, False, False])  # limit: only rows 0 and 1 attacked
    # finals: row 0 evades, row 1 still flagged, row 2 (not attacked) keeps its flagged start
    final = (np.array([1, 1, 1, 1, 0]), np.array([False, True, True, False, True]))
    m = evasion_metrics(y, start, final, attacked)
    assert (m["n_detected_successful"], m["n_attacked"], m["n_evaded"]) == (3, 2, 1)
    assert m["evasion_rate"] == 0.5
    assert m["start_detection_rate"] == 0.75  # 3 of 4 successful starts flagged
    assert m["final_detection_rate"] == pytest.approx(1 / 3)  # rows 0, 1, 3 covered + successful
    p = perturbation_metrics(np.zeros((2, 1, 2, 2)), np.array([[[[0.0, 0.3], [0.4, 0]]]] * 2))
    assert p["median_l2"] == pytest.approx(0.5) and p["mean_linf"] == pytest.approx(0.4)


def test_surrogate_agrees_with_the_detector_it_imitates(system: dict) -> None:
    features, predicted, margins = system["fit"]
    surrogate = system["attacker"].surrogate
    assert agreement(surrogate, features, predicted, margins) >= 0.85


def test_random_pool_draws_different_members_and_flags_at_each_threshold(
    system: dict, network: torch.nn.Module
) -> None:
    features, predicted, _ = system["fit"]
    members = [system["detector"], TransportDetector(n_estimators=10, random_state=7)]
    members[1].fit(features, np.r_[np.zeros(N_FIT), np.ones(N_FIT)].astype(int), predicted)
    calibrations = [
        Calibration.from_scores(m.score(features[:N_FIT], predicted[:N_FIT]), 0.1) for m in members
    ]
    assert all(c.achieved_fpr <= 0.1 for c in calibrations)
    pool = DetectorPool([m.to_torch() for m in members], [c.threshold for c in calibrations])
    drawn = pool.draw(200)
    assert set(drawn.tolist()) == {0, 1}
    f, p = torch.from_numpy(features), torch.from_numpy(predicted)
    with torch.no_grad():
        margins, answer = pool.margins(f, p), pool(f, p)
    assert torch.isclose(answer[:, None], margins).any(dim=1).all()  # each answer is a member's
    target = assemble_target(network, TargetSpec(members=2), members, calibrations)
    labels, flagged = target.flagged(system["x"])
    assert labels.shape == flagged.shape == (4,)
    assert target.guard.threshold == 0.0


def test_report_section_shows_each_row(tmp_path) -> None:
    from training.reporting.adaptive import adaptive_section

    row = {
        "model": "lap", "target": "transport", "attack": "surrogate-pgd",
        "budget": "Linf eps=0.03, 100 steps", "n_start": 200, "n_detected_successful": 50,
        "n_attacked": 50, "evasion_rate": 0.1, "start_detection_rate": 0.8,
        "final_detection_rate": 0.7, "median_l2": 1.2, "median_linf": 0.03,
        "seconds_per_image": 0.5, "surrogate_agreement": 0.9,
    }  # fmt: skip
    pooled = {**row, "target": "transport-pool5", "evasion_rate": 0.05, "start_median_l2": 0.9}
    rows = [row, pooled, {**row, "model": "vanilla", "evasion_rate": None}]
    assert "Which part" not in "\n".join(adaptive_section({"adaptive": rows}))
    parts = {"forests": [0.893, 0.728], "family cw-batched": [0.953, 0.769]}
    ensemble = {**row, "target": "ensemble", "attack": "feature-match", "parts": parts}
    with_parts = "\n".join(adaptive_section({"adaptive": [*rows, ensemble]}))
    part_rows = [line for line in with_parts.splitlines() if line.startswith("| LAP ensemble")]
    assert len(part_rows) == 1 and "89.3 → 72.8" in part_rows[0] and "95.3 → 76.9" in with_parts
    lines = adaptive_section({"adaptive": rows}, tmp_path)
    table = "\n".join(lines)
    assert lines[0] == "## Adaptive attacks"
    assert "| LAP " in table and "| VAN " in table and "10.0" in table and "90.0%" in table

    # the comparison: one row for the attack, the single detector beside the pool, per network
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    tables = [t for t in table.splitlines() if t.startswith(("| Attack", "| surrogate"))]
    assert cells(tables[0]) == [
        "Attack", "Budget", "VAN transport (%)", "LAP transport (%)", "LAP transport-pool5 (%)"
    ]  # fmt: skip
    assert cells(tables[1]) == ["surrogate-pgd", "Linf eps=0.03, 100 steps", "-", "10.0", "5.0"]
    assert (tmp_path / "figures" / "adaptive_evasion.png").stat().st_size > 1000
    assert "0.900" in table  # the start images' median L2
    assert adaptive_section({}) == []


def test_rows_are_collected_from_the_run_directory(tmp_path) -> None:
    from detector.artefacts import write_json
    from training.rundir import RunDir

    run = RunDir(tmp_path)
    for target in ("transport", "transport-pool5"):
        write_json(run.adaptive("lap") / target / "surrogate-pgd-abc" / "row.json", {"t": target})
    assert [r["t"] for r in run.adaptive_rows()] == ["transport", "transport-pool5"]


def test_an_attacker_of_a_second_opinion_target_reads_and_differentiates_both_networks(
    network: torch.nn.Module,
) -> None:
    """With features holding a second network's opinion, the target's Guard runs both networks
    and the attacker's forward pass gives the very features the Guard scores, with a gradient
    that reaches the input through the second network."""
    import copy

    from detector.features import FeatureSpec
    from detector.quantile import QuantileDetector

    second = copy.deepcopy(network)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    spec = FeatureSpec(head=True, second=True)
    x = synthetic_images(40, seed=3)
    features, logits = extract_features(network, x, spec=spec, second=second)
    detector = QuantileDetector(fpr=0.1).fit(features, feature_names=spec.names(2))
    calibration = Calibration.from_scores(detector.score(features), 0.1)
    target = assemble_target(network, TargetSpec(), [detector], [calibration], spec, second=second)
    assert target.guard.second is second
    attacker = Attacker(network, target, x, features, logits.argmax(1))
    seen, predicted = attacker.features(x[:6])
    np.testing.assert_allclose(seen, features[:6], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        target.guard.predict(x[:6]).scores, detector.score(seen, predicted), atol=1e-6
    )
    images = torch.from_numpy(x[:6]).requires_grad_(True)
    _, graph = attacker.forward(images)
    (gradient,) = torch.autograd.grad(graph[:, -2].sum(), images)  # second_log_prob
    assert gradient.abs().sum() > 0
