"""The parameter server across real processes and real ZeroMQ sockets on 127.0.0.1.

Every cluster is a real scheduler, real servers (`python -m tfkv.ps.node`) and real worker
processes; the `cluster` fixture asserts at the end that none of them is left running.
"""

import json
import signal
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfkv import optim, store
from tfkv.errors import EXIT_PEER_FAILED
from tfkv.models import build
from tfkv.parallel.data_parallel import DataParallel


def _results(paths):
    return [json.loads(p.read_text()) for p in paths]


def _ok(c, timeout=120):
    codes = c.wait(timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"


def _job(cluster, scenario, *args, num_servers=1, num_workers=1, timeout=120, **env):
    """Servers and workers running `scenario` to a clean end: (the cluster, each worker's output
    file)."""
    c = cluster(num_servers=num_servers, num_workers=num_workers, **env)
    c.start_servers()
    outs = c.start_workers(scenario, *args)
    _ok(c, timeout)
    return c, outs


def test_sync_semantics_big_arrays_and_string_keys(cluster):
    _, outs = _job(cluster, "semantics", num_servers=2, num_workers=2, MXNET_KVSTORE_BIGARRAY_BOUND="100")
    for r in _results(outs):
        assert r["num_workers"] == 2
        for step in range(3):
            a, big_first, big_last = r[f"step{step}"]
            assert a == [[3.0] * 3] * 2  # (0+1) + (1+1): the sum of both workers' pushes
            assert big_first == big_last == 2 * step + 1  # split over both servers, summed per part
        assert r["device_sum"] == [6.0] * 5  # (1 + 2) from each of the two workers
    assert sorted(r["rank"] for r in _results(outs)) == [0, 1]


def test_request_numbers_wrap_as_the_header_carries_them(cluster):
    """A header carries 32 bits of sequence number; a worker's numbers wrap with it, so a job
    past 2**32 requests (430,000 steps of a 10,000-key model) still matches every reply."""
    _, outs = _job(cluster, "seq_wrap", num_workers=2)
    for r in _results(outs):
        assert r["got"] == [[2.0, 2.0]] * 4  # both workers' pushes, every step
        assert 0 < r["next"] < 1000  # wrapped past 2**32 - 1


def test_pushpull_streams_each_key_back(cluster):
    _, outs = _job(cluster, "pushpull", num_servers=2, num_workers=2, MXNET_KVSTORE_BIGARRAY_BOUND="500",
                   TFKV_CHUNK_BYTES="2000")
    for r in _results(outs):
        assert r["parts"] == {"small": 1, "split": 2, "chunked": 4}  # 2 servers x 2 chunks of 500 floats
        small, split, shape, chunked = r["pushpull"]
        assert small == [3.0] * 3  # 1 + 2
        assert split == [3.0, 3.0]  # (1 + 0) from worker 0, (1 + 1) from worker 1
        assert shape == [50, 40] and chunked == [2.0, 2.0]  # 0 + 2
        assert r["arrived"] == ["chunked", "small", "split"]  # each key once
        assert r["async"] == {"small": [2.0, 2.0], "split": [2.0, 2.0], "chunked": [2.0, 2.0]}
        assert r["into_out"] == [3.0, 3.0, True]
        assert r["landed"] == 4 and r["landing_left"] == 0  # secure: each part opened in dest itself
        assert "expected a writable float[50, 40]" in r["bad_out"]
        assert r["after_bad_out"] == 2.0
        assert r["cast_in_place"] == ["float64", [3.0] * 3, 0.0, 0.0]  # 1 + 2; chunked: 0 + 0
        assert r["after_cast"] == 3.0
        assert r["compressed"] == 1.0  # 0.5 quantised to +0.5 by both workers


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_update_on_servers_counts_every_push_once(cluster, kind):
    _, outs = _job(cluster, "updates", "20", num_workers=2, TEST_KVSTORE=kind)
    for r in _results(outs):
        # SGD lr=1 from 100: every step takes off 1 (worker 0) and 2 (worker 1).
        assert r["final"] == [100.0 - 20 * 3] * 4
        if kind == "dist_sync":
            assert r["last_seen"] == r["final"]  # a pull after the last push sees the last round


def test_bad_requests_get_errors_and_the_server_stays_up(cluster):
    _, (out,) = _job(cluster, "bad_requests")
    r = _results([out])[0]
    errors = r["errors"]
    assert "header is 7 bytes" in errors[0]
    assert "elements exceed" in errors[1] or "payload is" in errors[1]
    assert "3 values pushed, the key holds 8" in errors[2]
    assert "not initialised" in errors[3]
    assert "not a worker of this job" in errors[4]
    assert "optimizer 'x' is unknown" in errors[5]
    assert "bad magic" in errors[6]
    assert "key 987654 is not initialised" in errors[7]
    assert "names a key twice" in errors[8]
    assert "holding 8 values carries 9" in errors[9]
    assert errors[10] == "PUSHPULL"  # the good one: one reply, no error
    assert r["after"] == [2.0] * 8  # none of the bad pushes was applied


def test_resend_retransmits_and_never_applies_twice(cluster):
    _, (out,) = _job(cluster, "lossy", PS_RESEND="1", PS_RESEND_TIMEOUT="300")
    r = _results([out])[0]
    assert r["first"] == [-1.0] * 4  # the lost push arrived through the retransmission
    assert r["second"] == [-2.0] * 4  # the duplicated push was applied once
    assert r["sends"] >= 3


def test_verbose_logs_connections_and_messages(cluster):
    c, _ = _job(cluster, "updates", "2", PS_VERBOSE="2", DMLC_INTERFACE="lo")
    assert "registered" in c.output("scheduler")
    assert "listening on 127.0.0.1" in c.output("server 0")
    assert "PUSH key=" in c.output("server 0") and "PULL key=" in c.output("server 0")
    assert "cluster of 1 servers, 1 workers" in c.output("worker 0")


@pytest.mark.slow
@pytest.mark.parametrize("kind,ndev,update_on_kvstore", [
    ("dist_sync", 1, "1"), ("dist_sync", 1, "0"), ("dist_sync_device", 2, "1"),
])
def test_dist_sync_matches_local_at_the_global_batch(cluster, tf_devices, kind, ndev, update_on_kvstore):
    """2 workers at batch b end with the weights of `local` at batch 2b.

    Worker r trains on slice r of each global batch; its loss is scaled by 1/(2b), so the
    servers' sum is the gradient of the global batch. Float32 sums are taken in another order
    (per worker, then across workers), so agreement is to round-off, not bit for bit.
    """
    b = 16
    _, outs = _job(cluster, "train", str(ndev), update_on_kvstore, str(b), num_servers=2, num_workers=2,
                   timeout=240, TEST_KVSTORE=kind, MXNET_KVSTORE_BIGARRAY_BOUND="100")

    keras.utils.set_random_seed(7)
    opt = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3)
    mlp = {"_target_": "tfkv.models.mlp.build", "hidden": [32, 16]}
    dp = DataParallel(lambda: build(mlp, input_shape=(8, 8, 1), num_classes=10),
                      tf_devices[:2], store.create("local", devices=tf_devices[:2]), opt, [b, b])
    rng = np.random.default_rng(42)
    for _ in range(6):
        dp.step(tf.constant(rng.normal(size=(2 * b, 8, 8, 1)).astype(np.float32)),
                tf.constant(rng.integers(0, 10, 2 * b).astype(np.int32)))
    expected = dp.get_weights()
    for out in outs:
        with np.load(str(out) + ".npz") as f:
            got = [f[f"arr_{i}"] for i in range(len(f.files))]
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["worker 1", "server 0", "scheduler"])
def test_a_dead_node_stops_every_other_node_fast(cluster, victim):
    c = cluster(num_servers=2, num_workers=2, TFKV_HEARTBEAT_TIMEOUT="3")  # timed: a short timeout
    c.start_servers()
    outs = c.start_workers("hang", "120")
    deadline = time.time() + 120
    while not all(o.exists() and o.stat().st_size for o in outs):
        assert time.time() < deadline, c.outputs()
        time.sleep(0.1)
    time.sleep(0.5)
    c.procs[victim].send_signal(signal.SIGKILL)
    killed_at = time.time()
    codes = c.wait(timeout=20)
    took = time.time() - killed_at
    assert took < 10, f"the others took {took:.1f} s to stop"
    for name, code in codes.items():
        if name != victim:
            assert code != 0, f"{name} exited 0 after {victim} died\n{c.outputs()}"
            if name != "scheduler" and victim != "scheduler":
                assert victim in c.output(name), c.output(name)
    if victim == "scheduler":
        assert "the scheduler at 127.0.0.1" in c.output("worker 0")


