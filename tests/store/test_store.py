"""The KVStore types through MXNet's API: registry and MXNet's type names, push/pull, update in
the store, aggregate-only, optimizer state, `local` and `device` giving the same numbers, and the
MXNet behaviours users rely on (pushpull in place, one kind of key, capabilities, Python
updaters, 2-bit compression between devices; keys of a real dist job)."""

import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim, store
from tfkv.store.base import KVStore


def _var(value, device="/device:CPU:0"):
    with tf.device(device):
        return tf.Variable(np.asarray(value, np.float32))


def test_registry_creates_types_by_name(tf_devices):
    assert {"local", "device"} <= set(store.names())
    kv = store.create("local")
    assert isinstance(kv, KVStore) and kv.type == "local"
    assert (kv.rank, kv.num_workers) == (0, 1)
    assert kv.is_capable("optimizer")
    assert store.create("device", devices=tf_devices[:2]).type == "device"
    with pytest.raises(ValueError, match="unknown KVStore type 'dist_foo'"):
        store.create("dist_foo")


@pytest.mark.parametrize("kind", ["local", "device"])
def test_push_sums_devices_and_pull_copies_everywhere(kind, tf_devices):
    kv = store.create(kind, devices=tf_devices[:3])
    kv.init(3, np.ones((2, 2), np.float32))
    grads = [tf.fill((2, 2), float(i + 1)) for i in range(3)]
    kv.push(3, grads)  # no optimizer: the store keeps the sum
    outs = [_var(np.zeros((2, 2)), d) for d in tf_devices[:3]]
    kv.pull(3, out=outs)
    for o in outs:
        np.testing.assert_array_equal(o.numpy(), np.full((2, 2), 6.0))
    np.testing.assert_array_equal(kv.pull(3).numpy(), np.full((2, 2), 6.0))


