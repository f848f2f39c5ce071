"""The one scoring path: network + transport features + detector + threshold.

The service, batch scoring and the evaluation all call :meth:`Guard.predict`, so they cannot
disagree: ONE forward pass gives the logits and, through the residual taps, the features; the
detector's torch form scores them on the same device; ``flagged = score > threshold``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from detector.base import Detector
from detector.bundle import BundleManifest, load_bundle
from detector.calibration import Calibration
from detector.errors import ConfigError, InputError
from detector.explain import CleanBand, Gallery, block_features
from detector.features import FeatureSpec, TransportFeatureExtractor
from detector.networks import InputSpec, load, resolve_device
from detector.preprocessing import prepare_images


@dataclass
class GuardResult:
    """Predictions and abnormality decisions for a batch; numpy arrays of length N."""

    labels: np.ndarray  # int64
    class_names: list[str]  # the class name of each label (length N, not the label set)
    confidences: np.ndarray  # float32, max softmax probability
    probabilities: np.ndarray  # float32 [N, K]
    scores: np.ndarray  # float32, higher = more abnormal
    flagged: np.ndarray  # bool, scores > threshold
    threshold: float
    blocks: np.ndarray | None = None  # float32 [N, 2, M]: (msq_m, cos_m) of every block


class Guard:
    """A network and a detector module behind one ``predict``; thread-safe (calls are serialized)."""

    def __init__(
        self,
        model: nn.Module,
        detector_module: nn.Module,
        *,
        input_spec: InputSpec,
        class_names: Sequence[str],
        threshold: float,
        features: FeatureSpec | None = None,
        device: str | torch.device = "auto",
        manifest: BundleManifest | None = None,
        batch_size: int = 256,
        band: CleanBand | None = None,
        gallery: Gallery | None = None,
        second: nn.Module | None = None,
        target_fpr: float | None = None,
    ) -> None:
        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.second = second.to(self.device).eval() if second is not None else None
        self.detector_module = detector_module.to(self.device).eval()
        self.input_spec = input_spec
        self.class_names = list(class_names)
        self.threshold = float(threshold)
        self.target_fpr = target_fpr  # the operating point's target FPR, when known
        self.manifest = manifest
        self.batch_size = int(batch_size)
        self._extractor = TransportFeatureExtractor(self.model, features, second=self.second)
        self.feature_names = self._extractor.feature_names
        self.block_names = self._extractor.tap_names
        self.band = band  # the clean band per class (explanations), when the bundle has one
        self.gallery = gallery
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------
    # Construction
    # ---------------------------------------------------------------------------------------
    @classmethod
    def from_bundle(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "auto",
        target_fpr: float | None = None,
    ) -> Guard:
        """Load a verified bundle (see :func:`detector.bundle.load_bundle`), flagging at its
        operating point for ``target_fpr`` (default: the target it was calibrated for; one it
        was not calibrated at raises :class:`ConfigError`)."""
        target = resolve_device(device)
        bundle = load_bundle(path, device=target)
        manifest = bundle.manifest
        threshold = manifest.threshold_at(target_fpr)
        return cls(
            bundle.model,
            bundle.detector.to_torch(),
            input_spec=manifest.input_spec,
            class_names=manifest.class_names,
            threshold=threshold,
            features=manifest.detector.feature_spec,
            device=target,
            manifest=manifest,
            band=bundle.band,
            gallery=bundle.gallery,
            second=bundle.second,
            target_fpr=manifest.target_fpr if target_fpr is None else float(target_fpr),
        )

    @classmethod
    def from_run(
        cls,
        network: str | Path | nn.Module,
        detector: Detector,
        calibration: Calibration | float,
        *,
        features: FeatureSpec | None = None,
        device: str | torch.device = "auto",
        input_spec: InputSpec | None = None,
        class_names: Sequence[str] | None = None,
        second: str | Path | nn.Module | None = None,
    ) -> Guard:
        """Build from in-memory objects (evaluation): a saved network directory or a model, a
        fitted detector, and a calibration (or a bare threshold). ``input_spec``/``class_names``
        default to the network's config (our networks carry one); ``second`` (a directory or a
        model) is the second network of features with ``second=True``."""
        model = load(network) if isinstance(network, (str, Path)) else network
        config = getattr(model, "config", None)
        spec = input_spec or (config.input_spec if config is not None else None)
        names = class_names or (config.class_names if config is not None else None)
        if spec is None or names is None:
            raise ConfigError("this network has no config: pass input_spec and class_names")
        threshold = (
            calibration.threshold if isinstance(calibration, Calibration) else float(calibration)
        )
        return cls(
            model,
            detector.to_torch(),
            input_spec=spec,
            class_names=names,
            threshold=threshold,
            features=features,
            device=device,
            second=load(second) if isinstance(second, (str, Path)) else second,
        )

    # ---------------------------------------------------------------------------------------
    # Inputs
    # ---------------------------------------------------------------------------------------
    def prepare(self, images: Sequence[np.ndarray] | np.ndarray) -> torch.Tensor:
        """Images -> float32 CPU tensor [N, C, H, W] in the input spec: see
        :func:`detector.preprocessing.prepare_images`."""
        return prepare_images(images, self.input_spec)

    # ---------------------------------------------------------------------------------------
    # Scoring
    # ---------------------------------------------------------------------------------------
    def predict(self, x: np.ndarray | torch.Tensor) -> GuardResult:
        """Labels, probabilities, scores and flags of a batch [N, C, H, W] already in the input
        spec's shape and value range, from ONE forward pass per chunk of ``batch_size``."""
        batch = torch.as_tensor(x) if isinstance(x, np.ndarray) else x
        if batch.ndim != 4 or tuple(batch.shape[1:]) != self.input_spec.shape:
            raise InputError(
                f"expected a batch of shape [N, {', '.join(map(str, self.input_spec.shape))}], got {tuple(batch.shape)}"
            )
        if not batch.is_floating_point():
            raise InputError(
                f"expected float pixels in the value range, got {batch.dtype}; use prepare() for uint8"
            )
        if not torch.isfinite(batch).all():
            raise InputError("the batch contains NaN or infinite values")
        chunks = [
            self._predict_chunk(batch[i : i + self.batch_size])
            for i in range(0, len(batch), self.batch_size)
        ]
        if chunks:
            logits, scores, features = (torch.cat(parts) for parts in zip(*chunks, strict=True))
        else:
            logits, scores = torch.zeros(0, len(self.class_names)), torch.zeros(0)
            features = torch.zeros(0, len(self.feature_names))
        probabilities = torch.softmax(logits.float(), dim=1)
        confidences, labels = probabilities.max(dim=1)
        label_array = labels.numpy().astype(np.int64)
        score_array = scores.numpy().astype(np.float32)
        return GuardResult(
            labels=label_array,
            class_names=[self.class_names[i] for i in label_array],
            confidences=confidences.numpy().astype(np.float32),
            probabilities=probabilities.numpy().astype(np.float32),
            scores=score_array,
            flagged=score_array > self.threshold,
            threshold=self.threshold,
            blocks=block_features(features.numpy(), len(self.block_names)),
        )

    def _predict_chunk(
        self, batch: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits, scores, the residue columns msq_m/cos_m of the features) of one chunk."""
        with self._lock, torch.inference_mode(), self._extractor as fx:
            logits = self.model(batch.to(self.device, torch.float32))
            features = fx.features()
            scores = self.detector_module(features, logits.argmax(dim=1))
            residues = features[:, : 2 * len(self.block_names)]
            return logits.float().cpu(), scores.float().cpu(), residues.float().cpu()

    def part_scores(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Each part's score of a batch in the input spec, float32 [N] by name, for a detector
        whose torch form has parts (the ensemble: ``forests``, ``family <name>``, ``novelty``,
        ``margin``, ``penultimate``); its score is their max, so a part above the threshold
        flags an input. Empty for a detector without parts."""
        named_parts = getattr(self.detector_module, "parts", None)
        if not callable(named_parts):
            return {}
        chunks: dict[str, list[torch.Tensor]] = {}
        for i in range(0, len(x), self.batch_size):
            with self._lock, torch.inference_mode(), self._extractor as fx:
                logits = self.model(torch.as_tensor(x[i : i + self.batch_size]).to(self.device))
                parts = named_parts(fx.features(), logits.argmax(dim=1))
            for name, score in parts.items():
                chunks.setdefault(name, []).append(score.float().cpu())
        return {name: torch.cat(scores).numpy() for name, scores in chunks.items()}

    def predict_images(self, images: Sequence[np.ndarray] | np.ndarray) -> GuardResult:
        """:meth:`prepare` then :meth:`predict`."""
        return self.predict(self.prepare(images))

    def warmup(self, batch_sizes: Sequence[int] = (1, 8)) -> None:
        """Run each batch size once so the first request pays no start-up cost."""
        low = self.input_spec.value_range[0]
        for size in batch_sizes:
            self.predict(torch.full((size, *self.input_spec.shape), float(low)))
