"""Loss and metrics from the config: regression and multi-label tasks learn, one step is Keras's
gradient of the mean loss plus regularisation, a model with dict inputs, two outputs, BatchNorm
and an L2 regulariser trains on every single-machine store and reports what Keras reports, and
BatchNorm statistics are averaged over one worker's copies.

Tolerances: the step comparison sums per-device gradients of summed losses (then rescales by
1/batch) where Keras differentiates the mean directly; in float32 that is round-off, ~1e-7
relative, checked at 1e-5 relative (and 1e-6 absolute), far below a missed term (the
regulariser alone moves the weights by ~1e-3 here).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim, store
from tfkv.errors import ConfigError
from tfkv.parallel.criterion import Criterion
from tfkv.parallel.data_parallel import DataParallel

BATCH = 32


def _regression_data(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ np.linspace(-1, 1, 8).astype(np.float32) + 0.5)[:, None]
    return tf.constant(x), tf.constant(y)


def _multilabel_data(seed=0, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = np.random.default_rng(99).normal(size=(8, 4)).astype(np.float32)
    return tf.constant(x), tf.constant((x @ w > 0).astype(np.float32))


def _dense(outputs, activation=None):
    def build():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(outputs, activation=activation)(h))
    return build


def _store(kind, devices):
    return store.create(kind, devices=devices)


def _learn(devices, kind, build, data, criterion, steps=40):
    keras.utils.set_random_seed(1)
    dp = DataParallel(build, devices, _store(kind, devices), optim.Adam(schedule=optim.Schedule(lr=0.02)),
                      [BATCH // len(devices)] * len(devices), criterion=criterion)
    test = [data(seed=100)]
    before = dp.evaluate(test)
    for s in range(steps):
        dp.step(*data(seed=s))
    return dp, before, dp.evaluate(test)


@pytest.mark.parametrize("kind", ["local", "device"])
@pytest.mark.parametrize("loss", ["mse", "mae"])
def test_regression_learns(kind, loss, tf_devices):
    dp, before, after = _learn(tf_devices[:2], kind, _dense(1), _regression_data, Criterion(loss, ["mae"]))
    assert set(after) == {"loss", "mae"}
    assert after["loss"] < 0.3 * before["loss"] and after["mae"] < 0.5 * before["mae"], (before, after)
    if loss == "mae":
        assert after["loss"] == pytest.approx(after["mae"], rel=1e-5)  # the same quantity, two ways
    train, seen = dp.take_metrics()
    assert seen == 40 * BATCH and set(train) == {"loss", "mae"}


@pytest.mark.parametrize("kind", ["local", "device"])
def test_multilabel_learns(kind, tf_devices):
    crit = Criterion("binary_crossentropy", ["accuracy"])
    _, before, after = _learn(tf_devices[:2], kind, _dense(4, "sigmoid"), _multilabel_data, crit)
    assert after["loss"] < 0.6 * before["loss"] and after["accuracy"] > 0.9 > before["accuracy"], (before, after)


def test_accuracy_maps_from_the_loss_as_keras_compile_does():
    def accuracy(loss):
        (_, _, metric), = Criterion(loss, ["accuracy"]).new_metrics([None])
        return type(metric).__name__, getattr(metric, "threshold", None)

    assert accuracy("sparse_categorical_crossentropy") == ("SparseCategoricalAccuracy", None)
    assert accuracy(None) == ("SparseCategoricalAccuracy", None)  # the default: sparse CE on logits
    assert accuracy("categorical_crossentropy") == ("CategoricalAccuracy", None)
    assert accuracy("binary_crossentropy") == ("BinaryAccuracy", 0.5)
    assert accuracy({"_target_": "keras.losses.BinaryCrossentropy", "from_logits": True}) == ("BinaryAccuracy", 0.0)
    (name, _, metric), = Criterion("mse", [{"_target_": "keras.metrics.RootMeanSquaredError"}]).new_metrics([None])
    assert name == "root_mean_squared_error"
    names = [n for n, _, _ in Criterion("mse", ["mae", "mse"]).new_metrics(["a", "b"])]
    assert names == ["a_mae", "a_mse", "b_mae", "b_mse"]
    # what config validation checks `objective` against, before any data is read
    assert Criterion("mse", ["mae"]).value_names() == ["loss", "mae"]
    assert Criterion({"a": "mse", "b": "mae"}, {"a": ["mae"]}).value_names() == ["loss", "a_loss", "b_loss", "a_mae"]


@pytest.mark.parametrize("loss, metrics, message", [
    ("msee", [], "loss='msee' is not a Keras loss"),
    ("mse", ["accuracy"], "metrics[0]: 'accuracy' needs a crossentropy loss"),
    ("mse", ["accurracy"], "metrics[0]='accurracy' is not a Keras metric"),
    ({"_target_": "keras.losses.NoSuchLoss"}, [], "loss._target_='keras.losses.NoSuchLoss'"),
    ({"_target_": "keras.losses.Huber", "deltaa": 1.0}, [], "loss.deltaa is not an argument of keras.losses.Huber"),
    ({"a": "mse"}, {"b": ["mae"]}, "metrics.b: the loss names outputs ['a'], not 'b'"),
])
def test_bad_loss_and_metrics_are_one_line(loss, metrics, message):
    with pytest.raises(ConfigError) as e:
        Criterion(loss, metrics)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_outputs_that_do_not_fit_are_one_line():
    crit = Criterion({"a": "mse", "b": "mae"}, [])
    with pytest.raises(ConfigError, match=r"loss names outputs \['a', 'b'\], the labels have \['a', 'c'\]"):
        crit.output_names({"a": 0, "c": 0})
    with pytest.raises(ConfigError, match="the model has one output"):
        crit.output_names(tf.zeros(3))
    with pytest.raises(ConfigError, match=r"loss: sparse_categorical_crossentropy does not fit the model's output"):
        Criterion("sparse_categorical_crossentropy", []).losses(tf.zeros((4, 3), tf.int32), tf.zeros((4, 5, 7)))


# -- one step: Keras's gradient of the mean loss plus the regulariser -------------------------------

def _regularised():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05))(inputs)
    out = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.05))(h)
    return keras.Model(inputs, out)


@pytest.mark.parametrize("kind, update_on_kvstore", [("local", True), ("device", False)])
def test_one_step_is_the_gradient_of_mean_loss_plus_regularisation(kind, update_on_kvstore, tf_devices):
    """2 devices, work load 3:1 (the regulariser must count once, not once per device or example)."""
    devices, lr = tf_devices[:2], 0.5
    keras.utils.set_random_seed(5)
    dp = DataParallel(_regularised, devices, _store(kind, devices), optim.SGD(schedule=optim.Schedule(lr=lr)),
                      [24, 8], update_on_kvstore=update_on_kvstore,
                      criterion=Criterion({"_target_": "keras.losses.SparseCategoricalCrossentropy",
                                           "from_logits": True}, []))
    x, y = _step_batch()
    model = _regularised()
    model.set_weights(dp.get_weights())
    want, total = _keras_step(model, x, y, lr)
    dp.step(x, y)
    for got, w in zip(dp.get_weights(), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    values, _ = dp.take_metrics()
    assert values["loss"] == pytest.approx(total, rel=1e-5)  # Keras's loss: data + regularisation


def _step_batch():
    rng = np.random.default_rng(3)
    return (tf.constant(rng.normal(size=(BATCH, 8)).astype(np.float32)),
            tf.constant(rng.integers(0, 3, BATCH).astype(np.int32)))


def _keras_step(model, x, y, lr):
    """The weights after one SGD step on Keras's mean loss plus regularisation, and that loss;
    checks that the regulariser moves this step (leaving it out, or counting it twice, shows)."""
    start = model.get_weights()
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape(persistent=True) as tape:
        data = ce(y, model(x, training=True))
        total = data + tf.add_n(model.losses)
    with_reg = [w - lr * g.numpy() for w, g in zip(start, tape.gradient(total, model.trainable_variables))]
    without = [w - lr * g.numpy() for w, g in zip(start, tape.gradient(data, model.trainable_variables))]
    assert max(float(np.abs(a - b).max()) for a, b in zip(with_reg, without)) > 1e-3
    return with_reg, float(total)


def test_model_parallel_adds_each_groups_regularisation_once(tf_devices):
    """Two layer groups on two devices, 4 micro-batches: one step is Keras's gradient of the mean
    loss plus both groups' regularisers, and the reported loss includes them."""
    from tfkv.parallel.model_parallel import ModelParallel
    from tfkv.parallel.placement import LayerGroup

    l2 = keras.regularizers.L2(0.05)
    groups = [LayerGroup("a", lambda: [keras.layers.Dense(16, activation="tanh", kernel_regularizer=l2)], (8,), 0, 0),
              LayerGroup("b", lambda: [keras.layers.Dense(3, kernel_regularizer=l2)], (16,), 0, 0)]
    keras.utils.set_random_seed(5)
    lr = 0.5
    mp = ModelParallel(groups, tf_devices[:2], store.create("local"), optim.SGD(schedule=optim.Schedule(lr=lr)),
                       BATCH, micro_batches=4)
    start = mp.get_weights()
    x, y = _step_batch()
    model = keras.Sequential([keras.Input((8,)), *groups[0].make(), *groups[1].make()])
    model.set_weights(start)
    want, total = _keras_step(model, x, y, lr)
    mp.step(x, y)
    for got, w in zip(mp.get_weights(), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    assert mp.take_metrics()[0]["loss"] == pytest.approx(total, rel=1e-5)


# -- dict inputs, two outputs, BatchNorm, L2 --------------------------------------------------------

def two_headed():
    """Dict inputs `image` and `meta`; outputs `digit` (logits) and `size` (regression);
    BatchNorm and an L2 regulariser. Module-level: the dist test's workers build it too."""
    image = keras.Input((6, 6, 1), name="image")
    meta = keras.Input((3,), name="meta")
    h = keras.layers.Conv2D(4, 3, kernel_regularizer=keras.regularizers.L2(1e-3))(image)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(keras.layers.ReLU()(h))
    h = keras.layers.Concatenate()([h, meta])
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3))(h)
    return keras.Model({"image": image, "meta": meta},
                       {"digit": keras.layers.Dense(4, name="digit")(h), "size": keras.layers.Dense(1, name="size")(h)})


