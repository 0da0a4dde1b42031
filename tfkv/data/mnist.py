"""MNIST from its IDX files on disk (plain or gzipped), downloading them when allowed."""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from tfkv.data.base import DataSet
from tfkv.data.download import FetchError, fetch
from tfkv.errors import DataError

FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
# IDX magic: two zero bytes, the element type (0x08 = uint8), the number of dimensions.
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
MEAN, STD = (0.1307,), (0.3081,)


def read_idx(path: str, magic: int) -> np.ndarray:
    """The uint8 array stored in IDX file `path`; DataError if it is not one or is cut short."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if path.endswith(".gz"):
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError
        raise DataError(f"mnist: cannot read {path} ({e}); delete it and download it again") from e
    if len(raw) < 4 or int.from_bytes(raw[:4], "big") != magic:
        found = f"0x{int.from_bytes(raw[:4], 'big'):08x}" if len(raw) >= 4 else "nothing"
        raise DataError(
            f"mnist: {path} is not an IDX file of this kind (magic {found}, expected 0x{magic:08x}); "
            "replace it with the original file"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"mnist: {path} is truncated inside its header; delete it and download it again")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims))
    if len(raw) - header != expected:
        raise DataError(
            f"mnist: {path} holds {len(raw) - header} data bytes but its header {dims} needs "
            f"{expected}; the file is truncated or corrupt, delete it and download it again"
        )
    # copy: a view of the `bytes` would be read-only and pin the whole file buffer
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()


def _find(root: str, name: str) -> str | None:
    # torchvision keeps the same files under MNIST/raw, so a shared data directory works as is.
    for directory in (root, os.path.join(root, "mnist"), os.path.join(root, "MNIST", "raw")):
        for suffix in ("", ".gz"):
            path = os.path.join(directory, name + suffix)
            if os.path.isfile(path):
                return path
    return None


def _download(root: str, name: str) -> str:
    reasons = []
    for mirror in MIRRORS:
        try:
            return fetch(mirror + name + ".gz", os.path.join(root, name + ".gz"))
        except FetchError as e:
            reasons.append(str(e))
    raise FetchError("; ".join(reasons))


def _locate(root: str, download: bool) -> dict[str, str]:
    paths = {key: _find(root, name) for key, name in FILES.items()}
    missing = [FILES[k] for k, p in paths.items() if p is None]
    if not missing:
        return paths  # type: ignore[return-value]
    where = f"{root} (or {os.path.join(root, 'mnist')})"
    wanted = ", ".join(missing)
    if not download:
        raise DataError(
            f"mnist: missing {wanted} (plain or .gz) in {where}; put them there from "
            f"{MIRRORS[0]} or set dataset.download=true"
        )
    for key, name in FILES.items():
        if paths[key] is None:
            try:
                paths[key] = _download(root, name)
            except FetchError as e:
                raise DataError(
                    f"mnist: missing {wanted} (plain or .gz) in {where} and the download failed "
                    f"({e}); put the files there from {MIRRORS[0]}"
                ) from e
    return paths  # type: ignore[return-value]


def load(root: str = "data/mnist", download: bool = True) -> DataSet:
    """The 60k/10k MNIST split as (N, 28, 28, 1) uint8 images; `seed` is unused (fixed split)."""
    root = os.path.abspath(os.path.expanduser(str(root)))
    paths = _locate(root, bool(download))
    arrays = {}
    for key, path in paths.items():
        arrays[key] = read_idx(path, IMAGES_MAGIC if key.startswith("x") else LABELS_MAGIC)
    for split in ("train", "test"):
        x, y = arrays["x_" + split], arrays["y_" + split]
        if len(x) != len(y):
            raise DataError(
                f"mnist: {paths['x_' + split]} has {len(x)} images but {paths['y_' + split]} has "
                f"{len(y)} labels; the files do not belong together, download them again"
            )
        if len(y) and int(y.max()) > 9:
            raise DataError(f"mnist: {paths['y_' + split]} has label {int(y.max())} > 9; replace it")
    if arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]:
        raise DataError(
            f"mnist: train images are {arrays['x_train'].shape[1:]} but test images are "
            f"{arrays['x_test'].shape[1:]}; the files do not belong together, download them again"
        )
    return DataSet(
        name="mnist",
        x_train=arrays["x_train"][..., None],
        y_train=arrays["y_train"].astype(np.int32),
        x_test=arrays["x_test"][..., None],
        y_test=arrays["y_test"].astype(np.int32),
        num_classes=10,
        mean=MEAN,
        std=STD,
    )
