"""Feature sets chosen on the training side only: the informative candidate wins, the choice does
not move when the test side changes, and the table is cached."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from detector.errors import ConfigError
from detector.features import FeatureSpec
from training.evaluation.feature_selection import (
    restrict,
    select_features,
    spec_columns,
    union_spec,
)
from training.evaluation.protocols import Samples, Split

CANDIDATES = [FeatureSpec(), FeatureSpec(head=True)]
NAMES = FeatureSpec(head=True).names(2)  # msq_0 cos_0 msq_1 cos_1 head_margin ...


def _sets(n: int = 500, seed: int = 0) -> tuple[Samples, dict[str, Samples]]:
    """Residue columns carry no signal; the head's margin separates attacked from clean."""
    rng = np.random.default_rng(seed)
    images = np.zeros((n, 1, 2, 2), np.float32)
    indices = np.arange(n)

    def samples(name: str, margin: float) -> Samples:
        features = rng.normal(0, 1, (n, len(NAMES))).astype(np.float32)
        features[:, 4] += margin
        return Samples(name, images, features, rng.integers(0, 2, n), indices)

    return samples("clean", 3.0), {"cw": samples("cw", 0.0)}


def test_the_informative_candidate_wins_and_the_table_is_kept(tmp_path: Path) -> None:
    clean, attacks = _sets()
    out = tmp_path / "selection.json"
    chosen, table = select_features(
        CANDIDATES, NAMES, clean, attacks, detector="transport", test_fraction=0.2, out=out
    )
    assert chosen == FeatureSpec(head=True)
    rows = {row["features"]: row for row in table["rows"]}
    assert rows["residues+head"]["mean"] > 0.9 > 0.65 > rows["residues"]["mean"]
    assert json.loads(out.read_text())["chosen"] == "residues+head"
    # Cached: a second call reads the table (even with other data).
    again, _ = select_features(
        CANDIDATES, NAMES, *_sets(seed=5), detector="transport", test_fraction=0.2, out=out
    )
    assert again == chosen


def test_the_test_side_never_influences_the_choice() -> None:
    clean, attacks = _sets()
    is_test = Split(0, 0.2, len(clean)).is_test
    poisoned = {}
    for key, samples in attacks.items():
        features = samples.features.copy()
        features[is_test[samples.indices]] = 1e6  # garbage on the test side only
        poisoned[key] = Samples(key, samples.images, features, samples.predicted, samples.indices)
    kwargs = {"detector": "transport", "test_fraction": 0.2}
    _, table = select_features(CANDIDATES, NAMES, clean, attacks, **kwargs)
    _, poisoned_table = select_features(CANDIDATES, NAMES, clean, poisoned, **kwargs)
    assert poisoned_table["rows"] == table["rows"]


def test_columns_of_a_candidate_are_found_by_name() -> None:
    union = union_spec(
        [
            FeatureSpec(embeddings=True, squeeze=True),
            FeatureSpec(head=True, image=True, extra_directions=2, nss=True),
        ]
    )
    assert union == FeatureSpec(
        embeddings=True, head=True, image=True, extra_directions=2, squeeze=True, nss=True
    )
    names = union.names(3)
    columns = spec_columns(FeatureSpec(head=True), names)
    assert [names[i] for i in columns] == FeatureSpec(head=True).names(3)
    clean, _ = _sets()
    restricted = restrict(clean, np.array([0, 4]), NAMES)
    assert restricted.feature_names == ("msq_0", "head_margin")
    assert restricted.features.shape == (len(clean), 2)
    with pytest.raises(ConfigError, match="lack the columns"):
        spec_columns(FeatureSpec(line_shape=True), names)


def test_own_feature_selection_names_a_protocol_detector_that_is_not_deployed() -> None:
    from pydantic import ValidationError

    from training.presets.pipelines import PipelineConfig, get_pipeline_preset

    config = get_pipeline_preset("smoke")
    assert config.own_feature_selection == ["transport"]
    assert config.feature_chooser("transport") == "transport"
    assert config.feature_chooser("quantile") == config.feature_chooser() == "ensemble"
    data = config.model_dump()
    for own, match in (
        (["novelty"], "not one of the detectors"),
        (["ensemble"], "deployed detector"),
    ):
        with pytest.raises(ValidationError, match=match):
            PipelineConfig.model_validate(data | {"own_feature_selection": own})
