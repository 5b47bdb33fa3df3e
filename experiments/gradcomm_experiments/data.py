"""Datasets: scikit-learn's digits, MNIST and CIFAR-10 from their files, and shuffled batches."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass
class Dataset:
    """Images in NHWC float32 and integer labels, split into train and test."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images), a stratified split, scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Dataset("digits", x_train, y_train, x_test, y_test)


def _read_idx(path: pathlib.Path) -> np.ndarray:
    """An MNIST idx file (optionally gzipped): big-endian magic, dims, then uint8 data."""
    import gzip

    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(directory: pathlib.Path, names: Sequence[str]) -> pathlib.Path:
    for name in names:
        for candidate in (directory / name, directory / (name + ".gz")):
            if candidate.exists():
                return candidate
    raise ValueError(f"--data-dir: none of {list(names)} (or .gz) found in {directory}")


# MNIST's four idx files, each under either of its usual names.
MNIST_FILES = {
    "x_train": ["train-images-idx3-ubyte", "train-images.idx3-ubyte"],
    "y_train": ["train-labels-idx1-ubyte", "train-labels.idx1-ubyte"],
    "x_test": ["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"],
    "y_test": ["t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"],
}
CIFAR10_FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]


def _root(name: str, data_dir: str | os.PathLike) -> pathlib.Path:
    """`data_dir`, or its subdirectory that the dataset's archive unpacks to."""
    root = pathlib.Path(data_dir)
    sub = root / ("mnist" if name == "mnist" else "cifar-10-batches-py")
    return sub if sub.is_dir() else root


def check_files(name: str, data_dir: str | os.PathLike) -> None:
    """Raises ValueError, naming what is missing, unless `data_dir` holds `name`'s files."""
    root = _root(name, data_dir)
    if name == "mnist":
        for names in MNIST_FILES.values():
            _find(root, names)
    elif missing := [f for f in CIFAR10_FILES if not (root / f).exists()]:
        raise ValueError(f"--data-dir: {', '.join(missing)} not found in {root}: expected "
                         "the CIFAR-10 python batches (cifar-10-batches-py)")  # fmt: skip


def load_mnist(data_dir: str | os.PathLike) -> Dataset:
    """MNIST from the four standard idx files in `data_dir` (or `data_dir/mnist`)."""
    root = _root("mnist", data_dir)
    arrays = {key: _read_idx(_find(root, names)) for key, names in MNIST_FILES.items()}
    images = {k: (arrays[k] / 255.0).astype(np.float32)[..., None] for k in ("x_train", "x_test")}
    labels = {k: arrays[k].astype(np.int32) for k in ("y_train", "y_test")}
    return Dataset(
        "mnist", images["x_train"], labels["y_train"], images["x_test"], labels["y_test"]
    )


def load_cifar10(data_dir: str | os.PathLike) -> Dataset:
    """CIFAR-10 from the standard python batches (`cifar-10-batches-py`) in `data_dir`."""
    import pickle

    root = _root("cifar10", data_dir)

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        with open(root / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        x = batch[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return (x / 255.0).astype(np.float32), np.asarray(batch[b"labels"], np.int32)

    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = read("test_batch")
    return Dataset(
        "cifar10",
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        x_test,
        y_test,
    )


DATASETS = ("digits", "mnist", "cifar10")


def load_dataset(name: str, data_dir: str | None, seed: int = 0) -> Dataset:
    """digits (bundled with scikit-learn), or MNIST / CIFAR-10 from --data-dir."""
    if name == "digits":
        return load_digits(seed)
    if name not in DATASETS:
        raise SystemExit(f"unknown dataset {name!r}: choose from {', '.join(DATASETS)}")
    if data_dir is None:
        raise SystemExit(f"--dataset {name} needs --data-dir with its files")
    try:
        check_files(name, data_dir)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return load_mnist(data_dir) if name == "mnist" else load_cifar10(data_dir)


def batches(
    x: np.ndarray, y: np.ndarray, global_batch: int, seed: int, epoch: int
) -> list[dict[str, Any]]:
    """One epoch of shuffled full batches (the remainder is dropped), the same in every process."""
    order = np.random.default_rng([seed, epoch]).permutation(len(x))
    count = len(x) // global_batch
    return [{"x": x[idx], "y": y[idx]} for idx in np.split(order[: count * global_batch], count)]
