"""The built-in streaming readers (TFRecord, image folder, CSV, npy/npz) on real files written here:
the right examples, disjoint shards covering the set, a shuffle fixed by (seed, epoch), exact
cardinality, Keras's folder conventions, flat memory for mapped arrays, and one line for bad input."""

from __future__ import annotations

import functools
import inspect
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from tfkv import target
from tfkv.data import csv_reader, images, npy, streaming, tfrecord
from tfkv.data.base import Context
from tfkv.data.source import PROVIDED, Split
from tfkv.errors import ConfigError, DataError

N = 37  # not a multiple of the batch or the worker count: remainders are where counts go wrong
SPEC = {"x": {"shape": [3], "dtype": "float32"}, "y": {"shape": [], "dtype": "int64"}}


def _ids_y(x, y):
    return np.asarray(y).astype(int).tolist()


def _tfrecord(tmp_path):
    ids = np.arange(N)
    x = np.stack([ids, 2 * ids, 3 * ids], 1).astype(np.float32)
    for k in range(3):  # several files of unequal length
        tfrecord.write(tmp_path / f"part{k}.tfrecord", {"x": x[k::3], "y": ids[k::3]})
    load = functools.partial(tfrecord.load, str(tmp_path / "*.tfrecord"), SPEC, "y")
    return load, _ids_y, lambda i: [i, 2 * i, 3 * i]


def _csv(tmp_path):
    ids = list(range(N))
    csv_reader.write(tmp_path / "a.csv", {"a": ids[:20], "b": [i / 2 for i in ids[:20]], "y": ids[:20]})
    csv_reader.write(tmp_path / "b.csv", {"a": ids[20:], "b": [i / 2 for i in ids[20:]], "y": ids[20:]})
    return functools.partial(csv_reader.load, str(tmp_path / "*.csv"), "y"), _ids_y, lambda i: [i, i / 2]


def _npy(tmp_path):
    ids = np.arange(N)
    np.save(tmp_path / "x.npy", np.stack([ids, -ids], 1).astype(np.float32))
    np.save(tmp_path / "y.npy", ids)
    return functools.partial(npy.load, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")), _ids_y, lambda i: [i, -i]


def _npz(tmp_path):
    ids = np.arange(N)
    x = np.stack([ids, -ids], 1).astype(np.float32)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=ids, x_test=x, y_test=ids)
    return functools.partial(npy.load, npz=str(tmp_path / "d.npz")), _ids_y, lambda i: [i, -i]


def _images(tmp_path):
    for i in range(N):  # image i is filled with the value i (PNG is lossless): x says which one it is
        folder = tmp_path / "img" / ("odd" if i % 2 else "even")
        folder.mkdir(parents=True, exist_ok=True)
        tf.io.write_file(str(folder / f"{i:03d}.png"), tf.io.encode_png(tf.fill([4, 5, 3], np.uint8(i))))

    def load(**ctx):
        result = images.load(str(tmp_path / "img"), image_size=[4, 5], **ctx)
        assert isinstance(result, Split) and result.num_classes == 2
        return result.data

    def ids(x, y):
        x, y = np.asarray(x), np.asarray(y)
        assert (y == ["even", "odd"].index("odd") * (x[:, 0, 0, 0] % 2)).all()  # class = sorted folder name
        return x[:, 0, 0, 0].astype(int).tolist()

    return load, ids, lambda i: np.full([4, 5, 3], float(i))


READERS = {"tfrecord": _tfrecord, "csv": _csv, "npy": _npy, "npz": _npz, "images": _images}


@pytest.fixture(params=list(READERS))
def reader(request, tmp_path):
    return READERS[request.param](tmp_path)


def _take(reader, **ctx):
    """(ids in the order read, batches counted, cardinality, x of each id)."""
    load, ids = reader[:2]
    ds = load(**ctx)
    order, xs, n = [], {}, 0
    for x, y in ds:
        batch_ids = ids(x, y)
        order += batch_ids
        for k, i in enumerate(batch_ids):
            xs[i] = np.asarray(x[k])
        n += 1
    return order, n, int(ds.cardinality()), xs


