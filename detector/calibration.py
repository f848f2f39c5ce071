"""Decision thresholds calibrated on clean validation scores at a target false-positive rate.

Scoring is separate from thresholding (alibi-detect's ``score`` vs ``infer_threshold``): an input
is flagged when its score is STRICTLY greater than the threshold.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
)
from scipy import stats

from detector.errors import ArtefactError, ConfigError, InputError, validation_problems


class CalibrationWarning(UserWarning):
    """A calibrated threshold that flags (almost) nothing: see :attr:`Calibration.saturated`."""


def calibrate_threshold(
    clean_scores: np.ndarray, target_fpr: float = 0.05, *, confidence: float | None = None
) -> float:
    """The smallest threshold t whose FPR on the clean scores is <= target_fpr.

    Without ``confidence``, the empirical FPR, mean(clean_scores > t). With it, the one-sided
    Clopper-Pearson upper bound at that confidence of the FPR that ``t`` has on the images the
    scores were drawn from: a threshold calibrated on n images then keeps FPR <= target_fpr on new
    ones with probability >= ``confidence`` (the point estimate exceeds it about half the time).
    ``t`` is always one of the clean scores (the FPR only changes there); when no score meets
    the target, their maximum.
    """
    scores = _check_scores(clean_scores)
    if not 0.0 <= target_fpr < 1.0:
        raise ConfigError(f"target_fpr must be in [0, 1), got {target_fpr}")
    if confidence is not None and not 0.0 < confidence < 1.0:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    values = np.unique(scores)  # sorted ascending
    # Clean scores strictly above each candidate.
    above = len(scores) - np.searchsorted(np.sort(scores), values, side="right")
    fpr = (
        above / len(scores)
        if confidence is None
        else fpr_upper_bound(above, len(scores), confidence)
    )
    meets = fpr <= target_fpr  # non-increasing in t: once met, met above
    return float(values[int(np.argmax(meets))] if meets.any() else values[-1])


def fpr_upper_bound(flagged: np.ndarray, n: int, confidence: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound of a rate from ``flagged`` of ``n`` (1 when all are)."""
    flagged = np.asarray(flagged, dtype=np.float64)
    safe = np.minimum(flagged, n - 1)
    bound = stats.beta.ppf(confidence, safe + 1, n - safe)
    return np.where(flagged >= n, 1.0, bound)


def rate_interval(flagged: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson (exact) interval of a rate: ``flagged`` of ``n`` images."""
    if n < 1 or not 0 <= flagged <= n:
        raise InputError(f"a rate needs 0 <= flagged <= n and n >= 1, got {flagged} of {n}")
    if not 0 < confidence < 1:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")
    interval = stats.binomtest(int(flagged), int(n)).proportion_ci(confidence, method="exact")
    return float(interval.low), float(interval.high)


def empirical_fpr(clean_scores: np.ndarray, threshold: float) -> float:
    """Share of clean scores flagged (score > threshold)."""
    scores = _check_scores(clean_scores)
    return float(np.mean(scores > threshold))


def _check_scores(scores: np.ndarray) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise InputError(f"clean scores must be a non-empty 1-D array, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise InputError("clean scores contain NaN or infinite values")
    return array


@dataclass(frozen=True)
class Calibration:
    """A calibrated decision: flag when score > ``threshold``.

    ``achieved_fpr`` is the FPR on the ``n`` clean validation scores it was chosen on;
    ``confidence``, when set, the probability with which the threshold's FPR is <= target_fpr
    (see :func:`calibrate_threshold`); ``default_vote_threshold`` is the detector's own
    decision (``Detector.decision_threshold``: 0.5 for the ensemble, the out-of-bag point of the
    forest detectors), kept beside it. ``saturated``: the target FPR is above 0 but the
    threshold is the clean scores' maximum (too many tie there, or too few images for the
    confidence), so only an input scoring above every clean image is flagged (a detector whose
    scores stop there flags nothing): :meth:`from_scores` warns with :class:`CalibrationWarning`.
    """

    # what from_dict accepts (pydantic: exact JSON types, finite numbers, no unknown field)
    __pydantic_config__ = ConfigDict(extra="forbid", allow_inf_nan=False)

    threshold: StrictFloat
    target_fpr: Annotated[StrictFloat, Field(ge=0, lt=1)]
    achieved_fpr: Annotated[StrictFloat, Field(ge=0, le=1)]
    n: Annotated[StrictInt, Field(ge=1)]
    default_vote_threshold: StrictFloat = 0.5
    confidence: Annotated[StrictFloat, Field(gt=0, lt=1)] | None = None
    saturated: StrictBool = False

    @classmethod
    def from_scores(
        cls,
        clean_scores: np.ndarray,
        target_fpr: float = 0.05,
        *,
        default_vote_threshold: float = 0.5,
        confidence: float | None = None,
    ) -> Calibration:
        """Calibrate on clean validation scores (see :func:`calibrate_threshold`)."""
        threshold = calibrate_threshold(clean_scores, target_fpr, confidence=confidence)
        scores = _check_scores(clean_scores)
        saturated = bool(target_fpr > 0 and threshold == scores.max())
        if saturated:
            at_top = int(np.sum(scores == threshold))
            warnings.warn(
                f"no clean score below the maximum {threshold:g} meets the target FPR "
                f"{target_fpr:g} ({at_top} of {scores.size} clean scores tie there), so the "
                "threshold is that maximum: only inputs scoring above every clean image are "
                "flagged, and a detector whose scores stop there flags nothing. Calibrate on "
                "more clean images, or give the detector finer scores.",
                CalibrationWarning,
                stacklevel=2,
            )
        return cls(
            threshold=threshold,
            target_fpr=float(target_fpr),
            achieved_fpr=empirical_fpr(clean_scores, threshold),
            n=int(scores.size),
            default_vote_threshold=float(default_vote_threshold),
            confidence=confidence,
            saturated=saturated,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Calibration:
        """The calibration :meth:`to_dict` wrote, checked against the field types and bounds
        above; a corrupt or edited one raises :class:`ArtefactError` naming what is wrong (it
        never builds a calibration that would flag at the wrong threshold)."""
        try:
            return TypeAdapter(cls).validate_python(data)
        except ValidationError as error:
            problems = validation_problems(error.errors(), "calibration")
            raise ArtefactError(f"calibration is corrupt: {problems}") from error