@pytest.mark.slow
def test_manual_launch_with_the_same_command_for_every_role(cluster, tmp_path):
    """The MXNet guide's manual launch: export DMLC_*, run one command per role."""
    run_dir = tmp_path / "run"
    cmd = ["tfkv-run", "kvstore=dist_sync", "epochs=2", f"hydra.run.dir={run_dir}", "progress=false"]
    c = cluster(num_servers=1, num_workers=2)
    c.start("scheduler", "scheduler", cmd)
    c.start("server 0", "server", cmd)
    for i in range(2):
        c.start(f"worker {i}", "worker", cmd + [f"hydra.job.name=worker{i}"], TFKV_RANK_HINT=str(i))
    _ok(c, timeout=240)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["epoch"] == 2 and metrics["test_accuracy"] > 0.8
    assert "import tensorflow" not in c.output("server 0")


@pytest.mark.parametrize("what,when", [("push", "after"), ("push", "before"), ("barrier", "before"),
                                       pytest.param("pushpull", "before", marks=pytest.mark.slow),
                                       pytest.param("barrier", "after", marks=pytest.mark.slow)])
def test_a_round_or_barrier_a_finished_worker_never_joins_fails_at_once(cluster, what, when):
    """Issue 28: two dist_sync workers; worker 0 pushes and pulls key 0 three times and closes,
    worker 1 pushes a fourth time (or pushpulls keys fused into one round, or enters a barrier).
    Worker 1 used to wait without a word until killed (MXNet does). Now the round (barrier) that
    can never close fails it at once, whether it was already waiting when worker 0 left or came
    later, with one line naming the key, the round (barrier) and the worker that left; the job
    then ends non-zero, worker 0's clean exit left as it was."""
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("worker_left", what, when)
    codes = c.wait(timeout=40)
    # worker 1 stops because a peer left: a peer's reaction (EXIT_PEER_FAILED), which launchers
    # never blame over a failure of the peer's own (test_contract's worker that exits 5)
    assert (codes["worker 0"], codes["worker 1"]) == (0, EXIT_PEER_FAILED), f"{codes}\n{c.outputs()}"
    assert codes["scheduler"] != 0 and codes["server 0"] != 0, f"{codes}\n{c.outputs()}"
    closed, failed = _results(outs)
    error = failed["error"]
    if what == "barrier":
        assert error.startswith("ClusterError: worker 1: barrier "), error
        assert "can never be released: worker 0 left the job" in error, error
    else:
        also = " (and the 1 keys pushed with it)" if what == "pushpull" else ""
        assert error.startswith(f"DistError: server 0: key 0{also}: round 4 can never close: worker 0 left the job"), error
    assert "\n" not in error
    # At once: from worker 0's close, or worker 1's fourth if later, well inside the heartbeat
    # timeout that ends a dead peer.
    assert failed["at"] - max(closed["closing_at"], failed["acting_at"]) < 2.0, (failed, closed)
    assert error.split(": ", 1)[1] in c.output("worker 1")


