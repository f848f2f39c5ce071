"""Transport features: for every residual block m, ( ||r_m||^2 / d_m , cos(r_m, 1) ) (seed 003, eq. 34).

They come from the SAME forward pass as the logits: a forward hook on each residual tap reduces
r_m to per-sample sums as soon as it is computed (two streaming reductions over the tensor, no
copy, no flatten of a non-contiguous tensor), so the residual itself is never kept:

    msq_m = sum(r^2) / d        cos_m = sum(r) / (||r|| * sqrt(d))     (0 when r = 0)

Optional extras (:class:`FeatureSpec`): cosines to further fixed +-1 directions (seeded, balanced
Rademacher signs, orthogonal to 1 and nearly orthogonal to each other); the same statistics of the
embeddings x_{m+1} (each block's output; seed 003 §5.3.1 allows embeddings as well as residues);
the line-shape score of the trajectory (seed 001, eq. 43-44); what enters the network (the input
image itself) and where the trajectory starts (x_0, the first block's input): for each, its msq and
cos and how its energy spreads over the image (:func:`spatial_statistics`); where it ends for
the classifier (head: top-1 minus top-2 logit margin, max softmax probability, log-sum-exp); the
input image's natural-scene statistics (the NSS baseline's 36, :mod:`detector.scene_statistics`);
and the penultimate embedding itself (the input of the network's last linear layer, scaled to unit
length: the representation deep nearest-neighbour OOD detection compares, Sun et al. 2022), the
last columns when asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from detector.errors import ConfigError, InputError
from detector.networks import resolve_device
from detector.opinion import OPINION_NAMES, second_opinion
from detector.scene_statistics import scene_statistic_names, scene_statistics
from detector.squeeze import SQUEEZE_NAMES, squeeze_distances
from detector.taps import ResidualTaps, Tap, Taps, default_tap_names

DIRECTION_SEED = 20240601
LINE_SHAPE = "line_shape"
HEAD_NAMES = ("head_margin", "head_maxprob", "head_logsumexp")
SPATIAL_NAMES = (
    "msq", "cos", "kurtosis", "roughness", "peak", "l1",
    "energy_q05", "energy_q25", "energy_q50", "spread_q10", "spread_q25", "spread_q50",
)  # fmt: skip
IMAGE_NAMES = tuple(f"image_{name}" for name in SPATIAL_NAMES)
START_NAMES = tuple(f"start_{name}" for name in SPATIAL_NAMES)
NSS_NAMES = tuple(f"nss_{name}" for name in scene_statistic_names())
PENULTIMATE_PREFIX = "pen_"
ENERGY_QUANTILES = (0.05, 0.25, 0.5)
#: Positions the spatial order statistics read at most (a strided grid beyond: 32x32 maps whole).
ORDER_POSITIONS = 1024
#: Elements per sample a residual's extra-direction cosines read at most (the leading ones).
DIRECTION_ELEMENTS = 1 << 17
SPREAD_QUANTILES = (0.1, 0.25, 0.5)


def _group_names(prefix: str, n_blocks: int, extra_directions: int) -> list[str]:
    names = [f"{prefix}{kind}_{m}" for m in range(n_blocks) for kind in ("msq", "cos")]
    return names + [
        f"{prefix}cos_{m}_dir{j}" for m in range(n_blocks) for j in range(1, extra_directions + 1)
    ]


def feature_names(
    n_blocks: int,
    *,
    extra_directions: int = 0,
    line_shape: bool = False,
    embeddings: bool = False,
    head: bool = False,
    start: bool = False,
    image: bool = False,
    squeeze: bool = False,
    second: bool = False,
    penultimate: int = 0,
    nss: bool = False,
) -> list[str]:
    """Column names, block-major: msq_0, cos_0, msq_1, cos_1, ..., cos_{m}_dir{j}; then with
    ``embeddings`` the same named emb_*; then line_shape; then the image_*, nss_*, start_*,
    head, squeeze_* and second_* columns; last, the ``penultimate`` embedding's pen_0, ..."""
    names = _group_names("", n_blocks, extra_directions)
    if embeddings:
        names += _group_names("emb_", n_blocks, extra_directions)
    if line_shape:
        names.append(LINE_SHAPE)
    if image:
        names += IMAGE_NAMES
    if nss:
        names += NSS_NAMES
    if start:
        names += START_NAMES
    if head:
        names += HEAD_NAMES
    if squeeze:
        names += SQUEEZE_NAMES
    if second:
        names += OPINION_NAMES
    names += [f"{PENULTIMATE_PREFIX}{i}" for i in range(penultimate)]
    return names