def test_lists_of_keys_pushpull_and_broadcast(tf_devices):
    kv = store.create("local")
    kv.init(["a", "b"], [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    out = kv.pushpull(["a", "b"], [[tf.ones(2), tf.ones(2)], tf.fill((3,), 5.0)])
    np.testing.assert_array_equal(out[0].numpy(), [2, 2])
    np.testing.assert_array_equal(out[1].numpy(), [5, 5, 5])
    targets = [_var(np.zeros(4), d) for d in tf_devices[:2]]
    kv.broadcast("c", tf.range(4, dtype=tf.float32), out=targets, priority=-1)
    for t in targets:
        np.testing.assert_array_equal(t.numpy(), [0, 1, 2, 3])


def _train_store(kind, devices, opt, steps=5, keys=4):
    kv = store.create(kind, devices=devices)
    kv.set_optimizer(opt)
    rng = np.random.default_rng(1)
    for k in range(keys):
        kv.init(k, rng.normal(size=(3, k + 2)).astype(np.float32))
    for _ in range(steps):
        for k in range(keys):
            kv.push(k, [tf.constant(rng.normal(size=(3, k + 2)).astype(np.float32)) for _ in devices],
                    priority=-k)
    return kv, [kv.pull(k).numpy() for k in range(keys)]


def test_update_in_store_follows_the_rule(tf_devices):
    opt = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=0.01)
    kv = store.create("local", devices=tf_devices[:2])
    kv.set_optimizer(opt)
    w0 = np.array([1.0, -2.0], np.float32)
    kv.init("w", w0)
    g = [np.array([0.5, 0.5], np.float32), np.array([1.5, -0.5], np.float32)]
    kv.push("w", [tf.constant(x) for x in g])
    kv.push("w", [tf.constant(x) for x in g])
    w, state = w0, (np.zeros(2, np.float32),)
    for t in range(2):
        w, state = opt.step(optim.NumpyOps, float(t), w, g[0] + g[1], state)
    np.testing.assert_allclose(kv.pull("w").numpy(), w, rtol=1e-6)


def test_local_and_device_give_the_same_numbers(tf_devices):
    opt = optim.Adam(schedule=optim.Schedule(lr=0.01), wd=1e-3)
    _, local = _train_store("local", tf_devices[:4], opt)
    kv, device = _train_store("device", tf_devices[:4], opt)
    homes = {kv._values[k].device for k in range(4)}
    assert len(homes) > 1, "the device store should spread keys over the devices"
    for a, b in zip(local, device):
        np.testing.assert_array_equal(a, b)


def test_optimizer_state_saves_and_loads(tmp_path, tf_devices):
    opt = optim.SGD(schedule=optim.Schedule(lr=0.05), momentum=0.9)
    kv, _ = _train_store("local", tf_devices[:2], opt, steps=3, keys=2)
    kv.save_optimizer_states(str(tmp_path / "opt.npz"))
    with np.load(tmp_path / "opt.npz", allow_pickle=False) as f:
        assert sorted(f.files) == ["0/count", "0/momentum", "1/count", "1/momentum"]
        assert int(f["0/count"]) == 3 and np.abs(f["0/momentum"]).sum() > 0
    other = store.create("local")
    other.set_optimizer(opt)
    for k in range(2):
        other.init(k, kv.pull(k).numpy())
    other.load_optimizer_states(str(tmp_path / "opt.npz"))
    g = tf.ones((3, 2))
    kv.push(0, g)
    other.push(0, g)
    np.testing.assert_array_equal(kv.pull(0).numpy(), other.pull(0).numpy())


def test_push_and_pull_trace_into_a_tf_function(tf_devices):
    kv = store.create("device", devices=tf_devices[:2])
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    kv.init(0, np.zeros(2, np.float32))
    outs = [_var(np.zeros(2), d) for d in tf_devices[:2]]

    @tf.function
    def step(g):
        kv.push(0, [g, g])
        kv.pull(0, out=outs)

    step(tf.ones(2))
    step(tf.ones(2))
    for o in outs:
        np.testing.assert_array_equal(o.numpy(), [-4.0, -4.0])


@pytest.mark.parametrize("kind", ["local", "device"])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_tensors_trace_into_a_tf_function(kind, dtype, tf_devices):
    """Half tf.Tensors pushed from a traced step: summed in their dtype, pulled into half and
    float32 variables (cast, as MXNet's CopyFromTo); a float32 tensor is refused while tracing,
    in one line; the device store's 2-bit compression takes half gradients."""
    kv = store.create(kind, devices=tf_devices[:2])
    kv.init(0, tf.zeros(2, dtype))
    with tf.device(tf_devices[0]):
        half, wide = tf.Variable(tf.zeros(2, dtype)), tf.Variable(tf.zeros(2))

    @tf.function
    def step(g):
        kv.push(0, [g, 2 * g])
        kv.pull(0, out=[half, wide])

    step(tf.constant([0.25, -3.0], dtype))
    assert half.dtype == dtype and kv.pull(0).dtype == dtype
    np.testing.assert_array_equal(wide.numpy(), [0.75, -9.0])
    np.testing.assert_array_equal(tf.cast(half, tf.float32).numpy(), [0.75, -9.0])
    with pytest.raises(ValueError, match=f"push of key 0: a float32 value for a {dtype.name} key"):
        tf.function(lambda g: kv.push(0, [g, g]))(tf.ones(2))
    if kind == "device":
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        # retraced (compression is traced in); 0.3 and 0.6 per device: only the second sends (+/-0.5)
        tf.function(step.python_function)(tf.constant([0.3, -0.3], dtype))
        np.testing.assert_array_equal(wide.numpy(), [0.5, -0.5])
        assert kv.pull(0).dtype == dtype


def test_a_dist_pull_casts_into_a_variable_of_another_dtype():
    """A pulled half value delivered into float32 and bfloat16 variables (the dist_* stores'
    Pull): cast, as MXNet's CopyFromTo; numpy outs are checked and cast the same way."""
    from tfkv.ps.parts import Pull, plan

    layout = plan(7, (2,), 1, 10**6, 1 << 20, np.dtype(np.float16))
    wide, bf = tf.Variable(tf.zeros(2)), tf.Variable(tf.zeros(2, tf.bfloat16))
    host = np.zeros(2, np.float64)
    pull = Pull(7, layout, [wide, bf, host])
    pull.expect([1])
    assert pull.arrive(1, np.array([0.5, -3.0], np.float16))
    pull.deliver()
    assert pull.value.dtype == np.float16 and wide.dtype == tf.float32 and bf.dtype == tf.bfloat16
    for got in (wide.numpy(), tf.cast(bf, tf.float32).numpy(), host):
        np.testing.assert_array_equal(got, [0.5, -3.0])


# -- GPU P2P: where a key's device values are summed -----------------------------------------------

@pytest.mark.parametrize("p2p", ["1", "0"])
def test_gpu_p2p_decides_where_device_values_meet(p2p, tf_devices, monkeypatch):
    monkeypatch.setenv("MXNET_ENABLE_GPU_P2P", p2p)
    devs = tf_devices[:3]
    kv = store.create("device", devices=devs)
    kv.init([0, 1], [np.zeros(4, np.float32), np.zeros(4, np.float32)])
    grads = [_var(np.full(4, i + 1.0), d) for i, d in enumerate(devs)]

    @tf.function
    def step():
        kv.push(1, grads)
        return kv.pull(1)

    np.testing.assert_array_equal(step().numpy(), [6.0] * 4)  # the same numbers either way
    home = kv._home[1]
    assert tf.DeviceSpec.from_string(home) != tf.DeviceSpec.from_string("/device:CPU:0")
    adds = [op.device for op in step.get_concrete_function().graph.get_operations() if op.type == "AddN"]
    assert len(adds) == 1
    want = home if p2p == "1" else "/device:CPU:0"
    assert tf.DeviceSpec.from_string(adds[0]) == tf.DeviceSpec.from_string(want)


def test_gpu_p2p_variables():
    from tfkv.store.base import gpu_p2p

    assert gpu_p2p({}) and gpu_p2p({"MXNET_ENABLE_GPU_P2P": "1"})
    assert not gpu_p2p({"MXNET_ENABLE_GPU_P2P": "0"})
    assert not gpu_p2p({"TFKV_ENABLE_GPU_P2P": "false", "MXNET_ENABLE_GPU_P2P": "1"})  # tfkv's name first


# -- MXNet behaviours: pushpull in place, keys, names, capabilities, updaters, compression ---------

@pytest.mark.parametrize("kind", ["local", "device"])
def test_pushpull_without_out_writes_into_the_values(kind, tf_devices):
    kv = store.create(kind, devices=tf_devices[:2])
    kv.init(["a", "b"], [np.zeros(2, np.float32), np.zeros(3, np.float32)])
    a = [_var([1, 2], d) for d in tf_devices[:2]]
    b = np.full(3, 5.0, np.float32)
    kv.pushpull(["a", "b"], [a, b])  # MXNet: no out, so the result goes into the values
    for v in a:
        np.testing.assert_array_equal(v.numpy(), [2, 4])
    np.testing.assert_array_equal(b, [5, 5, 5])
    c = _var([3, 3], tf_devices[0])
    kv.pushpull("a", c)  # one value, not a list
    np.testing.assert_array_equal(c.numpy(), [3, 3])
    d = np.full(3, 7.0)  # float64, as np.ones makes: cast into, as MXNet's copy into an NDArray
    assert kv.pushpull("b", d) is not None and d.dtype == np.float64
    np.testing.assert_array_equal(d, [7, 7, 7])

    @tf.function
    def traced():
        kv.pushpull("a", a)

    traced()
    for v in a:
        np.testing.assert_array_equal(v.numpy(), [4, 8])  # [2, 4] from each device


@pytest.mark.parametrize("kind", ["local", "device"])
def test_one_kind_of_key_per_store(kind, tf_devices):
    kv = store.create(kind, devices=tf_devices[:2])
    kv.init(-1, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="key 'w' is a str, but this store's keys are ints: .* never both"):
        kv.init("w", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="never both"):
        kv.push("w", tf.ones(2))
    with pytest.raises(TypeError, match="key 1.5 is a float; a KVStore key is an int or a str"):
        kv.init(1.5, np.zeros(2, np.float32))
    named = store.create(kind, devices=tf_devices[:2])
    named.init("w", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="key 0 is a int, but this store's keys are strs"):
        named.pull(0)


def test_mxnet_type_names():
    for name, kind in (("dist", "dist_sync"), ("dist_device_sync", "dist_sync_device"),
                       ("dist_sync_device", "dist_sync_device"), ("dist_device_async", "dist_async_device"),
                       ("Dist_Async", "dist_async"), ("LOCAL", "local"), ("local_update_cpu", "local"),
                       ("local_allreduce_cpu", "local"), ("local_allreduce_device", "device"), ("device", "device")):
        assert store.canonical(name) == kind, name
    assert store.create("Local").type == "local"
    assert store.create("local_allreduce_device").type == "device"
    with pytest.raises(ValueError, match="KVStore type 'nccl' is MXNet's, not tfkv's; use device"):
        store.create("nccl")
    with pytest.raises(ValueError, match="'horovod' is MXNet's, not tfkv's; use dist_sync"):
        store.canonical("horovod")
    assert store.capabilities("device").compression and store.capabilities("dist").compression
    assert not store.capabilities("local").compression


def test_every_type_declares_its_capabilities_once_and_the_registry_agrees():
    """Capabilities are declared by each class; the registry answers for tfkv's own types without
    importing them, and what it says is what the classes declare (never parsed from a name)."""
    from tfkv.store import BUILTIN, REGISTRY, Capabilities

    assert set(BUILTIN) == set(store.names()) - set(REGISTRY.plugins())
    for name, declared in BUILTIN.items():
        assert Capabilities.of(REGISTRY.get(name)) == declared, name
    assert [n for n in BUILTIN if store.capabilities(n).distributed] == [
        "dist_sync", "dist_async", "dist_sync_device", "dist_async_device"]
    assert [n for n in BUILTIN if not store.capabilities(n).sync] == ["dist_async", "dist_async_device"]


def test_capabilities_and_dead_nodes():
    from tfkv.store.base import OPTIMIZER, SERVER_GROUP, WORKER_GROUP

    kv = store.create("local")
    assert kv.is_capable(OPTIMIZER) and kv.is_capable(kv.OPTIMIZER) and kv.is_capable("OPTIMIZER")
    with pytest.raises(ValueError, match="unknown capability 'sparse'"):
        kv.is_capable("sparse")
    assert kv.num_dead_node(SERVER_GROUP + WORKER_GROUP) == 0 and kv.num_dead_node(1, timeout=5) == 0
    with pytest.raises(ValueError, match="node_id=9"):
        kv.num_dead_node(9)


@pytest.mark.parametrize("kind", ["local", "device"])
def test_python_updater_as_mxnet(kind, tf_devices):
    """MXNet's tutorial updater: `stored += input * 2`, on every push; in a tf.function too."""
    calls = []

    def update(key, received, stored):
        calls.append(key)
        stored += received * 2

    kv = store.create(kind, devices=tf_devices[:2])
    kv._set_updater(update)
    kv.init(3, np.ones((2, 3), np.float32))
    kv.push(3, [tf.ones((2, 3)), tf.ones((2, 3))])  # summed: 2, then 1 + 2 * 2
    np.testing.assert_array_equal(kv.pull(3).numpy(), np.full((2, 3), 5.0))

    @tf.function
    def step():
        kv.push(3, [tf.ones((2, 3)), tf.zeros((2, 3))])

    step()
    np.testing.assert_array_equal(kv.pull(3).numpy(), np.full((2, 3), 7.0))
    assert calls == [3, 3]
    kv.set_updater(lambda key, received, stored: stored - received)  # returning the new value works too
    kv.push(3, tf.ones((2, 3)))
    np.testing.assert_array_equal(kv.pull(3).numpy(), np.full((2, 3), 6.0))
    with pytest.raises(TypeError, match="not callable"):
        kv.set_updater(42)
    with pytest.raises(RuntimeError, match="a Python updater"):
        kv.save_optimizer_states("/tmp/never-written.npz")


def test_device_store_compresses_between_devices_as_mxnet(tf_devices):
    """Each device quantises its value with its own residual (error feedback) on that device;
    the sum is of the +-threshold values, as numpy's `compression` computes them."""
    from tfkv.ps import compression

    devs = tf_devices[:2]
    kv = store.create("device", devices=devs)
    kv.init(0, np.zeros(5, np.float32))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})  # after init too, as before it
    kv.init(1, np.zeros((2, 2), np.float32))
    grads = [np.array([0.3, 0.6, -0.7, 1.2, 0.0], np.float32), np.array([0.3, -0.2, -0.4, 0.5, 0.1], np.float32)]
    residuals = [np.zeros(5, np.float32) for _ in devs]

    @tf.function
    def step(a, b):
        kv.push(0, [a, b])
        return kv.pull(0)

    for _ in range(3):
        want = sum(compression.unpack(compression.pack(g, r, 0.5), 5, 0.5) for g, r in zip(grads, residuals))
        with tf.device(devs[0]):
            a = tf.constant(grads[0])
        with tf.device(devs[1]):
            b = tf.constant(grads[1])
        np.testing.assert_array_equal(step(a, b).numpy(), want)
    for r, var, d in zip(residuals, kv._residuals[0], devs):
        np.testing.assert_array_equal(var.numpy(), r)
        spec, want = tf.DeviceSpec.from_string(var.device), tf.DeviceSpec.from_string(d)
        assert (spec.device_type, spec.device_index) == (want.device_type, want.device_index)
    kv.push(1, [tf.fill((2, 2), 0.7), tf.fill((2, 2), -0.1)])
    np.testing.assert_array_equal(kv.pull(1).numpy(), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="kvstore=local sends neither"):
        store.create("local").set_gradient_compression({"type": "2bit", "threshold": 0.5})


