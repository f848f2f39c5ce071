"""Observable residual networks: one forward pass gives the logits and, through stable taps,
every block's residual r_m(x_m).

Every block applies ``x_{m+1} = shortcut(x_m) + h * residual(branch(x_m))`` where ``residual`` is an
``nn.Identity`` tap: a forward hook on it sees r_m(x_m) without a second forward implementation.
Networks take images in their value range (default [0, 1]) and normalize inside, so attacks,
clip values and the service all work in pixel space.

Architectures are looked up by name (:func:`get_model`, :func:`list_models`); weights travel as
``model.safetensors`` + ``config.json`` and come back through :func:`load` alone. A classifier
from torchvision or timm (``torchvision:NAME``, ``timm:NAME``, :mod:`detector.zoo`) comes back
as an :class:`ImportedNetwork`: the same normalization inside, residual taps named in its config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeAlias

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from detector import zoo
from detector.artefacts import atomic_path, read_model, write_text
from detector.block_taps import residual_taps
from detector.errors import ArtefactError, ConfigError

WEIGHTS_FILE = "model.safetensors"
#: Set on a recorder hook that keeps the tensor it sees (not only a reduction of it).
KEEPS_TENSOR = "keeps_tensor"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------------------------
# Configs that travel with the weights
# --------------------------------------------------------------------------------------------
Interpolation: TypeAlias = Literal["bilinear", "bicubic"]
#: The fields of the resize policy, written only when set (a spec without them reads as before).
RESIZE_POLICY = ("resize_to", "crop", "interpolation")


class InputSpec(BaseModel):
    """What images the network takes: shape, value range and the normalization it applies, and
    how an image of another size becomes the network's input.

    ``resize="convert"`` (the default) converts other sizes: with ``crop="center"`` as
    torchvision's eval transform ``Resize(resize_to)`` + ``CenterCrop((height, width))`` (the
    shorter side to ``resize_to``, aspect kept, then the centre); without a crop by stretching to
    (height, width). ``interpolation`` is that resize's (antialiased; default bilinear).
    ``resize="strict"`` refuses any other shape. An image already of the network's size is taken
    as it is.
    """

    model_config = ConfigDict(extra="forbid")

    channels: int = Field(ge=1, le=4)
    height: int = Field(ge=1)
    width: int = Field(ge=1)
    value_range: tuple[float, float] = (0.0, 1.0)
    mean: list[float]
    std: list[float]
    # How a server treats images of another size/channel count: convert them, or refuse them.
    resize: Literal["convert", "strict"] = "convert"
    resize_to: int | None = Field(default=None, ge=1)
    crop: Literal["center"] | None = None
    interpolation: Interpolation | None = None

    @model_validator(mode="after")
    def _check_resize_policy(self) -> InputSpec:
        given = [name for name in RESIZE_POLICY if getattr(self, name) is not None]
        if self.resize == "strict" and given:
            raise ValueError(f"a strict input spec resizes nothing: drop {', '.join(given)}")
        if (self.resize_to is None) != (self.crop is None):
            raise ValueError(
                "resize_to and crop go together: the shorter side is resized to resize_to, then "
                'cropped at the center (crop "center")'
            )
        if self.resize_to is not None and self.resize_to < max(self.height, self.width):
            raise ValueError(
                f"resize_to {self.resize_to} is smaller than the {self.height}x{self.width} crop: "
                f"the shorter side must be at least {max(self.height, self.width)}"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unset_policy(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The resize policy is written only when set, so the specs of networks without one (and
        the configs, manifests and fingerprints that hold them) read as they always have."""
        data: dict[str, Any] = handler(self)
        for name in RESIZE_POLICY:
            if data.get(name, []) is None:
                del data[name]
        return data

    def describe_resize(self) -> str:
        """How an image of another size becomes the input, in words."""
        size = f"{self.height}x{self.width}"
        how = f"antialiased {self.interpolation or 'bilinear'}"
        if self.resize == "strict":
            return f"only {size} images (strict)"
        if self.crop == "center":
            return f"shorter side to {self.resize_to} then centre crop {size} ({how})"
        return f"stretch to {size} ({how})"

    @model_validator(mode="after")
    def _check_normalization(self) -> InputSpec:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(
                f"mean and std need one value per channel ({self.channels}), "
                f"got {len(self.mean)} and {len(self.std)}"
            )
        if not all(math.isfinite(v) for v in (*self.value_range, *self.mean, *self.std)):
            raise ValueError("value_range, mean and std must be finite numbers")
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be positive")
        if self.value_range[0] >= self.value_range[1]:
            raise ValueError("value_range must be (low, high) with low < high")
        return self

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.channels, self.height, self.width)


