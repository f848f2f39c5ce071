"""The paper-scale presets: each pipeline preset validates, each real network trains for a few
steps on tiny data in torchvision's format, and the pre-flight check runs on such data."""

from __future__ import annotations

import pytest

from detector import networks
from detector.errors import DataNotFoundError
from tests.ondisk import write_cifar, write_svhn, write_tiny_imagenet
from training.attacks.registry import list_attacks
from training.pipeline.preflight import check_names, check_pipeline
from training.presets import get_train_preset
from training.presets.pipelines import get_pipeline_preset, list_pipeline_presets
from training.trainer.loop import train

WRITERS = {
    "paper-cifar10-resnet110": lambda root: write_cifar(root, classes=10, n=8),
    "paper-cifar100-resnext50": lambda root: write_cifar(root, classes=100, n=8),
    "paper-tinyimagenet-wrn": lambda root: write_tiny_imagenet(root, classes=3, per_class=4),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(WRITERS))
def test_paper_preset_network_trains_a_few_steps(tmp_path, family) -> None:
    WRITERS[family](tmp_path / "data")
    preset = get_train_preset(f"{family}-lap")
    assert preset.epochs == 300 and preset.milestones == [150, 225, 250] and preset.augment
    config = preset.model_copy(
        update={
            "epochs": 1,
            "train_subset": 8,
            "test_subset": 4,
            "batch_size": 4,
            "val_fraction": 0.0,
            "device": "cpu",
            "verify_data": False,
        }
    )
    last = train(config, tmp_path / "run", root=tmp_path / "data", progress=False)
    assert last["epoch"] == 1 and last["lambda"] > preset.lap.lambda0
    model = networks.load(tmp_path / "run")
    assert model.config.architecture == preset.architecture
    assert len(model.tap_names()) > 3


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_paper_pipeline_preset_validates(family) -> None:
    config = get_pipeline_preset(family)
    check_names(config)
    assert family in list_pipeline_presets()
    assert {get_train_preset(p).objective for p in config.models.values()} == {"vanilla", "lap"}
    keys = [a.key for a in config.attacks]
    assert keys[:3] == ["fgm", "apgd", "bim"] and config.unseen_train == "fgm"
    assert all(a.attack in list_attacks() for a in config.attacks)
    assert {a["attack"] for a in config.not_run}.isdisjoint(keys)
    assert config.mahalanobis_magnitudes[-1] == 0.01 and "nss" in config.detectors


def test_paper_cifar10_preflight_on_tiny_data(tmp_path) -> None:
    root = tmp_path / "data"
    write_cifar(root, classes=10, n=4)
    write_cifar(root, classes=100, n=4)
    write_svhn(root, n=4)
    report = check_pipeline(get_pipeline_preset("paper-cifar10-resnet110"), root=root)
    assert report.data == {
        "cifar10 train": 20,
        "cifar10 test": 4,
        "cifar100 test": 4,
        "svhn test": 4,
    }
    assert sorted(report.networks) == ["lap", "vanilla"]
    assert "resnet110" in report.networks["lap"] and "logits (2, 10)" in report.networks["lap"]


def test_paper_cifar10_preflight_names_the_missing_data(tmp_path) -> None:
    write_cifar(tmp_path, classes=10, n=4)  # CIFAR-10 only: the OOD set CIFAR-100 is absent
    with pytest.raises(DataNotFoundError, match="cifar100"):
        check_pipeline(get_pipeline_preset("paper-cifar10-resnet110"), root=tmp_path)


def test_full_preset_adds_the_slow_attacks_and_passes_preflight(data_root, capsys) -> None:
    from training.cli.main import main

    config = get_pipeline_preset("full")
    check_names(config)
    assert "full" in list_pipeline_presets()
    attacks = {a.key: a.attack for a in config.attacks}
    assert {"fgm-eps0.1", "fgm-eps0.03", "bim", "apgd"} <= set(attacks) and not config.not_run
    assert {attacks[k] for k in ("cw", "deepfool")} == {"cw-batched", "deepfool-batched"}
    assert {"autoattack", "hsj", "boundary"} <= set(attacks.values())
    assert config.expected_duration and " h " in config.expected_duration
    assert main(["pipeline", "--preset", "full", "--check", "--root", str(data_root)]) == 0
    out = capsys.readouterr().out
    assert "pipeline full: config valid" in out and "fashion-mnist test: 10000 images" in out
    assert main(["pipeline", "--list-presets"]) == 0
    assert "expected: at most" in capsys.readouterr().out
