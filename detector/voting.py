"""Forest voting: the hard votes of fitted scikit-learn forests, by every tree or held out by
source image, and the own decision of a detector that scores by them (:class:`ForestDecision`).

The transport, NSS and Mahalanobis detectors score by these votes; the detector contract
(:mod:`detector.base`) knows nothing of forests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.ensemble import RandomForestClassifier
from sklearn.utils import check_array

from detector.base import DEFAULT_VOTE_THRESHOLD, check_groups
from detector.errors import InputError, NotFittedError
from detector.metrics import balanced_threshold


def _trees_input(forest: RandomForestClassifier, features: np.ndarray) -> np.ndarray:
    """The rows as the trees' contiguous float32, checked once for every tree."""
    x = np.ascontiguousarray(check_array(features), dtype=np.float32)
    if x.shape[1] != forest.n_features_in_:  # apply(check_input=False) would not check
        raise InputError(f"the forest takes {forest.n_features_in_} features, got {x.shape[1]}")
    return x


def _tree_votes(tree: Any, x: np.ndarray) -> np.ndarray:
    """One tree's hard vote per row of :func:`_trees_input` rows: its leaf's class index."""
    leaf_class = tree.tree_.value[:, 0, :].argmax(axis=1)
    return leaf_class[tree.apply(x, check_input=False)]


def oob_vote_fraction(
    forest: RandomForestClassifier, features: np.ndarray, groups: np.ndarray | None = None
) -> np.ndarray:
    """Out-of-bag hard votes on the rows ``forest`` was fitted on (in their order): per row, the
    fraction voting class 1 among the trees whose bootstrap sample did not draw it, float64 [N];
    NaN where every tree drew it (always, without bootstrap). As :func:`vote_fraction`, a vote is
    the class index of the tree's leaf's largest value.

    ``groups`` (one id per row): rows of a group are out of a tree's bag only when it drew none
    of them. An attacked image and its clean source are near twins with opposite labels: a tree
    that drew one votes the other's label wrong, so ungrouped votes on paired rows understate
    the forest (docs/decisions.md, "The forests' own decision")."""
    x = _trees_input(forest, features)
    rows = check_groups(groups, len(x))
    return held_out_votes(forest, x, rows, rows)[0]


def held_out_votes(
    forest: RandomForestClassifier,
    features: np.ndarray,
    groups: np.ndarray,
    fitted_groups: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Votes on any rows by the trees that never saw their group: per row, the fraction voting
    class 1 among the trees whose bootstrap sample drew no fitting row of the row's group
    (``groups``: one id per row; ``fitted_groups``: one per row ``forest`` was fitted on, in
    its order), float64 [N], NaN where no tree qualifies; and how many trees voted, int64 [N].
    A row whose group the forest was not fitted on is voted on by every tree; the fitting rows
    themselves (``groups`` = ``fitted_groups``) get their (grouped) out-of-bag votes."""
    x = _trees_input(forest, features)
    groups, fitted_groups = check_groups(groups, len(x)), np.asarray(fitted_groups)
    samples = forest.estimators_samples_ if forest.bootstrap else None
    if samples is not None and len(fitted_groups) <= max(int(s.max(initial=-1)) for s in samples):
        raise InputError("fitted_groups must name each of the forest's fitting rows")
    ids, index = np.unique(np.concatenate([fitted_groups, groups]), return_inverse=True)
    fitted, group = index[: len(fitted_groups)], index[len(fitted_groups) :]
    votes = np.zeros(len(x), dtype=np.int64)
    counts = np.zeros(len(x), dtype=np.int64)
    for i, tree in enumerate(forest.estimators_):
        in_bag = np.zeros(len(ids), dtype=bool)
        in_bag[fitted if samples is None else fitted[samples[i]]] = True
        out = ~in_bag[group]
        if out.any():
            votes[out] += _tree_votes(tree, x[out])
            counts += out
    fraction = np.full(len(x), np.nan)
    np.divide(votes, counts, out=fraction, where=counts > 0)
    return fraction, counts


DECISIONS = ("majority", "oob")  # a forest detector's own decision: see ForestDecision


class ForestDecision:
    """The own decision of a detector that scores by forest votes (``decision`` parameter):
    ``"majority"`` flags a score > 0.5, the forests' majority vote (seed 003's); ``"oob"``
    flags a score above ``threshold_``, the threshold of the best balanced accuracy of the same
    score on the fitting rows' out-of-bag votes (each row voted on only by the trees that drew
    neither it nor its twin, see :func:`oob_vote_fraction`: learnt on the training side, without
    a held-out cut), the one nearest 0.5 among equals; 0.5 when no row has out-of-bag votes of
    both labels."""

    decision: str

    def _check_decision(self) -> None:
        if self.decision not in DECISIONS:
            raise InputError(f"decision must be one of {DECISIONS}, got {self.decision!r}")

    def _learn_decision(
        self, oob_scores: Callable[[], np.ndarray], is_abnormal: np.ndarray
    ) -> None:
        """Set ``threshold_`` from the fitting rows' out-of-bag scores (NaN: no such vote),
        computed only for the ``"oob"`` decision."""
        self._check_decision()
        self.threshold_ = DEFAULT_VOTE_THRESHOLD
        if self.decision == "majority":
            return
        scores = oob_scores()
        voted = ~np.isnan(scores)
        labels = np.asarray(is_abnormal)[voted]
        if len(np.unique(labels)) == 2:  # out-of-bag votes on both clean and abnormal rows
            self.threshold_ = balanced_threshold(labels, scores[voted], prefer=self.threshold_)

    def decision_threshold(self) -> float:
        """Its own decision: flag a score > this (see :class:`ForestDecision`)."""
        if not hasattr(self, "threshold_"):
            raise NotFittedError(f"this {type(self).__name__} is not fitted yet: call fit first")
        return float(self.threshold_)


def vote_fraction(forest: RandomForestClassifier, features: np.ndarray) -> np.ndarray:
    """Fraction of a fitted binary forest's trees voting class 1 (hard votes), float64 [N]: each
    tree's ``predict`` (the class index of its leaf's largest value, ties to 0), with the input
    checked and converted to the trees' float32 once rather than once per tree (3-6x faster)."""
    x = _trees_input(forest, features)
    votes = np.zeros(len(x), dtype=np.int64)
    for tree in forest.estimators_:
        votes += _tree_votes(tree, x)
    return votes / len(forest.estimators_)
