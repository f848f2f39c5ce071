"""Each paper-scale preset's real network trains for a few steps on tiny data in torchvision's format."""

from __future__ import annotations

import pytest

from detector import networks
from tests.ondisk import write_cifar, write_tiny_imagenet
from training.presets import get_train_preset
from training.trainer import train

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
