"""The shipped detector: the supervised transport forests OR the far tails of clean-only parts.

``EnsembleDetector`` flags what the forests flag OR what lies in the far tail of clean:
score = max(forest vote fraction, clip(1 - (1 - u) / tail, 0, 1), ...), so at the default
threshold 0.5 the novelty part spends ``tail / 2`` of the false-positive budget; the bundle's
threshold is calibrated on the combined score. Its clean-only parts, the novelty detector
(:mod:`detector.novelty`; ``novelty_distance``, the nearest clean sample by default), the margin
part and the penultimate part below, each ramp over a 2.5% tail (``tail``, ``margin_tail``,
``penultimate_tail``), so at the decision 0.5 each flags about 1.25% of clean inputs (less
together: they overlap) and the forests about 1-1.5%. The first two were sized to share the
bundle's 5% target: measured on the training side only, the novelty part sharing it with the
margin part flagged more unseen attacks (minimal-perturbation ones most) than the novelty part
spending it alone (docs/decisions.md, "Ensemble parts and tails"). The parts:

- family forests: fitted on several attack families, each family also gets forests of its own
  (a family that is a small share of the pooled forests' abnormal rows is still flagged as a
  detector trained on it alone would flag it), fitted against up to ``family_clean_ratio`` (4)
  clean rows per row of the family: with as many clean rows as attacked ones, a minimal-
  perturbation family's forests learn clean from a few hundred images and spend most of the
  ensemble's false-positive budget; four clean rows per row lower the calibrated threshold and
  flag more attacks (docs/decisions.md, "Ensemble parts and tails");
- the margin part (:mod:`detector.margin`): the clean CDF of the logit margin per predicted
  class, ramped over its last ``margin_tail``: images on the decision boundary, where
  minimal-perturbation attacks stop, whatever the attack;
- the penultimate part (:mod:`detector.penultimate`): the distance to the nearest clean image in
  the network's penultimate embedding, ramped over its last ``penultimate_tail`` (2.5%): what the
  classifier itself has never seen. Its embedding travels as the features' last columns
  (``FeatureSpec(penultimate=D)``; on the training side, ``samples.extra`` via
  :meth:`EnsembleDetector.precompute`). Chosen on the training side only: it flags more of the
  out-of-distribution stand-ins (rotated images most) at the same calibrated FPR target and
  every attack about as often (docs/decisions.md, "Penultimate part").

All parts travel as arrays + JSON, never pickles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
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
from detector.features import FeatureSpec, check_features
from detector.forest import TransportDetector
from detector.margin import MARGIN_FEATURE, MarginScorer, check_margin_arrays, margin_arrays
from detector.nearest import clean_cdf
from detector.novelty import NoveltyDetector, NoveltyScorer
from detector.penultimate import (
    PENULTIMATE_KEY,
    EmbeddingScorer,
    check_embedding_arrays,
    embedding_arrays,
    penultimate_embedding,
)
from detector.registry import register_detector


def _checked_reference(
    reference: tuple[np.ndarray, np.ndarray, np.ndarray | None], n_columns: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The clean rows for the clean-only parts as arrays (features, class labels, groups: row
    positions when None); refused when empty, of another width than the fit's rows
    (``n_columns``), or with labels or groups of another length."""
    features, predicted, groups = reference
    x = np.asarray(features)
    if x.ndim != 2 or x.shape[1] != n_columns or not len(x):
        raise InputError(
            f"the clean-only parts need clean rows of {n_columns} columns, got {x.shape}"
        )
    return x, check_class_labels(predicted, len(x)), check_groups(groups, len(x))


def tail_ramp(u: torch.Tensor, tail: float) -> torch.Tensor:
    """0 below the clean CDF's last ``tail``, rising to exactly 1 at u = 1 (float32)."""
    return torch.clamp(1.0 - (1.0 - u.float()) / tail, 0.0, 1.0)


