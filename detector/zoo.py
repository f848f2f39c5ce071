"""Classifiers from torchvision and timm, looked up by ``torchvision:NAME`` or ``timm:NAME``.

NAME is a torchvision classification builder (``resnet18``, ``vit_b_16``, ``wide_resnet50_2``...),
a torchvision model class whose arguments are plain values (``VisionTransformer``: a ViT of any
size), or a timm model. Built without pretrained weights (the user's weights file brings them):
torchvision builders get ``weights=None``, timm ``pretrained=False``; keyword arguments
(``num_classes``, ``image_size``, ``in_chans``...) go to the builder. timm is an optional extra: ``pip install 'lapguard[timm]'``.
:func:`input_defaults` gives what the architecture expects when the user does not say: the
default weights' crop size and normalization for torchvision, ``resolve_model_data_config`` for
timm; an explicit ``image_size``/``img_size``/``in_chans`` argument wins. They include the
eval transform's resize: torchvision's weights resize the shorter side to 256 and crop the centre
224 (the ratio kept for other sizes), timm's data config gives ``crop_pct`` and ``interpolation``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

from torch import nn

from detector.errors import ConfigError, one_line

ZOOS = ("torchvision", "timm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_SIZE = 224
IMAGENET_CROP_PCT = 0.875  # torchvision's usual eval transform: resize 256, crop 224
# Arguments that would load weights from elsewhere than the user's file.
WEIGHT_ARGUMENTS = ("weights", "weights_backbone", "pretrained", "checkpoint_path")


def is_zoo_architecture(name: str) -> bool:
    """Whether ``name`` reads ``torchvision:NAME`` or ``timm:NAME``."""
    zoo, sep, model = name.partition(":")
    return bool(sep) and zoo in ZOOS


def split_architecture(name: str) -> tuple[str, str]:
    """``"timm:resnet18"`` -> ``("timm", "resnet18")``; ConfigError for anything else."""
    if not is_zoo_architecture(name) or not name.partition(":")[2]:
        raise ConfigError(f"{name!r} is not torchvision:NAME or timm:NAME")
    zoo, _, model = name.partition(":")
    return zoo, model


def _timm() -> ModuleType:
    try:
        import timm
    except ImportError as error:
        raise ConfigError(
            "timm: architectures need the timm package: pip install 'lapguard[timm]'"
        ) from error
    return timm


def _torchvision_classes() -> dict[str, type[nn.Module]]:
    """The model classes torchvision.models exports (``VisionTransformer``, ``ResNet``...)."""
    from torchvision import models

    found = {name: getattr(models, name) for name in dir(models)}
    return {n: c for n, c in found.items() if isinstance(c, type) and issubclass(c, nn.Module)}


def zoo_models(zoo: str) -> list[str]:
    """The classifier names of one zoo: torchvision's classification builders and model classes,
    or timm's models."""
    if zoo == "timm":
        return list(_timm().list_models())
    from torchvision import models

    return [*models.list_models(module=models), *sorted(_torchvision_classes())]


def check_architecture(name: str) -> None:
    """ConfigError unless ``name`` is a classifier of its zoo (suggesting close names)."""
    zoo, model = split_architecture(name)
    known = zoo_models(zoo)
    if model in known or (zoo == "timm" and _timm().is_model(model)):
        return
    close = difflib.get_close_matches(model, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(f'{zoo}:{c}' for c in close)}?" if close else ""
    raise ConfigError(f"unknown {zoo} architecture {model!r}{hint}")


