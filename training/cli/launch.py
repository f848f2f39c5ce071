"""Launching a training run: its config from a preset or a file with overrides, and the torchrun
rank of this process (so only one process of a distributed run prints its summary)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from detector.errors import ConfigError, validation_problems
from training.presets import get_train_preset
from training.trainer.config import TrainConfig, read_train_config


def resolve_train_config(
    *, preset: str | None, config_file: Path | None, overrides: dict[str, Any]
) -> TrainConfig:
    """The named preset or the config file, with the ``overrides`` that are not None applied
    (and validated again). Exactly one of ``preset`` and ``config_file`` is expected."""
    if (preset is None) == (config_file is None):
        raise ConfigError("give one training config: a preset name or a config file")
    config = get_train_preset(preset) if preset is not None else read_train_config(config_file)  # type: ignore[arg-type]
    updates = {key: value for key, value in overrides.items() if value is not None}
    if not updates:
        return config
    try:
        return config.model_validate({**config.model_dump(), **updates})
    except ValidationError as error:
        problems = validation_problems(error.errors())
        raise ConfigError(f"invalid training config override: {problems}") from error


def is_main_process() -> bool:
    """True unless torchrun started this process with a RANK other than 0.

    The torchrun contract (like ``training.trainer.loop._env_rank``), not a setting of ours."""
    return os.environ.get("RANK", "0") == "0"