def test_reads_every_example_once(reader):
    order, batches, cardinality, xs = _take(reader, split="test", batch_size=4)
    assert sorted(order) == list(range(N))
    for i, x in xs.items():
        np.testing.assert_allclose(x, reader[2](i))
    assert batches == cardinality == -(-N // 4)  # the test split keeps its last, smaller batch


def test_shards_are_disjoint_and_cover_the_set(reader):
    shards = [_take(reader, batch_size=1, rank=r, num_workers=3, seed=5, epoch=2)[0] for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(N))
    assert [len(s) for s in shards] == [13, 12, 12]


def test_shuffle_is_fixed_by_seed_and_epoch(reader):
    first = _take(reader, batch_size=1, seed=3, epoch=1)[0]
    assert first == _take(reader, batch_size=1, seed=3, epoch=1)[0]  # a resumed epoch replays its order
    assert first != _take(reader, batch_size=1, seed=3, epoch=2)[0]
    assert first != _take(reader, batch_size=1, seed=4, epoch=1)[0]
    assert sorted(first) == list(range(N))


@pytest.mark.parametrize("workers", [1, 3])
def test_cardinality_is_exact(reader, workers):
    for rank in range(workers):
        order, batches, cardinality, _ = _take(reader, batch_size=4, rank=rank, num_workers=workers)
        shard = len(range(rank, N, workers))
        assert batches == cardinality == shard // 4  # training: full batches only
        assert len(order) == 4 * batches


# -- TFRecord -----------------------------------------------------------------------------------

def test_tfrecord_several_inputs_are_a_dict_and_bytes_decode(tmp_path):
    pixels = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2, 1)
    png = [tf.io.encode_png(tf.constant(p)).numpy() for p in pixels]
    tfrecord.write(tmp_path / "d.tfrecord", {"raw": [p.tobytes() for p in pixels], "png": png,
                                             "n": np.arange(6), "y": np.arange(6) % 2})
    features = {"raw": {"shape": [2, 2, 1], "dtype": "string", "decode": "uint8", "scale": 2},
                "png": {"shape": [2, 2, 1], "dtype": "string", "decode": "image"},
                "n": {"shape": [], "dtype": "int64"}, "y": {"dtype": "int64"}}
    x, y = next(iter(tfrecord.load(str(tmp_path / "*.tfrecord"), features, "y", split="test", batch_size=6)))
    assert sorted(x) == ["n", "png", "raw"]
    order = x["n"].numpy()
    np.testing.assert_array_equal(x["raw"].numpy(), pixels[order] / 2)
    np.testing.assert_array_equal(x["png"].numpy(), pixels[order])
    np.testing.assert_array_equal(y.numpy(), order % 2)


def test_tfrecord_counts_are_cached_until_the_file_changes(tmp_path):
    path = tmp_path / "d.tfrecord"
    tfrecord.write(path, {"x": np.zeros((5, 3), np.float32), "y": np.arange(5)})
    assert tfrecord.count_records(str(path)) == 5
    tfrecord.write(path, {"x": np.zeros((9, 3), np.float32), "y": np.arange(9)})
    assert tfrecord.count_records(str(path)) == 9
    ds = tfrecord.load(str(path), SPEC, "y", batch_size=2)
    assert int(ds.cardinality()) == len(list(ds)) == 4


@pytest.mark.parametrize("change,error,words", [
    ({"features": {"x": {"shape": [3], "dtype": "int64"}}}, DataError, "dataset.features.x.dtype=int64 but"),
    ({"features": {"x": {"shape": [4], "dtype": "float32"}}}, DataError, "dataset.features.x.shape=[4] holds 4"),
    ({"features": {"z": {"shape": [3]}}}, DataError, "dataset.features.z: the records of"),
    ({"features": {"x": {"shape": [3], "dtype": "float64"}}}, ConfigError, "dataset.features.x.dtype='float64'"),
    ({"features": {"x": {"shape": [3], "dtyp": "float32"}}}, ConfigError, "dataset.features.x has unknown key"),
    ({"features": {"x": {"shape": [3], "decode": "uint8"}}}, ConfigError, "set dataset.features.x.dtype=string"),
    ({"label": "label"}, ConfigError, "dataset.label='label' is not one of dataset.features"),
    ({"files": "nowhere/*.tfrecord"}, ConfigError, "dataset.files='nowhere/*.tfrecord' matches no file"),
    ({"files": {"train": "*.tfrecord"}, "split": "test"}, ConfigError, "dataset.files has no 'test' entry"),
])
def test_tfrecord_bad_input_is_one_line(tmp_path, monkeypatch, change, error, words):
    monkeypatch.chdir(tmp_path)
    tfrecord.write(tmp_path / "d.tfrecord", {"x": np.zeros((4, 3), np.float32), "y": np.arange(4)})
    args = {"files": "*.tfrecord", "features": SPEC, "label": "y"}
    args = {**args, **change, "features": {**SPEC, **change.get("features", {})}}
    with pytest.raises(error) as e:
        tfrecord.load(**args)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_tfrecord_not_tfrecords_is_one_line(tmp_path):
    (tmp_path / "d.tfrecord").write_bytes(b"not a record file at all")
    with pytest.raises(DataError, match=r"dataset.files: .*d.tfrecord"):
        tfrecord.load(str(tmp_path / "*.tfrecord"), SPEC, "y")


