"""Adversarial sets attacked on Ray (``lapguard attack --engine ray``): the slow attacks (CW,
DeepFool, HopSkipJump, Boundary, AutoAttack) sharded over the workers of a cluster.

The driver plans, resumes, writes and assembles the set exactly as a local run
(:func:`training.attacks.sets.get_or_generate`); only the batches run elsewhere. Each worker (a
Ray actor) receives the network as its two files through the object store (``config.json`` and
``model.safetensors``: no pickled model, and no shared file system needed), checks the weights'
sha256, loads it once and builds the attack once. Batches are handed out round-robin, two in
flight per worker, and a worker that returns one takes the next pending batch; the driver writes
each returned batch into the set's partial folder with the writer of the local run
(:func:`~training.attacks.sets.write_batch`). Every batch is seeded from ``(seed, batch index)``,
so the set is byte for byte the local one, and a set interrupted on Ray resumes locally, or the
other way round.

Without an address a local Ray is started on first use and stopped by :meth:`RayEngine.close`;
``address`` (``HOST:6379`` or ``auto``) joins a running cluster whose
nodes have ``lapguard[attacks,ray]`` installed. Ray is optional: ``pip install 'lapguard[ray]'``.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detector import networks
from detector.artefacts import sha256_bytes
from detector.errors import ArtefactError, ConfigError, LapguardError
from training.attacks.registry import AttackRunner, get_attack_spec
from training.attacks.sets import BatchJob, EngineRun, announce_duration, attack_batch, write_batch

#: Batches queued on each worker, so that none waits for the driver between two batches.
IN_FLIGHT = 2
#: Seconds to wait for a TCP connection to a cluster's address before calling it unreachable
#: (Ray itself retries for minutes and then exits the process).
CONNECT_TIMEOUT = 5.0


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ConfigError(
            "the ray engine needs Ray: pip install 'lapguard[ray]', or use --engine local"
        ) from error
    return ray


def check_reachable(address: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Raise a ConfigError unless ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``) accepts a
    TCP connection; ``auto`` and ``local`` are left to Ray."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"Ray address {address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise ConfigError(
            f"cannot reach the Ray cluster at {address} ({error}): start it with "
            "`ray start --head`, check the address, or leave out --ray-address for a local Ray"
        ) from error


def network_files(model_dir: Path) -> dict[str, bytes]:
    """The files a worker rebuilds the network from (its config and safetensors weights)."""
    names = (networks.CONFIG_FILE, networks.WEIGHTS_FILE)
    missing = [name for name in names if not (model_dir / name).is_file()]
    if missing:
        raise ArtefactError(f"{model_dir} lacks {', '.join(missing)}: not a saved network")
    return {name: (model_dir / name).read_bytes() for name in names}


class AttackWorker:
    """A Ray actor's state: the network, verified and loaded once, and the attack built once."""

    def __init__(
        self,
        files: dict[str, bytes],
        network_sha256: str,
        attack: str,
        params: dict[str, Any],
        batch_size: int,
        device: str,
        threads: int,
    ) -> None:
        if sha256_bytes(files[networks.WEIGHTS_FILE]) != network_sha256:
            raise ArtefactError(
                "the network weights sent to a Ray worker do not match their sha256"
            )
        torch.set_num_threads(threads)
        folder = Path(tempfile.mkdtemp(prefix="lapguard-network-"))
        try:
            for name, data in files.items():
                (folder / name).write_bytes(data)
            model = networks.load(folder, device=device)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.runner = AttackRunner(model, attack, params, batch_size=batch_size, device=device)

    def attack(self, x: np.ndarray, y: np.ndarray, b: int, seed: int) -> dict[str, np.ndarray]:
        """The arrays of batch ``b`` (what :func:`~training.attacks.sets.write_batch` stores)."""
        # Arrays from the object store are read-only: attack writable copies, as locally.
        return attack_batch(self.runner, np.array(x), np.array(y), b, seed)


