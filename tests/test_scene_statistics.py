"""The torch scene statistics against an independent scipy/numpy computation of BRISQUE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter
from scipy.special import gammaln

from detector.errors import InputError
from detector.nss import nss_features
from detector.scene_statistics import scene_statistic_names, scene_statistics

_ALPHA = np.arange(0.2, 10.0, 0.001)
_R = np.exp(gammaln(1 / _ALPHA) + gammaln(3 / _ALPHA) - 2 * gammaln(2 / _ALPHA))


def _shape(ratio: np.ndarray) -> np.ndarray:
    return np.interp(ratio, _R[::-1], _ALPHA[::-1])


def _reference(gray: np.ndarray) -> list[np.ndarray]:
    """One scale's 18 statistics with scipy's Gaussian filter and numpy's interpolation."""
    blur = {"sigma": 7 / 6, "truncate": 3 / (7 / 6), "mode": "nearest", "axes": (1, 2)}
    mu = gaussian_filter(gray, **blur)
    c = (gray - mu) / (np.sqrt(np.abs(gaussian_filter(gray * gray, **blur) - mu * mu)) + 1)
    n = len(gray)
    flat = c.reshape(n, -1)
    columns = [_shape(np.mean(flat**2, 1) / np.maximum(np.mean(np.abs(flat), 1) ** 2, 1e-12))]
    columns.append(np.mean(flat**2, 1))
    for p in (
        c[:, :, :-1] * c[:, :, 1:],
        c[:, :-1, :] * c[:, 1:, :],
        c[:, :-1, :-1] * c[:, 1:, 1:],
        c[:, :-1, 1:] * c[:, 1:, :-1],
    ):
        x = p.reshape(n, -1)
        left_v = np.sum(np.where(x < 0, x * x, 0), 1) / np.maximum((x < 0).sum(1), 1)
        right_v = np.sum(np.where(x > 0, x * x, 0), 1) / np.maximum((x > 0).sum(1), 1)
        g = np.sqrt(left_v) / np.maximum(np.sqrt(right_v), 1e-12)
        r = np.mean(np.abs(x), 1) ** 2 / np.maximum(np.mean(x * x, 1), 1e-12)
        big = r * (g**3 + 1) * (g + 1) / np.maximum((g**2 + 1) ** 2, 1e-12)
        a = _shape(1 / np.maximum(big, 1e-12))
        scale = np.exp(0.5 * (gammaln(1 / a) - gammaln(3 / a)))
        mean = (
            (np.sqrt(right_v) - np.sqrt(left_v)) * scale * np.exp(gammaln(2 / a) - gammaln(1 / a))
        )
        columns += [a, mean, left_v, right_v]
    return columns


def reference(images: np.ndarray, value_range: tuple[float, float] = (0, 1)) -> np.ndarray:
    x = images.astype(np.float64)
    gray = x[:, 0] if x.shape[1] == 1 else np.tensordot(x[:, :3], [0.299, 0.587, 0.114], ([1], [0]))
    gray = (gray - value_range[0]) * 255 / (value_range[1] - value_range[0])
    h, w = gray.shape[1] // 2 * 2, gray.shape[2] // 2 * 2
    half = gray[:, :h, :w].reshape(len(gray), h // 2, 2, w // 2, 2).mean(axis=(2, 4))
    return np.nan_to_num(np.stack(_reference(gray) + _reference(half), 1)).astype(np.float32)


def _fashion(root: Path, n: int) -> np.ndarray:
    raw = root / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    pixels = np.fromfile(raw, dtype=np.uint8, offset=16, count=n * 784)
    return (pixels.reshape(n, 1, 28, 28) / 255.0).astype(np.float32)


def test_the_statistics_match_scipy_on_clothes_attacks_noise_and_colour(data_root: Path) -> None:
    rng = np.random.default_rng(3)
    clothes = _fashion(data_root, 300)
    signs = np.sign(rng.standard_normal(clothes.shape)).astype(np.float32)
    sets = {
        "clothes": clothes,
        "fgm eps=0.03": np.clip(clothes + 0.03 * signs, 0, 1),
        "noise": rng.random((100, 1, 28, 28), dtype=np.float32),
        "colour 32x31": rng.random((40, 3, 32, 31), dtype=np.float32),
    }
    for name, images in sets.items():
        got = scene_statistics(torch.from_numpy(images)).numpy()
        assert got.shape == (len(images), 36) and got.dtype == np.float32, name
        np.testing.assert_allclose(got, reference(images), rtol=1e-5, atol=1e-6, err_msg=name)
    # a signed 0.03 step moves almost every image's statistics
    moved = scene_statistics(torch.from_numpy(sets["fgm eps=0.03"])) - scene_statistics(
        torch.from_numpy(clothes)
    )
    assert (moved.abs().amax(1) > 1e-3).float().mean() > 0.9
    centred = clothes * 2 - 1  # a network reading [-1, 1]: the same statistics
    np.testing.assert_allclose(
        scene_statistics(torch.from_numpy(centred), (-1.0, 1.0)).numpy(),
        scene_statistics(torch.from_numpy(clothes)).numpy(),
        rtol=1e-4,
        atol=1e-5,
    )
    assert len(scene_statistic_names()) == 36 == len(set(scene_statistic_names()))


def test_flat_images_give_finite_statistics_and_bad_shapes_are_refused() -> None:
    flat = np.zeros((3, 1, 28, 28), np.float32)
    got = nss_features(flat)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, reference(flat))
    assert nss_features(np.zeros((0, 1, 28, 28), np.float32)).shape == (0, 36)
    for shape in [(2, 2, 28, 28), (2, 1, 1, 28), (2, 28, 28)]:
        with pytest.raises(InputError, match="scene statistics need"):
            scene_statistics(torch.zeros(shape))


def test_an_attacker_gets_a_gradient_through_the_statistics() -> None:
    """No gradient masking: the group must not hide the image from an adaptive attack."""
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    x[1, :, :8] = 0.0  # a flat band, as Fashion-MNIST's background
    x[2] = 0.5  # a flat image
    x.requires_grad_(True)
    scene_statistics(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[:2].abs() > 0).float().mean() > 0.9