def build_zoo_model(name: str, arguments: Mapping[str, Any]) -> nn.Module:
    """The untrained classifier ``name`` built with ``arguments``, in eval mode."""
    check_architecture(name)
    given = [key for key in WEIGHT_ARGUMENTS if key in arguments]
    if given:
        raise ConfigError(
            f"{name} takes its weights from your file only: drop the argument(s) {', '.join(given)}"
        )
    zoo, model_name = split_architecture(name)
    try:
        if zoo == "timm":
            model = _timm().create_model(model_name, pretrained=False, **arguments)
        elif model_name in _torchvision_classes():
            model = _torchvision_classes()[model_name](**arguments)
        else:
            from torchvision import models

            model = models.get_model(model_name, weights=None, **arguments)
    except (TypeError, ValueError, RuntimeError, AssertionError, NotImplementedError) as error:
        raise ConfigError(
            one_line(f"{name} cannot be built with the arguments {dict(arguments)}: {error}")
        ) from error
    return model.eval()


@dataclass(frozen=True)
class InputDefaults:
    """What an architecture expects: image shape and normalization (for the zoo's usual channel
    count, which an ``in_chans`` argument may change), its eval transform's resize (the crop's
    fraction of the resized shorter side; None: a stretch) and interpolation, and where they
    come from."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str
    crop_pct: float | None = None
    interpolation: str = "bilinear"
    floor: bool = False  # timm floors size / crop_pct; torchvision's resize sizes are rounded

    def resize_to(self, size: int) -> int | None:
        """The shorter side to resize to before a centre crop of ``size``, the zoo's ratio kept;
        None when the zoo stretches."""
        if self.crop_pct is None:
            return None
        scaled = size / self.crop_pct
        return math.floor(scaled) if self.floor else round(scaled)


def _torchvision_defaults(model_name: str) -> InputDefaults:
    from torchvision import models

    source = f"the default weights of torchvision {model_name}"
    try:
        preset = models.get_model_weights(model_name).DEFAULT.transforms()
        size = int(preset.crop_size[0])
        mean, std = tuple(preset.mean), tuple(preset.std)
        crop_pct = size / int(preset.resize_size[0])
        interpolation = str(preset.interpolation.value)
    except (AttributeError, KeyError, ValueError, TypeError, IndexError, ZeroDivisionError):
        size, mean, std = IMAGENET_SIZE, IMAGENET_MEAN, IMAGENET_STD
        crop_pct, interpolation = IMAGENET_CROP_PCT, "bilinear"
        source = "ImageNet's (torchvision's usual)"
    return InputDefaults(len(mean), size, size, mean, std, source, crop_pct, interpolation)


def _timm_defaults(model: nn.Module, model_name: str) -> InputDefaults:
    config = _timm().data.resolve_model_data_config(model)
    channels, height, width = (int(v) for v in config["input_size"])
    # only timm's "center" crop mode is a resize of the shorter side then a centre crop
    centred = config.get("crop_mode", "center") == "center" and config.get("crop_pct")
    return InputDefaults(
        channels,
        height,
        width,
        tuple(float(v) for v in config["mean"]),
        tuple(float(v) for v in config["std"]),
        f"timm's data config of {model_name}",
        crop_pct=float(config["crop_pct"]) if centred else None,
        interpolation=str(config.get("interpolation", "bilinear")),
        floor=True,
    )


def _argument_size(arguments: Mapping[str, Any]) -> tuple[int, int] | None:
    for key in ("image_size", "img_size"):
        value = arguments.get(key)
        if isinstance(value, int):
            return value, value
        if isinstance(value, list | tuple) and len(value) == 2:
            return int(value[0]), int(value[1])
    return None


def input_defaults(name: str, model: nn.Module, arguments: Mapping[str, Any]) -> InputDefaults:
    """The input shape and normalization ``model`` (built as ``name`` with ``arguments``) expects
    by default; an ``image_size``/``img_size`` or ``in_chans`` argument overrides the zoo's."""
    zoo, model_name = split_architecture(name)
    found = (
        _timm_defaults(model, model_name) if zoo == "timm" else _torchvision_defaults(model_name)
    )
    size = _argument_size(arguments)
    if size is not None:
        found = replace(found, height=size[0], width=size[1])
    channels = arguments.get("in_chans")
    if isinstance(channels, int):
        found = replace(found, channels=channels)
    return found
