"""Labels keep their kind through tfkv's array pipeline: float targets (a regression, soft
labels) stay floats in every split and every worker's shard, class ids stay integers. The
end-to-end check is against an oracle outside tfkv: plain Keras `fit` on the same arrays, and
the exported model.keras evaluated by plain Keras on the test arrays."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tfkv.data import Source

PACKAGE = '''
import keras
import numpy as np

W = np.array([0.9, -0.7, 0.5, 0.3], np.float32)


def unit_targets(split):
    """A regression whose targets all lie in (0, 1): cast to int32, every one becomes 0."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    x = rng.standard_normal((1024 if split == "train" else 256, 4)).astype(np.float32)
    y = 1.0 / (1.0 + np.exp(-(x @ W)))
    return x, y.astype(np.float64)  # float64, as numpy computes it: tfkv takes it as float32


def class_ids(split):
    x, y = unit_targets(split)
    return x, (y > 0.5).astype(np.int64)


def regressor(input_shape):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(shape=input_shape)
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))
'''


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "labelpkg.py").write_text(textwrap.dedent(PACKAGE))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("labelpkg", None)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_float_targets_stay_floats_and_class_ids_stay_integers(project: Path, num_workers: int) -> None:
    import labelpkg

    for factory, dtype in (("unit_targets", np.float32), ("class_ids", np.int32)):
        expected = {split: getattr(labelpkg, factory)(split)[1] for split in ("train", "test")}
        for rank in range(num_workers):
            source = Source({"_target_": f"labelpkg.{factory}"}, seed=0, batch_size=32, eval_batch_size=100,
                            num_workers=num_workers, rank=rank)
            assert source.label_spec.dtype.as_numpy_dtype == dtype
            for split, batches in (("train", source.train(1)), ("test", source.test(num_workers, rank))):
                ys = np.concatenate([np.asarray(y).ravel() for _, y in batches])
                assert ys.dtype == dtype, (factory, split)
                # every label is one of the factory's, unchanged (float32 of the float64 given)
                assert np.isin(ys, expected[split].astype(dtype)).all(), (factory, split, ys[:5])


_KERAS_MAE: dict[str, float] = {}  # the oracle's test MAE: the same fit for every placement, fitted once


@pytest.mark.parametrize("placement", [
    ["kvstore=local", "devices=[cpu:0]"],
    ["kvstore=device", "devices=[cpu:0,cpu:1]"],
])
def test_a_regression_on_float_arrays_reaches_what_keras_fit_reaches(project: Path, placement: list[str]) -> None:
    import keras

    import labelpkg

    epochs, lr, batch = 8, 0.05, 32  # Keras reaches MAE ~0.02 by epoch 8 (0.01 by 20), well under 0.05
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(project), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-m", "tfkv.cli", "hydra.run.dir=out", "progress=false", *placement,
                        "model._target_=labelpkg.regressor", "~model.hidden", "~model.dropout",
                        "dataset._target_=labelpkg.unit_targets", "~dataset.test_fraction", "loss=mse",
                        "metrics=[mae]", "objective=test_mae", "optimizer=adam", f"optimizer.lr={lr}",
                        f"epochs={epochs}", f"batch_size={batch}"],
                       cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]

    x, y = labelpkg.unit_targets("train")
    xt, yt = labelpkg.unit_targets("test")
    exported = keras.saving.load_model(project / "out" / "model.keras", compile=False)
    tfkv_mae = float(np.mean(np.abs(exported.predict(xt, verbose=0).ravel() - yt)))

    if "mae" not in _KERAS_MAE:
        oracle = labelpkg.regressor((4,))
        oracle.compile(optimizer=keras.optimizers.Adam(lr), loss="mse")
        oracle.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True)
        _KERAS_MAE["mae"] = float(np.mean(np.abs(oracle.predict(xt, verbose=0).ravel() - yt)))
    keras_mae = _KERAS_MAE["mae"]

    always_zero = float(np.mean(np.abs(yt)))  # what training on truncated labels learns
    assert keras_mae < 0.05 < always_zero, (keras_mae, always_zero)
    assert tfkv_mae < 2 * keras_mae + 0.01, (tfkv_mae, keras_mae)
