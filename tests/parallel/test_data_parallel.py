"""Data parallelism gives the weights of one device, whatever the split and the store.

Exactness: each device pushes the gradient of its examples' summed loss and the optimizer's
rescale_grad divides the sum by the global batch (MXNet's scale), so the update equals the
one-device one in exact arithmetic. In float32 the sum is taken in a
different order (per slice, then across devices), so weights agree to round-off (~1e-6
relative), not bit for bit; the tolerance below is a few hundred times that, far below any
real difference (a wrong split or a missed device changes weights by >1e-2).
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim, store
from tfkv.config import split_batch
from tfkv.models import lenet, mlp
from tfkv.parallel.data_parallel import DataParallel
from tfkv.store.base import KVStore, pairs
from tfkv.store.local import LocalStore
from tfkv.ps.updater import NumpyUpdater

RTOL, ATOL = 2e-5, 2e-6
SHAPE, CLASSES, BATCH, STEPS = (8, 8, 1), 10, 32, 6
BUILDERS = {"mlp": lambda shape, classes: mlp.build(shape, classes, hidden=[32, 16]), "lenet": lenet.build}


class EagerLocalStore(LocalStore):
    """The real `local` store, driven between the compiled halves of the step instead of inside
    the graph (the path of a store without async_pushpull)."""

    traceable = False


class HostStore(KVStore):
    """The parameter-server client's contract without the network: `async_pushpull`, so
    DataParallel pushes from inside the compiled step; values summed in numpy and updated by the
    servers' NumpyUpdater. Records each push as (key, pushed from the main thread?)."""

    async_pushpull = True

    def __init__(self):
        self.values, self.updater, self.pushes = {}, None, []

    def init(self, key, value):
        for k, vs in pairs(key, value):
            self.values[k] = np.asarray(vs[0], np.float32).copy()

    def push(self, key, value, priority=0):
        for k, vs in pairs(key, value):
            self.pushes.append((k, threading.current_thread() is threading.main_thread()))
            g = np.sum([np.asarray(v, np.float32) for v in vs], axis=0)
            self.values[k] = self.updater.update(k, self.values[k], g) if self.updater else g

    def pull(self, key, out=None, priority=0):
        for k, outs in pairs(key, out):
            for o in outs:
                o.assign(self.values[k])
        return None if out is not None else self.values[key]

    def set_optimizer(self, optimizer):
        self.updater = NumpyUpdater(optimizer)

    def save_optimizer_states(self, fname):
        raise NotImplementedError

    def load_optimizer_states(self, fname):
        raise NotImplementedError


def _batches():
    rng = np.random.default_rng(42)
    return [(tf.constant(rng.normal(size=(BATCH, *SHAPE)).astype(np.float32)),
             tf.constant(rng.integers(0, CLASSES, BATCH).astype(np.int32))) for _ in range(STEPS)]


def _train(devices, kv, opt, model="mlp", work_load=None, update_on_kvstore=True):
    keras.utils.set_random_seed(7)
    builder = BUILDERS[model]
    dp = DataParallel(lambda: builder(SHAPE, CLASSES), devices, kv, opt,
                      split_batch(BATCH, work_load, len(devices)), update_on_kvstore=update_on_kvstore)
    for x, y in _batches():
        dp.step(x, y)
    for replica in dp.replicas[1:]:  # every copy holds the same weights after the pull
        for a, b in zip(dp.replicas[0].get_weights(), replica.get_weights()):
            np.testing.assert_array_equal(a, b)
    return dp


SGD = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3)


@pytest.fixture(scope="module")
def reference(tf_devices):
    return _train(tf_devices[:1], store.create("local"), SGD).get_weights()


def _assert_same(weights, reference):
    moved = False
    for w, r in zip(weights, reference):
        np.testing.assert_allclose(w, r, rtol=RTOL, atol=ATOL)
    initial = _train_initial()
    moved = any(not np.allclose(w, i) for w, i in zip(reference, initial))
    assert moved, "training did not change the weights; the comparison would prove nothing"


def _train_initial():
    keras.utils.set_random_seed(7)
    return BUILDERS["mlp"](SHAPE, CLASSES).get_weights()


