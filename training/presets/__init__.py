"""Named, typed training presets (``lapguard train --list-presets``).

``smoke-*``: a tiny network on a Fashion-MNIST subset, seconds on a CPU (tests, checks).
``quick-*``: the seed's Fashion-MNIST network on the full embedded data set, minutes on 2 cores.
``paper-*``: seed 003 appendix H.1 (300 epochs, SGD 0.1 divided by ten at 150/225/250), for GPUs.
"""

from __future__ import annotations

from typing import Any

from detector.errors import ConfigError
from training.trainer.config import LapSettings, MonitorSettings, TrainConfig

OBJECTIVE_SUFFIXES = {"vanilla": "vanilla", "lap": "lap", "rce": "rce"}


def _variants(prefix: str, base: dict, rce_overrides: dict | None = None) -> dict[str, TrainConfig]:
    presets = {}
    for suffix, objective in OBJECTIVE_SUFFIXES.items():
        fields = dict(base, name=f"{prefix}-{suffix}", objective=objective)
        if objective == "rce" and rce_overrides:
            fields.update(rce_overrides)
        presets[fields["name"]] = TrainConfig(**fields)
    return presets


_SMOKE = {
    "dataset": "fashion-mnist",
    "architecture": "resnet9_mnist",
    "arguments": {"width": 8, "depth": 3, "hidden": 16},
    "epochs": 1,
    "batch_size": 64,
    "lr": 0.05,
    "train_subset": 5000,
    "test_subset": 1000,
    "grad_clip": 5.0,
}
_QUICK = {
    "dataset": "fashion-mnist",
    "architecture": "resnet9_mnist",
    "epochs": 3,
    "batch_size": 128,
    "lr": 0.05,
    "milestones": [2],
    "weight_decay": 1e-4,
    "grad_clip": 5.0,
}
# The `diagnose` preset's networks: quick's schedule on 5,000 training images, with
# the dynamics monitors on; residual vs plain (skip=False), BatchNorm vs unitization, vanilla vs LAP.
# 5,000 images: on 2 cores shared with other jobs one epoch of 20,000 took 519 s (3 epochs x 4
# networks would be ~1.7 h); 5,000 keeps the preset within 45 minutes there.
_DIAGNOSE: dict[str, Any] = {**_QUICK, "train_subset": 5000, "monitors": MonitorSettings()}
_DIAGNOSE_VARIANTS: dict[str, dict[str, Any]] = {
    "diagnose-resnet-vanilla": {},
    "diagnose-resnet-lap": {"objective": "lap"},
    "diagnose-plain-vanilla": {"arguments": {"skip": False}},
    "diagnose-unit-vanilla": {"arguments": {"norm": "unit"}},
}
_PAPER_SCHEDULE = {
    "epochs": 300,
    "lr": 0.1,
    "milestones": [150, 225, 250],
    "weight_decay": 1e-4,
    "augment": True,
    "amp": True,
}
_PAPER_LAP = LapSettings(lambda0=1.0, tau=1.0, every=1)

TRAIN_PRESETS: dict[str, TrainConfig] = {
    **_variants("smoke", _SMOKE),
    **_variants("quick", _QUICK),
    **{
        name: TrainConfig(**{**_DIAGNOSE, "name": name, **fields})
        for name, fields in _DIAGNOSE_VARIANTS.items()
    },
    **_variants(
        "paper-cifar10-resnet110",
        {
            **_PAPER_SCHEDULE,
            "dataset": "cifar10",
            "architecture": "resnet110",
            "init": "orthogonal",
            "init_gain": 0.05,
            "batch_size": 256,
            "grad_clip": 5.0,
            "lap": _PAPER_LAP,
        },
        rce_overrides={"grad_clip": None},
    ),
    **_variants(
        "paper-cifar100-resnext50",
        {
            **_PAPER_SCHEDULE,
            "dataset": "cifar100",
            "architecture": "resnext50",
            "init": "kaiming",
            "batch_size": 128,
            "lap": _PAPER_LAP,
        },
        rce_overrides={"lr": 0.05, "init": "orthogonal", "init_gain": 0.05},
    ),
    **_variants(
        "paper-tinyimagenet-wrn",
        {
            **_PAPER_SCHEDULE,
            "dataset": "imagefolder",
            "architecture": "wide_resnet",
            "init": "orthogonal",
            "init_gain": 0.1,
            "batch_size": 114,
            "lap": _PAPER_LAP,
        },
    ),
}


def list_train_presets() -> list[str]:
    return sorted(TRAIN_PRESETS)


def get_train_preset(name: str) -> TrainConfig:
    """A copy of the named preset; an unknown name lists the known ones."""
    if name not in TRAIN_PRESETS:
        raise ConfigError(
            f"unknown training preset {name!r}; known: {', '.join(list_train_presets())}"
        )
    return TRAIN_PRESETS[name].model_copy(deep=True)
