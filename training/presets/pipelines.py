"""Named pipeline presets (``lapguard pipeline --preset NAME``): networks, attacks, detectors, protocols.

``smoke`` and ``quick`` run on 2 CPU cores, ``full`` (every attack) overnight on them; ``paper-*`` are
seed 003's experiments, for GPU machines with those data sets on disk
(``lapguard pipeline --preset paper-... --check`` checks them first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from detector.cost import DEFAULT_BUDGET, declared_ratio, within_budget
from detector.errors import ConfigError, validation_problems
from detector.features import FeatureSpec
from training.data.synthetic_outliers import SYNTHETIC_OOD

DetectorName = Literal["transport", "mahalanobis", "nss", "quantile", "novelty", "ensemble"]
#: The run's name of the network ``lapguard pipeline --network DIR`` protects.
IMPORTED_NAME = "network"
ServableName = Literal["transport", "quantile", "novelty", "ensemble"]


class FeatureOptions(BaseModel):
    """One candidate trajectory feature set (see :class:`detector.features.FeatureSpec`)."""

    model_config = ConfigDict(extra="forbid")

    embeddings: bool = False
    extra_directions: int = Field(default=0, ge=0, le=64)
    line_shape: bool = False
    head: bool = False
    start: bool = False
    image: bool = False
    squeeze: bool = False
    second: bool = False  # the run's other network's opinion (detector.opinion)
    nss: bool = False  # the input image's natural-scene statistics (detector.scene_statistics)

    def spec(self) -> FeatureSpec:
        return FeatureSpec(**self.model_dump())


# Seed 003 §5.3.1's feature sets, growing: residues; + the classifier's head; + embeddings; + the
# trajectory's start x_0 (how its energy spreads over the image); + extra directions and the
# line-shape score; each of the last three also with the input image's own spread (where a small
# L-inf perturbation shows before the stem smooths it); two of those also with how far the softmax
# moves when the input is squeezed (five more forward passes, detector.squeeze); the last two also
# with the run's other network's opinion of the prediction (one more forward pass of that network,
# detector.opinion: a minimal perturbation made for one network rarely fools the other); and two
# with the input image's natural-scene statistics (the NSS baseline's 36, detector.scene_statistics:
# a small L-inf step changes the image's local contrast statistics). The pipeline picks one on the
# training side.
FEATURE_CANDIDATES = [
    FeatureOptions(),
    FeatureOptions(head=True),
    FeatureOptions(embeddings=True, head=True),
    FeatureOptions(start=True, head=True),
    FeatureOptions(embeddings=True, start=True, head=True),
    FeatureOptions(embeddings=True, start=True, head=True, extra_directions=4, line_shape=True),
    FeatureOptions(image=True, start=True, head=True),
    FeatureOptions(embeddings=True, image=True, start=True, head=True),
    FeatureOptions(
        embeddings=True, image=True, start=True, head=True, extra_directions=4, line_shape=True
    ),
    FeatureOptions(image=True, start=True, head=True, squeeze=True),
    FeatureOptions(embeddings=True, image=True, start=True, head=True, squeeze=True),
    FeatureOptions(image=True, start=True, head=True, second=True),
    FeatureOptions(image=True, start=True, head=True, squeeze=True, second=True),
    FeatureOptions(image=True, nss=True, start=True, head=True),
    FeatureOptions(image=True, nss=True, start=True, head=True, squeeze=True, second=True),
]

# The quick preset's: the residues alone (the baseline) and every candidate with the image group.
# The five others without it scored 5-10 points below the image group's on the training side of
# both networks, for the ensemble and for TR, in every quick run measured; each costs ~6 s per
# network and selecting detector. The full preset offers all of them.
QUICK_FEATURE_CANDIDATES = [c for c in FEATURE_CANDIDATES if c.image or c == FeatureOptions()]


class AttackRun(BaseModel):
    """One adversarial set per network: attack ``attack`` with ``params`` on the first ``n`` test images."""

    model_config = ConfigDict(extra="forbid")

    key: str
    attack: str
    params: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(ge=2)
    n_by_model: dict[str, int] = Field(default_factory=dict)  # fewer (or more) images per network

    def n_for(self, model: str) -> int:
        """The number of test images attacked on network ``model``."""
        return self.n_by_model.get(model, self.n)


# Config fields that say where a run goes or how long it takes, not what it computes: a run
# directory is resumed across them (a newer version's time estimate, another device).
NOT_COMPUTED = {"device", "expected_duration"}


class PipelineConfig(BaseModel):
    """train -> attack -> features -> detection protocols -> deployable detector -> report -> bundle."""

    model_config = ConfigDict(extra="forbid")

    name: str
    dataset: str = "fashion-mnist"
    models: dict[str, str]  # network name in the run -> training preset
    # Network name in the run -> a network directory made by `lapguard import` (no training: its
    # images are the data set's, through the network's input spec).
    imported: dict[str, str] = Field(default_factory=dict)
    attacks: list[AttackRun]
    detectors: list[DetectorName] = ["transport", "mahalanobis"]
    seen: list[str] | None = None  # attack keys for the seen setting (default: every attack)
    unseen_train: str | None = None  # attack key trained on in the unseen setting
    # Attack keys, OOD set names, or "synthetic": outliers of the network's own validation images
    # (training/data/synthetic_outliers.py), the seed's OOD experiment trained on another distribution.
    ood_train: list[str] = Field(default_factory=list)
    ood_test: list[str] = Field(default_factory=lambda: ["digits", "noise"])
    ood_n: int = Field(default=1000, ge=10)
    seeds: int = Field(default=5, ge=1)
    test_fraction: float = Field(default=0.1, gt=0, lt=1)
    noisy_copies: bool = (
        False  # add uniformly noised clean copies (labelled clean) to detector training
    )
    # Up to this many clean training rows per abnormal row in the OOD protocol (1: the seed's
    # balanced sets; None: every clean image of the training side).
    ood_clean_ratio: float | None = Field(default=1.0, ge=1, allow_inf_nan=False)
    # training images for class means and covariance
    mahalanobis_clean_n: int = Field(default=5000, ge=100)
    # Input pre-processing magnitudes tried (chosen on the training side); Lee et al.'s list by default.
    mahalanobis_magnitudes: list[float] = Field(
        default_factory=lambda: [0.0, 0.0005, 0.001, 0.0014, 0.002, 0.005, 0.01]
    )
    target_fpr: float = Field(default=0.05, gt=0, lt=1)
    # The deployed threshold keeps FPR <= target_fpr on new clean images with this probability
    # (a Clopper-Pearson bound on its calibration images; None: the point estimate, which new
    # images exceed about half the time).
    calibration_confidence: float | None = Field(default=0.95, gt=0, lt=1)
    deploy_model: str = "lap"
    deploy_attacks: list[str] | None = (
        None  # attack keys the deployed detector is trained on (default: all)
    )
    # Synthetic outliers (training/data/synthetic_outliers.py) the deployed ensemble also learns, as
    # one more family beside the attacks: made from this many training-side clean images (0: none).
    deploy_synthetic_outliers: int = Field(default=0, ge=0)
    # Attack keys whose learning curve (seen-setting accuracy of the transport detector on the
    # deploy network vs the number of training pairs) the evaluation measures.
    learning_curve_attacks: list[str] = Field(default_factory=list)
    # Candidate feature sets (the first is the default; with several, the training side picks).
    feature_candidates: list[FeatureOptions] = Field(
        default_factory=lambda: [FeatureOptions()], min_length=1
    )
    # Guard time / the network's plain forward time the chosen features may cost: candidates
    # whose groups declare more forward passes, or whose extraction measures more on the deploy
    # network (detector.cost), are not offered. The default keeps the Guard to the one forward
    # pass that serves the prediction; None offers every candidate.
    cost_budget: float | None = Field(default=DEFAULT_BUDGET, ge=1, allow_inf_nan=False)
    selection_detector: ServableName = "transport"  # the detector the selection fits
    # Detectors that choose their OWN feature set on the training side (the same selection,
    # fitting them instead); every other feature-reading detector, the deployed one included,
    # reads the selection detector's.
    own_feature_selection: list[ServableName] = Field(default_factory=list)
    deploy_detector: ServableName = "transport"  # the detector the bundle ships
    not_run: list[dict[str, str]] = Field(
        default_factory=list
    )  # attacks left out, with the reason (for the report)
    # How long the preset takes and on what (shown by --list-presets and in the report).
    expected_duration: str | None = None
    device: str = "auto"

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        keys = [a.key for a in self.attacks]
        if len(set(keys)) != len(keys):
            raise ValueError(f"attack keys must be unique, got {keys}")
        if SYNTHETIC_OOD in (*keys, *self.ood_test):
            raise ValueError(
                f"{SYNTHETIC_OOD!r} names the OOD protocol's synthetic outliers: "
                "choose another attack key or OOD set"
            )
        for name in [
            *(self.seen or []),
            *([self.unseen_train] if self.unseen_train else []),
            *(self.deploy_attacks or []),
            *self.learning_curve_attacks,
        ]:
            if name not in keys:
                raise ValueError(f"{name!r} is not one of the attack keys {keys}")
        trainable = {*keys, *self.ood_test, SYNTHETIC_OOD}  # an OOD set is split: half trains
        for name in self.ood_train:
            if name not in trainable:
                raise ValueError(
                    f"OOD training set {name!r} is neither an attack key, an OOD set nor "
                    f"{SYNTHETIC_OOD!r}"
                )
        both = set(self.models) & set(self.imported)
        if both:
            raise ValueError(f"networks {sorted(both)} are both trained and imported")
        if self.deploy_model not in self.network_names:
            raise ValueError(
                f"deploy_model {self.deploy_model!r} is not one of the networks "
                f"{self.network_names}"
            )
        for name in self.own_feature_selection:
            if name not in self.detectors:
                raise ValueError(f"own_feature_selection: {name!r} is not one of the detectors")
            if name == self.deploy_detector:
                raise ValueError(
                    f"own_feature_selection: the deployed detector {name!r} reads the selection "
                    "detector's feature set, which the bundle ships"
                )
        if self.cost_budget is not None and not self.affordable_candidates():
            cheapest = min(declared_ratio(c.spec()) for c in self.feature_candidates)
            raise ValueError(
                f"no feature candidate fits cost_budget {self.cost_budget}: the cheapest "
                f"declares {cheapest:g} forward passes"
            )
        if any(c.second for c in self.feature_candidates) and len(self.network_names) < 2:
            raise ValueError(
                "a feature candidate with second=True needs a second network; "
                f"this config has only {self.network_names}"
            )
        return self

    def affordable_candidates(self) -> list[FeatureSpec]:
        """The candidate feature sets whose declared cost is within :attr:`cost_budget` (all
        without one), in the config's order."""
        specs = [c.spec() for c in self.feature_candidates]
        return specs if self.cost_budget is None else within_budget(specs, self.cost_budget)

    @property
    def network_names(self) -> list[str]:
        """Every network of the run: the trained ones, then the imported ones."""
        return [*self.models, *self.imported]

    def second_network(self, name: str) -> str:
        """The network whose opinion network ``name``'s second-opinion features hold: the
        config's first other network."""
        others = [m for m in self.network_names if m != name]
        if not others:
            raise ValueError(f"network {name!r} has no second network in {self.network_names}")
        return others[0]

    def on_network(
        self, network: str | Path, *, budget: float = DEFAULT_BUDGET, name: str = IMPORTED_NAME
    ) -> PipelineConfig:
        """This preset run on one imported network (a `lapguard import` directory) instead of
        the networks it trains: every attack and detector as configured, on that network alone,
        so the candidate feature sets without a second network's opinion (each once), chosen
        under ``budget`` (the preset's own budget was set for its own networks)."""
        candidates: list[FeatureOptions] = []
        for options in self.feature_candidates:
            alone = options.model_copy(update={"second": False})
            if alone not in candidates:
                candidates.append(alone)
        attacks = [{**a.model_dump(), "n_by_model": {}} for a in self.attacks]
        return validated(
            self,
            models={},
            imported={name: str(Path(network).resolve())},
            attacks=attacks,
            deploy_model=name,
            feature_candidates=[c.model_dump() for c in candidates],
            cost_budget=budget,
        )

    def feature_chooser(self, detector: str | None = None) -> str:
        """The detector whose training-side selection picks ``detector``'s feature set: itself
        when it is in ``own_feature_selection``, else (and for None) ``selection_detector``."""
        if detector in self.own_feature_selection:
            return str(detector)
        return self.selection_detector

    @property
    def seen_keys(self) -> list[str]:
        return self.seen if self.seen is not None else [a.key for a in self.attacks]


