"""One exception hierarchy; every message says what went wrong and what to do."""

from __future__ import annotations

import re
from typing import Any


def one_line(text: object, limit: int = 400) -> str:
    """``text`` as one line (every run of whitespace, newlines included, becomes one space), cut
    to ``limit`` characters: what a message quoting a third-party error needs."""
    flat = re.sub(r"\s+", " ", str(text)).strip()
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


def validation_problems(errors: list[Any], what: str = "") -> str:
    """A pydantic ``ValidationError.errors()`` list as one line: 'field.path: message; ...'
    (``what`` names an error that belongs to no field)."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or what}: {e['msg']}" for e in errors)


class LapguardError(Exception):
    """Base class of every error lapguard raises on purpose."""


class ConfigError(LapguardError, ValueError):
    """A configuration, preset or parameter is invalid."""


class DataNotFoundError(LapguardError, FileNotFoundError):
    """A data set or input file is missing; the message names the path searched."""


class ArtefactError(LapguardError):
    """A saved artefact (weights, bundle, cache) is missing, corrupt or does not match."""


class InputError(LapguardError, ValueError):
    """An input (image, array, features) cannot be used: wrong shape, type or content."""


class NotFittedError(LapguardError, RuntimeError):
    """An estimator was used before `fit`."""


class InputTooLargeError(InputError):
    """An input is larger than allowed: too many bytes, pixels or images. Send less, or raise the limit."""


class UnsupportedMediaError(InputError):
    """An input is of a type or format that is not accepted; the message lists what is."""
