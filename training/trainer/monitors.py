"""Training-time dynamics monitors (``TrainConfig.monitors``), one row of numbers per epoch:

* ``monitor_w_layers``: seed 000's single-layer view. After each epoch a probe head per layer
  (stem, each block; :mod:`training.trainer.probes`) is fitted on fixed training images with the network
  frozen, and the mean W-distance between its predicted label distribution and the one-hot
  target (discrete cost, eq. 2) is measured on fixed held-out images; the last entry is the
  network's own head. Followed epoch by epoch, each entry is one layer across training.
* ``monitor_ics``: seed 004's internal covariate shift, the EM distance (eq. 2) between each
  block's output distribution on fixed images at the end of this epoch and at the end of the
  previous one (the first epoch: the network it started from), exact on the samples.

Every measure runs in eval mode without gradients and uses no random state, so training is
the same with or without monitors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from detector import dynamics
from training.data.datasets import to_arrays
from training.trainer.config import MonitorSettings
from training.trainer.probes import fit_probes


class DynamicsMonitor:
    """Fixed images and the previous epoch's block outputs; :meth:`record` gives one epoch's row."""

    def __init__(
        self,
        settings: MonitorSettings,
        train_set: Dataset,
        held_out: Dataset,
        device: torch.device,
        *,
        seed: int = 0,
    ) -> None:
        self.settings = settings
        self.device = device
        self.probe_x, self.probe_y = to_arrays(train_set, settings.probe_images, seed=seed + 1)
        self.eval_x, self.eval_y = to_arrays(held_out, settings.eval_images, seed=seed + 2)
        self.ics_x = torch.from_numpy(self.eval_x[: settings.ics_images])
        self._previous: list[np.ndarray] | None = None

    def _block_outputs(self, model: nn.Module) -> list[np.ndarray]:
        states, _ = dynamics.block_tensors(model, self.ics_x.to(self.device))
        return [s.flatten(1).double().cpu().numpy() for s in states[1:]]

    def start(self, model: nn.Module) -> None:
        """Remember the block outputs of the network training starts (or resumes) from."""
        was_training = model.training
        model.eval()
        self._previous = self._block_outputs(model)
        model.train(was_training)

    def record(self, model: nn.Module) -> dict[str, Any]:
        """This epoch's ``monitor_w_layers`` and ``monitor_ics`` (see the module docstring)."""
        was_training = model.training
        model.eval()
        try:
            probes = fit_probes(model, self.probe_x, self.probe_y, device=self.device)
            x = torch.from_numpy(self.eval_x).to(self.device)
            with torch.no_grad():
                states, logits = dynamics.block_tensors(model, x)
                layers = [torch.softmax(p(s), 1) for p, s in zip(probes, states, strict=True)]
                layers.append(torch.softmax(logits, 1))
            cost = dynamics.label_cost(logits.shape[1])
            w_layers = [
                float(
                    np.mean(
                        dynamics.dirac_label_wasserstein(
                            p.double().cpu().numpy(), self.eval_y, cost
                        )
                    )
                )
                for p in layers
            ]
            current = self._block_outputs(model)
        finally:
            model.train(was_training)
        ics = None
        if self._previous is not None:
            ics = [
                dynamics.internal_covariate_shift(before, after)
                for before, after in zip(self._previous, current, strict=True)
            ]
        self._previous = current
        return {"monitor_w_layers": w_layers, "monitor_ics": ics}
