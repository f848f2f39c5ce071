"""Training objectives: cross-entropy, LAP (transport cost with an Uzawa multiplier), RCE."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from detector.errors import ConfigError

Objective = Literal["vanilla", "lap", "lap-fixed", "rce"]
OBJECTIVES: tuple[str, ...] = ("vanilla", "lap", "lap-fixed", "rce")


def transport_cost(residuals: Sequence[torch.Tensor]) -> torch.Tensor:
    """C = sum over blocks of mean(r_m^2), the mean over the batch and the elements (seed 003's code)."""
    if not residuals:
        raise ValueError("transport_cost needs at least one residual")
    return torch.stack([r.float().pow(2).mean() for r in residuals]).sum()


def reverse_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Reverse cross-entropy (Pang et al. 2018) for a network that already returns negated logits.

    The RCE network is trained so that softmax of its raw logits z matches the reverse label
    (1 - onehot)/(K - 1) and predicts with -z; ``logits`` here are -z, as our RCE networks return.
    """
    num_classes = logits.shape[1]
    if num_classes < 2:
        raise ValueError("reverse cross-entropy needs at least two classes")
    reverse = (1.0 - F.one_hot(targets, num_classes).float()) / (num_classes - 1)
    return -(reverse * F.log_softmax(-logits, dim=1)).sum(dim=1).mean()


class UzawaMultiplier:
    """The LAP weight lambda: every ``every`` steps, lambda <- lambda + tau * L (method of multipliers).

    The objective is C / lambda + L, so the transport penalty fades as the task loss accumulates.
    With ``tau=0`` it is the fixed-lambda variant.
    """

    def __init__(self, lambda0: float = 1.0, tau: float = 1.0, every: int = 1) -> None:
        if lambda0 <= 0:
            raise ConfigError(f"lambda0 must be positive, got {lambda0}")
        if tau < 0:
            raise ConfigError(f"tau must be non-negative, got {tau}")
        if every < 1:
            raise ConfigError(f"the Uzawa update period s must be >= 1, got {every}")
        self.value = float(lambda0)
        self.tau = float(tau)
        self.every = int(every)
        self.steps = 0

    def step(self, task_loss: float) -> float:
        """Count one optimizer step whose task loss was ``task_loss``; update lambda every s steps."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.value += self.tau * float(task_loss)
        return self.value

    def state_dict(self) -> dict[str, float | int]:
        return {"value": self.value, "tau": self.tau, "every": self.every, "steps": self.steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.value = float(state["value"])
        self.tau = float(state["tau"])
        self.every = int(state["every"])
        self.steps = int(state["steps"])


@dataclass
class LossTerms:
    """One step's loss: ``total`` is what is minimized; the others are detached, for logging."""

    total: torch.Tensor
    task: torch.Tensor
    transport: torch.Tensor


def compute_loss(
    objective: str,
    logits: torch.Tensor,
    residuals: Sequence[torch.Tensor],
    targets: torch.Tensor,
    lam: float = 1.0,
) -> LossTerms:
    """The training loss of ``objective`` given the forward pass's logits and residuals."""
    if objective in ("vanilla", "lap", "lap-fixed"):
        task = F.cross_entropy(logits, targets)
    elif objective == "rce":
        task = reverse_cross_entropy(logits, targets)
    else:
        raise ConfigError(f"unknown objective {objective!r}; known: {', '.join(OBJECTIVES)}")
    if objective in ("lap", "lap-fixed"):
        transport = transport_cost(residuals)
        total = transport / lam + task
        return LossTerms(total=total, task=task.detach(), transport=transport.detach())
    with torch.no_grad():
        transport = transport_cost(residuals)
    return LossTerms(total=task, task=task.detach(), transport=transport)
