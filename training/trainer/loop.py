"""Training loop for vanilla, LAP and RCE networks: checkpoints every epoch, resume, metrics.

The output directory is a saved network (loadable by ``detector.networks.load``) plus the
training record: train config, per-epoch metrics, logged steps, training curve and the last
checkpoint; its layout is :class:`training.rundir.ModelDir`.

Several processes (``torchrun --nproc_per_node=K -m training.cli.main train ...``, WORLD_SIZE > 1):
DistributedDataParallel over a process group (nccl on CUDA, gloo on CPU), each rank on its
share of the same seeded per-epoch order (DistributedSampler, batch size / K per rank, so a
step sees the single-process batch); the LAP multiplier follows the loss averaged over the
ranks; every rank resumes from the checkpoint and only rank 0 writes files.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from detector import artefacts, networks
from detector.errors import ArtefactError, ConfigError
from detector.taps import ResidualTaps
from training.data.datasets import class_names, dataset_info, load_dataset, subset, train_val_split
from training.plots import plot_training_curve
from training.rundir import CHECKPOINT_STATE, ModelDir
from training.trainer.config import TrainConfig
from training.trainer.initialization import init_weights
from training.trainer.losses import UzawaMultiplier, compute_loss, transport_cost
from training.trainer.monitors import DynamicsMonitor

CHECKPOINT_STATE_KEY = "lapguard_state"  # the checkpoint's state in its safetensors metadata

STEP_LOG_EVERY = 20


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _env_rank() -> tuple[int, int]:
    """(rank, world size) as torchrun sets them; (0, 1) for a single process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _init_distributed(device: torch.device) -> torch.device:
    """Join torchrun's process group (nccl on CUDA, gloo on CPU); this rank's device."""
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return device


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _mean_over_ranks(value: torch.Tensor) -> float:
    """A scalar averaged over the ranks (itself for a single process)."""
    if not _distributed():
        return value.item()
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _augmentation(x: torch.Tensor) -> torch.Tensor:
    """Random crop (4-pixel padding) and horizontal flip, on a batch, for CIFAR-style presets."""
    n, _, h, w = x.shape
    flip = torch.rand(n, device=x.device) < 0.5
    x = torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    padded = nn.functional.pad(x, (4, 4, 4, 4), mode="reflect")
    i, j = torch.randint(0, 9, (2,)).tolist()
    return padded[:, :, i : i + h, j : j + w]


def train_one_epoch(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    objective: str,
    multiplier: UzawaMultiplier,
    *,
    device: torch.device,
    grad_clip: float | None = None,
    augment: bool = False,
    amp: bool = False,
    step_log: list[dict[str, Any]] | None = None,
    progress: bool = True,
    description: str = "train",
) -> dict[str, float]:
    """One pass over ``loader``; returns mean loss terms and accuracy. LAP updates lambda per step."""
    model.train()
    totals = {"loss": 0.0, "task_loss": 0.0, "transport": 0.0, "correct": 0.0, "count": 0.0}
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if amp and device.type == "cuda"
        else nullcontext()
    )
    bar = tqdm(loader, desc=description, leave=False, disable=not progress, dynamic_ncols=True)
    network = model.module if isinstance(model, DistributedDataParallel) else model
    with ResidualTaps(network) as taps:
        for batch_index, (x, y) in enumerate(bar):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if augment:
                x = _augmentation(x)
            with autocast:
                logits = model(x)
                terms = compute_loss(objective, logits.float(), taps.outputs, y, multiplier.value)
            optimizer.zero_grad(set_to_none=True)
            terms.total.backward()
            taps.clear()
            if grad_clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            task = _mean_over_ranks(terms.task)
            if objective == "lap":
                multiplier.step(task)
            n = y.shape[0]
            totals["loss"] += terms.total.item() * n
            totals["task_loss"] += task * n
            totals["transport"] += terms.transport.item() * n
            totals["correct"] += (logits.argmax(1) == y).sum().item()
            totals["count"] += n
            if step_log is not None and batch_index % STEP_LOG_EVERY == 0:
                step_log.append(
                    {
                        "step": batch_index,
                        "task_loss": task,
                        "transport": terms.transport.item(),
                        "lambda": multiplier.value,
                    }
                )
            bar.set_postfix(
                loss=f"{task:.3f}", C=f"{terms.transport.item():.3f}", lam=f"{multiplier.value:.1f}"
            )
    if _distributed():  # sums over every rank's share
        summed = torch.tensor(list(totals.values()), dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        totals = dict(zip(totals, summed.tolist(), strict=True))
    count = max(totals.pop("count"), 1.0)
    return {
        "train_loss": totals["loss"] / count,
        "train_task_loss": totals["task_loss"] / count,
        "train_transport": totals["transport"] / count,
        "train_accuracy": totals["correct"] / count,
    }


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, float | None]:
    """Accuracy and transport cost (sum over blocks of mean r^2) of ``model`` in eval mode."""
    model.eval()
    correct = count = 0
    transport_sum = 0.0
    with ResidualTaps(model) as taps:
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x)
            correct += (logits.argmax(1) == y).sum().item()
            transport_sum += transport_cost(taps.outputs).item() * y.shape[0]
            count += y.shape[0]
            taps.clear()
    if count == 0:
        return {"accuracy": None, "transport": None}
    return {"accuracy": correct / count, "transport": transport_sum / count}


