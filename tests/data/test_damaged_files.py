"""Damaged data files, written here, through every built-in reader: one line naming the file and
where in it (byte, row, member), whether counting finds the damage or reading does, and for
tfkv-run a non-zero exit with that line instead of a traceback from inside tf.data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfkv.data import Source, csv_reader, tfrecord
from tfkv.errors import DataError

SPEC = {"x": {"shape": [3], "dtype": "float32"}, "y": {"shape": [], "dtype": "int64"}}


def _read_everything(node: dict, **context) -> None:
    """What the trainer does with a factory's data: count it, read the training epoch and the test split."""
    source = Source(node, seed=0, batch_size=4, eval_batch_size=8, **context)
    for _ in source.train(1):
        pass
    for _ in source.test():
        pass


def _one_line(error: pytest.ExceptionInfo, *words: str) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    for w in words:
        assert w in text, (w, text)
    return text


def _tfrecords(tmp_path: Path, n: int = 40) -> list[Path]:
    paths = []
    for k in range(2):
        ids = np.arange(k * n, (k + 1) * n)
        paths.append(tmp_path / f"part{k}.tfrecord")
        tfrecord.write(paths[-1], {"x": np.stack([ids] * 3, 1).astype(np.float32), "y": ids % 2})
    return paths


def _record_offsets(path: Path) -> list[int]:
    data, offsets, pos = path.read_bytes(), [], 0
    while pos < len(data):
        offsets.append(pos)
        pos += 16 + int.from_bytes(data[pos:pos + 8], "little")
    return offsets


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_tfrecord_with_a_damaged_record_is_one_line_naming_the_file_and_the_byte(tmp_path: Path) -> None:
    paths = _tfrecords(tmp_path)
    start = _record_offsets(paths[1])[25]
    _flip(paths[1], start + 12 + 5)  # inside the payload: its checksum fails, found only when read
    node = {"_target_": "tfkv.data.tfrecord.load", "files": str(tmp_path / "*.tfrecord"), "features": SPEC,
            "label": "y"}
    for context in ({}, {"num_workers": 2, "rank": 1}):
        with pytest.raises(DataError) as e:
            _read_everything(node, **context)
        # TensorFlow's offset: the payload's, 12 bytes (length and its checksum) into the record
        _one_line(e, f"dataset.files: {paths[1]} has a damaged record at byte {start + 12}", "corrupted record")


def test_a_tfrecord_with_a_damaged_length_is_one_line_while_counting(tmp_path: Path) -> None:
    paths = _tfrecords(tmp_path)
    start = _record_offsets(paths[0])[7]
    _flip(paths[0], start + 7)  # the length's top byte: a record of ~2**63 bytes
    with pytest.raises(DataError) as e:
        tfrecord.count_records(str(paths[0]))
    _one_line(e, f"dataset.files: {paths[0]} has a damaged record at byte {start}", "past the end of the file")
    # cut short: the last record's length runs past the end too
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[:-3])
    with pytest.raises(DataError) as e:
        tfrecord.count_records(str(paths[1]))
    _one_line(e, f"{paths[1]} has a damaged record at byte {_record_offsets(paths[1])[-1]}")


def test_a_damaged_compressed_tfrecord_is_one_line_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "d.tfrecord.gz"
    with tf.io.TFRecordWriter(str(path), options="GZIP") as writer:
        for i in range(200):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, i, i])),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2]))})).SerializeToString())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # cut in the middle of the compressed stream
    with pytest.raises(DataError) as e:
        tfrecord.count_records(str(path), "GZIP")
    _one_line(e, f"dataset.files: {path} has a damaged record")


def _csvs(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "a.csv", tmp_path / "b.csv"]
    for k, path in enumerate(paths):
        ids = list(range(k * 30, (k + 1) * 30))
        csv_reader.write(path, {"a": ids, "b": [i / 2 for i in ids], "y": [i % 2 for i in ids]})
    return paths