def _momentum_store(devs, t=0.5):
    kv = store.create("device", devices=devs)
    kv.set_gradient_compression({"type": "2bit_momentum", "threshold": t})
    kv.init(0, np.zeros(5, np.float32))
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), momentum=0.9))
    return kv


def test_device_store_applies_momentum_on_the_devices_and_keeps_it_in_its_state(tf_devices, tmp_path):
    """2bit_momentum between devices: each device's velocity and residual as numpy's
    pack_corrected keeps them, the store's SGD without momentum (no momentum state), a push
    before the optimizer refused; the saved state holds the velocities and residuals, and a
    store loading it goes on exactly as the one that saved it."""
    from tfkv.ps import compression

    devs = tf_devices[:2]
    early = store.create("device", devices=devs)
    early.set_gradient_compression({"type": "2bit_momentum", "threshold": 0.5})
    early.init(0, np.zeros(2, np.float32))
    with pytest.raises(RuntimeError, match="2bit_momentum applies the optimizer's momentum on the devices: call "
                                           "set_optimizer"):
        early.push(0, [tf.zeros(2), tf.zeros(2)])
    kv = _momentum_store(devs)
    grads = [np.array([0.3, 0.6, -0.7, 1.2, 0.0], np.float32), np.array([0.3, -0.2, -0.4, 0.5, 0.1], np.float32)]
    velocities, residuals = [np.zeros(5, np.float32) for _ in devs], [np.zeros(5, np.float32) for _ in devs]
    weight = np.zeros(5, np.float32)

    def step(kv, oracle=True):
        kv.push(0, [tf.constant(g) for g in grads])
        if oracle:
            sent = sum(compression.unpack(compression.pack_corrected(g, u, r, 0.5, 0.9), 5, 0.5)
                       for g, u, r in zip(grads, velocities, residuals))
            weight[:] -= sent  # SGD lr 1 without momentum
        return kv.pull(0).numpy()

    for _ in range(4):
        np.testing.assert_array_equal(step(kv), weight)
    assert weight.tolist() != [0.0] * 5
    for held, mine in ((kv._velocities[0], velocities), (kv._residuals[0], residuals)):
        np.testing.assert_array_equal([v.numpy() for v in held], mine)
    kv.save_optimizer_states(str(tmp_path / "state.npz"))
    with np.load(tmp_path / "state.npz") as f:
        assert sorted(f.files) == ["0/compression_residual_0", "0/compression_residual_1", "0/compression_velocity_0",
                                   "0/compression_velocity_1", "0/count"]  # no momentum in the updater
    again = _momentum_store(devs)
    again._values[0].assign(kv._values[0])  # the weights come from the checkpoint's weights.npz
    again.load_optimizer_states(str(tmp_path / "state.npz"))
    for _ in range(3):
        np.testing.assert_array_equal(step(again, oracle=False), step(kv))
        np.testing.assert_array_equal(kv.pull(0).numpy(), weight)

    # a lone value crosses no link, so it is not quantised; the momentum still applies (exactly
    # SGD's with momentum 0.9, lr 1: the updater has none)
    lone = _momentum_store(devs)
    g = np.array([0.3, -0.7, 1.2, 0.0, 0.1], np.float32)
    lone.push(0, tf.constant(g))
    lone.push(0, tf.constant(g))
    np.testing.assert_allclose(lone.pull(0).numpy(), -g - (0.9 * g + g), rtol=1e-6)