def validated(config: PipelineConfig, **changes: Any) -> PipelineConfig:
    """``config`` with ``changes``, checked again (a ConfigError says what does not hold)."""
    try:
        return PipelineConfig.model_validate({**config.model_dump(), **changes})
    except ValidationError as error:
        raise ConfigError(
            f"pipeline {config.name}: {validation_problems(error.errors())}"
        ) from error


# The LAP presets compare every candidate, the squeezed and second-opinion ones included: they
# set no cost budget, knowingly; a user's network runs under the default budget.

# CW-L2 as the CPU presets run it: ART's algorithm (cw-batched) with 5 binary-search steps from
# c = 0.3 instead of 10 from c = 0.01, which spend their first steps doubling c up to where an
# image is first fooled. Against ART with the seed's parameters on the same 200 images
# (benchmarks/minimal_attacks.py): success -0.0 / -0.6 points, median L2 -6% / -5% (LAP /
# vanilla), half the cost (0.12 s/image on 2 cores; docs/decisions.md, "Batched CW and DeepFool").
CPU_CW_PARAMS: dict[str, Any] = {"binary_search_steps": 5, "initial_const": 0.3}

# DeepFool as the CPU presets run it: deepfool-batched towards each image's 3 most likely classes
# (its prediction and the next two) instead of all 10: one backward pass per candidate and step,
# and the seed's overshoot (1e-6) takes ~35 steps per image on the quick networks. Measured against
# ART with the seed's parameters (docs/decisions.md, "Batched CW and DeepFool").
CPU_DEEPFOOL_PARAMS: dict[str, Any] = {"nb_grads": 3}

