"""What batch scoring reads: discovering the inputs, and the ONE payload loader.

Inputs are image files, folders (searched recursively for image extensions), ``.npy``/``.npz``
arrays (a stack of images along the first axis: ``[N, H, W]``, ``[N, C, H, W]`` or
``[N, H, W, C]``, uint8 or floats in the value range) and in-memory arrays or data sets (the CLI
hands over a torchvision data set; this package never imports ``training``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from detector.errors import DataNotFoundError, InputError, LapguardError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
ARRAY_EXTENSIONS = frozenset({".npy", ".npz"})
#: Array names tried, in order, in an ``.npz`` holding more than one array.
NPZ_KEYS = ("images", "x", "arr_0")

Payload = bytes | np.ndarray


@dataclass(frozen=True)
class InMemoryInput:
    """An array (a stack of images along axis 0) or a data set whose items are an image or an
    ``(image, target)`` pair (image: array or tensor, HW/CHW/HWC), named for the output."""

    name: str
    data: np.ndarray | Dataset


class ArraySource:
    """Images by position in an array (memory-mapped for ``.npy``) or a data set."""

    def __init__(self, data: np.ndarray | Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def image(self, index: int) -> np.ndarray:
        item = self.data[index]
        if isinstance(item, (tuple, list)):  # (image, target) from a torchvision data set
            item = item[0]
        if isinstance(item, torch.Tensor):
            return item.numpy()
        return np.asarray(item)


@dataclass(frozen=True)
class InputItem:
    """One input: an image file (``path``), an item of an array or data set (``index``, with the
    array's ``path`` when the run has several sources), or an input already known to be unusable
    (``problem``, e.g. an array file that cannot be read)."""

    path: str | None = None
    index: int | None = None
    source: ArraySource | None = field(default=None, compare=False, repr=False)
    problem: str | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple[str | None, int | None]:
        return (self.path, self.index)

    def ids(self) -> dict[str, str | int]:
        """The identifying keys of this input's output row."""
        return {k: v for k, v in (("path", self.path), ("index", self.index)) if v is not None}


@dataclass(frozen=True)
class Unusable:
    """Marks an input that could not be read, decoded or converted, and why."""

    reason: str


InputLike = str | Path | np.ndarray | Dataset | InMemoryInput
# kind ("file" or "array"), name, the array's images, why the array cannot be used
_Entry = tuple[str, str, ArraySource | None, str | None]


def discover_inputs(inputs: Sequence[InputLike]) -> list[InputItem]:
    """The inputs, in order: folders expanded (recursively, sorted, image extensions only),
    arrays and data sets expanded by position, duplicates dropped. A path that does not exist
    is a :class:`DataNotFoundError` (nothing is scored); a file that cannot be read or decoded
    is not found out here but when it is scored."""
    entries = [entry for number, given in enumerate(inputs) for entry in _entries(number, given)]
    several = len(entries) > 1
    items: list[InputItem] = []
    seen: set[tuple[str | None, int | None]] = set()
    for kind, name, source, problem in entries:
        if kind == "file":
            batch = [InputItem(path=name)]
        elif source is None:  # an array that cannot be used: one row for the file
            batch = [InputItem(path=name, problem=problem)]
        else:
            label = name if several else None
            batch = [InputItem(path=label, index=i, source=source) for i in range(len(source))]
        for item in batch:
            if item.key not in seen:
                seen.add(item.key)
                items.append(item)
    if not items:
        raise DataNotFoundError(
            "no inputs to score: give image files, folders holding images "
            f"({', '.join(sorted(IMAGE_EXTENSIONS))}), .npy/.npz arrays or a data set"
        )
    return items


def _entries(number: int, given: InputLike) -> list[_Entry]:
    """What one given input expands to (a folder: its image files)."""
    if isinstance(given, InMemoryInput):
        return [("array", given.name, ArraySource(given.data), None)]
    if isinstance(given, (np.ndarray, Dataset)):
        return [("array", f"<input {number}>", ArraySource(given), None)]
    path = Path(given)
    if path.is_dir():
        found = sorted(
            p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        return [("file", str(p), None, None) for p in found]
    if path.is_file() and path.suffix.lower() in ARRAY_EXTENSIONS:
        try:
            return [("array", str(path), ArraySource(open_array(path)), None)]
        except InputError as error:
            return [("array", str(path), None, describe_error(error))]
    if path.exists():
        return [("file", str(path), None, None)]  # any other file: tried as an image
    raise DataNotFoundError(f"input {str(given)!r} does not exist")


def open_array(path: Path) -> np.ndarray:
    """A stack of images from ``.npy`` (memory-mapped) or ``.npz`` (its only array, else the
    first of ``images``, ``x``, ``arr_0``); :class:`InputError` when it is not one."""
    try:
        if path.suffix.lower() == ".npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            with np.load(path, allow_pickle=False) as archive:
                names = list(archive.files)
                name = (
                    names[0] if len(names) == 1 else next((k for k in NPZ_KEYS if k in names), None)
                )
                if name is None:
                    raise InputError(
                        f"{path} holds arrays {names}; keep one array, or name it one of {list(NPZ_KEYS)}"
                    )
                array = archive[name]
    except (OSError, ValueError, EOFError) as error:  # not an array file, or pickled objects
        raise InputError(f"cannot read {path} as a numpy array: {error}") from error
    if array.ndim not in (3, 4) or not (
        array.dtype == np.uint8 or np.issubdtype(array.dtype, np.floating)
    ):
        raise InputError(
            f"{path} is a {array.dtype} array of shape {list(array.shape)}; expected a stack of "
            "images [N, H, W], [N, C, H, W] or [N, H, W, C] of uint8 or floats"
        )
    return array


def load_payload(item: InputItem) -> Payload:
    """What an input holds: an image file's encoded bytes, or an array item's pixels (raises
    when it cannot be read)."""
    if item.problem is not None:
        raise InputError(item.problem)
    if item.source is not None and item.index is not None:
        return item.source.image(item.index)
    if item.path is None:
        raise InputError("an input with neither a path nor an index")
    return Path(item.path).read_bytes()


def read_payload(item: InputItem) -> Payload | Unusable:
    """:func:`load_payload`, with an input that cannot be read as :class:`Unusable` (an error
    row, never a failed run)."""
    try:
        return load_payload(item)
    except Exception as error:  # noqa: BLE001 - unreadable input: an error row, not a failed run
        return Unusable(describe_error(error))


def describe_error(error: BaseException) -> str:
    """One line saying why an input could not be scored."""
    if isinstance(error, LapguardError):
        text = str(error)
    elif isinstance(error, OSError) and error.strerror:
        text = f"cannot read the file: {error.strerror}"
    else:
        text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())


def dataset_input(name: str, dataset: Dataset, count: int | None = None) -> InMemoryInput:
    """The first ``count`` items (all when None) of a data set, named ``name``: its stored uint8
    images when the items are exactly those pixels scaled to [0, 1] (the same pixels, without
    decoding one image at a time), else the data set itself."""
    total = len(dataset)  # type: ignore[arg-type]
    count = total if count is None else min(count, total)
    stored = stored_images(dataset)
    if stored is not None:
        return InMemoryInput(name, np.asarray(stored[:count]))
    return InMemoryInput(name, Subset(dataset, range(count)))


def stored_images(dataset: Dataset) -> np.ndarray | torch.Tensor | None:
    """A torchvision data set's stored uint8 images (``data``, one per item) when its first and
    last items are exactly those pixels divided by 255; None otherwise. Checked on the items
    themselves, so whatever the data set's transform is, the pixels scored are its pixels."""
    stored = getattr(dataset, "data", None)
    total = len(dataset)  # type: ignore[arg-type]
    if stored is None or total == 0 or len(stored) != total:
        return None
    if str(stored.dtype) not in ("uint8", "torch.uint8"):
        return None
    return stored if all(_item_is_stored(dataset, stored, i) for i in (0, total - 1)) else None


def _item_is_stored(dataset: Dataset, stored: np.ndarray | torch.Tensor, index: int) -> bool:
    item = dataset[index]
    image = item[0] if isinstance(item, (tuple, list)) else item
    if not isinstance(image, torch.Tensor) or image.dtype != torch.float32:
        return False
    pixels = torch.as_tensor(np.asarray(stored[index])).float().div(255)
    layouts = [pixels, pixels.unsqueeze(0)]  # CHW or HW
    if pixels.ndim == 3:
        layouts.append(pixels.permute(2, 0, 1))  # HWC
    return any(layout.shape == image.shape and torch.equal(layout, image) for layout in layouts)