TWO_HEADED_LOSS = {"digit": {"_target_": "keras.losses.SparseCategoricalCrossentropy", "from_logits": True},
                   "size": "mse"}
TWO_HEADED_METRICS = {"digit": ["accuracy"], "size": ["mae"]}


def two_headed_data(seed, n=BATCH):
    """A learnable task: the digit is the brightest quadrant, the size the mean of `meta`."""
    rng = np.random.default_rng(seed)
    image = rng.normal(size=(n, 6, 6, 1)).astype(np.float32)
    meta = rng.normal(size=(n, 3)).astype(np.float32)
    quadrants = np.stack([image[:, :3, :3].sum((1, 2, 3)), image[:, :3, 3:].sum((1, 2, 3)),
                          image[:, 3:, :3].sum((1, 2, 3)), image[:, 3:, 3:].sum((1, 2, 3))], 1)
    x = {"image": tf.constant(image), "meta": tf.constant(meta)}
    y = {"digit": tf.constant(quadrants.argmax(1).astype(np.int32)),
         "size": tf.constant(meta.mean(1, keepdims=True))}
    return x, y


def two_headed_dataset(split: str) -> tf.data.Dataset:
    """`two_headed_data` as a data factory for tfkv-run (`dataset._target_`)."""
    x, y = two_headed_data(0 if split == "train" else 1, 256 if split == "train" else 64)
    return tf.data.Dataset.from_tensor_slices((x, y))