_CPU_NOT_RUN = [
    {"attack": "hsj", "reason": "HopSkipJump takes ~24 s/image on 2 CPU cores; use a GPU preset"},
    {
        "attack": "boundary",
        "reason": "BoundaryAttack (5000 iterations) takes ~200 s/image on 2 CPU cores; use a GPU preset",
    },
    {
        "attack": "autoattack",
        "reason": "AutoAttack standard is ~100x FGM's cost on CPU; use a GPU preset",
    },
]

# Seed 003, section 5.4 and appendix H: FGM/APGD/BIM at eps 0.03 (Linf), CW and HSJ in L2, ART's
# defaults otherwise (HSJ 50, BA 5000, CW 10, APGD and DeepFool 100 iterations); one adversarial
# example per test image, the test set split 0.9/0.1 into detection training and test sets.
_PAPER_ATTACKS = {
    "fgm": AttackRun(key="fgm", attack="fgm", params={"eps": 0.03}, n=10000),
    "apgd": AttackRun(key="apgd", attack="apgd", params={"eps": 0.03}, n=10000),
    "bim": AttackRun(key="bim", attack="bim", params={"eps": 0.03}, n=10000),
    "autoattack": AttackRun(key="autoattack", attack="autoattack", params={"eps": 0.03}, n=10000),
    "deepfool": AttackRun(key="deepfool", attack="deepfool", n=10000),
    "cw": AttackRun(key="cw", attack="cw", n=10000),
    "hsj": AttackRun(key="hsj", attack="hsj", n=10000),
    "boundary": AttackRun(key="boundary", attack="boundary", n=10000),
}