def test_a_barrier_after_a_push_sees_it_applied(cluster):
    _, outs = _job(cluster, "push_then_barrier", num_servers=2, num_workers=2)
    assert [r["after"] for r in _results(outs)] == [3.0, 3.0]


# -- faster communication: 2-bit compression, chunking ----------------------------------------------

def test_two_bit_compression_over_the_wire(cluster):
    _, outs = _job(cluster, "compressed", num_servers=2, num_workers=2, MXNET_KVSTORE_BIGARRAY_BOUND="1000",
                   TFKV_CHUNK_BYTES="4000")
    for r in _results(outs):
        assert r["parts"] == 4  # split over 2 servers, each half cut into 2 chunks of <= 4000 bytes
        assert r["a"] == [0.0, 1.0]  # 0.3 is held back, then 0.6 sends 0.5 from each worker
        assert r["big"] == [1.0, 1.0]  # 0.5 from worker 0, 0.5 (of 1.0) from worker 1
        assert r["big_residual"] == [0.5, 0.5]  # worker 1's residual arrives a step later
        assert r["plain"] == 0.5
        # 3000 float32 = 12000 bytes; 4 chunks of 750 values = 4 * 47 words = 752 bytes
        assert r["plain_bytes"] == 12000 and r["compressed_bytes"] == 752
        assert r["plain_bytes"] / r["compressed_bytes"] > 15.9