# -- image folder -------------------------------------------------------------------------------

def test_images_follow_keras_image_dataset_from_directory(tmp_path):
    rng = np.random.default_rng(0)
    for name, count in (("zebra", 3), ("ant", 4), ("moth", 2)):
        (tmp_path / name / "sub").mkdir(parents=True)
        for i in range(count):  # nested folders and both formats, as keras finds them
            img = tf.constant(rng.integers(0, 255, (6, 8, 3), dtype=np.uint8))
            where = tmp_path / name / ("sub" if i % 2 else "") / f"{i}.png"
            tf.io.write_file(str(where), tf.io.encode_png(img))
    (tmp_path / "ant" / "notes.txt").write_text("not an image")
    ours = images.load(str(tmp_path), image_size=[3, 4], color_mode="grayscale", label_mode="categorical",
                       split="test", batch_size=32)
    theirs = tf.keras.utils.image_dataset_from_directory(str(tmp_path), image_size=(3, 4), color_mode="grayscale",
                                                         label_mode="categorical", shuffle=False, batch_size=32)

    def pairs(ds):
        return sorted((y.tobytes(), x.round(3).tobytes()) for xb, yb in ds for x, y in zip(xb.numpy(), yb.numpy()))

    assert ours.num_classes == 3
    x, y = next(iter(ours.data))
    assert x.shape == (9, 3, 4, 1) and x.dtype == tf.float32 and y.shape == (9, 3)
    assert pairs(ours.data) == pairs(theirs)


def test_images_validation_split_is_disjoint_and_fixed(tmp_path):
    for i in range(10):
        (tmp_path / f"c{i % 2}").mkdir(exist_ok=True)
        tf.io.write_file(str(tmp_path / f"c{i % 2}" / f"{i}.png"), tf.io.encode_png(tf.fill([2, 2, 1], np.uint8(i))))

    def ids(split, epoch):
        data = images.load(str(tmp_path), image_size=[2, 2], color_mode="grayscale", validation_split=0.3,
                           split=split, epoch=epoch, batch_size=1).data
        return sorted(int(x[0, 0, 0, 0]) for x, _ in data)

    train, test = ids("train", 1), ids("test", 1)
    assert len(train) == 7 and len(test) == 3 and sorted(train + test) == list(range(10))
    assert ids("train", 2) == train  # the held-out part does not move between epochs


def test_images_bad_input_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="dataset.directory=.* is not a folder"):
        images.load(str(tmp_path / "missing"))
    (tmp_path / "cls").mkdir()
    with pytest.raises(DataError, match="holds no .bmp/.gif/.jpeg/.jpg/.png file"):
        images.load(str(tmp_path))
    (tmp_path / "cls" / "x.png").write_bytes(b"garbage")
    with pytest.raises(DataError, match="x.png is not a readable image"):
        images.load(str(tmp_path))


# -- CSV ----------------------------------------------------------------------------------------

def test_csv_select_and_unpacked_columns(tmp_path):
    csv_reader.write(tmp_path / "d.csv", {"a": [1, 2], "name": ["p", "q"], "b": [0.5, 1.5], "y": [0.25, 0.75]})
    x, y = next(iter(csv_reader.load(str(tmp_path / "d.csv"), "y", select=["b", "a"], split="test", batch_size=2)))
    np.testing.assert_array_equal(x.numpy(), [[0.5, 1], [1.5, 2]])  # in select's order
    assert y.dtype == tf.float32  # a regression target stays a float
    x, _ = next(iter(csv_reader.load(str(tmp_path / "d.csv"), "y", pack=False, split="test", batch_size=2)))
    assert sorted(x) == ["a", "b", "name"] and x["name"].numpy().tolist() == [b"p", b"q"]