@dataclass(frozen=True)
class FeatureSpec:
    """How transport features are computed: which residual taps (None: the network's default
    ones), how many extra +-1 directions, and which groups are appended: the embeddings' statistics,
    the line-shape score, the input image's and the trajectory's start x_0's
    :func:`spatial_statistics`, the head's (logit margin, max probability, log-sum-exp), how
    far the softmax moves under :mod:`detector.squeeze`'s squeezers (a forward pass each), a
    second network's opinion of the prediction (:mod:`detector.opinion`; the extractor needs
    that network), the input image's natural-scene statistics (``nss``:
    :mod:`detector.scene_statistics`, what the NSS baseline reads), and, last, the
    ``penultimate`` embedding of that width (0: none; the extractor checks it against the
    network's last linear layer)."""

    taps: tuple[str, ...] | None = None
    extra_directions: int = 0
    line_shape: bool = False
    embeddings: bool = False
    head: bool = False
    start: bool = False
    image: bool = False
    squeeze: bool = False
    second: bool = False
    penultimate: int = 0
    nss: bool = False

    def __post_init__(self) -> None:
        if self.taps is not None and not isinstance(self.taps, tuple):
            object.__setattr__(self, "taps", tuple(self.taps))
        if self.extra_directions < 0:
            raise InputError(f"extra_directions must be >= 0, got {self.extra_directions}")
        if self.penultimate < 0:
            raise InputError(f"penultimate must be >= 0, got {self.penultimate}")

    def tap_names(self, model: nn.Module) -> list[str]:
        """The residual taps these features read on ``model`` (its default ones when None)."""
        return list(self.taps) if self.taps is not None else default_tap_names(model)

    def names(self, n_blocks: int) -> list[str]:
        """Column names of the features of a network with ``n_blocks`` taps."""
        return feature_names(
            n_blocks,
            extra_directions=self.extra_directions,
            line_shape=self.line_shape,
            embeddings=self.embeddings,
            head=self.head,
            start=self.start,
            image=self.image,
            squeeze=self.squeeze,
            second=self.second,
            penultimate=self.penultimate,
            nss=self.nss,
        )

    def label(self) -> str:
        """'residues', then '+emb', '+dir4', '+line', '+image', '+nss', '+start', '+head',
        '+squeeze', '+second', '+pen'."""
        parts = ["residues"]
        parts += ["emb"] if self.embeddings else []
        parts += [f"dir{self.extra_directions}"] if self.extra_directions else []
        parts += ["line"] if self.line_shape else []
        parts += ["image"] if self.image else []
        parts += ["nss"] if self.nss else []
        parts += ["start"] if self.start else []
        parts += ["head"] if self.head else []
        parts += ["squeeze"] if self.squeeze else []
        parts += ["second"] if self.second else []
        parts += ["pen"] if self.penultimate else []
        return "+".join(parts)


def embedding_tap(residual_tap: str) -> str:
    """The block whose output is the embedding x_{m+1}: the residual tap's parent module."""
    if "." not in residual_tap:
        raise ConfigError(
            f"residual tap {residual_tap!r} has no parent module: its block's output (the "
            "embedding) cannot be tapped; use FeatureSpec(embeddings=False)"
        )
    return residual_tap.rsplit(".", 1)[0]


def penultimate_tap(model: nn.Module) -> str:
    """The name of the network's last linear layer, whose input is the penultimate embedding."""
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not linear:
        raise ConfigError(
            f"{type(model).__name__} has no linear layer: it has no penultimate embedding"
        )
    return linear[-1]


