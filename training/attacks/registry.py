"""Adversarial attacks by name: one ART adapter, one registry, explicit validated parameters.

Every attack is untargeted and sees the network only (never a detector). Parameters are pydantic
models holding the seed's settings (003 §5.4) and ART's defaults otherwise; any of them can be
overridden by name. Images are numpy float32 NCHW in the network's value range, labels int64.

Registered: ``fgm``, ``apgd``, ``bim``, ``cw``, ``deepfool``, ``hsj``, ``boundary``,
``autoattack`` (the authors' code, PyPI ``pyautoattack``), ``noise`` (uniform noise of the
same ε: a control, labelled clean in detection training), and ``cw-batched``,
``deepfool-batched`` and ``apgd-batched`` (ART's CW-L2, DeepFool and APGD as batched torch code in
:mod:`training.attacks.batched`, with the same parameters, cheaper).

Randomness: each batch is seeded from ``(seed, batch index)`` (numpy's global generator, torch and
``random``, which ART and AutoAttack draw from), so a set resumed after an interruption equals one
generated in one go with the same batch size.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from art.estimators.classification import PyTorchClassifier
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn
from tqdm.auto import tqdm

from detector.errors import ConfigError, InputError, validation_problems
from detector.networks import NetworkConfig, resolve_device
from training.attacks.batched import CarliniL2, apgd, deepfool

Norm = Literal["Linf", "L2", "L1"]
_ART_NORMS: dict[str, float] = {"Linf": np.inf, "L2": 2.0, "L1": 1.0}
RunFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


# --------------------------------------------------------------------------------------------
# Parameters (one pydantic model per attack; unknown fields are refused)
# --------------------------------------------------------------------------------------------
class AttackParams(BaseModel):
    """Base of every attack's parameters."""

    model_config = ConfigDict(extra="forbid")

    def linf_bound(self) -> float | None:
        """The L∞ budget every adversarial sample respects, or None when the attack has none."""
        return None


class _LinfBounded(AttackParams):
    eps: float = Field(
        0.03, gt=0, description="maximal perturbation (in the network's value range)"
    )

    def linf_bound(self) -> float | None:
        return self.eps if getattr(self, "norm", "Linf") == "Linf" else None


class FGMParams(_LinfBounded):
    """Fast Gradient Method (Goodfellow et al. 2015), one signed-gradient step."""

    norm: Norm = "Linf"


class APGDParams(_LinfBounded):
    """Auto-PGD on the cross-entropy loss (Croce & Hein 2020) through ART."""

    norm: Norm = "Linf"
    eps_step: float | None = Field(
        None, gt=0, description="initial step; None = 2*eps (ART's default 0.1 exceeds eps=0.03)"
    )
    max_iter: int = Field(100, ge=1)
    nb_random_init: int = Field(1, ge=1, description="restarts (ART's default 5 costs 5x)")
    loss_type: Literal["cross_entropy", "difference_logits_ratio"] = "cross_entropy"

    @model_validator(mode="after")
    def _resolve_step(self) -> APGDParams:
        if self.eps_step is None:
            self.eps_step = 2.0 * self.eps
        return self


class BIMParams(_LinfBounded):
    """Basic Iterative Method (Kurakin et al. 2017), L∞."""

    eps_step: float | None = Field(
        None,
        gt=0,
        description="step per iteration; None = eps/10 (ART's default 0.1 exceeds eps=0.03)",
    )
    max_iter: int = Field(
        20, ge=1, description="iterations (20 steps of eps/10 can travel 2*eps before projection)"
    )

    @model_validator(mode="after")
    def _resolve_step(self) -> BIMParams:
        if self.eps_step is None:
            self.eps_step = self.eps / 10.0
        return self


class CWParams(AttackParams):
    """Carlini & Wagner L2 (ART's CarliniL2Method), minimal-perturbation, no ε."""

    confidence: float = Field(0.0, ge=0)
    learning_rate: float = Field(0.01, gt=0)
    binary_search_steps: int = Field(10, ge=1)
    max_iter: int = Field(10, ge=1)
    initial_const: float = Field(0.01, gt=0)
    max_halving: int = Field(5, ge=1)
    max_doubling: int = Field(5, ge=1)