@pytest.mark.parametrize("case", [
    dict(n=4, kind="local"),
    dict(n=4, kind="device"),
    dict(n=2, kind="local", work_load=[3, 1]),
    dict(n=4, kind="device", work_load=[1, 2, 3, 2]),
    dict(n=4, kind="local", update_on_kvstore=False),
    dict(n=2, kind="eager"),
    dict(n=2, kind="eager", update_on_kvstore=False),
    dict(n=2, kind="host"),
    dict(n=3, kind="host", update_on_kvstore=False),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_k_devices_match_one_device(case, tf_devices, reference):
    devices = tf_devices[:case["n"]]
    kinds = {"eager": lambda: EagerLocalStore(devices), "host": HostStore}
    kv = kinds[case["kind"]]() if case["kind"] in kinds else store.create(case["kind"], devices=devices)
    dp = _train(devices, kv, SGD, work_load=case.get("work_load"),
                update_on_kvstore=case.get("update_on_kvstore", True))
    _assert_same(dp.get_weights(), reference)


def test_pushes_gradient_sums_and_rescales_as_mxnet_module(tf_devices):
    """MXNet's scale: the store sums each device's gradient of its examples' summed loss (what a
    2-bit threshold is compared with), and the optimizer divides by the batch (rescale_grad)."""
    devices = tf_devices[:2]
    kv = store.create("local", devices=devices)
    dp = _train(devices, kv, SGD, update_on_kvstore=False)  # the store only sums
    x, y = _batches()[0]
    model = BUILDERS["mlp"](SHAPE, CLASSES)
    model.set_weights(dp.get_weights())
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    want = tape.gradient(loss, model.trainable_variables)
    dp.step(x, y)
    for k, g in enumerate(want):
        np.testing.assert_allclose(kv.pull(k).numpy(), g, rtol=1e-4, atol=1e-5 * float(np.abs(g).max()))
    assert dp._updaters[0].optimizer.rescale_grad == 1 / BATCH
    assert SGD.rescale_grad is None  # the caller's optimizer is left as it was


@pytest.mark.parametrize("sync, rescale", [(True, 1 / (2 * BATCH)), (False, 1 / BATCH)])
def test_rescale_grad_counts_every_worker_of_a_synchronous_store(sync, rescale, tf_devices):
    """Module's rule: 1 / (batch x workers) when the servers sum every worker's push before one
    update (dist_sync), 1 / batch when each push updates (dist_async); a set value is kept."""

    class TwoWorkers(HostStore):
        distributed = True
        num_workers = 2

    TwoWorkers.sync = sync
    kv = TwoWorkers()
    _train(tf_devices[:1], kv, SGD)
    assert kv.updater.optimizer.rescale_grad == rescale
    kept = TwoWorkers()
    _train(tf_devices[:1], kept, optim.SGD(rescale_grad=0.5))
    assert kept.updater.optimizer.rescale_grad == 0.5


def test_split_follows_work_load():
    assert split_batch(64, None, 4) == [16, 16, 16, 16]
    assert split_batch(64, [3, 1], 2) == [48, 16]
    assert split_batch(10, None, 3) == [3, 3, 4]  # MXNet: the remainder goes to the last device
    assert sum(split_batch(127, [1, 2, 3], 3)) == 127


def test_replicas_live_on_their_devices(tf_devices):
    dp = _train(tf_devices[:3], store.create("device", devices=tf_devices[:3]), SGD)
    for d, replica in zip(tf_devices[:3], dp.replicas):
        assert {v.value.device.split("/")[-1] for v in replica.weights} == {d.split("/")[-1]}


def test_convolutional_model_with_adam(tf_devices):
    adam = optim.Adam(schedule=optim.Schedule(lr=1e-3))
    one = _train(tf_devices[:1], store.create("local"), adam, model="lenet").get_weights()
    two = _train(tf_devices[:2], store.create("device", devices=tf_devices[:2]), adam, model="lenet").get_weights()
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_metrics_count_every_example(tf_devices):
    dp = _train(tf_devices[:2], store.create("local", devices=tf_devices[:2]), SGD)
    values, seen = dp.take_metrics()
    assert seen == BATCH * STEPS and 0 <= values["accuracy"] <= 1 and values["loss"] > 0
    assert set(values) == {"loss", "accuracy"}
    assert dp.take_metrics()[1] == 0


class RecordingStore(EagerLocalStore):
    """Records the key order in which a step hands its gradients over (higher priority first)."""

    def __init__(self, devices):
        super().__init__(devices)
        self.pushed = []

    def pushpull_async(self, key, value, priority=0):
        self.pushed.append([k for _, k in sorted(zip(priority, key), key=lambda t: -t[0])])
        return super().pushpull_async(key, value, priority)


def test_between_halves_step_pushes_last_layer_first_and_times_its_phases(tf_devices):
    kv = RecordingStore(tf_devices[:2])
    dp = _train(tf_devices[:2], kv, SGD)
    n = len(dp.keys)
    assert len(kv.pushed) == STEPS and all(order == list(range(n))[::-1] for order in kv.pushed)
    assert dp.timings["steps"] == STEPS
    assert all(dp.timings[p] > 0 for p in ("compute", "push", "pull", "assign"))
    dp.reset_timings()
    assert dp.timings["steps"] == 0 and dp.timings["compute"] == 0.0


def test_a_streaming_store_is_pushed_from_inside_the_step_in_backprop_order(tf_devices):
    """With async_pushpull, each key is pushed by the compiled step itself (on a TensorFlow
    thread, not the caller's), the last layer first, once per key and step."""
    kv = HostStore()
    dp = _train(tf_devices[:2], kv, SGD)
    n = len(dp.keys)
    assert len(kv.pushes) == STEPS * n
    assert [k for k, _ in kv.pushes] == list(range(n))[::-1] * STEPS
    assert not any(on_main for _, on_main in kv.pushes), "pushes ran on the caller's thread, after the graph"
    assert dp.timings["steps"] == STEPS and 0 < dp.timings["push"] < dp.timings["compute"]


def test_an_error_in_a_push_from_inside_the_step_is_raised_as_itself(tf_devices):
    class Refusing(HostStore):
        def push(self, key, value, priority=0):
            if self.updater is not None:  # after the broadcast at start-up
                raise ValueError("server 0: refused")
            super().push(key, value, priority)

    keras.utils.set_random_seed(7)
    dp = DataParallel(lambda: mlp.build(SHAPE, CLASSES, hidden=[8]), tf_devices[:2], Refusing(), SGD, [BATCH // 2] * 2)
    x, y = _batches()[0]
    with pytest.raises(ValueError, match="server 0: refused"):
        dp.step(x, y)
