"""2-bit gradient compression: exact packing, the error-feedback invariant, momentum correction's
invariant against its closed form, the kinds' registry, parameter checks."""

import numpy as np
import pytest

from tfkv.ps import compression as C


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, 4096 + 3])
def test_pack_unpack_round_trip_is_exact(n):
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 3, n)
    t = 0.25
    values = np.array([0, t, -t], np.float32)[codes]
    residual = np.zeros(n, np.float32)
    words = C.pack(values, residual, t)
    assert words.dtype == np.uint32 and words.size == (n + 15) // 16
    np.testing.assert_array_equal(C.unpack(words, n, t), values)  # every value sent, exactly
    assert not residual.any()


def test_bit_layout_is_16_codes_per_word_low_bits_first():
    t = 1.0
    values = np.array([1, -1, 0, 1] + [0] * 12 + [-1], np.float32)
    words = C.pack(values, np.zeros(17, np.float32), t)
    assert words.tolist() == [0b01_00_10_01, 0b10]


def test_quantisation_and_residual_invariant_over_many_steps():
    rng = np.random.default_rng(0)
    n, t = 999, 0.5
    residual = np.zeros(n, np.float32)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(50):
        grad = rng.normal(scale=0.3, size=n).astype(np.float32)
        total += grad
        q = C.unpack(C.pack(grad, residual, t), n, t)
        assert set(np.unique(q)) <= {-t, 0.0, t}
        sent += q
        # sent + residual equals everything pushed so far (float32 round-off only)
        np.testing.assert_allclose(sent + residual, total, atol=1e-4)
        assert np.abs(residual).max() < t + 3 * 0.3 * 6  # bounded: never runs away


def test_thresholding_rule():
    residual = np.array([0.0, 0.0, 0.0, 0.0, 0.0], np.float32)
    q = C.unpack(C.pack(np.array([0.5, 0.49, -0.5, -0.7, 1.2], np.float32), residual, 0.5), 5, 0.5)
    assert q.tolist() == [0.5, 0.0, -0.5, -0.5, 0.5]
    np.testing.assert_allclose(residual, [0.0, 0.49, 0.0, -0.2, 0.7], atol=1e-6)


def test_unpack_refuses_malformed_words():
    with pytest.raises(ValueError, match="invalid code 3"):
        C.unpack(np.array([3], np.uint32), 1, 0.5)
    with pytest.raises(ValueError, match="padding"):
        C.unpack(np.array([1 << 4], np.uint32), 2, 0.5)
    with pytest.raises(ValueError, match="cannot hold"):
        C.unpack(np.zeros(2, np.uint32), 16, 0.5)


def test_parse_params():
    assert C.parse({"type": "2bit", "threshold": 0.25}).threshold == 0.25
    assert C.parse({"type": "2bit"}) == C.Setting(C.KINDS[1], 0.5)  # MXNet's name is MXNet's scheme
    assert C.parse({"type": "2bit"}).kind.worker_momentum is False
    assert C.parse({"type": "2bit_momentum"}).kind.worker_momentum is True
    assert C.parse({"type": "none"}) is None and C.parse(None) is None
    for bad in ({"type": "1bit"}, {"type": "2bit", "threshold": 0}, {"type": "2bit", "thresh": 1},
                {"type": "2bit_mxnet"}):  # a config's name, not the API's
        with pytest.raises(ValueError):
            C.parse(bad)


def test_config_names_are_the_registrys():
    """A tfkv-run config's 2bit is the accurate kind, 2bit_mxnet MXNet's; an unknown name is one
    line naming the choices."""
    assert C.from_config("2bit", 0.5).params() == {"type": "2bit_momentum", "threshold": 0.5}
    assert C.from_config("2bit_mxnet", 0.5).params() == {"type": "2bit", "threshold": 0.5}
    assert C.from_config("none", 0.5) is None
    with pytest.raises(ValueError, match=r"^kvstore.compression.type='1bit' is not known; choose one of none, "
                                         r"2bit_mxnet, 2bit$"):
        C.from_config("1bit", 0.5)