class DeepFoolParams(AttackParams):
    """DeepFool (Moosavi-Dezfooli et al. 2016), minimal-perturbation, no ε."""

    max_iter: int = Field(100, ge=1)
    epsilon: float = Field(1e-6, ge=0, description="overshoot")
    nb_grads: int = Field(10, ge=1, description="number of class gradients (most likely classes)")


class CWBatchedParams(CWParams):
    """Carlini & Wagner L2, ART's algorithm as batched torch code (one backward pass per step)."""


class DeepFoolBatchedParams(DeepFoolParams):
    """DeepFool, ART's algorithm as batched torch code (unflipped samples only)."""


class APGDBatchedParams(APGDParams):
    """Auto-PGD on the cross-entropy loss, ART's algorithm as batched torch code (one forward
    and backward pass per iteration; L∞ only)."""

    norm: Literal["Linf"] = "Linf"
    loss_type: Literal["cross_entropy"] = "cross_entropy"


class _DecisionBased(AttackParams):
    margin: float = Field(
        1e-3,
        ge=0,
        description="smallest top-2 logit margin of a result (pushed past the boundary; 0: off)",
    )


class HSJParams(_DecisionBased):
    """HopSkipJump (Chen et al. 2020), decision-based black-box."""

    norm: Literal["L2", "Linf"] = "L2"
    max_iter: int = Field(50, ge=1)
    max_eval: int = Field(10000, ge=1)
    init_eval: int = Field(100, ge=1)
    init_size: int = Field(100, ge=1)


class BoundaryParams(_DecisionBased):
    """Boundary Attack (Brendel et al. 2018), decision-based black-box, untargeted."""

    delta: float = Field(0.01, gt=0)
    epsilon: float = Field(
        0.01, gt=0, description="initial step towards the original (not a budget)"
    )
    step_adapt: float = Field(0.667, gt=0, lt=1)
    max_iter: int = Field(5000, ge=1)
    num_trial: int = Field(25, ge=1)
    sample_size: int = Field(20, ge=1)
    init_size: int = Field(100, ge=1)
    min_epsilon: float = Field(0.0, ge=0)


AutoAttackName = Literal["apgd-ce", "apgd-dlr", "fab", "square", "apgd-t", "fab-t"]


class AutoAttackParams(_LinfBounded):
    """AutoAttack (Croce & Hein 2020) with the authors' code; unset options keep their settings."""

    norm: Norm = "Linf"
    version: Literal["standard", "plus", "rand", "custom"] = "standard"
    attacks: list[AutoAttackName] | None = Field(None, description="only with version='custom'")
    n_iter: int | None = Field(None, ge=1, description="iterations of APGD/FAB (authors: 100)")
    n_queries: int | None = Field(None, ge=1, description="Square queries (authors: 5000)")
    n_target_classes: int | None = Field(
        None, ge=1, description="targets of APGD-T/FAB-T (authors: 9)"
    )

    @model_validator(mode="after")
    def _check_version(self) -> AutoAttackParams:
        if self.version == "custom" and not self.attacks:
            raise ValueError("version 'custom' needs a list of attacks")
        if self.version != "custom" and self.attacks is not None:
            raise ValueError(
                f"attacks can only be chosen with version 'custom', not {self.version!r}"
            )
        return self


class NoiseParams(_LinfBounded):
    """Uniform noise in [-eps, eps] per pixel, clipped: a control that is not an attack."""


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttackSpec:
    """A registered attack: its parameters, batch sizes and how to build it against a network."""

    name: str
    params: type[AttackParams]
    build: Callable[[AttackRunner, Any], RunFn]
    kind: Literal["white-box", "black-box", "control"]
    default_batch_size: int
    max_batch_size: int | None = None
    slow: bool = False

    @property
    def summary(self) -> str:
        return (self.params.__doc__ or "").strip().splitlines()[0]


_ATTACKS: dict[str, AttackSpec] = {}


def _register(spec: AttackSpec) -> None:
    if spec.name in _ATTACKS:
        raise ValueError(f"attack {spec.name!r} is registered twice")
    _ATTACKS[spec.name] = spec


def list_attacks() -> list[str]:
    """Names of every registered attack."""
    return list(_ATTACKS)


