"""Data sets by name through torchvision, seeded splits, and out-of-distribution sets.

Images are float tensors in [0, 1] (``ToTensor``); normalization lives inside the network.
Nothing is downloaded unless ``download=True`` is asked for.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset, random_split
from torchvision import datasets, transforms

from detector.artefacts import atomic_path
from detector.errors import ConfigError, DataNotFoundError
from detector.networks import InputSpec
from training.data.cifar_files import CIFAR10Files, CIFAR100Files

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
DEBIAN_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def default_root() -> Path:
    """Data root: ``$LAPGUARD_DATA`` or ./data."""
    return Path(os.environ.get("LAPGUARD_DATA", "data"))


@dataclass(frozen=True)
class DatasetInfo:
    """What a named data set looks like: shape, normalization constants, class names."""

    name: str
    channels: int
    height: int
    width: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]
    loader: Callable[[Path, str, bool, bool], Dataset] = field(repr=False, compare=False)

    def input_spec(self) -> InputSpec:
        return InputSpec(
            channels=self.channels,
            height=self.height,
            width=self.width,
            mean=list(self.mean),
            std=list(self.std),
        )


_TO_TENSOR = transforms.ToTensor()


def _split_flag(split: str) -> bool:
    if split not in ("train", "test"):
        raise ConfigError(f"split must be 'train' or 'test', got {split!r}")
    return split == "train"


class _SVHNFiles(datasets.SVHN):
    split_list = {
        split: [url, name, None] for split, (url, name, _) in datasets.SVHN.split_list.items()
    }


def _fashion_mnist(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    return datasets.FashionMNIST(
        str(root), train=_split_flag(split), transform=_TO_TENSOR, download=download
    )


def _mnist(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    return datasets.MNIST(
        str(root), train=_split_flag(split), transform=_TO_TENSOR, download=download
    )


def _cifar10(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    cls = datasets.CIFAR10 if verify else CIFAR10Files
    return cls(str(root), train=_split_flag(split), transform=_TO_TENSOR, download=download)


def _cifar100(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    cls = datasets.CIFAR100 if verify else CIFAR100Files
    return cls(str(root), train=_split_flag(split), transform=_TO_TENSOR, download=download)


def _svhn(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    _split_flag(split)
    cls = datasets.SVHN if verify else _SVHNFiles
    return cls(str(root / "svhn"), split=split, transform=_TO_TENSOR, download=download)


def _imagefolder(root: Path, split: str, download: bool, verify: bool) -> Dataset:
    # TinyImageNet-style layout: ROOT/tiny-imagenet-200/{train,val}/<class>/**/*.JPEG, or any
    # ROOT/imagefolder/{train,test}/<class>/*.png. Validation folders must be sorted by class.
    _split_flag(split)
    for base, folder in (
        (root / "tiny-imagenet-200", {"train": "train", "test": "val"}[split]),
        (root / "imagefolder", split),
    ):
        path = base / folder
        if path.is_dir():
            transform = transforms.Compose([transforms.Resize((64, 64)), transforms.ToTensor()])
            return datasets.ImageFolder(str(path), transform=transform, loader=_folder_image)
    raise DataNotFoundError(
        f"no image folder for split {split!r} under {root}: expected {root}/tiny-imagenet-200/"
        f"{'train' if split == 'train' else 'val'}/<class>/ or {root}/imagefolder/{split}/<class>/"
    )


def _folder_image(path: str) -> Image.Image:
    """An image folder's file as RGB (torchvision's loader); a file that is not a readable image
    is a DataNotFoundError naming it, not a PIL traceback in the middle of a run."""
    try:
        with open(path, "rb") as handle:
            return Image.open(handle).convert("RGB")
    except (OSError, SyntaxError, ValueError) as error:  # UnidentifiedImageError is an OSError
        raise DataNotFoundError(f"{path} is not a readable image: {error}") from error


FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "fashion-mnist", 1, 28, 28, (0.2860,), (0.3530,), FASHION_CLASSES, _fashion_mnist
        ),
        DatasetInfo(
            "mnist", 1, 28, 28, (0.1307,), (0.3081,), tuple(str(i) for i in range(10)), _mnist
        ),
        DatasetInfo(
            "cifar10",
            3,
            32,
            32,
            (0.4914, 0.4822, 0.4465),
            (0.2470, 0.2435, 0.2616),
            CIFAR10_CLASSES,
            _cifar10,
        ),
        DatasetInfo(
            "cifar100",
            3,
            32,
            32,
            (0.5071, 0.4865, 0.4409),
            (0.2673, 0.2564, 0.2762),
            tuple(f"class_{i}" for i in range(100)),
            _cifar100,
        ),
        DatasetInfo(
            "svhn",
            3,
            32,
            32,
            (0.4377, 0.4438, 0.4728),
            (0.1980, 0.2010, 0.1970),
            tuple(str(i) for i in range(10)),
            _svhn,
        ),
        DatasetInfo(
            "imagefolder",
            3,
            64,
            64,
            (0.4802, 0.4481, 0.3975),
            (0.2770, 0.2691, 0.2821),
            tuple(f"class_{i}" for i in range(200)),
            _imagefolder,
        ),
    )
}

OOD_SETS = ("digits", "noise")


def dataset_info(name: str) -> DatasetInfo:
    """Shape, normalization and class names of a named data set."""
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]


def load_dataset(
    name: str,
    split: str = "train",
    *,
    root: str | Path | None = None,
    download: bool = False,
    verify: bool = True,
) -> Dataset:
    """A torchvision data set by name; a missing data set is a DataNotFoundError naming the path.

    ``verify=False`` accepts CIFAR/SVHN files that are present but not torchvision's originals
    (md5 not checked), e.g. small copies in torchvision's on-disk format; CIFAR's pickled batches
    are then read without running code (:mod:`training.data.cifar_files`).
    """
    info = dataset_info(name)
    root = Path(root) if root is not None else default_root()
    try:
        dataset = info.loader(root, split, download, verify)
    except (RuntimeError, FileNotFoundError) as error:  # torchvision: "not found or corrupted",
        # an image folder without class folders
        hint = (
            "run `make data` (or `lapguard data`)"
            if name == "fashion-mnist"
            else "pass --download on a machine with internet"
        )
        raise DataNotFoundError(
            f"data set {name!r} ({split}) not found under {root.resolve()}: {error} — {hint}"
        ) from error
    return dataset


def class_names(name: str, dataset: Dataset | None = None) -> list[str]:
    """Class names of a data set (read from the data when it carries them)."""
    classes = getattr(dataset, "classes", None)
    if classes:
        return [str(c) for c in classes]
    return list(dataset_info(name).class_names)


def train_val_split(dataset: Dataset, val_fraction: float, seed: int) -> tuple[Subset, Subset]:
    """Seeded random split of a training set into train/validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = int(round(len(dataset) * val_fraction))  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    train, val = random_split(dataset, [len(dataset) - n_val, n_val], generator=generator)  # type: ignore[arg-type]
    return train, val