def _paper_preset(
    family: str,
    dataset: str,
    attacks: list[str],
    *,
    seen: list[str] | None = None,
    ood_train: list[str],
    ood_test: list[str],
) -> PipelineConfig:
    """A seed-003 configuration: vanilla and LAP networks of the training presets ``family-*``,
    the attacks that network was evaluated on (table 12), unseen attacks after training on FGM
    (table 13), and the OOD experiments (tables 14, 15); every detector of the paper."""
    return PipelineConfig(
        name=family,
        dataset=dataset,
        models={"vanilla": f"{family}-vanilla", "lap": f"{family}-lap"},
        attacks=[_PAPER_ATTACKS[key] for key in attacks],
        detectors=["transport", "mahalanobis", "nss"],
        seen=seen,
        unseen_train="fgm",
        ood_train=ood_train,
        ood_test=ood_test,
        ood_n=10000,
        seeds=5,
        test_fraction=0.1,
        not_run=[
            {"attack": key, "reason": f"the seed does not evaluate {key} on {family}"}
            for key in _PAPER_ATTACKS
            if key not in attacks
        ],
    )


# `full`: quick's fast attacks plus every slow one, for an overnight run on 2 CPU cores. Expected
# time from the per-image costs in docs/results.md, "Attacks" (2 cores, run alone), both networks:
#   training 7 min; the FGM/BIM/APGD sets (eps 0.1 and 0.03) ~27 min (quick's measured costs:
#     BIM 0.038 s/image, APGD as apgd-batched 0.14-0.16 s/image, ART's 0.20-0.25);
#   CW and DeepFool as cw-batched/deepfool-batched, 1000 images: <= 0.91 h (bounded by ART's CW,
#     1.79/1.50 s/image on VAN/LAP: the same algorithm, batched) + 0.06 h (DeepFool with
#     CPU_DEEPFOOL_PARAMS, 0.10-0.11 s/image; ART's 0.82-1.40);
#   AutoAttack standard eps=0.1, 500 images: <= 1.47 h (5.3 s/image at eps=0.03; at 0.1 APGD-CE
#     fools almost every image and AutoAttack runs its other attacks on the rest only);
#   HopSkipJump (50 it.), 500 images: 2.31 h (8.3 s/image);
#   Boundary (5000 it.), 100 images: 3.48 h (62.7 s/image);
#   features, protocols, detector, report and bundle ~10 min (quick: 8 min for 6 sets).
# Total <= 8.9 h; the slow attacks' costs were measured on the LAP network. The slow sets can be
# made faster elsewhere with `lapguard attack --engine ray`: a set is keyed by its configuration.
_FULL_ATTACKS = [
    AttackRun(key="fgm-eps0.1", attack="fgm", params={"eps": 0.1}, n=10000),
    AttackRun(key="fgm-eps0.03", attack="fgm", params={"eps": 0.03}, n=2000),
    AttackRun(key="bim-eps0.03", attack="bim", params={"eps": 0.03}, n=2000),
    AttackRun(key="apgd-eps0.03", attack="apgd-batched", params={"eps": 0.03}, n=2000),
    AttackRun(key="bim", attack="bim", params={"eps": 0.1}, n=5000),
    AttackRun(key="apgd", attack="apgd-batched", params={"eps": 0.1}, n=1500),
    AttackRun(key="cw", attack="cw-batched", params=CPU_CW_PARAMS, n=1000),
    AttackRun(key="deepfool", attack="deepfool-batched", params=CPU_DEEPFOOL_PARAMS, n=1000),
    AttackRun(key="autoattack", attack="autoattack", params={"eps": 0.1}, n=500),
    AttackRun(key="hsj", attack="hsj", n=500),
    AttackRun(key="boundary", attack="boundary", n=100),
]
_FULL = PipelineConfig(
    name="full",
    models={"vanilla": "quick-vanilla", "lap": "quick-lap"},
    attacks=_FULL_ATTACKS,
    detectors=["transport", "ensemble", "mahalanobis", "nss", "quantile"],
    unseen_train="fgm-eps0.1",
    ood_train=["fgm-eps0.1", "cw", SYNTHETIC_OOD],  # as quick
    ood_clean_ratio=None,  # as quick
    ood_n=1000,
    seeds=5,
    mahalanobis_magnitudes=[0.0, 0.001],  # each magnitude > 0 costs a backward per layer
    learning_curve_attacks=["cw", "deepfool"],
    feature_candidates=FEATURE_CANDIDATES,
    cost_budget=None,
    selection_detector="ensemble",
    own_feature_selection=["transport"],  # as quick
    deploy_detector="ensemble",
    deploy_synthetic_outliers=1800,  # as quick
    expected_duration="at most ~8.9 h on 2 CPU cores, alone (Boundary 3.5 h, HopSkipJump 2.3 h)",
)

