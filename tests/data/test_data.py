"""tfkv.data: loaders on tiny files in the real on-disk formats (through their conf/dataset entries),
safe unpickling, sharding, pipelines, and `Source`: any factory's data sharded, batched and counted
the same way on every worker.

Nothing here touches the network: every test uses download=False or replaces `urlopen`.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import subprocess
import sys
import tarfile
import urllib.error

import numpy as np
import pytest
from omegaconf import OmegaConf

import tfkv.data as data
from tfkv import cli
from tfkv.data import cifar10, download, mnist, safe_pickle
from tfkv.errors import ConfigError, DataError
from formats import idx_bytes, write_cifar, write_mnist

DATASET_CONF = os.path.join(cli.conf_dir(), "dataset")


def cfg(name: str, root=None, **kw):
    """conf/dataset/<name>.yaml with `kw` (and root, download=False where it has them) overriding it."""
    node = OmegaConf.load(os.path.join(DATASET_CONF, f"{name}.yaml"))
    if "root" in node:
        kw = {"root": str(root if root is not None else "."), **kw}
    if "download" in node:
        kw = {"download": False, **kw}
    return OmegaConf.merge(node, kw)


def load(node, seed: int = 0) -> data.DataSet:
    """The in-memory DataSet a built-in entry gives, as the trainer gets it (through Source)."""
    source = data.Source(node, seed, batch_size=1, eval_batch_size=1)
    assert source.memory is not None
    return source.memory


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(download, "urlopen", refuse)


# ---------------------------------------------------------------------------------------------
# MNIST (IDX)


@pytest.mark.parametrize("subdir", ["", "mnist"])
def test_mnist_round_trip(tmp_path, subdir):
    arrays = write_mnist(tmp_path / subdir)
    ds = load(cfg("mnist", tmp_path))
    assert ds.name == "mnist" and ds.num_classes == 10
    assert ds.x_train.shape == (5, 28, 28, 1) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (3, 28, 28, 1) and ds.input_shape == (28, 28, 1)
    assert ds.y_train.dtype == np.int32 and ds.y_test.dtype == np.int32
    np.testing.assert_array_equal(ds.x_train[..., 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(ds.x_test[..., 0], arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert ds.mean == (0.1307,) and ds.std == (0.3081,)


def test_mnist_truncated_file(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte") as e:
        load(cfg("mnist", tmp_path))
    assert "truncated" in str(e.value) and "\n" not in str(e.value)


def test_mnist_truncated_gzip(tmp_path):
    write_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz"):
        load(cfg("mnist", tmp_path))


def test_mnist_wrong_magic(tmp_path):
    write_mnist(tmp_path)
    # a labels file where the images should be: valid IDX, wrong kind
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros(3, np.uint8)))
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte.*magic 0x00000801"):
        load(cfg("mnist", tmp_path))


def test_mnist_missing_offline(tmp_path):
    with pytest.raises(DataError) as e:
        load(cfg("mnist", tmp_path))
    message = str(e.value)
    assert str(tmp_path) in message and "\n" not in message
    for name in mnist.FILES.values():
        assert name in message
    assert mnist.MIRRORS[0] in message


def test_mnist_download_failure_is_one_line(tmp_path):
    config = cfg("mnist", tmp_path, download=True)
    with pytest.raises(DataError, match="download failed") as e:
        load(config)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".part-")]  # no temp file left


def test_mnist_download_writes_files(tmp_path, monkeypatch):
    source = tmp_path / "source"
    arrays = write_mnist(source, gzip_name=None)
    requested = []

    def fake_urlopen(url, timeout):
        requested.append(url)
        assert timeout <= 10
        name = url.rsplit("/", 1)[1][: -len(".gz")]
        return io.BytesIO(gzip.compress((source / name).read_bytes()))

    monkeypatch.setattr(download, "urlopen", fake_urlopen)
    root = tmp_path / "root"
    config = cfg("mnist", root, download=True)
    ds = load(config)
    assert all(url.startswith(mnist.MIRRORS[0]) for url in requested) and len(requested) == 4
    assert sorted(os.listdir(root)) == sorted(n + ".gz" for n in mnist.FILES.values())
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])


# ---------------------------------------------------------------------------------------------
# CIFAR-10 (pickled batches)


def test_cifar10_round_trip(tmp_path):
    written = write_cifar(tmp_path)
    ds = load(cfg("cifar10", tmp_path))
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_train.dtype == np.uint8
    assert ds.x_test.shape == (4, 32, 32, 3) and ds.num_classes == 10
    assert ds.y_train.dtype == np.int32
    first = written["data_batch_1"][b"data"]
    # pixel (row 5, col 7) of image 2: red, green and blue planes are 1024 apart
    for c in range(3):
        assert ds.x_train[2, 5, 7, c] == first[2, c * 1024 + 5 * 32 + 7]
    expected_x = np.concatenate([written[n][b"data"] for n in cifar10.TRAIN_FILES])
    np.testing.assert_array_equal(ds.x_train.transpose(0, 3, 1, 2).reshape(20, 3072), expected_x)
    expected_y = sum((written[n][b"labels"] for n in cifar10.TRAIN_FILES), [])
    np.testing.assert_array_equal(ds.y_train, expected_y)
    np.testing.assert_array_equal(ds.y_test, written["test_batch"][b"labels"])
    assert len(ds.mean) == len(ds.std) == 3


def py2_batch_bytes(data_array, labels):
    """A batch pickled the way Python 2's cPickle wrote the original files: py2 `str` opcodes
    (U/T) for keys and raw bytes, and numpy's pre-2.0 `numpy.core.multiarray` path."""

    def s(b):
        return b"U" + bytes([len(b)]) + b

    def k(i):
        return b"K" + bytes([i])

    raw = data_array.tobytes()
    shape = b"(" + b"".join(b"J" + struct.pack("<i", d) for d in data_array.shape) + b"t"
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n" + k(0) + b"\x85"
             + s(b"b") + b"\x87R(" + k(1) + shape + b"cnumpy\ndtype\n" + s(b"u1") + k(0) + k(1)
             + b"\x87R(" + k(3) + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff" + k(0)
             + b"tb\x89T" + struct.pack("<I", len(raw)) + raw + b"tb")
    return (b"\x80\x02}(" + s(b"batch_label") + s(b"training batch 1 of 5") + s(b"data") + array
            + s(b"labels") + b"](" + b"".join(k(v) for v in labels) + b"eu.")