class NetworkConfig(BaseModel):
    """Everything needed to rebuild a network from its weights file.

    ``taps`` belongs to imported networks (``torchvision:NAME``/``timm:NAME``): the module names,
    inside the torchvision/timm model (the names of its own state dict), whose outputs are the
    residual branches, in depth order; None means the known taps of its blocks
    (:mod:`detector.block_taps`). Our networks name their own taps and leave it None.
    """

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    architecture: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    class_names: list[str]
    input_spec: InputSpec
    taps: list[str] | None = None

    @field_validator("format_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != FORMAT_VERSION:
            raise ValueError(
                f"unknown network format version {value} (this lapguard reads {FORMAT_VERSION})"
            )
        return value

    @field_validator("architecture")
    @classmethod
    def _registered(cls, value: str) -> str:
        if zoo.is_zoo_architecture(value):
            zoo.check_architecture(value)
        elif value not in _MODELS:
            raise ValueError(
                f"unknown architecture {value!r}; registered: {', '.join(list_models())} "
                "(or torchvision:NAME, timm:NAME)"
            )
        return value

    @model_validator(mode="after")
    def _check_imported(self) -> NetworkConfig:
        if self.taps is not None and not zoo.is_zoo_architecture(self.architecture):
            raise ValueError("taps are stored for torchvision:/timm: networks only")
        if self.taps is not None and not self.taps:
            raise ValueError("taps must name at least one module (or be null)")
        given = self.arguments.get("num_classes", self.num_classes)
        if zoo.is_zoo_architecture(self.architecture) and given != self.num_classes:
            raise ValueError(
                f"arguments.num_classes is {given} but there are {self.num_classes} class names"
            )
        return self

    @model_serializer(mode="wrap")
    def _without_unset_taps(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``taps`` is written only when set, so the configs of our own networks (and the
        manifests and fingerprints that hold them) read as they always have."""
        data: dict[str, Any] = handler(self)
        if data.get("taps", []) is None:
            del data["taps"]
        return data

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
class Normalize(nn.Module):
    """(x - mean) / std per channel, with the constants stored as buffers (they travel with the weights)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], *, persistent: bool = True
    ) -> None:
        super().__init__()
        for name, values in (("mean", mean), ("std", std)):
            constants = torch.tensor(list(values), dtype=torch.float32).view(1, -1, 1, 1)
            self.register_buffer(name, constants, persistent=persistent)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class ResidualBlock(nn.Module):
    """x -> shortcut(x) + h * residual(branch(x)), optionally followed by an activation.

    ``residual`` is the tap: an identity whose forward hook sees r(x) before the step size h.
    ``post_activation`` gives ResNeXt-style blocks, x -> relu(shortcut(x) + h r(x));
    ``skip=False`` drops the shortcut (a plain, skip-free block x -> h r(x)).
    """

    def __init__(
        self,
        branch: nn.Module,
        *,
        h: float = 1.0,
        shortcut: nn.Module | None = None,
        post_activation: bool = False,
        skip: bool = True,
    ) -> None:
        super().__init__()
        self.branch = branch
        self.residual = nn.Identity()
        self.shortcut = shortcut if shortcut is not None else nn.Identity()
        self.h = h
        self.activation: nn.Module = nn.ReLU(inplace=False) if post_activation else nn.Identity()
        # skip=False gives the plain block x -> h * branch(x) (seed 001: "removing the identity
        # maps"); the tap still sees the branch output.
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.skip:
            return self.activation(self.h * self.residual(self.branch(x)))
        return self.activation(self.shortcut(x) + self.h * self.residual(self.branch(x)))