PIPELINE_PRESETS: dict[str, PipelineConfig] = {
    "smoke": PipelineConfig(
        name="smoke",
        models={"vanilla": "smoke-vanilla", "lap": "smoke-lap"},
        attacks=[AttackRun(key="fgm-eps0.1", attack="fgm", params={"eps": 0.1}, n=600)],
        detectors=["transport", "ensemble", "mahalanobis", "quantile"],
        ood_train=["fgm-eps0.1", SYNTHETIC_OOD],
        # Both candidates hold the other network's opinion, so every smoke bundle carries two
        # networks and the end-to-end tests serve the second one.
        feature_candidates=[FeatureOptions(second=True), FeatureOptions(head=True, second=True)],
        cost_budget=None,  # the second network's pass, knowingly
        selection_detector="ensemble",
        own_feature_selection=["transport"],  # as quick
        deploy_detector="ensemble",
        ood_n=200,
        seeds=2,
        test_fraction=0.2,
        # 40 calibration images cannot bound a 5% FPR with 95% confidence (0 of 40 flagged bounds
        # it at 7.2%): the threshold would flag nothing clean and little else. The point estimate.
        calibration_confidence=None,
        mahalanobis_clean_n=500,
        mahalanobis_magnitudes=[0.0, 0.001],
        not_run=[
            {"attack": a, "reason": "the smoke preset runs FGM only"}
            for a in ("apgd", "bim", "cw", "deepfool", "hsj", "boundary", "autoattack")
        ],
    ),
    "quick": PipelineConfig(
        name="quick",
        models={"vanilla": "quick-vanilla", "lap": "quick-lap"},
        # test_fraction 0.2: >= 200 test images per attack per seed from ~1,200 attacked images,
        # so the slow attacks fit the 45-minute budget on 2 CPU cores. The vanilla network (the
        # LAP comparison) gets fewer images of the slow attacks (n_by_model).
        attacks=[
            AttackRun(key="fgm-eps0.1", attack="fgm", params={"eps": 0.1}, n=10000),
            # eps=0.03 (the seed's budget): ~60-80% succeed. Each slow or small-budget set is sized
            # for >= 200 successful held-out images with ~10% to spare (one quick run kept 183-214 of
            # 1,250-1,700 images).
            AttackRun(key="fgm-eps0.03", attack="fgm", params={"eps": 0.03}, n=2000),
            AttackRun(key="bim-eps0.03", attack="bim", params={"eps": 0.03}, n=1600),
            AttackRun(
                key="apgd-eps0.03",
                attack="apgd-batched",
                params={"eps": 0.03},
                n=1650,
                n_by_model={"vanilla": 500},
            ),
            AttackRun(key="bim", attack="bim", params={"eps": 0.1}, n=2500),
            AttackRun(
                key="apgd",
                attack="apgd-batched",
                params={"eps": 0.1},
                n=1250,
                n_by_model={"vanilla": 500},
            ),
            # ART's CW-L2 and DeepFool as batched torch code (same algorithms, tested against
            # ART): CW with CPU_CW_PARAMS ~16x, DeepFool with CPU_DEEPFOOL_PARAMS ~12x cheaper than
            # ART's on 2 CPU cores.
            AttackRun(
                key="cw",
                attack="cw-batched",
                params=CPU_CW_PARAMS,
                n=1350,
                n_by_model={"vanilla": 500},
            ),
            AttackRun(
                key="deepfool",
                attack="deepfool-batched",
                params=CPU_DEEPFOOL_PARAMS,
                n=1400,
                n_by_model={"vanilla": 500},
            ),
        ],
        detectors=["transport", "ensemble", "mahalanobis", "nss", "quantile"],
        unseen_train="fgm-eps0.1",
        # The seed's two OOD experiments (003 section 5.4.4): trained on an attack (FGM, CW) and on
        # another distribution, here synthetic outliers of the network's own validation images.
        ood_train=["fgm-eps0.1", "cw", SYNTHETIC_OOD],
        # The OOD protocol's detectors learn clean from every clean training-side image: with as
        # many as CW's few hundred images, the CW-trained ensemble flagged 8.6% of clean test
        # images (docs/decisions.md, "OOD clean ratio").
        ood_clean_ratio=None,
        ood_n=1000,
        seeds=5,
        test_fraction=0.2,
        mahalanobis_magnitudes=[0.0, 0.001],  # each magnitude > 0 costs a backward per layer
        learning_curve_attacks=["cw", "deepfool"],
        feature_candidates=QUICK_FEATURE_CANDIDATES,
        cost_budget=None,
        selection_detector="ensemble",
        # The transport forests (TR) choose their own set: what the forests alone separate best
        # is not what the ensemble, with its clean-only parts, does best (docs/decisions.md,
        # "Transport forests choose their own features").
        own_feature_selection=["transport"],
        deploy_detector="ensemble",
        # The shipped ensemble also learns synthetic outliers of 1,800 training-side clean images
        # (chosen on the training side: docs/decisions.md, "Synthetic outliers").
        deploy_synthetic_outliers=1800,
        expected_duration=(
            "~54 min on 2 CPU cores, alone (training 9, attacks 18, evaluation 24, deploying"
            ' and reporting 2; docs/results.md, "Pipeline time")'
        ),
        not_run=_CPU_NOT_RUN,
    ),
    "paper-cifar10-resnet110": _paper_preset(
        "paper-cifar10-resnet110",
        "cifar10",
        ["fgm", "apgd", "bim", "autoattack", "deepfool", "cw", "hsj", "boundary"],
        ood_train=["cifar100", "cw"],
        ood_test=["cifar100", "svhn"],
    ),
    "paper-cifar100-resnext50": _paper_preset(
        "paper-cifar100-resnext50",
        "cifar100",
        ["fgm", "apgd", "bim", "autoattack", "deepfool", "cw"],
        ood_train=["autoattack", "cw"],
        ood_test=["svhn"],
    ),
    # The seed has no OOD experiment on TinyImageNet: the data-free OOD sets only.
    "paper-tinyimagenet-wrn": _paper_preset(
        "paper-tinyimagenet-wrn",
        "imagefolder",
        ["fgm", "apgd", "bim", "autoattack", "deepfool", "cw"],
        seen=["fgm", "apgd", "bim", "autoattack"],  # DeepFool and CW: unseen only (table 13)
        ood_train=[],
        ood_test=["digits", "noise"],
    ),
    "full": _FULL,
}


