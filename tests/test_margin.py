"""The margin part: the clean CDF of the logit margin per predicted class, in numpy and torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.errors import ArtefactError
from detector.margin import MarginScorer, check_margin_arrays, margin_arrays


def test_margin_score_is_the_share_of_clean_margins_of_the_class_at_least_as_large() -> None:
    margins = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0], np.float32)
    predicted = np.array([0, 0, 0, 0, 1, 1, 1])
    arrays = margin_arrays(margins, predicted, min_class_samples=3)
    assert arrays["margin_counts"].tolist() == [4, 3, 7]  # class 0, class 1, pooled
    scorer = MarginScorer(arrays, column=1)
    features = torch.tensor([[9.0, 0.5], [9.0, 2.5], [9.0, 25.0], [9.0, 2.5], [9.0, 2.5]])
    labels = torch.tensor([0, 0, 1, 1, 7])  # 7: no row of its own -> pooled
    u = scorer(features, labels).numpy()
    # class 0: 0 of 4 below 0.5 -> 1.0; 2 of 4 below 2.5 -> 0.5; class 1: 2 of 3 below 25
    # -> 1/3; 0 of 3 below 2.5 -> 1.0; pooled: 2 of 7 below 2.5 -> 5/7
    np.testing.assert_allclose(u, [1.0, 0.5, 1 / 3, 1.0, 5 / 7], rtol=1e-6)
    np.testing.assert_allclose(scorer(features, None).numpy()[1], 5 / 7, rtol=1e-6)


def test_a_class_with_too_few_clean_samples_uses_the_pooled_reference() -> None:
    arrays = margin_arrays(np.array([1.0, 2.0, 3.0], np.float32), np.array([0, 0, 1]), 2)
    assert arrays["margin_counts"].tolist() == [2, 0, 3]
    u = MarginScorer(arrays, 0)(torch.tensor([[2.5]]), torch.tensor([1])).numpy()
    np.testing.assert_allclose(u, [1 / 3], rtol=1e-6)


def test_broken_margin_arrays_are_refused() -> None:
    arrays = margin_arrays(np.array([1.0, 2.0], np.float32), np.array([0, 1]), 1)
    with pytest.raises(ArtefactError, match="lack margin_counts"):
        check_margin_arrays({"margin_reference": arrays["margin_reference"]})
    with pytest.raises(ArtefactError, match="do not fit"):
        check_margin_arrays({**arrays, "margin_counts": np.array([5, 1, 2])})