def test_split_momentum_moves_sgds_momentum_to_the_workers():
    from tfkv import optim

    sgd = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-4, rescale_grad=0.5)
    served, m = C.split_momentum(C.parse({"type": "2bit_momentum"}), sgd)
    assert m == 0.9 and served == optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.0, wd=1e-4, rescale_grad=0.5)
    assert C.split_momentum(C.parse({"type": "2bit"}), sgd) == (sgd, 0.0)  # MXNet's: momentum stays in the store
    assert C.split_momentum(None, sgd) == (sgd, 0.0)
    with pytest.raises(ValueError, match="applies SGD's momentum on the workers; optimizer adam has none"):
        C.split_momentum(C.parse({"type": "2bit_momentum"}), optim.Adam())


def _corrected_by_hand(grads, m, t):
    """The momentum-corrected gradients u_t = m * u_{t-1} + g_t of each step, one value at a time
    in float32 as pack_corrected's docstring states the rule: u_t goes into the residual, +-t is
    sent where the residual reaches t, and u restarts from zero where the residual still holds
    a whole t after sending. Returns (u_t of every step, the values sent, the last u)."""
    n = grads[0].size
    u, r = [np.float32(0)] * n, [np.float32(0)] * n
    corrected, sent = [], []
    for g in grads:
        step_u, step_sent = [], []
        for i in range(n):
            u[i] = np.float32(m) * u[i] + g[i]
            r[i] = r[i] + u[i]
            s = t if r[i] >= t else -t if r[i] <= -t else 0.0
            r[i] = r[i] - np.float32(s)
            step_u.append(u[i])
            step_sent.append(s)
            if abs(r[i]) >= t:
                u[i] = np.float32(0)
        corrected.append(np.array(step_u, np.float64))
        sent.append(np.array(step_sent))
    return corrected, sent, np.array(u, np.float32)


def test_momentum_correction_and_error_feedback_sum_exactly():
    """After N pushes, what was sent plus the residual is the sum of the momentum-corrected
    gradients; and while nothing is sent (a threshold above every sum) the velocity is m's
    geometric sum of the gradients and the residual their running sum (closed form)."""
    rng = np.random.default_rng(1)
    n, t, m, steps = 300, 0.5, 0.9, 40
    velocity, residual = np.zeros(n, np.float32), np.zeros(n, np.float32)
    grads = [rng.normal(scale=0.2, size=n).astype(np.float32) for _ in range(steps)]
    sent = [C.unpack(C.pack_corrected(g, velocity, residual, t, m), n, t) for g in grads]
    assert all(set(np.unique(s)) <= {-t, 0.0, t} for s in sent)
    assert 0.05 < np.mean([np.count_nonzero(s) for s in sent]) / n < 0.95  # some sent, some held back
    corrected, by_hand, last = _corrected_by_hand(grads, m, t)
    np.testing.assert_array_equal(np.array(sent), np.array(by_hand))
    np.testing.assert_array_equal(velocity, last)
    restarted = sum(int(np.count_nonzero(u != 0)) for u in corrected) - int(np.count_nonzero(last))
    assert restarted > 0  # the masking happened, and the sum below still holds
    np.testing.assert_allclose(np.sum(sent, axis=0) + residual, np.sum(corrected, axis=0), atol=2e-4)

    big = 1e6  # nothing is ever sent: no masking, the plain geometric sums
    velocity, residual = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for g in grads[:20]:
        assert not C.unpack(C.pack_corrected(g, velocity, residual, big, m), n, big).any()
    geometric = [sum(m ** (j - i) * grads[i].astype(np.float64) for i in range(j + 1)) for j in range(20)]
    np.testing.assert_allclose(velocity, geometric[-1], atol=1e-5)
    np.testing.assert_allclose(residual, np.sum(geometric, axis=0), atol=1e-4)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100])