class ObservableResNet(nn.Module):
    """normalize -> stem -> residual blocks -> head. Residual taps are ``blocks.{m}.residual``."""

    def __init__(
        self,
        *,
        stem: nn.Module,
        blocks: Sequence[ResidualBlock],
        head: nn.Module,
        mean: Sequence[float],
        std: Sequence[float],
        negate_logits: bool = False,
    ) -> None:
        super().__init__()
        self.normalize = Normalize(mean, std)
        self.stem = stem
        self.blocks = nn.Sequential(*blocks)
        self.head = head
        # RCE networks predict with the negated logits (Pang et al. 2018); we return those, so
        # every consumer (attacks, detectors, service) sees ordinary "higher = more likely" logits.
        self.negate_logits = negate_logits
        self.config: NetworkConfig | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.stem(self.normalize(x))))
        return -logits if self.negate_logits else logits

    def tap_names(self) -> list[str]:
        """Names of the residual taps, in depth order."""
        return [f"blocks.{m}.residual" for m in range(len(self.blocks))]


class ImportedNetwork(nn.Module):
    """A torchvision/timm classifier made observable: it normalizes inside (images arrive in the
    input spec's value range) and names its residual taps (``model.<tap>``).

    Its state dict is the wrapped model's own, keys unprefixed (those of the user's file): the
    normalization constants come from the config, and hooks drop the ``model.`` prefix on
    ``state_dict`` and add it back on ``load_state_dict``. While something records a tap
    (:class:`detector.taps.Taps`), the tap's output goes on into its block as a copy: torchvision
    and timm ResNets add the shortcut in place (``out += identity``), which would otherwise change
    the recorded residual and break gradients through it.
    """

    def __init__(
        self, model: nn.Module, *, mean: Sequence[float], std: Sequence[float], taps: Sequence[str]
    ) -> None:
        super().__init__()
        self.normalize = Normalize(mean, std, persistent=False)
        self.model = model
        modules = dict(model.named_modules())
        missing = [name for name in taps if name not in modules]
        if missing or not taps:
            raise ConfigError(
                f"tap modules not found in {type(model).__name__}: {', '.join(missing) or 'none given'}"
            )
        self.taps = list(taps)
        self.config: NetworkConfig | None = None
        self._register_state_dict_hook(_drop_model_prefix)
        self._register_load_state_dict_pre_hook(_add_model_prefix)
        for name in self.taps:
            modules[name].register_forward_hook(_copy_when_recorded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(self.normalize(x))

    def tap_names(self) -> list[str]:
        """Names of the residual taps, in depth order."""
        return [f"model.{name}" for name in self.taps]


def _copy_when_recorded(module: nn.Module, _inputs: Any, output: Any) -> Any:
    """Forward hook of a tap: hand a copy on when another hook (a recorder, which runs first)
    saw the output and either keeps it or gradients flow through what it computed from it, so
    that in-place work after the tap leaves the recorded tensor alone. A recorder that reduced
    the output at once, without gradients (the Guard's pass), needs no copy."""
    if not isinstance(output, torch.Tensor) or len(module._forward_hooks) < 2:
        return None
    keeps = any(getattr(hook, KEEPS_TENSOR, False) for hook in module._forward_hooks.values())
    return output.clone() if keeps or torch.is_grad_enabled() else None


def _drop_model_prefix(
    module: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any
) -> None:
    """State-dict hook: ``{prefix}model.k`` -> ``{prefix}k`` (the wrapped model's own keys)."""
    inner = f"{prefix}model."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _add_model_prefix(state: dict[str, Any], prefix: str, *_args: Any) -> None:
    """Load pre-hook: every ``{prefix}k`` -> ``{prefix}model.k`` (the inverse of the above)."""
    for key in [k for k in state if k.startswith(prefix)]:
        state[f"{prefix}model.{key[len(prefix) :]}"] = state.pop(key)


Network: TypeAlias = ObservableResNet | ImportedNetwork


class Unitization(nn.Module):
    """Batch normalization with the unitization of seed 004 embedded (Algorithms 1 and 2).

    Per sample: x_hat = BN(x) without its affine step (lines 1-4 of Algorithm 1, line 5 of
    Algorithm 2), p = 1 / sqrt(s + eps) with s = ||x_hat||^2 for [N, C] inputs (Algorithm 1,
    line 5) or s = ||x_hat||^2 / (n H W) for [N, C, H, W] inputs (Algorithm 2, lines 6-10;
    ``norm_divisor`` is the seed's n, H*W by default), then x_bar = [p alpha + (1 - alpha)] x_hat
    (eq. 10; Algorithm 1 line 6, Algorithm 2 line 13) and y = gamma x_bar + beta.

    ``alpha`` (one per channel) is trainable and starts at 0, as in the seed's experiments, so a
    fresh layer computes exactly what ``BatchNorm`` computes; it is not clamped (the seed's
    interpolation, eq. 10, is how it avoids constrained training). With alpha = 1, gamma = 1,
    beta = 0 every output has norm below 1 ([N, C]) or sqrt(n H W) ([N, C, H, W]), which bounds the
    EM distance between any two output distributions by twice that (Theorem 3.1).
    Running moments are kept as BatchNorm keeps them, so inference uses them just as BN does.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        num_features: int,
        *,
        spatial: bool = True,
        eps: float = 1e-5,
        momentum: float = 0.1,
        norm_divisor: float | None = None,
    ) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(num_features))
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        # BatchNorm's running moments, kept here (not in an affine-free BatchNorm child) so that
        # code initializing every BatchNorm's weight and bias leaves this layer alone.
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self.spatial = spatial
        self.eps = eps
        self.momentum = momentum
        self.norm_divisor = norm_divisor

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x_hat = BN(x) without the affine step: batch moments in training (updating the running
        ones), running moments in eval, exactly as ``BatchNorm`` does."""
        if self.training:
            self.num_batches_tracked.add_(1)
        return F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            None,
            None,
            self.training,
            self.momentum,
            self.eps,
        )

    def inverse_norm(self, x_hat: torch.Tensor) -> torch.Tensor:
        """p of Algorithm 1 (line 5) / Algorithm 2 (lines 6-10), one value per sample: [N]."""
        squares = x_hat.flatten(1).square().sum(1)
        if self.spatial:
            pixels = x_hat.shape[-2] * x_hat.shape[-1]
            n = self.norm_divisor if self.norm_divisor is not None else pixels
            squares = squares / (n * pixels)
        return torch.rsqrt(squares + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_hat = self.normalize(x)
        per_sample = (-1,) + (1,) * (x.ndim - 1)
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        p = self.inverse_norm(x_hat).view(per_sample)
        alpha = self.alpha.view(per_channel)
        x_bar = (p * alpha + (1 - alpha)) * x_hat
        return self.weight.view(per_channel) * x_bar + self.bias.view(per_channel)


NormKind = Literal["batch", "unit"]
NORM_KINDS: tuple[str, ...] = ("batch", "unit")


def norm_layer(kind: NormKind, channels: int, *, spatial: bool = True) -> nn.Module:
    """The normalization a builder asked for: ``batch`` (BatchNorm) or ``unit`` (:class:`Unitization`)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels) if spatial else nn.BatchNorm1d(channels)
    if kind == "unit":
        return Unitization(channels, spatial=spatial)
    raise ConfigError(f"unknown normalization {kind!r}; choose one of: {', '.join(NORM_KINDS)}")


def _conv_bn(
    cin: int,
    cout: int,
    *,
    stride: int = 1,
    groups: int = 1,
    kernel: int = 3,
    norm: NormKind = "batch",
) -> list[nn.Module]:
    return [
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        norm_layer(norm, cout),
    ]


# --------------------------------------------------------------------------------------------
# Registry (modelled on torchvision.models: keyword-only builders looked up by name)
# --------------------------------------------------------------------------------------------
Builder = Callable[..., ObservableResNet]
_MODELS: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator that registers a keyword-only network builder under ``name``."""

    def wrap(builder: Builder) -> Builder:
        if name in _MODELS:
            raise ValueError(f"architecture {name!r} is registered twice")
        _MODELS[name] = builder
        return builder

    return wrap


def list_models() -> list[str]:
    """Names of every registered architecture."""
    return sorted(_MODELS)


def get_model(name: str, **kwargs: Any) -> ObservableResNet:
    """Build the registered architecture ``name`` with keyword arguments."""
    if name not in _MODELS:
        raise ConfigError(f"unknown architecture {name!r}; registered: {', '.join(list_models())}")
    try:
        return _MODELS[name](**kwargs)
    except TypeError as error:
        raise ConfigError(f"bad arguments for architecture {name!r}: {error}") from error


@register_model("resnet9_mnist")
def resnet9_mnist(
    *,
    num_classes: int = 10,
    in_channels: int = 1,
    mean: Sequence[float] = (0.2860,),
    std: Sequence[float] = (0.3530,),
    width: int = 32,
    depth: int = 9,
    hidden: int = 32,
    input_size: int = 28,
    h: float = 1.0,
    negate_logits: bool = False,
    norm: NormKind = "batch",
    skip: bool = True,
) -> ObservableResNet:
    """The seed's MNIST/Fashion-MNIST network: two convs encode CxSxS into width x S/2 x S/2,
    ``depth`` residual blocks (conv-BN-ReLU-conv-BN), classifier FC-BN-ReLU-FC.

    ``norm="unit"`` puts :class:`Unitization` (seed 004) wherever BatchNorm would be;
    ``skip=False`` builds the plain (skip-free) twin, x_{m+1} = h * branch(x_m) (seed 001).
    """
    stem = nn.Sequential(
        *_conv_bn(in_channels, width, norm=norm),
        nn.ReLU(),
        *_conv_bn(width, width, stride=2, norm=norm),
        nn.ReLU(),
    )
    blocks = [
        ResidualBlock(
            nn.Sequential(
                *_conv_bn(width, width, norm=norm), nn.ReLU(), *_conv_bn(width, width, norm=norm)
            ),
            h=h,
            skip=skip,
        )
        for _ in range(depth)
    ]
    side = (input_size + 1) // 2
    head = nn.Sequential(
        nn.Flatten(),
        nn.Linear(width * side * side, hidden),
        norm_layer(norm, hidden, spatial=False),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )
    return ObservableResNet(
        stem=stem, blocks=blocks, head=head, mean=mean, std=std, negate_logits=negate_logits
    )


def _preact_basic(
    cin: int, cout: int, stride: int, *, h: float, dropout: float = 0.0, norm: NormKind = "batch"
) -> ResidualBlock:
    layers: list[nn.Module] = [
        norm_layer(norm, cin),
        nn.ReLU(),
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        norm_layer(norm, cout),
        nn.ReLU(),
    ]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Conv2d(cout, cout, 3, padding=1, bias=False))
    shortcut = None
    if stride != 1 or cin != cout:
        shortcut = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
    return ResidualBlock(nn.Sequential(*layers), h=h, shortcut=shortcut)


