"""The system an adaptive attack faces: a network, a detector fitted on the training side and its
calibrated threshold, behind the one scoring path (:class:`~detector.guard.Guard`).

A target is either one detector (``members=1``, e.g. the transport forests "TR") or a pool of
``members`` detectors of the same kind, each fitted with its own seed on its own bootstrap share
of the training side and calibrated at the same target FPR; the pool answers each query with a
member drawn at random (Eniser et al. 2020, suggested by seed 003 §5.4.5). Everything is fitted
and calibrated on the training side of the seed-0 split, as :func:`training.evaluation.deployable.fit_deployable`
does; nothing is chosen on the test side, where the attacks' starting images come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from detector import artefacts
from detector.base import Detector
from detector.calibration import Calibration
from detector.errors import ArtefactError, InputError
from detector.features import FeatureSpec
from detector.guard import Guard
from detector.registry import get_detector, load_detector
from training.attacks.registry import network_config
from training.evaluation.context import PipelineRun, add_precomputed
from training.evaluation.deployable import SPLIT_SEED, deploy_parts, equal_shares
from training.evaluation.protocols import Samples, Split, on_all_cores

TARGET_FILE = "target.json"
BOOTSTRAP_SHARE = 0.8


class DetectorPool(nn.Module):
    """Detectors in torch form, each with its threshold, answering with a random member per sample.

    ``forward(features, predicted) -> score - threshold`` of the member drawn for each sample (a
    seeded generator, advanced by every call: a new draw per query), so the pool flags where
    the result is > 0. :meth:`margins` gives every member's ``score - threshold`` [N, K].
    """

    thresholds: torch.Tensor

    def __init__(self, members: list[nn.Module], thresholds: list[float], *, seed: int = 0) -> None:
        super().__init__()
        if not members or len(members) != len(thresholds):
            raise InputError("a pool needs at least one member and one threshold per member")
        self.members = nn.ModuleList(members)
        self.register_buffer("thresholds", torch.tensor(thresholds, dtype=torch.float32))
        self.generator = torch.Generator().manual_seed(seed)

    def margins(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Every member's ``score - threshold``, float32 [N, K]."""
        scores = [member(features, predicted).float() for member in self.members]
        return torch.stack(scores, dim=1) - self.thresholds

    def draw(self, n: int) -> torch.Tensor:
        """The members answering the next ``n`` queries (int64 [N])."""
        return torch.randint(len(self.members), (n,), generator=self.generator)

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        margins = self.margins(features, predicted)
        chosen = self.draw(len(features)).to(margins.device)
        return margins.gather(1, chosen[:, None])[:, 0]


@dataclass(frozen=True)
class TargetSpec:
    """Which system is attacked: detector ``detector`` (registry name), ``members`` of them."""

    detector: str = "transport"
    members: int = 1

    def __post_init__(self) -> None:
        if self.members < 1:
            raise InputError(f"a target needs at least one member, got {self.members}")

    @property
    def label(self) -> str:
        """'transport' for one detector, 'transport-pool5' for a pool of five."""
        return self.detector if self.members == 1 else f"{self.detector}-pool{self.members}"


