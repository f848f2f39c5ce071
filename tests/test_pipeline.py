"""End to end: `lapguard pipeline --preset smoke` writes a valid results.json, report and bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from detector.guard import Guard
from detector.metrics import auroc
from tests.conftest import run_smoke_pipeline
from training.cli.main import main as cli_main
from training.evaluation.context import PipelineRun

pytestmark = pytest.mark.slow

# The keys of a detection row in results.json, as DESIGN.md's example row shows them.
DETECTION_ROW_KEYS = {
    *("model", "detector", "setting", "train_attack", "test_attack"),
    *("accuracy", "auroc", "tpr", "fpr", "fpr_at_95_tpr", "successful_attack_detection_rate"),
    *("runs", "accuracy_std"),
}


def test_results_json_follows_the_design_contract(smoke_run) -> None:
    results = json.loads((smoke_run / "results.json").read_text())
    assert results["preset"] == "smoke" and results["dataset"] == "fashion-mnist"
    for name in ("vanilla", "lap"):
        model = results["models"][name]
        assert (
            0.5 < model["test_accuracy"] <= 1
            and model["epochs"] == 1
            and model["train_seconds"] > 0
        )
        fgm = results["attacks"][name]["fgm-eps0.1"]
        assert fgm["n"] == 600 and 0 <= fgm["success_rate"] <= 1 and fgm["seconds"] > 0
        assert fgm["unperturbed"] == 0  # FGM moves every image
    assert (
        results["models"]["lap"]["transport_cost"] < results["models"]["vanilla"]["transport_cost"]
    )
    rows = results["detection"]
    assert {(r["model"], r["detector"]) for r in rows} == {
        (m, d)
        for m in ("vanilla", "lap")
        for d in ("transport", "ensemble", "mahalanobis", "quantile")
    }
    for row in rows:
        assert set(row) >= DETECTION_ROW_KEYS and row["runs"] == 2 and 0 <= row["accuracy"] <= 1
    seen_transport = [r for r in rows if r["detector"] == "transport" and r["setting"] == "seen"]
    assert all(
        r["auroc"] > 0.75 for r in seen_transport
    )  # FGM ε=0.1 is clearly detectable even on a tiny network
    ood_keys = {"model", "detector", "train_set", "test_set", "accuracy", "auroc", "fpr_at_95_tpr"}
    assert {r["test_set"] for r in results["ood"]} == {"digits", "noise"}
    # the seed's two OOD experiments: trained on an attack, and on synthetic outliers of each
    # network's own validation images
    assert {(r["model"], r["train_set"]) for r in results["ood"]} == {
        (m, t) for m in ("vanilla", "lap") for t in ("fgm-eps0.1", "synthetic")
    }
    assert all(ood_keys <= set(r) for r in results["ood"])
    timing = results["timing"]["feature_extraction_seconds"]
    assert timing["transport"] > 0 and timing["mahalanobis"] > 0


def test_the_evaluation_gives_the_protocols_the_runs_ood_clean_ratio(
    smoke_run, data_root, tmp_path, monkeypatch
) -> None:
    """A run whose config asks for every clean training image in the OOD protocol evaluates
    with that rule (the protocols themselves are tested in test_experiments.py)."""
    import training.evaluation.evaluate as evaluation

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    (run / "evaluation.json").unlink()
    config = json.loads((run / "pipeline_config.json").read_text())
    assert config["ood_clean_ratio"] == 1.0
    (run / "pipeline_config.json").write_text(json.dumps({**config, "ood_clean_ratio": None}))
    asked: list[float | None] = []

    class Asked(Exception):
        """The rule is all this test needs: no protocol runs."""

    def stop(**kwargs):
        asked.append(kwargs["ood_clean_ratio"])
        raise Asked

    monkeypatch.setattr(evaluation, "run_protocols", stop)
    with pytest.raises(Asked):
        evaluation.evaluate(PipelineRun.open(run, root=data_root, progress=False))
    assert asked == [None]


def test_synthetic_training_outliers_are_made_of_validation_images_and_refused_when_short(
    smoke_run, data_root, tmp_path
) -> None:
    """The OOD protocol's synthetic set is made from the network's own validation images (never
    one of the test images the splits cut), once per network; a network that held back fewer
    images than the set needs stops the evaluation with a message naming the way out."""
    from detector.errors import ConfigError
    from training.evaluation.context import PipelineRun, validation_images

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    (run / "evaluation.json").unlink()
    opened = PipelineRun.open(run, root=data_root, progress=False)
    synthetic = opened.samples("lap").ood_train["synthetic"]
    held_back = validation_images(opened, "lap")
    assert len(synthetic) == opened.config.ood_n == 200 and len(held_back) == 500
    # row i is validation image i under transform i mod 6: row 2 is image 2 inverted
    assert np.allclose(synthetic.images[2], 1.0 - held_back[2])
    config = json.loads((run / "pipeline_config.json").read_text())
    (run / "pipeline_config.json").write_text(json.dumps({**config, "ood_n": 600}))
    with pytest.raises(ConfigError, match="holds back 500: lower ood_n or take 'synthetic' out"):
        PipelineRun.open(run, root=data_root, progress=False).samples("lap")
    # a config that does not train on it never makes it, however few images were held back
    without = {**config, "ood_n": 600, "ood_train": ["fgm-eps0.1"]}
    (run / "pipeline_config.json").write_text(json.dumps(without))
    assert PipelineRun.open(run, root=data_root, progress=False).samples("lap").ood_train == {}


def test_a_pipeline_that_asks_for_more_validation_images_than_held_back_stops_before_training(
    data_root, tmp_path
) -> None:
    """Refused in seconds at the first step, not after the training and the attacks: no network
    is trained, and the run's progress says why (as the demo's page shows it)."""
    from detector.errors import ConfigError
    from training.pipeline.run import check_synthetic_ood, run_pipeline
    from training.presets.pipelines import get_pipeline_preset

    config = get_pipeline_preset("smoke").model_copy(update={"ood_n": 501})
    with pytest.raises(ConfigError, match="'vanilla'.s validation images, but it holds back 500"):
        run_pipeline(config, tmp_path / "run", root=data_root, progress=False)
    assert not (tmp_path / "run" / "models").exists()
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert progress["state"] == "failed" and progress["step"] == "train vanilla"
    assert "lower ood_n" in progress["message"]
    check_synthetic_ood(config.model_copy(update={"ood_n": 500}), root=data_root)  # enough
    without = config.model_copy(update={"ood_train": ["fgm-eps0.1"]})
    check_synthetic_ood(without, root=data_root)  # nothing to check


def test_a_run_resumes_across_a_new_time_estimate_but_not_across_another_computation(
    tmp_path,
) -> None:
    """A newer version's ``expected_duration`` (or another device) resumes the run directory and
    keeps its saved config; a field that changes what is computed is refused."""
    from detector.errors import ConfigError
    from training.evaluation.context import init_run
    from training.presets.pipelines import get_pipeline_preset

    config = get_pipeline_preset("smoke")
    run = tmp_path / "run"
    init_run(config, run)
    saved = (run / "pipeline_config.json").read_text()
    init_run(config.model_copy(update={"expected_duration": "~3 min", "device": "cpu"}), run)
    assert (run / "pipeline_config.json").read_text() == saved
    with pytest.raises(ConfigError, match="holds a run of another pipeline config"):
        init_run(config.model_copy(update={"ood_n": 100}), run)


def test_timings_record_every_step_and_the_report_sums_them(smoke_run) -> None:
    """timings.jsonl: the machine's reference workload, then one line per step, in order; the
    report's run-time table adds up the steps before it."""
    from training.evaluation.context import PipelineRun
    from training.pipeline.run import pipeline_steps
    from training.timings import read_timings

    rows = read_timings(smoke_run)
    references = [r for r in rows if r["event"] == "reference"]
    steps = [r for r in rows if r["event"] == "step"]
    assert references and references[0] == rows[0] and references[0]["torch_seconds"] > 0
    names = [name for name, _ in pipeline_steps(PipelineRun.open(smoke_run, progress=False))]
    assert [r["step"] for r in steps[: len(names)]] == names and all(
        r["seconds"] >= 0 for r in steps
    )
    section = (smoke_run / "report.md").read_text().split("## Where the run's time went")[1]
    total = next(ln for ln in section.splitlines() if ln.startswith("| total "))
    before_report = sum(r["seconds"] for r in steps[: names.index("report")]) / 60
    assert total.split("|")[2].strip() == f"{before_report:.1f}"