def subset(dataset: Dataset, n: int | None, seed: int) -> Dataset:
    """The first ``n`` items of a seeded random order (all of them, in that order, when n is too
    large), so every n gives a prefix of the same order; ``n=None`` keeps the data set as it is."""
    if n is None:
        return dataset
    if n <= 0:
        raise ConfigError(f"subset size must be positive, got {n}")
    total = len(dataset)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(seed)
    return Subset(dataset, torch.randperm(total, generator=generator)[: min(n, total)].tolist())


def to_arrays(
    dataset: Dataset, n: int | None = None, *, seed: int = 0, batch_size: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 NCHW in [0, 1], labels int64) for the first ``n`` items of a seeded order."""
    chosen = subset(dataset, n, seed) if n is not None else dataset
    loader = torch.utils.data.DataLoader(chosen, batch_size=batch_size, shuffle=False)
    xs, ys = [], []
    for x, y in loader:
        xs.append(x.numpy().astype(np.float32, copy=False))
        ys.append(np.asarray(y, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def load_ood(
    name: str, spec: InputSpec, n: int, *, seed: int = 0, root: str | Path | None = None
) -> np.ndarray:
    """An out-of-distribution set shaped like ``spec``: ``digits`` (scikit-learn's bundled 8x8
    digits, resized), ``noise`` (uniform), or any named data set (resized/converted)."""
    rng = np.random.default_rng(seed)
    if name == "noise":
        low, high = spec.value_range
        return rng.uniform(low, high, size=(n, *spec.shape)).astype(np.float32)
    if name == "digits":
        from sklearn.datasets import load_digits

        images = load_digits().images.astype(np.float32) / 16.0  # (1797, 8, 8) in [0, 1]
        idx = rng.choice(len(images), size=n, replace=n > len(images))
        x = torch.from_numpy(images[idx]).unsqueeze(1)
    else:
        x_np, _ = to_arrays(load_dataset(name, "test", root=root), n, seed=seed)
        x = torch.from_numpy(x_np)
    x = torch.nn.functional.interpolate(
        x, size=(spec.height, spec.width), mode="bilinear", align_corners=False
    )
    if x.shape[1] != spec.channels:
        x = (
            x.mean(dim=1, keepdim=True)
            if spec.channels == 1
            else x.expand(-1, spec.channels, -1, -1)
        )
    return x.clamp(0, 1).numpy().astype(np.float32)


# --------------------------------------------------------------------------------------------
# Embedded Fashion-MNIST (Debian package dataset-fashion-mnist)
# --------------------------------------------------------------------------------------------
def _install_debian_package() -> str | None:
    """Try to apt-get install the Debian package; return None on success, else why not."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available on this machine"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "installing a Debian package needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "-qq", DEBIAN_PACKAGE]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        # The package lists may be missing on a fresh machine: update once and retry.
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, text=True, env=env)
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return f"`{' '.join(command)}` failed: {result.stderr.strip()[-500:]}"
    return None