def _momentum_oracle(workers, steps, m=0.5, t=0.5, lr=1.0):
    """The weights after each step of the momentum_compressed scenario, in plain Python: each
    worker's velocity u = m*u + g and residual v += u, +-t sent where |v| >= t, u zeroed where
    |v| is still >= t after it, the sum applied by SGD without momentum."""
    from dist_worker import MOMENTUM_GRADS

    w, u, v, after = [0.0] * 4, [[0.0] * 4 for _ in range(workers)], [[0.0] * 4 for _ in range(workers)], []
    for step in range(steps):
        for r in range(workers):
            for i, g in enumerate(MOMENTUM_GRADS[step % 3]):
                u[r][i] = m * u[r][i] + g * (r + 1)
                v[r][i] += u[r][i]
                sent = t if v[r][i] >= t else -t if v[r][i] <= -t else 0.0
                v[r][i] -= sent
                u[r][i] = 0.0 if abs(v[r][i]) >= t else u[r][i]
                w[i] -= lr * sent
        after.append(list(w))
    return after


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async", "dist_sync_device"])
def test_momentum_corrected_compression_over_the_wire(cluster, kind):
    """2bit_momentum: the workers apply the momentum before quantising, the servers run SGD
    without it (their optimizer holds no momentum state), and the weights are the oracle's; a
    push before the optimizer (whose momentum the workers need) is refused in one line."""
    _, outs = _job(cluster, "momentum_compressed", num_servers=2, num_workers=2, TEST_KVSTORE=kind)
    want = _momentum_oracle(2, 6)
    assert want[-1] != want[0] and any(abs(x) > 0.5 for x in want[-1])  # momentum moved it beyond one send
    for r in _results(outs):
        assert ("dist_async needs an optimizer" if kind == "dist_async" else
                "2bit_momentum applies the optimizer's momentum on the workers: call set_optimizer") in r["refused"]
        # no momentum on the servers; the worker's own error feedback beside their state
        assert r["state"] == ["w/count", f"worker_feedback/{r['rank']}/w/residual",
                              f"worker_feedback/{r['rank']}/w/velocity"]
        assert r["final"] == want[-1]
        if kind != "dist_async":  # async: each push applied on arrival, the sum the same in the end
            assert r["seen"] == want
    # worker 0's checkpoint after share_feedback holds every worker's own state (dist_sync: through
    # the servers), each worker's its own; dist_async shares nothing (no step where they belong together)
    results = sorted(_results(outs), key=lambda r: r["rank"])
    everyone = {k: v for r in results for k, v in r["own"].items()}
    assert len(everyone) == 4 and all(any(x != 0 for x in v) for k, v in everyone.items() if "residual" in k)
    assert results[0]["shared"] == (results[0]["own"] if kind == "dist_async" else everyone)


def test_resend_with_compression_never_applies_twice(cluster):
    _, (out,) = _job(cluster, "lossy_compressed", PS_RESEND="1", PS_RESEND_TIMEOUT="300")
    r = _results([out])[0]
    # SGD lr=1, pushes of 1.0 with threshold 0.5: 0.5 is sent each step (the rest accumulates).
    assert r["first"] == [-0.5] * 4
    assert r["second"] == [-1.0] * 4
    assert r["sends"] >= 3


