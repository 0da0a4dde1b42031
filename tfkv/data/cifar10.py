"""CIFAR-10 from the python-pickle batches on disk, unpickled safely; downloads when allowed."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile

import numpy as np

from tfkv.data import safe_pickle
from tfkv.data.base import DataSet
from tfkv.data.download import FetchError, fetch, file_md5
from tfkv.errors import DataError

DIRNAME = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
ARCHIVE = "cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 32, 32, 3) uint8, labels (N,) int32) of one pickled batch file."""
    try:
        with open(path, "rb") as f:
            batch = safe_pickle.load(f, encoding="bytes")
    except Exception as e:  # noqa: BLE001 - whatever a corrupt or hostile pickle raises, the file is bad
        raise DataError(
            f"cifar10: cannot load {path} ({type(e).__name__}: {e}); "
            f"replace it with the original from {URL}"
        ) from e
    data = labels = None
    if isinstance(batch, dict):
        # the originals are py2 pickles with byte keys; a re-pickled copy may have str keys
        data = batch.get(b"data", batch.get("data"))
        labels = batch.get(b"labels", batch.get("labels"))
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[1] == 3 * 32 * 32 and labels is not None and len(labels) == len(data)):
        raise DataError(
            f"cifar10: {path} is not a CIFAR-10 batch (expected a dict with a uint8 (N, 3072) "
            f"'data' array and N 'labels'); replace it with the original from {URL}"
        )
    y = np.asarray(labels, dtype=np.int64)
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise DataError(f"cifar10: {path} has labels outside 0..9; replace it with the original")
    # rows are channel-first planes (1024 red, 1024 green, 1024 blue); models want NHWC
    x = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return x, y.astype(np.int32)


def _extract(archive: str, root: str) -> None:
    """Unpack the batches from `archive` into root/DIRNAME, refusing links and escaping paths."""
    target = os.path.join(root, DIRNAME)
    staging = tempfile.mkdtemp(dir=root, prefix=".cifar10-extract-")
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(DIRNAME + "/")]
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, members=members, filter="data")
            else:  # Python without extraction filters: allow only plain files under DIRNAME
                for m in members:
                    parts = m.name.split("/")
                    if not (m.isfile() or m.isdir()) or ".." in parts or os.path.isabs(m.name):
                        raise tarfile.TarError(f"unsafe member {m.name!r}")
                tar.extractall(staging, members=members)
        os.makedirs(target, exist_ok=True)
        extracted = os.path.join(staging, DIRNAME)
        for name in TRAIN_FILES + (TEST_FILE,):
            if os.path.isfile(os.path.join(extracted, name)):
                # file by file, so a concurrent reader never sees a half-written batch
                os.replace(os.path.join(extracted, name), os.path.join(target, name))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(
            f"cifar10: cannot extract {archive} ({e}); delete it and download it again from {URL}"
        ) from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _missing(directory: str) -> list[str]:
    return [n for n in TRAIN_FILES + (TEST_FILE,) if not os.path.isfile(os.path.join(directory, n))]


def _ensure(root: str, download: bool) -> str:
    directory = os.path.join(root, DIRNAME)
    missing = _missing(directory)
    if not missing:
        return directory
    archive = os.path.join(root, ARCHIVE)
    partial = "" if len(missing) == 6 else f"; missing {', '.join(missing)}"
    wanted = f"{DIRNAME}/ (data_batch_1..5, test_batch{partial})"
    if not os.path.isfile(archive):
        if not download:
            raise DataError(
                f"cifar10: put {wanted} under {root}, e.g. by extracting {URL} there, "
                "or set dataset.download=true"
            )
        try:
            fetch(URL, archive, md5=MD5)
        except FetchError as e:
            raise DataError(
                f"cifar10: put {wanted} under {root} (download failed: {e}); "
                f"get it by extracting {URL} there"
            ) from e
    digest = file_md5(archive)
    if digest != MD5:
        raise DataError(
            f"cifar10: {archive} has md5 {digest}, expected {MD5}; delete it and download it "
            f"again from {URL}"
        )
    _extract(archive, root)
    still = _missing(directory)
    if still:
        raise DataError(f"cifar10: {archive} lacks {', '.join(still)}; download it again from {URL}")
    return directory


def load(root: str = "data/cifar10", download: bool = True, augment: bool = True) -> DataSet:
    """The 50k/10k CIFAR-10 split as (N, 32, 32, 3) uint8 images; `augment`: random crop + flip
    of training images."""
    root = os.path.abspath(os.path.expanduser(str(root)))
    directory = _ensure(root, bool(download))
    train = [read_batch(os.path.join(directory, n)) for n in TRAIN_FILES]
    x_test, y_test = read_batch(os.path.join(directory, TEST_FILE))
    return DataSet(
        name="cifar10",
        x_train=np.concatenate([x for x, _ in train]),
        y_train=np.concatenate([y for _, y in train]),
        x_test=x_test,
        y_test=y_test,
        num_classes=10,
        mean=MEAN,
        std=STD,
        augment=bool(augment),
    )
