"""The run context: a run directory under its pipeline config. A :class:`PipelineRun` loads each
network, its test images, its attack sets and its sample sets (images + transport features +
predictions) once, on first use, and every step reads them from there. It runs no step itself:
the steps are in :mod:`training.pipeline.run`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from detector import artefacts, networks
from detector.base import Detector
from detector.cost import feature_costs, noise_batch, within_measured_budget
from detector.errors import ArtefactError, ConfigError
from detector.features import FeatureSpec, extract_features
from training.attacks import sets as adversarial
from training.data.datasets import load_dataset, load_ood, to_arrays
from training.data.network_images import attack_images, images_after
from training.data.synthetic_outliers import SYNTHETIC_OOD, check_held_back, synthetic_outliers
from training.evaluation.feature_selection import (
    restrict,
    select_features,
    spec_columns,
    union_spec,
)
from training.evaluation.protocols import Samples
from training.presets.pipelines import NOT_COMPUTED, PipelineConfig
from training.rundir import RunDir
from training.trainer.config import read_train_config
from training.trainer.loop import train_and_validation_sets

# What a feature cache file holds (an older or corrupt one is computed again).
FEATURE_CACHE_KEYS = ("features", "logits", "feature_names", "source", "seconds")


def read_pipeline_config(run: str | Path) -> PipelineConfig:
    """The config saved in a run directory (ArtefactError when it is not one)."""
    path = RunDir(run).config_file
    if not path.is_file():
        raise ArtefactError(
            f"{run} is not a pipeline run directory (no {path.name}); run `lapguard pipeline` first"
        )
    return artefacts.read_model(path, PipelineConfig, what="pipeline config")


def init_run(config: PipelineConfig, run: str | Path) -> None:
    """Write the config, or check that the run directory was made with one that computes the
    same (fields in ``NOT_COMPUTED`` may differ; the saved config is kept)."""
    path = RunDir(run).config_file
    if path.is_file():
        saved = artefacts.read_model(path, PipelineConfig, what="pipeline config")
        if saved.model_dump(exclude=NOT_COMPUTED) != config.model_dump(exclude=NOT_COMPUTED):
            raise ConfigError(f"{run} holds a run of another pipeline config; choose a new --out")
    else:
        artefacts.write_text(path, config.model_dump_json(indent=2))


def perturbed(adv: adversarial.AdversarialSet) -> np.ndarray:
    """Rows of an attacked set that differ from their source image. ART's APGD and CW return an
    image the network already misclassifies unchanged (~9% of Fashion-MNIST test images): such a
    row is a clean image, not an adversarial sample, and a detector can neither learn nor be
    judged on it, so detection sets leave it out (the seed pairs every image with "an
    adversarial sample generated" from it)."""
    return np.asarray(adv.linf) > 0


def _moved(adv: adversarial.AdversarialSet, name: str, key: str) -> np.ndarray:
    """:func:`perturbed` rows of attack ``key`` on network ``name``; a ConfigError when the attack
    moved none (nothing to detect: a network whose input gradient is zero, such as one with an
    untrained all-zero head)."""
    moved = perturbed(adv)
    if not moved.any():
        raise ConfigError(
            f"attack {key} left all {len(moved)} images of network {name!r} unchanged: its "
            "input gradient is zero on them (an untrained network?), so there is nothing to detect"
        )
    return moved


@dataclass
class NetworkSamples:
    """One network's sample sets with their transport features (attacks: perturbed rows only)."""

    clean: Samples
    attacks: dict[str, Samples]
    ood: dict[str, Samples]
    timing: dict[str, float]
    ood_train: dict[str, Samples] = field(default_factory=dict)  # trained on, never tested


class PipelineRun:
    """A run directory under its config. Loads each network, its test images, its attack sets
    and its sample sets at most once, on first use, and hands them to every step."""

    def __init__(
        self,
        config: PipelineConfig,
        run: str | Path,
        *,
        root: Path | None = None,
        progress: bool = True,
    ) -> None:
        self.config = config
        self.dir = RunDir(run)
        self.root = root
        self.progress = progress
        self.device = str(networks.resolve_device(config.device))
        self._models: dict[str, networks.Network] = {}
        self._images: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._sets: dict[str, dict[str, adversarial.AdversarialSet]] = {}
        self._full: dict[str, NetworkSamples] = {}
        self._samples: dict[tuple[str, str], NetworkSamples] = {}
        self._specs: dict[tuple[str, str], FeatureSpec] = {}

    @cached_property
    def candidates(self) -> list[FeatureSpec]:
        """The candidate feature sets within the config's cost budget: declared
        (:meth:`PipelineConfig.affordable_candidates`), then measured on the deploy network
        (:meth:`feature_costs`); the first always stays, so there is one to choose."""
        declared = self.config.affordable_candidates()
        budget = self.config.cost_budget
        if budget is None or len(declared) < 2:
            return declared
        costs = self.feature_costs(declared)
        return within_measured_budget(declared, [costs[s.label()] for s in declared], budget)

    @cached_property
    def union(self) -> FeatureSpec:
        """Every column any candidate reads: what the feature caches hold."""
        return union_spec(self.candidates)

    def feature_costs(self, specs: list[FeatureSpec]) -> dict[str, float]:
        """(forward + features) / plain forward of each of ``specs`` on the deploy network at
        batch 32 (:func:`detector.cost.feature_costs`), measured once and kept in the run
        directory, so a resumed run offers the candidates it offered."""
        path = self.dir.feature_costs_file
        saved = artefacts.read_json(path, what="feature costs") if path.is_file() else {}
        if all(spec.label() in saved for spec in specs):
            return {str(k): float(v) for k, v in saved.items()}
        name = self.config.deploy_model
        model = self.model(name)
        batch = noise_batch(model.config.input_spec)  # type: ignore[union-attr]
        second = self.second_model(name, union_spec(specs))
        ratios = feature_costs(model, specs, batch, second=second)
        measured = {spec.label(): ratio for spec, ratio in zip(specs, ratios, strict=True)}
        artefacts.write_json(path, measured)
        return measured

    @classmethod
    def open(
        cls, run: str | Path, *, root: Path | None = None, progress: bool = True
    ) -> PipelineRun:
        """An existing run directory with the config saved in it."""
        return cls(read_pipeline_config(run), run, root=root, progress=progress)

    def model(self, name: str) -> networks.Network:
        """The trained network ``name`` (eval mode, on the run's device)."""
        if name not in self._models:
            self._models[name] = networks.load(self.dir.model(name), device=self.device)
        return self._models[name]

    def second_model(self, name: str, spec: FeatureSpec | None = None) -> torch.nn.Module | None:
        """The second network of ``name``'s features (``spec``, default the union of the
        candidates) when they hold its opinion, else None."""
        if not (spec or self.union).second:
            return None
        return self.model(self.config.second_network(name))

    def extract(
        self, name: str, images: np.ndarray, spec: FeatureSpec | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """:func:`~detector.features.extract_features` of network ``name`` with ``spec`` (default:
        the one chosen for it), with the second network when the spec needs one."""
        spec = spec or self.feature_spec(name)
        return extract_features(
            self.model(name),
            images,
            device=self.device,
            spec=spec,
            second=self.second_model(name, spec),
        )

    def test_images(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, labels, source indices) of the test images every attack of ``name`` uses."""
        if name not in self._images:
            self._images[name] = attack_images(
                self.dir.model(name), split="test", n=self.test_count(name), seed=0, root=self.root
            )
        return self._images[name]

    def test_count(self, name: str) -> int:
        """How many test images network ``name``'s attacks and clean samples draw on: the most
        any attack asks for; for an imported network at most the test split less the ``ood_n``
        images held back after them (:func:`validation_images`)."""
        n_max = max(a.n_for(name) for a in self.config.attacks)
        if name not in self.config.imported:
            return n_max
        total = len(load_dataset(self.config.dataset, "test", root=self.root))  # type: ignore[arg-type]
        if total <= self.config.ood_n:
            raise ConfigError(
                f"{self.config.dataset}'s test split has {total} images: an imported network "
                f"needs more than ood_n ({self.config.ood_n}) to hold some back"
            )
        return min(n_max, total - self.config.ood_n)

    def attack_set(self, name: str, key: str) -> adversarial.AdversarialSet:
        """The configured attack ``key`` on network ``name`` (generated once, then loaded)."""
        sets = self._sets.setdefault(name, {})
        if key not in sets:
            spec = next(a for a in self.config.attacks if a.key == key)
            x, y, indices = self.test_images(name)
            n = spec.n_for(name)
            sets[key] = adversarial.get_or_generate(
                self.dir.attacks(name),
                self.model(name),
                x[:n],
                y[:n],
                indices[:n],
                spec.attack,
                spec.params,
                seed=0,
                device=self.config.device,
                progress=self.progress,
            )
        return sets[key]

    def attack_sets(self, name: str) -> dict[str, adversarial.AdversarialSet]:
        """Every configured attack on network ``name``, in the config's order."""
        return {spec.key: self.attack_set(name, spec.key) for spec in self.config.attacks}

    def samples(self, name: str, detector: str | None = None) -> NetworkSamples:
        """Clean, attacked and OOD samples of network ``name`` with their (cached) features, in
        the columns of the feature set ``detector`` reads (:meth:`feature_spec`; default: the
        selection detector's, which the run ships)."""
        spec = self.feature_spec(name, detector)
        key = (name, spec.label())
        if key not in self._samples:
            full = self._collected(name)
            names = self.union.names(self._blocks(name))
            columns = spec_columns(spec, names)
            self._samples[key] = NetworkSamples(
                restrict(full.clean, columns, names),
                {k: restrict(v, columns, names) for k, v in full.attacks.items()},
                {k: restrict(v, columns, names) for k, v in full.ood.items()},
                full.timing,
                {k: restrict(v, columns, names) for k, v in full.ood_train.items()},
            )
        return self._samples[key]

    def image_samples(
        self, name: str, set_name: str, images: np.ndarray, indices: np.ndarray
    ) -> Samples:
        """Samples of network ``name`` on images outside the config's sets (the deployed
        detector's synthetic outliers), in the columns of its chosen feature set; the features
        are cached under ``set_name``, which must name these very images."""
        f, predicted, _ = self._features(name, set_name, set_name, images)
        names = self.union.names(self._blocks(name))
        samples = Samples(set_name, images, f, predicted, np.asarray(indices))
        return restrict(samples, spec_columns(self.feature_spec(name), names), names)

    def _blocks(self, name: str) -> int:
        return len(self.union.tap_names(self.model(name)))

    def feature_spec(self, name: str, detector: str | None = None) -> FeatureSpec:
        """The feature set ``detector`` reads on network ``name`` (default: the selection
        detector's, which the deployed detector and the bundle use): the only candidate, or the
        one the training side picks for the detector that chooses it
        (:meth:`PipelineConfig.feature_chooser`; :func:`select_features`, cached on disk)."""
        chooser = self.config.feature_chooser(detector)
        key = (name, chooser)
        if key not in self._specs:
            if len(self.candidates) == 1:
                self._specs[key] = self.candidates[0]
            else:
                full = self._collected(name)
                own = chooser != self.config.selection_detector
                self._specs[key], _ = select_features(
                    self.candidates,
                    self.union.names(self._blocks(name)),
                    full.clean,
                    {k: full.attacks[k] for k in self.config.seen_keys},
                    detector=chooser,
                    test_fraction=self.config.test_fraction,
                    out=self.dir.feature_selection(name, chooser if own else None),
                )
        return self._specs[key]

    def _collected(self, name: str) -> NetworkSamples:
        """:meth:`_collect` once per network: every feature column of the candidates' union."""
        if name not in self._full:
            self._full[name] = self._collect(name)
        return self._full[name]

    def _collect(self, name: str) -> NetworkSamples:
        x, _, indices = self.test_images(name)
        f, predicted, seconds = self._features(name, "clean", f"clean-{len(x)}", x)
        clean = Samples("clean", x, f, predicted, indices)
        attacks: dict[str, Samples] = {}
        for key, adv in self.attack_sets(name).items():
            f, predicted, _ = self._features(name, key, adv.manifest["key"], adv.x_adv)
            samples = Samples(key, adv.x_adv, f, predicted, adv.indices, adv.success)
            attacks[key] = samples.take(_moved(adv, name, key))
        ood: dict[str, Samples] = {}
        spec = self.model(name).config.input_spec  # type: ignore[union-attr]
        for ood_name in self.config.ood_test:
            n = self.config.ood_n
            images = load_ood(ood_name, spec, n, seed=0, root=self.root)
            f, predicted, _ = self._features(name, f"ood-{ood_name}", f"ood-{ood_name}-{n}", images)
            ood[ood_name] = Samples(f"ood-{ood_name}", images, f, predicted, np.arange(len(images)))
        timing = {"clean_images": float(len(x)), "transport_seconds": seconds}
        ood_train = {}
        if SYNTHETIC_OOD in self.config.ood_train:  # made only for a config that trains on it
            ood_train[SYNTHETIC_OOD] = self._synthetic_ood(name)
        return NetworkSamples(clean, attacks, ood, timing, ood_train)

    def _synthetic_ood(self, name: str) -> Samples:
        """The OOD protocol's synthetic training set on network ``name``: ``ood_n`` synthetic
        outliers (:mod:`training.data.synthetic_outliers`) of the network's own validation images,
        which no split of the detector's test images holds (leak-free for every seed). Its
        features and its detectors' precomputed arrays are cached under a digest of the images."""
        held_back = validation_images(self, name)
        n = self.config.ood_n
        check_held_back(name, len(held_back), n)
        spec = self.model(name).config.input_spec  # type: ignore[union-attr]
        images, _ = synthetic_outliers(held_back[:n], spec.value_range, seed=0)
        digest = hashlib.sha256(images.tobytes()).hexdigest()[:12]
        f, predicted, _ = self._features(
            name, f"ood-{SYNTHETIC_OOD}", f"ood-{SYNTHETIC_OOD}-{digest}", images
        )
        return Samples(f"ood-{SYNTHETIC_OOD}-{digest}", images, f, predicted, np.arange(n))

    def _features(
        self, name: str, set_name: str, source: str, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """(features, predicted labels, seconds) of ``images``, cached under the ``source`` key."""
        path = self.dir.features(name, set_name)
        names = self.union.names(self._blocks(name))
        cached = artefacts.load_cache(path, FEATURE_CACHE_KEYS)
        if (
            cached is not None
            and str(cached["source"]) == source
            and len(cached["features"]) == len(images)
            and list(cached["feature_names"]) == names
        ):
            return cached["features"], cached["logits"].argmax(1), float(cached["seconds"])
        started = time.perf_counter()
        features, logits = self.extract(name, images, self.union)
        seconds = time.perf_counter() - started
        artefacts.save_npz(
            path,
            features=features,
            logits=logits,
            feature_names=np.array(names),
            source=np.array(source),
            seconds=np.array(seconds),
        )
        return features, logits.argmax(1), seconds


def add_precomputed(run: PipelineRun, name: str, detector: Detector, sets: list[Samples]) -> None:
    """A detector's per-row arrays (:meth:`~detector.base.Detector.precompute`) of each sample
    set of network ``name``, added to its ``extra``; computed once and cached on disk."""
    keys = detector.precompute_keys()
    for samples in sets if keys else []:
        path = run.dir.precomputed(name, detector.info.name, samples.name)
        cached = artefacts.load_cache(path, keys)
        if cached is not None and len(cached[keys[0]]) == len(samples):
            samples.extra.update({k: cached[k] for k in keys})
            continue
        samples.extra.update(detector.precompute(run.model(name), samples.images))
        artefacts.save_npz(path, **{k: samples.extra[k] for k in keys})


def validation_set(run: PipelineRun, name: str) -> Dataset:
    """Network ``name``'s validation set (:func:`training.trainer.loop.train_and_validation_sets` of
    its ``train_config.json``): clean images of its training split that it held back and never
    learnt from. No detector is fitted on them; the OOD protocol's synthetic set (fitted on,
    never tested on) is made of transformed copies of its first ``ood_n``."""
    config = read_train_config(run.dir.model_dir(name).train_config_file)
    full_train = load_dataset(config.dataset, "train", root=run.root, verify=config.verify_data)
    return train_and_validation_sets(config, full_train)[1]


def validation_images(run: PipelineRun, name: str) -> np.ndarray:
    """:func:`validation_set`'s images in its order; an empty array when it held none back. An
    imported network's training images are unknown: its held-back images are the ``ood_n`` test
    images that follow, in the same seeded order, those its attacks and clean samples use."""
    if name in run.config.imported:
        skip, n = run.test_count(name), run.config.ood_n
        return images_after(run.dir.model(name), skip=skip, n=n, root=run.root)
    held_back = validation_set(run, name)
    if not len(held_back):  # type: ignore[arg-type]
        return np.empty(0, np.float32)
    return to_arrays(held_back)[0]


def noisy_copies(
    run: PipelineRun, name: str, detector: str | None = None, eps: float = 0.1
) -> Samples:
    """Noised copies of network ``name``'s clean images, in the columns ``detector`` reads."""
    clean = run.samples(name, detector).clean
    rng = np.random.default_rng(0)
    images = np.clip(
        clean.images + rng.uniform(-eps, eps, clean.images.shape).astype(np.float32), 0, 1
    )
    features, logits = run.extract(name, images, run.feature_spec(name, detector))
    return Samples("noise", images, features, logits.argmax(1), clean.indices)
