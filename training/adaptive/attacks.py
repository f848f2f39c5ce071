"""Adaptive attacks: the attacker knows the detector and attacks the network + detector system.

The registry's section for attacks that see a detector (:mod:`training.attacks.registry` holds those that
see the network only). Each starts from a detected successful adversarial image ``x_start`` of a
clean image ``x`` (true label ``y``) and returns an image meant to fool the network AND pass the
detector; every result is clipped to the value range.

- ``system-hsj`` (seed 003 §5.4.5, attack 1): HopSkipJump on the black-box system whose classes
  are the network's plus 'detected', targeted at the start's (wrong) label, from ``x_start``.
- ``feature-match`` (attack 2): HopSkipJump on the detector alone, in standardized feature space,
  finds undetected features ``z*`` near the start's; then eq. (42),
  ``min -L(N(x*), y) + c1 ||D(x*) - z*|| + c2 ||x* - x||``, by L-BFGS from ``x_start``. For a
  detector that does not read the network's penultimate embedding, ``D`` and ``z*`` also hold
  it by default (``guide``): the embedding of the clean row HopSkipJump started from.
- ``surrogate-pgd`` / ``surrogate-opgd``: white-box PGD through a distilled differentiable
  surrogate of the detector (:mod:`training.adaptive.surrogate`) under an L∞/L2 budget around ``x``:
  the summed objective, or orthogonal PGD (Bryniarski et al. 2022), which steps on the network's
  loss orthogonally to the detector's gradient until the network is fooled, then on the
  detector's orthogonally to the network's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from detector.errors import ConfigError
from detector.features import FeatureSpec, TransportFeatureExtractor, penultimate_width
from detector.penultimate import penultimate_embedding
from training.adaptive.surrogate import SurrogateDetector
from training.adaptive.target import Target
from training.attacks.batched import TanhBox
from training.attacks.registry import network_config


# --------------------------------------------------------------------------------------------
# What the attacker holds
# --------------------------------------------------------------------------------------------
@dataclass
class Attacker:
    """The attacked system and the attacker's knowledge: the network (white box), the target
    (queried as a black box, or read for its features and thresholds), clean reference rows from
    the training side (images, features, predicted labels) and, for the white-box attacks, a
    surrogate of the detector."""

    model: nn.Module
    target: Target
    reference_images: np.ndarray
    reference_features: np.ndarray
    reference_predicted: np.ndarray
    surrogate: SurrogateDetector | None = None
    surrogate_agreement: float | None = None  # with the target, on the surrogate's training rows

    def __post_init__(self) -> None:
        scale = self.reference_features.std(axis=0)
        self.feature_mean = self.reference_features.mean(axis=0)
        self.feature_scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
        self.value_range = network_config(self.model).input_spec.value_range
        self.device = self.target.guard.device
        self._reference_verdict: tuple[np.ndarray, np.ndarray] | None = None
        self._passing_rows: dict[int, np.ndarray] = {}
        self._reference_embedding: np.ndarray | None = None

    def reference_verdict(self) -> tuple[np.ndarray, np.ndarray]:
        """(labels, flags) of the reference images by the system, queried once."""
        if self._reference_verdict is None:
            self._reference_verdict = self.target.flagged(self.reference_images)
        return self._reference_verdict

    def passing_rows(self, label: int) -> np.ndarray:
        """Reference rows predicted ``label`` whose features the detector passes when it reads
        them as class ``label`` (queried once per label)."""
        if label not in self._passing_rows:
            rows = np.flatnonzero(self.reference_predicted == label)
            flagged = detector_flags(self, self.reference_features[rows], label)
            self._passing_rows[label] = rows[~flagged]
        return self._passing_rows[label]

    def forward(
        self, x: torch.Tensor, spec: FeatureSpec | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, transport features) of ``x`` with their autograd graph: one forward pass
        through the same taps the detector reads (and through the second network, when the
        features hold its opinion); ``spec``: other columns than the target's."""
        second = self.target.guard.second
        spec = spec or self.target.features
        with TransportFeatureExtractor(self.model, spec, second=second) as fx:
            logits = self.model(x)
            return logits, fx.features()

    def guided_spec(self) -> FeatureSpec:
        """The target's features with the network's penultimate embedding last (as they are
        when the detector reads it)."""
        spec = self.target.features
        return (
            spec if spec.penultimate else replace(spec, penultimate=penultimate_width(self.model))
        )

    def reference_embedding(self) -> np.ndarray:
        """The reference images' penultimate embeddings (computed once)."""
        if self._reference_embedding is None:
            self._reference_embedding = penultimate_embedding(self.model, self.reference_images)
        return self._reference_embedding

    def features(
        self, x: np.ndarray, spec: FeatureSpec | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(features, predicted labels) of images ``x`` (numpy, no graph)."""
        with torch.no_grad():
            logits, feats = self.forward(torch.from_numpy(x).to(self.device), spec)
        return feats.cpu().numpy(), logits.argmax(1).cpu().numpy()

    def clip(self, x: np.ndarray) -> np.ndarray:
        return np.clip(x, *self.value_range).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------
class AdaptiveParams(BaseModel):
    """Base of the adaptive attacks' parameters (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid")


class SystemHSJParams(AdaptiveParams):
    """HopSkipJump on the black-box network + detector (seed 003 §5.4.5, attack 1)."""

    max_iter: int = Field(50, ge=1)
    max_eval: int = Field(10000, ge=1)
    init_eval: int = Field(100, ge=1)
    init: Literal["nearest-clean", "random"] = Field(
        "nearest-clean",
        description="where HopSkipJump starts: the nearest training-side clean image the system "
        "passes with the wanted label, or ART's uniform-noise draws (the seed's run: up to 100 "
        "draws, the attack fails when the system flags them all)",
    )


class FeatureMatchParams(AdaptiveParams):
    """Undetected features by HopSkipJump on the detector, then eq. (42) by L-BFGS (attack 2)."""

    hsj_max_iter: int = Field(50, ge=1)
    hsj_max_eval: int = Field(10000, ge=1)
    c1: list[float] = Field([1.0, 10.0, 100.0], min_length=1, description="tried in turn")
    c2: float = Field(1.0, ge=0)
    lbfgs_iter: int = Field(50, ge=1, description="L-BFGS iterations per c1")
    ce_cap: float = Field(
        10.0, gt=0, description="-min(L, cap): the unbounded -L would swamp the other terms"
    )
    guide: Literal["penultimate", "none"] = Field(
        "penultimate",
        description="for a detector that does not read the penultimate embedding: match it too, "
        "to the embedding of the clean row HopSkipJump started from (L-BFGS stalls on the "
        "trajectory features alone: docs/decisions.md, 'Feature matching guided by the "
        "embedding')",
    )


class SurrogatePGDParams(AdaptiveParams):
    """PGD through the distilled surrogate of the detector, under an L∞ or L2 budget."""

    norm: Literal["Linf", "L2"] = "Linf"
    eps: float = Field(0.03, gt=0)
    steps: int = Field(100, ge=1)
    step: float | None = Field(None, gt=0, description="None: eps/20 (L∞) or eps/10 (L2)")
    detector_weight: float = Field(1.0, ge=0, description="weight of the surrogate margin")
    orthogonal: bool = False

    def step_size(self) -> float:
        return self.step or self.eps / (20.0 if self.norm == "Linf" else 10.0)


RunFn = Callable[[Attacker, np.ndarray, np.ndarray, np.ndarray, Any], np.ndarray]


@dataclass(frozen=True)
class AdaptiveSpec:
    """A registered adaptive attack: its parameters, what it starts from and how it runs."""

    name: str
    params: type[AdaptiveParams]
    run: RunFn
    start: Literal["cw", "bim"]
    defaults: dict[str, Any]

    def make_params(self, overrides: dict[str, Any] | None = None) -> AdaptiveParams:
        return self.params.model_validate({**self.defaults, **(overrides or {})})


_ADAPTIVE: dict[str, AdaptiveSpec] = {}


def list_adaptive_attacks() -> list[str]:
    """Names of every registered adaptive attack."""
    return list(_ADAPTIVE)


def get_adaptive_spec(name: str) -> AdaptiveSpec:
    if name not in _ADAPTIVE:
        raise ConfigError(f"unknown adaptive attack {name!r}; registered: {', '.join(_ADAPTIVE)}")
    return _ADAPTIVE[name]


def run_adaptive(
    name: str,
    attacker: Attacker,
    x: np.ndarray,
    x_start: np.ndarray,
    y: np.ndarray,
    params: dict[str, Any] | None = None,
    *,
    seed: int = 0,
) -> np.ndarray:
    """Adaptive attack ``name`` on clean images ``x`` (labels ``y``) from their adversarial
    images ``x_start``: float32 images of the same shape in the value range."""
    spec = get_adaptive_spec(name)
    np.random.seed(seed)
    torch.manual_seed(seed)
    out = spec.run(attacker, x, x_start, y, spec.make_params(params))
    return attacker.clip(np.asarray(out, dtype=np.float32).reshape(x.shape))


# --------------------------------------------------------------------------------------------
# Attack 1: HopSkipJump on the black-box system
# --------------------------------------------------------------------------------------------
def _hsj(
    classifier: Any, *, targeted: bool, max_iter: int, max_eval: int, init_eval: int = 100
) -> Any:
    """ART's HopSkipJump (L2) on a black-box classifier; starts are always given."""
    from art.attacks.evasion import HopSkipJump

    return HopSkipJump(
        classifier,
        batch_size=64,  # queries per predict call
        targeted=targeted,
        norm=2,
        max_iter=max_iter,
        max_eval=max_eval,
        init_eval=min(init_eval, max_eval),
        verbose=False,
    )


def _nearest(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Index of the candidate nearest (L2) to each row."""
    flat_rows, flat_cands = rows.reshape(len(rows), -1), candidates.reshape(len(candidates), -1)
    distances = (
        (flat_rows**2).sum(1)[:, None] - 2 * flat_rows @ flat_cands.T + (flat_cands**2).sum(1)
    )
    return distances.argmin(1)


def system_hsj(
    a: Attacker, x: np.ndarray, x_start: np.ndarray, y: np.ndarray, p: SystemHSJParams
) -> np.ndarray:
    """Targeted HopSkipJump on the system 'network label, or class K = detected' from ``x_start``
    towards its network label; started (``x_adv_init``) from the nearest training-side clean
    image the system passes with that label, or (``init="random"``, the seed's run) from ART's
    uniform-noise draws, which the system almost always flags."""
    from art.estimators.classification import BlackBoxClassifier

    k = network_config(a.model).num_classes

    def system(batch: np.ndarray) -> np.ndarray:
        labels, flagged = a.target.flagged(np.asarray(batch, dtype=np.float32))
        return np.eye(k + 1, dtype=np.float32)[np.where(flagged, k, labels)]

    classifier = BlackBoxClassifier(
        system, x.shape[1:], k + 1, clip_values=tuple(map(float, a.value_range))
    )
    wanted = a.features(x_start)[1]
    ref_labels, ref_flagged = a.reference_verdict()
    out = x_start.copy()
    for c in np.unique(wanted):
        rows = np.flatnonzero(wanted == c)
        passing = np.flatnonzero((ref_labels == c) & ~ref_flagged)
        if p.init == "random":
            inits = None
        elif passing.size:
            inits = a.reference_images[
                passing[_nearest(x_start[rows], a.reference_images[passing])]
            ]
        else:
            continue
        attack = _hsj(
            classifier,
            targeted=True,
            max_iter=p.max_iter,
            max_eval=p.max_eval,
            init_eval=p.init_eval,
        )
        target = np.eye(k + 1, dtype=np.float32)[np.full(len(rows), c)]
        init = None if inits is None else inits.copy()
        out[rows] = attack.generate(x=x_start[rows], y=target, x_adv_init=init)
    return out


# --------------------------------------------------------------------------------------------
# Attack 2: undetected features by HopSkipJump on the detector, then eq. (42)
# --------------------------------------------------------------------------------------------
def detector_flags(a: Attacker, features: np.ndarray, label: int) -> np.ndarray:
    """The target's detector alone (its torch form and threshold) on feature rows read as
    predicted class ``label``: True where flagged."""
    guard = a.target.guard
    feats = torch.from_numpy(np.asarray(features, dtype=np.float32)).to(guard.device)
    labels = torch.full((len(feats),), int(label), dtype=torch.int64, device=guard.device)
    with torch.inference_mode():
        scores = guard.detector_module(feats, labels)
    return scores.cpu().numpy() > guard.threshold


def undetected_features(
    a: Attacker, z: np.ndarray, predicted: np.ndarray, p: FeatureMatchParams
) -> tuple[np.ndarray, np.ndarray]:
    """(``z*``, start rows): per row, HopSkipJump (untargeted, 2 classes: passed/flagged) on the
    detector for the row's predicted class, in standardized feature space, from the nearest
    training-side clean feature row of that class the detector passes (its reference row).
    Rows without such a start keep ``z`` (start row -1)."""
    from art.estimators.classification import BlackBoxClassifier

    u_ref = (a.reference_features - a.feature_mean) / a.feature_scale
    bound = float(np.abs(u_ref).max()) * 1.5
    out, starts = z.copy(), np.full(len(z), -1)
    for i in range(len(z)):
        label = int(predicted[i])

        def detector(u: np.ndarray, label: int = label) -> np.ndarray:
            flags = detector_flags(a, u * a.feature_scale + a.feature_mean, label)
            return np.eye(2, dtype=np.float32)[flags.astype(int)]

        passing = a.passing_rows(label)
        if not passing.size:
            continue
        u = ((z[i : i + 1] - a.feature_mean) / a.feature_scale).astype(np.float32)
        starts[i] = passing[_nearest(u, u_ref[passing])][0]
        init = u_ref[starts[i] : starts[i] + 1].astype(np.float32)
        classifier = BlackBoxClassifier(detector, u.shape[1:], 2, clip_values=(-bound, bound))
        attack = _hsj(classifier, targeted=False, max_iter=p.hsj_max_iter, max_eval=p.hsj_max_eval)
        found = attack.generate(x=u, x_adv_init=init.copy())
        out[i] = found[0] * a.feature_scale + a.feature_mean
    return out, starts


@dataclass(frozen=True)
class Matched:
    """What eq. (42) matches: columns ``spec`` of the attacker's pass, their targets ``z_star``
    [N, F] and their scales [F]."""

    spec: FeatureSpec
    z_star: np.ndarray
    scale: np.ndarray

    def take(self, rows: np.ndarray) -> Matched:
        return replace(self, z_star=self.z_star[rows])


def matched_features(
    a: Attacker, x_start: np.ndarray, z_star: np.ndarray, starts: np.ndarray, guide: str
) -> Matched:
    """The target's columns and ``z*``; with ``guide`` 'penultimate' and a detector that does not
    read the penultimate embedding, also the embedding, matched to that of each row's reference
    start row (its own, for a row without one)."""
    if guide == "none" or a.target.features.penultimate:
        return Matched(a.target.features, z_star, a.feature_scale)
    spec = a.guided_spec()
    reference = a.reference_embedding()
    own = a.features(x_start, spec)[0][:, -reference.shape[1] :]
    target = np.where((starts >= 0)[:, None], reference[np.maximum(starts, 0)], own)
    std = reference.std(axis=0)
    scale = np.concatenate([a.feature_scale, np.where(std > 0, std, 1.0)]).astype(np.float32)
    return Matched(spec, np.concatenate([z_star, target], axis=1), scale)


def _eq42(
    a: Attacker, x: np.ndarray, x_start: np.ndarray, y: np.ndarray, matched: Matched, c1: float,
    p: FeatureMatchParams,
) -> np.ndarray:  # fmt: skip
    """Solve eq. (42) for one c1 by L-BFGS in tanh space (the box constraint), from ``x_start``."""
    box = TanhBox(*map(float, a.value_range))
    device = a.device
    x_t = torch.from_numpy(x).to(device)
    y_t = torch.from_numpy(y).to(device)
    z_t = torch.from_numpy(matched.z_star.astype(np.float32)).to(device)
    scale = torch.from_numpy(matched.scale).to(device)
    w = box.to_tanh(torch.from_numpy(x_start).to(device)).detach().requires_grad_(True)
    optimizer = torch.optim.LBFGS([w], max_iter=p.lbfgs_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        x_adv = box.from_tanh(w)
        logits, feats = a.forward(x_adv, matched.spec)
        ce = nn.functional.cross_entropy(logits, y_t, reduction="none").clamp(max=p.ce_cap)
        matching = ((feats - z_t) / scale).flatten(1).norm(dim=1)
        distance = (x_adv - x_t).flatten(1).norm(dim=1)
        loss = (-ce + c1 * matching + p.c2 * distance).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return box.from_tanh(w).detach().cpu().numpy()


def feature_match(
    a: Attacker, x: np.ndarray, x_start: np.ndarray, y: np.ndarray, p: FeatureMatchParams
) -> np.ndarray:
    """Attack 2: ``z*`` by :func:`undetected_features` (and the guide, :func:`matched_features`),
    then eq. (42) for each c1 in turn; a row keeps the first result that fools the network and
    passes the system (queried), else the last one."""
    z, predicted = a.features(x_start)
    matched = matched_features(a, x_start, *undetected_features(a, z, predicted, p), p.guide)
    out = x_start.copy()
    pending = np.arange(len(x))
    for c1 in p.c1:
        if not pending.size:
            break
        part = matched.take(pending)
        found = a.clip(_eq42(a, x[pending], x_start[pending], y[pending], part, c1, p))
        out[pending] = found
        labels, flagged = a.target.flagged(found)
        pending = pending[(labels == y[pending]) | flagged]
    return out


# --------------------------------------------------------------------------------------------
# The white-box attack through a surrogate: PGD and orthogonal PGD
# --------------------------------------------------------------------------------------------
def _gradients(
    a: Attacker, x_adv: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gradient of the network's loss, gradient of minus the surrogate margin, fooled mask)."""
    assert a.surrogate is not None
    x_adv = x_adv.detach().requires_grad_(True)
    with torch.enable_grad():
        logits, feats = a.forward(x_adv)
        ce = nn.functional.cross_entropy(logits, y, reduction="sum")
        margin = a.surrogate(feats, torch.softmax(logits, dim=1)).sum()
        g_net = torch.autograd.grad(ce, x_adv, retain_graph=True)[0]
        g_det = torch.autograd.grad(-margin, x_adv)[0]
    return g_net, g_det, logits.argmax(1) != y


def _orthogonal(g: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``g`` minus its projection on ``other``, per sample."""
    g2, o2 = g.flatten(1), other.flatten(1)
    coef = (g2 * o2).sum(1, keepdim=True) / o2.square().sum(1, keepdim=True).clamp_min(1e-20)
    return (g2 - coef * o2).view_as(g)


def _direction(
    g_net: torch.Tensor, g_det: torch.Tensor, fooled: torch.Tensor, p: SurrogatePGDParams
) -> torch.Tensor:
    if not p.orthogonal:
        return g_net + p.detector_weight * g_det
    shape = (-1,) + (1,) * (g_net.ndim - 1)
    return torch.where(fooled.view(shape), _orthogonal(g_det, g_net), _orthogonal(g_net, g_det))


def _step(
    x_adv: torch.Tensor, x: torch.Tensor, d: torch.Tensor, p: SurrogatePGDParams
) -> torch.Tensor:
    """One ascent step along ``d`` and the projection on the ε-ball around ``x``."""
    if p.norm == "Linf":
        moved = x_adv + p.step_size() * d.sign()
        return x + (moved - x).clamp(-p.eps, p.eps)
    unit = d / d.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *([1] * (d.ndim - 1)))
    delta = x_adv + p.step_size() * unit - x
    norms = delta.flatten(1).norm(dim=1).view(-1, *([1] * (d.ndim - 1)))
    return x + delta * torch.clamp(p.eps / norms.clamp_min(1e-12), max=1.0)


def surrogate_pgd(
    a: Attacker, x: np.ndarray, x_start: np.ndarray, y: np.ndarray, p: SurrogatePGDParams
) -> np.ndarray:
    """PGD from ``x_start`` (projected into the budget around ``x``) on the network's loss and the
    surrogate's margin; each row keeps its first iterate that fools the network and passes the
    system (queried once per step), else the last one."""
    if a.surrogate is None:
        raise ConfigError("the surrogate attacks need an Attacker with a surrogate")
    low, high = map(float, a.value_range)
    x_t = torch.from_numpy(x).to(a.device)
    y_t = torch.from_numpy(y).to(a.device)
    x_adv = _step(torch.from_numpy(x_start).to(a.device), x_t, torch.zeros_like(x_t), p)
    x_adv = x_adv.clamp(low, high)
    done = np.zeros(len(x), dtype=bool)
    best = x_adv.clone()
    for _ in range(p.steps):
        g_net, g_det, fooled = _gradients(a, x_adv, y_t)
        x_adv = _step(x_adv, x_t, _direction(g_net, g_det, fooled, p), p).clamp(low, high).detach()
        labels, flagged = a.target.flagged(x_adv.cpu().numpy())
        new = (labels != y) & ~flagged & ~done
        best[torch.from_numpy(new).to(a.device)] = x_adv[torch.from_numpy(new).to(a.device)]
        done |= new
        if done.all():
            break
    best[torch.from_numpy(~done).to(a.device)] = x_adv[torch.from_numpy(~done).to(a.device)]
    return best.cpu().numpy()


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------
def _register(spec: AdaptiveSpec) -> None:
    if spec.name in _ADAPTIVE:
        raise ValueError(f"adaptive attack {spec.name!r} is registered twice")
    _ADAPTIVE[spec.name] = spec


_register(AdaptiveSpec("system-hsj", SystemHSJParams, system_hsj, "cw", {}))
_register(AdaptiveSpec("feature-match", FeatureMatchParams, feature_match, "cw", {}))
_register(AdaptiveSpec("surrogate-pgd", SurrogatePGDParams, surrogate_pgd, "bim", {}))
_register(
    AdaptiveSpec("surrogate-opgd", SurrogatePGDParams, surrogate_pgd, "bim", {"orthogonal": True})
)