class EnsembleScorer(nn.Module):
    """max(forest vote fraction, each family forest's, novelty tail ramp, margin tail ramp,
    penultimate tail ramp): torch form of :class:`EnsembleDetector`. With the penultimate part,
    the features' last ``embedding.points.shape[1]`` columns are the embedding, read by it only.
    :meth:`parts` gives each part's score by name ('forests', 'family <name>', 'novelty',
    'margin', 'penultimate'): which part flags an input."""

    def __init__(
        self,
        forests: nn.Module,
        novelty: NoveltyScorer,
        tail: float,
        families: Sequence[nn.Module] = (),
        margin: MarginScorer | None = None,
        margin_tail: float = 0.0,
        embedding: EmbeddingScorer | None = None,
        embedding_tail: float = 0.0,
        family_names: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.forests = forests
        self.families = nn.ModuleList(families)
        self.family_names = list(family_names) or [str(i) for i in range(len(families))]
        if len(self.family_names) != len(families):
            raise InputError(f"{len(families)} family forests, {len(family_names)} names")
        self.novelty = novelty
        self.tail = float(tail)
        self.margin = margin
        self.margin_tail = float(margin_tail)
        self.embedding = embedding
        self.embedding_tail = float(embedding_tail)

    def forward(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> torch.Tensor:
        scores = iter(self.parts(features, predicted).values())
        score = next(scores)
        for part in scores:
            score = torch.maximum(score, part)
        return score

    def parts(
        self, features: torch.Tensor, predicted: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Each part's score in [0, 1] (float32 [N]) by name; the ensemble's is their max."""
        embedding_score = None
        if self.embedding is not None:
            width = self.embedding.points.shape[1]
            if features.ndim != 2 or features.shape[1] <= width:
                raise InputError(
                    f"expected the trajectory features and a {width}-wide penultimate "
                    f"embedding, got {tuple(features.shape)}"
                )
            u = self.embedding(features[:, -width:])
            embedding_score = tail_ramp(u, self.embedding_tail)
            features = features[:, :-width]
        parts = {"forests": self.forests(features, predicted).float()}
        for name, family in zip(self.family_names, self.families, strict=True):
            parts[f"family {name}"] = family(features, predicted).float()
        parts["novelty"] = tail_ramp(self.novelty(features, predicted), self.tail)
        if self.margin is not None:
            parts["margin"] = tail_ramp(self.margin(features, predicted), self.margin_tail)
        if embedding_score is not None:
            parts["penultimate"] = embedding_score
        return parts


MARGIN_TAIL = 0.025  # the margin part's clean tail (0: none); see the module docstring
PENULTIMATE_TAIL = 0.025  # the penultimate part's clean tail (0: none); see the docstring
FAMILY_CLEAN_RATIO = 4.0  # clean rows per family row in a family's forests; see the docstring
# The ensemble's parameters that its forests do not take.
_ENSEMBLE_ONLY = (
    "tail",
    "family_forests",
    "margin_tail",
    "family_clean_ratio",
    "novelty_distance",
    "penultimate_tail",
)


@register_detector
class EnsembleDetector(Detector):
    """The transport forests (what attacks look like) OR the novelty detector's far tail (what
    clean does not look like): see the module docstring. ``tail`` is the clean tail the novelty
    part ramps over (a share of the false-positive budget, fixed a priori, never tuned on tests).

    With ``family_forests`` and abnormal rows from two or more families (``fit``'s ``families``,
    or ``abnormal.families`` in :meth:`fit_samples`), each family also gets its own forests,
    fitted on that family's rows vs up to ``family_clean_ratio`` clean rows per family row: a
    family that is a small share of the pooled forests' abnormal side (minimal-perturbation
    attacks beside large L-inf ones) is still flagged as well as a detector trained on it alone
    would flag it."""

    info = DetectorInfo(
        "ensemble",
        "TR+NV",
        reads="features",
        servable=True,
        summary="the transport forests (with class forests and one set per attack family) OR the "
        "far tails of three clean-only parts: the nearest clean image on the features and in "
        "the network's penultimate embedding, and the logit margin",
    )

    def __init__(
        self,
        n_estimators: int = 100,
        max_depth: int | None = None,
        class_conditional: bool = True,
        min_class_samples: int = 20,
        tail: float = 0.025,
        family_forests: bool = True,
        margin_tail: float = MARGIN_TAIL,
        family_clean_ratio: float = FAMILY_CLEAN_RATIO,
        novelty_distance: str = "nearest",
        penultimate_tail: float = PENULTIMATE_TAIL,
        random_state: int | None = 0,
        n_jobs: int | None = None,
    ) -> None:
        self.n_estimators = n_estimators
        self.max_depth = max_depth
        self.class_conditional = class_conditional
        self.min_class_samples = min_class_samples
        self.tail = tail
        self.family_forests = family_forests
        self.margin_tail = margin_tail
        self.family_clean_ratio = family_clean_ratio
        self.novelty_distance = novelty_distance
        self.penultimate_tail = penultimate_tail
        self.random_state = random_state
        self.n_jobs = n_jobs

    def _unfitted_parts(self) -> tuple[TransportDetector, NoveltyDetector]:
        shared = {k: v for k, v in self.get_params().items() if k not in _ENSEMBLE_ONLY}
        return TransportDetector(**shared), NoveltyDetector(
            min_class_samples=self.min_class_samples, distance=self.novelty_distance
        )

    def forest_params(self) -> dict[str, Any]:
        """The parameters of its pooled forests (a :class:`TransportDetector` with these
        parameters, fitted on the same rows, fits the same forests)."""
        return self._unfitted_parts()[0].get_params()

    def fit(
        self,
        features: np.ndarray,
        is_abnormal: np.ndarray,
        predicted_labels: np.ndarray,
        families: np.ndarray | None = None,
        *,
        forests: TransportDetector | None = None,
        margin_column: int | None = None,
        penultimate_columns: int = 0,
        groups: np.ndarray | None = None,
        reference: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
        clean_parts: EnsembleDetector | None = None,
    ) -> EnsembleDetector:
        """Forests on every row (0 clean / 1 abnormal), one set per family of the abnormal rows
        (``families``: a name per row, read on abnormal rows only); the clean-only parts on the
        clean rows only, or on ``reference`` when given: (features as ``features``' columns,
        predicted labels, source groups or None) of the clean images they learn from instead (a
        paired protocol's every clean training image, where the forests learn from an attack's
        sources). ``forests``: the pooled forests already fitted on the same rows with the same
        parameters (a protocol that also runs the transport detector), reused as they are.
        ``margin_column``: the features' logit-margin column, whose clean CDF the margin part
        ramps over its last ``margin_tail`` (none without it, or when ``margin_tail`` is 0).
        ``penultimate_columns``: how many of the last columns are the penultimate embedding
        (:mod:`detector.penultimate`), read by that part only, on the clean rows (or the
        reference's), over its last ``penultimate_tail`` (0 columns or tail: no such part; the
        columns are then refused). ``groups``: each row's source image, for the pooled forests'
        out-of-bag decision; the reference's groups are in the same id space, and given exactly
        when ``groups`` is. ``clean_parts``: an ensemble with the same parameters already fitted
        on the same clean rows (the same ``reference``; checked by their groups), whose
        clean-only parts are reused as they are (a protocol fitting several attacks against one
        training side fits them once)."""
        if not 0 < self.tail < 1:
            raise InputError(f"tail must be in (0, 1), got {self.tail}")
        if not 0 <= self.margin_tail < 1:
            raise InputError(f"margin_tail must be in [0, 1), got {self.margin_tail}")
        if not 0 <= self.penultimate_tail < 1:
            raise InputError(f"penultimate_tail must be in [0, 1), got {self.penultimate_tail}")
        x = np.asarray(features)
        width = int(penultimate_columns)
        if width and not self.penultimate_tail:
            raise InputError("penultimate columns given, but penultimate_tail is 0")
        if width < 0 or (width and (x.ndim != 2 or x.shape[1] <= width)):
            raise InputError(f"penultimate_columns {width} do not fit features {x.shape}")
        clean = check_binary_labels(is_abnormal, len(x)) == 0
        row_groups = check_groups(groups, len(x))
        if reference is None:
            predicted = check_class_labels(predicted_labels, len(x))
            reference = (x[clean], predicted[clean], row_groups[clean])
        elif (groups is None) != (reference[2] is None):
            raise InputError(
                "the clean reference's groups and the rows' must both be given or both be None "
                "(one id space: each row's source image)"
            )
        checked = _checked_reference(reference, x.shape[1])  # before any fit
        features = x[:, :-width] if width else x
        if not self.family_clean_ratio > 0:
            raise InputError(f"family_clean_ratio must be > 0, got {self.family_clean_ratio}")
        pooled = self._unfitted_parts()[0]
        if forests is not None and forests.get_params() != pooled.get_params():
            raise InputError("the forests to reuse were fitted with other parameters")
        if forests is None:
            forests = pooled.fit(features, is_abnormal, predicted_labels, groups)
        self.forests_ = forests
        self.grouped_ = groups is not None and getattr(forests, "grouped_", False)
        predicted = np.asarray(predicted_labels)
        self.family_names_, self.families_ = self._fit_families(
            np.asarray(features), clean, predicted, families, row_groups
        )
        self.n_features_in_ = self.forests_.n_features_in_ + width
        if margin_column is not None and not 0 <= margin_column < self.forests_.n_features_in_:
            raise InputError(f"margin_column {margin_column} is not a feature column")
        if margin_column is None or not self.margin_tail > 0:
            margin_column = None
        if clean_parts is None:
            self._fit_clean_parts(*checked, width=width, margin_column=margin_column)
        else:
            self._reuse_clean_parts(clean_parts, checked[2], width, margin_column)
        return self

    def _fit_clean_parts(
        self,
        x: np.ndarray,
        predicted: np.ndarray,
        groups: np.ndarray,
        *,
        width: int,
        margin_column: int | None,
    ) -> None:
        """The clean-only parts (novelty, margin, penultimate) on clean rows, as
        :func:`_checked_reference` gives them: ``x`` with the penultimate embedding in its last
        ``width`` columns."""
        self.clean_groups_ = groups  # for held_out_scores (not saved with the arrays)
        self.penultimate_width_ = width
        self.penultimate_ = embedding_arrays(x[:, -width:]) if width else {}
        x = x[:, :-width] if width else x
        self.novelty_ = self._unfitted_parts()[1].fit(x, predicted)
        self.margin_column_, self.margin_ = None, {}
        if margin_column is not None:
            self.margin_column_ = int(margin_column)
            self.margin_ = margin_arrays(x[:, margin_column], predicted, self.min_class_samples)

    def _reuse_clean_parts(
        self,
        fitted: EnsembleDetector,
        groups: np.ndarray,
        width: int,
        margin_column: int | None,
    ) -> None:
        """The clean-only parts of ``fitted``, refused unless fitted with the same parameters,
        the same columns and on clean rows of the same ``groups`` (the reference's, checked)."""
        check_fitted(fitted)
        if fitted.get_params() != self.get_params():
            raise InputError("the clean-only parts to reuse were fitted with other parameters")
        if (fitted.penultimate_width_, fitted.margin_column_) != (width, margin_column) or not (
            np.array_equal(fitted.clean_groups_, groups)
        ):
            raise InputError("the clean-only parts to reuse were fitted on other clean rows")
        self.clean_groups_, self.penultimate_width_ = fitted.clean_groups_, width
        self.penultimate_, self.novelty_ = fitted.penultimate_, fitted.novelty_
        self.margin_column_, self.margin_ = fitted.margin_column_, fitted.margin_

    def _fit_families(
        self,
        x: np.ndarray,
        clean: np.ndarray,
        predicted: np.ndarray,
        families: np.ndarray | None,
        groups: np.ndarray,
    ) -> tuple[list[str], list[TransportDetector]]:
        """One forest set per family: its rows vs up to ``family_clean_ratio`` clean rows per
        row (drawn by the seed; every clean row when there are fewer); ``groups``: each row's
        source image, kept for :meth:`held_out_scores`."""
        if not self.family_forests or families is None:
            return [], []
        families = np.asarray(families).astype(str)
        if families.shape != (len(x),):
            raise InputError(f"families must have shape ({len(x)},), got {families.shape}")
        names = sorted(set(families[~clean]))
        if len(names) < 2:
            return [], []
        rng = np.random.default_rng(self.random_state)
        clean_rows = np.flatnonzero(clean)
        fitted = []
        for i, name in enumerate(names):
            rows = np.flatnonzero(~clean & (families == name))
            n_clean = min(int(round(self.family_clean_ratio * len(rows))), len(clean_rows))
            drawn = rng.choice(clean_rows, n_clean, replace=False)
            both = np.concatenate([np.sort(drawn), rows])
            seed = None if self.random_state is None else self.random_state + 100 * (i + 1)
            # the ensemble reads a family's votes, never its own decision: none to learn
            params = {**self.forest_params(), "random_state": seed, "decision": "majority"}
            part = TransportDetector(**params)
            fitted.append(part.fit(x[both], ~clean[both], predicted[both], groups[both]))
        return names, fitted

    def fit_samples(
        self,
        clean: SampleSet,
        abnormal: SampleSet,
        *,
        forests: TransportDetector | None = None,
        clean_reference: SampleSet | None = None,
        clean_parts: EnsembleDetector | None = None,
    ) -> EnsembleDetector:
        """Forests on clean vs abnormal (and per family, when ``abnormal`` carries a
        ``families`` array); the novelty part on the clean samples only (``clean_reference``
        when given: the clean images the clean-only parts learn from instead); the margin part
        when the samples' ``feature_names`` hold the logit margin; the penultimate part when
        both carry their embedding in ``extra`` (:meth:`precompute`) and ``penultimate_tail``
        > 0. ``forests`` and ``clean_parts``: parts to reuse, as :meth:`fit` takes them."""
        names = list(getattr(clean, "feature_names", None) or [])
        margin_column = names.index(MARGIN_FEATURE) if MARGIN_FEATURE in names else None
        families = getattr(abnormal, "families", None)
        if families is not None:
            families = np.concatenate([np.full(len(clean), ""), np.asarray(families, str)])
        with_embedding = self.penultimate_tail > 0 and all(
            PENULTIMATE_KEY in s.extra for s in (clean, abnormal)
        )
        rows = [self._columns(s, with_embedding) for s in (clean, abnormal)]
        reference = None
        if clean_reference is not None:
            names_there = list(getattr(clean_reference, "feature_names", None) or [])
            if names_there != names:
                raise InputError(
                    "the clean reference's feature columns differ from the clean samples': "
                    f"{names_there[:4]}... against {names[:4]}..."
                )
            reference = (
                self._columns(clean_reference, with_embedding),
                clean_reference.predicted,
                getattr(clean_reference, "indices", None),
            )
        return self.fit(
            np.concatenate(rows),
            abnormal_labels(clean, abnormal),
            np.concatenate([clean.predicted, abnormal.predicted]),
            families,
            forests=forests,
            margin_column=margin_column,
            penultimate_columns=rows[0].shape[1] - clean.features.shape[1],
            groups=source_groups(clean, abnormal),
            reference=reference,
            clean_parts=clean_parts,
        )

    @staticmethod
    def _columns(samples: SampleSet, with_embedding: bool) -> np.ndarray:
        """The samples' features, followed by their penultimate embedding when asked for."""
        if not with_embedding:
            return np.asarray(samples.features)
        if PENULTIMATE_KEY not in samples.extra:
            raise InputError(
                "this ensemble reads the penultimate embedding: add "
                "detector.precompute(model, samples.images) to samples.extra first"
            )
        return np.concatenate([samples.features, samples.extra[PENULTIMATE_KEY]], axis=1)

    def precompute(self, model: nn.Module, images: np.ndarray) -> dict[str, np.ndarray]:
        """The images' penultimate embeddings (when ``penultimate_tail`` > 0)."""
        if not self.penultimate_tail:
            return {}
        return {PENULTIMATE_KEY: penultimate_embedding(model, images)}

    def precompute_keys(self) -> list[str]:
        return [PENULTIMATE_KEY] if self.penultimate_tail else []

    def serving_features(self, spec: FeatureSpec) -> FeatureSpec:
        """The features the fitted detector reads: ``spec``, the features it was fitted on, with
        the penultimate embedding appended when it has that part."""
        check_fitted(self)
        return replace(spec, penultimate=self.penultimate_width_)

    def score(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        """Combined scores in [0, 1]: HIGHER = MORE ABNORMAL; > 0.5 is the default decision.
        ``features``: as fitted (with the penultimate part, its embedding in the last columns)."""
        check_fitted(self)
        features = check_features(features, self.n_features_in_)
        return self._combine(features, check_class_labels(predicted_labels, len(features)))[0]

    def held_out_scores(
        self, features: np.ndarray, predicted_labels: np.ndarray, groups: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`score` of any rows by what never saw their group (``groups``: each row's
        source image, as ``fit`` was given them; row positions when it was given none): each
        forest's grouped out-of-bag votes (:meth:`TransportDetector.held_out_scores`), and for
        the nearest-clean distances the nearest clean row of another group that the clean-only
        parts learnt from (the reference's, when ``fit`` was given one). Rows of a
        group it was not fitted on get :meth:`score`; its own clean fitting rows get the score
        a detector fitted without them would about give them, for calibration. The margin part
        reads every clean margin (a fitting row's own moves its CDF by at most 1/n). Also,
        per row, the fewest trees that voted of any forest. Where that is 0 some forest had no
        tree to vote: the score is NaN where a whole forest set (pooled or a family's: a general
        forest and its class forest) had none, else it reads the set's other forest. Filter on
        the count, not on NaN.
        Needs the detector as fitted, not loaded from arrays."""
        check_fitted(self)
        if not hasattr(self, "clean_groups_"):
            raise InputError("held-out scores need the detector as fitted, not loaded from arrays")
        features = check_features(features, self.n_features_in_)
        predicted = check_class_labels(predicted_labels, len(features))
        scores, fewest = self._combine(features, predicted, check_groups(groups, len(features)))
        assert fewest is not None  # with groups, _combine counts the trees
        return scores, fewest

    def _combine(
        self, features: np.ndarray, predicted: np.ndarray, groups: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The max of the parts' scores, in float32 arithmetic as :class:`EnsembleScorer`
        computes it: as served, or with ``groups`` by what never saw each row's group (then
        also the fewest trees that voted, per row; else None). Inputs already checked."""
        width = self.penultimate_width_
        x = np.asarray(features[:, :-width] if width else features, np.float32)
        forests = [self.forests_, *self.families_]
        fewest = None
        if groups is None:
            votes = [forest.score(x, predicted) for forest in forests]
        else:
            held = [forest.held_out_scores(x, predicted, groups) for forest in forests]
            votes = [part for part, _ in held]
            fewest = np.minimum.reduce([trees for _, trees in held])
        score = np.maximum.reduce([np.asarray(v).astype(np.float32) for v in votes])
        for ramp in self._ramps(x, features[:, x.shape[1] :], predicted, groups):
            score = np.maximum(score, ramp)
        return score.astype(np.float64), fewest

    def _ramps(
        self,
        x: np.ndarray,
        embedding: np.ndarray,
        predicted: np.ndarray,
        groups: np.ndarray | None,
    ) -> list[np.ndarray]:
        """The clean-only parts' tail ramps (novelty, margin, penultimate when fitted); with
        ``groups``, a clean fitting row of a row's own group is never its nearest."""
        pair = None
        if groups is not None:
            ids = np.unique(np.concatenate([groups, self.clean_groups_]), return_inverse=True)[1]
            pair = (torch.from_numpy(ids[: len(groups)]), torch.from_numpy(ids[len(groups) :]))
        with torch.inference_mode():
            rows, labels = torch.from_numpy(x), torch.from_numpy(predicted)
            novelty = self.novelty_.to_torch()
            u = clean_cdf(novelty.reference, novelty.distance(rows, labels, groups=pair))
            ramps = [tail_ramp(u, self.tail)]
            margin = self._margin_scorer()
            if margin is not None:
                ramps.append(tail_ramp(margin(rows, labels), self.margin_tail))
            scorer = self._embedding_scorer()
            if scorer is not None:
                u = scorer(torch.from_numpy(np.asarray(embedding, np.float32)), groups=pair)
                ramps.append(tail_ramp(u, self.penultimate_tail))
        return [ramp.numpy() for ramp in ramps]

    def _margin_scorer(self) -> MarginScorer | None:
        if self.margin_column_ is None:
            return None
        return MarginScorer(self.margin_, self.margin_column_)

    def _embedding_scorer(self) -> EmbeddingScorer | None:
        if not self.penultimate_width_:
            return None
        return EmbeddingScorer(self.penultimate_, self.penultimate_width_)

    def serving_rows(self, samples: SampleSet) -> np.ndarray:
        """The samples' features, followed by their penultimate embedding with that part."""
        check_fitted(self)
        return self._columns(samples, bool(self.penultimate_width_))

    def score_samples(self, samples: SampleSet) -> np.ndarray:
        return self.score(self.serving_rows(samples), samples.predicted)

    def predict(self, features: np.ndarray, predicted_labels: np.ndarray) -> np.ndarray:
        return self.score(features, predicted_labels) > DEFAULT_VOTE_THRESHOLD

    def to_torch(self) -> EnsembleScorer:
        check_fitted(self)
        return EnsembleScorer(
            self.forests_.to_torch(),
            self.novelty_.to_torch(),
            self.tail,
            [family.to_torch() for family in self.families_],
            self._margin_scorer(),
            self.margin_tail,
            self._embedding_scorer(),
            self.penultimate_tail,
            self.family_names_,
        )

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        check_fitted(self)
        parts = {"forest": self.forests_, "novelty": self.novelty_}
        parts.update({f"family{i}": family for i, family in enumerate(self.families_)})
        arrays = {f"margin.{k}": v for k, v in self.margin_.items()}
        arrays.update({f"penultimate.{k}": v for k, v in self.penultimate_.items()})
        for prefix, part in parts.items():
            arrays.update({f"{prefix}.{k}": v for k, v in part.to_arrays()[0].items()})
        params = {**self.get_params(), "n_features_in": int(self.n_features_in_)}
        learned = {
            "families": list(self.family_names_),
            "margin_column": self.margin_column_,
            "penultimate_width": self.penultimate_width_,
        }
        return arrays, params | learned

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], params: dict[str, Any]) -> EnsembleDetector:
        params = dict(params)
        try:
            n_features = int(params.pop("n_features_in"))
            names = [str(n) for n in params.pop("families", [])]
            column = params.pop("margin_column", None)
            width = int(params.pop("penultimate_width", 0))
            params.setdefault("margin_tail", 0.0)  # bundles from before the margin part
            params.setdefault("novelty_distance", "class-mean")  # ... and the nearest distance
            params.setdefault("penultimate_tail", 0.0)  # ... and the penultimate part
            detector = cls(**params)
        except (KeyError, TypeError, ValueError) as error:
            raise ArtefactError(f"ensemble detector params are incomplete: {error}") from error

        def part(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}

        if width < 0 or width >= n_features or (width > 0 and not detector.penultimate_tail):
            raise ArtefactError(
                f"ensemble penultimate width {width} does not fit {n_features} features and "
                f"penultimate_tail {detector.penultimate_tail}"
            )
        detector.penultimate_width_ = width
        detector.penultimate_ = part("penultimate.") if width else {}
        if width:
            check_embedding_arrays(detector.penultimate_, width)
        n_features -= width  # the trajectory features the other parts read
        forests, _ = detector._unfitted_parts()
        forest_params = {**forests.get_params(), "n_features_in": n_features}
        detector.forests_ = TransportDetector.from_arrays(part("forest."), forest_params)
        detector.family_names_ = names
        detector.families_ = [
            TransportDetector.from_arrays(part(f"family{i}."), forest_params)
            for i in range(len(names))
        ]
        detector.novelty_ = NoveltyDetector.from_arrays(
            part("novelty."),
            {
                "min_class_samples": detector.min_class_samples,
                "distance": detector.novelty_distance,
                "n_features_in": n_features,
            },
        )
        detector.n_features_in_ = n_features + width
        detector.margin_column_, detector.margin_ = None, {}
        if column is not None:
            detector.margin_column_, detector.margin_ = int(column), part("margin.")
            if not 0 <= detector.margin_column_ < n_features:
                raise ArtefactError(f"ensemble margin column {column} is not a feature column")
            check_margin_arrays(detector.margin_)
        return detector
