"""Writers of tiny data sets in torchvision's on-disk formats (CIFAR, SVHN, MNIST idx, image folders),
so the real torchvision loaders are tested without downloading anything."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def write_cifar(root: Path, *, n: int = 12, classes: int = 10, seed: int = 0) -> None:
    """CIFAR-10 (classes=10) or CIFAR-100 (classes=100) batches of random 32x32 images."""
    rng = np.random.default_rng(seed)
    if classes == 10:
        folder = root / "cifar-10-batches-py"
        files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        meta_name, meta = "batches.meta", {"label_names": [f"c{i}" for i in range(10)]}
        label_key = "labels"
    else:
        folder = root / "cifar-100-python"
        files = ["train", "test"]
        meta_name, meta = "meta", {"fine_label_names": [f"c{i}" for i in range(100)]}
        label_key = "fine_labels"
    folder.mkdir(parents=True, exist_ok=True)
    for name in files:
        batch = {
            "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            label_key: rng.integers(0, classes, n).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / meta_name).write_bytes(pickle.dumps(meta))


def write_svhn(root: Path, *, n: int = 12, seed: int = 0) -> None:
    from scipy.io import savemat

    rng = np.random.default_rng(seed)
    folder = root / "svhn"
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
        y = rng.integers(1, 11, size=(n, 1)).astype(np.uint8)  # SVHN stores digit 0 as 10
        savemat(folder / f"{split}_32x32.mat", {"X": x, "y": y})


def write_mnist(root: Path, *, n: int = 12, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix in ("train", "t10k"):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        header = np.array([0x803, n, 28, 28], dtype=">i4").tobytes()
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            np.array([0x801, n], dtype=">i4").tobytes() + labels.tobytes()
        )


def write_tiny_imagenet(root: Path, *, classes: int = 3, per_class: int = 4, seed: int = 0) -> None:
    """TinyImageNet-like folders of 64x64 JPEGs: train/<class>/images/*.JPEG and val/<class>/*.JPEG."""
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        for c in range(classes):
            folder = (
                root
                / "tiny-imagenet-200"
                / split
                / f"n{c:08d}"
                / ("images" if split == "train" else "")
            )
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, size=(64, 64, 3), dtype=np.uint8)).save(
                    folder / f"{i}.JPEG"
                )
