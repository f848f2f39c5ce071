"""Training loop for vanilla, LAP and RCE networks: checkpoints every epoch, resume, metrics.

Output directory (a saved network, loadable by ``detector.networks.load``)::

    model.safetensors, config.json      the network (written when training finishes)
    train_config.json                   the TrainConfig, to re-run
    metrics.jsonl, steps.jsonl          per-epoch metrics and per-step loss terms
    training_curve.png
    checkpoint.safetensors + checkpoint.json   model + optimizer state after the last epoch

Several processes (``torchrun --nproc_per_node=K -m training.cli train ...``, WORLD_SIZE > 1):
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
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm.auto import tqdm

from detector import networks
from detector.errors import ArtefactError, ConfigError
from detector.taps import ResidualTaps
from training.config import TrainConfig
from training.data import class_names, dataset_info, load_dataset, subset, train_val_split
from training.initialization import init_weights
from training.losses import UzawaMultiplier, compute_loss, transport_cost
from training.plots import plot_training_curve

CHECKPOINT_WEIGHTS = "checkpoint.safetensors"
CHECKPOINT_STATE = "checkpoint.json"
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
    out: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    optim_state = optimizer.state_dict()
    for index, param_state in optim_state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.detach().contiguous().cpu()
    state = dict(state, param_groups=optim_state["param_groups"])
    tmp = out / (CHECKPOINT_WEIGHTS + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(out / CHECKPOINT_WEIGHTS)
    tmp_state = out / (CHECKPOINT_STATE + ".tmp")
    tmp_state.write_text(json.dumps(state, indent=2))
    tmp_state.replace(out / CHECKPOINT_STATE)


def _load_checkpoint(
    out: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    try:
        state = json.loads((out / CHECKPOINT_STATE).read_text())
        tensors = load_file(str(out / CHECKPOINT_WEIGHTS))
    except (OSError, ValueError, json.JSONDecodeError) as error:
        raise ArtefactError(
            f"checkpoint in {out} is unreadable ({error}); delete {CHECKPOINT_STATE} to start over"
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


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _loaders(
    config: TrainConfig, root: str | Path | None, world_size: int = 1
) -> tuple[DataLoader, DataLoader, DataLoader, list[str]]:
    full_train = load_dataset(config.dataset, "train", root=root, verify=config.verify_data)
    names = class_names(config.dataset, full_train)
    train_set, val_set = train_val_split(full_train, config.val_fraction, config.seed)
    train_set = subset(train_set, config.train_subset, config.seed)
    if config.train_subset is not None:
        val_set = subset(val_set, max(config.train_subset // 10, 1), config.seed)
    test_set: Dataset = subset(
        load_dataset(config.dataset, "test", root=root, verify=config.verify_data),
        config.test_subset,
        config.seed,
    )
    common = {"batch_size": config.batch_size, "num_workers": config.num_workers}
    generator = torch.Generator().manual_seed(config.seed)
    if world_size > 1:  # this rank's share of the seeded order (seed * 1000 + epoch, set per epoch)
        sampler = DistributedSampler(
            train_set, shuffle=True, seed=config.seed * 1000, drop_last=False
        )
        per_rank = dict(common, batch_size=math.ceil(config.batch_size / world_size))
        train_loader = DataLoader(train_set, sampler=sampler, drop_last=False, **per_rank)
    else:
        train_loader = DataLoader(
            train_set, shuffle=True, drop_last=False, generator=generator, **common
        )
    eval_common = dict(common, batch_size=max(config.batch_size, 256))
    return (
        train_loader,
        DataLoader(val_set, **eval_common),
        DataLoader(test_set, **eval_common),
        names,
    )


def train(
    config: TrainConfig, out: str | Path, *, root: str | Path | None = None, progress: bool = True
) -> dict[str, Any]:
    """Train (or resume, or skip if finished) the network ``config`` describes into ``out``.

    Returns the last epoch's metrics. Re-running with the same config resumes from the last saved
    epoch; a different config in the same directory is refused.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world_size = _env_rank()
    config_path = out / "train_config.json"
    if config_path.is_file():
        saved = TrainConfig.model_validate_json(config_path.read_text())
        if saved.fingerprint() != config.fingerprint():
            raise ConfigError(
                f"{out} already holds a network trained with another config; choose a new --out"
            )
    elif rank == 0:  # written whole, then renamed: other ranks never read half a file
        config_path.with_suffix(".json.tmp").write_text(config.model_dump_json(indent=2))
        config_path.with_suffix(".json.tmp").replace(config_path)

    metrics_path, steps_path = out / "metrics.jsonl", out / "steps.jsonl"
    epochs_done = _read_jsonl(metrics_path)
    if (out / networks.WEIGHTS_FILE).is_file() and len(epochs_done) >= config.epochs:
        return epochs_done[-1]

    seed_everything(config.seed)
    device = networks.resolve_device(config.device)
    if world_size > 1:
        device = _init_distributed(device)
        progress = progress and rank == 0
    train_loader, val_loader, test_loader, names = _loaders(config, root, world_size)
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
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    multiplier = UzawaMultiplier(
        config.lap.lambda0, config.lap.tau if config.objective == "lap" else 0.0, config.lap.every
    )

    start_epoch = 0
    if (out / CHECKPOINT_STATE).is_file():
        state = _load_checkpoint(out, model, optimizer)
        start_epoch = int(state["epoch"])
        multiplier.load_state_dict(state["multiplier"])
    epochs_done = epochs_done[:start_epoch]
    steps = _read_jsonl(steps_path)
    trained: nn.Module = model
    if world_size > 1:  # wraps after the checkpoint is loaded; DDP broadcasts rank 0's weights
        trained = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )

    def lr_at(epoch: int) -> float:
        return config.lr * config.gamma ** sum(1 for m in config.milestones if epoch >= m)

    last: dict[str, Any] = epochs_done[-1] if epochs_done else {}
    for epoch in range(start_epoch, config.epochs):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(epoch)
        if isinstance(train_loader.sampler, DistributedSampler):
            train_loader.sampler.set_epoch(epoch)
        else:
            train_loader.generator.manual_seed(config.seed * 1000 + epoch)  # type: ignore[union-attr]
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
        steps = [s for s in steps if s["step"] < epoch * len(train_loader)]
        steps.extend({**s, "step": s["step"] + epoch * len(train_loader)} for s in step_log)
        val = evaluate(model, val_loader, device)
        test = evaluate(model, test_loader, device)
        last = {
            "epoch": epoch + 1,
            "lr": lr_at(epoch),
            "lambda": multiplier.value,
            **train_metrics,
            "val_accuracy": val["accuracy"],
            "test_accuracy": test["accuracy"],
            "test_transport": test["transport"],
            "epoch_seconds": seconds,
        }
        epochs_done.append(last)
        if rank != 0:
            continue
        metrics_path.write_text("".join(json.dumps(r) + "\n" for r in epochs_done))
        steps_path.write_text("".join(json.dumps(s) + "\n" for s in steps))
        _save_checkpoint(
            out,
            model,
            optimizer,
            {
                "epoch": epoch + 1,
                "multiplier": multiplier.state_dict(),
                "fingerprint": config.fingerprint(),
            },
        )
        plot_training_curve(steps, epochs_done, out / "training_curve.png")
        if progress:
            tqdm.write(
                f"[{config.name}] epoch {epoch + 1}: test acc {test['accuracy']:.4f}, val acc {val['accuracy']:.4f}, "
                f"transport {test['transport']:.3f}, lambda {multiplier.value:.1f}, {seconds:.0f}s"
            )
    if rank == 0:
        networks.save(model.cpu(), out, net_config)
    if world_size > 1:
        dist.barrier()  # the other ranks return once the network is saved
        dist.destroy_process_group()
    return last