class DiagnoseConfig(BaseModel):
    """``lapguard diagnose --preset NAME --run DIR``: train the networks the seeds' comparisons
    need, diagnose them (training/diagnostics/diagnose.py) and measure each claim (training/diagnostics/claims.py).

    ``models`` maps a role to a training preset; the claims read the roles ``resnet`` (residual,
    BatchNorm, vanilla), ``lap`` (the same with LAP), ``plain`` (no skips) and ``unit``
    (unitization instead of BatchNorm), and skip a claim whose roles are missing."""

    model_config = ConfigDict(extra="forbid")

    name: str
    models: dict[str, str]
    n: int = Field(default=1000, ge=2)
    probe_n: int = Field(default=2000, ge=10)
    ots_n: int = Field(default=500, ge=2)
    expected_duration: str | None = None
    device: str = "auto"


DIAGNOSE_PRESETS: dict[str, DiagnoseConfig] = {
    "diagnose": DiagnoseConfig(
        name="diagnose",
        models={
            "resnet": "diagnose-resnet-vanilla",
            "lap": "diagnose-resnet-lap",
            "plain": "diagnose-plain-vanilla",
            "unit": "diagnose-unit-vanilla",
        },
        expected_duration="<= 45 min on 2 busy CPU cores (4 networks x 3 epochs on 5,000 images)",
    ),
}


def get_diagnose_preset(name: str) -> DiagnoseConfig:
    """A copy of the named diagnose preset; an unknown name lists the known ones."""
    if name not in DIAGNOSE_PRESETS:
        raise ConfigError(
            f"unknown diagnose preset {name!r}; known: {', '.join(sorted(DIAGNOSE_PRESETS))}"
        )
    return DIAGNOSE_PRESETS[name].model_copy(deep=True)


def list_pipeline_presets() -> list[str]:
    return sorted(PIPELINE_PRESETS)


def get_pipeline_preset(name: str) -> PipelineConfig:
    """A copy of the named preset; an unknown name lists the known ones."""
    if name not in PIPELINE_PRESETS:
        raise ConfigError(
            f"unknown pipeline preset {name!r}; known: {', '.join(list_pipeline_presets())}"
        )
    return PIPELINE_PRESETS[name].model_copy(deep=True)