def test_compression_is_refused_by_single_machine_stores():
    kv = store.create("local")
    kv.set_gradient_compression({"type": "none"})
    with pytest.raises(ValueError, match="parameter servers"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})


# -- parallel reduction on the servers -------------------------------------------------------------

def test_large_arrays_are_summed_in_threads_small_ones_inline():
    from tfkv.ps.reduction import Reducer

    rng = np.random.default_rng(1)
    a, b = rng.normal(size=10_007).astype(np.float32), rng.normal(size=10_007).astype(np.float32)
    srv = Reducer(3, min_span=3_000)  # a server's summation: 3 ranges of 3,335 or 3,336
    out = srv.add(a, b)
    np.testing.assert_array_equal(out, a + b)  # same float32 adds, only split by ranges
    assert srv._pool is not None and srv._pool._max_workers == 2  # the serving thread takes the first range
    small = Reducer(3, min_span=6_000)
    np.testing.assert_array_equal(small.add(a, b), a + b)
    assert small._pool is None
    assert out is not a and out is not b
    for server in (srv, small):  # the third and later pushes of a round add in place
        acc = a.copy()
        assert server.add(acc, b, out=acc) is acc
        np.testing.assert_array_equal(acc, a + b)


def test_reduction_threads_from_the_environment():
    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.ps import cpus
    from tfkv.ps.reduction import Reducer

    base = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
            "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    assert ClusterEnv.from_env(base).reduction_nthreads == 0  # one per CPU the server may use
    assert Reducer(0).nthreads == cpus.usable()
    assert ClusterEnv.from_env({**base, "MXNET_KVSTORE_REDUCTION_NTHREADS": "2"}).reduction_nthreads == 2
    assert ClusterEnv.from_env({**base, "TFKV_REDUCTION_NTHREADS": "1",
                                "MXNET_KVSTORE_REDUCTION_NTHREADS": "8"}).reduction_nthreads == 1
    assert ClusterEnv.from_env({**base, "TFKV_CHUNK_BYTES": "1024"}).chunk_bytes == 1024


@pytest.mark.parametrize("p2p", ["1", "0"])
def test_dist_device_types_sum_on_a_device_or_through_the_host(cluster, p2p):
    _, outs = _job(cluster, "semantics", num_workers=2, TEST_KVSTORE="dist_sync_device", MXNET_ENABLE_GPU_P2P=p2p)
    for r in _results(outs):
        assert r["device_sum"] == [6.0] * 5
        assert r["step2"][0] == [[3.0] * 3] * 2


# -- leaving: at interpreter exit, and when a reply never comes -------------------------------------

def test_a_script_that_ends_without_close_leaves_cleanly(cluster):
    """MXNet's worker scripts end without a teardown call (the store leaves in its destructor):
    the interpreter's exit leaves as close() does, so every role exits 0, none is declared dead.
    An exception displayed before the store was made (sys.last_value, which IPython sets for a
    cell's traceback) is not this exit's."""
    _, outs = _job(cluster, "ends_without_close", num_workers=2, timeout=60, TEST_SHOWN_EXCEPTION="1")
    assert [r["value"] for r in _results(outs)] == [[3.0] * 4] * 2


def test_a_lost_reply_fails_the_request_naming_server_and_request(cluster):
    """A reply that never arrives while the server keeps heartbeating: the worker asks the server
    what it still holds and fails within a few heartbeat timeouts, naming the server and request."""
    c = cluster(num_servers=1, num_workers=1, TFKV_HEARTBEAT_TIMEOUT="3")  # timed: a short timeout
    c.start_servers()
    (out,) = c.start_workers("lost_reply")
    codes = c.wait(timeout=40)
    ended = time.time()
    assert codes["worker 0"] == 1 and codes["server 0"] == codes["scheduler"] == 3, f"{codes}\n{c.outputs()}"
    log = c.output("worker 0")
    assert "server 0 at 127.0.0.1:" in log and "PULL of key 'w' (request" in log and "reply was lost" in log, log
    assert ended - _results([out])[0]["pulling_at"] < 12  # heartbeat timeout 3 s: one probe, its answer