def test_tensorflow_ops_pack_the_same_words_as_numpy(n):
    """The device store's in-graph compression is the wire format: the same words, residuals and
    decoded values as the numpy scheme the servers decode."""
    import tensorflow as tf

    from tfkv.store import tf_compression as T

    rng = np.random.default_rng(n)
    grad = rng.normal(size=n).astype(np.float32)
    start = (rng.normal(size=n) * 0.3).astype(np.float32)
    residual = start.copy()
    words = C.pack(grad, residual, 0.5)
    var = tf.Variable(start)
    got = T.pack(tf.constant(grad), var, 0.5)
    assert got.dtype == tf.uint32
    np.testing.assert_array_equal(got.numpy(), words)
    np.testing.assert_array_equal(var.numpy(), residual)
    np.testing.assert_array_equal(T.unpack(got, n, 0.5).numpy(), C.unpack(words, n, 0.5))

    # 2bit_momentum: the same words, residual and velocity, step after step
    velocity, residual = (rng.normal(size=n) * 0.3).astype(np.float32), start.copy()
    tf_velocity, tf_residual = tf.Variable(velocity), tf.Variable(start)
    for _ in range(3):
        g = rng.normal(size=n).astype(np.float32)
        words = C.pack_corrected(g, velocity, residual, 0.5, 0.9)
        np.testing.assert_array_equal(T.pack(tf.constant(g), tf_residual, 0.5, tf_velocity, 0.9).numpy(), words)
        np.testing.assert_array_equal(tf_residual.numpy(), residual)
        np.testing.assert_array_equal(tf_velocity.numpy(), velocity)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_gradients_compress_with_a_float32_residual(dtype):
    """A half gradient packs as its float32 value would; what is held back stays in a float32
    residual (half would round small leftovers away)."""
    import ml_dtypes

    half = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    grad = (np.arange(40, dtype=np.float32) / 16 - 1.2).astype(half)
    r16, r32 = np.zeros(40, np.float32), np.zeros(40, np.float32)
    assert C.pack(grad, r16, 0.5).tolist() == C.pack(grad.astype(np.float32), r32, 0.5).tolist()
    assert r16.dtype == np.float32 and r16.tolist() == r32.tolist()


@pytest.mark.parametrize("n", [1, 15, 17, 1000, (1 << 16) + 5, 3 * (1 << 16) - 3])
def test_compiled_packing_is_the_oracles_bit_for_bit(n):
    """The compiled kernels (tfkv.ps.kernels) give the words, residuals and velocities of the plain-numpy
    scheme (tests/ps/compression_oracle.py), step after step, for both kinds, at sizes that are
    no multiple of 16 nor of a block; unpack gives the oracle's values."""
    import compression_oracle as O

    rng = np.random.default_rng(n)
    t, m = 0.37, 0.9
    r_new, r_old = [(rng.normal(size=n) * 0.3).astype(np.float32)] * 2
    r_new, r_old = r_new.copy(), r_old.copy()
    v_new, v_old, rc_new, rc_old = (np.zeros(n, np.float32) for _ in range(4))
    for step in range(4):
        g = rng.normal(scale=0.4, size=n).astype(np.float32)
        g[:3] = np.array([t, -t, 0.0], np.float32)[:min(n, 3)]  # the thresholds themselves
        got, want = C.pack(g, r_new, t), O.pack(g, r_old, t)
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.uint32 and r_new.tobytes() == r_old.tobytes()
        np.testing.assert_array_equal(C.unpack(got, n, t), O.unpack(want, n, t))
        got, want = C.pack_corrected(g, v_new, rc_new, t, m), O.pack_corrected(g, v_old, rc_old, t, m)
        np.testing.assert_array_equal(got, want)
        assert rc_new.tobytes() == rc_old.tobytes() and v_new.tobytes() == v_old.tobytes()  # -0 as +0 too
    assert np.count_nonzero(v_new == 0) > 0 and np.count_nonzero(got) > 0


