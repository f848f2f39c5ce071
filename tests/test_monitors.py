"""Training-time dynamics monitors (seeds 000 and 004) recorded in metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from detector import networks
from training.data.datasets import load_dataset
from training.rundir import ModelDir
from training.trainer.config import MonitorSettings, TrainConfig
from training.trainer.loop import train
from training.trainer.monitors import DynamicsMonitor

SETTINGS = MonitorSettings(probe_images=200, eval_images=60, ics_images=40)


def _config(monitors: MonitorSettings | None) -> TrainConfig:
    return TrainConfig(
        name="tiny",
        arguments={"width": 4, "depth": 2, "hidden": 8},
        epochs=2,
        batch_size=64,
        train_subset=400,
        test_subset=100,
        grad_clip=5.0,
        device="cpu",
        monitors=monitors,
    )


@pytest.mark.slow
def test_monitors_record_every_epoch_and_leave_training_unchanged(
    tmp_path: Path, data_root: Path
) -> None:
    watched = train(_config(SETTINGS), tmp_path / "watched", root=data_root, progress=False)
    rows = ModelDir(tmp_path / "watched").read_metrics()
    assert [len(r["monitor_w_layers"]) for r in rows] == [4, 4]  # stem, 2 blocks, head
    assert all(0.0 <= w <= 1.0 for r in rows for w in r["monitor_w_layers"])
    assert [len(r["monitor_ics"]) for r in rows] == [2, 2]
    assert all(v > 0 for r in rows for v in r["monitor_ics"])  # the weights moved
    assert watched["monitor_w_layers"] == rows[-1]["monitor_w_layers"]
    assert (tmp_path / "watched" / "training_curve.png").stat().st_size > 0
    train(_config(None), tmp_path / "plain", root=data_root, progress=False)
    a = load_file(str(ModelDir(tmp_path / "watched").weights_file))
    b = load_file(str(ModelDir(tmp_path / "plain").weights_file))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _config(SETTINGS).fingerprint() == _config(None).fingerprint()


def test_an_unchanged_network_has_no_covariate_shift(tiny_config, data_root: Path) -> None:
    torch.manual_seed(0)
    model = networks.build_network(tiny_config).eval()
    dataset = load_dataset("fashion-mnist", "test", root=data_root)
    monitor = DynamicsMonitor(SETTINGS, dataset, dataset, torch.device("cpu"))
    monitor.start(model)
    row = monitor.record(model)
    assert row["monitor_ics"] == [0.0, 0.0]
    # Shifting the last BN's bias of block 1 by b moves its output by b per element: ICS = b sqrt(d).
    with torch.no_grad():
        model.blocks[1].branch[4].bias += 0.5
    shifted = monitor.record(model)["monitor_ics"]
    assert shifted[0] == 0.0
    assert shifted[1] == pytest.approx(0.5 * (4 * 14 * 14) ** 0.5, rel=1e-5)
    assert not model.training  # the mode is left as it was
