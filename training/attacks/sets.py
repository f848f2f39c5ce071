"""The adversarial set store: generated sets saved with full precision, keyed by configuration,
resumable, and verified on load.

A set lives in ``CACHE_DIR/<attack>-<key>/`` as ``adversarial.npz`` (read with
``allow_pickle=False``) + ``manifest.json``. The key hashes everything that determines the result:
attack, resolved parameters, seed, the network's sha256 (of its ``model.safetensors``), the source
indices and the input images. Generation writes each finished batch to
``CACHE_DIR/<attack>-<key>.partial/``, so an interrupted run resumes where it stopped; the final
folder appears in one rename.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import save as safetensors_bytes
from tqdm.auto import tqdm

from detector import networks
from detector.artefacts import (
    load_npz,
    read_json,
    read_model,
    save_npz,
    sha256_bytes,
    sha256_file,
    sha256_json,
    write_json,
)
from detector.errors import ArtefactError, ConfigError, InputError
from detector.networks import Network
from training.attacks.registry import (
    AttackParams,
    AttackRunner,
    batch_seed,
    batch_slices,
    check_inputs,
    get_attack_spec,
    make_attack_params,
    predict_labels,
)
from training.data.network_images import attack_images
from training.rundir import RunDir

FORMAT_VERSION = 1
ARRAYS_FILE = "adversarial.npz"
MANIFEST_FILE = "manifest.json"
STATE_FILE = "state.json"
ARRAY_KEYS = ("x_adv", "indices", "labels", "clean_pred", "adv_pred", "success", "l2", "linf")
BatchCallback = Callable[[int, int], None]


class SetManifest(BaseModel):
    """What a stored adversarial set is and how it was made."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    key: str
    attack: str
    params: dict[str, Any]
    seed: int
    n: int = Field(ge=1)
    input_shape: list[int]
    network_sha256: str
    indices_sha256: str
    inputs_sha256: str
    arrays_sha256: str
    batch_size: int
    workers: int
    device: str
    engine: str = Field("local", description="where the last run attacked: local or ray")
    libraries: dict[str, str | None]
    wall_seconds: float = Field(description="elapsed generation time, summed over resumed runs")
    # Sum of the batches' own times (worker-seconds); None in sets written before it was recorded.
    batch_seconds: float | None = None
    seconds_per_image: float = Field(
        description="batch_seconds / n: the cost of one image on one worker"
    )
    success_rate: float
    created: str


@dataclass
class AdversarialSet:
    """A generated set. ``success`` is ``adv_pred != labels``; l2/linf are per-sample sizes of
    ``x_adv - x`` in the network's value range."""

    x_adv: np.ndarray
    indices: np.ndarray
    labels: np.ndarray
    clean_pred: np.ndarray
    adv_pred: np.ndarray
    success: np.ndarray
    l2: np.ndarray
    linf: np.ndarray
    manifest: dict[str, Any]
    path: Path | None = None
    from_cache: bool = field(default=False)

    def __len__(self) -> int:
        return len(self.x_adv)

    def summary(self) -> dict[str, float]:
        """Success rates (overall and on originally-correct images), median L2/L∞ of the
        successful samples, and seconds per image."""
        correct = self.clean_pred == self.labels
        won = self.success
        return {
            "n": float(len(self)),
            "clean_accuracy": float(correct.mean()),
            "success_rate": float(won.mean()),
            "success_rate_on_correct": float(won[correct].mean())
            if correct.any()
            else float("nan"),
            "median_l2": float(np.median(self.l2[won])) if won.any() else float("nan"),
            "median_linf": float(np.median(self.linf[won])) if won.any() else float("nan"),
            "seconds_per_image": float(self.manifest["seconds_per_image"]),
        }