class RayEngine:
    """A :class:`~training.attacks.sets.BatchEngine` running batches on Ray actors, one per CPU
    (one per GPU when the cluster has GPUs and the device asked for is not ``cpu``), or
    ``workers`` of them. Use it as a context manager: a local Ray it started is stopped on exit."""

    def __init__(
        self, *, address: str | None = None, workers: int | None = None, threads: int = 1
    ) -> None:
        if workers is not None and workers < 1:
            raise ConfigError(f"the number of Ray workers must be at least 1, got {workers}")
        if threads < 1:
            raise ConfigError(f"threads per Ray worker must be at least 1, got {threads}")
        self.ray = import_ray()
        if address is not None:
            check_reachable(address)
        self.address, self.workers, self.threads = address, workers, threads
        self._started = False

    def __enter__(self) -> RayEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the local Ray this engine started (a cluster it joined keeps running)."""
        if self._started:
            self.ray.shutdown()
            self._started = False

    def _connect(self) -> None:
        if self.ray.is_initialized():
            return
        try:
            self.ray.init(
                address=self.address,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        except (ConnectionError, RuntimeError, ValueError, SystemExit) as error:
            # SystemExit: Ray exits the process when a cluster stops answering mid-connection.
            where = self.address or "a local Ray"
            raise ConfigError(f"cannot start or join Ray ({where}): {error}") from error
        self._started = True

    def _placement(self, device: str, batches: int) -> tuple[int, str, dict[str, Any]]:
        """(number of actors, their device, their Ray resource options)."""
        resources = self.ray.cluster_resources()
        gpu = device != "cpu" and resources.get("GPU", 0) >= 1
        if device.startswith("cuda") and not gpu:
            raise ConfigError(f"device {device!r} asked for, but the Ray cluster has no GPU")
        slots = max(
            1, int(resources.get("GPU" if gpu else "CPU", 1) // (1 if gpu else self.threads))
        )
        count = max(1, min(self.workers or slots, slots, batches))
        options = {"num_cpus": self.threads, "num_gpus": 1 if gpu else 0}
        return count, "cuda" if gpu else "cpu", options

    def run(
        self, job: BatchJob, pending: list[int], finished: Callable[[int], None], *, progress: bool
    ) -> EngineRun:
        """Attack the ``pending`` batches of ``job`` on Ray; each is written as it comes back."""
        self._connect()
        count, device, options = self._placement(job.device, len(pending))
        worker = self.ray.remote(**options)(AttackWorker)
        files = self.ray.put(network_files(job.model_dir))
        arguments = (job.network_sha256, job.attack, job.params, job.batch_size, device)
        actors = [worker.remote(files, *arguments, self.threads) for _ in range(count)]
        announce = progress and get_attack_spec(job.attack).slow
        left = set(pending)
        try:
            for b, arrays in _results(self.ray, actors, job, pending):
                seconds = write_batch(job.partial, b, arrays)
                left.discard(b)
                finished(b)
                if announce and left:
                    announce_duration(
                        job.attack, seconds / job.size(b), sorted(left), job.slices, count
                    )
                    announce = False
        finally:
            for actor in actors:
                self.ray.kill(actor)
        return EngineRun("ray", count, device)


def _results(
    ray: Any, actors: list[Any], job: BatchJob, pending: list[int]
) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(batch, arrays) in the order the actors finish them: IN_FLIGHT batches per actor, handed
    out round-robin, then the next pending batch to whichever actor returned one."""
    queue = deque(pending)
    flight: dict[Any, tuple[int, Any]] = {}

    def submit(actor: Any) -> None:
        if queue:
            b = queue.popleft()
            x, y = job.images(b)
            flight[actor.attack.remote(x, y, b, job.seed)] = (b, actor)

    for _ in range(IN_FLIGHT):
        for actor in actors:
            submit(actor)
    while flight:
        (ref,), _ = ray.wait(list(flight), num_returns=1)
        b, actor = flight.pop(ref)
        arrays = _get(ray, ref, b)
        submit(actor)
        yield b, arrays


def _get(ray: Any, ref: Any, b: int) -> dict[str, np.ndarray]:
    """A batch's arrays; a worker's LapguardError is raised as is, any other failure as a
    LapguardError naming the batch."""
    try:
        arrays: dict[str, np.ndarray] = ray.get(ref)
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, LapguardError):
            raise cause from error
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
        raise LapguardError(f"a Ray worker failed on batch {b}: {reason}") from error
    return arrays
