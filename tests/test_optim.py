"""The optimizer rules: one definition, the same numbers under numpy (servers) and TensorFlow."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim
from tfkv.store.tf_updater import TFOps, TFUpdater


def _run_numpy(opt, w, grads):
    state = tuple(np.zeros_like(w) for _ in opt.state_names)
    for t, g in enumerate(grads):
        w, state = opt.step(optim.NumpyOps, np.float32(t), w, g, state)
    return w


@pytest.mark.parametrize("opt", [
    optim.SGD(schedule=optim.Schedule(lr=0.1)),
    optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3),
    optim.Adam(schedule=optim.Schedule(lr=0.01), wd=1e-4),
    optim.SGD(schedule=optim.Schedule(name="cosine", lr=0.1, total=4, warmup=2), momentum=0.5),
    optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3, rescale_grad=0.25, clip_gradient=0.2),
    optim.Adam(schedule=optim.Schedule(lr=0.01), wd=1e-2, rescale_grad=0.5, clip_gradient=0.3),
], ids=["sgd", "sgd-momentum-wd", "adam", "sgd-cosine-warmup", "sgd-rescale-clip", "adam-rescale-clip"])
def test_numpy_and_tensorflow_agree(opt):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(5, 3)).astype(np.float32)
    grads = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(6)]
    expected = _run_numpy(opt, w0.copy(), grads)
    var = tf.Variable(w0)
    updater = TFUpdater(opt)
    updater.create_state("k", var, "/device:CPU:0")
    for g in grads:
        updater.update("k", var, tf.constant(g))
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-5, atol=1e-6)
    assert int(updater.get_states()["k/count"]) == 6
    assert not np.allclose(expected, w0)


def test_sgd_matches_mxnet_formula():
    opt = optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9, wd=0.1)
    w, g, v = np.float32(2.0), np.float32(1.0), np.float32(0.3)
    new_w, (new_v,) = opt.step(optim.NumpyOps, 0.0, w, g, (v,))
    assert new_v == pytest.approx(0.9 * 0.3 - 0.5 * (1.0 + 0.1 * 2.0))
    assert new_w == pytest.approx(2.0 + new_v)


def test_rescale_grad_and_clip_gradient_have_mxnet_meaning():
    # SGD (MXNet's sgd_mom_update): clip(rescale_grad * grad) first, then + wd * weight.
    sgd = optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9, wd=0.1, rescale_grad=0.25, clip_gradient=0.2)
    w, v = np.float32(2.0), np.float32(0.3)
    new_w, (new_v,) = sgd.step(optim.NumpyOps, 0.0, w, np.float32(4.0), (v,))
    assert new_v == pytest.approx(0.9 * 0.3 - 0.5 * (min(0.25 * 4.0, 0.2) + 0.1 * 2.0))
    assert new_w == pytest.approx(2.0 + new_v)
    _, (small,) = sgd.step(optim.NumpyOps, 0.0, w, np.float32(0.4), (v,))  # 0.1 is under the clip
    assert small == pytest.approx(0.9 * 0.3 - 0.5 * (0.25 * 0.4 + 0.1 * 2.0))
    # Adam (MXNet's adam_update): rescale_grad * grad + wd * weight, then clipped.
    adam = optim.Adam(schedule=optim.Schedule(lr=0.01), wd=0.1, rescale_grad=0.5, clip_gradient=0.3)
    _, (m, var) = adam.step(optim.NumpyOps, 0.0, np.float32(2.0), np.float32(-3.0), (np.float32(0), np.float32(0)))
    assert m == pytest.approx(0.1 * -0.3) and var == pytest.approx(0.001 * 0.09)  # clip(-1.5 + 0.2)
    # Unset, rescale_grad is MXNet's default 1 and nothing is clipped.
    plain = optim.SGD(schedule=optim.Schedule(lr=1.0))
    assert plain.step(optim.NumpyOps, 0.0, np.float32(0.0), np.float32(7.0), ())[0] == pytest.approx(-7.0)


@pytest.mark.parametrize("field, value", [("rescale_grad", 0.0), ("clip_gradient", -1.0), ("rescale_grad", "x")])
def test_rescale_and_clip_out_of_range_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"sgd.{field}="):
        optim.from_dict({**optim.to_dict(optim.SGD()), field: value})


def test_unset_rescale_grad_becomes_one_over_the_examples_of_an_update():
    assert optim.with_rescale(optim.SGD(), 128).rescale_grad == 1 / 128
    assert optim.with_rescale(optim.Adam(rescale_grad=0.5), 128).rescale_grad == 0.5  # set: kept


def test_mxnet_names_and_arguments_create_the_optimizer():
    sgd = optim.create("SGD", learning_rate=0.2, momentum=0.9, wd=1e-4, rescale_grad=1 / 128, clip_gradient=5.0)
    assert sgd == optim.SGD(schedule=optim.Schedule(lr=0.2), momentum=0.9, wd=1e-4, rescale_grad=1 / 128,
                            clip_gradient=5.0)
    assert optim.create("sgd").schedule.lr == 0.01  # MXNet's default learning rate
    adam = optim.create("Adam", beta1=0.8, epsilon=1e-6)
    assert (adam.name, adam.schedule.lr, adam.beta1, adam.epsilon) == ("adam", 0.001, 0.8, 1e-6)
    with pytest.raises(ValueError, match="optimizer 'nag' is not in tfkv; choose one of adam, sgd"):
        optim.create("nag")
    with pytest.raises(ValueError, match="argument\\(s\\) lr_scheduler not supported by tfkv; it takes"):
        optim.create("sgd", lr_scheduler=None)


def test_any_finite_learning_rate_as_in_mxnet():
    """MXNet's KVStore tests build an "add what you receive" updater as SGD with a negative rate;
    the rate is any finite number (numpy and TensorFlow, through JSON), and only a NaN or an
    infinity is refused, in one line naming it."""
    for opt in (optim.create("sgd", learning_rate=-1), optim.SGD(schedule=optim.Schedule(lr=-1.0)),
                optim.from_dict(json.loads(json.dumps(optim.to_dict(optim.create("sgd", learning_rate=-1.0)))))):
        w, g = np.ones(3, np.float32), np.array([0.5, 1.0, 2.0], np.float32)
        assert np.array_equal(_run_numpy(opt, w, [g, g]), w + 2 * g)
        tf_w, _ = opt.step(TFOps, tf.constant(0.0), tf.constant(w), tf.constant(g), ())
        assert np.array_equal(tf_w.numpy(), w + g)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError) as e:
            optim.create("sgd", learning_rate=bad)
        assert str(e.value) == f"schedule.lr={bad!r} must be a finite number"


def test_config_rescale_and_clip_reach_the_rule():
    from tfkv.config import AdamConfig, SGDConfig  # each optimizer's own schema

    opt = optim.from_config(SGDConfig(name="sgd", rescale_grad=0.5, clip_gradient=2.0), 10, 2)
    assert (opt.rescale_grad, opt.clip_gradient) == (0.5, 2.0)
    assert optim.from_config(AdamConfig(name="adam"), 10, 2).rescale_grad is None


def test_adam_first_step_moves_by_lr():
    # With bias correction, Adam's first step is lr * sign(g) (up to epsilon).
    opt = optim.Adam(schedule=optim.Schedule(lr=0.01))
    w, _ = opt.step(optim.NumpyOps, 0.0, np.float32(1.0), np.float32(-3.0), (np.float32(0), np.float32(0)))
    assert w == pytest.approx(1.01, abs=1e-6)


def test_schedules():
    step = optim.Schedule(name="step", lr=1.0, factor=0.1, milestones=[10, 20])
    assert [float(step(t, optim.NumpyOps)) for t in (0, 9, 10, 19, 20, 50)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01])
    cos = optim.Schedule(name="cosine", lr=1.0, total=100)
    assert float(cos(0, optim.NumpyOps)) == pytest.approx(1.0)
    assert float(cos(50, optim.NumpyOps)) == pytest.approx(0.5)
    assert float(cos(150, optim.NumpyOps)) == pytest.approx(0.0, abs=1e-7)
    warm = optim.Schedule(lr=1.0, warmup=4)
    assert [float(warm(t, optim.NumpyOps)) for t in (0, 1, 3, 10)] == pytest.approx([0.25, 0.5, 1, 1])
    assert float(step(tf.constant(15.0), TFOps)) == pytest.approx(0.1)


def test_optimizer_travels_as_json():
    opt = optim.SGD(schedule=optim.Schedule(name="step", lr=0.2, milestones=[5]), momentum=0.9, wd=1e-4,
                    rescale_grad=1 / 128, clip_gradient=5.0)
    again = optim.from_dict(json.loads(json.dumps(optim.to_dict(opt))))
    assert again == opt
    with pytest.raises(ValueError):
        optim.from_dict({"name": "os.system"})


@pytest.mark.parametrize("opt", [
    optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3),
    optim.SGD(schedule=optim.Schedule(name="step", lr=0.5, milestones=[2])),
    optim.Adam(schedule=optim.Schedule(lr=0.01)),
    optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3, rescale_grad=1 / 64),
    optim.SGD(schedule=optim.Schedule(lr=0.1), wd=1e-3, rescale_grad=0.5, clip_gradient=0.3),
    optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.5, rescale_grad=0.25, clip_gradient=0.3),
], ids=["sgd-momentum-wd", "sgd-step", "adam", "sgd-rescale", "sgd-rescale-clip-wd", "sgd-rescale-clip"])
def test_server_updater_follows_the_rule(opt):
    """The servers' numpy updater (in place for SGD) gives the rule's numbers and never writes
    into the weight it was given (it may still be in flight in a zero-copy send)."""
    from tfkv.ps.updater import NumpyUpdater

    rng = np.random.default_rng(3)
    w0 = rng.normal(size=50).astype(np.float32)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(5)]
    expected = _run_numpy(opt, w0.copy(), grads)
    updater, w = NumpyUpdater(opt), w0.copy()
    for g in grads:
        before = w.copy()
        new = updater.update(7, w, g)
        np.testing.assert_array_equal(w, before)
        w = new
    np.testing.assert_allclose(w, expected, rtol=1e-6, atol=1e-7)
