"""Precision policies, loss scaling, clipping and XLA in the data-parallel step (issue 17: 1, 4, 6).

Real TensorFlow and Keras throughout; the only stand-in is a GPU's compute capability (this
machine has none), handed to the check as the pair TensorFlow would report.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import tfkv_run

from tfkv import optim, store
from tfkv.errors import ConfigError
from tfkv.models import mlp
from tfkv.parallel.data_parallel import DataParallel
from tfkv.parallel.precision import LossScale, check_devices, set_policy
from tfkv.ps.updater import NumpyUpdater
from tfkv.store.local import LocalStore
from tfkv.trainer import rng

SHAPE, CLASSES, BATCH = (8, 8, 1), 10, 32


def _build():
    return mlp.build(SHAPE, CLASSES, hidden=[32, 16])


def _batches(steps, seed=42):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(BATCH, *SHAPE)).astype(np.float32), rng.integers(0, CLASSES, BATCH).astype(np.int32))
            for _ in range(steps)]


class EagerLocalStore(LocalStore):
    """The real `local` store driven between the compiled halves of the step (the path every
    store that is not traced into the graph takes, dist_* included)."""

    traceable = False


def _dp(devices, kv, opt, **kw):
    keras.utils.set_random_seed(7)
    return DataParallel(_build, devices, kv, opt, [BATCH // len(devices)] * len(devices), **kw)


@pytest.fixture
def float16_policy():
    set_policy("mixed_float16")
    yield
    set_policy("float32")


@pytest.mark.parametrize("ndev,kind", [(1, "local"), (2, "local"), (2, "eager")])
def test_an_overflow_skips_the_step_on_every_device_and_halves_the_scale(tf_devices, float16_policy, ndev, kind):
    devices = tf_devices[:ndev]
    kv = EagerLocalStore(devices) if kind == "eager" else store.create(kind, devices=devices)
    scale = LossScale(initial=2.0**10, growth_steps=1000)
    dp = _dp(devices, kv, optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9), loss_scale=scale)
    assert dp.replicas[0].layers[-1].compute_dtype == "float32"  # the logits stay float32
    assert dp.replicas[0].layers[1].compute_dtype == "float16"
    batches = _batches(3)
    x, y = batches[1]
    x[-1] = 1e5  # float16's largest is 65504: the last device's slice overflows
    batches[1] = (x, y)
    seen = []
    for x, y in batches:
        dp.step(tf.constant(x), tf.constant(y))
        seen.append((dp.get_weights(), float(scale.scale.numpy()), int(scale.good_steps.numpy())))
    assert [s[1:] for s in seen] == [(1024.0, 1), (512.0, 0), (512.0, 1)]
    for a, b in zip(seen[0][0], seen[1][0]):  # the overflowing step changed nothing ...
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(w).all() for w in seen[2][0])  # ... and training went on
    assert any(not np.array_equal(a, b) for a, b in zip(seen[1][0], seen[2][0]))
    for replica in dp.replicas[1:]:
        for a, b in zip(dp.replicas[0].get_weights(), replica.get_weights()):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_an_overflow_on_one_worker_skips_the_step_on_every_worker(cluster):
    """dist_sync, 2 workers (real processes, real servers): worker 1's gradients overflow at step
    2; both skip it (agreed through the store before anything is pushed), both halve the scale,
    the weights stay equal on both, and the next step trains."""
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("overflow", "1")  # the optimizer on the servers: a push would be applied
    codes = c.wait(180)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    weights = [[[f[f"arr_{i}"] for i in range(len(f.files))] for f in map(np.load, (f"{out}.{s}.npz" for s in range(4)))]
               for out in outs]
    scales = [json.loads(out.read_text())["scale"] for out in outs]
    assert scales == [[1024.0, 512.0, 512.0, 512.0]] * 2
    for step in range(4):
        for a, b in zip(weights[0][step], weights[1][step]):
            np.testing.assert_array_equal(a, b)
    w = weights[0]
    assert all(np.array_equal(a, b) for a, b in zip(w[0], w[1]))  # step 2 skipped
    assert not any(np.array_equal(a, b) for a, b in zip(w[1], w[2]))  # step 3 trained
    assert all(np.isfinite(a).all() for a in w[3])


def test_the_scale_grows_after_its_growth_steps_and_a_checkpoint_keeps_it(tf_devices, float16_policy):
    scale = LossScale(initial=2.0**8, growth_steps=2)
    dp = _dp(tf_devices[:1], store.create("local"), optim.SGD(), loss_scale=scale)
    for x, y in _batches(5):
        dp.step(tf.constant(x), tf.constant(y))
    assert (float(scale.scale.numpy()), int(scale.good_steps.numpy())) == (1024.0, 1)
    saved = rng.state(dp)  # what tfkv.trainer puts in a checkpoint
    scale.scale.assign(1.0)
    scale.good_steps.assign(0)
    rng.restore(dp, saved)
    assert (float(scale.scale.numpy()), int(scale.good_steps.numpy())) == (1024.0, 1)


def _reference_step(opt, x, y, clipnorm=None):
    """One update as Keras code would make it: the mean loss's gradient, clipped by
    tf.clip_by_global_norm, then the optimizer's rule on the summed gradient (rescale_grad =
    1/batch), as the parameter servers' updater runs it."""
    keras.utils.set_random_seed(7)
    model = _build()
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    if clipnorm:
        grads, _ = tf.clip_by_global_norm(grads, clipnorm)
    updater = NumpyUpdater(optim.with_rescale(opt, len(y)))
    return [updater.update(k, w.numpy(), g.numpy() * len(y)) for k, (w, g) in
            enumerate(zip(model.trainable_variables, grads))]


