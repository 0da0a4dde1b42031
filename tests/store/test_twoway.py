"""Two-way 2-bit compression (`both_ways`): the servers' replies compressed with error feedback on
the servers, against a plain numpy oracle of the error-feedback sums in both directions; real
scheduler, servers and workers over real sockets (tests/workers/twoway_worker.py)."""

import sys

import numpy as np
import pytest
import twoway_worker as W  # tests/workers, on pytest's path

from tfkv import store
from tfkv.ps import compression

SPLIT = {"MXNET_KVSTORE_BIGARRAY_BOUND": "1000", "TFKV_CHUNK_BYTES": "4000"}  # 2 servers, chunks


def _quantised(residual, t):
    """What 2-bit sends of `residual` (taken out of it, in place): +-t where |residual| >= t."""
    sent = np.where(residual >= t, t, np.where(residual <= -t, -t, 0.0))
    residual -= sent
    return sent


def oracle(workers, steps, summing=False, start=0, weights=None, copy=None):
    """The copy every worker pulls after each step (float64: every value is dyadic, so exact):
    each worker's residual += g, +-0.5 sent; the servers sum, SGD (lr 0.5, momentum 0.5) updates
    the weights (or, summing, the sum is the value); the reply is +-0.25 of weights - mirror,
    the mirror (the workers' copy) moved by it; summing, +-0.25 of sum + the servers' residual.
    From `start` with the servers' `weights` and the `copy` (a resume: the workers' residuals
    and the momentum as given: zero and none here, the test's checkpoint holds the momentum)."""
    w = np.asarray(W.initial(), np.float64) if weights is None else weights
    mirror = w.copy() if copy is None else copy
    residuals = [np.zeros(W.SIZE) for _ in range(workers)]
    server_residual, velocity = np.zeros(W.SIZE), np.zeros(W.SIZE)
    pulled = [mirror.copy()]
    for step in range(start, start + steps):
        total = sum(_quantised(np.add(residuals[r], W.grads(step, r), out=residuals[r]), W.PUSH_T)
                    for r in range(workers))
        if summing:
            server_residual += total
            pulled.append(_quantised(server_residual, W.PULL_T))
            continue
        velocity = W.MOMENTUM * velocity - W.LR * total
        w = w + velocity
        mirror = mirror + _quantised(w - mirror, W.PULL_T)
        pulled.append(mirror.copy())
    return np.stack(pulled), w, velocity


