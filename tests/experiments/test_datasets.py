"""The experiments read MNIST and CIFAR-10 from their standard file formats.

The files are written here, byte by byte to the published layouts (big-endian idx with a
magic number; pickled CIFAR python batches), so the loaders are checked without a download.
"""

import gzip
import pathlib
import pickle

import numpy as np
import pytest

from gradcomm_experiments import data as datasets


def write_idx(path: pathlib.Path, array: np.ndarray, *, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files(tmp_path, compress):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (6, 28, 28)),
        "train-labels-idx1-ubyte": rng.integers(0, 10, 6),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28)),
        "t10k-labels-idx1-ubyte": np.array([9, 0, 4]),
    }
    (tmp_path / "mnist").mkdir()
    for name, array in arrays.items():
        write_idx(tmp_path / "mnist" / name, array, compress=compress)

    data = datasets.load_dataset("mnist", str(tmp_path))

    assert data.x_train.shape == (6, 28, 28, 1) and data.x_train.dtype == np.float32
    np.testing.assert_array_equal(
        data.x_test[..., 0], (arrays["t10k-images-idx3-ubyte"] / 255.0).astype(np.float32)
    )
    np.testing.assert_array_equal(data.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(data.y_test, [9, 0, 4])
    assert data.num_classes == 10


def test_cifar10_python_batches(tmp_path):
    rng = np.random.default_rng(1)
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        pixels = rng.integers(0, 256, (2, 3 * 32 * 32), dtype=np.uint8)
        labels = rng.integers(0, 10, 2).tolist()
        written[name] = (pixels, labels)
        with open(root / name, "wb") as f:
            pickle.dump({b"data": pixels, b"labels": labels}, f)

    data = datasets.load_dataset("cifar10", str(tmp_path))

    assert data.x_train.shape == (10, 32, 32, 3) and data.x_test.shape == (2, 32, 32, 3)
    pixels, labels = written["test_batch"]
    # Channel-major rows: the first 1024 bytes are the red plane, row by row.
    np.testing.assert_array_equal(
        data.x_test[1, 0, :, 0], (pixels[1, :32] / 255.0).astype(np.float32)
    )
    np.testing.assert_array_equal(data.x_test[0, 31, 31, 2], np.float32(pixels[0, -1] / 255.0))
    np.testing.assert_array_equal(data.y_test, labels)
    np.testing.assert_array_equal(data.y_train[:2], written["data_batch_1"][1])


def test_missing_files_and_unknown_datasets_fail_clearly(tmp_path):
    with pytest.raises(SystemExit, match="train-images-idx3-ubyte"):
        datasets.load_dataset("mnist", str(tmp_path))
    with pytest.raises(SystemExit, match="CIFAR-10 python batches"):
        datasets.load_dataset("cifar10", str(tmp_path))
    with pytest.raises(SystemExit, match="needs --data-dir"):
        datasets.load_dataset("mnist", None)
    with pytest.raises(SystemExit, match="unknown dataset"):
        datasets.load_dataset("imagenet", str(tmp_path))


def test_digits_is_the_default_and_stratified():
    data = datasets.load_dataset("digits", None, seed=0)
    assert (
        data.x_train.shape[1:] == (8, 8, 1) and 0 <= data.x_train.min() <= data.x_train.max() <= 1
    )
    assert len(data.x_train) + len(data.x_test) == 1797
    assert set(np.unique(data.y_test)) == set(range(10))