def test_csv_without_header(tmp_path):
    (tmp_path / "d.csv").write_text("1,2,0\n3,4,1\n5,6,0\n")
    ds = csv_reader.load(str(tmp_path / "d.csv"), "c", header=False, column_names=["a", "b", "c"],
                         split="test", batch_size=8)
    x, y = next(iter(ds))
    assert x.numpy().tolist() == [[1, 2], [3, 4], [5, 6]] and y.numpy().tolist() == [0, 1, 0]
    assert int(ds.cardinality()) == 1


@pytest.mark.parametrize("kwargs,error,words", [
    ({"label": "target"}, ConfigError, "dataset.label='target' is not a column of"),
    ({"label": "y", "select": ["a", "zz"]}, ConfigError, "dataset.select: zz not among the columns"),
    ({"label": "y", "select": ["a", "y"]}, ConfigError, "dataset.select: the label 'y' is in it"),
    ({"label": "y"}, ConfigError, "dataset.select: column(s) s hold text"),
    ({"label": "s", "select": ["a"]}, ConfigError, "dataset.label='s' holds text"),
    ({"label": "y", "header": False}, ConfigError, "dataset.column_names: the files have no header"),
    ({"label": "y", "files": "*.tsv"}, ConfigError, "dataset.files='*.tsv' matches no file"),
])
def test_csv_bad_input_is_one_line(tmp_path, monkeypatch, kwargs, error, words):
    monkeypatch.chdir(tmp_path)
    csv_reader.write(tmp_path / "d.csv", {"a": [1, 2], "s": ["p", "q"], "y": [0, 1]})
    with pytest.raises(error) as e:
        csv_reader.load(**{"files": "*.csv", **kwargs})
    assert words in str(e.value) and "\n" not in str(e.value)


# -- npy / npz ----------------------------------------------------------------------------------

