"""A network's images from its data set: the one its training preset named (``train_config.json``)
or, for an imported network, the one its import record names (``imported.json``), converted
through the network's input spec (:func:`detector.preprocessing.prepare_images`, the transform the
service applies to an upload), so a 28x28 grey data set feeds a 3x32x32 network as the server
would feed it.
"""

from __future__ import annotations

from collections.abc import Sized
from pathlib import Path

import numpy as np
from torch.utils.data import Subset

from detector import networks
from detector.artefacts import read_json
from detector.errors import ArtefactError
from detector.networks import InputSpec
from detector.preprocessing import prepare_images
from training.data.datasets import load_dataset, subset, to_arrays
from training.rundir import ModelDir


def network_dataset(model_dir: str | Path) -> str:
    """The data set network ``model_dir`` was trained on, or was imported to be judged on."""
    files = ModelDir(model_dir)
    path = files.train_config_file
    if not path.is_file() and files.import_record_file.is_file():
        path = files.import_record_file
    try:
        return str(read_json(path)["dataset"])
    except (ArtefactError, KeyError, TypeError) as error:
        raise ArtefactError(f"cannot read the data set name from {path}: {error}") from error


def in_input_spec(images: np.ndarray, spec: InputSpec) -> np.ndarray:
    """``images`` (float32 NCHW in [0, 1]) as the network takes them: unchanged when they have
    its shape already, else through :func:`prepare_images` (channels, resize, crop)."""
    if images.shape[1:] == spec.shape:
        return images
    return prepare_images(images, spec).numpy()


def attack_images(
    model_dir: str | Path,
    *,
    split: str = "test",
    n: int | None = 1000,
    seed: int = 0,
    root: str | Path | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(images, labels, source indices): the first ``n`` of a seeded order of ``split`` of the
    network's data set (:func:`network_dataset`), in its input spec."""
    dataset = load_dataset(network_dataset(model_dir), split, root=root)
    chosen = subset(dataset, n, seed)
    assert isinstance(dataset, Sized)  # torchvision's data sets and Subset have a length
    indices = np.asarray(
        chosen.indices if isinstance(chosen, Subset) else range(len(dataset)), dtype=np.int64
    )
    x, y = to_arrays(dataset, n, seed=seed)
    spec = networks.read_config(model_dir).input_spec
    return in_input_spec(x, spec), y, indices


def images_after(
    model_dir: str | Path, *, skip: int, n: int, seed: int = 0, root: str | Path | None = None
) -> np.ndarray:
    """Images ``skip`` to ``skip + n`` of the seeded order of the network's test split, in its
    input spec: test images :func:`attack_images` with ``n <= skip`` never hands out (an
    imported network's held-back images, which no detector is fitted or tested on)."""
    x, _, _ = attack_images(model_dir, split="test", n=skip + n, seed=seed, root=root)
    return x[skip:]
