"""A user's own torchvision/timm classifier and weights file made into a network directory
(``model.safetensors`` + ``config.json``) that :func:`detector.networks.load` rebuilds, so
attacks, features, detectors, bundles and the server take it unchanged. No retraining.

Everything is checked before anything is written: the weights must fit the architecture, the taps
must exist, the network must run on images of its input spec, and the network reloaded from the
staged directory must give the logits of the model built from the user's file. Only then does the
staged directory move to its place.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ValidationError
from torch import nn

from detector import networks, zoo
from detector.block_taps import residual_taps
from detector.errors import ArtefactError, ConfigError, one_line, validation_problems
from detector.networks import ImportedNetwork, InputSpec, NetworkConfig
from detector.user_weights import State, classifier_width, load_weights, read_state_dict

CHECK_BATCH = 4
CHECK_SEED = 0


@dataclass(frozen=True)
class ImportRequest:
    """What ``lapguard import`` was asked: the architecture (``torchvision:NAME``/``timm:NAME``)
    and its builder's ``arguments``, the weights file, the output directory, and optionally the
    input spec, the classes and tap name patterns (None: the architecture's defaults, the
    weights' class count, the known taps of its blocks). ``resize_to`` and ``crop`` set how
    uploads of another size are resized (:class:`InputSpec`): ``crop="none"`` stretches, a
    ``resize_to`` alone crops the centre; None: the architecture's eval transform."""

    architecture: str
    weights: Path
    out: Path
    arguments: Mapping[str, Any] = field(default_factory=dict)
    channels: int | None = None
    size: tuple[int, int] | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    class_names: tuple[str, ...] | None = None
    num_classes: int | None = None
    taps: tuple[str, ...] | None = None
    resize_to: int | None = None
    crop: Literal["center", "none"] | None = None


@dataclass(frozen=True)
class ImportResult:
    """The network directory written, its config, and the defaults chosen for what was not given."""

    directory: Path
    config: NetworkConfig
    chosen: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """A summary: architecture, classes, input spec, taps."""
        config, spec = self.config, self.config.input_spec
        names = config.class_names
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        taps = config.taps or []
        return [
            *self.chosen,
            f"imported {config.architecture} into {self.directory}",
            f"  classes  {config.num_classes}: {shown}",
            f"  input    {spec.channels}x{spec.height}x{spec.width} in {list(spec.value_range)}, "
            f"mean {spec.mean}, std {spec.std}",
            f"  resize   {spec.describe_resize()}",
            f"  taps     {len(taps)} residual taps: {taps[0]} ... {taps[-1]}",
            "  check    the reloaded network gives the logits of the weights file",
        ]


def import_network(request: ImportRequest) -> ImportResult:
    """Write ``request.out`` from the user's architecture and weights file (see the module's note);
    on any error nothing is written."""
    out = _free_directory(Path(request.out))
    if not zoo.is_zoo_architecture(request.architecture):
        raise ConfigError(
            f"import takes torchvision:NAME or timm:NAME (e.g. torchvision:resnet18), "
            f"got {request.architecture!r}"
        )
    zoo.check_architecture(request.architecture)
    state = read_state_dict(request.weights)
    model, class_names = _model_and_classes(request, state)
    load_weights(model, state, what=f"the weights of {request.weights} and {request.architecture}")
    spec, chosen = _input_spec(request, model)
    taps = residual_taps(model, request.taps)
    config = _config(request, class_names, spec, taps)
    network = ImportedNetwork(model, mean=spec.mean, std=spec.std, taps=taps)
    network.config = config
    expected, x = _reference_logits(model, config)
    _write_checked(network, x, expected, out)
    return ImportResult(out, config, tuple(chosen))


def _free_directory(out: Path) -> Path:
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty: give a new --out directory")
    return out


def _class_count(request: ImportRequest) -> int | None:
    """The class count the request gives (--classes, --num-classes, --arg num_classes), if any."""
    given = {
        "--classes": len(request.class_names) if request.class_names else None,
        "--num-classes": request.num_classes,
        "num_classes argument": request.arguments.get("num_classes"),
    }
    counts = {value for value in given.values() if value is not None}
    if len(counts) > 1:
        said = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None)
        raise ConfigError(f"the class counts disagree: {said}")
    count = counts.pop() if counts else None
    if count is not None and (not isinstance(count, int) or count < 1):
        raise ConfigError(f"the number of classes must be a positive integer, got {count!r}")
    return count


def _model_and_classes(request: ImportRequest, state: State) -> tuple[nn.Module, list[str]]:
    """The untrained model for the weights, and the class names (default "0".."N-1", N from the
    weights' last linear layer when the request does not say)."""
    arguments = dict(request.arguments)
    count = _class_count(request)
    if count is not None:
        arguments["num_classes"] = count
    model = zoo.build_zoo_model(request.architecture, arguments)
    if count is None:
        count = classifier_width(model, state)
        if count is None:
            raise ConfigError(
                f"cannot tell the number of classes from {request.weights} (no weight of "
                f"{request.architecture}'s last linear layer): give --num-classes N or --classes"
            )
        if count != classifier_width(model, model.state_dict()):
            model = zoo.build_zoo_model(request.architecture, {**arguments, "num_classes": count})
    names = list(request.class_names) if request.class_names else [str(i) for i in range(count)]
    return model, names