def test_a_server_that_answers_nothing_fails_the_request_after_the_request_timeout(cluster):
    """Every message from the server is lost from the first pull on, the answer to the PING that
    asks about it too: the pull fails once TFKV_REQUEST_TIMEOUT has passed, naming both."""
    c = cluster(num_servers=1, num_workers=1, TFKV_REQUEST_TIMEOUT="3", TFKV_HEARTBEAT_TIMEOUT="3")
    c.start_servers()
    (out,) = c.start_workers("lost_reply", "all")
    codes = c.wait(timeout=40)
    ended = time.time()
    assert codes["worker 0"] == 1 and codes["server 0"] == codes["scheduler"] == 3, f"{codes}\n{c.outputs()}"
    log = c.output("worker 0")
    assert "server 0 at 127.0.0.1:" in log and "not even a PING sent" in log and "PULL of key 'w'" in log, log
    assert 6 <= ended - _results([out])[0]["pulling_at"] < 15  # 3 s of silence, then 3 s for the PING


def test_a_busy_server_still_answering_is_not_timed_out(cluster):
    """A server silent past the worker's heartbeat timeout gets a PING, queued behind this
    worker's own pulls; it then answers them for longer than TFKV_REQUEST_TIMEOUT before it
    reaches the PING. Replies keep coming, so the request timeout counts from the last one heard,
    not from the PING: the job finishes. (3,600 pulls of 800 KB: the server answers 900 in about
    0.4 s now that replies go out in batches, under the request timeout.)"""
    c = cluster(num_servers=1, num_workers=1, TFKV_HEARTBEAT_TIMEOUT="6")  # the server's stop is no death
    c.start_servers()
    (out,) = c.start_workers("busy_server", str(c.procs["server 0"].pid), "2", "3600",
                             TFKV_HEARTBEAT_TIMEOUT="1.5", TFKV_REQUEST_TIMEOUT="1")
    codes = c.wait(timeout=60)
    assert set(codes.values()) == {0}, f"{codes}\n{c.outputs()}"
    r = _results([out])[0]
    assert r["exact"] and r["seconds"] > 1.5 + 1, r  # past the PING's request timeout


def test_small_keys_are_pushed_and_pulled_together(cluster):
    """200 small keys pushed and pulled one call each (as backprop's hooks do) go to their
    servers as PUSHPULL requests of many keys, in a handful of ZeroMQ messages, not 400; the
    large key goes as a PUSHPULL of its own (no key list, its payload last), before the wait;
    every value is exact (2 workers, SGD lr=1: 50 - (1 + 2))."""
    _, outs = _job(cluster, "fusion", num_servers=2, num_workers=2)
    for r in _results(outs):
        assert r["small"] == [47.0] and r["big"] == [-2.0, -2.0]
        requests = [req for message in r["puts"] for req in message]
        assert sum(n for kind, n in requests if kind == "PUSHPULL") == 200
        assert sorted(kind for kind, _ in requests if kind != "PUSHPULL") == ["PUSHPULL one"]
        assert len(r["puts"]) <= 2 * r["servers"] + 2, r["puts"]
        assert ["PUSHPULL one", 1] in [req for message in r["before_wait"] for req in message]  # the large key


@pytest.mark.slow
@pytest.mark.parametrize("nkeys,size,steps,fusion", [(10_000, 1_000, 3, 512 << 10), (20_000, 2, 1, 0)])
def test_many_keys_every_reply_arrives_exactly(cluster, nkeys, size, steps, fusion):
    """More replies in flight than ZeroMQ's default high-water mark (1,000 messages): none is
    dropped, every update is applied once. 20,000 keys go one message each (fusion off), so
    that ZeroMQ carries 20 times its high-water mark in replies (100,000 passed too, in 70 s of
    CI's 20 minutes); 10,000 keys in batches."""
    from conftest import expected

    # A heartbeat timeout for a loaded machine (as in test_soak): the point is the replies.
    _, outs = _job(cluster, "int_sgd", str(steps), str(nkeys), str(size), num_servers=2, num_workers=2,
                   timeout=400, TFKV_HEARTBEAT_TIMEOUT="10", TFKV_FUSION_BYTES=str(fusion))
    for r in _results(outs):
        assert r["final"] == expected(steps, nkeys, 2)


