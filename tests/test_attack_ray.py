"""`lapguard attack --engine ray`: batches sharded over local Ray workers give the set of a local
run byte for byte, a half-finished local set is completed on Ray, and misuse fails clearly."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from detector import networks
from detector.artefacts import sha256_file
from detector.networks import InputSpec, NetworkConfig, build_network
from training.attacks.ray_engine import RayEngine
from training.attacks.sets import AdversarialSet, get_or_generate, load_adversarial_set
from training.cli.main import main
from training.data.datasets import load_dataset, to_arrays

# Tiny settings: the sets must be equal, not strong.
HSJ = {"max_iter": 2, "max_eval": 50, "init_eval": 10, "init_size": 20}


@pytest.fixture(scope="module")
def network(data_root: Path) -> networks.ObservableResNet:
    """A tiny network trained for a few steps, so that the attacks have something to flip."""
    torch.manual_seed(0)
    model = build_network(
        NetworkConfig(
            architecture="resnet9_mnist",
            arguments={"width": 4, "depth": 2, "hidden": 8},
            class_names=[f"c{i}" for i in range(10)],
            input_spec=InputSpec(channels=1, height=28, width=28, mean=[0.5], std=[0.5]),
        )
    )
    x, y = to_arrays(load_dataset("fashion-mnist", "train", root=data_root), 256, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for start in range(0, 256, 64):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            model(torch.from_numpy(x[start : start + 64])), torch.from_numpy(y[start : start + 64])
        )
        loss.backward()
        optimizer.step()
    return model.eval()


def _run_dir(folder: Path, network: networks.ObservableResNet) -> Path:
    """A run directory holding one network, models/vanilla."""
    model_dir = networks.save(network, folder / "models" / "vanilla")
    (model_dir / "train_config.json").write_text(json.dumps({"dataset": "fashion-mnist"}))
    return folder


def _stored(run: Path) -> dict[str, str]:
    """sha256 of every stored set's adversarial.npz, by set folder (attack-key)."""
    return {
        folder.name: sha256_file(folder / "adversarial.npz")
        for folder in sorted((run / "attacks" / "vanilla").iterdir())
    }


def test_ray_engine_writes_the_local_set_byte_for_byte(
    network: networks.ObservableResNet, data_root: Path, tmp_path: Path
) -> None:
    import ray

    local, on_ray = _run_dir(tmp_path / "local", network), _run_dir(tmp_path / "ray", network)
    common = ["--n", "8", "--batch-size", "2", "--device", "cpu", "--root", str(data_root)]
    common.append("--no-progress")
    for attack, params in (("fgm", ["--eps", "0.1"]), ("apgd", ["--param", "max_iter=3"])):
        assert main(["attack", "--run", str(local), "--attack", attack, *params, *common]) == 0
        ray_flags = ["--engine", "ray", "--ray-workers", "2"]
        assert (
            main(["attack", "--run", str(on_ray), "--attack", attack, *params, *common, *ray_flags])
            == 0
        )
    assert not ray.is_initialized()  # the local Ray it started is stopped again

    assert _stored(on_ray) == _stored(local) and len(_stored(local)) == 2
    for folder in (on_ray / "attacks" / "vanilla").iterdir():
        adv = load_adversarial_set(folder)
        assert adv.manifest["engine"] == "ray" and adv.manifest["workers"] == 2
        assert len(adv) == 8 and adv.manifest["batch_size"] == 2
    assert not list((on_ray / "attacks" / "vanilla").glob("*.partial"))


def test_a_set_interrupted_on_one_engine_is_completed_on_the_other_identically(
    network: networks.ObservableResNet, data_root: Path, tmp_path: Path
) -> None:
    x, y = to_arrays(load_dataset("fashion-mnist", "test", root=data_root), 4, seed=0)
    sets = {"hsj": (HSJ, None), "apgd": ({"max_iter": 3}, 2)}  # HSJ: batches of one image

    def make(folder: str, attack: str, **options: Any) -> AdversarialSet:
        params, size = sets[attack]
        return get_or_generate(
            tmp_path / folder,
            network,
            x,
            y,
            np.arange(4),
            attack,
            params,
            batch_size=size,
            device="cpu",
            progress=False,
            **options,
        )

    def stop_after(count: int) -> Callable[[int, int], None]:
        done: list[int] = []

        def on_batch(b: int, n: int) -> None:
            done.append(b)
            if len(done) == count:
                raise KeyboardInterrupt

        return on_batch

    with pytest.raises(KeyboardInterrupt):  # HSJ batches 0 and 1 made locally
        make("resumed", "hsj", on_batch=stop_after(2))
    on_ray: list[int] = []
    with RayEngine(workers=2) as engine:
        completed = {
            "hsj": make("resumed", "hsj", on_batch=lambda b, n: on_ray.append(b), engine=engine)
        }
        with pytest.raises(KeyboardInterrupt):  # one APGD batch made on Ray, the other killed
            make("resumed", "apgd", on_batch=stop_after(1), engine=engine)
    completed["apgd"] = make("resumed", "apgd")  # the rest, locally
    assert sorted(on_ray) == [2, 3]
    assert completed["hsj"].manifest["engine"] == "ray"
    assert completed["apgd"].manifest["engine"] == "local"
    for attack, resumed in completed.items():
        whole = make("whole", attack)
        assert resumed.manifest["arrays_sha256"] == whole.manifest["arrays_sha256"]
        assert sha256_file(resumed.path / "adversarial.npz") == sha256_file(
            whole.path / "adversarial.npz"
        )


# --------------------------------------------------------------------------------------------
# Misuse: clear errors, nothing written
# --------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ray-workers", "2"], "need --engine ray"),
        (["--engine", "ray", "--workers", "2"], "use --ray-workers"),
        (["--engine", "ray", "--ray-workers", "0"], "at least 1"),
        (["--engine", "ray", "--ray-address", "nowhere"], "not HOST:PORT"),
        (["--engine", "ray", "--ray-address", "127.0.0.1:PORT"], "cannot reach the Ray cluster"),
    ],
)
def test_bad_engine_flags_exit_2_and_write_nothing(
    network: networks.ObservableResNet, tmp_path: Path, capsys, flags: list[str], message: str
) -> None:
    run = _run_dir(tmp_path, network)
    flags = [f.replace("PORT", str(_free_port())) for f in flags]
    assert main(["attack", "--run", str(run), "--attack", "fgm", "--n", "2", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (run / "attacks").exists()


def test_without_ray_installed_the_error_says_how_to_install_it(
    network: networks.ObservableResNet, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    run = _run_dir(tmp_path, network)
    assert main(["attack", "--run", str(run), "--attack", "fgm", "--engine", "ray"]) == 2
    assert "pip install 'lapguard[ray]'" in capsys.readouterr().err
    assert not (run / "attacks").exists()