def penultimate_width(model: nn.Module) -> int:
    """The width of the network's penultimate embedding (its last linear layer's inputs)."""
    return int(dict(model.named_modules())[penultimate_tap(model)].in_features)


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    """Each sample's values flattened and scaled to unit Euclidean length (0 stays 0), float32."""
    z = x.flatten(1).float()
    norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
    return z / torch.where(norm > 0, norm, torch.ones_like(norm))


def sign_directions(dim: int, count: int, *, seed: int = DIRECTION_SEED) -> torch.Tensor:
    """``count`` fixed +-1 vectors of length ``dim`` as a float32 [dim, count] CPU tensor.

    Each has as many +1 as -1 entries (so it is orthogonal to the ones vector when ``dim`` is
    even); they are seeded by (seed, dim), so every process draws the same directions.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + dim)
    signs = torch.ones(count, dim)
    signs[:, dim // 2 :] = -1.0
    for j in range(count):
        signs[j] = signs[j, torch.randperm(dim, generator=generator)]
    return signs.T.contiguous()


class TransportFeatureExtractor:
    """Context manager computing transport features during an ordinary forward pass.

    ::

        with TransportFeatureExtractor(model) as fx:
            logits = model(x)
            feats = fx.features()     # float32 [N, F] on the model's device

    Hooks exist only inside the ``with`` block; ``features()`` describes the last forward pass
    (also after the block). One extractor serves one forward pass at a time.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: FeatureSpec | None = None,
        *,
        value_range: tuple[float, float] | None = None,
        second: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.spec = spec or FeatureSpec()
        self.second = _checked_second(model, self.spec, second)
        self.value_range = value_range or network_value_range(model)
        self.extra_directions = int(self.spec.extra_directions)
        self.line_shape = bool(self.spec.line_shape)
        self._taps = ResidualTaps(model, self.spec.taps, transform=self._reduce, reduces=True)
        self._embedding_taps = Taps(
            model,
            [Tap(embedding_tap(name)) for name in self._taps.names] if self.spec.embeddings else [],
            transform=self._statistics,
            reduces=True,
        )
        self._head = Taps(model, [Tap("", "output")], transform=head_statistics)
        self._start = Taps(
            model,
            [Tap(embedding_tap(self._taps.names[0]), "input")] if self.spec.start else [],
            transform=spatial_statistics,
        )
        self._image = Taps(
            model, [Tap("", "input")] if self.spec.image else [], transform=spatial_statistics
        )
        self._nss = Taps(
            model, [Tap("", "input")] if self.spec.nss else [], transform=self._scene_statistics
        )
        # Squeeze: the pass's input and logits, kept for the squeezed pass features() runs.
        self._squeeze_source = Taps(
            model,
            [Tap("", "input"), Tap("", "output")] if self.spec.squeeze else [],
            transform=self._keep,
        )
        self._squeezed: torch.Tensor | None = None
        self._penultimate = Taps(
            model,
            [Tap(_checked_penultimate(model, self.spec), "input")] if self.spec.penultimate else [],
            transform=unit_rows,
        )
        # Second opinion: the pass's input and logits with their graph (an attacker's gradient).
        self._opinion_source = Taps(
            model,
            [Tap("", "input"), Tap("", "output")] if self.spec.second else [],
            transform=lambda value: value,
        )
        self._hooked = False
        # Every forward pass of the model starts a new trajectory (line shape).
        self._pass_start = Taps(model, [Tap("", "input")], transform=self._new_pass)
        self._directions: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}
        # Line shape: running sum of unit residuals per residual shape (one group per stage).
        self._unit_sums: dict[tuple[int, ...], torch.Tensor] = {}
        self._steps = 0

    @property
    def tap_names(self) -> list[str]:
        return list(self._taps.names)

    @property
    def n_blocks(self) -> int:
        return len(self._taps.names)

    @property
    def feature_names(self) -> list[str]:
        return self.spec.names(self.n_blocks)

    def __enter__(self) -> TransportFeatureExtractor:
        for taps in self._all_taps:
            taps.clear()  # never serve a previous context's values
        self._new_pass()
        self._squeezed = None
        self._hook()
        return self

    def __exit__(self, *exc: object) -> None:
        self._unhook()

    def _hook(self) -> None:
        self._hooked = True
        wanted = (
            (self._taps, True),
            (self._embedding_taps, self.spec.embeddings),
            (self._head, self.spec.head),
            (self._image, self.spec.image),
            (self._nss, self.spec.nss),
            (self._start, self.spec.start),
            (self._squeeze_source, self.spec.squeeze),
            (self._opinion_source, self.spec.second),
            (self._penultimate, bool(self.spec.penultimate)),
            (self._pass_start, self.line_shape),
        )
        for taps, on in wanted:
            if on:
                taps.__enter__()

    def _unhook(self) -> None:
        self._hooked = False
        for taps in (*self._all_taps, self._pass_start):
            taps.__exit__(None, None, None)

    @property
    def _all_taps(self) -> tuple[Taps, ...]:
        return (
            self._taps,
            self._embedding_taps,
            self._image,
            self._nss,
            self._start,
            self._head,
            self._squeeze_source,
            self._opinion_source,
            self._penultimate,
        )

    def _scene_statistics(self, x: torch.Tensor) -> torch.Tensor:
        return scene_statistics(x, self.value_range)

    def _keep(self, value: torch.Tensor) -> torch.Tensor:
        self._squeezed = None  # a new pass: its squeeze columns are not computed yet
        return value.detach()

    def squeeze_columns(self) -> torch.Tensor:
        """The squeeze group of the last pass (:func:`detector.squeeze.squeeze_distances`),
        computed once per pass with every hook removed, so the squeezed pass leaves the other
        groups' values alone."""
        if self._squeezed is None:
            x, logits = self._squeeze_source.outputs
            hooked = self._hooked
            if hooked:
                self._unhook()
            try:
                self._squeezed = squeeze_distances(
                    self.model, x, logits, value_range=self.value_range
                )
            finally:
                if hooked:
                    self._hook()
        return self._squeezed

    def _new_pass(self, _inputs: torch.Tensor | None = None) -> bool:
        self._unit_sums = {}
        self._steps = 0
        return True

    def _direction_matrix(self, dim: int, like: torch.Tensor) -> torch.Tensor:
        key = (dim, like.device, like.dtype)
        if key not in self._directions:
            self._directions[key] = sign_directions(dim, self.extra_directions).to(
                like.device, like.dtype
            )
        return self._directions[key]

    def _reduce(self, r: torch.Tensor) -> torch.Tensor:
        """Per-sample [msq, cos, cos_dir1..k] of one residual tensor (runs inside the hook)."""
        columns, norm = self._columns(r)
        if self.line_shape:
            self._accumulate_unit(r, norm)
        return torch.stack(columns, dim=1)

    def _statistics(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample [msq, cos, cos_dir1..k] of one embedding tensor (runs inside the hook)."""
        return torch.stack(self._columns(x)[0], dim=1)

    def _columns(self, r: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        dims = tuple(range(1, r.ndim))
        d = math.prod(r.shape[1:])
        total = r.sum(dim=dims, dtype=torch.float32)
        norm = torch.linalg.vector_norm(r, dim=dims, dtype=torch.float32)
        denominator = norm * math.sqrt(d)
        safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        columns = [
            norm.square() / d,
            torch.where(denominator > 0, total / safe, torch.zeros_like(total)),
        ]
        if self.extra_directions:
            columns.extend(self._direction_cosines(r.reshape(r.shape[0], d), norm))
        return columns, norm

    def _direction_cosines(self, flat: torch.Tensor, norm: torch.Tensor) -> list[torch.Tensor]:
        """cos(r, u_j) for the extra +-1 directions u_j; past :data:`DIRECTION_ELEMENTS` per
        sample, of r's leading elements (its first channels: a direction supported there, read
        in place, without a copy), so the projection costs a fraction of the forward pass on a
        large network."""
        if flat.shape[1] > DIRECTION_ELEMENTS:
            flat = flat[:, :DIRECTION_ELEMENTS]
            norm = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32)
        d = flat.shape[1]
        denominator = norm * math.sqrt(d)
        safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
        projections = flat @ self._direction_matrix(d, flat)
        cosines = torch.where(denominator[:, None] > 0, projections.float() / safe[:, None], 0.0)
        return list(cosines.unbind(1))

    def _accumulate_unit(self, r: torch.Tensor, norm: torch.Tensor) -> None:
        shape = (r.shape[0], *r.shape[1:])
        scale = torch.where(norm > 0, 1.0 / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
        scale = scale.view(-1, *([1] * (r.ndim - 1)))
        if shape in self._unit_sums and not torch.is_grad_enabled():
            self._unit_sums[shape].add_(r.float() * scale)  # in place: one tensor-sized copy less
        elif shape in self._unit_sums:
            self._unit_sums[shape] = self._unit_sums[shape] + r.float() * scale
        else:
            self._unit_sums[shape] = r.float() * scale
        self._steps += 1

    def line_shape_score(self) -> torch.Tensor:
        """LSS = n / ||sum_l r_l/||r_l|| || (seed 001, eq. 43-44), per sample; >= 1, 1 = straight.

        Residuals of different shapes (different stages) live in different spaces; their unit
        sums are treated as orthogonal components of one trajectory.
        """
        if not self._unit_sums:
            raise RuntimeError("no forward pass has gone through the taps with line_shape=True")
        squares = [s.flatten(1).square().sum(1) for s in self._unit_sums.values()]
        length = torch.stack(squares, 1).sum(1).sqrt()
        return self._steps / length.clamp_min(1e-12)

    def features(self) -> torch.Tensor:
        """Features of the last forward pass: float32 [N, F], columns as :attr:`feature_names`."""
        parts = _group_columns(self._taps.outputs)
        if self.spec.embeddings:
            parts += _group_columns(self._embedding_taps.outputs)
        if self.line_shape:
            parts.append(self.line_shape_score().unsqueeze(1))
        if self.spec.image:
            parts.append(self._image.outputs[0])
        if self.spec.nss:
            parts.append(self._nss.outputs[0])
        if self.spec.start:
            parts.append(self._start.outputs[0])
        if self.spec.head:
            parts.append(self._head.outputs[0])
        if self.spec.squeeze:
            parts.append(self.squeeze_columns())
        if self.spec.second:
            x, logits = self._opinion_source.outputs
            parts.append(second_opinion(self.second, x, logits.argmax(1)))  # type: ignore[arg-type]
        if self.spec.penultimate:
            parts.append(self._penultimate.outputs[0])
        return torch.cat(parts, dim=1)


def _checked_second(
    model: nn.Module, spec: FeatureSpec, second: nn.Module | None
) -> nn.Module | None:
    """The second network of a spec with the second-opinion group, or ConfigError."""
    if spec.second and second is None:
        raise ConfigError(
            f"the feature set {spec.label()} holds a second network's opinion: pass that network "
            "(second=...; a bundle carries it as second.safetensors)"
        )
    if second is not None and second is model:
        raise ConfigError("the second network must be another network than the deployed one")
    return second


def _checked_penultimate(model: nn.Module, spec: FeatureSpec) -> str:
    """The last linear layer of a network whose penultimate width is the spec's, or ConfigError."""
    width = penultimate_width(model)
    if width != spec.penultimate:
        raise ConfigError(
            f"the feature set holds a {spec.penultimate}-wide penultimate embedding, but this "
            f"network's last linear layer reads {width} values: it belongs to another network"
        )
    return penultimate_tap(model)