def test_cifar10_reads_python2_pickles(tmp_path):
    write_cifar(tmp_path)
    rng = np.random.default_rng(5)
    pixels = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
    labels = [3, 1, 4, 1]
    (tmp_path / cifar10.DIRNAME / "data_batch_1").write_bytes(py2_batch_bytes(pixels, labels))
    ds = load(cfg("cifar10", tmp_path))
    np.testing.assert_array_equal(ds.x_train[:4].transpose(0, 3, 1, 2).reshape(4, 3072), pixels)
    np.testing.assert_array_equal(ds.y_train[:4], labels)


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({b"data": _Evil(marker), b"labels": []}, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        safe_pickle.loads(payload)
    write_cifar(tmp_path)
    (tmp_path / cifar10.DIRNAME / "data_batch_3").write_bytes(payload)
    with pytest.raises(DataError, match="data_batch_3") as e:
        load(cfg("cifar10", tmp_path))
    assert "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_safe_pickle_reads_numpy_arrays(protocol):
    value = {b"data": np.arange(12, dtype=np.uint8).reshape(3, 4), b"labels": [1, 2, 3]}
    loaded = safe_pickle.loads(pickle.dumps(value, protocol=protocol))
    np.testing.assert_array_equal(loaded[b"data"], value[b"data"])
    assert loaded[b"labels"] == [1, 2, 3]


def test_safe_pickle_refuses_other_codecs():
    import codecs

    payload = pickle.dumps(codecs.encode, protocol=2)  # a bare reference to the global is fine...
    assert safe_pickle.loads(payload)("abc", "latin1") == b"abc"
    with pytest.raises(pickle.UnpicklingError):  # ...but only for latin1
        safe_pickle.loads(payload)("abc", "rot13")


def test_cifar10_wrong_layout(tmp_path):
    write_cifar(tmp_path)
    with open(tmp_path / cifar10.DIRNAME / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    with pytest.raises(DataError, match="test_batch.*not a CIFAR-10 batch"):
        load(cfg("cifar10", tmp_path))


def test_cifar10_missing_offline(tmp_path):
    with pytest.raises(DataError) as e:
        load(cfg("cifar10", tmp_path))
    message = str(e.value)
    assert "\n" not in message
    for part in (str(tmp_path), "cifar-10-batches-py", "data_batch_1..5", "test_batch", cifar10.URL):
        assert part in message


def test_cifar10_download_failure_is_one_line(tmp_path):
    config = cfg("cifar10", tmp_path, download=True)
    with pytest.raises(DataError, match="download failed") as e:
        load(config)
    assert str(tmp_path) in str(e.value) and cifar10.URL in str(e.value)
    assert "\n" not in str(e.value)


def _tarball(path, source_dir, extra=None):
    with tarfile.open(path, "w:gz") as tar:
        tar.add(source_dir, arcname=cifar10.DIRNAME)
        if extra is not None:
            tar.addfile(extra, io.BytesIO(b"x"))


def test_cifar10_extracts_local_archive(tmp_path, monkeypatch):
    written = write_cifar(tmp_path / "src")
    root = tmp_path / "root"
    root.mkdir()
    archive = root / cifar10.ARCHIVE
    _tarball(archive, tmp_path / "src" / cifar10.DIRNAME)
    monkeypatch.setattr(cifar10, "MD5", download.file_md5(str(archive)))
    ds = load(cfg("cifar10", root))
    np.testing.assert_array_equal(ds.y_test, written["test_batch"][b"labels"])
    assert not [p for p in os.listdir(root) if p.startswith(".cifar10-extract")]


def test_cifar10_archive_md5_mismatch(tmp_path):
    write_cifar(tmp_path / "src")
    _tarball(tmp_path / cifar10.ARCHIVE, tmp_path / "src" / cifar10.DIRNAME)
    with pytest.raises(DataError, match="md5"):
        load(cfg("cifar10", tmp_path))


def test_cifar10_archive_path_traversal_refused(tmp_path, monkeypatch):
    write_cifar(tmp_path / "src")
    root = tmp_path / "root"
    root.mkdir()
    escape = tarfile.TarInfo(f"{cifar10.DIRNAME}/../../escaped")
    escape.size = 1
    archive = root / cifar10.ARCHIVE
    _tarball(archive, tmp_path / "src" / cifar10.DIRNAME, extra=escape)
    monkeypatch.setattr(cifar10, "MD5", download.file_md5(str(archive)))
    with pytest.raises(DataError, match="cannot extract"):
        load(cfg("cifar10", root))
    assert not (tmp_path / "escaped").exists()


# ---------------------------------------------------------------------------------------------
# digits, synthetic, the conf entries


def test_builtin_sets_are_target_entries_and_an_unknown_one_is_one_line():
    names = sorted(p[:-5] for p in os.listdir(DATASET_CONF) if p.endswith(".yaml"))
    assert {"cifar10", "digits", "embedded_text", "mnist", "ptb", "synthetic"} <= set(names)
    for name in ("cifar10", "digits", "embedded_text", "mnist", "ptb", "synthetic"):
        node = cfg(name)
        assert node._target_.startswith("tfkv.data.") and callable(data.source.check(node))
    with pytest.raises(ConfigError) as e:
        load({"_target_": "tfkv.data.imagenet.load"})
    assert "dataset._target_='tfkv.data.imagenet.load': cannot import 'tfkv.data.imagenet'" in str(e.value)
    assert "\n" not in str(e.value)


def test_digits_split_is_fixed():
    a = load(cfg("digits", test_fraction=0.25), seed=0)
    b = load({"_target_": "tfkv.data.digits.load", "test_fraction": 0.25}, seed=123)
    assert a.x_train.shape[1:] == (8, 8, 1) and a.x_train.dtype == np.float32
    assert len(a.x_test) == round(1797 * 0.25) and len(a.x_train) + len(a.x_test) == 1797
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0
    np.testing.assert_array_equal(a.x_test, b.x_test)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert a.mean[0] == pytest.approx(float(a.x_train.mean()))
    with pytest.raises(ConfigError, match="test_fraction"):
        load(cfg("digits", test_fraction=0.0))


def test_digits_ship_inside_tfkv_and_load_without_scikit_learn_or_scipy(tmp_path):
    """The shipped arrays are UCI's 1797 digits as scikit-learn has them (their checksum, taken
    from sklearn.datasets.load_digits, and class counts); loading them imports neither
    scikit-learn nor SciPy, which tfkv no longer installs."""
    import hashlib
    import tomllib

    blocked = ("import sys\n"
               "for name in ('sklearn', 'scipy'):\n"
               "    sys.modules[name] = None  # import fails, as where they are not installed\n"
               "from tfkv.data import digits\n"
               "ds = digits.load()\n"
               "print(len(ds.x_train), len(ds.x_test))\n")
    r = subprocess.run([sys.executable, "-c", blocked], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1438", "359"]
    from tfkv.data import digits

    images, labels = digits.raw()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8 and images.max() == 16
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    digest = hashlib.sha256(images.astype(np.uint8).tobytes() + labels.astype(np.uint8).tobytes()).hexdigest()
    assert digest == "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert not [d for d in dependencies if d.lower().startswith(("scikit-learn", "sklearn", "scipy"))]


def test_synthetic_is_seeded_and_learnable():
    config = cfg("synthetic", num_train=300, num_test=50, shape=[4, 4, 2], num_classes=3)
    a, b, c = load(config, seed=1), load(config, seed=1), load(config, seed=2)
    assert a.x_train.shape == (300, 4, 4, 2) and a.x_test.shape == (50, 4, 4, 2)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int32 and a.num_classes == 3
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train, c.x_train)
    assert set(np.unique(a.y_train)) == {0, 1, 2}
    # the labels are a linear function of x: least squares on one-hot targets separates them
    x = np.concatenate([a.x_train, a.x_test]).reshape(350, -1)
    y = np.concatenate([a.y_train, a.y_test])
    w, *_ = np.linalg.lstsq(x, np.eye(3)[y], rcond=None)
    assert (np.argmax(x @ w, axis=1) == y).mean() > 0.8


def test_import_does_not_load_tensorflow():
    code = ("import sys, tfkv.data as d; "
            "s = d.Source({'_target_': 'tfkv.data.synthetic.load', 'num_train': 8, 'num_test': 8}, 0, 4, 4); "
            "assert s.steps == 2 and s.num_classes == 10; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))


# ---------------------------------------------------------------------------------------------
# sharding and pipelines


def split_sampler(length, num_parts, part_index):
    """The index list of MXNet's gluon.data SplitSampler (as used by its distributed examples)."""
    part_len = length // num_parts
    start = part_len * part_index
    end = start + part_len
    return list(range(start, end))


@pytest.mark.parametrize("length,num_parts", [(10, 1), (10, 3), (12, 4), (7, 7), (5, 8)])
def test_shard_range_matches_split_sampler(length, num_parts):
    seen = set()
    for part in range(num_parts):
        start, end = data.shard_range(length, num_parts, part)
        indices = list(range(start, end))
        assert indices == split_sampler(length, num_parts, part)
        assert not seen & set(indices)
        seen |= set(indices)
    assert len(seen) == (length // num_parts) * num_parts  # the remainder is dropped


def test_shard_range_validates():
    for args in [(10, 0, 0), (10, 2, 2), (10, 2, -1)]:
        with pytest.raises(ValueError):
            data.shard_range(*args)


def indexed_set(n_train=40, n_test=10, hw=4):
    """uint8 images whose pixels all equal the example's index, labels = index % 10."""
    x = np.broadcast_to(np.arange(n_train + n_test, dtype=np.uint8)[:, None, None, None],
                        (n_train + n_test, hw, hw, 1)).copy()
    y = (np.arange(n_train + n_test) % 10).astype(np.int32)
    return data.DataSet("indexed", x[:n_train], y[:n_train], x[n_train:], y[n_train:], 10,
                        mean=(0.5,), std=(0.25,))


def collect(dataset):
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in dataset])
    return np.stack(xs), np.stack(ys)


def test_steps_per_epoch():
    ds = indexed_set()
    assert data.steps_per_epoch(ds, 8) == 5
    assert data.steps_per_epoch(ds, 8, num_parts=3) == 13 // 8
    with pytest.raises(DataError, match="batch_size=16") as e:
        data.steps_per_epoch(ds, 16, num_parts=3)
    assert "13" in str(e.value) and "\n" not in str(e.value)


def test_train_dataset_order_and_normalisation():
    ds = indexed_set()
    seed, epoch, parts, part = 3, 2, 3, 1
    dataset = data.train_dataset(ds, 4, epoch=epoch, seed=seed, num_parts=parts, part_index=part)
    x_spec, y_spec = dataset.element_spec
    assert tuple(x_spec.shape) == (4, 4, 4, 1) and tuple(y_spec.shape) == (4,)
    assert x_spec.dtype.name == "float32" and y_spec.dtype.name == "int32"
    xs, ys = collect(dataset)
    start, end = data.shard_range(40, parts, part)  # [13, 26)
    order = start + np.random.default_rng([seed, epoch]).permutation(end - start)
    order = order[: (end - start) // 4 * 4]
    np.testing.assert_array_equal(ys.reshape(-1), ds.y_train[order])
    expected = (order.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.25)
    np.testing.assert_allclose(xs[:, :, 0, 0, 0].reshape(-1), expected, rtol=1e-6, atol=1e-6)


def test_train_dataset_deterministic_per_epoch():
    ds = indexed_set()
    a = collect(data.train_dataset(ds, 8, epoch=0, seed=0))
    b = collect(data.train_dataset(ds, 8, epoch=0, seed=0))
    c = collect(data.train_dataset(ds, 8, epoch=1, seed=0))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    # every epoch is a permutation of the whole (single) shard
    assert sorted(a[0][:, :, 0, 0, 0].reshape(-1).tolist()) == sorted(
        c[0][:, :, 0, 0, 0].reshape(-1).tolist())


def test_train_dataset_shards_are_disjoint():
    ds = indexed_set()
    seen = []
    for part in range(3):
        xs, _ = collect(data.train_dataset(ds, 4, epoch=0, seed=0, num_parts=3, part_index=part))
        ids = np.rint(xs[:, :, 0, 0, 0] * 0.25 * 255 + 0.5 * 255).astype(int).reshape(-1)
        start, end = data.shard_range(40, 3, part)
        assert ids.min() >= start and ids.max() < end
        seen.extend(ids.tolist())
    assert len(seen) == len(set(seen))


def test_train_dataset_rejects_too_small_shard():
    with pytest.raises(DataError, match="batch_size"):
        data.train_dataset(indexed_set(), 64, epoch=0, seed=0)


def test_augmentation_is_reproducible():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8)
    y = np.zeros(16, np.int32)
    ds = data.DataSet("img", x, y, x[:4], y[:4], 10, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    plain = collect(data.train_dataset(ds, 8, epoch=0, seed=0))[0]
    a = collect(data.train_dataset(ds, 8, epoch=0, seed=0, augment=True))[0]
    b = collect(data.train_dataset(ds, 8, epoch=0, seed=0, augment=True))[0]
    c = collect(data.train_dataset(ds, 8, epoch=1, seed=0, augment=True))[0]
    assert a.shape == plain.shape == (2, 8, 32, 32, 3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, plain)
    order_0 = np.random.default_rng([0, 0]).permutation(16)
    order_1 = np.random.default_rng([0, 1]).permutation(16)
    assert not np.array_equal(a.reshape(16, -1)[np.argsort(order_0)],
                              c.reshape(16, -1)[np.argsort(order_1)])
    # each augmented image is a shifted (and maybe mirrored) copy: its centre survives intact
    originals = x[order_0].astype(np.float32) / 255
    for got, src in zip(a.reshape(16, 32, 32, 3), originals):
        windows = [src, src[:, ::-1]]
        assert any(_is_shift(got, w) for w in windows)


def _is_shift(got, src, pad=4):
    padded = np.pad(src, [(pad, pad), (pad, pad), (0, 0)])
    return any(np.allclose(got, padded[i:i + 32, j:j + 32], atol=1e-6)
               for i in range(2 * pad + 1) for j in range(2 * pad + 1))


def test_small_images_are_not_augmented():
    ds = indexed_set()  # 4x4 images
    a = collect(data.train_dataset(ds, 8, epoch=0, seed=0, augment=True))[0]
    b = collect(data.train_dataset(ds, 8, epoch=0, seed=0))[0]
    np.testing.assert_array_equal(a, b)


def test_test_dataset_keeps_order_and_remainder():
    ds = indexed_set(n_test=10)
    batches = list(data.test_dataset(ds, 4))
    assert [int(x.shape[0]) for x, _ in batches] == [4, 4, 2]
    ys = np.concatenate([y.numpy() for _, y in batches])
    np.testing.assert_array_equal(ys, ds.y_test)
    xs = np.concatenate([x.numpy() for x, _ in batches])
    expected = (np.arange(40, 50, dtype=np.float32) / np.float32(255) - 0.5) / 0.25
    np.testing.assert_allclose(xs[:, 0, 0, 0], expected, rtol=1e-6, atol=1e-6)
    assert batches[0][0].dtype.name == "float32" and batches[0][1].dtype.name == "int32"


def test_token_ids_stay_integers_through_the_pipeline():
    """Token ids reach the model as the int32 they are stored as (a float cast would lose ids
    above 2**24), while image pixels become float32."""
    from tfkv.data import ptb

    ds = ptb.from_splits("tiny", {"train": ["a b c d e f g h i j k l"] * 4, "valid": ["a b c d e f g"],
                                  "test": ["a b c d e f g"]}, seq_len=5, vocab_size=0, eval_split="test")
    x, y = next(iter(data.train_dataset(ds, 2, epoch=0, seed=0)))
    assert x.dtype.name == "int32" and y.dtype.name == "int32"
    stored = {tuple(row) for row in ds.x_train.tolist()}
    assert all(tuple(row) in stored for row in x.numpy().tolist())  # the stored ids, unchanged
    xt, _ = next(iter(data.test_dataset(ds, 2)))
    assert xt.dtype.name == "int32"


# ---------------------------------------------------------------------------------------------
# Source: what tests/data/test_source.py leaves out (the context of each split, the wrong kinds of result)

CALLS: list[dict] = []


def sharded(split: str, rank: int, num_workers: int, batch_size: int, epoch: int, seed: int):
    """A factory that shards and batches itself: rank r holds 10 + r examples."""
    import tensorflow as tf

    CALLS.append({"split": split, "rank": rank, "num_workers": num_workers, "epoch": epoch, "seed": seed,
                  "batch_size": batch_size})
    n = 10 + rank
    x = tf.data.Dataset.from_tensor_slices(np.full((n, 1), rank * 100 + epoch, np.float32))
    y = tf.data.Dataset.from_tensor_slices(np.zeros(n, np.int32))
    return tf.data.Dataset.zip((x, y)).batch(batch_size, drop_remainder=split == "train")


def not_data():
    return {"x": [1, 2, 3]}


def forever():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((np.zeros((4, 1)), np.zeros(4))).repeat()


def test_each_split_is_asked_with_its_own_context(tf_devices):
    CALLS.clear()
    source = data.Source({"_target_": "test_data.sharded"}, 9, batch_size=4, eval_batch_size=5, num_workers=2, rank=1)
    assert source.steps == 10 // 4  # the fewest full batches of any rank (rank 0: 10 examples)
    assert [int(v) for x, _ in source.train(2) for v in x.numpy().ravel()] == [102] * 8  # its shard, epoch 2
    assert {(c["split"], c["rank"], c["num_workers"], c["seed"], c["batch_size"]) for c in CALLS} == \
        {("train", 0, 2, 9, 4), ("train", 1, 2, 9, 4)}
    CALLS.clear()
    assert sum(len(x) for x, _ in source.test()) == 10
    # the whole test split for every worker: rank 0 of 1, epoch 1, the evaluation batch size
    assert [(c["split"], c["rank"], c["num_workers"], c["epoch"], c["batch_size"]) for c in CALLS] == \
        [("test", 0, 1, 1, 5)]


@pytest.mark.parametrize("node, error, words", [
    ({"_target_": "test_data.not_data"}, DataError, ["dataset._target_=test_data.not_data returned a dict",
                                                     "a tf.data.Dataset of (x, y) pairs"]),
    ({"_target_": "test_data.forever"}, DataError, ["is infinite", "steps_per_epoch"]),
    ({"_target_": "nopkg_tfkv_test.make"}, ConfigError, ["cannot import 'nopkg_tfkv_test'"]),
])
def test_a_factory_returning_the_wrong_thing_is_one_line(tf_devices, node, error, words):
    with pytest.raises(error) as e:
        data.source.check(node)  # what validation finds before anything starts
        data.Source(node, 0, batch_size=8, eval_batch_size=8)
    for word in words:
        assert word in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
