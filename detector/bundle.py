"""The deployable bundle (docs/architecture.md, "Bundle"): manifest.json + model.safetensors +
detector.safetensors (+ second.safetensors when the features hold a second network's opinion, +
explain.safetensors).

The manifest (pydantic, no unknown keys) says what the network is, how inputs look, which
detector with which parameters, the calibrated threshold, headline metrics and the sha256 of
every file. Loading verifies every checksum before reading a byte of the files, and refuses a
bundle that does not match with a message naming the problem. Nothing is ever unpickled: the
weights and the detector's arrays are safetensors, everything else JSON.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from safetensors import SafetensorError
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch

from detector.artefacts import sha256_file, write_text
from detector.base import Detector
from detector.calibration import Calibration
from detector.cost import GuardCost
from detector.errors import ArtefactError, ConfigError, validation_problems
from detector.explain import EXPLAIN_FILE, CleanBand, Gallery, GalleryItem
from detector.features import FeatureSpec
from detector.networks import (
    WEIGHTS_FILE,
    InputSpec,
    Network,
    NetworkConfig,
    build_network,
    read_config,
    resolve_device,
)
from detector.registry import detector_class, detector_name, list_detectors

BUNDLE_FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DETECTOR_FILE = "detector.safetensors"
SECOND_WEIGHTS_FILE = "second.safetensors"
REQUIRED_FILES = (WEIGHTS_FILE, DETECTOR_FILE)


class DetectorSpec(BaseModel):
    """Which detector, its parameters, and how its features are computed."""

    model_config = ConfigDict(extra="forbid")

    kind: str  # a servable registered detector (detector.registry.list_detectors(servable=True))
    params: dict[str, Any]
    feature_names: list[str]
    taps: list[str] | None = None
    extra_directions: int = Field(default=0, ge=0)
    line_shape: bool = False
    embeddings: bool = False
    head: bool = False
    start: bool = False
    image: bool = False
    squeeze: bool = False
    second: bool = False
    penultimate: int = Field(default=0, ge=0)  # the penultimate embedding's width (0: none)
    nss: bool = False  # the input image's natural-scene statistics

    @property
    def feature_spec(self) -> FeatureSpec:
        """The feature options as one typed spec (the JSON keeps its flat keys)."""
        return FeatureSpec(**self.model_dump(include={f.name for f in fields(FeatureSpec)}))

    @field_validator("kind")
    @classmethod
    def _servable_kind(cls, kind: str) -> str:
        servable = list_detectors(servable=True)
        if kind not in servable:
            raise ValueError(f"detector kind must be one of {servable}, got {kind!r}")
        return kind


class ExplainSpec(BaseModel):
    """What ``explain.safetensors`` holds: the clean band's quantile levels (None: no band) and
    the gallery's samples, in the order of its images."""

    model_config = ConfigDict(extra="forbid")

    band_quantiles: list[float] | None = None
    gallery: list[GalleryItem] = Field(default_factory=list)