def _preact_network(
    *,
    widths: Sequence[int],
    blocks_per_stage: int,
    num_classes: int,
    in_channels: int,
    mean: Sequence[float],
    std: Sequence[float],
    h: float,
    dropout: float,
    stem_width: int,
    negate_logits: bool,
    norm: NormKind,
) -> ObservableResNet:
    stem = nn.Conv2d(in_channels, stem_width, 3, padding=1, bias=False)
    blocks: list[ResidualBlock] = []
    cin = stem_width
    for stage, cout in enumerate(widths):
        for b in range(blocks_per_stage):
            stride = 2 if (stage > 0 and b == 0) else 1
            blocks.append(_preact_basic(cin, cout, stride, h=h, dropout=dropout, norm=norm))
            cin = cout
    head = nn.Sequential(
        norm_layer(norm, cin),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(cin, num_classes),
    )
    return ObservableResNet(
        stem=stem, blocks=blocks, head=head, mean=mean, std=std, negate_logits=negate_logits
    )


@register_model("resnet110")
def resnet110(
    *,
    num_classes: int = 10,
    in_channels: int = 3,
    mean: Sequence[float] = (0.4914, 0.4822, 0.4465),
    std: Sequence[float] = (0.2470, 0.2435, 0.2616),
    depth: int = 110,
    base_width: int = 16,
    h: float = 1.0,
    negate_logits: bool = False,
    norm: NormKind = "batch",
) -> ObservableResNet:
    """CIFAR pre-activation ResNet (He et al. 2016b): 3 stages of (depth-2)/6 basic blocks.
    ``norm="unit"`` uses :class:`Unitization` (seed 004's ResNet-20/110 set-up)."""
    if (depth - 2) % 6 != 0 or depth < 8:
        raise ConfigError(f"resnet110 depth must be 6n+2 (e.g. 20, 56, 110), got {depth}")
    return _preact_network(
        widths=[base_width, 2 * base_width, 4 * base_width],
        blocks_per_stage=(depth - 2) // 6,
        num_classes=num_classes,
        in_channels=in_channels,
        mean=mean,
        std=std,
        h=h,
        dropout=0.0,
        stem_width=base_width,
        negate_logits=negate_logits,
        norm=norm,
    )