@pytest.mark.parametrize("row,words", [
    ("17,x,1", "row 9 of {path} has 'x' in column 'b', not a float32 number"),
    ("17,8.5", "row 9 of {path} has 2 fields, not 3 (a, b, y)"),
    ("17,8.5,", "row 9 of {path} has '' in column 'y', not an int64 number"),
])
def test_a_csv_row_that_does_not_read_is_one_line_naming_the_file_and_the_row(tmp_path: Path, row: str,
                                                                             words: str) -> None:
    paths = _csvs(tmp_path)
    lines = paths[1].read_text().splitlines()
    lines[8] = row  # the header is row 1
    paths[1].write_text("\n".join(lines) + "\n")
    node = {"_target_": "tfkv.data.csv_reader.load", "files": str(tmp_path / "*.csv"), "label": "y"}
    with pytest.raises(DataError) as e:
        _read_everything(node)
    _one_line(e, "dataset.files: " + words.format(path=paths[1]))


def test_a_csv_with_bytes_that_are_not_text_is_one_line_while_counting(tmp_path: Path) -> None:
    paths = _csvs(tmp_path)
    data = paths[0].read_bytes().split(b"\n")
    data[20] = b"\xff\xfe\x00garbage"
    paths[0].write_bytes(b"\n".join(data))
    with pytest.raises(DataError) as e:
        csv_reader.count_rows(str(paths[0]), True, ",")
    _one_line(e, f"dataset.files: line", f"of {paths[0]} cannot be read as CSV")


def test_an_image_that_does_not_decode_is_one_line_naming_it(tmp_path: Path) -> None:
    for i in range(20):
        folder = tmp_path / "img" / ("odd" if i % 2 else "even")
        folder.mkdir(parents=True, exist_ok=True)
        tf.io.write_file(str(folder / f"{i:03d}.png"), tf.io.encode_png(tf.fill([4, 5, 3], np.uint8(i))))
    bad = tmp_path / "img" / "odd" / "013.png"
    bad.write_bytes(bad.read_bytes()[:30])  # cut short: a PNG header and nothing to decode
    node = {"_target_": "tfkv.data.images.load", "directory": str(tmp_path / "img"), "image_size": [4, 5],
            "validation_split": 0.5}
    with pytest.raises(DataError) as e:
        for seed in range(4):  # whichever split the damaged image falls in
            source = Source(node, seed=seed, batch_size=2, eval_batch_size=2)
            for batches in (source.train(1), source.test()):
                for _ in batches:
                    pass
    _one_line(e, f"dataset.directory: {bad} is not a readable image")


def test_npy_and_npz_cut_short_are_one_line_naming_the_file(tmp_path: Path) -> None:
    from tfkv.data import npy

    x, y = np.zeros((50, 3), np.float32), np.arange(50)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    (tmp_path / "x.npy").write_bytes((tmp_path / "x.npy").read_bytes()[:300])
    with pytest.raises(DataError) as e:
        npy.load(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))
    _one_line(e, f"{tmp_path / 'x.npy'}")
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y)
    data = (tmp_path / "d.npz").read_bytes()
    member = data.index(b"x_train.npy")
    # the member's array bytes end early (its local header and the zip directory intact)
    (tmp_path / "d.npz").write_bytes(data[:member + 200] + data[member + 200 + 400:])
    with pytest.raises(DataError) as e:
        npy.load(npz=str(tmp_path / "d.npz"))
    _one_line(e, "dataset.npz", f"{tmp_path / 'd.npz'}")


def test_tfkv_run_on_a_damaged_tfrecord_exits_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    paths = _tfrecords(tmp_path, n=200)
    start = _record_offsets(paths[1])[150]
    _flip(paths[1], start + 12 + 3)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run([sys.executable, "-m", "tfkv.cli", "hydra.run.dir=out", "progress=false", "epochs=1",
                        "dataset=tfrecord", f"dataset.files={{train: '{tmp_path}/part*.tfrecord', "
                        f"test: '{paths[0]}'}}", "dataset.features={x: {shape: [3]}, y: {dtype: int64}}",
                        "dataset.label=y", "dataset.num_classes=2", "batch_size=16", "model.hidden=[8]"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"tfkv-run: dataset\.files: {re.escape(str(paths[1]))} has a damaged record at byte "
                        rf"{start + 12} \(corrupted record at {start + 12}\); replace the file, or leave it out of "
                        r"dataset\.files", last), last
