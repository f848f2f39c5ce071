"""What the Guard costs beside the network it protects: the time of one Guard pass (the forward
pass that serves the prediction, the features its hooks reduce on the way, and the detector)
over the time of the network's plain forward pass, on one batch, measured interleaved so a
change in the machine's load touches both sides alike (seed 003 §5.4.6: the transport features
come from the one forward pass that serves the prediction).

Feature groups that run the network again declare it (:data:`EXTRA_PASSES`); a pipeline's
feature-set choice keeps to a budget, first by ``1 + declared passes`` (:func:`declared_ratio`),
then by what each candidate's extraction measures on the network (:func:`feature_costs`); the
bundle records the Guard's ratio measured on the machine that wrote it (:class:`GuardCost`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from detector.features import FeatureSpec, TransportFeatureExtractor
from detector.networks import InputSpec
from detector.squeeze import SQUEEZE_NAMES

if TYPE_CHECKING:
    from detector.guard import Guard

#: Extra forward passes per feature group: squeezing runs the network once per squeezer, the
#: second opinion runs the other network once; every other group reads the one pass.
EXTRA_PASSES = {"squeeze": len(SQUEEZE_NAMES), "second": 1}
#: The default budget: a Guard at most 10% slower than the network's plain forward pass.
DEFAULT_BUDGET = 1.10
#: The batch the cost is measured at.
COST_BATCH = 32


class GuardCost(BaseModel):
    """A measured cost: Guard time / plain forward time at ``batch_size`` on ``device``."""

    model_config = ConfigDict(extra="forbid")

    ratio: float = Field(gt=0, allow_inf_nan=False)
    batch_size: int = Field(ge=1)
    device: str
    rounds: int = Field(ge=1)
    budget: float | None = Field(default=None, ge=1)  # what the feature choice was held to


def declared_ratio(spec: FeatureSpec) -> float:
    """1 + the extra forward passes ``spec``'s groups declare (the network's own pass is 1)."""
    return 1.0 + EXTRA_PASSES["squeeze"] * spec.squeeze + EXTRA_PASSES["second"] * spec.second


def within_budget(specs: list[FeatureSpec], budget: float) -> list[FeatureSpec]:
    """The feature sets whose declared cost (:func:`declared_ratio`) is within ``budget``."""
    return [spec for spec in specs if declared_ratio(spec) <= budget + 1e-9]


def within_measured_budget(
    specs: list[FeatureSpec], costs: list[float], budget: float
) -> list[FeatureSpec]:
    """The feature sets whose measured cost (:func:`feature_costs`) is within ``budget``; the
    first (the cheapest a config lists) always stays, so there is one to choose."""
    return [specs[0], *(s for s, c in zip(specs[1:], costs[1:], strict=True) if c <= budget)]


def interleaved_medians(
    calls: dict[str, Callable[[], object]], *, rounds: int, device: torch.device
) -> dict[str, float]:
    """The median seconds of each call, timed in turns (the order alternating each round) after
    one warm-up call each, so a change in the machine's load touches every call alike."""
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls.items())
    for round_ in range(rounds):
        for name, call in order if round_ % 2 == 0 else order[::-1]:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def measure_cost(
    guard: Guard, batch: torch.Tensor, *, rounds: int = 7, budget: float | None = None
) -> GuardCost:
    """Time ``guard.predict(batch)`` and the guard's network alone on ``batch`` in turns
    (:func:`interleaved_medians`); the ratio of the medians."""
    model, device = guard.model, guard.device

    @torch.inference_mode()
    def plain() -> None:
        model(batch.to(device, torch.float32))

    medians = interleaved_medians(
        {"plain": plain, "guard": lambda: guard.predict(batch)}, rounds=rounds, device=device
    )
    return GuardCost(
        ratio=medians["guard"] / medians["plain"],
        batch_size=len(batch),
        device=str(device),
        rounds=rounds,
        budget=budget,
    )


def feature_costs(
    model: nn.Module,
    specs: list[FeatureSpec],
    batch: torch.Tensor,
    *,
    second: nn.Module | None = None,
    rounds: int = 5,
) -> list[float]:
    """(forward pass + each spec's features) / plain forward pass on ``batch``, each timed in
    turns with the plain pass: what each candidate feature set costs on this network, before any
    detector is fitted on it."""
    device = next(model.parameters()).device
    x = batch.to(device, torch.float32)
    extractors = [
        TransportFeatureExtractor(model, spec, second=second if spec.second else None)
        for spec in specs
    ]

    def extract(extractor: TransportFeatureExtractor) -> Callable[[], object]:
        @torch.inference_mode()
        def call() -> object:
            with extractor as fx:
                model(x)
                return fx.features()

        return call

    plain = torch.inference_mode()(lambda: model(x))
    ratios = []
    for extractor in extractors:  # each against the plain pass in turns, as measure_cost does
        medians = interleaved_medians(
            {"plain": plain, "features": extract(extractor)}, rounds=rounds, device=device
        )
        ratios.append(medians["features"] / medians["plain"])
    return ratios


def noise_batch(spec: InputSpec, size: int = COST_BATCH, *, seed: int = 0) -> torch.Tensor:
    """``size`` seeded uniform images in ``spec``'s shape and value range (what a cost is
    measured on: a forward pass costs the same whatever the pixels)."""
    low, high = spec.value_range
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((size, *spec.shape), generator=generator) * (high - low) + low