def test_device_store_does_not_compress_a_single_value(tf_devices):
    """MXNet's CommDevice::Reduce returns a lone value as it is, before any compression: nothing
    crosses between devices, so nothing is quantised (nor kept as a residual)."""
    kv = store.create("device", devices=tf_devices[:2])
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(0, np.zeros(3, np.float32))
    kv.push(0, np.array([0.3, -0.7, 1.2], np.float32))
    np.testing.assert_allclose(kv.pull(0).numpy(), [0.3, -0.7, 1.2])
    one = store.create("device", devices=tf_devices[:1])
    one.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    one.init(0, np.zeros(3, np.float32))
    one.push(0, [tf.constant([0.3, -0.7, 1.2])])
    np.testing.assert_allclose(one.pull(0).numpy(), [0.3, -0.7, 1.2])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int", "str"])
def test_dist_keys_never_share_a_server_slot(cluster, kind):
    """Negative and large int keys, or strs, in a real dist_sync job over 2 servers: each key
    keeps its own value (2**40 and -1 shared one before), a key of the other kind is refused;
    pushpull without out writes into the values."""
    import json

    from dist_worker import KEYS

    c = cluster(num_servers=2, num_workers=2)
    c.start_servers()
    outs = c.start_workers("keys", kind)
    codes = c.wait(120)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    n = len(KEYS[kind])
    for out in outs:
        r = json.loads(out.read_text())
        assert r["init"] == [i + 1.0 for i in range(n)]
        assert r["pushed"] == [1 + 20.0 * (i + 1) for i in range(n)]  # rank 0 + rank 1 + 2 x 10(i+1)
        assert r["ids"] == n
        assert r["in_place"] == [[2.0] * 3, [6.0] * 3, [6.0] * 3]  # pushpull without out, into the values
        assert r["flat"] == [2.0] * 6
        other = "str" if kind == "int" else "int"
        assert f"is a {other}, but this store's keys are {kind}s" in r["mixed"]
        assert "cannot run a Python updater" in r["updater"]
        assert r["capable"] is True and r["dead"] == 0
