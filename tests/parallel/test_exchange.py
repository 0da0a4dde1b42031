"""Each data-parallel exchange built alone, on copies of a small model, against plain TensorFlow.

The oracle: the model's own Keras copy, its gradient of the batch's mean loss taken by
`tf.GradientTape` with Keras's crossentropy, and one SGD step in closed form (w - lr * g). Every
exchange, whatever the store and where the updates happen, leaves every copy with those weights
after one step; a loss-scaled step whose gradients are not finite leaves them as they were and
halves the scale. Which exchange a DataParallel gets is decided once, from the store's
capabilities and the config (`choose`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim, store
from tfkv.parallel.backprop import Backprop
from tfkv.parallel.criterion import Criterion
from tfkv.parallel.exchange import (AfterBackpropExchange, InGraphExchange, StreamedExchange, choose)
from tfkv.parallel.metrics import Tally
from tfkv.parallel.precision import LossScale
from tfkv.parallel.replicas import Replicas
from tfkv.store.local import LocalStore

BATCH, FEATURES, CLASSES, LR = 8, 5, 3, 0.5


class BetweenHalves(LocalStore):
    """The real local store, pushed and pulled outside the compiled step (not traceable)."""

    traceable = False


class Streaming(BetweenHalves):
    """The real local store, handed each key's gradients from inside backprop (async_pushpull)."""

    async_pushpull = True


def _build():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def _batch():
    rng = np.random.default_rng(0)
    return (tf.constant(rng.normal(size=(BATCH, FEATURES)).astype(np.float32)),
            tf.constant(rng.integers(0, CLASSES, BATCH).astype(np.int32)))


def _expected(x, y):
    """One SGD step of the batch's mean crossentropy, by Keras and TF alone."""
    model = _build()
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    return [w.numpy() - LR * g.numpy() for w, g in zip(model.trainable_variables, grads)]


def _exchange(kind, kv, devices, update_on_kvstore=True, loss_scale=None):
    replicas = Replicas(_build, devices, kv, update_on_kvstore, row_sparse=False)
    sgd = optim.with_rescale(optim.SGD(schedule=optim.Schedule(lr=LR)), BATCH)
    replicas.start(sgd, {}, evaluate_only=False)
    metrics = Tally(Criterion())
    sizes = [BATCH // len(devices)] * len(devices)
    backprop = Backprop(replicas, sizes, Criterion(), metrics, loss_scale, clipnorm=None, jit_compile=False)
    return kind(replicas, backprop, loss_scale), replicas, metrics


def _step(exchange, metrics, x, y):
    metrics.prepare(y)
    exchange.step(x, y, None)


@pytest.mark.parametrize("kind, make, update_on_kvstore", [
    (InGraphExchange, lambda d: store.create("local", devices=d), True),
    (InGraphExchange, lambda d: store.create("device", devices=d), False),
    (StreamedExchange, Streaming, True),
    (StreamedExchange, Streaming, False),
    (AfterBackpropExchange, BetweenHalves, True),
    (AfterBackpropExchange, BetweenHalves, False),
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_one_step_is_sgd_of_tensorflows_gradient_on_every_copy(kind, make, update_on_kvstore, tf_devices):
    devices = tf_devices[:2]
    exchange, replicas, metrics = _exchange(kind, make(devices), devices, update_on_kvstore)
    x, y = _batch()
    before = [v.numpy() for v in replicas.params[0]]
    _step(exchange, metrics, x, y)
    expected = _expected(x, y)
    for params in replicas.params:
        for v, w in zip(params, expected):
            np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(b, w) for b, w in zip(before, expected)), "the step moved nothing"
    assert metrics.take()[1] == BATCH


def test_one_device_alone_updates_itself_in_the_graph(tf_devices):
    kv = store.create("local")
    exchange, replicas, metrics = _exchange(InGraphExchange, kv, tf_devices[:1], update_on_kvstore=True)
    assert not replicas.uses_store and not replicas.update_on_kvstore
    x, y = _batch()
    _step(exchange, metrics, x, y)
    for v, w in zip(replicas.params[0], _expected(x, y)):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, make", [
    (InGraphExchange, lambda d: store.create("local", devices=d)),
    (AfterBackpropExchange, BetweenHalves),
], ids=["InGraphExchange", "AfterBackpropExchange"])
def test_a_loss_scaled_step_is_the_unscaled_one_and_a_non_finite_one_is_skipped(kind, make, tf_devices):
    devices = tf_devices[:2]
    scale = LossScale(initial=2.0**10)
    exchange, replicas, metrics = _exchange(kind, make(devices), devices, loss_scale=scale)
    x, y = _batch()
    _step(exchange, metrics, x, y)
    expected = _expected(x, y)
    for v, w in zip(replicas.params[1], expected):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)
    assert float(scale.scale.numpy()) == 2.0**10 and int(scale.good_steps.numpy()) == 1
    after_one = [[v.numpy() for v in params] for params in replicas.params]
    poisoned = tf.tensor_scatter_nd_update(x, [[0, 0]], [np.inf])
    _step(exchange, metrics, poisoned, y)
    for params, kept in zip(replicas.params, after_one):
        for v, w in zip(params, kept):
            np.testing.assert_array_equal(v.numpy(), w)
    assert float(scale.scale.numpy()) == 2.0**9 and int(scale.good_steps.numpy()) == 0


def test_the_exchange_is_chosen_from_the_stores_capabilities_and_the_loss_scale(tf_devices):
    devices = tf_devices[:2]

    def chosen(kv, n=2, loss_scale=None):
        return choose(Replicas(_build, devices[:n], kv, True, row_sparse=False), loss_scale)

    assert chosen(store.create("local", devices=devices)) is InGraphExchange
    assert chosen(BetweenHalves(devices), n=1) is InGraphExchange  # one device: no store to go through
    assert chosen(Streaming(devices)) is StreamedExchange
    assert chosen(Streaming(devices), loss_scale=LossScale()) is AfterBackpropExchange
    assert chosen(BetweenHalves(devices)) is AfterBackpropExchange


def test_a_streamed_exchange_refuses_a_loss_scale(tf_devices):
    devices = tf_devices[:2]
    with pytest.raises(ValueError, match="loss-scaled"):
        _exchange(StreamedExchange, Streaming(devices), devices, loss_scale=LossScale())
