"""Pre-flight check of a pipeline config: every name it uses exists, every data set it reads is on
disk and every network builds and runs, in seconds, before hours of GPU time are spent on it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from detector import networks
from detector.errors import ConfigError
from training.attacks.registry import make_attack_params
from training.data.datasets import OOD_SETS, class_names, dataset_info, load_dataset
from training.data.network_images import in_input_spec
from training.pipeline.imported import check_imported
from training.pipeline.run import check_synthetic_ood
from training.presets import get_train_preset
from training.presets.pipelines import PipelineConfig


@dataclass
class Preflight:
    """What the check found: images per data split and a one-line summary per network."""

    preset: str
    data: dict[str, int] = field(default_factory=dict)
    networks: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Human-readable summary, one fact a line."""
        return [
            f"pipeline {self.preset}: config valid",
            *(f"  data {name}: {count} images" for name, count in self.data.items()),
            *(f"  network {name}: {summary}" for name, summary in self.networks.items()),
        ]


def check_names(config: PipelineConfig) -> None:
    """Every training preset exists and trains on the pipeline's data set; every attack is
    registered and takes its parameters. Raises ConfigError naming the first problem."""
    for name, preset in config.models.items():
        train_config = get_train_preset(preset)
        if train_config.dataset != config.dataset:
            raise ConfigError(
                f"network {name!r} (preset {preset}) trains on {train_config.dataset!r}, "
                f"the pipeline on {config.dataset!r}"
            )
    for spec in config.attacks:
        make_attack_params(spec.attack, spec.params)
    dataset_info(config.dataset)
    for name in config.ood_test:
        if name not in OOD_SETS:
            dataset_info(name)


def _data_sets(config: PipelineConfig) -> list[tuple[str, str]]:
    """(data set, split) pairs the pipeline reads: its own train and test splits, and the test
    split of every OOD set that is a data set."""
    ood = [(name, "test") for name in config.ood_test if name not in OOD_SETS]
    return [(config.dataset, "train"), (config.dataset, "test"), *ood]


def check_pipeline(config: PipelineConfig, *, root: Path | None = None) -> Preflight:
    """Names (``check_names``), data on disk (files present and readable; the originals'
    checksums are verified when training opens them), and one forward pass of each network
    on two test images. Raises ConfigError or DataNotFoundError naming what is wrong."""
    check_names(config)
    check_synthetic_ood(config, root=root)
    report = Preflight(config.name)
    for name, split in _data_sets(config):
        report.data[f"{name} {split}"] = len(load_dataset(name, split, root=root, verify=False))  # type: ignore[arg-type]
    test_set = load_dataset(config.dataset, "test", root=root, verify=False)
    images = torch.stack([test_set[i][0] for i in range(min(2, len(test_set)))])  # type: ignore[arg-type]
    for name, preset in config.models.items():
        train_config = get_train_preset(preset)
        network_config = networks.NetworkConfig(
            architecture=train_config.architecture,
            arguments=train_config.arguments,
            class_names=class_names(config.dataset, test_set),
            input_spec=dataset_info(config.dataset).input_spec(),
        )
        model = networks.build_network(network_config).eval()
        with torch.no_grad():
            logits = model(images)
        parameters = sum(p.numel() for p in model.parameters())
        report.networks[name] = (
            f"{train_config.architecture} ({parameters / 1e6:.1f}M parameters), "
            f"{train_config.objective}, {train_config.epochs} epochs, "
            f"logits {tuple(logits.shape)} on {len(images)} test images"
        )
    check_imported(config)
    for name, path in config.imported.items():
        model = networks.load(path)
        with torch.no_grad():
            x = in_input_spec(images.numpy(), model.config.input_spec)  # type: ignore[union-attr]
            logits = model(torch.from_numpy(x))
        parameters = sum(p.numel() for p in model.parameters())
        report.networks[name] = (
            f"imported from {path}: {model.config.architecture} "  # type: ignore[union-attr]
            f"({parameters / 1e6:.1f}M parameters), logits {tuple(logits.shape)} on "
            f"{len(images)} test images through its input spec"
        )
    return report
