"""Small real files in the formats the data readers take (MNIST's IDX, CIFAR-10's pickled
batches), written by the tests that read them."""

import gzip
import os
import pickle

import numpy as np

from tfkv.data import cifar10


def idx_bytes(array: np.ndarray) -> bytes:
    magic = 0x0800 | array.ndim  # 0x08 = unsigned byte
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(directory, n_train=5, n_test=3, gzip_name="train-images-idx3-ubyte"):
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    os.makedirs(directory, exist_ok=True)
    for name, array in arrays.items():
        raw = idx_bytes(array)
        if name == gzip_name:
            with open(os.path.join(directory, name + ".gz"), "wb") as f:
                f.write(gzip.compress(raw))
        else:
            with open(os.path.join(directory, name), "wb") as f:
                f.write(raw)
    return arrays


def write_cifar(root, n=4):
    rng = np.random.default_rng(2)
    directory = root / cifar10.DIRNAME
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in cifar10.TRAIN_FILES + (cifar10.TEST_FILE,):
        batch = {
            b"batch_label": f"{name} of 5".encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(n)],
        }
        with open(directory / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)  # the originals are protocol-2 pickles
        written[name] = batch
    return written