def prepare_fashion_mnist(
    root: str | Path | None = None, *, source: Path = DEBIAN_FASHION_MNIST, install: bool = True
) -> Path:
    """Lay out Fashion-MNIST as torchvision expects (ROOT/FashionMNIST/raw/ with decompressed idx
    files) from Debian's package, installing it when possible. Returns the raw folder."""
    root = Path(root) if root is not None else default_root()
    raw = root / "FashionMNIST" / "raw"
    if all((raw / f).is_file() for f in FASHION_MNIST_FILES):
        return raw
    if not all((source / f"{f}.gz").is_file() for f in FASHION_MNIST_FILES) and install:
        why = _install_debian_package()
        if why is not None and not (source / f"{FASHION_MNIST_FILES[0]}.gz").is_file():
            raise DataNotFoundError(
                f"Fashion-MNIST not found in {source} and {DEBIAN_PACKAGE} could not be installed ({why}). "
                f"Run as root: `apt-get update && apt-get install -y {DEBIAN_PACKAGE}`, then `make data`; "
                f"or put the four idx files in {raw}, or use `lapguard data --download` with internet."
            )
    missing = [f"{f}.gz" for f in FASHION_MNIST_FILES if not (source / f"{f}.gz").is_file()]
    if missing:
        raise DataNotFoundError(f"Fashion-MNIST files missing in {source}: {', '.join(missing)}")
    raw.mkdir(parents=True, exist_ok=True)
    for name in FASHION_MNIST_FILES:
        with (
            atomic_path(raw / name) as tmp,
            gzip.open(source / f"{name}.gz", "rb") as src,
            open(tmp, "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
    return raw
