"""Detection metrics in numpy: ROC curve, AUROC, FPR at 95% TPR, accuracy, TPR/FPR, and the
threshold of the best balanced accuracy.

Conventions: ``is_abnormal`` is 1 for adversarial/OOD inputs; scores are HIGHER = MORE
ABNORMAL; an input is flagged when score > threshold. The ROC curve follows scikit-learn's
``roc_curve`` exactly (same points, same ``drop_intermediate`` rule), and is tested against it.
"""

from __future__ import annotations

import numpy as np

from detector.errors import InputError


def _check(is_abnormal: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(is_abnormal)
    s = np.asarray(scores, dtype=np.float64)
    if y.ndim != 1 or s.shape != y.shape:
        raise InputError(
            f"is_abnormal and scores must be 1-D of one length, got {y.shape} and {s.shape}"
        )
    if y.dtype != bool and not np.isin(y, (0, 1)).all():
        raise InputError("is_abnormal must hold 0 (clean) and 1 (abnormal) only")
    if not np.isfinite(s).all():
        raise InputError("scores contain NaN or infinite values")
    return y.astype(bool), s


def _binary_curve(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """False and true positive counts at each distinct score, from the highest score down."""
    order = np.argsort(s, kind="mergesort")[::-1]
    s, y = s[order], y[order]
    distinct = np.where(np.diff(s))[0]
    ends = np.r_[distinct, y.size - 1]
    tps = np.cumsum(y)[ends].astype(np.float64)
    fps = 1.0 + ends - tps
    return fps, tps, s[ends]


def roc_curve(
    is_abnormal: np.ndarray, scores: np.ndarray, *, drop_intermediate: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fpr, tpr, thresholds) as scikit-learn's ``roc_curve``; thresholds[0] = inf.

    Point i is "flag when score >= thresholds[i]".
    """
    y, s = _check(is_abnormal, scores)
    if y.all() or not y.any():
        raise InputError("a ROC curve needs both clean and abnormal samples")
    fps, tps, thresholds = _binary_curve(y, s)
    if drop_intermediate and len(fps) > 2:
        keep = np.where(np.r_[True, np.logical_or(np.diff(fps, 2), np.diff(tps, 2)), True])[0]
        fps, tps, thresholds = fps[keep], tps[keep], thresholds[keep]
    fps, tps = np.r_[0.0, fps], np.r_[0.0, tps]
    thresholds = np.r_[np.inf, thresholds]
    return fps / fps[-1], tps / tps[-1], thresholds


def auroc(is_abnormal: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (ties count one half), as scikit-learn's ``roc_auc_score``."""
    fpr, tpr, _ = roc_curve(is_abnormal, scores, drop_intermediate=False)
    return float(np.trapezoid(tpr, fpr))


def fpr_at_tpr(is_abnormal: np.ndarray, scores: np.ndarray, tpr_level: float = 0.95) -> float:
    """The lowest FPR among ROC points (thresholds at observed scores) whose TPR >= ``tpr_level``."""
    fpr, tpr, _ = roc_curve(is_abnormal, scores, drop_intermediate=False)
    return float(fpr[np.searchsorted(tpr, tpr_level, side="left")])


def balanced_threshold(
    is_abnormal: np.ndarray, scores: np.ndarray, *, prefer: float = 0.5
) -> float:
    """The threshold t (flag = score > t) of the highest balanced accuracy (TPR + TNR) / 2 on
    these scores; among equally good flag sets, the one whose range of thresholds holds or lies
    nearest ``prefer``, at ``prefer`` when its range holds it, else midway between the two
    scores that bound it. ``prefer`` when no threshold beats flagging everything or nothing."""
    y, s = _check(is_abnormal, scores)
    if y.all() or not y.any():
        raise InputError("a balanced threshold needs both clean and abnormal samples")
    fps, tps, values = _binary_curve(y, s)  # flag score >= values[i], values descending
    gain = tps[:-1] / y.sum() - fps[:-1] / (~y).sum()  # flagging all (the last point) gains 0
    if gain.size == 0 or gain.max() <= 0:
        return float(prefer)
    best = np.flatnonzero(gain >= gain.max() - 1e-12)
    low, high = values[best + 1], values[best]  # score > t for t in [low, high) flags the same
    distance = np.maximum(low - prefer, 0) + np.maximum(prefer - high, 0)
    i = int(np.argmin(distance))
    if low[i] <= prefer < high[i]:
        return float(prefer)
    return float((low[i] + high[i]) / 2)


def detection_metrics(
    is_abnormal: np.ndarray,
    scores: np.ndarray,
    threshold: float,
    *,
    attack_success: np.ndarray | None = None,
) -> dict[str, float]:
    """Headline metrics of a detector at ``threshold`` (flag = score > threshold).

    - ``accuracy``: detection accuracy on a balanced set, (TPR + TNR) / 2 — plain accuracy when
      clean and abnormal counts are equal, and not skewed by the mix when they are not;
    - ``tpr`` (abnormal flagged), ``fpr`` (clean flagged), ``auroc``, ``fpr_at_95_tpr``;
    - ``successful_attack_detection_rate`` (only with ``attack_success``, a boolean mask over all
      samples that is consulted on abnormal ones): the share of successful attacks flagged;
      NaN when no attack succeeded;
    - ``n_clean``, ``n_abnormal``.
    """
    y, s = _check(is_abnormal, scores)
    if y.all() or not y.any():
        raise InputError("detection metrics need both clean and abnormal samples")
    flagged = s > threshold
    tpr = float(flagged[y].mean())
    fpr = float(flagged[~y].mean())
    metrics = {
        "accuracy": 0.5 * (tpr + 1.0 - fpr),
        "tpr": tpr,
        "fpr": fpr,
        "auroc": auroc(y, s),
        "fpr_at_95_tpr": fpr_at_tpr(y, s, 0.95),
        "n_clean": float((~y).sum()),
        "n_abnormal": float(y.sum()),
    }
    if attack_success is not None:
        success = np.asarray(attack_success, dtype=bool)
        if success.shape != y.shape:
            raise InputError(f"attack_success must have shape {y.shape}, got {success.shape}")
        successful = y & success
        metrics["successful_attack_detection_rate"] = (
            float(flagged[successful].mean()) if successful.any() else float("nan")
        )
    return metrics