def get_attack_spec(name: str) -> AttackSpec:
    """The registry entry of ``name``; an unknown name is a ConfigError listing the known ones."""
    if name not in _ATTACKS:
        raise ConfigError(f"unknown attack {name!r}; registered: {', '.join(list_attacks())}")
    return _ATTACKS[name]


def make_attack_params(
    name: str, overrides: dict[str, Any] | AttackParams | None = None
) -> AttackParams:
    """Validated parameters of attack ``name``: its defaults updated with ``overrides``."""
    spec = get_attack_spec(name)
    if isinstance(overrides, AttackParams):
        if not isinstance(overrides, spec.params):
            raise ConfigError(
                f"attack {name!r} takes {spec.params.__name__}, got {type(overrides).__name__}"
            )
        overrides = overrides.model_dump()
    overrides = dict(overrides or {})
    allowed = list(spec.params.model_fields)
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ConfigError(
            f"unknown parameter(s) {', '.join(unknown)} for attack {name!r}; it takes: {', '.join(allowed)}"
        )
    try:
        return spec.params.model_validate(overrides)
    except ValidationError as error:
        problems = validation_problems(error.errors(), name)
        raise ConfigError(f"invalid parameters for attack {name!r}: {problems}") from error


def attack_defaults(name: str) -> dict[str, Any]:
    """The default parameters of attack ``name`` (resolved, e.g. APGD's step = 2*eps)."""
    return make_attack_params(name).model_dump(mode="json")


# --------------------------------------------------------------------------------------------
# The one ART adapter
# --------------------------------------------------------------------------------------------
class _Float32Classifier(PyTorchClassifier):
    """PyTorchClassifier that casts inputs to float32 (HopSkipJump sends float64)."""

    def predict(
        self, x: np.ndarray, batch_size: int = 128, training_mode: bool = False, **kwargs: Any
    ) -> np.ndarray:
        return super().predict(
            np.asarray(x, dtype=np.float32),
            batch_size=batch_size,
            training_mode=training_mode,
            **kwargs,
        )

    def loss_gradient(self, x: Any, y: Any, training_mode: bool = False, **kwargs: Any) -> Any:
        if isinstance(x, np.ndarray):
            x = x.astype(np.float32, copy=False)
        return super().loss_gradient(x, y, training_mode=training_mode, **kwargs)

    def class_gradient(
        self, x: Any, label: Any = None, training_mode: bool = False, **kwargs: Any
    ) -> Any:
        if isinstance(x, np.ndarray):
            x = x.astype(np.float32, copy=False)
        return super().class_gradient(x, label=label, training_mode=training_mode, **kwargs)


def network_config(model: nn.Module) -> NetworkConfig:
    """The NetworkConfig attached to an observable network (``build_network``/``load`` set it)."""
    config = getattr(model, "config", None)
    if not isinstance(config, NetworkConfig):
        raise ConfigError(
            "attacks need a network built by detector.networks (build_network or load): it carries its input spec"
        )
    return config


@contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    # ART places estimators on torch.cuda.current_device(): make that the one asked for.
    with (
        torch.cuda.device(device)
        if device.type == "cuda" and device.index is not None
        else nullcontext()
    ):
        yield


def art_classifier(model: nn.Module, *, device: str | torch.device = "auto") -> PyTorchClassifier:
    """Wrap an observable network as an ART classifier: logits, CE loss, clip values from its
    input spec (normalization stays inside the network). The model is moved to ``device``."""
    config = network_config(model)
    spec = config.input_spec
    resolved = resolve_device(device)
    model.to(resolved).eval()
    with _on_device(resolved):
        return _Float32Classifier(
            model=model,
            loss=nn.CrossEntropyLoss(),
            input_shape=spec.shape,
            nb_classes=config.num_classes,
            clip_values=(float(spec.value_range[0]), float(spec.value_range[1])),
            device_type="gpu" if resolved.type == "cuda" else "cpu",
        )


# --------------------------------------------------------------------------------------------
# Running an attack batch by batch
# --------------------------------------------------------------------------------------------
def batch_seed(seed: int, batch: int) -> int:
    """The seed of batch ``batch`` of a set generated with ``seed`` (independent streams)."""
    return int(np.random.SeedSequence([int(seed), int(batch)]).generate_state(1)[0])