@pytest.mark.parametrize("ndev,update_on_kvstore", [(1, True), (2, True), (2, False)])
def test_clipnorm_clips_the_workers_gradient_as_clip_by_global_norm(tf_devices, ndev, update_on_kvstore):
    opt = optim.SGD(schedule=optim.Schedule(lr=0.5))
    x, y = _batches(1)[0]
    dp = _dp(tf_devices[:ndev], store.create("local", devices=tf_devices[:ndev]), opt, clipnorm=0.05,
             update_on_kvstore=update_on_kvstore)
    dp.step(tf.constant(x), tf.constant(y))
    clipped, unclipped = _reference_step(opt, x, y, clipnorm=0.05), _reference_step(opt, x, y)
    got = [v.numpy() for v in dp.replicas[0].trainable_variables]
    for g, e in zip(got, clipped):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(g, u, atol=1e-4) for g, u in zip(got, unclipped))  # the clip bit


@pytest.mark.parametrize("where", ["store", "devices", "eager-store"])
def test_clip_gradient_and_rescale_grad_apply_wherever_the_optimizer_runs(tf_devices, where):
    """MXNet's elementwise clip_gradient and rescale_grad: the same update in the store, on every
    device (update_on_kvstore=false) and in the servers' updater (the reference)."""
    opt = optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9, rescale_grad=0.02, clip_gradient=0.01)
    devices = tf_devices[:2]
    kv = EagerLocalStore(devices) if where == "eager-store" else store.create("local", devices=devices)
    x, y = _batches(1)[0]
    dp = _dp(devices, kv, opt, update_on_kvstore=where != "devices")
    dp.step(tf.constant(x), tf.constant(y))
    expected, unclipped = _reference_step(opt, x, y), _reference_step(optim.SGD(schedule=optim.Schedule(lr=0.5),
                                                                                 momentum=0.9, rescale_grad=0.02), x, y)
    got = [v.numpy() for v in dp.replicas[0].trainable_variables]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(g, u, atol=1e-4) for g, u in zip(got, unclipped))


def test_jit_compile_trains_to_the_same_loss(tf_devices):
    losses = {}
    for jit in (False, True):
        dp = _dp(tf_devices[:2], store.create("local", devices=tf_devices[:2]), optim.SGD(), jit_compile=jit)
        for x, y in _batches(8):
            dp.step(tf.constant(x), tf.constant(y))
        losses[jit] = dp.take_metrics()[0]["loss"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


class _HostRoundTrip(keras.layers.Layer):
    """A layer whose op runs in Python: XLA has no kernel for it."""

    def call(self, x):
        return tf.ensure_shape(tf.numpy_function(lambda a: a, [x], x.dtype, stateful=False), x.shape)

    def compute_output_shape(self, shape):
        return shape


def test_jit_compile_of_an_op_xla_lacks_is_one_line_naming_it(tf_devices):
    def build():
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(3)(_HostRoundTrip()(inputs)))

    dp = DataParallel(build, tf_devices[:1], store.create("local"), optim.SGD(), [8], jit_compile=True)
    with pytest.raises(ConfigError) as e:
        dp.step(tf.ones((8, 4)), tf.zeros(8, tf.int32))
    assert "jit_compile=true: XLA cannot compile this model's step (op PyFuncStateless)" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_gpu_without_tensor_cores_for_the_policy_is_refused():
    # No GPU here: the compute capabilities are the pairs TensorFlow reports for a P100 (6.0)
    # and a V100 (7.0).
    with pytest.raises(ConfigError, match=r"precision=mixed_float16: gpu:1 has compute capability 6\.0"):
        check_devices("mixed_float16", [("gpu:0", (7, 0)), ("gpu:1", (6, 0))])
    with pytest.raises(ConfigError, match=r"precision=mixed_bfloat16: gpu:0 has compute capability 7\.0"):
        check_devices("mixed_bfloat16", [("gpu:0", (7, 0))])
    check_devices("mixed_float16", [("gpu:0", (7, 0)), ("cpu:0", None)])
    check_devices("float32", [("gpu:0", (3, 5))])


@pytest.mark.slow
def test_mixed_bfloat16_trains_the_default_experiment_within_a_point_of_float32(tmp_path):
    """The default experiment (digits MLP, 10 epochs) as `tfkv-run` runs it, both precisions."""
    results = {}
    for precision in ("float32", "mixed_bfloat16"):
        run = tmp_path / precision
        run.mkdir()
        tfkv_run(f"precision={precision}", "progress=false", cwd=run)
        (path,) = run.glob("outputs/*/*/metrics.json")
        results[precision] = json.loads(path.read_text())
    print({p: (r["test_accuracy"], r["samples_per_sec"]) for p, r in results.items()})
    assert results["float32"]["test_accuracy"] > 0.9
    assert abs(results["mixed_bfloat16"]["test_accuracy"] - results["float32"]["test_accuracy"]) <= 0.01
