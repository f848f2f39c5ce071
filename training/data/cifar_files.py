"""CIFAR-10/100 batches whose md5 is not checked (re-encoded copies, small test files), read
without running code from them.

CIFAR's python batches are pickles. torchvision unpickles them with :func:`pickle.load`, which is
safe only for the originals its md5 check recognises; a file that skips the check could run any
code it names. These data sets read every batch and the meta file with :class:`BatchUnpickler`,
which builds only dicts, lists, strings, bytes, numbers and numpy arrays, and refuse anything
else naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
from torchvision import datasets
from torchvision.datasets.vision import VisionDataset

from detector.errors import DataNotFoundError

# The only globals a CIFAR batch names: numpy's array reconstruction (numpy 1 and 2 paths).
ALLOWED_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)


class BatchUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers and numpy arrays only."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a data batch")
        return super().find_class(module, name)


def read_batch(path: str | Path) -> dict[str, Any]:
    """One CIFAR python batch (or meta file) as a dict, read with :class:`BatchUnpickler`; a
    file that is not such a batch is a DataNotFoundError naming it."""
    try:
        data = Path(path).read_bytes()
        entry = BatchUnpickler(io.BytesIO(data), encoding="latin1").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError) as error:
        raise DataNotFoundError(f"{path} is not a readable CIFAR batch: {error}") from error
    if not isinstance(entry, dict):
        raise DataNotFoundError(f"{path} is not a CIFAR batch: it holds {type(entry).__name__}")
    return entry


class _UnverifiedCIFAR(datasets.CIFAR10):
    """torchvision's CIFAR layout and attributes, every file read with :func:`read_batch`."""

    def __init__(
        self, root: str, train: bool = True, transform: Any = None, download: bool = False
    ):
        VisionDataset.__init__(self, root, transform=transform)
        self.train = train
        if download:
            self.download()
        if not self._check_integrity():
            raise RuntimeError("Dataset not found or corrupted")
        data: list[np.ndarray] = []
        targets: list[int] = []
        for file_name, _ in self.train_list if train else self.test_list:
            path = Path(self.root) / self.base_folder / file_name
            entry = read_batch(path)
            labels = entry.get("labels", entry.get("fine_labels"))
            if not isinstance(entry.get("data"), np.ndarray) or labels is None:
                raise DataNotFoundError(f"{path} lacks a CIFAR batch's 'data' array or labels")
            data.append(entry["data"])
            targets.extend(int(label) for label in labels)
        try:
            self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))
        except ValueError as error:
            raise DataNotFoundError(
                f"the CIFAR batches under {root} are not 3x32x32 images: {error}"
            ) from error
        self.targets = targets
        self._load_meta()

    def _load_meta(self) -> None:
        path = Path(self.root) / self.base_folder / self.meta["filename"]
        self.classes = list(read_batch(path)[self.meta["key"]])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


class CIFAR10Files(_UnverifiedCIFAR):
    """CIFAR-10 whose files are checked for presence only (md5 None)."""

    train_list = [(name, None) for name, _ in datasets.CIFAR10.train_list]
    test_list = [(name, None) for name, _ in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}


class CIFAR100Files(_UnverifiedCIFAR):
    """CIFAR-100 whose files are checked for presence only (md5 None)."""

    base_folder = datasets.CIFAR100.base_folder
    url = datasets.CIFAR100.url
    filename = datasets.CIFAR100.filename
    tgz_md5 = datasets.CIFAR100.tgz_md5
    train_list = [(name, None) for name, _ in datasets.CIFAR100.train_list]
    test_list = [(name, None) for name, _ in datasets.CIFAR100.test_list]
    meta = {**datasets.CIFAR100.meta, "md5": None}