@register_model("wide_resnet")
def wide_resnet(
    *,
    num_classes: int = 200,
    in_channels: int = 3,
    mean: Sequence[float] = (0.4802, 0.4481, 0.3975),
    std: Sequence[float] = (0.2770, 0.2691, 0.2821),
    depth: int = 16,
    widen_factor: int = 4,
    dropout: float = 0.0,
    h: float = 1.0,
    negate_logits: bool = False,
    norm: NormKind = "batch",
) -> ObservableResNet:
    """Wide ResNet (Zagoruyko & Komodakis 2016), pre-activation, 3 stages of (depth-4)/6 blocks."""
    if (depth - 4) % 6 != 0 or depth < 10:
        raise ConfigError(f"wide_resnet depth must be 6n+4 (e.g. 16, 28), got {depth}")
    return _preact_network(
        widths=[16 * widen_factor, 32 * widen_factor, 64 * widen_factor],
        blocks_per_stage=(depth - 4) // 6,
        num_classes=num_classes,
        in_channels=in_channels,
        mean=mean,
        std=std,
        h=h,
        dropout=dropout,
        stem_width=16,
        negate_logits=negate_logits,
        norm=norm,
    )


def _resnext_bottleneck(
    cin: int,
    cout: int,
    stride: int,
    *,
    cardinality: int,
    group_width: int,
    h: float,
    norm: NormKind = "batch",
) -> ResidualBlock:
    inner = cardinality * group_width
    branch = nn.Sequential(
        *_conv_bn(cin, inner, kernel=1, norm=norm),
        nn.ReLU(),
        *_conv_bn(inner, inner, stride=stride, groups=cardinality, norm=norm),
        nn.ReLU(),
        *_conv_bn(inner, cout, kernel=1, norm=norm),
    )
    shortcut = None
    if stride != 1 or cin != cout:
        shortcut = nn.Sequential(*_conv_bn(cin, cout, stride=stride, kernel=1, norm=norm))
    return ResidualBlock(branch, h=h, shortcut=shortcut, post_activation=True)