class OperatingPoint(BaseModel):
    """A threshold calibrated on the same clean scores as the bundle's, at another target FPR
    (with the same confidence): an operator who wants fewer false alarms serves it
    (``lapguard serve --target-fpr``) without refitting anything."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    target_fpr: float = Field(gt=0, lt=1)
    threshold: float
    achieved_fpr: float = Field(ge=0, le=1)  # on the clean scores it was calibrated on


class BundleManifest(BaseModel):
    """manifest.json of a bundle."""

    model_config = ConfigDict(extra="forbid")

    format_version: int
    name: str
    version: str
    created: str
    dataset: str
    class_names: list[str]
    input_spec: InputSpec
    network: NetworkConfig
    second_network: NetworkConfig | None = None  # the opinion network (DetectorSpec.second)
    detector: DetectorSpec
    threshold: float = Field(allow_inf_nan=False)  # NaN or inf would flag nothing or everything
    target_fpr: float = Field(gt=0, lt=1)
    default_vote_threshold: float = Field(default=0.5, allow_inf_nan=False)
    metrics: dict[str, float] = Field(default_factory=dict)
    explain: ExplainSpec | None = None
    operating_points: list[OperatingPoint] = Field(default_factory=list)  # by target FPR
    # Guard time / the network's plain forward time, measured where the bundle was written.
    cost: GuardCost | None = None
    files: dict[str, str]

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != BUNDLE_FORMAT_VERSION:
            raise ValueError(
                f"unknown bundle format version {value} (this lapguard reads {BUNDLE_FORMAT_VERSION})"
            )
        return value

    @field_validator("files")
    @classmethod
    def _plain_names(cls, files: dict[str, str]) -> dict[str, str]:
        for name, digest in files.items():
            if Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"bundle file names must be plain file names, got {name!r}")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"sha256 of {name} must be 64 lowercase hex digits")
        return files

    @model_validator(mode="after")
    def _consistent(self) -> BundleManifest:
        if self.class_names != self.network.class_names:
            raise ValueError("class_names differ from the network's class names")
        if self.input_spec.shape != self.network.input_spec.shape:
            raise ValueError(
                f"input_spec shape {self.input_spec.shape} differs from the network's {self.network.input_spec.shape}"
            )
        if self.explain is not None and EXPLAIN_FILE not in self.files:
            raise ValueError(f"explain is set but {EXPLAIN_FILE} is not listed in files")
        self._consistent_second()
        self._consistent_operating_points()
        return self

    def threshold_at(self, target_fpr: float | None = None) -> float:
        """The threshold of the operating point at ``target_fpr`` (None: the bundle's own target);
        a target the bundle was not calibrated at raises :class:`ConfigError` naming those it was."""
        if target_fpr is None or _same_fpr(target_fpr, self.target_fpr):
            return self.threshold
        for point in self.operating_points:
            if _same_fpr(point.target_fpr, target_fpr):
                return point.threshold
        offered = sorted({self.target_fpr, *(p.target_fpr for p in self.operating_points)})
        raise ConfigError(
            f"bundle {self.name!r} has no operating point at target FPR {target_fpr:g}; it was "
            f"calibrated at {', '.join(f'{t:g}' for t in offered)}"
        )

    def _consistent_operating_points(self) -> None:
        """One point per target; the bundle's own target at its threshold; a stricter target
        never at a lower threshold (what an edit that swaps thresholds would break)."""
        points = sorted(self.operating_points, key=lambda p: p.target_fpr)
        targets = [p.target_fpr for p in points]
        if any(_same_fpr(a, b) for a, b in pairwise(targets)):
            raise ValueError(f"operating_points repeat a target FPR: {targets}")
        for point in points:
            if _same_fpr(point.target_fpr, self.target_fpr) and point.threshold != self.threshold:
                raise ValueError(
                    f"the operating point at the bundle's target FPR {self.target_fpr:g} has "
                    f"threshold {point.threshold:g}, not the bundle's {self.threshold:g}"
                )
        thresholds = [p.threshold for p in points]
        if any(b > a for a, b in pairwise(thresholds)):
            raise ValueError(
                "operating_points' thresholds must not rise with the target FPR: "
                + ", ".join(f"{p.target_fpr:g} -> {p.threshold:g}" for p in points)
            )

    def _consistent_second(self) -> None:
        """A second network exactly when the features need one, with the same classes and input."""
        second = self.second_network
        if self.detector.second and second is None:
            raise ValueError(
                "the detector's features hold a second network's opinion but "
                "second_network is not set"
            )
        if second is None:
            return
        if not self.detector.second:
            raise ValueError("second_network is set but the detector's features do not use it")
        if SECOND_WEIGHTS_FILE not in self.files:
            raise ValueError(
                f"second_network is set but {SECOND_WEIGHTS_FILE} is not listed in files"
            )
        if second.class_names != self.class_names:
            raise ValueError("the second network's class names differ from the network's")
        if second.input_spec.shape != self.network.input_spec.shape:
            raise ValueError(
                f"the second network's input shape {second.input_spec.shape} differs from the "
                f"network's {self.network.input_spec.shape}"
            )


def _same_fpr(a: float, b: float) -> bool:
    """Two target FPRs the same up to float noise (0.01 from JSON, a CLI flag or arithmetic)."""
    return abs(a - b) <= 1e-9


@dataclass
class Bundle:
    """A verified, loaded bundle."""

    path: Path
    manifest: BundleManifest
    model: Network
    detector: Detector
    band: CleanBand | None = None
    gallery: Gallery | None = None
    second: Network | None = None


def detector_kind(detector: Detector) -> str:
    """The registry name of a detector a bundle can hold (one with a torch form)."""
    servable = list_detectors(servable=True)
    try:
        kind = detector_name(detector)
    except ConfigError:
        kind = ""
    if kind not in servable:
        raise ArtefactError(
            f"cannot bundle a {type(detector).__name__}: bundles hold {' or '.join(servable)} detectors"
        )
    return kind


def write_bundle(
    out_dir: str | Path,
    *,
    network_dir: str | Path,
    detector: Detector,
    calibration: Calibration,
    name: str,
    version: str = "1",
    dataset: str,
    metrics: dict[str, float] | None = None,
    features: FeatureSpec | None = None,
    input_spec: InputSpec | None = None,
    band: CleanBand | None = None,
    gallery: Gallery | None = None,
    second_network_dir: str | Path | None = None,
    operating_points: Sequence[Calibration] = (),
    cost: GuardCost | None = None,
) -> Path:
    """Write a bundle directory from a saved network (``network_dir``) and a fitted detector.

    ``features`` must be the spec the detector's features were extracted with (default: the
    residues of the network's default taps); ``input_spec`` overrides the network's (e.g.
    ``resize="strict"``); ``band`` and ``gallery`` (optional) go to ``explain.safetensors`` for
    ``/v1/explain`` and the page; ``second_network_dir`` is the saved second network of a spec
    with ``second=True`` (its weights go to ``second.safetensors``); ``operating_points`` are
    calibrations of the same scores at other target FPRs (:class:`OperatingPoint`); ``cost``
    the Guard's measured cost (:func:`detector.cost.measure_cost`). Returns ``out_dir``."""
    spec = features or FeatureSpec()
    network_dir = Path(network_dir)
    config = read_config(network_dir)
    weights = network_dir / WEIGHTS_FILE
    if not weights.is_file():
        raise ArtefactError(f"no weights at {weights}")
    tap_list = spec.tap_names(build_network(config))
    names = spec.names(len(tap_list))
    arrays, params = detector.to_arrays()
    if params.get("n_features_in") != len(names):
        raise ArtefactError(
            f"the detector was fitted on {params.get('n_features_in')} features but this network "
            f"gives {len(names)} ({len(tap_list)} blocks, features {spec.label()})"
        )
    second_weights, second_config = _second_source(spec, second_network_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(weights, out / WEIGHTS_FILE)
    save_numpy({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / DETECTOR_FILE))
    (out / SECOND_WEIGHTS_FILE).unlink(missing_ok=True)
    files = list(REQUIRED_FILES)
    if second_weights is not None:
        shutil.copyfile(second_weights, out / SECOND_WEIGHTS_FILE)
        files.append(SECOND_WEIGHTS_FILE)
    explain = _write_explain(out, band, gallery)
    files += [EXPLAIN_FILE] if explain is not None else []
    manifest = BundleManifest(
        format_version=BUNDLE_FORMAT_VERSION,
        name=name,
        version=str(version),
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dataset=dataset,
        class_names=list(config.class_names),
        input_spec=input_spec or config.input_spec,
        network=config,
        second_network=second_config,
        detector=DetectorSpec(
            kind=detector_kind(detector),
            params=params,
            feature_names=names,
            **asdict(spec),
        ),
        threshold=float(calibration.threshold),
        target_fpr=float(calibration.target_fpr),
        default_vote_threshold=float(calibration.default_vote_threshold),
        metrics={k: float(v) for k, v in (metrics or {}).items()},
        explain=explain,
        operating_points=_manifest_points(operating_points),
        cost=cost,
        files={f: sha256_file(out / f) for f in files},
    )
    write_text(out / MANIFEST_FILE, manifest.model_dump_json(indent=2))
    return out


def _manifest_points(calibrations: Sequence[Calibration]) -> list[OperatingPoint]:
    """The manifest's operating points of ``calibrations``, by target FPR."""
    return [
        OperatingPoint(target_fpr=c.target_fpr, threshold=c.threshold, achieved_fpr=c.achieved_fpr)
        for c in sorted(calibrations, key=lambda c: c.target_fpr)
    ]


def _second_source(
    spec: FeatureSpec, network_dir: str | Path | None
) -> tuple[Path | None, NetworkConfig | None]:
    """(weights file, config) of the second network a spec needs; (None, None) when it needs none."""
    if not spec.second:
        if network_dir is not None:
            raise ConfigError(
                f"features {spec.label()} use no second network: drop second_network_dir"
            )
        return None, None
    if network_dir is None:
        raise ConfigError(f"features {spec.label()} need a second network: pass second_network_dir")
    weights = Path(network_dir) / WEIGHTS_FILE
    if not weights.is_file():
        raise ArtefactError(f"no weights at {weights}")
    return weights, read_config(Path(network_dir))


def _write_explain(
    out: Path, band: CleanBand | None, gallery: Gallery | None
) -> ExplainSpec | None:
    """``explain.safetensors`` of the band and gallery (when there is one) and its manifest part."""
    (out / EXPLAIN_FILE).unlink(missing_ok=True)
    if band is None and gallery is None:
        return None
    arrays = {**(band.to_arrays() if band else {}), **(gallery.to_arrays() if gallery else {})}
    save_numpy({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(out / EXPLAIN_FILE))
    return ExplainSpec(
        band_quantiles=list(band.quantiles) if band else None,
        gallery=list(gallery.items) if gallery else [],
    )


def _read_explain(
    root: Path, manifest: BundleManifest, n_blocks: int
) -> tuple[CleanBand | None, Gallery | None]:
    """The band and gallery of a bundle whose manifest lists them (checksums already verified)."""
    spec = manifest.explain
    if spec is None:
        return None, None
    try:
        arrays = load_numpy(str(root / EXPLAIN_FILE))
    except (SafetensorError, OSError, ValueError) as error:
        raise ArtefactError(f"cannot read bundle file {EXPLAIN_FILE}: {error}") from error
    band = None
    if spec.band_quantiles is not None:
        band = CleanBand.from_arrays(arrays, len(manifest.class_names), n_blocks)
    gallery = Gallery.from_arrays(arrays, spec.gallery, manifest.input_spec.shape)
    return band, gallery


def read_manifest(path: str | Path) -> BundleManifest:
    """Read and validate a bundle's manifest and verify every file's checksum."""
    root = Path(path)
    if not root.is_dir():
        raise ArtefactError(f"bundle directory {root} does not exist")
    manifest_path = root / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ArtefactError(f"bundle {root} has no {MANIFEST_FILE}")
    try:
        data = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtefactError(f"{manifest_path} is not valid JSON: {error}") from error
    try:
        manifest = BundleManifest.model_validate(data)
    except ValidationError as error:
        problems = validation_problems(error.errors(), "manifest")
        raise ArtefactError(f"invalid bundle manifest {manifest_path}: {problems}") from error
    unlisted = [f for f in REQUIRED_FILES if f not in manifest.files]
    if unlisted:
        raise ArtefactError(
            f"bundle manifest {manifest_path} does not list required file(s) {', '.join(unlisted)}"
        )
    for name, expected in manifest.files.items():
        file = root / name
        if not file.is_file():
            raise ArtefactError(f"bundle file {name} listed in the manifest is missing from {root}")
        actual = sha256_file(file)
        if actual != expected:
            raise ArtefactError(
                f"checksum mismatch for bundle file {name}: the file was changed or corrupted "
                f"(manifest sha256 {expected[:12]}..., file {actual[:12]}...); rebuild the bundle"
            )
    return manifest


def _load_network(root: Path, config: NetworkConfig, file: str) -> Network:
    """The network of ``config`` with the weights of bundle file ``file`` (checksum verified)."""
    model = build_network(config)
    try:
        state = load_torch(str(root / file))
        model.load_state_dict(state, strict=True)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ArtefactError(
            f"bundle file {file} does not hold this network's weights: {error}"
        ) from error
    return model


def load_bundle(path: str | Path, *, device: str | torch.device = "cpu") -> Bundle:
    """Verify and load a bundle: network (eval mode, on ``device``), detector and, when the
    features need it, the second network."""
    root = Path(path)
    manifest = read_manifest(root)
    model = _load_network(root, manifest.network, WEIGHTS_FILE)
    second = None
    if manifest.second_network is not None:
        second = _load_network(root, manifest.second_network, SECOND_WEIGHTS_FILE)
        second = second.to(resolve_device(device)).eval()
    try:
        arrays = load_numpy(str(root / DETECTOR_FILE))
    except (SafetensorError, OSError, ValueError) as error:
        raise ArtefactError(f"cannot read bundle file {DETECTOR_FILE}: {error}") from error
    spec = manifest.detector
    detector = detector_class(spec.kind).from_arrays(arrays, spec.params)
    n_features = spec.params.get("n_features_in")
    n_blocks = len(spec.feature_spec.tap_names(model))
    expected = spec.feature_spec.names(n_blocks)
    if n_features != len(expected) or spec.feature_names != expected:
        raise ArtefactError(
            f"bundle detector takes {n_features} features named {spec.feature_names[:4]}..., "
            f"but the network gives {len(expected)}: the detector belongs to another network"
        )
    band, gallery = _read_explain(root, manifest, n_blocks)
    return Bundle(
        path=root,
        manifest=manifest,
        model=model.to(resolve_device(device)).eval(),
        detector=detector,
        band=band,
        gallery=gallery,
        second=second,
    )