# --------------------------------------------------------------------------------------------
# Checksums and keys
# --------------------------------------------------------------------------------------------
def network_sha256(model: Network | str | Path) -> str:
    """sha256 of the network's ``model.safetensors`` (for a model in memory: of the bytes
    :func:`detector.networks.save` would write)."""
    if isinstance(model, (str, Path)):
        weights = Path(model) / networks.WEIGHTS_FILE
        if not weights.is_file():
            raise ArtefactError(f"no weights at {weights}")
        return sha256_file(weights)
    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError("the network has no config: build it with build_network or load it")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    return sha256_bytes(safetensors_bytes(state, metadata={"architecture": config.architecture}))


def set_key(
    *, attack: str, params: dict[str, Any], seed: int, network: str, indices: str, inputs: str
) -> str:
    """The configuration hash naming a set (16 hex digits)."""
    payload = {
        "format": FORMAT_VERSION,
        "attack": attack,
        "params": params,
        "seed": seed,
        "network_sha256": network,
        "indices_sha256": indices,
        "inputs_sha256": inputs,
    }
    return sha256_json(payload)[:16]


def _libraries() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("lapguard", "torch", "numpy", "adversarial-robustness-toolbox", "pyautoattack"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# --------------------------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------------------------
def load_adversarial_set(
    directory: str | Path, *, expected_key: str | None = None
) -> AdversarialSet:
    """Load a stored set and verify it: manifest schema, array checksum, counts and shapes."""
    directory = Path(directory)
    manifest_path, arrays_path = directory / MANIFEST_FILE, directory / ARRAYS_FILE
    if not manifest_path.is_file():
        raise ArtefactError(f"no manifest at {manifest_path}")
    manifest = read_model(manifest_path, SetManifest, what="adversarial set manifest")
    if expected_key is not None and manifest.key != expected_key:
        raise ArtefactError(
            f"manifest {manifest_path} has key {manifest.key}, expected {expected_key}: delete the folder"
        )
    if not arrays_path.is_file():
        raise ArtefactError(f"no arrays at {arrays_path} (manifest {manifest_path} expects them)")
    if sha256_file(arrays_path) != manifest.arrays_sha256:
        raise ArtefactError(
            f"{arrays_path} does not match the checksum in {manifest_path}: delete the folder to regenerate"
        )
    arrays = load_npz(arrays_path)
    missing = [k for k in ARRAY_KEYS if k not in arrays]
    if missing:
        raise ArtefactError(f"{arrays_path} lacks arrays {', '.join(missing)}")
    n = manifest.n
    wrong = [k for k in ARRAY_KEYS if len(arrays[k]) != n]
    if wrong:
        raise ArtefactError(
            f"{arrays_path}: arrays {', '.join(wrong)} do not hold n={n} samples as {manifest_path} says"
        )
    if (
        list(arrays["x_adv"].shape) != [n, *manifest.input_shape]
        or arrays["x_adv"].dtype != np.float32
    ):
        raise ArtefactError(
            f"{arrays_path}: x_adv is {arrays['x_adv'].dtype}{list(arrays['x_adv'].shape)}, "
            f"{manifest_path} says float32{[n, *manifest.input_shape]}"
        )
    return AdversarialSet(
        **{k: arrays[k] for k in ARRAY_KEYS},
        manifest=manifest.model_dump(),
        path=directory,
        from_cache=True,
    )


# --------------------------------------------------------------------------------------------
# Generation with resume and worker processes
# --------------------------------------------------------------------------------------------
def _batch_path(partial: Path, b: int) -> Path:
    return partial / f"batch-{b:06d}.npz"


def attack_batch(
    runner: AttackRunner, x: np.ndarray, y: np.ndarray, b: int, seed: int
) -> dict[str, np.ndarray]:
    """Attack batch ``b`` of a set generated with ``seed``: the arrays of its batch file
    (``x_adv``, ``clean_pred``, ``adv_pred`` and the ``seconds`` it took)."""
    start = time.perf_counter()
    x_adv = runner.run_batch(x, y, seed=batch_seed(seed, b))
    clean = predict_labels(runner.model, x, device=runner.device)
    adv = predict_labels(runner.model, x_adv, device=runner.device)
    seconds = time.perf_counter() - start
    return {"x_adv": x_adv, "clean_pred": clean, "adv_pred": adv, "seconds": np.asarray(seconds)}


def write_batch(partial: Path, b: int, arrays: dict[str, np.ndarray]) -> float:
    """Store a finished batch in the set's partial folder; the seconds it took to attack."""
    missing = [k for k in ("x_adv", "clean_pred", "adv_pred", "seconds") if k not in arrays]
    if missing:
        raise ArtefactError(f"batch {b} lacks arrays {', '.join(missing)}")
    save_npz(_batch_path(partial, b), **arrays)
    return float(arrays["seconds"])


def _run_one(
    runner: AttackRunner, x: np.ndarray, y: np.ndarray, b: int, seed: int, partial: Path
) -> float:
    """Attack batch ``b``, write its file, return the seconds it took."""
    return write_batch(partial, b, attack_batch(runner, x, y, b, seed))


_WORKER: dict[str, Any] = {}


def _worker_init(
    model_dir: str, attack: str, params: dict[str, Any], batch_size: int, device: str, threads: int
) -> None:
    torch.set_num_threads(threads)
    model = networks.load(model_dir, device=device)
    _WORKER["runner"] = AttackRunner(model, attack, params, batch_size=batch_size, device=device)


def _worker_batch(
    x: np.ndarray, y: np.ndarray, b: int, seed: int, partial: str
) -> tuple[int, float]:
    return b, _run_one(_WORKER["runner"], x, y, b, seed, Path(partial))


def _finished_batches(partial: Path, slices: list[slice]) -> dict[int, float]:
    """Batches already on disk (a batch file that cannot be read is removed and redone)."""
    done: dict[int, float] = {}
    for b, part in enumerate(slices):
        path = _batch_path(partial, b)
        if not path.is_file():
            continue
        try:
            data = load_npz(path)
            if len(data["x_adv"]) != part.stop - part.start:
                raise ArtefactError(f"{path} holds {len(data['x_adv'])} samples")
            done[b] = float(data["seconds"])
        except (ArtefactError, KeyError):
            path.unlink()
    return done


def _open_partial(partial: Path, key: str, batch_size: int, n: int) -> int:
    """Create or reopen the partial folder; returns the batch size to use (the stored one on resume)."""
    state_path = partial / STATE_FILE
    if state_path.is_file():
        try:
            state = read_json(state_path)
            if state["key"] == key and state["n"] == n:
                return int(state["batch_size"])
        except (ArtefactError, KeyError, TypeError, ValueError):
            pass
        shutil.rmtree(partial)  # a partial set we cannot trust: start again
    partial.mkdir(parents=True, exist_ok=True)
    state = {"key": key, "n": n, "batch_size": batch_size, "wall_seconds": 0.0}
    write_json(state_path, state, indent=None)
    return batch_size


def _add_wall_seconds(partial: Path, seconds: float) -> float:
    state_path = partial / STATE_FILE
    state = read_json(state_path)
    state["wall_seconds"] = float(state.get("wall_seconds", 0.0)) + seconds
    write_json(state_path, state, indent=None)
    return state["wall_seconds"]


def _run_parallel(
    pending: list[int],
    *,
    x: np.ndarray,
    y: np.ndarray,
    slices: list[slice],
    partial: Path,
    model_dir: Path,
    attack: str,
    params: dict[str, Any],
    batch_size: int,
    device: str,
    seed: int,
    workers: int,
    finished: Callable[[int], None],
) -> None:
    threads = max(1, (os.cpu_count() or 1) // workers)
    context = multiprocessing.get_context("spawn")
    init = (str(model_dir), attack, params, batch_size, device, threads)
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_worker_init, initargs=init
    ) as pool:
        futures: set[Future[tuple[int, float]]] = {
            pool.submit(_worker_batch, x[slices[b]], y[slices[b]], b, seed, str(partial))
            for b in pending
        }
        try:
            while futures:
                ready, futures = wait(futures, return_when=FIRST_COMPLETED)
                for future in ready:
                    b, _ = future.result()
                    finished(b)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def _assemble(
    partial: Path,
    final: Path,
    *,
    x: np.ndarray,
    y: np.ndarray,
    indices: np.ndarray,
    slices: list[slice],
    manifest: dict[str, Any],
) -> AdversarialSet:
    """Join the batch files into the final set and move it into place in one rename."""
    batches = [load_npz(_batch_path(partial, b)) for b in range(len(slices))]
    x_adv = np.concatenate([b["x_adv"] for b in batches]).astype(np.float32, copy=False)
    clean_pred = np.concatenate([b["clean_pred"] for b in batches]).astype(np.int64)
    adv_pred = np.concatenate([b["adv_pred"] for b in batches]).astype(np.int64)
    batch_seconds = float(sum(float(b["seconds"]) for b in batches))
    delta = (x_adv.astype(np.float64) - x.astype(np.float64)).reshape(len(x), -1)
    arrays = {
        "x_adv": x_adv,
        "indices": indices.astype(np.int64),
        "labels": y.astype(np.int64),
        "clean_pred": clean_pred,
        "adv_pred": adv_pred,
        "success": adv_pred != y,
        "l2": np.linalg.norm(delta, axis=1).astype(np.float32),
        "linf": np.abs(delta).max(axis=1).astype(np.float32),
    }
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save_npz(staging / ARRAYS_FILE, **arrays)
        manifest = {
            **manifest,
            "arrays_sha256": sha256_file(staging / ARRAYS_FILE),
            "batch_seconds": batch_seconds,
            "seconds_per_image": batch_seconds / len(x),
            "success_rate": float(arrays["success"].mean()),
        }
        validated = SetManifest.model_validate(manifest)
        (staging / MANIFEST_FILE).write_text(validated.model_dump_json(indent=2))
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same set first: keep its copy.
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(partial, ignore_errors=True)
            return load_adversarial_set(final, expected_key=validated.key)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(partial, ignore_errors=True)
    return AdversarialSet(**arrays, manifest=validated.model_dump(), path=final, from_cache=False)


@dataclass
class _SetPlan:
    """A requested set, checked and keyed: what to attack, with what, and the cache key."""

    attack: str
    params: AttackParams
    seed: int
    net: Network
    model_dir: Path | None
    x: np.ndarray
    y: np.ndarray
    indices: np.ndarray
    network_sha256: str
    indices_sha256: str
    inputs_sha256: str
    key: str

    @property
    def params_dict(self) -> dict[str, Any]:
        return self.params.model_dump(mode="json")


def check_set_options(seed: int, batch_size: int | None) -> None:
    """An attack seed numpy's SeedSequence takes (a non-negative integer) and a batch size of at
    least 1 (None: the attack's own)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"the attack seed must be a non-negative integer, got {seed!r}")
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}")


def _plan_set(
    model: Network | str | Path,
    x: np.ndarray,
    y: np.ndarray,
    indices: np.ndarray,
    attack: str,
    params: dict[str, Any] | None,
    *,
    seed: int,
    workers: int,
) -> _SetPlan:
    """Check the request (before anything is written) and compute the set's key."""
    get_attack_spec(attack)
    resolved = make_attack_params(attack, params)
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    model_dir: Path | None = None
    if isinstance(model, (str, Path)):
        model_dir = Path(model)
        net = networks.load(model_dir, device="cpu")
    else:
        net = model
    x, y = check_inputs(net, x, y)
    indices = np.asarray(indices)
    if indices.shape != (len(x),) or not np.issubdtype(indices.dtype, np.integer):
        raise InputError(f"indices must be {len(x)} integers, got {indices.dtype}{indices.shape}")
    net_sha = network_sha256(model_dir if model_dir is not None else net)
    indices_sha = sha256_bytes(indices.astype(np.int64).tobytes())
    inputs_sha = sha256_bytes(str(x.shape).encode(), x.tobytes(), y.tobytes())
    key = set_key(
        attack=attack,
        params=resolved.model_dump(mode="json"),
        seed=seed,
        network=net_sha,
        indices=indices_sha,
        inputs=inputs_sha,
    )
    return _SetPlan(
        attack, resolved, seed, net, model_dir, x, y, indices, net_sha, indices_sha, inputs_sha, key
    )


class _BatchProgress:
    """The progress bar and the wall-time record of one generation run. Wall time goes to
    state.json after every batch, so a killed run loses at most one batch of it."""

    def __init__(
        self, bar: Any, partial: Path, slices: list[slice], on_batch: BatchCallback | None
    ) -> None:
        self.bar, self.partial, self.slices, self.on_batch = bar, partial, slices, on_batch
        self.last = time.perf_counter()

    def tick(self) -> float:
        """Add the time since the last tick to state.json; the total so far."""
        now = time.perf_counter()
        total = _add_wall_seconds(self.partial, now - self.last)
        self.last = now
        return total

    def finished(self, b: int) -> None:
        self.bar.update(self.slices[b].stop - self.slices[b].start)
        self.tick()
        if self.on_batch is not None:
            self.on_batch(b, len(self.slices))


def announce_duration(
    attack: str, per_image: float, pending: list[int], slices: list[slice], workers: int
) -> None:
    """Say how long the ``pending`` batches will take at ``per_image`` seconds on ``workers``."""
    rest = sum(slices[i].stop - slices[i].start for i in pending)
    parallel = min(workers, len(pending))
    tqdm.write(
        f"{attack}: {per_image:.1f} s/image; about {per_image * rest / parallel / 60:.1f} min "
        f"for the {rest} remaining image(s) on {parallel} worker(s)",
        file=sys.stderr,
    )


def _network_dir(plan: _SetPlan, partial: Path, device: torch.device) -> Path:
    """The directory workers load the network from: the given one, or (for a network in
    memory) a copy saved in the partial folder."""
    if plan.model_dir is not None:
        return plan.model_dir
    model_dir = partial / "network"
    networks.save(plan.net.cpu(), model_dir)
    plan.net.to(device)
    return model_dir


# --------------------------------------------------------------------------------------------
# Batch engines: where the pending batches of a set are attacked (local processes are built in)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchJob:
    """The batches of one set as an engine sees them: the attack, the network's directory and
    checksum, the images, the slices, and the partial folder each finished batch goes to
    (through :func:`write_batch`, as locally). ``device`` is the one asked for (e.g. ``auto``)."""

    attack: str
    params: dict[str, Any]
    seed: int
    batch_size: int
    device: str
    model_dir: Path
    network_sha256: str
    x: np.ndarray
    y: np.ndarray
    slices: list[slice]
    partial: Path

    def images(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Images and labels of batch ``b``."""
        return self.x[self.slices[b]], self.y[self.slices[b]]

    def size(self, b: int) -> int:
        return self.slices[b].stop - self.slices[b].start


class EngineRun(NamedTuple):
    """How an engine ran one run's batches, as the set's manifest records it."""

    engine: str
    workers: int
    device: str


class BatchEngine(Protocol):
    """Attacks a set's pending batches somewhere else than in this process (e.g. on Ray)."""

    def run(
        self, job: BatchJob, pending: list[int], finished: Callable[[int], None], *, progress: bool
    ) -> EngineRun:
        """Attack every batch of ``pending``; write each with :func:`write_batch` into
        ``job.partial`` and call ``finished(b)`` right after."""
        ...


def _batch_job(
    plan: _SetPlan,
    partial: Path,
    slices: list[slice],
    batch_size: int,
    device: str,
    net_device: torch.device,
) -> BatchJob:
    return BatchJob(
        attack=plan.attack,
        params=plan.params_dict,
        seed=plan.seed,
        batch_size=batch_size,
        device=device,
        model_dir=_network_dir(plan, partial, net_device),
        network_sha256=plan.network_sha256,
        x=plan.x,
        y=plan.y,
        slices=slices,
        partial=partial,
    )


def _generate_pending(
    plan: _SetPlan,
    runner: AttackRunner,
    partial: Path,
    slices: list[slice],
    pending: list[int],
    tracker: _BatchProgress,
    *,
    batch_size: int,
    workers: int,
    progress: bool,
) -> None:
    """Attack every pending batch: serially, or (``workers`` > 1) in spawned processes. A slow
    attack times its first batch here and announces how long the rest will take."""
    x, y = plan.x, plan.y

    def serial(b: int) -> float:
        seconds = _run_one(runner, x[slices[b]], y[slices[b]], b, plan.seed, partial)
        tracker.finished(b)
        return seconds

    pending = list(pending)
    if pending and get_attack_spec(plan.attack).slow:
        b = pending.pop(0)
        per_image = serial(b) / (slices[b].stop - slices[b].start)
        if pending and progress:
            announce_duration(plan.attack, per_image, pending, slices, workers)
    if not (pending and workers > 1):
        for b in pending:
            serial(b)
        return
    _run_parallel(
        pending,
        x=x,
        y=y,
        slices=slices,
        partial=partial,
        model_dir=_network_dir(plan, partial, runner.device),
        attack=plan.attack,
        params=plan.params_dict,
        batch_size=batch_size,
        device=str(runner.device),
        seed=plan.seed,
        workers=workers,
        finished=tracker.finished,
    )


def _set_manifest(
    plan: _SetPlan, *, batch_size: int, used: EngineRun, wall: float
) -> dict[str, Any]:
    """The manifest fields known before the set is assembled."""
    return {
        "format_version": FORMAT_VERSION,
        "key": plan.key,
        "attack": plan.attack,
        "params": plan.params_dict,
        "seed": plan.seed,
        "n": len(plan.x),
        "input_shape": list(plan.x.shape[1:]),
        "network_sha256": plan.network_sha256,
        "indices_sha256": plan.indices_sha256,
        "inputs_sha256": plan.inputs_sha256,
        "batch_size": batch_size,
        "workers": used.workers,
        "device": used.device,
        "engine": used.engine,
        "libraries": _libraries(),
        "wall_seconds": wall,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _open_runner(
    plan: _SetPlan, partial: Path, batch_size: int | None, device: torch.device
) -> tuple[AttackRunner, int]:
    """The attack runner and the batch size to slice by: the one stored in the (created or
    reopened) partial folder when resuming."""
    runner = AttackRunner(plan.net, plan.attack, plan.params, batch_size=batch_size, device=device)
    partial.parent.mkdir(parents=True, exist_ok=True)
    size = _open_partial(partial, plan.key, runner.batch_size, len(plan.x))
    if size != runner.batch_size:
        runner = AttackRunner(plan.net, plan.attack, plan.params, batch_size=size, device=device)
    return runner, size


def get_or_generate(
    cache_dir: str | Path,
    model: Network | str | Path,
    x: np.ndarray,
    y: np.ndarray,
    indices: np.ndarray,
    attack: str,
    params: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    batch_size: int | None = None,
    device: str | torch.device = "auto",
    workers: int = 1,
    progress: bool = True,
    on_batch: BatchCallback | None = None,
    engine: BatchEngine | None = None,
) -> AdversarialSet:
    """The adversarial set of ``x`` (true labels ``y``, source ``indices``) under ``attack``:
    loaded from ``cache_dir`` when this exact configuration was generated before, otherwise
    generated (resuming finished batches of an interrupted run) and stored.

    ``model`` is a saved network directory or a network in memory. ``workers`` > 1 runs batches in
    spawned processes that load the network from its directory; an ``engine`` (e.g.
    :class:`training.attacks.ray_engine.RayEngine`) runs them elsewhere instead. Every batch is seeded
    from ``(seed, batch index)``, so the set is the same wherever its batches ran.
    ``on_batch(b, n_batches)`` is called after each newly generated batch.
    """
    if engine is not None and workers != 1:
        raise ConfigError("workers sets local processes; an engine chooses its own workers")
    check_set_options(seed, batch_size)
    plan = _plan_set(model, x, y, indices, attack, params, seed=seed, workers=workers)
    final = Path(cache_dir) / f"{attack}-{plan.key}"
    partial = Path(cache_dir) / f"{attack}-{plan.key}.partial"
    if final.is_dir():
        if partial.exists():  # left behind after the final rename
            shutil.rmtree(partial, ignore_errors=True)
        return load_adversarial_set(final, expected_key=plan.key)

    device_t = networks.resolve_device(device)
    runner, size = _open_runner(plan, partial, batch_size, device_t)
    slices = batch_slices(len(plan.x), size)
    done = _finished_batches(partial, slices)
    pending = [b for b in range(len(slices)) if b not in done]
    done_images = sum(slices[b].stop - slices[b].start for b in done)
    bar = tqdm(
        total=len(plan.x),
        initial=done_images,
        desc=attack,
        unit="img",
        disable=not progress,
        dynamic_ncols=True,
    )
    with bar:
        tracker = _BatchProgress(bar, partial, slices, on_batch)
        try:
            if engine is None or not pending:
                _generate_pending(
                    plan,
                    runner,
                    partial,
                    slices,
                    pending,
                    tracker,
                    batch_size=size,
                    workers=workers,
                    progress=progress,
                )
                used = EngineRun("local", workers, str(device_t))
            else:
                job = _batch_job(plan, partial, slices, size, str(device), device_t)
                used = engine.run(job, pending, tracker.finished, progress=progress)
        finally:
            wall = tracker.tick()
    manifest = _set_manifest(plan, batch_size=size, used=used, wall=wall)
    return _assemble(
        partial, final, x=plan.x, y=plan.y, indices=plan.indices, slices=slices, manifest=manifest
    )


# --------------------------------------------------------------------------------------------
# Run directories (layout: training/rundir.py): sets of network <name> in RUN/attacks/<name>/
# --------------------------------------------------------------------------------------------
def attack_run(
    run_dir: str | Path,
    attack: str,
    params: dict[str, Any] | None = None,
    *,
    n: int | None = 1000,
    split: str = "test",
    model: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    device: str | torch.device = "auto",
    workers: int = 1,
    root: str | Path | None = None,
    progress: bool = True,
    engine: BatchEngine | None = None,
) -> dict[str, AdversarialSet]:
    """Attack every network of a run directory (or the one named ``model``) on the first ``n``
    images of ``split``; sets are cached in ``DIR/attacks/<model>/``. Parameters and the run
    directory are checked before anything is written. ``engine``: see :func:`get_or_generate`."""
    make_attack_params(attack, params)
    if n is not None and n < 1:
        raise ConfigError(f"n must be positive, got {n}")
    check_set_options(seed, batch_size)  # before any network or image is loaded
    run = RunDir(run_dir)
    sets: dict[str, AdversarialSet] = {}
    for name, model_dir in run.networks(model).items():
        x, y, indices = attack_images(model_dir, split=split, n=n, seed=0, root=root)
        sets[name] = get_or_generate(
            run.attacks(name),
            model_dir,
            x,
            y,
            indices,
            attack,
            params,
            seed=seed,
            batch_size=batch_size,
            device=device,
            workers=workers,
            progress=progress,
            engine=engine,
        )
    return sets