@pytest.mark.parametrize("kind", ["local", "device"])
def test_dict_inputs_two_outputs_batchnorm_and_l2_train_and_report_as_keras(kind, tf_devices):
    devices = tf_devices[:2]
    crit = Criterion(TWO_HEADED_LOSS, TWO_HEADED_METRICS)
    keras.utils.set_random_seed(2)
    dp = DataParallel(two_headed, devices, _store(kind, devices), optim.Adam(schedule=optim.Schedule(lr=0.01)),
                      [20, 12], criterion=crit)
    test = [two_headed_data(100, 64)]
    before = dp.evaluate(test)
    for s in range(30):
        dp.step(*two_headed_data(s))
    train, seen = dp.take_metrics()
    assert seen == 30 * BATCH
    assert set(train) == {"loss", "digit_loss", "size_loss", "digit_accuracy", "size_mae"}
    for a, b in zip(dp.replicas[0].trainable_variables, dp.replicas[1].trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    dp.sync_non_trainable()
    after = dp.evaluate(test)
    assert after["loss"] < 0.7 * before["loss"] and after["size_mae"] < before["size_mae"], (before, after)

    # What Keras reports for these weights, loss, metrics: the same numbers under the same names.
    model = two_headed()
    model.set_weights(dp.get_weights())
    model.compile(loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
                  metrics={"digit": ["accuracy"], "size": ["mae"]})
    keras_says = model.evaluate(*test[0], batch_size=64, return_dict=True, verbose=0)
    assert set(keras_says) == set(after)
    for name, value in keras_says.items():
        assert after[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@pytest.mark.parametrize("kind", ["local", "device"])
def test_batch_norm_statistics_are_averaged_over_one_workers_copies(kind, tf_devices):
    devices = tf_devices[:2]
    keras.utils.set_random_seed(0)
    dp = DataParallel(two_headed, devices, _store(kind, devices), optim.SGD(schedule=optim.Schedule(lr=0.1)),
                      [16, 16], criterion=Criterion(TWO_HEADED_LOSS, []))
    x, y = two_headed_data(0)
    x["image"] = tf.concat([x["image"][:16] * 0.1, x["image"][16:] * 5 + 1], 0)  # the slices differ
    dp.step(x, y)
    first = [v.numpy() for v in dp.replicas[0].non_trainable_variables]
    second = [v.numpy() for v in dp.replicas[1].non_trainable_variables]
    assert first and all(not np.allclose(a, b) for a, b in zip(first, second)), "slices differ, so must statistics"
    dp.sync_non_trainable()
    for a, b, v0, v1 in zip(first, second, dp.replicas[0].non_trainable_variables,
                            dp.replicas[1].non_trainable_variables):
        np.testing.assert_allclose(v0.numpy(), (a + b) / 2, rtol=1e-6)
        np.testing.assert_array_equal(v0.numpy(), v1.numpy())


def test_checking_the_config_leaves_tensorflow_unstarted(tmp_path):
    """tfkv-run checks loss and metrics before it splits the CPU into logical devices, which
    TensorFlow allows only before its first variable: building the criterion and naming its
    metrics must not make one (a Keras metric object would). The default loss and metrics do
    not even import TensorFlow (Keras names and `_target_`s must: Keras says what they are)."""
    import subprocess
    import sys

    script = (
        "import sys; from tfkv.parallel.criterion import Criterion\n"
        "assert Criterion.from_config(None, ['accuracy']).value_names() == ['loss', 'accuracy']\n"
        "assert 'tensorflow' not in sys.modules, 'the default loss and metrics imported TensorFlow'\n"
        "c = Criterion.from_config('binary_crossentropy', ['accuracy', 'mae', {'_target_': 'keras.metrics.AUC'}])\n"
        "print(c.metric_names([None]))\n"
        "from tfkv.parallel import devices\n"
        "print(len(devices.setup(['cpu:0', 'cpu:1'])))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["['accuracy', 'mae', 'auc']", "2"], out.stdout


# -- every dist_* type, real scheduler, servers and workers -----------------------------------------

DIST_KINDS = ["dist_sync", "dist_async", "dist_sync_device", "dist_async_device"]


@pytest.mark.slow
def test_every_dist_type_trains_the_two_headed_model(cluster):
    """Four jobs (scheduler + 1 server each) and two worker processes that train the dict-input,
    two-output model with BatchNorm and L2 in each job in turn (one TensorFlow start per worker
    for all four types). In each: the loss on the worker's batch falls, both copies inside a
    worker hold the same weights and (averaged) BatchNorm statistics; in the synchronous types
    both workers hold the same weights, while each keeps its own BatchNorm statistics."""
    import json

    jobs = [cluster(num_servers=1, num_workers=2, TFKV_SECURE="0", TFKV_START_TIMEOUT="400") for _ in DIST_KINDS]
    for job in jobs:
        job.start_servers()
    more = ",".join(f"{kind}={job.env['DMLC_PS_ROOT_PORT']}" for kind, job in zip(DIST_KINDS[1:], jobs[1:]))
    outs = jobs[0].start_workers("criterion_kinds", TEST_KVSTORE=DIST_KINDS[0], TFKV_TEST_MORE=more)
    for job in jobs:
        codes = job.wait(timeout=400)
        assert set(codes.values()) == {0}, f"{codes}\n{jobs[0].outputs()}\n{job.outputs()}"
    results = [json.loads(p.read_text()) for p in outs]

    def arrays(out, kind, copy, state=False):
        with np.load(f"{out}.{kind}.{copy}{'.state' if state else ''}.npz") as f:
            return [f[f"arr_{i}"] for i in range(len(f.files))]

    for kind in DIST_KINDS:
        for r, out in zip(results, outs):
            before, after = r[kind]["before"], r[kind]["after"]
            assert set(after) == {"loss", "digit_loss", "size_loss", "digit_accuracy", "size_mae"}
            # async: the other worker's stale pushes land between this one's; the loss still falls
            assert after["loss"] < (0.9 if "async" in kind else 0.8) * before["loss"], (kind, before, after)
            for a, b in zip(arrays(out, kind, 0), arrays(out, kind, 1)):
                np.testing.assert_array_equal(a, b)
            states = [arrays(out, kind, c, state=True) for c in (0, 1)]
            assert states[0], "BatchNorm statistics are non-trainable variables"
            for a, b in zip(*states):
                np.testing.assert_array_equal(a, b)  # averaged over this worker's copies
        if "async" not in kind:
            for a, b in zip(arrays(outs[0], kind, 0), arrays(outs[1], kind, 0)):
                np.testing.assert_array_equal(a, b)
            assert any(not np.allclose(a, b) for a, b in zip(arrays(outs[0], kind, 0, state=True),
                                                           arrays(outs[1], kind, 0, state=True)))


def test_tfkv_run_reports_every_metric_of_a_two_headed_model(tmp_path):
    """Through tfkv-run on the device store: per-output losses and metrics in metrics.json
    (every epoch), the log line and TensorBoard, and the objective chosen among them."""
    import json
    import os
    from pathlib import Path

    from conftest import tfkv_run

    for group in ("model", "dataset"):
        (tmp_path / "conf" / group).mkdir(parents=True)
        (tmp_path / "conf" / group / "two_headed.yaml").write_text(
            f"_target_: test_criterion.two_headed{'_dataset' if group == 'dataset' else ''}\n")
    tests = str(Path(__file__).parent)
    proc = tfkv_run("--config-dir", "conf", "model=two_headed", "dataset=two_headed", "kvstore=device",
                    "devices=[cpu:0,cpu:1]", "epochs=2", "batch_size=32", "progress=false",
                    "loss={digit: {_target_: keras.losses.SparseCategoricalCrossentropy, from_logits: true}, "
                    "size: mse}", "metrics={digit: [accuracy], size: [mae]}", "objective=test_size_mae",
                    "optimizer=adam", "optimizer.lr=0.01", cwd=tmp_path,
                    env={"PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))})
    (path,) = tmp_path.glob("outputs/*/*/metrics.json")
    m = json.loads(path.read_text())
    names = {"loss", "digit_loss", "size_loss", "digit_accuracy", "size_mae"}
    assert {f"{p}_{n}" for p in ("train", "test") for n in names} <= set(m), sorted(m)
    assert len(m["history"]) == 2 and m["history"][1]["train_loss"] < m["history"][0]["train_loss"]
    assert "test_size_mae" in (path.parent / "tfkv.log").read_text()
    assert f"test_size_mae {m['test_size_mae']:.4f}" in proc.stdout + proc.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path.parent / "tensorboard")).Reload()
    tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
    assert {"epoch/test_size_mae", "epoch/train_digit_accuracy", "train/step_size_mae"} <= tags, tags