@dataclass
class Target:
    """A fitted, calibrated system: the Guard (the black box) and what an attacker may know."""

    spec: TargetSpec
    guard: Guard
    detectors: list[Detector]
    calibrations: list[Calibration]
    features: FeatureSpec

    @property
    def pool(self) -> DetectorPool:
        """The members with their thresholds (a pool of one for a single detector)."""
        return DetectorPool(
            [d.to_torch() for d in self.detectors], [c.threshold for c in self.calibrations]
        ).to(self.guard.device)

    def flagged(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(network labels, flags) of images ``x`` through the Guard: one query per image."""
        result = self.guard.predict(torch.from_numpy(np.asarray(x, dtype=np.float32)))
        return result.labels, result.flagged


def target_dir(run: PipelineRun, name: str, spec: TargetSpec) -> Path:
    """``RUN/adaptive/<network>/target-<label>/``."""
    return run.dir.adaptive(name) / f"target-{spec.label}"


def _member_training(train: Samples, k: int, members: int) -> Samples:
    """Member ``k``'s rows: all of them for a single detector; a seeded bootstrap share of the
    source images otherwise (clean and attacked rows of an image stay together)."""
    if members == 1:
        return train
    rng = np.random.default_rng([SPLIT_SEED, k])
    images = np.unique(train.indices)
    keep = rng.choice(images, int(round(BOOTSTRAP_SHARE * len(images))), replace=False)
    return train.take(np.isin(train.indices, keep))


def _saved_calibrations(info: Any, members: int, path: Path) -> list[Calibration]:
    """The members' calibrations a cached target holds; a damaged cache raises ArtefactError."""
    saved = info.get("calibrations") if isinstance(info, dict) else None
    if not isinstance(saved, list) or len(saved) != members:
        raise ArtefactError(
            f"adaptive target {path} holds no calibration for each of its {members} members; "
            f"delete {path.parent} to fit the target again"
        )
    return [Calibration.from_dict(c) for c in saved]


def fit_target(run: PipelineRun, name: str, spec: TargetSpec) -> Target:
    """Fit (or load) the target of network ``name``: each member on the training side of the
    network's attack sets in equal shares, each row marked with its attack family (as the
    deployed detector: an ensemble also fits one forest set per family), calibrated at the
    config's target FPR on the calibration split's clean images through the Guard."""
    out = target_dir(run, name, spec)
    config, data = run.config, run.samples(name, spec.detector)
    features = run.feature_spec(name, spec.detector)
    model, second = run.model(name), run.second_model(name, features)
    split = Split(SPLIT_SEED, config.test_fraction, int(data.clean.indices.max()) + 1)
    saved = out / TARGET_FILE
    # the per-row arrays its detector reads (the ensemble's penultimate embedding), cached
    add_precomputed(run, name, get_detector(spec.detector), [data.clean, *data.attacks.values()])
    if saved.is_file():
        info = artefacts.read_json(saved, what="adaptive target")
        detectors = [load_detector(out / f"member-{k}") for k in range(spec.members)]
        calibrations = _saved_calibrations(info, spec.members, saved)
    else:
        clean_train = split.train(data.clean)
        attacked = deploy_parts(config, data.attacks, split)
        detectors, calibrations = [], []
        for k in range(spec.members):
            detector = on_all_cores(get_detector(spec.detector).with_seed(SPLIT_SEED + k))
            clean = _member_training(clean_train, k, spec.members)
            abnormal = equal_shares(
                [_member_training(a, k, spec.members) for a in attacked], seed=SPLIT_SEED + k
            )
            detector.fit_samples(clean, abnormal)
            guard = Guard.from_run(
                model,
                detector,
                np.inf,
                features=detector.serving_features(features),
                device=run.device,
                second=second,
            )
            scores = guard.predict(split.calibration(data.clean).images).scores
            calibrations.append(
                Calibration.from_scores(scores.astype(np.float64), config.target_fpr)
            )
            detector.save(out / f"member-{k}")
            detectors.append(detector)
        artefacts.write_json(
            saved,
            {
                "detector": spec.detector,
                "members": spec.members,
                "calibrations": [c.to_dict() for c in calibrations],
                "split_seed": SPLIT_SEED,
            },
        )
    features = detectors[0].serving_features(features)  # every member reads the same
    return assemble_target(
        model, spec, detectors, calibrations, features, device=run.device, second=second
    )


def assemble_target(
    model: nn.Module,
    spec: TargetSpec,
    detectors: list[Detector],
    calibrations: list[Calibration],
    features: FeatureSpec | None = None,
    *,
    device: str | torch.device = "cpu",
    second: nn.Module | None = None,
) -> Target:
    """The Guard of fitted ``detectors`` with their ``calibrations`` on ``model`` (and the
    ``second`` network of features that hold its opinion): the detector and its threshold for
    one member, the random :class:`DetectorPool` (threshold 0) otherwise."""
    features = features or FeatureSpec()
    if len(detectors) != spec.members or len(calibrations) != spec.members:
        raise InputError(f"target {spec.label} needs {spec.members} detectors and calibrations")
    if spec.members == 1:
        guard = Guard.from_run(
            model, detectors[0], calibrations[0], features=features, device=device, second=second
        )
    else:
        pool = DetectorPool([d.to_torch() for d in detectors], [c.threshold for c in calibrations])
        config = network_config(model)
        guard = Guard(
            model,
            pool,
            input_spec=config.input_spec,
            class_names=config.class_names,
            threshold=0.0,
            features=features,
            device=device,
            second=second,
        )
    return Target(spec, guard, detectors, calibrations, features)
