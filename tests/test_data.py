"""Data sets through the real torchvision loaders: the embedded set, on-disk formats, OOD sets."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from detector.errors import ConfigError, DataNotFoundError
from detector.networks import InputSpec
from tests.ondisk import write_cifar, write_mnist, write_svhn, write_tiny_imagenet
from training.data.datasets import (
    dataset_info,
    load_dataset,
    load_ood,
    prepare_fashion_mnist,
    subset,
    to_arrays,
    train_val_split,
)


def test_embedded_fashion_mnist(data_root) -> None:
    train = load_dataset("fashion-mnist", "train", root=data_root)
    test = load_dataset("fashion-mnist", "test", root=data_root)
    assert (len(train), len(test)) == (60000, 10000)
    x, y = test[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    assert 0 <= y < 10


def test_prepare_is_idempotent_and_explains_a_missing_source(tmp_path, data_root) -> None:
    assert prepare_fashion_mnist(data_root) == data_root / "FashionMNIST" / "raw"
    with pytest.raises(DataNotFoundError, match="files missing in"):
        prepare_fashion_mnist(tmp_path / "root", source=tmp_path / "nowhere", install=False)
    assert not (tmp_path / "root" / "FashionMNIST").exists()


def test_seeded_splits(data_root) -> None:
    train = load_dataset("fashion-mnist", "train", root=data_root)
    a_train, a_val = train_val_split(train, 0.1, seed=1)
    b_train, b_val = train_val_split(train, 0.1, seed=1)
    c_train, _ = train_val_split(train, 0.1, seed=2)
    assert (len(a_train), len(a_val)) == (54000, 6000)
    assert a_val.indices == b_val.indices and a_train.indices != c_train.indices
    assert not set(a_train.indices) & set(a_val.indices)
    x1, y1 = to_arrays(subset(train, 50, seed=4))
    x2, y2 = to_arrays(train, 50, seed=4)
    assert x1.dtype == np.float32 and x1.shape == (50, 1, 28, 28)
    np.testing.assert_array_equal(y1, y2)
    with pytest.raises(ConfigError):
        train_val_split(train, 1.5, seed=0)


@pytest.mark.parametrize(
    ("name", "writer", "shape"),
    [
        ("cifar10", lambda root: write_cifar(root, classes=10), (3, 32, 32)),
        ("cifar100", lambda root: write_cifar(root, classes=100), (3, 32, 32)),
        ("svhn", write_svhn, (3, 32, 32)),
        ("mnist", write_mnist, (1, 28, 28)),
        ("imagefolder", write_tiny_imagenet, (3, 64, 64)),
    ],
)
def test_torchvision_on_disk_formats(tmp_path, name, writer, shape) -> None:
    with pytest.raises(DataNotFoundError, match=str(tmp_path.resolve())):
        load_dataset(name, "train", root=tmp_path, verify=False)
    writer(tmp_path)
    for split in ("train", "test"):
        dataset = load_dataset(name, split, root=tmp_path, verify=False)
        x, y = dataset[0]
        assert tuple(x.shape) == shape and x.dtype == torch.float32
        assert tuple(x.shape) == dataset_info(name).input_spec().shape
        assert int(y) >= 0


class _RunsCode:
    """A pickle that would create a file when loaded (the kind a tampered batch holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_unverified_cifar_batches_never_run_code(tmp_path) -> None:
    """Without the md5 check, CIFAR's pickled batches are read by an unpickler that builds only
    containers and arrays: a batch naming any other callable is refused, and so is a truncated
    one, each with an error naming the file; the payload never runs."""
    write_cifar(tmp_path, classes=10)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    marker = tmp_path / "ran"
    batch.write_bytes(pickle.dumps({"data": _RunsCode(marker), "labels": [0]}))
    with pytest.raises(DataNotFoundError, match="data_batch_1.*not allowed in a data batch"):
        load_dataset("cifar10", "train", root=tmp_path, verify=False)
    assert not marker.exists()
    write_cifar(tmp_path, classes=10)
    batch.write_bytes(batch.read_bytes()[:100])
    with pytest.raises(DataNotFoundError, match="data_batch_1 is not a readable CIFAR batch"):
        load_dataset("cifar10", "train", root=tmp_path, verify=False)


def test_image_folder_problems_name_the_folder_or_file(tmp_path) -> None:
    """A split folder without class folders, and an image file that is not an image, are
    DataNotFoundErrors naming where (they were a FileNotFoundError and a PIL traceback)."""
    (tmp_path / "imagefolder" / "train").mkdir(parents=True)
    with pytest.raises(DataNotFoundError, match="imagefolder.*class folder"):
        load_dataset("imagefolder", "train", root=tmp_path)
    write_tiny_imagenet(tmp_path / "tiny")
    broken = next((tmp_path / "tiny" / "tiny-imagenet-200" / "val").rglob("*.JPEG"))
    broken.write_bytes(b"not a jpeg")
    dataset = load_dataset("imagefolder", "test", root=tmp_path / "tiny")
    with pytest.raises(DataNotFoundError, match=f"{broken.name} is not a readable image"):
        to_arrays(dataset)


def test_md5_verification_refuses_copies_by_default(tmp_path) -> None:
    write_cifar(tmp_path, classes=10)
    with pytest.raises(DataNotFoundError, match="not found"):
        load_dataset("cifar10", "train", root=tmp_path)


def test_unknown_names() -> None:
    with pytest.raises(ConfigError, match="unknown data set 'imagenet-21k'"):
        dataset_info("imagenet-21k")
    with pytest.raises(ConfigError, match="split must be"):
        load_dataset("fashion-mnist", "validation")


def test_ood_sets_take_the_in_distribution_shape(data_root) -> None:
    gray = InputSpec(channels=1, height=28, width=28, mean=[0.5], std=[0.5])
    rgb = InputSpec(channels=3, height=32, width=32, mean=[0.5] * 3, std=[0.5] * 3)
    digits = load_ood("digits", gray, 64, seed=0)
    assert digits.shape == (64, 1, 28, 28) and digits.dtype == np.float32
    assert digits.min() >= 0 and digits.max() <= 1 and digits.std() > 0.1
    np.testing.assert_array_equal(digits, load_ood("digits", gray, 64, seed=0))
    noise = load_ood("noise", rgb, 10, seed=1)
    assert noise.shape == (10, 3, 32, 32) and noise.min() >= 0 and noise.max() <= 1
    mnist_like = load_ood("fashion-mnist", rgb, 5, root=data_root)
    assert mnist_like.shape == (5, 3, 32, 32)


def test_subsets_are_prefixes_of_one_seeded_order(data_root) -> None:
    test = load_dataset("fashion-mnist", "test", root=data_root)
    small, large, everything = (
        subset(test, 10, seed=5),
        subset(test, 200, seed=5),
        subset(test, 10**6, seed=5),
    )
    assert small.indices == large.indices[:10] == everything.indices[:10]
    assert sorted(everything.indices) == list(range(len(test)))