def _run(cluster, kind, workers, mode, steps, state="", timeout=180):
    c = cluster(num_servers=2, num_workers=workers, TEST_KVSTORE=kind, **SPLIT)
    c.start_servers()
    outs = []
    for i in range(workers):
        outs.append(c.dir / f"{kind}-{mode}-{i}.npz")
        c.start(f"worker {i}", "worker", [sys.executable, str(W.__file__), str(outs[-1]), mode, str(steps),
                                           *([state] if state else [])], TFKV_RANK_HINT=str(i))
    codes = c.wait(timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    return [np.load(o) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("kind,workers", [("dist_sync", 2), ("dist_sync_device", 2), ("dist_async", 1),
                                          ("dist_async_device", 1)])
def test_two_way_compression_is_the_oracles_error_feedback_both_ways(cluster, kind, workers):
    """Every pulled copy is the oracle's, bit for bit the same on every worker (dist_sync); the
    first pull carries float32, every later one 2-bit words: 1/16 of float32."""
    got = _run(cluster, kind, workers, "sgd", 6)
    want, _, _ = oracle(workers, 6)
    assert np.abs(want[-1] - want[0]).max() > 1  # the weights moved by many reply thresholds
    for r in got:
        np.testing.assert_array_equal(r["pulled"], want)
        # 3000 values in 4 chunks of 750: 47 words each; float32 would be 12000 bytes
        assert list(r["nbytes"]) == [4 * 47 * 4] * 6
    if workers > 1:
        assert all(r["pulled"].tobytes() == got[0]["pulled"].tobytes() for r in got)


@pytest.mark.slow
def test_two_way_compression_without_an_optimizer_sends_the_sum_with_server_residuals(cluster):
    """update_on_kvstore=false: the servers only sum; each reply is the round's sum 2-bit with the
    servers' residual, the same on every worker."""
    got = _run(cluster, "dist_sync", 2, "sum", 5)
    want, _, _ = oracle(2, 5, summing=True)
    assert np.abs(want[1:]).sum() > 0
    for r in got:
        np.testing.assert_array_equal(r["pulled"], want)


@pytest.mark.slow
def test_a_resumed_two_way_job_continues_exactly(cluster, tmp_path):
    """A checkpoint (the servers' optimizer state, with their weights under both_ways, and the
    workers' copy as the model's weights) resumed in a fresh job: its copies are those of a job
    never stopped, every worker's residuals back as they were."""
    state = str(tmp_path / "servers.states")
    first = _run(cluster, "dist_sync", 2, "sgd", 4, state)
    with np.load(state) as f:
        assert sorted(n for n in f.files if not n.startswith("worker_feedback/")) == [
            "w/count", "w/momentum", "w/server_weights"]
        assert sorted(n for n in f.files if n.startswith("worker_feedback/")) == [
            "worker_feedback/0/w/residual", "worker_feedback/1/w/residual"]
        weights, velocity = f["w/server_weights"].astype(np.float64), f["w/momentum"].astype(np.float64)
    want, w, v = oracle(2, 4)
    np.testing.assert_array_equal(first[0]["pulled"], want)
    np.testing.assert_array_equal(weights, w)  # the servers' weights, not the copy: it holds their residual
    assert np.abs(weights - want[-1]).max() > 0
    resumed = _run(cluster, "dist_sync", 2, "resume", 3, state)
    # the oracle resumed: momentum and weights as checkpointed, the mirror the copy, the residuals
    # as the first job left them
    want_after = _resumed_oracle(weights, velocity, want[-1], start=4, steps=3)
    for r in resumed:
        np.testing.assert_array_equal(r["pulled"], want_after)


def _resumed_oracle(weights, velocity, copy, start, steps):
    residuals = [np.zeros(W.SIZE) for _ in range(2)]
    for step in range(start):  # a worker's residual depends on its own gradients only
        for r in range(2):
            _quantised(np.add(residuals[r], W.grads(step, r), out=residuals[r]), W.PUSH_T)
    w, mirror, pulled = weights, copy, [copy]
    for step in range(start, start + steps):
        total = sum(_quantised(np.add(residuals[r], W.grads(step, r), out=residuals[r]), W.PUSH_T) for r in range(2))
        velocity = W.MOMENTUM * velocity - W.LR * total
        w = w + velocity
        mirror = mirror + _quantised(w - mirror, W.PULL_T)
        pulled.append(mirror)
    return np.stack(pulled)


def test_bad_two_way_settings_are_refused_in_one_line():
    for params, words in [({"type": "none", "both_ways": True}, "compression.type=none compresses nothing"),
                          ({"type": "2bit", "both_ways": "yes"}, "both_ways='yes' must be true or false"),
                          ({"type": "2bit", "pull_threshold": 0.1}, "only both_ways=true compresses"),
                          ({"type": "2bit", "both_ways": True, "pull_threshold": 0}, "pull_threshold=0.0 must be")]:
        with pytest.raises(ValueError, match=words):
            compression.parse(params)
    with pytest.raises(ValueError, match="kvstore=device has no servers"):
        store.create("device").set_gradient_compression({"type": "2bit", "both_ways": True})
    with pytest.raises(ValueError, match="kvstore=local sends neither"):
        store.create("local").set_gradient_compression({"type": "2bit", "both_ways": True})


def test_the_replies_threshold_follows_the_servers_optimizer():
    from tfkv import optim

    setting = compression.parse({"type": "2bit", "threshold": 0.5, "both_ways": True})
    sgd = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, rescale_grad=1 / 128)
    steps = compression.PULL_STEPS  # one step's largest change, times
    assert compression.pull_threshold_for(setting, sgd, 2) == pytest.approx(steps * 0.1 / 128 * 0.5 * 2 / 0.1)
    assert compression.pull_threshold_for(setting, optim.Adam(), 2) == pytest.approx(steps * 0.001)
    assert compression.pull_threshold_for(setting, None, 2) == 0.5
    given = compression.parse({"type": "2bit", "both_ways": True, "pull_threshold": 0.01})
    assert compression.pull_threshold_for(given, sgd, 2) == 0.01


def test_a_reply_asked_again_or_for_another_version_never_moves_a_copy_twice():
    """The servers' replies by the version a pull holds (tfkv.ps.replies), decoded by a worker's
    copies (tfkv.ps.copies): a resent pull of the version before gets the same words, a pull of
    the newest gets nothing new, any other the mirror whole; async mirrors are per worker."""
    from tfkv.ps import protocol as P
    from tfkv.ps.copies import Copies
    from tfkv.ps.replies import Replies

    replies, copies = Replies(), Copies()
    replies.threshold = 0.25
    w0, w1 = np.array([0.0, 1.0, -1.0], np.float32), np.array([0.5, 1.0, -1.25], np.float32)

    def pull(value, round_no, seq, holds=None, sync=True, sender=9):
        meta = None if holds is None else {"holds": holds}
        reply = replies.reply(P.Message(P.Type.PULL, sender, seq, 5, meta=meta), value, round_no, sync, False)
        return P.decode(P.encode(reply))

    first = pull(w0, 0, 1)
    assert first.dtype == P.DType.FLOAT32 and first.meta == {"version": 0}
    copies.asked(1, 5)
    np.testing.assert_array_equal(copies.decode(1, first), w0)
    words = pull(w1, 1, 2, holds=0)
    assert words.dtype == P.DType.TWOBIT and words.meta == {"version": 1, "threshold": 0.25}
    assert np.array_equal(pull(w1, 1, 3, holds=0).data, words.data)  # asked again: the same words
    copies.asked(2, 5)
    np.testing.assert_array_equal(copies.decode(2, words), [0.25, 1.0, -1.25])
    assert not pull(w1, 1, 4, holds=1).data.any()  # the newest held: nothing new
    assert pull(w1, 1, 5, holds=7).dtype == P.DType.FLOAT32  # another version: whole
    again = pull(w1, 1, 6, holds=0)
    copies.asked(6, 5)
    np.testing.assert_array_equal(copies.decode(6, again), [0.25, 1.0, -1.25])  # not moved twice
    # async: each worker's own mirror, moved at each of its pulls
    assert pull(w0, 0, 7, sync=False, sender=1).dtype == P.DType.FLOAT32
    assert pull(w1, 0, 8, holds=0, sync=False, sender=1).meta["version"] == 1
    assert pull(w1, 0, 9, sync=False, sender=2).meta == {"version": 0}
