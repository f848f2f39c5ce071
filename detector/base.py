"""The one detector contract: what every detector reads, how it fits and scores, its metadata.

Every detector is a scikit-learn style estimator (``__init__`` stores parameters only, learned
attributes end in ``_``, :func:`check_fitted` guards use) with two entry levels:

- its own level, on the arrays it reads (``TransportDetector.fit(features, is_abnormal,
  predicted)``, ``NSSDetector.fit(images, is_abnormal)``, ...);
- the common level, on sample sets (anything with row-aligned ``images``, ``features``,
  ``predicted`` and ``extra`` arrays, like ``training.evaluation.protocols.Samples``):
  ``fit_samples(clean, abnormal)`` and ``score_samples(samples)``, HIGHER = MORE ABNORMAL.

Detectors that read the network (``info.reads == "network"``) are first prepared on clean
training images (``prepare``) and read per-image-set arrays that ``precompute`` returns into
``samples.extra`` once, so many fits share one pass of the network. Detectors with a torch form
(``info.servable``) also give ``to_torch``, ``to_arrays``/``from_arrays`` and ``save``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError as SklearnNotFittedError
from sklearn.utils.validation import check_is_fitted
from torch import nn

from detector.artefacts import save_arrays, write_json
from detector.errors import ConfigError, InputError, NotFittedError

if TYPE_CHECKING:
    from detector.features import FeatureSpec

DEFAULT_VOTE_THRESHOLD = 0.5  # forests flag an input when more than half of the trees vote so
# The fewest trees whose votes make a held-out forest score (Detector.score_held_out): ten votes
# resolve a vote fraction to 0.1, the spacing of the thresholds calibration lands on.
MIN_HELD_OUT_TREES = 10
ARRAYS_FILE = "detector.safetensors"
PARAMS_FILE = "detector.json"

Reads = Literal["features", "images", "network"]
Self = TypeVar("Self", bound="Detector")


@dataclass(frozen=True)
class DetectorInfo:
    """What a registered detector is, for configs, the CLI, the report and the bundle."""

    name: str  # registry name, e.g. "transport"
    short_name: str  # report label, e.g. "TR"
    reads: Reads  # transport features, the images themselves, or images through the network
    supervised: bool = True  # False: fitted on clean samples only (abnormal ones are ignored)
    default_threshold: float | None = DEFAULT_VOTE_THRESHOLD  # its own decision; None: calibrated
    servable: bool = False  # has a torch form and travels in a bundle
    summary: str = ""  # one line for the report's legend: what it reads and how it decides


class SampleSet(Protocol):
    """Row-aligned inputs of one kind; ``training.evaluation.protocols.Samples`` is one."""

    images: np.ndarray  # [N, C, H, W] float32
    features: np.ndarray  # transport features [N, F]
    predicted: np.ndarray  # the network's predicted labels [N]
    extra: dict[str, np.ndarray]  # precomputed per-row arrays (``Detector.precompute``)

    def __len__(self) -> int: ...


# --------------------------------------------------------------------------------------------
# Shared checks
# --------------------------------------------------------------------------------------------
def check_fitted(estimator: BaseEstimator) -> None:
    """Raise lapguard's NotFittedError when ``estimator`` has not been fitted."""
    try:
        check_is_fitted(estimator)
    except SklearnNotFittedError as error:
        raise NotFittedError(
            f"this {type(estimator).__name__} is not fitted yet: call fit first"
        ) from error


def check_binary_labels(is_abnormal: np.ndarray, n: int) -> np.ndarray:
    """0/1 labels (1 = abnormal) of length n with both classes present, as int64."""
    labels = np.asarray(is_abnormal)
    if labels.shape != (n,):
        raise InputError(f"is_abnormal must have shape ({n},), got {labels.shape}")
    if labels.dtype != bool and not np.isin(labels, (0, 1)).all():
        raise InputError("is_abnormal must hold 0 (clean) and 1 (abnormal) only")
    labels = labels.astype(np.int64)
    if labels.min(initial=1) == labels.max(initial=0):
        raise InputError(
            "is_abnormal needs both clean (0) and abnormal (1) samples to fit a detector"
        )
    return labels


def check_class_labels(labels: np.ndarray, n: int, name: str = "predicted_labels") -> np.ndarray:
    """Integer class labels of length n, as int64."""
    array = np.asarray(labels)
    if array.shape != (n,):
        raise InputError(f"{name} must have shape ({n},), got {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must be integer class indices, got dtype {array.dtype}")
    return array.astype(np.int64)


def check_groups(groups: np.ndarray | None, n: int) -> np.ndarray:
    """One group id per row of ``n`` (a row's source image), as an array; row positions (each row
    its own group) when None."""
    if groups is None:
        return np.arange(n)
    if np.shape(groups) != (n,):
        raise InputError(f"groups must have shape ({n},), got {np.shape(groups)}")
    return np.asarray(groups)


def abnormal_labels(clean: SampleSet, abnormal: SampleSet) -> np.ndarray:
    """0 for every clean row then 1 for every abnormal row (bool [len(clean) + len(abnormal)])."""
    return np.concatenate([np.zeros(len(clean), bool), np.ones(len(abnormal), bool)])


