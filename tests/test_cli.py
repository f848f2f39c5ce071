"""The ``lapguard`` command line: usage errors, listings, and the paper pipeline presets starting
(pre-flight check on tiny on-disk CIFAR) or stopping with a clear message when data is absent."""

from __future__ import annotations

import argparse
import re

import pytest

from detector.errors import ConfigError, LapguardError
from tests.ondisk import write_cifar, write_svhn
from training.cli.launch import resolve_train_config
from training.cli.main import UsageError, build_parser, detector_choices, main
from training.presets.pipelines import list_pipeline_presets

PAPER = "paper-cifar10-resnet110"
ADAPTIVE = ["attack", "--adaptive", "--run", "r", "--attack", "feature-match"]


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lapguard {command}: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["pipeline"], "--preset NAME"),
        (["train"], "--preset NAME or --config FILE"),
        (["attack", "--attack", "fgm"], "--run DIR and --attack NAME"),
        (["attack", "--run", "r", "--attack", "fgm", "--param", "eps"], "KEY=VALUE"),
        (["pipeline", "--preset", "nope"], "unknown pipeline preset 'nope'"),
        (["train", "--preset", "smoke-lap", "--epochs", "0"], "epochs: Input should be"),
        (["attack", "--run", "r", "--attack", "fgm", "--seed", "-1"], "attack seed must be"),
        (["attack", "--run", "r", "--attack", "fgm", "--batch-size", "0"], "batch size must be"),
        (ADAPTIVE + ["--seed", "1", "--workers", "2"], "does not take --workers, --seed"),
        (ADAPTIVE + ["--engine", "ray"], "does not take --engine ray"),
        (ADAPTIVE + ["--limit", "-1"], "--limit must be at least 1, got -1"),
        (ADAPTIVE + ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(argv, needle, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert needle in _error_line(capsys, argv[0])
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    ("saved", "needle"),
    [
        ('{"name": "qu', "pipeline config .*pipeline_config.json is not valid JSON"),
        ('{"surprise": 1}', "pipeline config .*pipeline_config.json is not a valid PipelineConfig"),
        (b"\xff\xfe", "pipeline config .*pipeline_config.json is not valid JSON"),
    ],
)
def test_a_corrupt_saved_config_is_an_error_naming_it(saved, needle, capsys, tmp_path) -> None:
    """Every step that opens a run reads its saved config: a truncated, edited or binary one is
    one line naming the file, not a traceback, and the file is left as it is."""
    path = tmp_path / "pipeline_config.json"
    path.write_bytes(saved if isinstance(saved, bytes) else saved.encode())
    for command in ("evaluate", "report"):
        assert main([command, "--run", str(tmp_path)]) == 2
        assert re.search(needle, _error_line(capsys, command))
    assert path.read_bytes() == (saved if isinstance(saved, bytes) else saved.encode())


def test_usage_error_is_the_config_error_of_the_cli() -> None:
    assert issubclass(UsageError, ConfigError) and issubclass(UsageError, LapguardError)


def test_fit_offers_exactly_the_detector_choices(capsys) -> None:
    """`fit` offers the registered detectors that can ship (a torch form), and no other."""
    assert detector_choices() == ["ensemble", "novelty", "quantile", "transport"]
    for name in ("mahalanobis", "nss"):  # registered, evaluated, but not servable
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--run", "r", "--detector", name])
        assert exit_info.value.code == 2
        assert f"invalid choice: '{name}'" in capsys.readouterr().err
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    fit = sub.choices["fit"]
    action = next(a for a in fit._actions if a.dest == "detector")
    assert list(action.choices) == detector_choices() and action.default is None
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--run", "r", "--detector", "forest"])
    assert exit_info.value.code == 2


def test_listings_name_what_exists(capsys) -> None:
    assert main(["pipeline", "--list-presets"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(list_pipeline_presets()) or sorted(listed) == list_pipeline_presets()
    assert main(["train", "--list-presets"]) == 0
    assert f"{PAPER}-lap" in capsys.readouterr().out
    assert main(["data", "--list"]) == 0
    out = capsys.readouterr().out
    assert "cifar10" in out and out.rstrip().splitlines()[-1].startswith("OOD sets: digits, noise")


def test_paper_preset_check_starts_on_tiny_cifar(tmp_path, capsys, monkeypatch) -> None:
    root = tmp_path / "data"
    write_cifar(root, classes=10, n=4)
    write_cifar(root, classes=100, n=4)
    write_svhn(root, n=4)
    monkeypatch.chdir(tmp_path)
    assert main(["pipeline", "--preset", PAPER, "--root", str(root), "--check"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"pipeline {PAPER}: config valid"
    assert "  data cifar10 train: 20 images" in lines and "  data svhn test: 4 images" in lines
    assert sum("resnet110" in line and "logits (2, 10)" in line for line in lines) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # --check writes nothing


@pytest.mark.parametrize("check", [True, False])
def test_paper_preset_without_data_stops_with_the_path(tmp_path, capsys, check) -> None:
    empty = tmp_path / "no-data"
    argv = ["pipeline", "--preset", PAPER, "--root", str(empty), "--out", str(tmp_path / "run")]
    assert main([*argv, "--device", "cpu", "--no-progress", *(["--check"] if check else [])]) == 2
    err = _error_line(capsys, "pipeline")
    assert "data set 'cifar10' (train) not found" in err and str(empty.resolve()) in err
    assert not (tmp_path / "run" / "models" / "vanilla" / "model.safetensors").exists()


def test_train_config_overrides_apply_only_when_given(tmp_path) -> None:
    config = resolve_train_config(
        preset="smoke-lap", config_file=None, overrides={"epochs": 3, "seed": None}
    )
    assert (
        config.epochs == 3
        and config.seed
        == resolve_train_config(preset="smoke-lap", config_file=None, overrides={}).seed
    )
    path = tmp_path / "c.json"
    path.write_text(config.model_dump_json())
    assert resolve_train_config(preset=None, config_file=path, overrides={}) == config
    with pytest.raises(ConfigError, match="one training config"):
        resolve_train_config(preset="smoke-lap", config_file=path, overrides={})
    with pytest.raises(ConfigError, match="epochs"):
        resolve_train_config(preset="smoke-lap", config_file=None, overrides={"epochs": 0})
