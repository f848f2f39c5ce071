"""Probe heads (seed 000, Figure 1(a)): a linear classifier per layer of a frozen network, reading
that layer's label distribution mu_l. Shared by ``lapguard diagnose`` and the training monitors."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from detector import dynamics

PROBE_POOL = 4  # probe heads read a PROBE_POOL x PROBE_POOL average pooling of a layer's output


def _probe_pool(state: torch.Tensor) -> nn.Module:
    return nn.AdaptiveAvgPool2d(PROBE_POOL) if state.dim() == 4 else nn.Identity()


def _pooled_states(
    model: nn.Module, x: np.ndarray, *, device: torch.device, batch_size: int
) -> list[torch.Tensor]:
    """Every layer's (stem's and blocks') pooled, flattened output on ``x``: one [N, f] each."""
    pooled: list[list[torch.Tensor]] = []
    for states, _ in dynamics.batched_block_tensors(model, x, device=device, batch_size=batch_size):
        for i, state in enumerate(states):
            if len(pooled) <= i:
                pooled.append([])
            pooled[i].append(_probe_pool(state)(state).flatten(1).cpu())
    return [torch.cat(parts) for parts in pooled]


def fit_linear_probe(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, *, decay: float = 1e-3
) -> nn.Linear:
    """Multinomial logistic regression on ``features`` (standardized inside, folded back into
    the weights), fitted by L-BFGS from zero weights: deterministic, no random state used.
    One thread: the many tiny products of L-BFGS only pay thread hand-offs on more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit_linear_probe(features.double(), labels, num_classes, decay)
    finally:
        torch.set_num_threads(threads)


def _fit_linear_probe(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, decay: float
) -> nn.Linear:
    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    z = (features - mean) / std
    weight = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias], max_iter=100, history_size=10, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(z @ weight.T + bias, labels)
        loss = loss + decay * (weight**2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    linear = nn.Linear(z.shape[1], num_classes)
    with torch.no_grad():
        linear.weight.copy_((weight / std).float())
        linear.bias.copy_((bias - (weight * (mean / std)).sum(1)).float())
    return linear


def fit_probes(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, device: torch.device, batch_size: int = 250
) -> list[nn.Module]:
    """One probe head per layer (stem output, then each block's output) on the frozen network:
    pooling + a linear classifier fitted on ``(x, y)``. Each takes the layer's output as is."""
    sample, _ = dynamics.block_tensors(model, torch.from_numpy(x[:2]).to(device))
    pooled = _pooled_states(model, x, device=device, batch_size=batch_size)
    labels = torch.from_numpy(np.asarray(y, dtype=np.int64))
    num_classes = int(labels.max()) + 1
    num_classes = max(num_classes, getattr(getattr(model, "config", None), "num_classes", 0))
    return [
        nn.Sequential(_probe_pool(state), nn.Flatten(), fit_linear_probe(f, labels, num_classes))
        .to(device)
        .eval()
        for state, f in zip(sample, pooled, strict=True)
    ]