def source_groups(clean: SampleSet, abnormal: SampleSet) -> np.ndarray | None:
    """The source image of each row of clean then abnormal (an attacked image shares its clean
    source's id), for grouped out-of-bag votes; None when the sets carry no ``indices``. An
    abnormal set that is not made from the clean images (an OOD set) only groups unrelated
    rows, which costs them votes but no bias."""
    indices = [getattr(s, "indices", None) for s in (clean, abnormal)]
    if any(i is None for i in indices):
        return None
    return np.concatenate([np.asarray(i) for i in indices])


# --------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------
class Detector(BaseEstimator):
    """Base of every detector: metadata in ``info`` and the sample-set entry level.

    Subclasses implement ``fit_samples`` and ``score_samples``; servable ones also ``to_torch``,
    ``to_arrays`` and ``from_arrays``. Scores are float64 [N], HIGHER = MORE ABNORMAL.
    """

    info: ClassVar[DetectorInfo]

    def fit_samples(self: Self, clean: SampleSet, abnormal: SampleSet) -> Self:
        """Fit on clean vs abnormal sample sets (clean-only detectors ignore ``abnormal``)."""
        raise NotImplementedError

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        """Abnormality scores of a sample set, float64 [N]: HIGHER = MORE ABNORMAL."""
        raise NotImplementedError

    def decision_threshold(self) -> float | None:
        """The fitted detector's own decision (flag = score > it): ``info.default_threshold`` by
        default, a threshold learnt in ``fit`` where a detector learns one; None: it decides at
        the threshold calibrated at a target FPR."""
        return self.info.default_threshold

    def held_out_scores(
        self, features: np.ndarray, predicted_labels: np.ndarray, groups: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Scores of any rows by what never saw their group (``groups``: each row's source
        image), and per row the fewest forest trees that voted; None (default): the detector
        has no such scores. A detector whose parts can leave rows out overrides it."""
        return None

    def score_held_out(self, samples: SampleSet) -> np.ndarray | None:
        """Scores of ``samples`` by what never saw their source images (``samples.indices``):
        the fitted detector's own clean fitting images scored about as new clean images are,
        so a threshold can be calibrated on them too (more images than a held-out slice alone).
        NaN where a forest has fewer than :data:`MIN_HELD_OUT_TREES` such trees; None when the
        detector has no held-out scores (:meth:`held_out_scores`)."""
        indices = getattr(samples, "indices", None)
        if indices is None:
            raise InputError("held-out scores need each sample's source image ('indices')")
        held_out = self.held_out_scores(
            self.serving_rows(samples), samples.predicted, np.asarray(indices)
        )
        if held_out is None:
            return None
        if not getattr(self, "grouped_", False):
            raise InputError(
                "this detector was fitted without each row's source image (fit_samples gives "
                "them), so its fitting images cannot be told by their indices"
            )
        scores, trees = held_out
        return np.where(trees >= MIN_HELD_OUT_TREES, scores, np.nan)

    def prepare(self: Self, model: nn.Module, images: np.ndarray, labels: np.ndarray) -> Self:
        """Fit what the detector learns from clean training images once (a no-op by default)."""
        return self

    def precompute(self, model: nn.Module, images: np.ndarray) -> dict[str, np.ndarray]:
        """Per-row arrays of ``images`` that ``fit_samples``/``score_samples`` read from
        ``samples.extra`` (none by default): computed once per image set, shared by every fit."""
        return {}

    def precompute_keys(self) -> list[str]:
        """The ``samples.extra`` keys :meth:`precompute` returns (none by default), so a cache of
        them can be checked before anything is computed."""
        return []

    def serving_features(self, spec: FeatureSpec) -> FeatureSpec:
        """The features the fitted detector reads where it is served, given ``spec``, those it
        was fitted on (the same by default; a detector may append columns it computes there)."""
        return spec

    def serving_rows(self, samples: SampleSet) -> np.ndarray:
        """The feature matrix the fitted detector's torch form reads for ``samples``: what the
        Guard computes with :meth:`serving_features` (the samples' features by default)."""
        return np.asarray(samples.features)

    def with_seed(self: Self, seed: int) -> Self:
        """An unfitted copy with ``random_state=seed`` (when it has one) that shares what
        ``prepare`` learned: one detector per seed of an experiment."""
        params = self.get_params()
        if "random_state" in params:
            params["random_state"] = seed
        return type(self)(**params)

    def to_torch(self) -> nn.Module:
        """The fitted detector as a torch module ``forward(features, predicted=None) -> scores``."""
        raise ConfigError(f"the {self.info.name} detector has no torch form: it cannot be served")

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Numpy arrays + JSON-able parameters that :meth:`from_arrays` turns back into it."""
        raise ConfigError(f"the {self.info.name} detector cannot be saved as arrays")

    @classmethod
    def from_arrays(cls: type[Self], arrays: dict[str, np.ndarray], params: dict[str, Any]) -> Self:
        """A detector that scores like the one :meth:`to_arrays` saved."""
        raise ConfigError(f"the {cls.info.name} detector cannot be loaded from arrays")

    def save(self, directory: str | Path) -> Path:
        """Write ``detector.safetensors`` (arrays) and ``detector.json`` (kind + params)."""
        arrays, params = self.to_arrays()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_arrays(out / ARRAYS_FILE, arrays)
        write_json(out / PARAMS_FILE, {"kind": self.info.name, "params": params})
        return out
