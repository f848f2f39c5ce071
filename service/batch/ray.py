"""Batch scoring sharded over a Ray cluster (``lapguard score --engine ray``).

The driver discovers the inputs, resumes and writes the output exactly as in-process scoring
(:mod:`service.batch.runner`); what changes is where the network runs: a pool of Ray actors, each of
which loads the Guard from the bundle ONCE, receives batches (encoded file bytes or array items)
and returns their result rows. Batches are submitted round-robin, at most two per actor in
flight, and collected in submission order, so the rows come out in input order, as locally.

The bundle travels through Ray's object store and is verified (sha256) by every actor, so the
nodes of a multi-node cluster need lapguard installed but no shared file system. ``address``
connects to a running cluster (``ray start --head`` / ``ray start --address=HEAD:6379`` on the
nodes, then ``--ray-address HEAD:6379`` or ``auto``); without it a local Ray is started and
stopped again. Ray is optional: ``pip install 'lapguard[ray]'``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from detector.bundle import read_manifest
from detector.errors import ArtefactError, ConfigError, LapguardError
from service.batch.batches import prepare_batch, score_batch
from service.batch.inputs import (
    InputItem,
    InputLike,
    Payload,
    Unusable,
    describe_error,
    read_payload,
)
from service.batch.runner import RunOptions, ScoringSummary, run_scoring
from service.batch.writer import Row

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ConfigError(
            "the ray engine needs Ray: pip install 'lapguard[ray]' (or 'ray[data]'), "
            "or use --engine local"
        ) from error
    return ray


class GuardWorker:
    """A Ray actor's state: the Guard, loaded once from the bundle files it was sent."""

    def __init__(
        self, bundle_files: dict[str, bytes], device: str, target_fpr: float | None = None
    ) -> None:
        from detector.guard import Guard

        folder = Path(tempfile.mkdtemp(prefix="lapguard-bundle-"))
        try:
            for name, data in bundle_files.items():
                (folder / name).write_bytes(data)
            # checksums verified here
            self.guard = Guard.from_bundle(folder, device=device, target_fpr=target_fpr)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def score(self, payloads: Sequence[Payload | Unusable]) -> list[Row]:
        """The result rows of a batch of payloads, in order."""
        return score_batch(self.guard, prepare_batch(self.guard, payloads))


def bundle_files(bundle: Path) -> dict[str, bytes]:
    """The files of a bundle directory (verified by the actors when they load it)."""
    if not (bundle / "manifest.json").is_file():
        raise ArtefactError(
            f"{bundle} is not a bundle (no manifest.json); build one with `lapguard bundle`"
        )
    return {p.name: p.read_bytes() for p in sorted(bundle.iterdir()) if p.is_file()}


def score_inputs_ray(
    bundle: str | Path,
    inputs: Sequence[InputLike],
    out_path: str | Path,
    *,
    batch_size: int = 256,
    num_actors: int = 2,
    device: str = "auto",
    address: str | None = None,
    target_fpr: float | None = None,
    **options: Unpack[RunOptions],
) -> ScoringSummary:
    """Score ``inputs`` on ``num_actors`` Ray actors (one GPU each when the cluster has GPUs
    and ``device`` is not cpu) into ``out_path``, with the output of
    :func:`~service.batch.local.score_inputs` (``options``: see
    :func:`~service.batch.runner.run_scoring`), flagging at the bundle's operating point for
    ``target_fpr`` (checked here, before any actor starts)."""
    ray = import_ray()
    if batch_size < 1 or num_actors < 1:
        raise ConfigError("batch size and the number of Ray actors must be at least 1")
    files = bundle_files(Path(bundle))
    read_manifest(Path(bundle)).threshold_at(target_fpr)  # a wrong target fails before Ray starts

    def engine(pending: list[InputItem]) -> Iterator[list[Row]]:
        return _ray_results(
            ray,
            files,
            pending,
            batch_size=batch_size,
            num_actors=num_actors,
            device=device,
            address=address,
            target_fpr=target_fpr,
        )

    return run_scoring(inputs, out_path, engine, description="score (ray)", **options)


def _payloads(group: Sequence[InputItem]) -> list[Payload | Unusable]:
    """The group's payloads, arrays made contiguous (memory-mapped slices do not travel)."""
    loaded = [read_payload(item) for item in group]
    return [np.ascontiguousarray(p) if isinstance(p, np.ndarray) else p for p in loaded]


def _ray_results(
    ray: Any,
    files: dict[str, bytes],
    pending: list[InputItem],
    *,
    batch_size: int,
    num_actors: int,
    device: str,
    address: str | None,
    target_fpr: float | None,
) -> Iterator[list[Row]]:
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    actors: list[Any] = []
    try:
        resources = ray.cluster_resources()
        gpu = device != "cpu" and resources.get("GPU", 0) >= 1
        slots = int(resources.get("GPU" if gpu else "CPU", 1))
        batches = [pending[i : i + batch_size] for i in range(0, len(pending), batch_size)]
        count = max(1, min(num_actors, slots, len(batches)))
        worker = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(GuardWorker)
        files_ref = ray.put(files)
        actors = [worker.remote(files_ref, device, target_fpr) for _ in range(count)]
        window: deque[Any] = deque()
        for number, group in enumerate(batches):
            window.append(actors[number % count].score.remote(_payloads(group)))
            if len(window) >= 2 * count:
                yield _get(ray, window.popleft())
        while window:
            yield _get(ray, window.popleft())
    finally:
        for actor in actors:
            ray.kill(actor)
        if started_here:
            ray.shutdown()


def _get(ray: Any, ref: Any) -> list[Row]:
    try:
        rows: list[Row] = ray.get(ref)
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None) or error
        raise LapguardError(f"a Ray actor failed: {describe_error(cause)}") from error
    return rows
