"""A user's weights file read safely into a state dict, and checked against a network.

Accepted: a ``.safetensors`` file, or a state dict saved with ``torch.save(model.state_dict())``
and read with ``torch.load(..., weights_only=True)`` (also a checkpoint dict holding it under
``state_dict``, ``model_state_dict`` or ``model``; a ``module.`` prefix left by DataParallel is
dropped). A pickled whole module is refused: unpickling it could run any code.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from detector.errors import ArtefactError, ConfigError, DataNotFoundError, one_line

CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model")
SHOWN = 3
# What torch.load(weights_only=True) says when a file needs a class unpickled.
UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
State = dict[str, torch.Tensor]


def _torch_state(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = UNSUPPORTED_GLOBAL.search(str(error))
        if refused is None:
            raise _unreadable(path, error) from error
        raise ArtefactError(
            f"{path} holds pickled Python objects ({refused.group(1)}; e.g. a whole module "
            "saved with torch.save(model)), which lapguard does not unpickle: save "
            "model.state_dict() instead (torch.save(model.state_dict(), path) or safetensors)"
        ) from error
    except Exception as error:  # torch.load fails on a corrupt file with many exception types
        raise _unreadable(path, error) from error


def _unreadable(path: Path, error: Exception) -> ArtefactError:
    return ArtefactError(
        one_line(
            f"cannot read {path}: not a .safetensors file or a torch state dict "
            f"({type(error).__name__}: {error})"
        )
    )


def _unwrapped(loaded: Any, path: Path) -> State:
    """The state dict inside what ``torch.load`` returned (a checkpoint dict's, if nested)."""
    if isinstance(loaded, Mapping):
        for key in CHECKPOINT_KEYS:
            if isinstance(loaded.get(key), Mapping):
                loaded = loaded[key]
                break
    if not isinstance(loaded, Mapping) or not loaded:
        raise ArtefactError(f"{path} does not hold a state dict (a mapping of names to tensors)")
    bad = [str(k) for k, v in loaded.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ArtefactError(
            f"{path} is not a plain state dict (entries that are not tensors: "
            f"{', '.join(bad[:SHOWN])})"
        )
    state = {str(k): v for k, v in loaded.items()}
    if all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def read_state_dict(path: str | Path) -> State:
    """The tensors of a user's weights file, on the CPU (see the module's note for formats)."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"no weights file at {path}")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as error:
            raise ArtefactError(one_line(f"cannot read {path}: {error}")) from error
    return _unwrapped(_torch_state(path), path)


def _listed(label: str, items: list[str]) -> str:
    more = f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else ""
    return f"{label} {', '.join(items[:SHOWN])}{more}"


def mismatch(model: nn.Module, state: Mapping[str, torch.Tensor]) -> str:
    """'' if ``state`` fits ``model`` key for key and shape for shape, else one clause naming the
    first missing, unexpected and mis-shaped keys."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shaped = [
        f"{k} (file {list(v.shape)}, network {list(own[k].shape)})"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    parts = [
        _listed(label, items)
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", shaped),
        )
        if items
    ]
    return "; ".join(parts)


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor], *, what: str) -> None:
    """Load ``state`` into ``model`` strictly; a one-line ConfigError naming the first
    missing/unexpected/mis-shaped keys when it does not fit (``what`` names the pair)."""
    problems = mismatch(model, state)
    if problems:
        raise ConfigError(f"{what} do not fit: {problems}")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ConfigError(one_line(f"{what} do not fit: {error}")) from error


def classifier_width(model: nn.Module, state: Mapping[str, torch.Tensor]) -> int | None:
    """How many classes the weights' last linear layer gives (the last ``nn.Linear`` of
    ``model``, read in ``state``), or None when the file has no such weight."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    weight = state.get(f"{linear[-1]}.weight") if linear else None
    return int(weight.shape[0]) if weight is not None and weight.ndim == 2 else None
