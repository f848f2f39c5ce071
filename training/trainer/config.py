"""Typed training configuration, saved beside every trained network."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from detector.artefacts import sha256_json
from detector.errors import ConfigError
from detector.networks import list_models
from training.data.datasets import DATASETS


class LapSettings(BaseModel):
    """Uzawa settings: lambda starts at ``lambda0`` and grows by tau * L every ``every`` steps."""

    model_config = ConfigDict(extra="forbid")

    lambda0: float = Field(default=1.0, gt=0)
    tau: float = Field(default=1.0, ge=0)
    every: int = Field(default=1, ge=1)


class MonitorSettings(BaseModel):
    """Per-epoch dynamics monitors (training/trainer/monitors.py): probe heads fitted on ``probe_images``
    training images, W-distances on ``eval_images`` held-out images, the ICS on the first
    ``ics_images`` of them."""

    model_config = ConfigDict(extra="forbid")

    probe_images: int = Field(default=1000, ge=10)
    eval_images: int = Field(default=500, ge=2)
    ics_images: int = Field(default=256, ge=2)


class TrainConfig(BaseModel):
    """One network's training run. Every field has the seed's meaning (appendix H.1)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    dataset: str = "fashion-mnist"
    architecture: str = "resnet9_mnist"
    arguments: dict[str, Any] = Field(default_factory=dict)
    objective: Literal["vanilla", "lap", "lap-fixed", "rce"] = "vanilla"
    lap: LapSettings = Field(default_factory=LapSettings)
    epochs: int = Field(2, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(1e-4, ge=0)
    milestones: list[int] = Field(default_factory=list)
    gamma: float = Field(0.1, gt=0)
    init: Literal["default", "kaiming", "orthogonal"] = "kaiming"
    init_gain: float = Field(1.0, gt=0)
    grad_clip: float | None = Field(None, gt=0)
    augment: bool = False
    val_fraction: float = Field(0.1, ge=0, lt=1)
    train_subset: int | None = Field(None, ge=1)
    test_subset: int | None = Field(None, ge=1)
    verify_data: bool = True
    amp: bool = False
    seed: int = Field(default=0, ge=0, le=2**32 - 1)  # what numpy and torch seed with
    device: str = "auto"
    num_workers: int = Field(0, ge=0)
    # Seed 000's layer-wise W-distances and seed 004's ICS per epoch into metrics.jsonl.
    monitors: MonitorSettings | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.architecture not in list_models():
            raise ValueError(
                f"unknown architecture {self.architecture!r}; registered: {', '.join(list_models())}"
            )
        if self.dataset not in DATASETS:
            raise ValueError(
                f"unknown data set {self.dataset!r}; known: {', '.join(sorted(DATASETS))}"
            )
        if sorted(self.milestones) != self.milestones:
            raise ValueError("milestones must be increasing epochs")
        if self.objective == "lap-fixed" and self.lap.tau != 0:
            self.lap = self.lap.model_copy(update={"tau": 0.0})
        return self

    def fingerprint(self) -> str:
        """Hash of what determines the result (not where it runs, nor what is monitored), to
        key checkpoints."""
        relevant = self.model_dump(
            exclude={"device", "num_workers", "name", "verify_data", "monitors"}
        )
        return sha256_json(relevant)[:16]


def read_train_config(path: str | Path) -> TrainConfig:
    """Load a TrainConfig from a JSON file with a clear error for every problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return TrainConfig.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} is not valid JSON: {error}") from error
    except ValidationError as error:
        raise ConfigError(f"invalid training config {path}:\n{error}") from error