def test_npz_compressed_or_mismatched_is_one_line(tmp_path):
    np.savez_compressed(tmp_path / "c.npz", x_train=np.zeros((4, 2)), y_train=np.zeros(4))
    with pytest.raises(DataError, match="is compressed .* save it with np.savez"):
        npy.load(npz=str(tmp_path / "c.npz"))
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 2)), y_train=np.zeros(3))
    with pytest.raises(DataError, match="x has 4 rows, y 3 "):
        npy.load(npz=str(tmp_path / "d.npz"))
    with pytest.raises(ConfigError, match="dataset.x_key='inputs' is not in .* \\(it has x_train, y_train\\)"):
        npy.load(npz=str(tmp_path / "d.npz"), x_key="inputs")
    with pytest.raises(ConfigError, match="dataset.x=.* is not a file"):
        npy.load(x=str(tmp_path / "none.npy"), y=str(tmp_path / "none.npy"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_npy_memory_stays_flat_while_the_map_is_read(tmp_path):
    rows = 200 * 1024  # 200 MiB of uint8 rows: read whole, it would show in this process's RSS
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.uint8, shape=(rows, 1024))
    x[:] = 7
    x.flush()
    del x
    np.save(tmp_path / "y.npy", np.zeros(rows, np.int32))
    ds = npy.load(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"), batch_size=4096)
    before = _rss_mib()
    seen = sum(int(tf.reduce_sum(tf.cast(xb[:, 0], tf.int32))) for xb, _ in ds)
    assert seen == 7 * (rows // 4096) * 4096
    assert _rss_mib() - before < 100, "the mapped pages stayed resident"
    os.remove(tmp_path / "x.npy")


# -- through tfkv-run -----------------------------------------------------------------------------

def _separable(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """4 features; the class is the sign of the first: learnable in one short epoch."""
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def _tfrecord_run(tmp_path):
    for split, seed in (("train", 0), ("test", 1)):
        x, y = _separable(512 if split == "train" else 128, seed)
        tfrecord.write(tmp_path / f"{split}.tfrecord", {"x": x, "y": y})
    return ["dataset=tfrecord", f"dataset.files={{train: {tmp_path}/train.tfrecord, test: {tmp_path}/test.tfrecord}}",
            "dataset.features={x: {shape: [4]}, y: {dtype: int64}}", "dataset.label=y", "dataset.num_classes=2"]


def _csv_run(tmp_path):
    for split, seed in (("train", 0), ("test", 1)):
        x, y = _separable(512 if split == "train" else 128, seed)
        csv_reader.write(tmp_path / f"{split}.csv", {**{c: x[:, i] for i, c in enumerate("abcd")}, "y": y})
    return ["dataset=csv", f"dataset.files={{train: {tmp_path}/train.csv, test: {tmp_path}/test.csv}}",
            "dataset.label=y", "dataset.num_classes=2"]


def _npy_run(tmp_path):
    for split, seed in (("train", 0), ("test", 1)):
        x, y = _separable(512 if split == "train" else 128, seed)
        np.save(tmp_path / f"x_{split}.npy", x)
        np.save(tmp_path / f"y_{split}.npy", y)
    return ["dataset=npy", f"dataset.x={{train: {tmp_path}/x_train.npy, test: {tmp_path}/x_test.npy}}",
            f"dataset.y={{train: {tmp_path}/y_train.npy, test: {tmp_path}/y_test.npy}}", "dataset.num_classes=2"]


def _images_run(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(320):  # dark and bright images
        bright = i % 2
        (tmp_path / "img" / f"c{bright}").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 100, (8, 8, 1)) + 150 * bright
        tf.io.write_file(str(tmp_path / "img" / f"c{bright}" / f"{i}.png"), tf.io.encode_png(pixels.astype(np.uint8)))
    return ["dataset=image_folder", f"dataset.directory={tmp_path}/img", "dataset.image_size=[8,8]",
            "dataset.color_mode=grayscale", "dataset.validation_split=0.2"]



def test_a_reader_takes_tfkvs_values_by_name_and_gets_them_as_one_checked_context():
    """streaming.reader: tfkv sees a reader take split, seed, epoch, batch_size, rank and
    num_workers by name (so it shards and batches itself), the reader gets them as one Context (a
    reader's defaults where not given), and a split, a batch size or a rank that cannot be is one
    line before the reader runs."""
    seen = []

    @streaming.reader
    def load(files, label="y", *, context):
        seen.append((files, label, context))
        return "batches"

    assert load("f", rank=1, num_workers=2, epoch=3) == "batches"
    assert seen == [("f", "y", Context(split="train", seed=0, epoch=3, batch_size=32, rank=1, num_workers=2))]
    assert all(target.accepts(load, name) for name in PROVIDED) and not target.accepts(load, "context")
    for bad, message in [({"rank": 2, "num_workers": 2}, "rank=2 must be in [0, num_workers=2)"),
                         ({"split": "valid"}, "split='valid' must be one of train, test"),
                         ({"batch_size": 0}, "batch_size=0 must be at least 1")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load("f", **bad)
    assert len(seen) == 1


@pytest.mark.parametrize("reader", [images.load, npy.load, csv_reader.load, tfrecord.load],
                         ids=["image_folder", "npy", "csv", "tfrecord"])
def test_the_built_in_readers_take_tfkvs_values_with_a_readers_defaults(reader):
    params = inspect.signature(reader).parameters
    assert {name: params[name].default for name in PROVIDED} == {
        "split": "train", "seed": 0, "epoch": 1, "batch_size": 32, "rank": 0, "num_workers": 1}


@pytest.mark.slow
@pytest.mark.parametrize("make", [_tfrecord_run, _csv_run, _npy_run, _images_run],
                         ids=["tfrecord", "csv", "npy", "image_folder"])
def test_tfkv_run_trains_from_the_reader(tmp_path, make):
    import json

    from conftest import tfkv_run

    args = make(tmp_path)
    tfkv_run(*args, "epochs=1", "batch_size=16", "eval_batch_size=50", "model.hidden=[16]",
             cwd=tmp_path)
    (path,) = tmp_path.glob("outputs/*/*/metrics.json")
    metrics = json.loads(path.read_text())
    assert metrics["epoch"] == 1
    assert metrics["test_accuracy"] >= 0.8, metrics  # learnt from the files: chance is 0.5