def _group_columns(per_tap: list[torch.Tensor]) -> list[torch.Tensor]:
    """[msq, cos] of every block, then every block's direction cosines (block-major)."""
    per_block = torch.stack(per_tap, dim=1)  # [N, M, 2 + k]
    n = per_block.shape[0]
    parts = [per_block[:, :, :2].reshape(n, -1)]
    if per_block.shape[2] > 2:
        parts.append(per_block[:, :, 2:].reshape(n, -1))
    return parts


def _sorted_quantiles(values: torch.Tensor, quantiles: Sequence[float]) -> torch.Tensor:
    """Per-row quantiles (lower order statistic) of ``values`` [N, K], as [N, len(quantiles)]."""
    ordered = values.sort(dim=1).values
    last = values.shape[1] - 1
    return ordered[:, [int(q * last) for q in quantiles]]


def _order_grid(z: torch.Tensor) -> torch.Tensor:
    """The positions of z [N, C, H, W] the order statistics (quantiles, medians) read: all of
    them up to :data:`ORDER_POSITIONS`, else an evenly strided grid of about that many (sorting
    a 224x224 image's 50,176 positions would cost more than the forward pass it rides on)."""
    height, width = z.shape[2:]
    if height * width <= ORDER_POSITIONS:
        return z
    stride = math.ceil(math.sqrt(height * width / ORDER_POSITIONS))
    return z[..., ::stride, ::stride]