@pytest.mark.parametrize("n", [17, 40, (1 << 16) + 5])
def test_unpack_refuses_code_3_and_padding_anywhere(n):
    rng = np.random.default_rng(0)
    words = C.pack(rng.normal(size=n).astype(np.float32), np.zeros(n, np.float32), 0.5)
    for word in (0, len(words) // 2, len(words) - 1):
        for slot in (0, 7, (n - 1) % 16 if word == len(words) - 1 else 15):
            bad = words.copy()
            bad[word] |= np.uint32(3 << (2 * slot))
            with pytest.raises(ValueError, match="invalid code 3"):
                C.unpack(bad, n, 0.5)
    if n % 16:
        bad = words.copy()
        bad[-1] |= np.uint32(1 << 30)  # a +t in the last slot, past the last value
        with pytest.raises(ValueError, match="padding"):
            C.unpack(bad, n, 0.5)


@pytest.mark.parametrize("kind", ["2bit", "2bit_momentum"])
@pytest.mark.parametrize("bounds", [[(0, 1)], [(0, 37)], [(0, 17), (17, 40), (40, 1003)]])
def test_tensorflow_packing_of_a_keys_parts_is_the_oracles(kind, bounds):
    """In-graph packing (a dist store's compiled step): per part of a key, the oracle's words;
    the residual and velocity the oracle's after every step, in a tf.function as the step runs it."""
    import compression_oracle as O
    import tensorflow as tf

    from tfkv.store import tf_compression as T

    n, t, m = bounds[-1][1], 0.25, 0.875
    rng = np.random.default_rng(n)
    momentum = kind == "2bit_momentum"
    residual, velocity = tf.Variable(tf.zeros([n])), tf.Variable(tf.zeros([n])) if momentum else None
    pack = tf.function(lambda g: T.pack_parts(g, residual, t, bounds, velocity, m))
    r_old = [np.zeros(e - s, np.float32) for s, e in bounds]
    v_old = [np.zeros(e - s, np.float32) for s, e in bounds]
    for step in range(4):
        g = rng.normal(scale=0.3, size=n).astype(np.float32)
        got = pack(tf.constant(g))
        for (s, e), words, r, v in zip(bounds, got, r_old, v_old):
            want = O.pack_corrected(g[s:e], v, r, t, m) if momentum else O.pack(g[s:e], r, t)
            assert words.dtype == tf.uint32
            np.testing.assert_array_equal(words.numpy(), want)
        assert residual.numpy().tobytes() == np.concatenate(r_old).tobytes()
        if momentum:
            assert velocity.numpy().tobytes() == np.concatenate(v_old).tobytes()


@pytest.mark.parametrize("n", [1, 17, (1 << 16) + 5])
def test_unpack_onto_is_the_copy_plus_unpack_bit_for_bit_and_refuses_what_unpack_refuses(n):
    """A copy moved by a 2-bit reply in one pass equals copy + unpack(words), -0 included; the base
    is left as it was; malformed words are refused as unpack refuses them."""
    rng = np.random.default_rng(n)
    base = rng.normal(size=n).astype(np.float32)
    base[0] = -0.0
    words = C.pack(rng.normal(size=n).astype(np.float32), np.zeros(n, np.float32), 0.5)
    before = base.copy()
    got = C.unpack_onto(base, words, 0.5)
    assert got.tobytes() == (base + C.unpack(words, n, 0.5)).tobytes() and base.tobytes() == before.tobytes()
    bad = words.copy()
    bad[0] |= np.uint32(3)
    with pytest.raises(ValueError, match="invalid code 3"):
        C.unpack_onto(base, bad, 0.5)
    with pytest.raises(ValueError, match="cannot hold exactly"):
        C.unpack_onto(np.zeros(n + 16, np.float32), words, 0.5)  # a word more than the payload has
