"""Shared fixtures: the embedded data set and tiny seeded networks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from detector.networks import InputSpec, NetworkConfig, build_network
from training.data import FASHION_CLASSES, default_root, prepare_fashion_mnist


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The data root with Fashion-MNIST laid out (as `make data` does)."""
    root = default_root().resolve()
    prepare_fashion_mnist(root)
    return root


@pytest.fixture
def tiny_config() -> NetworkConfig:
    """A 2-block, 4-channel resnet9_mnist config for Fashion-MNIST-shaped inputs."""
    return NetworkConfig(
        architecture="resnet9_mnist",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        class_names=list(FASHION_CLASSES),
        input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.2860], std=[0.3530]),
    )


@pytest.fixture
def tiny_network(tiny_config: NetworkConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_network(tiny_config).eval()
