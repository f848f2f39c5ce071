"""LAP/vanilla/RCE objectives, the Uzawa update, the trainer's resume and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from detector import networks
from detector.errors import ArtefactError, ConfigError, DataNotFoundError
from training.cli.main import main as cli_main
from training.presets import get_train_preset, list_train_presets
from training.trainer.config import TrainConfig, read_train_config
from training.trainer.loop import train
from training.trainer.losses import (
    UzawaMultiplier,
    compute_loss,
    reverse_cross_entropy,
    transport_cost,
)


def test_transport_cost_is_sum_of_mean_squares() -> None:
    r1, r2 = torch.randn(4, 3, 5, 5), torch.randn(4, 3, 5, 5)
    expected = (r1**2).sum() / r1.numel() + (r2**2).sum() / r2.numel()
    torch.testing.assert_close(transport_cost([r1, r2]), expected)


@pytest.mark.parametrize(("tau", "every"), [(1.0, 1), (0.5, 3)])
def test_uzawa_update_follows_the_formula(tau: float, every: int) -> None:
    multiplier = UzawaMultiplier(lambda0=2.0, tau=tau, every=every)
    losses = [0.9, 0.7, 0.4, 0.3, 0.25, 0.2, 0.1]
    expected = 2.0
    for step, loss in enumerate(losses, start=1):
        if step % every == 0:
            expected += tau * loss
        assert multiplier.step(loss) == pytest.approx(expected)
    restored = UzawaMultiplier()
    restored.load_state_dict(multiplier.state_dict())
    assert restored.value == multiplier.value and restored.steps == len(losses)


def test_uzawa_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="lambda0 must be positive"):
        UzawaMultiplier(lambda0=0)
    with pytest.raises(ConfigError, match=">= 1"):
        UzawaMultiplier(every=0)


def test_lap_objective_divides_transport_by_lambda() -> None:
    logits = torch.randn(8, 10, requires_grad=True)
    targets = torch.randint(0, 10, (8,))
    residuals = [torch.randn(8, 4, requires_grad=True)]
    lap = compute_loss("lap", logits, residuals, targets, lam=4.0)
    ce = torch.nn.functional.cross_entropy(logits, targets)
    torch.testing.assert_close(lap.total, transport_cost(residuals) / 4.0 + ce)
    vanilla = compute_loss("vanilla", logits, residuals, targets, lam=4.0)
    torch.testing.assert_close(vanilla.total, ce)
    torch.testing.assert_close(vanilla.transport, lap.transport)
    vanilla.total.backward()
    assert residuals[0].grad is None  # vanilla training never pushes on the residuals


def test_reverse_cross_entropy_prefers_the_true_class_in_negated_logits() -> None:
    targets = torch.tensor([2, 0])
    good = torch.full((2, 3), -5.0)
    good[torch.arange(2), targets] = 5.0  # negated logits: the true class has the highest value
    bad = -good
    assert reverse_cross_entropy(good, targets) < reverse_cross_entropy(bad, targets)
    uniform = torch.zeros(2, 3)
    assert reverse_cross_entropy(uniform, targets).item() == pytest.approx(math.log(3), rel=1e-5)


def test_unknown_objective() -> None:
    with pytest.raises(ConfigError, match="unknown objective"):
        compute_loss(
            "adversarial", torch.zeros(1, 2), [torch.zeros(1)], torch.zeros(1, dtype=torch.long)
        )


def _tiny_config(**overrides) -> TrainConfig:
    fields = {
        "name": "tiny",
        "arguments": {"width": 4, "depth": 2, "hidden": 8},
        "objective": "lap",
        "epochs": 2,
        "batch_size": 64,
        "train_subset": 256,
        "test_subset": 128,
        "device": "cpu",
        "seed": 3,
    }
    return TrainConfig(**{**fields, **overrides})


def test_config_fingerprint_is_stable_and_ignores_where_it_runs() -> None:
    # Pinned: checkpoints of existing runs are keyed by it.
    config = _tiny_config()
    assert config.fingerprint() == "6d7a75012a0c6872"
    assert _tiny_config(device="cuda", num_workers=3, name="x").fingerprint() == "6d7a75012a0c6872"
    assert _tiny_config(seed=4).fingerprint() != "6d7a75012a0c6872"


@pytest.mark.slow
def test_train_writes_a_loadable_network_and_resumes(tmp_path, data_root) -> None:
    config = _tiny_config()
    full = train(config, tmp_path / "full", root=data_root, progress=False)
    assert full["epoch"] == 2 and full["lambda"] > 1.0
    model = networks.load(tmp_path / "full")
    assert model.config.class_names[0] == "T-shirt/top"
    assert (tmp_path / "full" / "training_curve.png").stat().st_size > 1000
    assert len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines()) == 2

    # Interrupted after one epoch, then resumed: the same result as one uninterrupted run.
    first = train(
        config.model_copy(update={"epochs": 1}),
        tmp_path / "resumed",
        root=data_root,
        progress=False,
    )
    assert first["epoch"] == 1
    (tmp_path / "resumed" / "train_config.json").write_text(config.model_dump_json())
    (tmp_path / "resumed" / "model.safetensors").unlink()  # as if killed before the end
    resumed = train(config, tmp_path / "resumed", root=data_root, progress=False)
    assert resumed["epoch"] == 2
    state = json.loads((tmp_path / "resumed" / "checkpoint.json").read_text())
    assert state["epoch"] == 2
    assert resumed["lambda"] == pytest.approx(full["lambda"], rel=1e-4)
    assert resumed["test_accuracy"] == pytest.approx(full["test_accuracy"], abs=0.02)

    # A finished run is a no-op; another config in the same directory is refused.
    assert train(config, tmp_path / "full", root=data_root, progress=False) == full
    with pytest.raises(ConfigError, match="another config"):
        train(
            config.model_copy(update={"lr": 0.2}), tmp_path / "full", root=data_root, progress=False
        )


@pytest.mark.slow
def test_lap_training_lowers_transport_cost(tmp_path, data_root) -> None:
    vanilla = train(
        _tiny_config(objective="vanilla", epochs=1, train_subset=1024),
        tmp_path / "v",
        root=data_root,
        progress=False,
    )
    lap = train(
        _tiny_config(objective="lap", epochs=1, train_subset=1024),
        tmp_path / "l",
        root=data_root,
        progress=False,
    )
    assert lap["test_transport"] < vanilla["test_transport"]


def test_presets_are_valid_and_listed() -> None:
    names = list_train_presets()
    for expected in (
        "smoke-vanilla",
        "smoke-lap",
        "quick-vanilla",
        "quick-lap",
        "paper-cifar10-resnet110-lap",
    ):
        assert expected in names
    paper = get_train_preset("paper-cifar10-resnet110-lap")
    assert (
        paper.lr,
        paper.milestones,
        paper.init,
        paper.init_gain,
        paper.batch_size,
        paper.grad_clip,
    ) == (
        0.1,
        [150, 225, 250],
        "orthogonal",
        0.05,
        256,
        5.0,
    )
    assert get_train_preset("paper-cifar10-resnet110-rce").grad_clip is None
    with pytest.raises(ConfigError, match="unknown training preset 'nope'"):
        get_train_preset("nope")


def test_a_config_that_cannot_train_never_claims_the_directory(tmp_path, data_root, capsys) -> None:
    """A network its arguments cannot build, or a seed numpy cannot take, is refused with a
    message before the config is saved, so the same --out takes the mended config."""
    bad = _tiny_config(arguments={"width": -3, "depth": 2, "hidden": 8})
    with pytest.raises(ConfigError, match="cannot be built with the arguments"):
        train(bad, tmp_path / "a", root=data_root, progress=False)
    assert not (tmp_path / "a" / "train_config.json").exists()
    out = str(tmp_path / "b")
    assert cli_main(["train", "--preset", "smoke-lap", "--seed", "-1", "--out", out]) == 2
    assert "seed: Input should be greater than or equal to 0" in capsys.readouterr().err
    assert not (tmp_path / "b" / "train_config.json").exists()
    assert cli_main(["train", "--preset", "", "--out", out]) == 2
    assert "unknown training preset ''" in capsys.readouterr().err


def test_resume_takes_the_state_saved_with_the_weights(tmp_path, data_root) -> None:
    """Interrupted between the checkpoint's two writes, the JSON state is an epoch behind the
    weights: the resume reads the state saved inside the weights, and trains no epoch twice. A
    corrupt checkpoint is an error naming what to delete."""
    config, out = _tiny_config(epochs=1), tmp_path / "run"
    train(config, out, root=data_root, progress=False)
    saved = load_file(str(out / "checkpoint.safetensors"))
    state = json.loads((out / "checkpoint.json").read_text())
    (out / "checkpoint.json").write_text(json.dumps(state | {"epoch": 0}))
    (out / "model.safetensors").unlink()
    train(config, out, root=data_root, progress=False)
    final = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(final[k], saved[f"model.{k}"]) for k in final)
    (out / "model.safetensors").unlink()
    (out / "checkpoint.safetensors").write_bytes(b"\x00" * 12)
    with pytest.raises(ArtefactError, match="checkpoint in .* is unreadable"):
        train(config, out, root=data_root, progress=False)


def test_bad_config_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        read_train_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_train_config(tmp_path / "bad.json")
    (tmp_path / "typo.json").write_text(json.dumps({"epochz": 3}))
    with pytest.raises(ConfigError, match="epochz"):
        read_train_config(tmp_path / "typo.json")
    (tmp_path / "arch.json").write_text(json.dumps({"architecture": "vgg16"}))
    with pytest.raises(ConfigError, match="unknown architecture"):
        read_train_config(tmp_path / "arch.json")


def test_missing_data_names_the_path(tmp_path) -> None:
    with pytest.raises(DataNotFoundError, match=str(tmp_path)):
        train(
            _tiny_config(dataset="cifar10", arguments={}, architecture="resnet110"),
            tmp_path / "out",
            root=tmp_path,
            progress=False,
        )


def test_cli_errors_are_one_clear_line(tmp_path, capsys) -> None:
    assert cli_main(["train", "--preset", "nope", "--out", str(tmp_path / "x")]) == 2
    assert "unknown training preset 'nope'" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(tmp_path / "missing.json")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert cli_main(["train", "--list-presets"]) == 0
    assert "quick-lap" in capsys.readouterr().out
    assert not (tmp_path / "x").exists()
