"""A second network's opinion as a feature group: does another network, trained on the same data,
read the image as the deployed network does?

A minimal perturbation (CW, DeepFool, a small-ε step) is made for one network: it moves that
network's prediction across the nearest boundary and rarely moves another network's. A clean image
is read alike by both. On the quick run's training side, the vanilla network agrees with the LAP
network's prediction on 95.9% of clean images but on 8.5% of LAP's CW images and 10.1% of its
DeepFool images (docs/decisions.md, "Second network's opinion"). The group's three columns: whether the second
network's top class is the deployed network's prediction, the log of its probability of that
class, and its max probability. It costs one forward pass of the second network, which keeps its
autograd graph: an adaptive attacker differentiates through both networks.
"""

from __future__ import annotations

import torch
from torch import nn

from detector.errors import ConfigError

OPINION_NAMES = ("second_agrees", "second_log_prob", "second_max_prob")
LOG_FLOOR = 1e-6  # log(p + floor): finite where the second network gives the class ~0


def second_opinion(second: nn.Module, x: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """[N, 3] float32: the :data:`OPINION_NAMES` columns of images ``x`` (the deployed network's
    input) that the deployed network labels ``predicted`` (int64 [N]); ``second`` runs once."""
    if len(x) != len(predicted):
        raise ConfigError(f"{len(x)} images but {len(predicted)} predicted labels")
    p = second(x).float().softmax(1)
    predicted = predicted.to(p.device, torch.int64)
    if len(predicted) and int(predicted.max()) >= p.shape[1]:
        raise ConfigError(
            f"the second network has {p.shape[1]} classes, fewer than the deployed network's"
        )
    own = p.gather(1, predicted[:, None])[:, 0]
    agrees = (p.argmax(1) == predicted).float()
    return torch.stack([agrees, torch.log(own + LOG_FLOOR), p.max(1).values], 1)
