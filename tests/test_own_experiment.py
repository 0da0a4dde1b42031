"""A user's own model, data, loss and metrics through `tfkv-run`: a regression on arrays, a
multi-label task with dict inputs from a tf.data factory, a factory that shards and batches
itself, and the one-line refusals of a factory or model that does not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = '''
"""A user's package: models and data factories tfkv knows nothing about."""
import keras
import numpy as np
import tensorflow as tf


def regression_data(split, seed):
    rng = np.random.default_rng(0 if split == "train" else 1)
    x = rng.standard_normal((512 if split == "train" else 128, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def whole_regression_data(split, seed):
    """regression_data's targets rounded to whole numbers."""
    x, y = regression_data(split, seed)
    return x, np.round(y)


def regressor(input_shape, units=16):
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Dense(units, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-4))(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def tags(split, labels=3):
    """Dict inputs, multi-hot labels: tag k is on when feature k of `a` plus `b` is positive."""
    n = 512 if split == "train" else 128
    rng = np.random.default_rng(2 if split == "train" else 3)
    a = rng.standard_normal((n, labels)).astype(np.float32)
    b = rng.standard_normal((n, 1)).astype(np.float32)
    y = ((a + b) > 0).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices(({"a": a, "b": b}, y))


def tagger(input_spec, labels=3):
    inputs = {name: keras.Input(shape=spec.shape, name=name) for name, spec in input_spec.items()}
    x = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    x = keras.layers.Dense(16, activation="relu")(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.Model(inputs, keras.layers.Dense(labels)(x))


def own_batches(split, rank, num_workers, batch_size):
    """Shards and batches itself; says how many classes there are."""
    import tfkv.data

    n = 600 if split == "train" else 100
    rng = np.random.default_rng(4 if split == "train" else 5)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(num_workers, rank)
    ds = ds.batch(batch_size, drop_remainder=split == "train")
    return tfkv.data.Split(ds, num_classes=4)


def not_data(split):
    return {"x": [1, 2, 3]}
'''


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "userpkg.py").write_text(textwrap.dedent(PACKAGE))
    return tmp_path


def run(project: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONPATH", None)  # the user's package imports because tfkv-run starts in its directory
    return subprocess.run([sys.executable, "-m", "tfkv.cli", "hydra.run.dir=out", "progress=false", *overrides],
                          cwd=project, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(project: Path) -> dict:
    return json.loads((project / "out" / "metrics.json").read_text())


def test_a_regression_on_arrays_with_mse_and_mae(project: Path) -> None:
    r = run(project, "model._target_=userpkg.regressor", "~model.hidden", "~model.dropout", "+model.units=16",
            "dataset._target_=userpkg.regression_data", "~dataset.test_fraction", "loss=mse", "metrics=[mae]",
            "objective=test_mae", "optimizer.lr=0.05", "epochs=4", "batch_size=32")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(project)
    first, last = m["history"][0], m["history"][-1]
    assert {"train_loss", "train_mae", "test_loss", "test_mae"} <= set(last)
    assert last["test_mae"] < first["test_mae"] and last["test_mae"] < 0.5, m["history"]
    assert "test_accuracy" not in last
    assert f"done: test_mae {last['test_mae']:.4f}" in r.stderr + r.stdout


def test_a_run_without_objective_returns_its_test_loss_as_keras_evaluates_it(project: Path) -> None:
    """Not a sweep, no `objective`, no accuracy reported: the run is not refused, and what it
    returns is test_loss, checked against Keras's own evaluate of the exported model. (Whole-number
    targets: tfkv's in-memory pipeline casts labels to int32, which truncates fractional regression
    targets; that is another defect, left to its owner, which this test must not hide behind.)"""
    import keras

    r = run(project, "model._target_=userpkg.regressor", "~model.hidden", "~model.dropout", "+model.units=16",
            "dataset._target_=userpkg.whole_regression_data", "~dataset.test_fraction", "loss=mse",
            "metrics=[mae]", "optimizer.lr=0.05", "epochs=2", "batch_size=32")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(project)
    sys.path.insert(0, str(project))
    try:
        import userpkg
    finally:
        sys.path.remove(str(project))
    x, y = userpkg.whole_regression_data("test", 0)
    model = keras.models.load_model(project / "out" / "model.keras", compile=False)
    model.compile(loss="mse", metrics=["mae"])
    loss, mae = model.evaluate(x, y, batch_size=128, verbose=0)
    assert m["test_loss"] == pytest.approx(loss, rel=1e-4) and m["test_mae"] == pytest.approx(mae, rel=1e-4)
    assert f"done: test_loss {loss:.4f}" in r.stderr + r.stdout


def test_a_multi_label_task_with_dict_inputs_on_two_devices(project: Path) -> None:
    r = run(project, "model._target_=userpkg.tagger", "~model.hidden", "~model.dropout",
            "dataset._target_=userpkg.tags", "~dataset.test_fraction",
            "loss={_target_:keras.losses.BinaryCrossentropy,from_logits:true}",
            "metrics=[accuracy,{_target_:keras.metrics.AUC,from_logits:true,multi_label:true,name:auc}]",
            "objective=test_auc", "kvstore=device", "devices=[cpu:0,cpu:1]", "optimizer.lr=0.1", "epochs=4",
            "batch_size=32")
    assert r.returncode == 0, r.stderr[-3000:]
    last = metrics(project)["history"][-1]
    assert last["test_accuracy"] > 0.8 and last["test_auc"] > 0.9, last


def test_a_factory_that_shards_and_batches_itself(project: Path) -> None:
    r = run(project, "dataset._target_=userpkg.own_batches", "~dataset.test_fraction", "epochs=2",
            "batch_size=50")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(project)
    assert m["history"][-1]["samples"] == 600  # 12 batches of 50, all of the factory's
    assert m["test_accuracy"] > 0.5


@pytest.mark.parametrize("overrides, words", [
    (["dataset._target_=userpkg.not_data", "~dataset.test_fraction"], ["dataset._target_=userpkg.not_data", "returned a dict"]),
    (["model._target_=userpkg.nothing"], ["model._target_", "userpkg", "nothing"]),
    (["model._target_=nopkg.nets.build"], ["model._target_", "cannot import"]),
    (["dataset._target_=userpkg.tags", "~dataset.test_fraction", "+dataset.labelz=3"], ["dataset.labelz", "labels"]),
    (["loss=mse", "metrics=[mae]", "objective=test_mae"], ["loss", "does not fit"]),
])
def test_what_does_not_fit_is_one_line(project: Path, overrides: list[str], words: list[str]) -> None:
    r = run(project, "epochs=1", *overrides)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("tfkv-run:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_a_saved_keras_model_trains_on(project: Path) -> None:
    import keras

    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Flatten()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.Dense(32, activation="relu")(x)))
    model.save(project / "start.keras")
    r = run(project, "model=saved", "model.path=start.keras", "epochs=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert metrics(project)["test_accuracy"] > 0.8
    r = run(project, "model=saved", "model.path=missing.keras", "epochs=1")
    assert r.returncode == 2 and "model.path=missing.keras" in r.stderr, r.stderr[-2000:]
