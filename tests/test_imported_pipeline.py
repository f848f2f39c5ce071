"""`lapguard pipeline --network DIR`: the user's own torchvision network, imported, goes through
the smoke preset's steps without training (the data set's 28x28 grey images through its 3x32x32
input spec) to a bundle a live server answers with; a network the run cannot use is refused in
one line before anything is written."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer

from detector.artefacts import read_json
from detector.guard import Guard
from tests.live_server import LiveServer
from tests.service_helpers import API_KEY, encode, expected, server_settings
from tests.test_import import CASES, VIT, VIT_ARGS, _save
from training.cli.main import main

pytestmark = pytest.mark.slow


def _pipeline(network: Path, out: Path, root: Path) -> int:
    command = ["pipeline", "--preset", "smoke", "--network", str(network), "--out", str(out)]
    return main([*command, "--root", str(root), "--no-progress"])


def _imported(case: str, fmt: str, folder: Path) -> Path:
    """The user's network ``case`` saved as ``fmt`` and imported with the CLI into ``folder``
    (torchvision's ViT starts with an all-zero head, whose input gradient an attack cannot
    follow: it gets the random head a little training would give it)."""
    build, arch, extra, _ = CASES[case]
    model = build()
    if case == "vit":
        torch.manual_seed(1)
        nn.init.normal_(model.heads.head.weight, std=0.1)
    weights = _save(model, folder / "user", fmt)
    command = ["import", arch, "--weights", str(weights), "--out", str(folder / "net")]
    assert main([*command, "--input-size", "32", *extra]) == 0
    return folder / "net"


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    folder = tmp_path_factory.mktemp("resnet18")
    assert _pipeline(_imported("resnet18", "safetensors", folder), folder / "run", data_root) == 0
    return folder / "run"


def test_an_imported_resnet_reaches_a_bundle_without_training(resnet_run: Path) -> None:
    results = read_json(resnet_run / "results.json")
    row = results["models"]["network"]
    assert set(results["models"]) == {"network"} and row["source"].endswith("net")
    assert 0 <= row["test_accuracy"] <= 1 and row["test_images"] == 600
    assert not (resnet_run / "models" / "network" / "metrics.jsonl").exists()  # not trained
    assert results["attacks"]["network"]["fgm-eps0.1"]["n"] == 600
    manifest = read_json(resnet_run / "bundle" / "manifest.json")
    assert manifest["network"]["architecture"] == "torchvision:resnet18"
    assert manifest["network"]["input_spec"]["channels"] == 3
    assert manifest.get("second_network") is None  # the run had no other network to ask
    assert "| imported |" in (resnet_run / "report.md").read_text()
    costs = read_json(resnet_run / "feature_costs.json")  # both one-pass candidates, measured
    assert set(costs) == {"residues", "residues+head"} and all(c > 0 for c in costs.values())


def test_a_live_server_answers_with_the_imported_bundle(resnet_run: Path) -> None:
    """A 28x28 grey PNG (the data set's kind of image) goes through the bundle's 3x32x32 spec,
    with the scores the bundle's own Guard gives it."""
    pixels = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    blob = encode(pixels)
    with LiveServer(server_settings(resnet_run / "bundle")) as live:
        answer = httpx.post(
            f"{live.url}/v1/predict",
            files=[("files", ("a.png", blob, "image/png"))],
            headers={"X-API-Key": API_KEY},
            timeout=60,
        )
        model = httpx.get(f"{live.url}/v1/model", headers={"X-API-Key": API_KEY}).json()
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"]["name"] == "lapguard-smoke-network"
    cost = read_json(resnet_run / "bundle" / "manifest.json")["cost"]
    assert model["cost"] == cost and cost["budget"] == 1.1 and cost["batch_size"] == 32
    assert cost["ratio"] > 0 and cost["device"] == "cpu"
    [served] = answer.json()["results"]
    reference = expected(Guard.from_bundle(resnet_run / "bundle", device="cpu"), [blob])
    assert served["label"] == int(reference.labels[0])
    assert served["score"] == pytest.approx(float(reference.scores[0]), abs=1e-5)


def test_the_same_command_resumes_and_another_network_is_refused(
    resnet_run: Path, data_root: Path, tmp_path: Path, capsys
) -> None:
    record = resnet_run / "models" / "network" / "imported.json"
    imported = record.stat().st_mtime_ns
    source = Path(read_json(resnet_run / "results.json")["models"]["network"]["source"])
    assert _pipeline(source, resnet_run, data_root) == 0  # finished: the import is not redone
    assert record.stat().st_mtime_ns == imported
    other = _imported("vit", "pt", tmp_path)
    capsys.readouterr()
    assert _pipeline(other, resnet_run, data_root) == 2
    assert "holds a run of another pipeline config" in capsys.readouterr().err


def test_an_imported_vit_from_a_state_dict_is_scored_by_its_bundle(
    data_root: Path, tmp_path: Path
) -> None:
    assert _pipeline(_imported("vit", "pt", tmp_path), tmp_path / "run", data_root) == 0
    guard = Guard.from_bundle(tmp_path / "run" / "bundle", device="cpu")
    grey = np.random.default_rng(1).random((4, 28, 28), dtype=np.float32)
    answer = guard.predict_images(list(grey))
    assert len(answer.scores) == 4 and np.isfinite(answer.scores).all()


@pytest.mark.parametrize("problem", ["missing", "classes"])
def test_a_network_the_run_cannot_use_is_one_line_and_writes_nothing(
    problem: str, data_root: Path, tmp_path: Path, capsys
) -> None:
    network = tmp_path / "nothing"
    expected = "make one with `lapguard import`"
    if problem == "classes":
        four = VisionTransformer(**VIT, mlp_dim=64, num_classes=4)
        weights = _save(four, tmp_path / "user", "safetensors")
        command = ["import", "torchvision:VisionTransformer", "--weights", str(weights)]
        command += ["--out", str(tmp_path / "net"), *VIT_ARGS, "--arg=num_classes=4"]
        assert main(command) == 0
        network, expected = tmp_path / "net", "has 4 classes, fashion-mnist has 10"
    capsys.readouterr()
    assert _pipeline(network, tmp_path / "run", data_root) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and expected in error
    assert not (tmp_path / "run").exists()


def test_an_imported_network_holds_back_test_images_for_its_calibration(
    resnet_run: Path, data_root: Path, tmp_path: Path
) -> None:
    """Its training images are unknown, so the ood_n test images after those the attacks use are
    its held-back ones: quick's 10,000-image FGM set leaves 1,000 of Fashion-MNIST's 10,000."""
    from training.evaluation.context import PipelineRun, validation_images
    from training.presets.pipelines import get_pipeline_preset

    quick = get_pipeline_preset("quick").on_network(resnet_run / "models" / "network")
    run = PipelineRun(quick, tmp_path / "run", root=data_root)
    assert run.test_count("network") == 9000
    smoke = PipelineRun.open(resnet_run, root=data_root)
    held_back = validation_images(smoke, "network")
    assert held_back.shape == (200, 3, 32, 32) and smoke.test_count("network") == 600
