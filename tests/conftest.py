"""Shared fixtures: the embedded data set, tiny seeded networks, and for the service tests a tiny
real bundle, its Guard, a live server on it and encoded images."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from filelock import FileLock
from PIL import Image

from detector.networks import InputSpec, NetworkConfig, build_network
from tests.live_server import LiveServer
from tests.service_helpers import (
    API_KEY,
    build_service_bundle,
    encode,
    server_settings,
    synthetic_images,
)
from training.data.datasets import FASHION_CLASSES, default_root, prepare_fashion_mnist


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs two workers on two cores), torch on one thread in each
    worker and in the processes tests start: two OpenMP teams on two busy cores stall in their
    barriers."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


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


# ---- the smoke pipeline, run once per session (pipeline, page and demo tests read it) -----------
def run_smoke_pipeline(out: Path, data_root: Path) -> int:
    """`lapguard pipeline --preset smoke --out OUT --root DATA_ROOT --no-progress`; its exit code."""
    from training.cli.main import main as cli_main

    command = ["pipeline", "--preset", "smoke", "--out", str(out), "--root", str(data_root)]
    return cli_main([*command, "--no-progress"])


def shared_path(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A path under the temporary folder every pytest-xdist worker of this run shares (this
    process's own folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, data_root: Path) -> Path:
    """A finished smoke run (~30 s), made once per test run by the first worker that asks for it
    (the others wait for it); read-only: copy it to change it."""
    run = shared_path(tmp_path_factory, "smoke") / "run"
    run.parent.mkdir(parents=True, exist_ok=True)
    done = run.parent / "finished"
    with FileLock(run.parent / "lock"):
        if not done.is_file():
            assert run_smoke_pipeline(run, data_root) == 0
            done.touch()
    return run


# ---- the service: a tiny real bundle and a live server ------------------------------------------
@pytest.fixture(scope="session")
def service_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny real bundle of the service tests (see `build_service_bundle`); read-only."""
    return build_service_bundle(tmp_path_factory.mktemp("service"))


@pytest.fixture(scope="module")
def guard(service_bundle: Path):
    """The bundle's Guard in process: the reference the served answers are compared with."""
    from detector.guard import Guard

    return Guard.from_bundle(service_bundle, device="cpu")


@pytest.fixture(scope="module")
def server(service_bundle: Path) -> Iterator[LiveServer]:
    """Loads the bundle itself in its lifespan (like `lapguard serve`), with an API key and small limits."""
    with LiveServer(server_settings(service_bundle)) as live:
        yield live


@pytest.fixture()
def client(server: LiveServer) -> Iterator[httpx.Client]:
    """An httpx client of `server` that sends the API key."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": API_KEY}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """Five 28x28 grayscale PNGs, a 40x40 RGB JPEG and a 320x240 RGB PNG (converted by the Guard:
    the large one takes the decode-in-a-thread path), a GIF."""
    arrays = (synthetic_images(6, seed=3)[:, 0] * 255).round().astype(np.uint8)
    blobs = [encode(a) for a in arrays[:5]]
    rgb = np.random.default_rng(4).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    large = np.asarray(Image.fromarray(rgb).resize((320, 240), Image.BILINEAR))
    return [*blobs, encode(rgb, "JPEG"), encode(large), encode(arrays[5], "GIF")]


# ---- a real redis-server (the query memory shared by replicas) ----------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server (Debian package, installed by `make system-tools`), stopped after."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make system-tools` (Debian redis-server)")
    directory: Path = tmp_path_factory.mktemp("redis")
    port = _free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)]
    command += ["--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)