@pytest.mark.slow
def test_half_precision_keys_over_dist_sync(cluster):
    """float16 and bfloat16 keys between two workers and two servers: exact sums kept in their
    dtype, 2 bytes a value pushed, half keys among fused float32 ones, a float32 push refused in
    one line, 2-bit compression of half gradients, and SGD on the servers matching numpy's
    float32 master computation cast to half with multi_precision, and losing each step without."""
    import kvstore_contract as contract

    _, outs = _job(cluster, "half", num_servers=2, num_workers=2, MXNET_KVSTORE_BIGARRAY_BOUND="100")
    for r in _results(outs):
        assert r["parts"] == 2  # the big half key is split over both servers
        for name in ("float16", "bfloat16"):
            assert r[name] == [name, [0.75] * 3, name, 0.75, 0.75]
            assert r[f"{name}_bytes"] == 2 * (3 + 1000)  # float32 would push 4 bytes a value
            assert r[f"{name}_f32_push"].startswith(f"push of key '{name}': a float32 value for a {name} key")
            assert "\n" not in r[f"{name}_f32_push"]
            assert r[f"{name}_2bit"] == [[name, 0.0], [name, 1.0]]  # 0.6 built up: +0.5 from each worker
            for mp in (0, 1):
                assert r[f"{name}_w{mp}"] == [name, contract.sgd_reference(name, bool(mp))]
            assert r[f"{name}_w0"] != r[f"{name}_w1"]
        assert r["mixed"] == {k: ["float32" if k.startswith("f") and k[1:].isdigit() else k, 3.0]
                              for k in ("f0", "float16", "f1", "bfloat16", "f2", "f3")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["2bit", "2bit_momentum"])
def test_pushes_packed_in_the_graph_are_the_numpy_oracles_and_resume_exactly(cluster, kind):
    """Words packed as TensorFlow ops, pushed as they are: the servers' weights after every step
    are those of the plain-numpy scheme (compression_oracle) with the same gradients, split over
    two servers; the worker's residuals are saved with the optimizer state and put back exactly,
    so the steps after a reload are an uninterrupted job's."""
    import compression_oracle as O

    _, (out,) = _job(cluster, "packed_compressed", num_servers=2, num_workers=1, MXNET_KVSTORE_BIGARRAY_BOUND="500",
                     TEST_COMPRESSION=kind)
    r = _results([out])[0]
    assert r["packs_in_graph"] and r["parts"] == 2
    rng, t, m = np.random.default_rng(7), 0.25, 0.5
    layout = {"w": [(0, 502), (502, 1003)], "b": [(0, 37)]}  # as the servers cut it (checked below)
    held = {k: [(np.zeros(e - s, np.float32), np.zeros(e - s, np.float32)) for s, e in b] for k, b in layout.items()}
    weights = {"w": np.zeros(1003, np.float32), "b": np.zeros(37, np.float32)}
    for step in range(5):
        for k, g in zip(["w", "b"], [rng.normal(scale=0.3, size=n).astype(np.float32) for n in (1003, 37)]):
            for (s, e), (res, vel) in zip(layout[k], held[k]):
                words = O.pack_corrected(g[s:e], vel, res, t, m) if kind == "2bit_momentum" else O.pack(g[s:e], res, t)
                weights[k][s:e] -= O.unpack(words, e - s, t)
        assert r["seen"][step] == [weights["w"].tolist(), weights["b"].tolist()], step
        if step == 2:
            residual = np.concatenate([res for res, _ in held["w"]])
            assert r["saved"]["worker_feedback/0/w/residual"] == residual.tolist()
            assert ("worker_feedback/0/w/velocity" in r["saved"]) == (kind == "2bit_momentum")
            assert r["zeroed"] == 0.0 and r["restored"] == residual.tolist() and residual.any()
    assert r["final_residual"] == np.concatenate([res for res, _ in held["w"]]).tolist()
    assert len(r["api_push"]) == 37
