"""Natural-scene statistics of images (BRISQUE, Mittal et al. 2012), in torch.

MSCN coefficients of the gray image on a 0..255 scale (mean subtracted, contrast normalized
with a 7x7 Gaussian window, sigma 7/6, edges replicated), a generalized Gaussian fitted to them
(shape, variance) and asymmetric generalized Gaussians fitted to their four pairwise products
(horizontal, vertical, two diagonals: shape, mean, left and right variance): 18 numbers per
scale, at 2 scales (the image and its 2x2 average-pooled half) = 36, by moment matching (the
shape read off a tabulated moment ratio, linearly interpolated, so the statistics have a
gradient wherever they are finite). Computed in float64 on the images' device, returned as
float32. The NSS baseline (:mod:`detector.nss`) and the trajectory features' ``nss`` group
(:mod:`detector.features`) both read these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detector.errors import InputError

LUMA = (0.299, 0.587, 0.114)
SIGMA = 7.0 / 6.0
RADIUS = 3  # scipy's gaussian_filter at truncate = 3 / sigma: int(3 + 0.5) taps each side
_TINY = 1e-12
PAIRS = ("h", "v", "d1", "d2")


def scene_statistic_names() -> list[str]:
    """Names of the 36 columns of :func:`scene_statistics`."""
    names = []
    for scale in (0, 1):
        names += [f"s{scale}_ggd_shape", f"s{scale}_ggd_var"]
        for pair in PAIRS:
            names += [f"s{scale}_{pair}_{k}" for k in ("shape", "mean", "left_var", "right_var")]
    return names


def _shape_table() -> tuple[torch.Tensor, torch.Tensor]:
    """(r(a) increasing, a): r(a) = G(1/a) G(3/a) / G(2/a)^2 = E[x^2] / E[|x|]^2 of a GGD of
    shape a, on the grid a = 0.2, 0.201, ..., 9.999 (r decreases in a; flipped here)."""
    alpha = 0.2 + 0.001 * torch.arange(9800, dtype=torch.float64)
    ratio = torch.exp(
        torch.lgamma(1 / alpha) + torch.lgamma(3 / alpha) - 2 * torch.lgamma(2 / alpha)
    )
    return ratio.flip(0), alpha.flip(0)


_RATIO, _ALPHA = _shape_table()


def shape_from_ratio(ratio: torch.Tensor) -> torch.Tensor:
    """The GGD shape a with r(a) = ``ratio`` (linear interpolation on the grid, clamped)."""
    xp, fp = _RATIO.to(ratio.device), _ALPHA.to(ratio.device)
    x = ratio.clamp(xp[0], xp[-1])
    i = torch.searchsorted(xp, x.contiguous(), right=True).clamp(1, len(xp) - 1)
    x0, x1 = xp[i - 1], xp[i]
    return fp[i - 1] + (x - x0) / (x1 - x0) * (fp[i] - fp[i - 1])


def _root(x: torch.Tensor) -> torch.Tensor:
    """sqrt of x >= 0, floored at sqrt(1e-12): a flat patch's gradient stays finite."""
    return torch.sqrt(x.clamp_min(_TINY))


def _blur(x: torch.Tensor) -> torch.Tensor:
    """Gaussian blur of [N, H, W] (separable, edges replicated, as scipy's mode='nearest')."""
    offsets = torch.arange(-RADIUS, RADIUS + 1, dtype=x.dtype, device=x.device)
    kernel = torch.exp(-0.5 * (offsets / SIGMA) ** 2)
    kernel = kernel / kernel.sum()
    padded = F.pad(x[:, None], (RADIUS,) * 4, mode="replicate")
    rows = F.conv2d(padded, kernel.view(1, 1, 1, -1))
    return F.conv2d(rows, kernel.view(1, 1, -1, 1))[:, 0]