def spatial_statistics(x: torch.Tensor) -> torch.Tensor:
    """Per-sample statistics of a state x [N, C, H, W] (the trajectory's start x_0), float32 [N, 12]:

    msq and cos(x, 1) as for every block; the kurtosis mean(x^4)/msq^2; the roughness (mean
    squared difference of horizontally and vertically adjacent values over 2 msq); how the energy
    e_p = sum_c x[:, c, p]^2 spreads over positions p: the peak max_p e_p and the 5/25/50%
    quantiles of e_p, each over mean_p e_p; the l1 ratio mean|x|/sqrt(msq); and the 10/25/50%
    quantiles of the distance^2 of each position's channel vector to the per-channel spatial median
    over mean_p e_p. All but msq are scale-free; flat regions (where small perturbations and
    out-of-distribution textures show first) drive the low quantiles, read on at most about
    :data:`ORDER_POSITIONS` positions (:func:`_order_grid`). A Transformer's token
    sequence [N, T, D] reads as T positions of D channels (adjacent: consecutive tokens)."""
    z = x.float()
    if z.ndim == 2:
        z = z[:, :, None, None]
    elif z.ndim == 3:
        z = z.transpose(1, 2)[..., None]
    if z.ndim != 4:
        raise ConfigError(
            f"start statistics need an [N, C, H, W] or [N, T, D] state, got shape {tuple(x.shape)}"
        )
    n, channels = z.shape[:2]
    msq = z.square().flatten(1).mean(1)
    safe = msq.clamp_min(torch.finfo(torch.float32).tiny)
    total = z.flatten(1).sum(1)
    cos = torch.where(msq > 0, total / (safe.sqrt() * z[0].numel()), 0.0)
    rough_h = (z[..., 1:, :] - z[..., :-1, :]).square().flatten(1).mean(1) if z.shape[2] > 1 else 0
    rough_w = (z[..., :, 1:] - z[..., :, :-1]).square().flatten(1).mean(1) if z.shape[3] > 1 else 0
    energy = z.square().sum(1).flatten(1)  # [N, positions]
    mean_energy = (msq * channels).clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    grid = _order_grid(z)
    flat = grid.flatten(2)
    spread = (flat - flat.median(dim=2, keepdim=True).values).square().sum(1)
    scalars = [
        msq,
        cos,
        z.pow(4).flatten(1).mean(1) / safe / safe,
        (rough_h + rough_w) / (2 * safe) * (msq > 0),
        energy.max(1).values / mean_energy[:, 0],
        z.abs().flatten(1).mean(1) / safe.sqrt() * (msq > 0),
    ]
    return torch.cat(
        [
            torch.stack([torch.as_tensor(c, dtype=torch.float32).expand(n) for c in scalars], 1),
            _sorted_quantiles(grid.square().sum(1).flatten(1), ENERGY_QUANTILES) / mean_energy,
            _sorted_quantiles(spread, SPREAD_QUANTILES) / mean_energy,
        ],
        dim=1,
    )