def batch_slices(n: int, batch_size: int) -> list[slice]:
    """Consecutive slices of ``batch_size`` items covering ``range(n)``."""
    return [slice(start, min(start + batch_size, n)) for start in range(0, n, batch_size)]


def check_inputs(model: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate images and labels against the network's input spec; returns float32/int64 copies."""
    spec = network_config(model).input_spec
    x = np.asarray(x)
    y = np.asarray(y)
    if x.ndim != 4 or tuple(x.shape[1:]) != spec.shape:
        raise InputError(
            f"images must be shaped (N, {', '.join(map(str, spec.shape))}), got {x.shape}"
        )
    if y.shape != (x.shape[0],):
        raise InputError(f"labels must be shaped ({x.shape[0]},), got {y.shape}")
    if x.shape[0] == 0:
        raise InputError("no images to attack")
    if not np.issubdtype(x.dtype, np.floating) or not np.isfinite(x).all():
        raise InputError(f"images must be finite floats, got dtype {x.dtype}")
    low, high = spec.value_range
    if x.min() < low - 1e-6 or x.max() > high + 1e-6:
        raise InputError(
            f"images must lie in the network's value range [{low}, {high}], got [{x.min()}, {x.max()}]"
        )
    return np.ascontiguousarray(x, dtype=np.float32), y.astype(np.int64)


@torch.no_grad()
def predict_labels(
    model: nn.Module, x: np.ndarray, *, device: str | torch.device = "auto", batch_size: int = 256
) -> np.ndarray:
    """Predicted classes (int64) of ``x``; the model is moved to ``device``."""
    resolved = resolve_device(device)
    model.to(resolved).eval()
    out = [
        model(torch.from_numpy(np.ascontiguousarray(x[s], dtype=np.float32)).to(resolved))
        .argmax(1)
        .cpu()
        for s in batch_slices(len(x), batch_size)
    ]
    return torch.cat(out).numpy().astype(np.int64)


class AttackRunner:
    """One attack built once against one network; :meth:`run_batch` attacks a batch."""

    def __init__(
        self,
        model: nn.Module,
        attack: str,
        params: dict[str, Any] | AttackParams | None = None,
        *,
        batch_size: int | None = None,
        device: str | torch.device = "auto",
    ) -> None:
        self.spec = get_attack_spec(attack)
        self.params = make_attack_params(attack, params)
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch size must be positive, got {batch_size}")
        size = batch_size or self.spec.default_batch_size
        if self.spec.max_batch_size is not None:
            # ART's DeepFool keeps a whole batch iterating until every sample flips.
            size = min(size, self.spec.max_batch_size)
        self.batch_size = size
        self.device = resolve_device(device)
        self.config = network_config(model)
        self.model = model.to(self.device).eval()
        self._classifier: PyTorchClassifier | None = None
        self._run = self.spec.build(self, self.params)

    @property
    def classifier(self) -> PyTorchClassifier:
        """The ART adapter, built on first use."""
        if self._classifier is None:
            self._classifier = art_classifier(self.model, device=self.device)
        return self._classifier

    def run_batch(self, x: np.ndarray, y: np.ndarray, *, seed: int) -> np.ndarray:
        """Adversarial versions of one batch (float32, clipped to the value range)."""
        np.random.seed(seed)
        random.seed(seed)
        torch.manual_seed(seed)
        with _on_device(self.device):
            x_adv = self._run(x, y, seed)
        x_adv = np.asarray(x_adv, dtype=np.float32).reshape(x.shape)
        low, high = self.config.input_spec.value_range
        return np.clip(x_adv, low, high)


def generate(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    attack: str,
    params: dict[str, Any] | None = None,
    *,
    batch_size: int | None = None,
    device: str | torch.device = "auto",
    seed: int = 0,
    progress: bool = True,
) -> np.ndarray:
    """Adversarial versions of ``x`` (float32, same shape) for true labels ``y``, untargeted.

    No caching here: :func:`training.attacks.sets.get_or_generate` stores and resumes sets.
    """
    runner = AttackRunner(model, attack, params, batch_size=batch_size, device=device)
    x, y = check_inputs(model, x, y)
    out = np.empty_like(x)
    with tqdm(
        total=len(x), desc=attack, unit="img", disable=not progress, dynamic_ncols=True
    ) as bar:
        for b, part in enumerate(batch_slices(len(x), runner.batch_size)):
            out[part] = runner.run_batch(x[part], y[part], seed=batch_seed(seed, b))
            bar.update(part.stop - part.start)
    return out


# --------------------------------------------------------------------------------------------
# Builders (ART evasion attacks; AutoAttack; noise)
# --------------------------------------------------------------------------------------------
def _art_run(attack: Any) -> RunFn:
    return lambda x, y, seed: attack.generate(x=x, y=y)


def _build_fgm(runner: AttackRunner, p: FGMParams) -> RunFn:
    from art.attacks.evasion import FastGradientMethod

    return _art_run(
        FastGradientMethod(
            runner.classifier,
            norm=_ART_NORMS[p.norm],
            eps=p.eps,
            targeted=False,
            batch_size=runner.batch_size,
        )
    )


def _build_apgd(runner: AttackRunner, p: APGDParams) -> RunFn:
    from art.attacks.evasion import AutoProjectedGradientDescent

    with _on_device(runner.device):
        attack = AutoProjectedGradientDescent(
            runner.classifier,
            norm=_ART_NORMS[p.norm],
            eps=p.eps,
            eps_step=p.eps_step,
            max_iter=p.max_iter,
            targeted=False,
            nb_random_init=p.nb_random_init,
            batch_size=runner.batch_size,
            loss_type=p.loss_type,
            verbose=False,
        )
    return _art_run(attack)


def _build_bim(runner: AttackRunner, p: BIMParams) -> RunFn:
    from art.attacks.evasion import BasicIterativeMethod

    return _art_run(
        BasicIterativeMethod(
            runner.classifier,
            eps=p.eps,
            eps_step=p.eps_step,
            max_iter=p.max_iter,
            targeted=False,
            batch_size=runner.batch_size,
            verbose=False,
        )
    )


def _build_cw(runner: AttackRunner, p: CWParams) -> RunFn:
    from art.attacks.evasion import CarliniL2Method

    return _art_run(
        CarliniL2Method(
            runner.classifier,
            targeted=False,
            batch_size=runner.batch_size,
            verbose=False,
            **p.model_dump(),
        )
    )


def _build_deepfool(runner: AttackRunner, p: DeepFoolParams) -> RunFn:
    from art.attacks.evasion import DeepFool

    nb_grads = min(p.nb_grads, runner.config.num_classes)
    return _art_run(
        DeepFool(
            runner.classifier,
            max_iter=p.max_iter,
            epsilon=p.epsilon,
            nb_grads=nb_grads,
            batch_size=runner.batch_size,
            verbose=False,
        )
    )


def _torch_run(runner: AttackRunner, attack: Callable[..., torch.Tensor]) -> RunFn:
    """A RunFn of a batched torch attack ``attack(model, x, y)`` on the runner's device."""

    def run(x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(runner.device)
        yt = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(runner.device)
        return attack(runner.model, xt, yt).detach().cpu().numpy()

    return run


def _build_cw_batched(runner: AttackRunner, p: CWBatchedParams) -> RunFn:
    value_range = runner.config.input_spec.value_range
    return _torch_run(
        runner,
        lambda model, x, y: CarliniL2(model, x, y, value_range=value_range, **p.model_dump()).run(),
    )


def _build_apgd_batched(runner: AttackRunner, p: APGDBatchedParams) -> RunFn:
    value_range = runner.config.input_spec.value_range
    eps_step = p.eps_step
    assert eps_step is not None  # resolved by the params' validator
    # The random starts come from torch's generator, which run_batch seeds per batch.
    return _torch_run(
        runner,
        lambda model, x, y: apgd(
            model,
            x,
            y,
            value_range=value_range,
            eps=p.eps,
            eps_step=eps_step,
            max_iter=p.max_iter,
            nb_random_init=p.nb_random_init,
        ),
    )


def _build_deepfool_batched(runner: AttackRunner, p: DeepFoolBatchedParams) -> RunFn:
    value_range = runner.config.input_spec.value_range
    nb_grads = min(p.nb_grads, runner.config.num_classes)
    return _torch_run(
        runner,
        lambda model, x, y: deepfool(
            model,
            x,
            value_range=value_range,
            max_iter=p.max_iter,
            epsilon=p.epsilon,
            nb_grads=nb_grads,
        ),
    )


def _seeded_starts(
    runner: AttackRunner,
    x: np.ndarray,
    *,
    init_size: int,
    seed: int,
    refine: Callable[..., np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Initial adversarial images for the decision-based attacks, drawn as ART draws them (uniform
    images until one is classified differently, at most ``init_size``) but from a seeded generator:
    ART's own draw uses an unseeded ``RandomState``. Returns (starts, found, clean predictions)."""
    rng = np.random.default_rng([seed, 1])
    low, high = runner.config.input_spec.value_range
    preds = runner.classifier.predict(x).argmax(1)
    starts, found = x.copy(), np.zeros(len(x), dtype=bool)
    for i in range(len(x)):
        candidates = rng.uniform(low, high, size=(init_size, *x.shape[1:])).astype(np.float32)
        hits = np.flatnonzero(
            runner.classifier.predict(candidates, batch_size=128).argmax(1) != preds[i]
        )
        if hits.size:
            start = candidates[hits[0]]
            starts[i] = refine(start, x[i], int(preds[i])) if refine is not None else start
            found[i] = True
    return starts, found, preds


#: Overshoots tried, smallest first, to move a decision-based result off the boundary.
OVERSHOOTS = (0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)


def clear_of_boundary(
    runner: AttackRunner, x: np.ndarray, x_adv: np.ndarray, clean_pred: np.ndarray, margin: float
) -> np.ndarray:
    """Decision-based attacks end within float rounding of the decision boundary: after 5000
    Boundary iterations the top-2 logit margin is ~1e-6, and the predicted class of such an
    image changes with the batch size it is evaluated in (measured: an 'adversarial' image that
    the store then classifies correctly). Each result moves away from its original along
    ``x_adv - x`` by the smallest overshoot of :data:`OVERSHOOTS` that leaves it misclassified
    with a top-2 logit margin >= ``margin`` (DeepFool's overshoot, applied after the search);
    a result that no overshoot clears is left as it is."""
    if margin <= 0 or not len(x):
        return x_adv
    low, high = runner.config.input_spec.value_range
    cleared = x_adv.copy()
    pending = np.ones(len(x), dtype=bool)
    for overshoot in OVERSHOOTS:
        todo = np.flatnonzero(pending)
        if not todo.size:
            break
        step = x_adv[todo] - x[todo]
        candidates = np.clip(x[todo] + (1.0 + overshoot) * step, low, high).astype(np.float32)
        logits = runner.classifier.predict(candidates, batch_size=128)
        top = np.sort(logits, axis=1)
        ok = (logits.argmax(1) != clean_pred[todo]) & (top[:, -1] - top[:, -2] >= margin)
        cleared[todo[ok]] = candidates[ok]
        pending[todo[ok]] = False
    return cleared


def _decision_based_run(
    runner: AttackRunner,
    attack: Any,
    p: HSJParams | BoundaryParams,
    refine: Callable[..., np.ndarray] | None,
) -> RunFn:
    def run(x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        starts, found, preds = _seeded_starts(
            runner, x, init_size=p.init_size, seed=seed, refine=refine
        )
        x_adv = x.copy()  # no adversarial start found: the sample is left as is (as ART does)
        if found.any():
            generated = attack.generate(x=x[found], y=y[found], x_adv_init=starts[found])
            x_adv[found] = clear_of_boundary(runner, x[found], generated, preds[found], p.margin)
        return x_adv

    return run


def _build_hsj(runner: AttackRunner, p: HSJParams) -> RunFn:
    from art.attacks.evasion import HopSkipJump

    attack = HopSkipJump(
        runner.classifier,
        batch_size=64,  # queries per predict call, not images
        targeted=False,
        norm=_ART_NORMS[p.norm],
        max_iter=p.max_iter,
        max_eval=p.max_eval,
        init_eval=p.init_eval,
        init_size=p.init_size,
        verbose=False,
    )
    low, high = runner.config.input_spec.value_range

    def refine(start: np.ndarray, original: np.ndarray, label: int) -> np.ndarray:
        # What ART does to its own random start: an L2 binary search towards the original.
        return attack._binary_search(
            current_sample=start,
            original_sample=original,
            target=label,
            norm=2,
            clip_min=low,
            clip_max=high,
            threshold=0.001,
        )

    return _decision_based_run(runner, attack, p, refine)


def _build_boundary(runner: AttackRunner, p: BoundaryParams) -> RunFn:
    from art.attacks.evasion import BoundaryAttack

    attack = BoundaryAttack(
        runner.classifier,
        batch_size=64,  # queries per predict call, not images
        targeted=False,  # ART's default is targeted=True
        verbose=False,
        **p.model_dump(exclude={"margin"}),
    )
    return _decision_based_run(runner, attack, p, None)


class _UnitRange(nn.Module):
    """Presents a network with value range [low, high] as one taking [0, 1] (AutoAttack clamps to [0, 1])."""

    def __init__(self, model: nn.Module, low: float, high: float) -> None:
        super().__init__()
        self.model, self.low, self.scale = model, low, high - low

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.model(self.low + self.scale * u)


def _build_autoattack(runner: AttackRunner, p: AutoAttackParams) -> RunFn:
    try:
        from pyautoattack import AutoAttack
    except ImportError as error:  # pragma: no cover - the attacks extra ships it
        raise ConfigError(
            "autoattack needs the `pyautoattack` package: pip install 'lapguard[attacks]'"
        ) from error

    low, high = runner.config.input_spec.value_range
    scale = high - low
    network = runner.model if (low, high) == (0.0, 1.0) else _UnitRange(runner.model, low, high)

    def run(x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        # set with version 'custom' (_check_version requires them)
        custom = cast("list[AutoAttackName]", p.attacks)
        attack = AutoAttack(
            network,
            attacks=list(custom) if p.version == "custom" else None,
            device=runner.device,
            eps=p.eps / scale,
            norm=p.norm,
            seed=seed,
            version=p.version,
        )
        if p.n_iter is not None:
            attack.apgd.n_iter = attack.apgd_targeted.n_iter = attack.fab.n_iter = p.n_iter
        if p.n_queries is not None:
            attack.square.n_queries = p.n_queries
        if p.n_target_classes is not None:
            targets = min(p.n_target_classes, runner.config.num_classes - 1)
            attack.apgd_targeted.n_target_classes = attack.fab.n_target_classes = targets
        xt = torch.from_numpy((x - low) / scale).to(runner.device)
        yt = torch.from_numpy(y).to(runner.device)
        x_adv, _ = attack.run_standard_evaluation(xt, yt, batch_size=len(x))
        return x_adv.detach().cpu().numpy() * scale + low

    return run


def _build_noise(runner: AttackRunner, p: NoiseParams) -> RunFn:
    def run(x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return x + rng.uniform(-p.eps, p.eps, size=x.shape).astype(np.float32)

    return run


for _spec in (
    AttackSpec("fgm", FGMParams, _build_fgm, "white-box", 256),
    AttackSpec("apgd", APGDParams, _build_apgd, "white-box", 128),
    AttackSpec("bim", BIMParams, _build_bim, "white-box", 256),
    AttackSpec("cw", CWParams, _build_cw, "white-box", 64),
    AttackSpec("deepfool", DeepFoolParams, _build_deepfool, "white-box", 32, max_batch_size=32),
    AttackSpec("hsj", HSJParams, _build_hsj, "black-box", 1, slow=True),
    AttackSpec("boundary", BoundaryParams, _build_boundary, "black-box", 1, slow=True),
    AttackSpec("autoattack", AutoAttackParams, _build_autoattack, "white-box", 128),
    AttackSpec("noise", NoiseParams, _build_noise, "control", 1000),
    AttackSpec("cw-batched", CWBatchedParams, _build_cw_batched, "white-box", 256),
    AttackSpec(
        "deepfool-batched", DeepFoolBatchedParams, _build_deepfool_batched, "white-box", 256
    ),
    AttackSpec("apgd-batched", APGDBatchedParams, _build_apgd_batched, "white-box", 128),
):
    _register(_spec)