def mscn(gray: torch.Tensor, c: float = 1.0) -> torch.Tensor:
    """MSCN coefficients of gray images [N, H, W] on a 0..255 scale."""
    mu = _blur(gray)
    sigma = _root(torch.abs(_blur(gray * gray) - mu * mu))
    return (gray - mu) / (sigma + c)


def ggd_fit(x: torch.Tensor) -> list[torch.Tensor]:
    """[shape, variance] of a zero-mean generalized Gaussian per row of x [N, P]."""
    variance = x.square().mean(1)
    mean_abs = x.abs().mean(1)
    return [shape_from_ratio(variance / mean_abs.square().clamp_min(_TINY)), variance]


def aggd_fit(x: torch.Tensor) -> list[torch.Tensor]:
    """[shape, mean, left variance, right variance] of an asymmetric GGD per row of x [N, P]."""
    negative, positive = x < 0, x > 0
    squares = x.square()
    left_var = (squares * negative).sum(1) / negative.sum(1).clamp_min(1)
    right_var = (squares * positive).sum(1) / positive.sum(1).clamp_min(1)
    left, right = _root(left_var), _root(right_var)
    gamma = left / right.clamp_min(_TINY)
    r_hat = x.abs().mean(1).square() / squares.mean(1).clamp_min(_TINY)
    big_r = r_hat * (gamma**3 + 1) * (gamma + 1) / ((gamma**2 + 1) ** 2).clamp_min(_TINY)
    # rho(a) = G(2/a)^2 / (G(1/a) G(3/a)) = 1 / r(a), so invert r at 1 / R.
    shape = shape_from_ratio(1.0 / big_r.clamp_min(_TINY))
    scale = torch.exp(0.5 * (torch.lgamma(1 / shape) - torch.lgamma(3 / shape)))
    mean = (right - left) * scale * torch.exp(torch.lgamma(2 / shape) - torch.lgamma(1 / shape))
    return [shape, mean, left_var, right_var]


def _one_scale(gray: torch.Tensor) -> list[torch.Tensor]:
    coefficients = mscn(gray)
    n = len(gray)
    columns = ggd_fit(coefficients.reshape(n, -1))
    products = (
        coefficients[:, :, :-1] * coefficients[:, :, 1:],  # horizontal
        coefficients[:, :-1, :] * coefficients[:, 1:, :],  # vertical
        coefficients[:, :-1, :-1] * coefficients[:, 1:, 1:],  # main diagonal
        coefficients[:, :-1, 1:] * coefficients[:, 1:, :-1],  # anti-diagonal
    )
    for product in products:
        columns += aggd_fit(product.reshape(n, -1))
    return columns


def scene_statistics(
    images: torch.Tensor, value_range: tuple[float, float] = (0.0, 1.0)
) -> torch.Tensor:
    """The 36 statistics of each image of ``images`` [N, C, H, W] (C = 1, or RGB first),
    values in ``value_range``: float32 [N, 36], NaN and infinities as 0."""
    if images.ndim != 4 or images.shape[1] == 2 or min(images.shape[2:]) < 2:
        raise InputError(
            "scene statistics need [N, C, H, W] images with 1 channel or 3 or more, "
            f"at least 2x2, got shape {tuple(images.shape)}"
        )
    x = images.to(torch.float64)  # differentiable: an adaptive attacker's gradient flows
    luma = x.new_tensor(LUMA)
    gray = x[:, 0] if x.shape[1] == 1 else torch.einsum("nchw,c->nhw", x[:, :3], luma)
    low, high = value_range
    gray = (gray - low) * (255.0 / (high - low))
    h, w = gray.shape[1] // 2 * 2, gray.shape[2] // 2 * 2
    half = F.avg_pool2d(gray[:, None, :h, :w], 2)[:, 0]
    columns = _one_scale(gray) + _one_scale(half)
    return torch.nan_to_num(torch.stack(columns, 1), nan=0.0, posinf=0.0, neginf=0.0).float()