def _save_checkpoint(
    files: ModelDir, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    optim_state = optimizer.state_dict()
    for index, param_state in optim_state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().contiguous().cpu()
    state = dict(state, param_groups=optim_state["param_groups"])
    with artefacts.atomic_path(files.checkpoint_weights) as tmp:  # the state travels inside too
        save_file(tensors, str(tmp), metadata={CHECKPOINT_STATE_KEY: json.dumps(state)})
    artefacts.write_json(files.checkpoint_state, state, indent=2)


def _load_checkpoint(
    files: ModelDir, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    try:
        with safe_open(str(files.checkpoint_weights), "pt") as weights:
            inside = (weights.metadata() or {}).get(CHECKPOINT_STATE_KEY)
        # The weights' own state: an interruption between the two writes leaves the JSON file
        # one epoch behind them (checkpoints written before the state travelled inside: the file).
        state = json.loads(inside if inside is not None else files.checkpoint_state.read_text())
        tensors = load_file(str(files.checkpoint_weights))
    except (OSError, ValueError, SafetensorError) as error:  # JSONDecodeError is a ValueError
        raise ArtefactError(
            f"checkpoint in {files.path} is unreadable ({error}); delete {CHECKPOINT_STATE} to start over"
        ) from error
    model.load_state_dict(
        {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    )
    optim_state: dict[str, Any] = {"state": {}, "param_groups": state.pop("param_groups")}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            optim_state["state"].setdefault(int(index), {})[name] = value
    optimizer.load_state_dict(optim_state)
    return state


def train_and_validation_sets(config: TrainConfig, full_train: Dataset) -> tuple[Dataset, Dataset]:
    """What a network of ``config`` learns from and what it holds back to validate on, both
    from its data set's training split ``full_train``: a seeded ``val_fraction`` is held back;
    with ``train_subset``, that many images are learnt from and a tenth as many held back."""
    learnt, held_back = train_val_split(full_train, config.val_fraction, config.seed)
    train_set = subset(learnt, config.train_subset, config.seed)
    val_set: Dataset = held_back
    if config.train_subset is not None:
        val_set = subset(held_back, max(config.train_subset // 10, 1), config.seed)
    return train_set, val_set


class _LoaderOptions(TypedDict):
    batch_size: int
    num_workers: int


def _loaders(
    config: TrainConfig, root: str | Path | None, world_size: int = 1
) -> tuple[DataLoader, DataLoader, DataLoader, list[str]]:
    full_train = load_dataset(config.dataset, "train", root=root, verify=config.verify_data)
    names = class_names(config.dataset, full_train)
    train_set, val_set = train_and_validation_sets(config, full_train)
    test_set: Dataset = subset(
        load_dataset(config.dataset, "test", root=root, verify=config.verify_data),
        config.test_subset,
        config.seed,
    )
    common: _LoaderOptions = {"batch_size": config.batch_size, "num_workers": config.num_workers}
    generator = torch.Generator().manual_seed(config.seed)
    if world_size > 1:  # this rank's share of the seeded order (seed * 1000 + epoch, set per epoch)
        sampler: DistributedSampler[int] = DistributedSampler(
            train_set, shuffle=True, seed=config.seed * 1000, drop_last=False
        )
        per_rank: _LoaderOptions = {
            **common,
            "batch_size": math.ceil(config.batch_size / world_size),
        }
        train_loader = DataLoader(train_set, sampler=sampler, drop_last=False, **per_rank)
    else:
        train_loader = DataLoader(
            train_set, shuffle=True, drop_last=False, generator=generator, **common
        )
    eval_common: _LoaderOptions = {**common, "batch_size": max(config.batch_size, 256)}
    return (
        train_loader,
        DataLoader(val_set, **eval_common),
        DataLoader(test_set, **eval_common),
        names,
    )


def _check_config(config: TrainConfig, files: ModelDir) -> None:
    """Refuse a directory trained with another config."""
    if files.train_config_file.is_file():
        saved = artefacts.read_model(files.train_config_file, TrainConfig, what="training config")
        if saved.fingerprint() != config.fingerprint():
            raise ConfigError(
                f"{files.path} already holds a network trained with another config; choose a new --out"
            )


def _write_config(config: TrainConfig, files: ModelDir, rank: int) -> None:
    """Save the config (rank 0) once its data loaded and its network was built, so a config
    that fails either never claims the directory."""
    if rank == 0 and not files.train_config_file.is_file():
        # written whole, then renamed: other ranks never read half a file
        artefacts.write_text(files.train_config_file, config.model_dump_json(indent=2))


def _build_model(
    config: TrainConfig, names: list[str], device: torch.device
) -> tuple[networks.Network, networks.NetworkConfig]:
    """The initialised network (on ``device``) and the config it is saved with."""
    info = dataset_info(config.dataset)
    net_config = networks.NetworkConfig(
        architecture=config.architecture,
        arguments=dict(
            config.arguments, **({"negate_logits": True} if config.objective == "rce" else {})
        ),
        class_names=names,
        input_spec=info.input_spec(),
    )
    model = networks.build_network(net_config)
    init_weights(model, config.init, config.init_gain)
    model.to(device)
    return model, net_config


def _optimizer_and_multiplier(
    config: TrainConfig, model: nn.Module
) -> tuple[torch.optim.Optimizer, UzawaMultiplier]:
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    multiplier = UzawaMultiplier(
        config.lap.lambda0, config.lap.tau if config.objective == "lap" else 0.0, config.lap.every
    )
    return optimizer, multiplier


def _resume(
    files: ModelDir,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    multiplier: UzawaMultiplier,
) -> int:
    """Load the last checkpoint, if any, into the model, optimizer and multiplier; the number
    of epochs it holds (0 without one)."""
    if not files.checkpoint_state.is_file():
        return 0
    state = _load_checkpoint(files, model, optimizer)
    multiplier.load_state_dict(state["multiplier"])
    return int(state["epoch"])


def _for_ranks(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` wrapped in DistributedDataParallel (on this rank's device)."""
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def _lr_at(config: TrainConfig, epoch: int) -> float:
    return config.lr * config.gamma ** sum(1 for m in config.milestones if epoch >= m)


def _run_epoch(
    config: TrainConfig,
    epoch: int,
    trained: nn.Module,
    model: nn.Module,
    loaders: tuple[DataLoader, DataLoader, DataLoader],
    optimizer: torch.optim.Optimizer,
    multiplier: UzawaMultiplier,
    *,
    device: torch.device,
    progress: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Train one epoch and evaluate it: (the epoch's metrics row, its logged steps)."""
    train_loader, val_loader, test_loader = loaders
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(config, epoch)
    if isinstance(train_loader.sampler, DistributedSampler):
        train_loader.sampler.set_epoch(epoch)
    else:
        train_loader.generator.manual_seed(config.seed * 1000 + epoch)
    started = time.perf_counter()
    step_log: list[dict[str, Any]] = []
    train_metrics = train_one_epoch(
        trained,
        train_loader,
        optimizer,
        config.objective,
        multiplier,
        device=device,
        grad_clip=config.grad_clip,
        augment=config.augment,
        amp=config.amp,
        step_log=step_log,
        progress=progress,
        description=f"{config.name} epoch {epoch + 1}/{config.epochs}",
    )
    seconds = time.perf_counter() - started
    val = evaluate(model, val_loader, device)
    test = evaluate(model, test_loader, device)
    row = {
        "epoch": epoch + 1,
        "lr": _lr_at(config, epoch),
        "lambda": multiplier.value,
        **train_metrics,
        "val_accuracy": val["accuracy"],
        "test_accuracy": test["accuracy"],
        "test_transport": test["transport"],
        "epoch_seconds": seconds,
    }
    return row, step_log


def _save_epoch(
    files: ModelDir,
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    multiplier: UzawaMultiplier,
    epoch: int,
    epochs_done: list[dict[str, Any]],
    steps: list[dict[str, Any]],
) -> None:
    """Metrics, steps, checkpoint and training curve after ``epoch`` (rank 0 only)."""
    artefacts.write_jsonl(files.metrics_file, epochs_done)
    artefacts.write_jsonl(files.steps_file, steps)
    state = {
        "epoch": epoch + 1,
        "multiplier": multiplier.state_dict(),
        "fingerprint": config.fingerprint(),
    }
    _save_checkpoint(files, model, optimizer, state)
    plot_training_curve(steps, epochs_done, files.training_curve)


def _monitor(
    config: TrainConfig,
    loaders: tuple[DataLoader, DataLoader, DataLoader],
    model: nn.Module,
    device: torch.device,
) -> Any:
    """The config's dynamics monitor, started on ``model`` (None without monitors)."""
    if config.monitors is None:
        return None

    train_loader, val_loader, test_loader = loaders
    held_out = val_loader.dataset if len(val_loader.dataset) else test_loader.dataset  # type: ignore[arg-type]
    monitor = DynamicsMonitor(
        config.monitors, train_loader.dataset, held_out, device, seed=config.seed
    )
    monitor.start(model)
    return monitor


def train(
    config: TrainConfig, out: str | Path, *, root: str | Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train (or resume, or skip if finished) the network ``config`` describes into ``out``.

    Returns the last epoch's metrics. Re-running with the same config resumes from the last saved
    epoch; a different config in the same directory is refused.
    """
    files = ModelDir(out)
    files.path.mkdir(parents=True, exist_ok=True)
    rank, world_size = _env_rank()
    _check_config(config, files)
    epochs_done = files.read_metrics()
    if files.weights_file.is_file() and len(epochs_done) >= config.epochs:
        return epochs_done[-1]

    seed_everything(config.seed)
    device = networks.resolve_device(config.device)
    if world_size > 1:
        device = _init_distributed(device)
        progress = progress and rank == 0
    train_loader, val_loader, test_loader, names = _loaders(config, root, world_size)
    model, net_config = _build_model(config, names, device)
    _write_config(config, files, rank)
    optimizer, multiplier = _optimizer_and_multiplier(config, model)
    start_epoch = _resume(files, model, optimizer, multiplier)
    epochs_done = epochs_done[:start_epoch]
    steps = files.read_steps()
    # Wrapped after the checkpoint is loaded: DDP broadcasts rank 0's weights.
    trained = _for_ranks(model, device) if world_size > 1 else model

    last: dict[str, Any] = epochs_done[-1] if epochs_done else {}
    loaders = (train_loader, val_loader, test_loader)
    monitor = _monitor(config, loaders, model, device) if rank == 0 else None
    for epoch in range(start_epoch, config.epochs):
        last, step_log = _run_epoch(
            config,
            epoch,
            trained,
            model,
            loaders,
            optimizer,
            multiplier,
            device=device,
            progress=progress,
        )
        offset = epoch * len(train_loader)
        steps = [s for s in steps if s["step"] < offset]
        steps.extend({**s, "step": s["step"] + offset} for s in step_log)
        if monitor is not None:
            last.update(monitor.record(model))
        epochs_done.append(last)
        if rank != 0:
            continue
        _save_epoch(files, config, model, optimizer, multiplier, epoch, epochs_done, steps)
        if progress:
            tqdm.write(
                f"[{config.name}] epoch {epoch + 1}: test acc {last['test_accuracy']:.4f}, "
                f"val acc {last['val_accuracy']:.4f}, transport {last['test_transport']:.3f}, "
                f"lambda {multiplier.value:.1f}, {last['epoch_seconds']:.0f}s"
            )
    if rank == 0:
        networks.save(model.cpu(), files.path, net_config)
    if world_size > 1:
        dist.barrier()  # the other ranks return once the network is saved
        dist.destroy_process_group()
    return last
