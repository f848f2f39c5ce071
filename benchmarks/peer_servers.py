"""The servers :mod:`benchmarks.service_peers` compares, each a context manager that starts it on a
free loopback port, waits until it is ready and stops it (and all its children) on exit; and the
peers' virtual environment, installed on first use."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.local_server import Server, start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
#: What the peers' environment holds (pinned: a figure is only comparable on the same versions).
PEER_REQUIREMENTS = ("mlserver==1.7.1", "ray[serve]==2.55.1")


def ensure_peers_venv(path: Path) -> Path:
    """The Python of ``path``, a virtual environment with :data:`PEER_REQUIREMENTS` (created and
    installed when missing or stale). It sees the product's packages (torch, numpy, ...) after its
    own, so torch is not installed twice and the peers' pins never touch the product's."""
    python = path / "bin" / "python"
    stamp = path / ".installed"
    wanted = "\n".join(PEER_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"installing {', '.join(PEER_REQUIREMENTS)} into {path} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "zz_lapguard_product.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEER_REQUIREMENTS], check=True)
    stamp.write_text(wanted)
    return python


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def model_name(bundle: Path) -> str:
    return str(json.loads((bundle / "manifest.json").read_text())["name"])


class PeerServer:
    """One server process; subclasses say how to start it and where it answers."""

    name = ""

    def __init__(
        self,
        bundle: Path,
        peers_python: Path | None,
        torch_threads: int | None = None,
        *,
        in_process: bool = False,
    ) -> None:
        self.bundle, self.peers_python = bundle.resolve(), peers_python
        self.in_process = in_process  # lapguard only: in a thread of this process (small mode)
        self.env = {"LAPGUARD_TORCH_THREADS": str(torch_threads)} if torch_threads else {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: Server | None = None
        self.log = tempfile.TemporaryFile(mode="w+", prefix=f"peer-{self.name}-")  # noqa: SIM115

    infer_path = "/"
    ready_path = "/"

    @property
    def infer_url(self) -> str:
        return self.url + self.infer_path

    def command(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self) -> PeerServer:
        # the repository root on the path: the peers' environment imports detector, service and
        # benchmarks.peers from this checkout (its .pth adds only the product's dependencies)
        env = {**os.environ, **self.env, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            self.command(), cwd=ROOT, env=env, stdout=self.log, stderr=self.log,
            start_new_session=True,
        )  # fmt: skip
        self.wait_ready(timeout=180)
        return self

    def wait_ready(self, timeout: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"{self.name} exited: {self.log.read()[-4000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{self.name} was not ready within {timeout:.0f} s")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then kill; then whatever it left in its session (Ray's raylet, workers)."""
        if self.process is None:
            return
        group = os.getpgid(self.process.pid)
        stop_server(self.process)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        self.process = None


class Lapguard(PeerServer):
    """``lapguard serve`` with the shipped defaults."""

    name = "lapguard"
    ready_path = "/readyz"

    def __enter__(self) -> PeerServer:
        self.process, self.url = start_server(
            self.bundle, flags=[], env=self.env, in_process=self.in_process
        )
        self.infer_path = f"/v2/models/{model_name(self.bundle)}/infer"
        return self

    def stop(self) -> None:
        """``lapguard serve`` shares this process's session: stop it alone."""
        if self.process is not None:
            stop_server(self.process)
            self.process = None


class MLServer(PeerServer):
    """MLServer 1.7 with the custom runtime, adaptive batching (64 images, 1 ms), no worker pool
    (``parallel_workers: 0``: the model runs in the server's process, as in the others)."""

    name = "mlserver"
    infer_path = "/v2/models/lapguard/infer"
    ready_path = "/v2/models/lapguard/ready"

    def command(self) -> list[str]:
        assert self.peers_python is not None
        folder = Path(tempfile.mkdtemp(prefix="mlserver-"))
        settings = {"http_port": self.port, "grpc_port": free_port(), "host": "127.0.0.1",
                    "parallel_workers": 0, "metrics_endpoint": None, "debug": False}  # fmt: skip
        (folder / "settings.json").write_text(json.dumps(settings))
        model = {"name": "lapguard", "implementation": "benchmarks.peers.mlserver_runtime.GuardRuntime",
                 "max_batch_size": 64, "max_batch_time": 0.001,
                 "parameters": {"uri": str(self.bundle)}}  # fmt: skip
        (folder / "model-settings.json").write_text(json.dumps(model))
        return [str(self.peers_python.parent / "mlserver"), "start", str(folder)]


class RayServe(PeerServer):
    """Ray Serve 2.55: one replica with all CPUs, ``@serve.batch`` of up to 64 requests."""

    name = "ray-serve"

    def command(self) -> list[str]:
        assert self.peers_python is not None
        python = str(self.peers_python)
        return [python, "-m", "benchmarks.peers.ray_app", str(self.bundle), str(self.port)]


class Floor(PeerServer):
    """The bare ASGI app, in the product's environment (it needs nothing else)."""

    name = "floor"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.peers.floor_app",
            str(self.bundle),
            str(self.port),
        ]


SERVERS: dict[str, type[PeerServer]] = {
    server.name: server for server in (Lapguard, MLServer, RayServe, Floor)
}
