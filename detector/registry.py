"""The detector registry (modelled on the networks' and the attacks'): every detector by name.

A detector module registers its class with ``@register_detector``; configs, the CLI, the report
and the bundle look detectors up here, so a name is spelled in one place::

    get_detector("transport", n_estimators=50)     # a new, unfitted detector
    list_detectors()                               # ['mahalanobis', 'nss', 'quantile', 'transport']
    detector_info("quantile").default_threshold    # None: it decides at the calibrated threshold
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, TypeVar

from detector.artefacts import load_arrays, read_json
from detector.base import ARRAYS_FILE, PARAMS_FILE, Detector, DetectorInfo
from detector.errors import ArtefactError, ConfigError

# Modules whose detectors register themselves on import; a new detector module goes here.
BUILTIN_MODULES = (
    "detector.forest",
    "detector.mahalanobis",
    "detector.nss",
    "detector.quantile",
    "detector.novelty",
    "detector.ensemble",
)

D = TypeVar("D", bound=type[Detector])
_DETECTORS: dict[str, type[Detector]] = {}


def register_detector(cls: D) -> D:
    """Class decorator that registers a :class:`Detector` subclass under ``cls.info.name``."""
    name = cls.info.name
    if name in _DETECTORS and _DETECTORS[name] is not cls:
        raise ValueError(f"detector {name!r} is registered twice")
    _DETECTORS[name] = cls
    return cls


def _registry() -> dict[str, type[Detector]]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return _DETECTORS


def list_detectors(*, servable: bool | None = None) -> list[str]:
    """Names of every registered detector (``servable=True``: those a bundle can hold)."""
    return sorted(
        name
        for name, cls in _registry().items()
        if servable is None or cls.info.servable == servable
    )


def detector_class(name: str) -> type[Detector]:
    """The registered class of detector ``name``."""
    registry = _registry()
    if name not in registry:
        raise ConfigError(f"unknown detector {name!r}; registered: {', '.join(list_detectors())}")
    return registry[name]


def detector_info(name: str) -> DetectorInfo:
    """The metadata of detector ``name`` (short name, what it reads, default threshold, ...)."""
    return detector_class(name).info


def get_detector(name: str, **params: Any) -> Detector:
    """A new, unfitted detector ``name`` with keyword parameters."""
    cls = detector_class(name)
    try:
        return cls(**params)
    except TypeError as error:
        raise ConfigError(f"bad parameters for detector {name!r}: {error}") from error


def detector_name(detector: Detector) -> str:
    """The registry name of a detector instance."""
    info = getattr(type(detector), "info", None)
    if info is None or _registry().get(info.name) is not type(detector):
        raise ConfigError(f"{type(detector).__name__} is not a registered detector")
    return str(info.name)


def load_detector(directory: str | Path) -> Detector:
    """A detector written by :meth:`Detector.save` (arrays + kind and params, never a pickle)."""
    root = Path(directory)
    saved = read_json(root / PARAMS_FILE, what="detector parameters")
    if not isinstance(saved, dict) or "kind" not in saved or "params" not in saved:
        raise ArtefactError(f"{root / PARAMS_FILE} must hold the detector's kind and params")
    cls = detector_class(str(saved["kind"]))
    return cls.from_arrays(load_arrays(root / ARRAYS_FILE), dict(saved["params"]))
