"""2-bit gradient compression: exact packing, the error-feedback invariant, parameter checks."""

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
    assert C.parse({"type": "2bit", "threshold": 0.25}) == 0.25
    assert C.parse({"type": "2bit"}) == 0.5
    assert C.parse({"type": "none"}) is None and C.parse(None) is None
    for bad in ({"type": "1bit"}, {"type": "2bit", "threshold": 0}, {"type": "2bit", "thresh": 1}):
        with pytest.raises(ValueError):
            C.parse(bad)


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
