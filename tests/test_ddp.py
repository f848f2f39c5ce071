"""Training with torchrun (DistributedDataParallel) on CPU with gloo: two processes train a tiny
network, rank 0 alone writes, and an interrupted distributed run resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detector import networks
from training.trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(config: Path, out: Path, data_root: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAPGUARD_", "OMP_"))}
    env["LAPGUARD_DATA"] = str(data_root)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # rendezvous on 127.0.0.1, a free port
        "--nproc_per_node=2",
        "-m",
        "training.cli.main",
        "train",
        "--config",
        str(config),
        "--out",
        str(out),
        "--root",
        str(data_root),
        "--no-progress",
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_torchrun_trains_on_two_cpu_processes_and_resumes(tmp_path: Path, data_root: Path) -> None:
    config = TrainConfig(
        name="ddp-tiny",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        objective="lap",
        epochs=2,
        batch_size=64,
        train_subset=256,
        test_subset=128,
        device="cpu",
        seed=3,
    )
    one_epoch = tmp_path / "one_epoch.json"
    one_epoch.write_text(config.model_copy(update={"epochs": 1}).model_dump_json())
    out = tmp_path / "run"
    first = _torchrun(one_epoch, out, data_root)
    assert first.returncode == 0, first.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert not list(out.glob("*.tmp"))

    # Continue to two epochs from the checkpoint, as an interrupted two-epoch run would.
    (out / "train_config.json").write_text(config.model_dump_json())
    (out / "model.safetensors").unlink()
    two_epochs = tmp_path / "two_epochs.json"
    two_epochs.write_text(config.model_dump_json())
    second = _torchrun(two_epochs, out, data_root)
    assert second.returncode == 0, second.stderr[-3000:]

    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]
    assert epochs[-1]["lambda"] > 1.0 and 0.0 <= epochs[-1]["test_accuracy"] <= 1.0
    assert json.loads((out / "checkpoint.json").read_text())["epoch"] == 2
    model = networks.load(out)  # the saved network loads on its own
    assert model.config.class_names[0] == "T-shirt/top"
    printed, _ = json.JSONDecoder().raw_decode(second.stdout[second.stdout.index("{") :])
    assert printed["epoch"] == 2
