"""`lapguard diagnose`: per-block curves against known answers, then a tiny real run directory."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from detector import artefacts
from training.attacks.sets import attack_run
from training.cli.main import main as cli_main
from training.diagnostics import diagnose
from training.reporting.report import dynamics_section, refresh_report
from training.rundir import NETWORKS_FIGURE, RunDir
from training.trainer.config import TrainConfig
from training.trainer.loop import train
from training.trainer.probes import fit_linear_probe

TINY = {"width": 4, "depth": 3, "hidden": 8}
OPTIONS = diagnose.DiagnoseOptions(n=40, probe_n=200, ots_n=30, attacks=True, batch_size=64)


# ---- the curves on arrays ----------------------------------------------------------------------
def test_cumulative_line_shape_of_straight_and_bent_tracks() -> None:
    direction = np.array([[1.0, 2.0, -1.0]], dtype=np.float32)
    straight = [direction * t for t in (0.0, 1.0, 1.5, 4.0)]
    lss, lsr = diagnose.cumulative_line_shape(straight)
    assert lss.shape == (1, 3)
    np.testing.assert_allclose(lss, 1.0, rtol=1e-6)
    np.testing.assert_allclose(lsr, 1.0, rtol=1e-6)
    # Two unit steps at a right angle: LSS(x_0..x_2) = 2 / sqrt(2); back along x: LSR 3.
    bent = [np.array([[0.0, 0.0]]), np.array([[1.0, 0.0]]), np.array([[1.0, 1.0]])]
    lss, _ = diagnose.cumulative_line_shape(bent)
    assert lss[0] == pytest.approx([1.0, np.sqrt(2)])
    _, lsr = diagnose.cumulative_line_shape(
        [np.array([[0.0]]), np.array([[2.0]]), np.array([[1.0]])]
    )
    assert lsr[0] == pytest.approx([1.0, 3.0])


def test_a_shape_change_starts_a_new_stage() -> None:
    states = [np.zeros((2, 3)), np.ones((2, 3)), np.ones((2, 5)), 2 * np.ones((2, 5))]
    lss, lsr = diagnose.cumulative_line_shape(states)
    assert np.isnan(lss[:, 1]).all() and np.isnan(lsr[:, 1]).all()
    np.testing.assert_allclose(lss[:, [0, 2]], 1.0)
    per_block, per_stage = diagnose.block_transport_scores(states, 2)
    assert per_block[1] is None and len(per_stage) == 2


def test_block_transport_scores_of_optimal_and_reversing_maps() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(25, 4))
    # x -> 2x + b is the gradient of a convex function: the optimal map (OTS 1) at every step.
    states = [x, 2 * x + 1.0, 4 * x + 3.0]
    per_block, per_stage = diagnose.block_transport_scores(states, 25)
    assert per_block == [1.0, 1.0] and per_stage == [1.0]
    line = np.linspace(-1, 1, 11)[:, None]
    per_block, _ = diagnose.block_transport_scores([line, -line], 11)
    assert per_block == [pytest.approx(1 / 11)]
    # Only the first n samples enter the assignment.
    assert diagnose.block_transport_scores([line, -line], 3)[0] == [pytest.approx(1 / 3)]


def test_linear_probe_separates_separable_classes_deterministically() -> None:
    rng = np.random.default_rng(1)
    labels = torch.from_numpy(rng.integers(0, 3, 150))
    features = torch.from_numpy(rng.normal(size=(150, 5))) * 0.1
    features[:, 0] += 5.0 * labels  # the class is read off feature 0, on a large offset
    first = fit_linear_probe(features.float(), labels, 3)
    second = fit_linear_probe(features.float(), labels, 3)
    predicted = first(features.float()).argmax(1)
    assert (predicted == labels).float().mean().item() == 1.0
    assert torch.equal(first.weight, second.weight)


def test_separation_is_the_auroc_of_the_score() -> None:
    assert diagnose.separation(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 1.0
    assert diagnose.separation(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 0.0
    assert diagnose.separation(np.array([np.nan]), np.array([1.0])) is None


# ---- a tiny real run -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """models/a (trained for one short epoch) and one cached FGM set of 40 test images."""
    run = tmp_path_factory.mktemp("diagnose") / "run"
    config = TrainConfig(
        name="tiny",
        arguments=TINY,
        epochs=1,
        batch_size=64,
        train_subset=600,
        test_subset=100,
        grad_clip=5.0,
        device="cpu",
    )
    train(config, RunDir(run).model("a"), root=data_root, progress=False)
    attack_run(run, "fgm", {"eps": 0.1}, n=40, root=data_root, progress=False, device="cpu")
    return run


@pytest.fixture(scope="module")
def diagnosed(tiny_run: Path, data_root: Path) -> dict:
    return diagnose.diagnose_run(tiny_run, options=OPTIONS, root=data_root, progress=False)


def test_every_measure_has_one_value_per_block_or_layer(diagnosed: dict) -> None:
    net = diagnosed["networks"]["a"]
    assert net["blocks"] == TINY["depth"]
    assert set(net["sets"]) == {"clean", "fgm-eps0.1"}
    clean = net["sets"]["clean"]
    assert clean["n"] == 40 and clean["ots_n"] == 30
    assert len(clean["lss_block"]) == len(clean["ots_block"]) == TINY["depth"]
    # stem + every block + the network's head
    assert len(clean["w_layers"]) == len(clean["probe_accuracy"]) == TINY["depth"] + 2
    assert clean["lss_block"][0] == pytest.approx(1.0)  # one step is always a straight line
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(clean["lss_block"]))  # m / ||S_m||
    assert all(0.0 <= w <= 1.0 for w in clean["w_layers"])
    assert clean["probe_accuracy"][-1] == pytest.approx(clean["accuracy"])
    attacked = net["sets"]["fgm-eps0.1"]
    assert 0.0 <= attacked["lss_auroc_vs_clean"] <= 1.0
    assert "lss_auroc_vs_clean" not in clean


def test_the_head_layer_reads_the_network_prediction(diagnosed: dict, tiny_run: Path) -> None:
    from detector import networks
    from training.data.network_images import attack_images

    x, y, _ = attack_images(RunDir(tiny_run).model("a"), n=40, seed=0)
    with torch.no_grad():
        probs = torch.softmax(networks.load(RunDir(tiny_run).model("a"))(torch.from_numpy(x)), 1)
    expected = float(np.mean(1.0 - probs.numpy()[np.arange(40), y]))
    clean = diagnosed["networks"]["a"]["sets"]["clean"]
    assert clean["w_layers"][-1] == pytest.approx(expected, rel=1e-5)


def test_diagnostics_are_cached_and_refreshed_when_inputs_change(
    diagnosed: dict, tiny_run: Path, data_root: Path
) -> None:
    path = RunDir(tiny_run).diagnostics_file
    stamp = path.stat().st_mtime_ns
    again = diagnose.diagnose_run(tiny_run, options=OPTIONS, root=data_root, progress=False)
    assert again == json.loads(path.read_text()) and path.stat().st_mtime_ns == stamp
    fewer = diagnose.DiagnoseOptions(n=20, probe_n=200, ots_n=20, batch_size=64)
    changed = diagnose.diagnose_run(tiny_run, options=fewer, root=data_root, progress=False)
    assert changed["networks"]["a"]["sets"]["clean"]["n"] == 20
    assert set(changed["networks"]["a"]["sets"]) == {"clean"}
    assert (RunDir(tiny_run).figures / NETWORKS_FIGURE).is_file()
    # no results.json: the run's report is the dynamics section alone
    assert refresh_report(tiny_run) == RunDir(tiny_run).report_file
    assert "## Network dynamics" in RunDir(tiny_run).report_file.read_text()
    artefacts.write_json(path, diagnosed)  # leave the module's diagnosis in place


def test_report_section_shows_the_table_claims_and_figures(diagnosed: dict, tiny_run: Path) -> None:
    run = RunDir(tiny_run)
    claims = [
        {"claim": "tracks are line-shaped", "seed": "001", "measured": "LSS 2.4", "holds": False}
    ]
    artefacts.write_json(run.diagnostics_file, {**diagnosed, "claims": claims})
    diagnose.dynamics_figures(diagnosed, run.figures)
    text = "\n".join(dynamics_section(tiny_run))
    assert "## Network dynamics" in text and "| a " in text and "fgm-eps0.1" in text
    assert re.search(r"\| tracks are line-shaped \| 001 +\| LSS 2.4 +\| does not hold \|", text)
    assert "figures/dynamics_attacks.png" in text
    artefacts.write_json(run.diagnostics_file, diagnosed)


def test_cli_prints_the_table_and_refuses_a_run_without_networks(
    diagnosed: dict, tiny_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The module's diagnosis is cached under other options: this call computes n=20 afresh.
    code = cli_main(["diagnose", "--run", str(tiny_run), "--n", "20", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and re.search(r"^a\s+clean\s+20\s", out, re.MULTILINE)
    assert cli_main(["diagnose", "--run", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "no trained network" in capsys.readouterr().err