def test_report_and_figures(smoke_run) -> None:
    report = (smoke_run / "report.md").read_text()
    assert "LAP TR" in report and "VAN TR" in report and "FGM ε=0.1" in report
    # The feature-set table: every candidate's training-side score, the chosen one marked.
    selection = json.loads((smoke_run / "features" / "lap" / "selection.json").read_text())
    section = report.split("## Feature sets, chosen on the training side")[1].split("\n## ")[0]
    lap_table = section.split("**LAP**")[1]
    chosen = next(r for r in selection["rows"] if r["features"] == selection["chosen"])
    assert f"| {chosen['features']} (chosen) " in lap_table
    assert f"**{100 * chosen['mean']:.2f}**" in lap_table
    assert all(f"| {r['features']} " in lap_table for r in selection["rows"])
    # The operating points: one row per target, each at its threshold and held-out clean FPR.
    info = json.loads((smoke_run / "detector" / "deployable.json").read_text())
    section = report.split("## Deployed detector: its operating points")[1].split("\n## ")[0]
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith(("| target", "| -"))
    ]
    assert [row[:3] for row in rows] == [
        [
            row[0],
            f"{p['calibration']['threshold']:.4g}",
            f"{100 * p['heldout']['fpr']:.2f}",
        ]
        for row, p in zip(rows, info["operating_points"], strict=True)
    ]
    assert [row[0].split()[0] for row in rows] == [
        f"{100 * p['calibration']['target_fpr']:g}" for p in info["operating_points"]
    ]
    assert "figures/operating_points.png" in section
    for link in [
        line.split("](")[1].split(")")[0] for line in report.splitlines() if "](figures/" in line
    ]:
        assert (smoke_run / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bundle_scores_like_the_evaluation(smoke_run, data_root) -> None:
    guard = Guard.from_bundle(smoke_run / "bundle", device="cpu")
    manifest = guard.manifest
    assert (
        manifest is not None and manifest.dataset == "fashion-mnist" and 0 < manifest.threshold <= 1
    )
    with np.load(smoke_run / "features" / "lap" / "clean.npz", allow_pickle=False) as clean:
        logits = clean["logits"]
    from training.data.network_images import attack_images

    x, _, _ = attack_images(smoke_run / "models" / "lap", n=64, root=data_root)
    result = guard.predict(x)
    np.testing.assert_array_equal(result.labels, logits[:64].argmax(1))
    assert result.scores.shape == (64,) and result.flagged.dtype == bool


def test_rerun_is_a_noop_and_steps_work_alone(smoke_run, tmp_path, data_root, capsys) -> None:
    cached = [
        smoke_run / "models" / "lap" / "model.safetensors",
        smoke_run / "evaluation.json",
        smoke_run / "detector" / "deployable.json",
        smoke_run / "detector" / "detector.safetensors",
        *sorted((smoke_run / "attacks").rglob("*.npz")),
        *sorted((smoke_run / "features").rglob("*.npz")),
    ]
    before = {path: path.stat().st_mtime_ns for path in cached}
    assert run_smoke_pipeline(smoke_run, data_root) == 0
    assert {
        path: path.stat().st_mtime_ns for path in cached
    } == before  # nothing trained, attacked or evaluated again
    assert cli_main(["bundle", "--run", str(smoke_run), "--out", str(tmp_path / "b")]) == 0
    assert Guard.from_bundle(tmp_path / "b", device="cpu").threshold > 0
    assert cli_main(["evaluate", "--run", str(smoke_run)]) == 0
    assert "transport" in capsys.readouterr().out
    assert cli_main(["fit", "--run", str(tmp_path / "not-a-run")]) == 2
    assert "not a pipeline run directory" in capsys.readouterr().err


def test_fit_deploys_every_offered_detector(smoke_run, tmp_path, capsys) -> None:
    """`lapguard fit --detector quantile` refits, calibrates and bundles the zero-shot detector
    (a copy of the smoke run, so the shipped transport detector stays as it is)."""

    run = tmp_path / "run"
    shutil.copytree(smoke_run, run)
    assert cli_main(["fit", "--run", str(run), "--detector", "quantile", "--no-progress"]) == 0
    calibration = json.loads(capsys.readouterr().out)
    info = json.loads((run / "detector" / "deployable.json").read_text())
    assert info["kind"] == "quantile" and info["calibration"] == calibration
    assert cli_main(["bundle", "--run", str(run), "--out", str(tmp_path / "b")]) == 0
    guard = Guard.from_bundle(tmp_path / "b", device="cpu")
    assert guard.manifest is not None and guard.manifest.detector.kind == "quantile"
    assert guard.threshold == calibration["threshold"]
    # an edited deployable.json whose threshold is no number: refused by name, nothing bundled
    info["calibration"]["threshold"] = "low"
    (run / "detector" / "deployable.json").write_text(json.dumps(info))
    assert cli_main(["bundle", "--run", str(run), "--out", str(tmp_path / "c")]) == 2
    assert "threshold: Input should be a valid number" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_held_out_clean_flags_split_by_whether_the_network_is_right(smoke_run, data_root) -> None:
    """deployable.json and the manifest split the held-out clean flag rate between the images
    the network classifies right and those it gets wrong, as the saved Guard scores give it."""
    import torch

    from detector.networks import load
    from training.data.network_images import attack_images
    from training.evaluation.protocols import Split

    info = json.loads((smoke_run / "detector" / "deployable.json").read_text())
    manifest = json.loads((smoke_run / "bundle" / "manifest.json").read_text())
    model_dir = smoke_run / "models" / info["network"]
    x, y, indices = attack_images(model_dir, n=600, root=data_root)
    test = Split(info["split_seed"], info["test_fraction"], int(indices.max()) + 1).is_test[indices]
    with torch.inference_mode():
        predicted = load(model_dir)(torch.from_numpy(x[test])).argmax(1).numpy()
    wrong = predicted != y[test]
    with np.load(smoke_run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        flagged = saved["clean"] > info["calibration"]["threshold"]
    heldout = info["heldout"]
    assert len(flagged) == heldout["n_clean"] and heldout["n_misclassified"] == wrong.sum() > 0
    assert heldout["fpr_correct"] == np.mean(flagged[~wrong])
    assert heldout["fpr_misclassified"] == np.mean(flagged[wrong])
    assert manifest["metrics"]["heldout_fpr_correct"] == heldout["fpr_correct"]


def test_deploy_on_split_seed_0_is_the_shipped_detector_and_another_seed_another_split(
    smoke_run, data_root, tmp_path
) -> None:
    """``deploy`` is the recipe ``fit_deployable`` writes: on seed 0 it gives deployable.json's
    threshold and held-out rates exactly; another seed holds out other images (about as many:
    each image is held out by a seeded draw)."""
    from training.evaluation.context import PipelineRun
    from training.evaluation.deployable import deploy

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run, run_dir)  # deploy caches arrays in the run
    info = json.loads((run_dir / "detector" / "deployable.json").read_text())
    run = PipelineRun.open(run_dir, root=data_root, progress=False)
    shipped = deploy(run, info["kind"], info["split_seed"])
    assert shipped.calibration.to_dict() == info["calibration"]
    # Calibrated on the held-out slice, its own fitting images' held-out scores and the
    # network's validation images (the smoke network holds back 500 of its training split).
    images = info["calibration_images"]
    assert shipped.calibration_images == images and images["fitting"] > images["slice"] > 0
    assert images["validation"] == 500
    assert info["calibration"]["n"] == images["slice"] + images["fitting"] + images["validation"]
    # Each source's share flagged at the threshold, weighted by its images, is the achieved FPR.
    rates = info["calibration_fpr"]
    assert shipped.calibration_fpr == rates and set(rates) == set(images)
    pooled = sum(rates[k] * images[k] for k in images) / info["calibration"]["n"]
    assert pooled == pytest.approx(info["calibration"]["achieved_fpr"], abs=1e-9)
    assert json.loads(json.dumps(shipped.heldout())) == info["heldout"]
    with np.load(run_dir / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        np.testing.assert_array_equal(shipped.scores["clean"], saved["clean"])
    other = deploy(run, info["kind"], info["split_seed"] + 1)
    n_other, n_shipped = len(other.scores["clean"]), len(shipped.scores["clean"])
    assert abs(n_other - n_shipped) <= 0.2 * n_shipped and other.calibration.n > 0
    assert n_other != n_shipped or not np.array_equal(
        other.scores["clean"], shipped.scores["clean"]
    )


def _held_out(
    smoke_run: Path, info: dict, data_root: Path, attack: str, params: dict, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """The held-out (B2) perturbed images of one attack set of the smoke run's deploy network,
    rebuilt from its store (the rows the pipeline scored: those the attack moved), and their
    source images' true labels."""
    from training.attacks.sets import get_or_generate
    from training.data.network_images import attack_images
    from training.evaluation.protocols import Split

    model_dir = smoke_run / "models" / info["network"]
    x, y, indices = attack_images(model_dir, n=600, root=data_root)
    attacked = get_or_generate(
        smoke_run / "attacks" / info["network"],
        model_dir,
        x[:n],
        y[:n],
        indices[:n],
        attack,
        params,
        progress=False,
    )
    split = Split(info["split_seed"], info["test_fraction"], int(indices.max()) + 1)
    rows = split.is_test[attacked.indices] & (attacked.linf > 0)
    return attacked.x_adv[rows], y[:n][rows]


def _served_scores(bundle: Path, name: str, images: np.ndarray) -> np.ndarray:
    """Scores from a live server, sent ``images`` as FP32 tensors through the v2 route."""
    return _served(bundle, name, images)[0]


def _served(
    bundle: Path, name: str, images: np.ndarray, target_fpr: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(scores, flags) from a live server at the bundle's operating point for ``target_fpr``
    (None: its own), sent ``images`` as FP32 tensors through the v2 route."""
    import httpx

    from service.settings import Settings
    from tests.live_server import LiveServer

    answers: dict[str, list] = {"score": [], "flagged": []}
    with LiveServer(Settings(bundle=bundle, device="cpu", target_fpr=target_fpr)) as live:
        step = live.settings.max_images_per_request
        for start in range(0, len(images), step):
            chunk = images[start : start + step]
            tensor = {"name": "input", "shape": list(chunk.shape), "datatype": "FP32"}
            request = {"inputs": [{**tensor, "data": chunk.reshape(-1).tolist()}]}
            response = httpx.post(f"{live.url}/v2/models/{name}/infer", json=request, timeout=120)
            assert response.status_code == 200, response.text
            for output in response.json()["outputs"]:
                answers.get(output["name"], []).extend(output["data"])
    return np.asarray(answers["score"], np.float32), np.asarray(answers["flagged"], bool)


def test_evaluation_score_command_and_server_give_identical_scores(
    smoke_run, data_root, tmp_path
) -> None:
    """One scoring path: the shipped detector's held-out FGM scores recorded by the pipeline, the
    scores `lapguard score` writes for the same images, and those the real server answers are
    the same numbers (not close), so the flag rate a deployment sees is the one measured."""
    info = json.loads((smoke_run / "detector" / "deployable.json").read_text())
    manifest = json.loads((smoke_run / "bundle" / "manifest.json").read_text())
    with np.load(smoke_run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        evaluated, clean = saved["fgm-eps0.1"], saved["clean"]
    # The smoke detector separates FGM from clean (threshold-free: its 40-image calibration
    # moves the flag rate by several points from one feature set to the next).
    assert (
        auroc(np.r_[np.zeros(len(clean)), np.ones(len(evaluated))], np.r_[clean, evaluated]) > 0.8
    )
    rate = manifest["metrics"]["heldout_flag_rate_fgm-eps0.1"]
    assert rate == info["heldout"]["flag_rate"]["fgm-eps0.1"] > 2 * info["heldout"]["fpr"]
    assert rate == np.mean(evaluated > manifest["threshold"])
    held_out, _ = _held_out(smoke_run, info, data_root, "fgm", {"eps": 0.1}, 600)
    assert len(held_out) == len(evaluated) == info["heldout"]["n"]["fgm-eps0.1"]

    np.save(tmp_path / "held_out.npy", held_out)
    out = tmp_path / "scores.jsonl"
    argv = ["score", "--bundle", str(smoke_run / "bundle"), str(tmp_path / "held_out.npy")]
    assert cli_main([*argv, "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    rows = sorted(
        (json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"]
    )
    np.testing.assert_array_equal(np.asarray([r["score"] for r in rows], np.float32), evaluated)

    served = _served_scores(smoke_run / "bundle", manifest["name"], held_out)
    np.testing.assert_array_equal(served, evaluated)


@pytest.fixture(scope="module")
def two_family_run(smoke_run, data_root, tmp_path_factory) -> Path:
    """The smoke run with a second attack family (DeepFool, batched, 200 images), resumed from a
    copy of its networks, attack sets and features: the shipped ensemble then fits family
    forests, and the margin part meets the attack it is for."""

    from training.pipeline.run import run_pipeline
    from training.pipeline.steps import preset_config
    from training.presets.pipelines import PipelineConfig

    run = tmp_path_factory.mktemp("two-families") / "run"
    for part in ("models", "attacks", "features"):
        shutil.copytree(smoke_run / part, run / part)
    smoke = preset_config("smoke").model_dump()
    config = PipelineConfig.model_validate(
        {
            **smoke,
            "name": "smoke-two-families",
            "attacks": [
                *smoke["attacks"],
                {"key": "deepfool", "attack": "deepfool-batched", "n": 200},
            ],
            "not_run": [r for r in smoke["not_run"] if r["attack"] != "deepfool"],
        }
    )
    run_pipeline(config, run, root=data_root, progress=False)
    return run


def test_the_served_ensemble_carries_family_forests_and_scores_deepfool_as_evaluated(
    two_family_run, data_root
) -> None:
    """Trained on two attack families, the shipped ensemble holds one forest set per family
    beside the pooled ones, and a live server answers the held-out DeepFool images with the very
    scores the pipeline recorded, at the flag rate the manifest states."""
    run = two_family_run
    info = json.loads((run / "detector" / "deployable.json").read_text())
    manifest = json.loads((run / "bundle" / "manifest.json").read_text())
    assert info["families"] == manifest["detector"]["params"]["families"]
    assert info["families"] == ["deepfool-batched", "fgm"]
    with np.load(run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        evaluated = saved["deepfool"]
    held_out, _ = _held_out(run, info, data_root, "deepfool-batched", {}, 200)
    assert len(held_out) == len(evaluated) == info["heldout"]["n"]["deepfool"] > 10
    served = _served_scores(run / "bundle", manifest["name"], held_out)
    np.testing.assert_array_equal(served, evaluated)
    rate = manifest["metrics"]["heldout_flag_rate_deepfool"]
    assert rate == np.mean(served > manifest["threshold"]) > 2 * info["heldout"]["fpr"]


def _served_as_png(bundle: Path, images: np.ndarray) -> list[dict]:
    """A live server's /v1/predict answers for ``images`` ([N, 1, H, W] in [0, 1]) uploaded as
    8-bit grey PNG files, as a client holding them as floats would send them."""
    import httpx

    from service.settings import Settings
    from tests.live_server import LiveServer
    from tests.service_helpers import encode

    pixels = np.round(np.clip(images[:, 0], 0, 1) * 255).astype(np.uint8)
    files = [("files", (f"{i}.png", encode(p), "image/png")) for i, p in enumerate(pixels)]
    results: list[dict] = []
    settings = Settings(bundle=bundle, device="cpu", query_memory="off")
    with LiveServer(settings) as live:
        step = live.settings.max_images_per_request
        for start in range(0, len(files), step):
            response = httpx.post(
                f"{live.url}/v1/predict", files=files[start : start + step], timeout=120
            )
            assert response.status_code == 200, response.text
            results += response.json()["results"]
    return results


def test_png_uploads_reproduce_the_manifests_png_rates(two_family_run, data_root) -> None:
    """The manifest's PNG rates are what a client uploading the held-out DeepFool images as PNG
    files gets from a live server: the same scores the pipeline saved, the same images still
    fooling the network (rounding undoes some of DeepFool's), the same share flagged."""
    run = two_family_run
    info = json.loads((run / "detector" / "deployable.json").read_text())
    manifest = json.loads((run / "bundle" / "manifest.json").read_text())
    held_out, labels = _held_out(run, info, data_root, "deepfool-batched", {}, 200)
    with np.load(run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        evaluated = saved["png-deepfool"]
    results = _served_as_png(run / "bundle", held_out)
    served = np.asarray([r["score"] for r in results], np.float32)
    np.testing.assert_array_equal(served, evaluated)
    fooled = np.asarray([r["label"] for r in results]) != labels
    heldout = info["heldout"]
    assert heldout["n_png_successful"]["deepfool"] == fooled.sum()
    assert 0 < fooled.sum() < heldout["n_successful"]["deepfool"]  # rounding undid some
    flagged = np.asarray([r["flagged"] for r in results])
    rate = manifest["metrics"]["heldout_png_successful_flag_rate_deepfool"]
    assert rate == heldout["png_successful_flag_rate"]["deepfool"] == np.mean(flagged[fooled])


def test_shipped_rates_cover_ood_and_successful_images_and_the_server_reproduces_them(
    smoke_run, data_root
) -> None:
    """The manifest records the deployed detector's held-out flag rate on every OOD set and on
    the successful adversarial images, in the feature set the training side chose; a live server
    sent the OOD images flags exactly that share of them."""
    from detector.networks import load
    from training.data.datasets import load_ood

    info = json.loads((smoke_run / "detector" / "deployable.json").read_text())
    manifest = json.loads((smoke_run / "bundle" / "manifest.json").read_text())
    selection = json.loads((smoke_run / "features" / "lap" / "selection.json").read_text())
    chosen = {"residues+second": False, "residues+head+second": True}[selection["chosen"]]
    assert manifest["detector"]["kind"] == info["kind"] == "ensemble"
    assert manifest["detector"]["head"] is chosen is info["features"]["head"]
    metrics = manifest["metrics"]
    successful = info["heldout"]["successful_flag_rate"]["fgm-eps0.1"]
    assert metrics["heldout_successful_flag_rate_fgm-eps0.1"] == successful
    assert info["heldout"]["n_successful"]["fgm-eps0.1"] <= info["heldout"]["n"]["fgm-eps0.1"]
    spec = load(smoke_run / "models" / info["network"]).config.input_spec
    with np.load(smoke_run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        for name in ("digits", "noise"):
            images = load_ood(name, spec, 200, seed=0, root=data_root)
            served = _served_scores(smoke_run / "bundle", manifest["name"], images)
            np.testing.assert_array_equal(served, saved[f"ood-{name}"])
            rate = metrics[f"heldout_flag_rate_ood-{name}"]
            assert rate == info["heldout"]["flag_rate"][f"ood-{name}"]
            assert rate == np.mean(served > manifest["threshold"])


def test_a_server_at_an_operating_point_reproduces_its_recorded_rates(smoke_run, data_root) -> None:
    """The deployed detector is calibrated at the config's target and at each further
    operating point on the same clean scores; deployable.json records each point's held-out
    rates and the manifest the threshold of each it offers; a live server started at another
    point flags the held-out FGM images exactly as recorded there, not as at its own."""
    from training.evaluation.deployable import OPERATING_FPRS

    info = json.loads((smoke_run / "detector" / "deployable.json").read_text())
    manifest = json.loads((smoke_run / "bundle" / "manifest.json").read_text())
    points = info["operating_points"]
    targets = [p["calibration"]["target_fpr"] for p in points]
    assert targets == sorted({*OPERATING_FPRS, manifest["target_fpr"]})
    own = next(p for p in points if p["calibration"]["target_fpr"] == manifest["target_fpr"])
    assert own == {"calibration": info["calibration"], "heldout": info["heldout"]}
    fprs = [p["heldout"]["fpr"] for p in points]
    assert fprs == sorted(fprs)  # a stricter target never flags more held-out clean images
    offered = [p for p in points if not p["calibration"]["saturated"] and p is not own]
    shipped = {p["target_fpr"]: p["threshold"] for p in manifest["operating_points"]}
    assert shipped == {
        p["calibration"]["target_fpr"]: p["calibration"]["threshold"] for p in [own, *offered]
    }
    other = offered[0]  # the smoke run's few clean images saturate the strict points
    with np.load(smoke_run / "detector" / "heldout_scores.npz", allow_pickle=False) as saved:
        evaluated = saved["fgm-eps0.1"]
    threshold = other["calibration"]["threshold"]
    rate = other["heldout"]["flag_rate"]["fgm-eps0.1"]
    assert rate == np.mean(evaluated > threshold) != info["heldout"]["flag_rate"]["fgm-eps0.1"]
    held_out, _ = _held_out(smoke_run, info, data_root, "fgm", {"eps": 0.1}, 600)
    target = other["calibration"]["target_fpr"]
    served, flagged = _served(smoke_run / "bundle", manifest["name"], held_out, target)
    np.testing.assert_array_equal(served, evaluated)
    np.testing.assert_array_equal(flagged, evaluated > threshold)
    assert np.mean(flagged) == rate


def test_the_transport_forests_read_the_set_they_chose(smoke_run) -> None:
    """TR chooses its own feature set on the training side (``selection-transport.json``, fitted
    with TR itself); the protocols hand TR that set's columns, the ensemble and the bundle the
    selection detector's; the evaluation and the report say which set each detector read."""
    from training.evaluation.context import PipelineRun

    lap = smoke_run / "features" / "lap"
    own = json.loads((lap / "selection-transport.json").read_text())
    shipped = json.loads((lap / "selection.json").read_text())
    assert (own["detector"], shipped["detector"]) == ("transport", "ensemble")
    assert own["candidates"] == shipped["candidates"] and own["rows"] != shipped["rows"]
    evaluation = json.loads((smoke_run / "evaluation.json").read_text())
    sets = evaluation["feature_sets"]["lap"]
    assert sets == {
        "transport": own["chosen"],
        "ensemble": shipped["chosen"],
        "quantile": shipped["chosen"],
    }
    run = PipelineRun.open(smoke_run, progress=False)
    for detector, chosen in (("transport", own["chosen"]), ("ensemble", shipped["chosen"])):
        spec = run.feature_spec("lap", detector)
        assert spec.label() == chosen
        names = run.samples("lap", detector).clean.feature_names
        assert list(names) == spec.names(len([n for n in names if n.startswith("msq_")]))
    section = (smoke_run / "report.md").read_text().split("## Feature sets, chosen on the")[1]
    assert f"**LAP**, transport: {own['chosen']}" in section
    assert f"**LAP**, ensemble: {shipped['chosen']}" in section


def test_a_corrupt_feature_cache_is_computed_again(smoke_run, data_root, tmp_path) -> None:
    """A feature cache that cannot be read (a disk error, a cut write) or lacks an array is a
    cache: the run computes it again, to the same features, and writes it whole."""
    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run, run_dir)
    cache = run_dir / "features" / "lap" / "clean.npz"
    with np.load(cache, allow_pickle=False) as saved:
        expected = saved["features"]
        arrays = {k: saved[k] for k in saved.files if k != "source"}
    for broken in (b"PK\x03\x04 cut short", None):
        if broken is None:
            np.savez(cache, **arrays)  # another layout: no 'source'
        else:
            cache.write_bytes(broken)
        samples = PipelineRun.open(run_dir, root=data_root, progress=False).samples("lap")
        assert samples.clean.features.shape[0] == expected.shape[0]
        with np.load(cache, allow_pickle=False) as again:
            np.testing.assert_allclose(again["features"], expected, rtol=1e-5, atol=1e-6)
            assert "source" in again.files
