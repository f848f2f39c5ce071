"""What a run's bundle carries for explanations (detector/explain.py): the clean band of every
class, from the training side's clean images only, and a gallery of held-out samples (clean,
one per attack, one per OOD set) that a first-time user of the page can click."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from detector.explain import CleanBand, Gallery, GalleryItem, block_features, to_uint8
from detector.features import FeatureSpec
from training.evaluation.context import PipelineRun, read_pipeline_config
from training.evaluation.protocols import Samples, Split

CLEAN_SAMPLES = 3


def explain_assets(
    run: str | Path, info: dict[str, Any], *, root: Path | None = None
) -> tuple[CleanBand, Gallery]:
    """The band and gallery of the deployed network of ``run`` (``info``: its deployable.json),
    from the cached sample sets and the same seed-0 split as the detector."""
    pipeline = PipelineRun(read_pipeline_config(run), run, root=root, progress=False)
    name = info["network"]
    model = pipeline.model(name)
    data = pipeline.samples(name)
    n_blocks = len(FeatureSpec(**info.get("features", {})).tap_names(model))
    split = Split(info["split_seed"], info["test_fraction"], int(data.clean.indices.max()) + 1)
    clean = split.train(data.clean)
    class_names = list(model.config.class_names)  # type: ignore[union-attr]
    band = CleanBand.fit(
        block_features(clean.features, n_blocks), clean.predicted, len(class_names)
    )
    _, labels, indices = pipeline.test_images(name)
    true_label = dict(zip(indices.tolist(), labels.tolist(), strict=True))
    parts = [_clean_rows(split.test(data.clean), true_label)]
    parts += [_first_fooled(key, split.test(s), true_label) for key, s in data.attacks.items()]
    parts += [[("ood", key, s.images[0], None)] for key, s in data.ood.items() if len(s)]
    chosen = [row for part in parts for row in part]
    value_range = model.config.input_spec.value_range  # type: ignore[union-attr]
    items = [
        GalleryItem(
            name=_file_name(kind, source, class_names[label] if label is not None else str(i)),
            kind=kind,
            source=source,
            label=class_names[label] if label is not None else None,
        )
        for i, (kind, source, _, label) in enumerate(chosen)
    ]
    images = to_uint8(np.stack([row[2] for row in chosen]), value_range)
    return band, Gallery(items, images)


def _file_name(*parts: str) -> str:
    """'clean-test-t-shirt-top.png': the parts, lower case, anything but letters/digits/. as -."""
    text = "-".join(parts).lower()
    return re.sub(r"[^a-z0-9.]+", "-", text).strip("-") + ".png"


def _clean_rows(samples: Samples, true_label: dict[int, int]) -> list[tuple]:
    """Up to :data:`CLEAN_SAMPLES` correctly classified images of distinct classes."""
    rows, seen = [], set()
    for row, index in enumerate(samples.indices.tolist()):
        label = true_label[index]
        if samples.predicted[row] == label and label not in seen:
            rows.append(("clean", "test", samples.images[row], label))
            seen.add(label)
        if len(rows) == CLEAN_SAMPLES:
            break
    return rows


def _first_fooled(key: str, samples: Samples, true_label: dict[int, int]) -> list[tuple]:
    """The first held-out image of attack ``key`` that fooled the network (none: no row)."""
    for row, index in enumerate(samples.indices.tolist()):
        fooled = samples.success is None or bool(samples.success[row])
        if fooled and samples.predicted[row] != true_label[index]:
            return [("adversarial", key, samples.images[row], true_label[index])]
    return []