def _per_channel(values: Sequence[float], channels: int) -> tuple[float, ...]:
    """The zoo's per-channel constants for ``channels`` channels (their mean when counts differ)."""
    if len(values) == channels:
        return tuple(values)
    return (sum(values) / len(values),) * channels


def _input_spec(request: ImportRequest, model: nn.Module) -> tuple[InputSpec, list[str]]:
    """The input spec: what the request gives, the architecture's defaults for the rest (and
    a line saying which defaults were chosen)."""
    found = zoo.input_defaults(request.architecture, model, request.arguments)
    channels = request.channels if request.channels is not None else found.channels
    height, width = request.size if request.size is not None else (found.height, found.width)
    mean = request.mean if request.mean is not None else _per_channel(found.mean, channels)
    std = request.std if request.std is not None else _per_channel(found.std, channels)
    try:
        spec = InputSpec(
            channels=channels, height=height, width=width, mean=list(mean), std=list(std)
        )
    except ValidationError as error:
        problems = validation_problems(error.errors(), what="mean/std")
        raise ConfigError(f"bad input spec: {problems}") from error
    spec = _with_resize_policy(spec, request, found)
    defaulted = [
        text
        for text, given in (
            (f"channels {channels}", request.channels),
            (f"size {height}x{width}", request.size),
            (f"mean {list(mean)}", request.mean),
            (f"std {list(std)}", request.std),
            (f"resize {spec.describe_resize()}", request.crop or request.resize_to),
        )
        if given is None
    ]
    chosen = [f"not given, so from {found.source}: {', '.join(defaulted)}"] if defaulted else []
    return spec, chosen


def _with_resize_policy(
    spec: InputSpec, request: ImportRequest, found: zoo.InputDefaults
) -> InputSpec:
    """``spec`` with the request's resize policy, the architecture's eval transform for what the
    request leaves out (its crop fraction kept at the chosen size)."""
    crop = request.crop or ("center" if request.resize_to is not None else None)
    resize_to = request.resize_to
    if crop is None:
        resize_to = found.resize_to(max(spec.height, spec.width))
        crop = "center" if resize_to is not None else "none"
    elif crop == "center" and resize_to is None:
        resize_to = found.resize_to(max(spec.height, spec.width)) or max(spec.height, spec.width)
    elif crop == "none" and resize_to is not None:
        raise ConfigError("--resize-to resizes before a centre crop: drop it or give --crop center")
    policy = {
        "resize_to": resize_to if crop == "center" else None,
        "crop": "center" if crop == "center" else None,
        "interpolation": "bicubic" if found.interpolation == "bicubic" else None,
    }
    try:
        return InputSpec.model_validate({**spec.model_dump(), **policy})
    except ValidationError as error:
        problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in error.errors())
        raise ConfigError(f"bad resize policy (--resize-to/--crop): {problems}") from error


def _config(
    request: ImportRequest, class_names: list[str], spec: InputSpec, taps: list[str]
) -> NetworkConfig:
    arguments = {k: v for k, v in request.arguments.items() if k != "num_classes"}
    try:
        return NetworkConfig(
            architecture=request.architecture,
            arguments=arguments,
            class_names=class_names,
            input_spec=spec,
            taps=taps,
        )
    except ValidationError as error:
        raise ConfigError(one_line(validation_problems(error.errors()))) from error


def _reference_logits(model: nn.Module, config: NetworkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the model built from the user's file on a seeded random batch in the input
    spec's value range, normalized by hand, and that batch; ConfigError if it does not run."""
    spec = config.input_spec
    low, high = spec.value_range
    generator = torch.Generator().manual_seed(CHECK_SEED)
    x = low + (high - low) * torch.rand(CHECK_BATCH, *spec.shape, generator=generator)
    mean = torch.tensor(spec.mean).view(1, -1, 1, 1)
    std = torch.tensor(spec.std).view(1, -1, 1, 1)
    try:
        with torch.no_grad():
            logits = model.eval()((x - mean) / std)
    except (RuntimeError, ValueError, AssertionError) as error:
        raise ConfigError(
            one_line(
                f"{config.architecture} does not run on {spec.channels}x{spec.height}x"
                f"{spec.width} images ({error}): check --channels/--input-size or the "
                "architecture's arguments (e.g. image_size)"
            )
        ) from error
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (
        CHECK_BATCH,
        config.num_classes,
    ):
        raise ConfigError(
            f"{config.architecture} does not return [batch, {config.num_classes}] logits"
        )
    return logits, x


def _nearest_existing(folder: Path) -> Path:
    folder = folder.absolute()
    while not folder.is_dir():
        folder = folder.parent
    return folder


def _write_checked(
    network: ImportedNetwork, x: torch.Tensor, expected: torch.Tensor, out: Path
) -> None:
    """Save into a staging directory beside ``out``, check that the reloaded network gives
    ``expected`` on ``x``, then move the directory to ``out``."""
    with tempfile.TemporaryDirectory(
        prefix=".lapguard-import-", dir=_nearest_existing(out.parent)
    ) as scratch:
        staged = Path(scratch) / "network"
        networks.save(network, staged)
        with torch.no_grad():
            got = networks.load(staged)(x)
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            difference = float((got - expected).abs().max())
            raise ArtefactError(
                f"the network reloaded from its directory gives other logits than the weights "
                f"file (max difference {difference:.3g}); nothing written"
            )
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.is_dir():
            out.rmdir()  # empty (checked first)
        shutil.move(str(staged), str(out))