@register_model("resnext50")
def resnext50(
    *,
    num_classes: int = 100,
    in_channels: int = 3,
    mean: Sequence[float] = (0.5071, 0.4865, 0.4409),
    std: Sequence[float] = (0.2673, 0.2564, 0.2762),
    layers: Sequence[int] = (3, 4, 6, 3),
    cardinality: int = 32,
    group_width: int = 4,
    base_width: int = 64,
    h: float = 1.0,
    negate_logits: bool = False,
    norm: NormKind = "batch",
) -> ObservableResNet:
    """CIFAR-style ResNeXt-50 (32x4d): 3x3 stem without max-pool, post-activation bottlenecks."""
    stem = nn.Sequential(*_conv_bn(in_channels, base_width, norm=norm), nn.ReLU())
    blocks: list[ResidualBlock] = []
    cin = base_width
    for stage, count in enumerate(layers):
        cout = base_width * 4 * (2**stage)
        width = group_width * (2**stage)
        for b in range(count):
            stride = 2 if (stage > 0 and b == 0) else 1
            blocks.append(
                _resnext_bottleneck(
                    cin, cout, stride, cardinality=cardinality, group_width=width, h=h, norm=norm
                )
            )
            cin = cout
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
    return ObservableResNet(
        stem=stem, blocks=blocks, head=head, mean=mean, std=std, negate_logits=negate_logits
    )


