"""A differentiable stand-in for a fitted detector: a small MLP distilled from its decisions.

Random forests have no gradient, so a white-box attacker on the network + detector system imitates
the detector with a smooth model (Carlini & Wagner 2017; Bryniarski et al. 2022) and follows the
imitation's gradient. :class:`SurrogateDetector` reads the transport features (standardized with
the training rows' mean and scale) and the network's predicted class (one-hot: the class forest
answers for it) and regresses the detector's margin ``score - threshold`` (> 0 = flagged). It is
fitted on training-side rows only.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from detector.errors import InputError
from detector.features import check_features


class SurrogateDetector(nn.Module):
    """``forward(features [N, F], predicted [N] or class probabilities [N, K]) -> margin [N]``;
    HIGHER = MORE ABNORMAL, > 0 where the imitated detector flags."""

    mean: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self, mean: np.ndarray, scale: np.ndarray, num_classes: int, hidden: int = 64
    ) -> None:
        super().__init__()
        self.num_classes = int(num_classes)
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.net = nn.Sequential(
            nn.Linear(len(mean) + num_classes, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, features: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
        z = (features.float() - self.mean) / self.scale
        classes = (
            predicted.float()
            if predicted.ndim == 2
            else nn.functional.one_hot(predicted.long(), self.num_classes).float()
        )
        return self.net(torch.cat([z, classes], dim=1))[:, 0]


def distill(
    features: np.ndarray,
    predicted: np.ndarray,
    margins: np.ndarray,
    num_classes: int,
    *,
    epochs: int = 400,
    hidden: int = 64,
    seed: int = 0,
) -> SurrogateDetector:
    """Fit a :class:`SurrogateDetector` to a detector's margins (``score - threshold``) on rows
    (``features``, ``predicted``): full-batch Adam on the squared error, seeded."""
    x = check_features(features)
    y = np.asarray(margins, dtype=np.float32)
    if y.shape != (len(x),) or np.asarray(predicted).shape != (len(x),):
        raise InputError("features, predicted labels and margins must have one row per sample")
    torch.manual_seed(seed)
    scale = x.std(axis=0)
    surrogate = SurrogateDetector(
        x.mean(axis=0), np.where(scale > 0, scale, 1.0), num_classes, hidden
    )
    inputs = torch.from_numpy(x)
    labels = torch.from_numpy(np.asarray(predicted, dtype=np.int64))
    target = torch.from_numpy(y)
    optimizer = torch.optim.Adam(surrogate.parameters(), lr=3e-3)
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(surrogate(inputs, labels), target)
        loss.backward()
        optimizer.step()
    return surrogate.eval()


@torch.no_grad()
def agreement(
    surrogate: SurrogateDetector, features: np.ndarray, predicted: np.ndarray, margins: np.ndarray
) -> float:
    """Share of rows where the surrogate and the detector agree on flagged (margin > 0) or not."""
    guess = surrogate(torch.from_numpy(check_features(features)), torch.from_numpy(predicted))
    return float(np.mean((guess.numpy() > 0) == (np.asarray(margins) > 0)))
