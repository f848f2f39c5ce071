"""The transport detector: random forests on transport features, and their tensor form.

``TransportDetector`` trains a general forest plus one forest per predicted class (seed 003
§5.3.1); its score is the fraction of trees voting "abnormal" (hard votes), the larger of the
class forest's and the general forest's, so HIGHER = MORE ABNORMAL and the forests' default vote
flags an input when either forest's fraction exceeds 0.5.

Why the OR: the general forest alone detects seen attacks slightly better (the OR adds the
class forests' false positives), but alone it is evaded more often by an attacker who knows the
detector and, trained on one attack, carries over less to unseen ones. Seed 003 §H expects the OR
to resist adaptive attacks better; it does, so it is the default (a feature-matching attack
guided by the penultimate embedding still evades it on some images; docs/decisions.md, "Class
forest OR general forest").

``TensorForest`` holds fitted trees as flat node arrays and walks a whole batch through every
tree at once with gathers (one step per tree level), on CPU or GPU. Detectors travel as plain
arrays + JSON parameters (``to_arrays``/``from_arrays``), never as pickles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from sklearn.ensemble import RandomForestClassifier
from torch import nn

from detector.base import (
    DEFAULT_VOTE_THRESHOLD,
    Detector,
    DetectorInfo,
    SampleSet,
    abnormal_labels,
    check_binary_labels,
    check_class_labels,
    check_fitted,
    check_groups,
    source_groups,
)
from detector.errors import ArtefactError, InputError
from detector.features import check_features
from detector.registry import register_detector
from detector.voting import ForestDecision, held_out_votes, vote_fraction

_COMPACT_EVERY = 8


# --------------------------------------------------------------------------------------------
# Flat node arrays and their tensor traversal
# --------------------------------------------------------------------------------------------
def _float32_at_most(threshold: np.ndarray) -> np.ndarray:
    """The largest float32 <= each float64 threshold: x <= t64 iff x <= t32 for float32 x."""
    t32 = threshold.astype(np.float32)
    above = t32.astype(np.float64) > threshold
    t32[above] = np.nextafter(t32[above], np.float32(-np.inf))
    return t32


def forest_arrays(forests: list[RandomForestClassifier]) -> dict[str, np.ndarray]:
    """Every tree of ``forests`` as one flat node table.

    ``children`` [nodes, 2] (leaves point to themselves), ``feature``, ``threshold`` (float64, as
    fitted), ``vote`` (1 where the leaf's majority is class 1; ties vote 0 as sklearn's argmax),
    ``roots`` [len(forests), n_trees] and ``depth`` (deepest tree).
    """
    children, feature, threshold, vote, roots = [], [], [], [], []
    offset, depth = 0, 0
    for forest in forests:
        forest_roots = []
        for estimator in forest.estimators_:
            tree = estimator.tree_
            n = tree.node_count
            ids = np.arange(n)
            leaf = tree.children_left == -1
            left = np.where(leaf, ids, tree.children_left) + offset
            right = np.where(leaf, ids, tree.children_right) + offset
            children.append(np.stack([left, right], axis=1))
            feature.append(np.where(leaf, 0, tree.feature))
            threshold.append(np.where(leaf, np.inf, tree.threshold))
            values = tree.value[:, 0, :]
            vote.append((values[:, 1] > values[:, 0]) if values.shape[1] > 1 else np.zeros(n, bool))
            forest_roots.append(offset)
            depth = max(depth, int(tree.max_depth))
            offset += n
        roots.append(forest_roots)
    if len({len(r) for r in roots}) > 1:
        raise InputError("every forest needs the same number of trees")
    return {
        "children": np.concatenate(children).astype(np.int32),
        "feature": np.concatenate(feature).astype(np.int32),
        "threshold": np.concatenate(threshold).astype(np.float64),
        "vote": np.concatenate(vote).astype(np.uint8),
        "roots": np.asarray(roots, dtype=np.int32),
        "depth": np.asarray([depth], dtype=np.int32),
    }


def _check_arrays(arrays: dict[str, np.ndarray]) -> None:
    needed = ("children", "feature", "threshold", "vote", "roots", "depth")
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise ArtefactError(f"forest arrays lack {', '.join(missing)}")
    n = len(arrays["feature"])
    if np.asarray(arrays["depth"]).size != 1:
        raise ArtefactError("forest array 'depth' must hold one number")
    if (
        arrays["children"].shape != (n, 2)
        or arrays["threshold"].shape != (n,)
        or arrays["vote"].shape != (n,)
    ):
        raise ArtefactError("forest arrays have inconsistent node counts")
    for key in ("children", "roots"):
        if arrays[key].size and (arrays[key].min() < 0 or arrays[key].max() >= n):
            raise ArtefactError(f"forest array {key!r} points outside the node table")


class TensorForest(nn.Module):
    """Forests of fitted decision trees as tensors, evaluated for a whole batch with gathers.

    ``forward(features [N, F], roots [N, T]) -> votes [N, T]``: each sample starts at its own
    tree roots (so each sample can use different forests) and moves one level per step.
    ``fraction(features, forest=0)`` is the share of one forest's trees voting 1.
    """

    child: torch.Tensor
    feature: torch.Tensor
    threshold: torch.Tensor
    vote: torch.Tensor
    leaf: torch.Tensor
    roots: torch.Tensor

    def __init__(self, arrays: dict[str, np.ndarray], n_features: int) -> None:
        super().__init__()
        _check_arrays(arrays)
        if arrays["feature"].size and arrays["feature"].max() >= n_features:
            raise ArtefactError(
                f"forest splits on feature {arrays['feature'].max()} but takes {n_features}"
            )
        self.n_features = int(n_features)
        self.depth = int(np.asarray(arrays["depth"]).reshape(-1)[0])
        children = arrays["children"].astype(np.int64)
        # int32 indices: half the memory traffic of int64 in the gathers (index_select takes both).
        self.register_buffer("child", torch.from_numpy(children.reshape(-1).astype(np.int32)))
        self.register_buffer("feature", torch.from_numpy(arrays["feature"].astype(np.int32)))
        self.register_buffer("threshold", torch.from_numpy(_float32_at_most(arrays["threshold"])))
        self.register_buffer("vote", torch.from_numpy(arrays["vote"].astype(np.float32)))
        self.register_buffer("leaf", torch.from_numpy(children[:, 0] == np.arange(len(children))))
        self.register_buffer("roots", torch.from_numpy(arrays["roots"].astype(np.int64)))

    def forward(self, features: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        if features.ndim != 2 or features.shape[1] != self.n_features:
            raise InputError(
                f"fitted on {self.n_features} features, got {tuple(features.shape)}: "
                "this detector belongs to another network"
            )
        n, t = roots.shape
        x = features.to(self.threshold.dtype).contiguous().reshape(-1)
        # Tree-major order: neighbouring entries walk the same tree, so its nodes stay in cache.
        node = roots.T.reshape(-1).to(torch.int32)
        offset = (torch.arange(n, dtype=torch.int32, device=x.device) * self.n_features).repeat(t)
        position = torch.arange(n * t, device=x.device)
        final = torch.empty_like(node)
        for step in range(self.depth):
            value = x.index_select(0, offset + self.feature.index_select(0, node))
            go_right = (value > self.threshold.index_select(0, node)).to(torch.int32)
            node = self.child.index_select(0, node * 2 + go_right)
            if step % _COMPACT_EVERY == _COMPACT_EVERY - 1:  # drop the paths that reached a leaf
                done = self.leaf.index_select(0, node)
                final[position[done]] = node[done]
                active = ~done
                node, offset, position = node[active], offset[active], position[active]
                if node.numel() == 0:
                    break
        final[position] = node
        return self.vote.index_select(0, final).view(t, n).T

    def fraction(self, features: torch.Tensor, forest: int = 0) -> torch.Tensor:
        roots = self.roots[forest].expand(features.shape[0], -1)
        return self.forward(features, roots).mean(dim=1)


class TransportScorer(nn.Module):
    """Torch form of a fitted :class:`TransportDetector`: ``forward(features, predicted) -> scores``.

    Score = max(fraction of the predicted class's forest voting abnormal, same for the general
    forest); classes without their own forest use the general forest. Higher = more abnormal.
    """

    table: torch.Tensor

    def __init__(
        self, arrays: dict[str, np.ndarray], n_features: int, class_ids: np.ndarray
    ) -> None:
        super().__init__()
        self.forest = TensorForest(arrays, n_features)
        class_ids = np.asarray(class_ids, dtype=np.int64)
        size = int(class_ids.max()) + 1 if class_ids.size else 0
        if class_ids.size and class_ids.min() < 0:
            raise ArtefactError("class ids must be >= 0")
        # table[c] = forest index of class c (1 + position in class_ids), 0 (general) otherwise;
        # one extra row for labels outside the table.
        table = np.zeros(size + 1, dtype=np.int64)
        table[class_ids] = np.arange(1, len(class_ids) + 1)
        self.register_buffer("table", torch.from_numpy(table))

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        roots = self.forest.roots
        n = features.shape[0]
        general = roots[0].expand(n, -1)
        if predicted is None or roots.shape[0] == 1:
            return self.forest(features, general).mean(dim=1)
        predicted = predicted.to(self.table.device).long()
        outside = len(self.table) - 1
        predicted = torch.where((predicted >= 0) & (predicted < outside), predicted, outside)
        own = roots[self.table[predicted]]
        votes = self.forest(features, torch.cat([general, own], dim=1))
        t = roots.shape[1]
        return torch.maximum(votes[:, :t].mean(dim=1), votes[:, t:].mean(dim=1))


# --------------------------------------------------------------------------------------------
# The detector
# --------------------------------------------------------------------------------------------
@register_detector
class TransportDetector(ForestDecision, Detector):
    """Random forests on transport features (seed 003 §5.3.1).

    ``fit(features, is_abnormal, predicted_labels)`` trains a general forest and, when
    ``class_conditional``, one forest per predicted class that has at least
    ``min_class_samples`` clean AND abnormal samples (other classes use the general forest).
    ``score(features, predicted_labels)`` = max over (class forest, general forest) of the
    fraction of trees voting abnormal: HIGHER = MORE ABNORMAL, in [0, 1].

    ``decision``, its own decision (``predict``, :meth:`decision_threshold`): ``"oob"``
    (default), the score's best balanced accuracy on the out-of-bag votes, or ``"majority"``,
    0.5 (see :class:`~detector.voting.ForestDecision`). The OR of two forests adds their false
    positives at 0.5; the out-of-bag point weighs them against the misses (docs/decisions.md,
    "The forests' own decision").
    """

    info = DetectorInfo(
        "transport",
        "TR",
        reads="features",
        servable=True,
        summary="random forests on the trajectory features, the predicted class's OR a general "
        "one (seed 003 §5.3.1), trained on attacks",
    )

    def __init__(
        self,
        n_estimators: int = 100,
        max_depth: int | None = None,
        class_conditional: bool = True,
        min_class_samples: int = 20,
        decision: str = "oob",
        random_state: int | None = 0,
        n_jobs: int | None = None,
    ) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.class_conditional = class_conditional
        self.min_class_samples = min_class_samples
        self.decision = decision
        self.random_state = random_state
        self.n_jobs = n_jobs

    def _forest(self, seed_offset: int) -> RandomForestClassifier:
        seed = None if self.random_state is None else self.random_state + seed_offset
        return RandomForestClassifier(
            n_estimators=self.n_estimators,
            max_depth=self.max_depth,
            random_state=seed,
            n_jobs=self.n_jobs,
        )

    def fit(
        self,
        features: np.ndarray,
        is_abnormal: np.ndarray,
        predicted_labels: np.ndarray,
        groups: np.ndarray | None = None,
    ) -> TransportDetector:
        """Fit on features [N, F], 0/1 abnormal labels [N] and the network's predicted classes
        [N]; ``groups``: each row's source image, for the out-of-bag decision's votes."""
        x = check_features(features)
        y = check_binary_labels(is_abnormal, len(x))
        predicted = check_class_labels(predicted_labels, len(x))
        row_groups = check_groups(groups, len(x))
        if self.n_estimators < 1:
            raise InputError(f"n_estimators must be >= 1, got {self.n_estimators}")
        self._check_decision()
        general = self._forest(0).fit(x, y)
        class_forests: dict[int, RandomForestClassifier] = {}
        if self.class_conditional:
            for c in np.unique(predicted):
                mask = predicted == c
                n_abnormal = int(y[mask].sum())
                if min(n_abnormal, int(mask.sum()) - n_abnormal) >= self.min_class_samples:
                    class_forests[int(c)] = self._forest(1 + int(c)).fit(x[mask], y[mask])
        self.n_features_in_ = x.shape[1]
        self.forest_: RandomForestClassifier | None = general
        self.class_forests_ = class_forests
        self.class_ids_ = np.asarray(sorted(class_forests), dtype=np.int64)
        self.arrays_ = forest_arrays([general] + [class_forests[int(c)] for c in self.class_ids_])
        # each fitting row's group and class, for held_out_scores (not saved with the arrays)
        self.fitted_groups_ = row_groups
        self.grouped_ = groups is not None  # by source image: score_held_out can read indices
        self.fitted_predicted_ = predicted
        self._learn_decision(lambda: self._oob_scores(x, predicted, groups), y)
        return self

    def _oob_scores(
        self, x: np.ndarray, predicted: np.ndarray, groups: np.ndarray | None
    ) -> np.ndarray:
        """The score (the OR) of the fitting rows from (grouped) out-of-bag votes; NaN only
        where both forests' trees all drew a row or its group."""
        return self.held_out_scores(x, predicted, check_groups(groups, len(x)))[0]

    def held_out_scores(
        self, features: np.ndarray, predicted_labels: np.ndarray, groups: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`score` of any rows by the trees that never saw their group (``groups``: each
        row's source image, as ``fit`` was given them; row positions when it was given none):
        the fitting rows' grouped out-of-bag scores, every tree's votes for a row whose group
        the forests were not fitted on (:func:`~detector.voting.held_out_votes`); NaN where both
        forests lack such trees. Also, per row, the fewer trees that voted of the two forests
        (0 where one has none). Needs the detector as fitted, not loaded from arrays."""
        check_fitted(self)
        if self.forest_ is None or not hasattr(self, "fitted_groups_"):
            raise InputError("held-out scores need the detector as fitted, not loaded from arrays")
        x = check_features(features, self.n_features_in_)
        predicted, groups = (
            check_class_labels(predicted_labels, len(x)),
            check_groups(groups, len(x)),
        )
        general, counts = held_out_votes(self.forest_, x, groups, self.fitted_groups_)
        own, own_counts = general.copy(), counts.copy()
        for c, forest in self.class_forests_.items():
            mask, fitted = predicted == c, self.fitted_predicted_ == c
            if mask.any():
                own[mask], own_counts[mask] = held_out_votes(
                    forest, x[mask], groups[mask], self.fitted_groups_[fitted]
                )
        return np.fmax(general, own), np.minimum(counts, own_counts)

    def fit_samples(self, clean: SampleSet, abnormal: SampleSet) -> TransportDetector:
        """Fit on the transport features and predicted labels of clean vs abnormal samples."""
        return self.fit(
            np.concatenate([clean.features, abnormal.features]),
            abnormal_labels(clean, abnormal),
            np.concatenate([clean.predicted, abnormal.predicted]),
            source_groups(clean, abnormal),
        )

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        """:meth:`score` of the samples' features and predicted labels: HIGHER = MORE ABNORMAL."""
        return self.score(samples.features, samples.predicted)

    def score(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        """Abnormality scores in [0, 1], HIGHER = MORE ABNORMAL (fraction of trees voting abnormal)."""
        check_fitted(self)
        x = check_features(features, self.n_features_in_)
        predicted = check_class_labels(predicted_labels, len(x))
        if self.forest_ is None:  # loaded from arrays: the tensor form is the only form
            with torch.inference_mode():
                scores = self.to_torch()(torch.from_numpy(x), torch.from_numpy(predicted))
            return scores.numpy().astype(np.float64)
        return np.maximum(*self.votes(x, predicted))

    def votes(
        self, features: np.ndarray, predicted_labels: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(general forest's, predicted class's forest's) fractions of trees voting abnormal,
        the general forest's for classes without a forest of their own; :meth:`score` is their
        max. Needs the fitted scikit-learn forests (a detector loaded from arrays only scores)."""
        check_fitted(self)
        if self.forest_ is None:
            raise InputError("a transport detector loaded from arrays has no separate votes")
        x = check_features(features, self.n_features_in_)
        predicted = check_class_labels(predicted_labels, len(x))
        general = vote_fraction(self.forest_, x)
        own = general.copy()
        for c, forest in self.class_forests_.items():
            mask = predicted == c
            if mask.any():
                own[mask] = vote_fraction(forest, x[mask])
        return general, own

    def predict(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        """True where the score is above its own decision (:meth:`decision_threshold`)."""
        return self.score(features, predicted_labels) > self.decision_threshold()

    def to_torch(self) -> TransportScorer:
        """The fitted forests as a torch module: ``forward(features [N,F], predicted [N]) -> scores [N]``."""
        check_fitted(self)
        return TransportScorer(self.arrays_, self.n_features_in_, self.class_ids_)

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Numpy arrays + JSON-able parameters that :meth:`from_arrays` turns back into a detector."""
        check_fitted(self)
        arrays = dict(self.arrays_)
        arrays["class_ids"] = self.class_ids_
        params = {
            **self.get_params(),
            "n_features_in": int(self.n_features_in_),
            "threshold": float(self.threshold_),
        }
        return arrays, params

    @classmethod
    def from_arrays(
        cls, arrays: dict[str, np.ndarray], params: dict[str, Any]
    ) -> TransportDetector:
        """A detector that scores (``score``, ``to_torch``) like the one saved; it cannot be refitted
        into the same sklearn forests, but ``fit`` works as on a new detector."""
        params = dict(params)
        try:
            n_features = int(params.pop("n_features_in"))
            # saved before the learnt decision: the majority vote
            threshold = float(params.pop("threshold", DEFAULT_VOTE_THRESHOLD))
            detector = cls(**params)
            trees = {k: np.asarray(v) for k, v in arrays.items() if k != "class_ids"}
            class_ids = np.asarray(arrays["class_ids"], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(
                f"transport detector arrays/params are incomplete: {error}"
            ) from error
        if not 0.0 <= threshold <= 1.0:
            raise ArtefactError(f"transport detector threshold must be in [0, 1], got {threshold}")
        _check_arrays(trees)
        if len(trees["roots"]) != len(class_ids) + 1:
            raise ArtefactError(
                "transport detector arrays: one forest per class id plus a general forest expected"
            )
        detector.n_features_in_ = n_features
        detector.forest_ = None
        detector.class_forests_ = {}
        detector.class_ids_ = class_ids
        detector.arrays_ = trees
        detector.threshold_ = threshold
        TensorForest(trees, n_features)  # validates feature indices
        return detector