# --------------------------------------------------------------------------------------------
# Building from a config, saving and loading
# --------------------------------------------------------------------------------------------
def build_network(config: NetworkConfig) -> Network:
    """Build the (untrained) network a config describes; the config is attached as ``.config``."""
    spec = config.input_spec
    if zoo.is_zoo_architecture(config.architecture):
        return _build_imported(config)
    try:
        model = get_model(
            config.architecture,
            num_classes=config.num_classes,
            in_channels=spec.channels,
            mean=spec.mean,
            std=spec.std,
            **config.arguments,
        )
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. a negative width
        raise ConfigError(
            f"architecture {config.architecture!r} cannot be built with the arguments "
            f"{config.arguments}: {error}"
        ) from error
    model.config = config
    return model


def _build_imported(config: NetworkConfig) -> ImportedNetwork:
    """The torchvision/timm network of ``config``, wrapped with its normalization and taps."""
    arguments = {"num_classes": config.num_classes, **config.arguments}
    model = zoo.build_zoo_model(config.architecture, arguments)
    spec = config.input_spec
    taps = config.taps if config.taps is not None else residual_taps(model)
    network = ImportedNetwork(model, mean=spec.mean, std=spec.std, taps=taps)
    network.config = config
    return network


def save(model: Network, directory: str | Path, config: NetworkConfig | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` into ``directory`` (created if needed)."""
    config = config or model.config
    if config is None:
        raise ConfigError(
            "save needs a NetworkConfig: pass one or build the model with build_network"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    with atomic_path(directory / WEIGHTS_FILE) as tmp:
        save_file(state, str(tmp), metadata={"architecture": config.architecture})
    write_text(directory / CONFIG_FILE, config.model_dump_json(indent=2))
    return directory


def read_config(directory: str | Path) -> NetworkConfig:
    """Read and validate ``config.json`` of a saved network."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ArtefactError(
            f"no network config at {path}: a saved network is a directory with {CONFIG_FILE} and {WEIGHTS_FILE}"
        )
    return read_model(path, NetworkConfig, what="network config")


def load(directory: str | Path, *, device: str | torch.device = "cpu") -> Network:
    """Load a network saved by :func:`save` from its directory alone, in eval mode."""
    directory = Path(directory)
    config = read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ArtefactError(f"no weights at {weights}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as error:
        raise ArtefactError(f"cannot read weights {weights}: {error}") from error
    model = build_network(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ArtefactError(
            f"weights {weights} do not match architecture {config.architecture}: {error}"
        ) from error
    return model.to(device).eval()


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} asked for but CUDA is not available; use --device cpu or auto"
        )
    return resolved