def head_statistics(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample [top-1 minus top-2 logit, max softmax probability, log-sum-exp] (float32)."""
    z = logits.float()
    if z.shape[1] < 2:
        raise ConfigError("head features need at least two classes")
    top = z.topk(2, dim=1).values
    lse = torch.logsumexp(z, dim=1)
    return torch.stack([top[:, 0] - top[:, 1], torch.exp(top[:, 0] - lse), lse], dim=1)


def network_value_range(model: nn.Module) -> tuple[float, float]:
    """The input value range of a network built from a :class:`NetworkConfig` ((0, 1) for a
    model without one)."""
    spec = getattr(getattr(model, "config", None), "input_spec", None)
    if spec is None:
        return (0.0, 1.0)
    low, high = spec.value_range
    return (float(low), float(high))


def model_device(model: nn.Module) -> torch.device:
    """The device of a model's first parameter or buffer (CPU for a model with neither)."""
    for parameter in model.parameters():
        return parameter.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def check_images(x: np.ndarray, *, name: str = "x") -> np.ndarray:
    """A float32 [N, C, H, W] array with finite values, or InputError."""
    x = np.asarray(x)
    if x.ndim != 4:
        raise InputError(f"{name} must be a [N, C, H, W] array, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise InputError(
            f"{name} must hold floats in the network's value range, got dtype {x.dtype}"
        )
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise InputError(f"{name} contains NaN or infinite values")
    return x


def check_features(features: np.ndarray, n_features: int | None = None) -> np.ndarray:
    """A finite float32 [N, F] feature matrix; with ``n_features``, refuses another width."""
    features = np.asarray(features)
    if features.ndim != 2:
        raise InputError(f"features must be a [N, F] array, got shape {features.shape}")
    if n_features is not None and features.shape[1] != n_features:
        raise InputError(
            f"fitted on {n_features} features, got {features.shape[1]}: "
            "this detector belongs to another network"
        )
    try:
        features = np.ascontiguousarray(features, dtype=np.float32)
    except (TypeError, ValueError) as error:
        raise InputError(f"features must be numeric: {error}") from error
    if not np.isfinite(features).all():
        raise InputError("features contain NaN or infinite values")
    return features


def extract_features(
    model: nn.Module,
    x: np.ndarray,
    *,
    batch_size: int = 256,
    device: str | torch.device | None = None,
    spec: FeatureSpec | None = None,
    progress: bool = False,
    second: nn.Module | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Transport features [N, F] and logits [N, K] (both float32) of images ``x`` [N, C, H, W].

    Runs in eval mode under ``torch.no_grad`` in batches on the model's device (``device``, when
    given, moves the model there first; ``second``, the second network of a spec with
    ``second=True``, follows the model). The train/eval modes are restored afterwards.
    """
    x = check_images(x)
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    if device is not None:
        model.to(resolve_device(device))
    target = model_device(model)
    was_training = model.training, second.training if second is not None else False
    model.eval()
    if second is not None:
        second.to(target).eval()
    features: list[np.ndarray] = []
    logits: list[np.ndarray] = []
    starts = range(0, len(x), batch_size)
    try:
        with (
            torch.no_grad(),
            TransportFeatureExtractor(model, spec, second=second) as fx,
        ):
            for start in tqdm(starts, desc="features", disable=not progress, leave=False):
                batch = torch.from_numpy(x[start : start + batch_size]).to(target)
                out = model(batch)
                logits.append(out.float().cpu().numpy())
                features.append(fx.features().cpu().numpy())
            names = fx.feature_names
    finally:
        model.train(was_training[0])
        if second is not None:
            second.train(was_training[1])
    if not features:
        return np.zeros((0, len(names)), np.float32), np.zeros((0, 0), np.float32)
    return np.concatenate(features), np.concatenate(logits)
