"""Training with row-sparse embeddings (issue 32, point 3): a Keras Embedding trained with
kvstore.row_sparse=true, or a tfkv.layers.ShardedEmbedding whose table the store holds, learns what
plain Keras learns from the same weights and batches (SGD: MXNet's lazy update is the dense one);
with Adam only the rows a batch touched move; the next batch's rows are asked for after this
worker's push; checkpoints resume exactly, and model.keras holds the whole table as a plain Keras
Embedding, evaluated by keras.models.load_model as tfkv evaluates it.

The oracle is plain Keras (model.fit / train_on_batch with keras.optimizers.SGD on the same
initial weights and batches), outside tfkv. Weights agree to float32 round-off: the store sums
per-example gradients and rescales (MXNet's rescale_grad) where Keras averages the loss.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from hydra import compose, initialize_config_dir

from sparse_worker import CLASSES, DIM, ROWS, WIDTH, ids_model

from tfkv import check, cli, optim, store
from tfkv.layers import ShardedEmbedding
from tfkv.parallel.data_parallel import DataParallel
from tfkv.store.local import LocalStore

RTOL, ATOL = 1e-5, 1e-6
BATCH, STEPS = 16, 6


def _batches(steps=STEPS, batch=BATCH, seed=0):
    """Ids drawn from a power law (few rows often, most rarely: some never) and labels."""
    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.3, size=(steps * batch, WIDTH)) - 1, ROWS - 1).astype(np.int32)
    labels = rng.integers(0, CLASSES, steps * batch).astype(np.int32)
    return [(tf.constant(ids[i * batch:(i + 1) * batch]), tf.constant(labels[i * batch:(i + 1) * batch]))
            for i in range(steps)]


def _keras_trained(initial, batches, optimizer):
    """The oracle: plain Keras from `initial` (weights in model.weights order) on `batches`."""
    model = ids_model((WIDTH,), CLASSES)
    model.set_weights(initial)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in batches:
        model.train_on_batch(x, y)
    return model.get_weights()


def _tfkv(kind, devices, optimizer, batches, row_sparse=True, sharded=False, initial=None, kv=None):
    keras.utils.set_random_seed(7)
    kv = kv or store.create(kind, devices=devices)
    dp = DataParallel(lambda: ids_model((WIDTH,), CLASSES, sharded=sharded), devices, kv, optimizer,
                      [BATCH // len(devices)] * len(devices), initial_weights=initial, row_sparse=row_sparse)
    start = dp.get_weights()
    for i, (x, y) in enumerate(batches):
        dp.step(x, y, batches[i + 1][0] if i + 1 < len(batches) else None)
    return dp, start


def _initial():
    keras.utils.set_random_seed(11)
    return ids_model((WIDTH,), CLASSES).get_weights()


def _assert_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


SGD = optim.SGD(schedule=optim.Schedule(lr=0.5))


@pytest.mark.parametrize("kind,n", [("local", 1), ("local", 2), ("device", 2)])
def test_row_sparse_keras_embedding_learns_what_keras_learns_with_sgd(kind, n, tf_devices):
    initial, batches = _initial(), _batches()
    dp, start = _tfkv(kind, tf_devices[:n], SGD, batches, initial=initial)
    assert dp.sparse is not None and [t.key for t in dp.sparse.tables] == [len(dp.keys)]
    assert dp.store.is_row_sparse(len(dp.keys))
    _assert_close(start, initial)
    want = _keras_trained(initial, batches, keras.optimizers.SGD(0.5))
    _assert_close(dp.get_weights(), want)
    assert not np.allclose(want[0], initial[0]), "the table did not move: the comparison proves nothing"


def test_row_sparse_matches_tfkv_dense_training(tf_devices):
    initial, batches = _initial(), _batches()
    sparse_dp, _ = _tfkv("local", tf_devices[:2], SGD, batches, initial=initial)
    dense_dp, _ = _tfkv("local", tf_devices[:2], SGD, batches, initial=initial, row_sparse=False)
    assert dense_dp.sparse is None
    _assert_close(sparse_dp.get_weights(), dense_dp.get_weights())


def test_lazy_adam_moves_only_the_rows_a_batch_touched(tf_devices):
    initial, batches = _initial(), _batches(steps=2)
    adam = optim.Adam(schedule=optim.Schedule(lr=0.05))
    dp, _ = _tfkv("local", tf_devices[:1], adam, batches[:1], initial=initial)
    after_one = dp.get_weights()[0]
    dp.step(*batches[1])
    after_two = dp.get_weights()[0]
    first, second = (set(np.unique(b[0].numpy()).tolist()) for b in batches)
    never = sorted(set(range(ROWS)) - first - second)
    only_first = sorted(first - second)
    assert never and only_first and second
    np.testing.assert_array_equal(after_two[never], initial[0][never])  # never touched: as initialised
    np.testing.assert_array_equal(after_two[only_first], after_one[only_first])  # lazy: no momentum step
    assert not np.allclose(after_two[sorted(second)], after_one[sorted(second)])
    # dense Adam (Keras) keeps moving the rows of step 1 by their momentum at step 2
    dense = _keras_trained(initial, batches, keras.optimizers.Adam(0.05))[0]
    assert not np.allclose(dense[only_first], after_one[only_first])


def test_sharded_embedding_keeps_only_a_batch_of_rows_and_learns_what_keras_learns(tf_devices):
    batches = _batches()
    dp, start = _tfkv("device", tf_devices[:2], SGD, batches, sharded=True)
    for replica in dp.replicas:  # the worker holds a cache of rows, never the table
        cache = replica.get_layer("embed").embeddings
        assert tuple(cache.shape) == (BATCH * WIDTH, DIM)
    assert start[0].shape == (ROWS, DIM) and np.abs(start[0]).max() > 0  # the store's Table, drawn from its seed
    # the names of the model built without a store: the cache stands for the table, no row ids
    assert [n.rsplit("/", 1)[1] for n in dp.weight_names()] == ["embeddings", "kernel", "bias", "kernel", "bias"]
    want = _keras_trained(start, batches, keras.optimizers.SGD(0.5))
    _assert_close(dp.get_weights(), want)
    # evaluation loads each batch's rows: the same loss as Keras's on the trained weights
    plain = ids_model((WIDTH,), CLASSES)
    plain.set_weights(dp.get_weights())
    x = tf.concat([b[0] for b in batches], 0)
    y = tf.concat([b[1] for b in batches], 0)
    keras_loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, plain(x)))
    assert dp.evaluate([(x, y)])["loss"] == pytest.approx(keras_loss, rel=1e-5)


def test_sharded_embedding_without_a_store_is_a_keras_embedding_and_round_trips(tmp_path):
    model = ids_model((WIDTH,), CLASSES, sharded=True)
    layer = model.get_layer("embed")
    assert isinstance(layer, keras.layers.Embedding) and not layer.holds_rows
    assert tuple(layer.embeddings.shape) == (ROWS, DIM)  # the whole table, as plain Keras has it
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    again = loaded.get_layer("embed")
    assert type(again) is ShardedEmbedding and again.rows_per_batch == layer.rows_per_batch
    x = _batches(steps=1)[0][0]
    np.testing.assert_allclose(loaded(x), model(x), rtol=1e-6)


def test_too_many_distinct_ids_for_the_cache_is_one_line(tf_devices):
    keras.utils.set_random_seed(7)
    dp = DataParallel(lambda: ids_model((WIDTH,), CLASSES, sharded=True, rows_per_batch=4), tf_devices[:1],
                      store.create("local"), SGD, [BATCH])
    x, y = _batches(steps=1)[0]
    with pytest.raises(Exception) as e:
        dp.step(x, y)
    text = str(e.value)
    assert "ShardedEmbedding 'embed'" in text and "rows_per_batch=4" in text and "\n" not in text


class Subclassed(keras.Model):
    """A subclassed model: no graph of layers for a probe, so rows are fetched at lookup time
    (ShardedEmbedding) or taken back after the push (a Keras Embedding's whole table)."""

    def __init__(self, sharded=False):
        super().__init__()
        self.embed = (ShardedEmbedding(ROWS, DIM, BATCH * WIDTH, seed=2, name="embed") if sharded
                      else keras.layers.Embedding(ROWS, DIM, name="embed"))
        self.flat, self.out = keras.layers.Flatten(), keras.layers.Dense(CLASSES)

    def call(self, x):
        return self.out(self.flat(self.embed(x)))


def _subclassed(sharded=False):
    model = Subclassed(sharded)
    model(np.zeros((1, WIDTH), np.int32))  # built
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["keras-embedding", "sharded"])
def test_a_subclassed_model_fetches_rows_at_lookup_time_and_learns_what_keras_learns(sharded, tf_devices, caplog):
    batches = _batches()
    keras.utils.set_random_seed(5)
    initial = _subclassed().get_weights()
    with caplog.at_level("INFO", logger="tfkv"):
        dp = DataParallel(lambda: _subclassed(sharded), tf_devices[:2], store.create("local", devices=tf_devices[:2]),
                          SGD, [BATCH // 2] * 2, initial_weights=initial, row_sparse=True)
    assert dp.sparse.probe is None
    assert "fetched at lookup time" in caplog.text
    for x, y in batches:
        dp.step(x, y)
    oracle = _subclassed()
    oracle.set_weights(initial)
    oracle.compile(optimizer=keras.optimizers.SGD(0.5),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in batches:
        oracle.train_on_batch(x, y)
    _assert_close(dp.get_weights(), oracle.get_weights())
    assert not np.allclose(dp.get_weights()[0], initial[0])


class RecordingLocalStore(LocalStore):
    """The real local store driven as the parameter-server client is (between the compiled
    halves of the step, not traced into it), recording the order of its pushes and row requests
    of the table key."""

    traceable = False

    def __init__(self, devices=None):
        super().__init__(devices)
        self.calls = []

    def push(self, key, value, priority=0):
        if not isinstance(key, (list, tuple)) and self.is_row_sparse(key):
            self.calls.append("push")
        return super().push(key, value, priority)

    def row_sparse_pull_async(self, key, row_ids, priority=0):
        self.calls.append(("request", tuple(np.asarray(row_ids).tolist())))
        return super().row_sparse_pull_async(key, row_ids, priority)


def test_the_next_batchs_rows_are_requested_after_this_batchs_push(tf_devices):
    batches = _batches(steps=3)
    kv = RecordingLocalStore(tf_devices[:1])
    _tfkv("local", tf_devices[:1], SGD, batches, sharded=True, kv=kv)
    ids = [tuple(np.unique(b[0].numpy()).tolist()) for b in batches]
    # batch 0 asked for before it computes; each later batch's rows once, after the push before it
    assert kv.calls == [("request", ids[0]), "push", ("request", ids[1]), "push", ("request", ids[2]), "push"]


def test_update_on_the_workers_is_refused_in_one_line(tf_devices):
    from tfkv.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        DataParallel(lambda: ids_model((WIDTH,), CLASSES), tf_devices[:2], store.create("local"), SGD, [8, 8],
                     update_on_kvstore=False, row_sparse=True)
    assert "embed" in str(e.value) and "update_on_kvstore=true" in str(e.value)


# -- through tfkv-run: config, checkpoints, resume, export, eval_only -----------------------------

def _data(root: Path) -> Path:
    rng = np.random.default_rng(5)
    ids = np.minimum(rng.zipf(1.3, size=(320, WIDTH)) - 1, ROWS - 1).astype(np.int32)
    labels = (ids[:, 0] % CLASSES).astype(np.int32)  # learnable from the first id's row
    path = root / "ids.npz"
    np.savez(path, x_train=ids[:256], y_train=labels[:256], x_test=ids[256:], y_test=labels[256:])
    return path


def _args(root: Path) -> list[str]:
    return ["model._target_=sparse_worker.ids_model", "~model.hidden", "~model.dropout", "dataset=npy",
            f"dataset.npz={_data(root)}", f"dataset.num_classes={CLASSES}", f"batch_size={BATCH}", "progress=false"]


def _run(root: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """tfkv's trainer in this process, as tfkv-run runs it."""
    from tfkv.trainer import train

    args = [*_args(root), *overrides]
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=args)
    check.validate(cfg)
    run_dir = root / name
    run_dir.mkdir(exist_ok=True)
    return train(cfg, run_dir, args, search_root=root), run_dir


def _assert_plain_keras_evaluates(model: Path, data: Path, test_loss: float) -> None:
    """model.keras, loaded by plain Keras (no tfkv on the path), holds a keras Embedding with the
    whole table and gives tfkv's test loss."""
    code = ("import json, sys, numpy as np, keras\n"
            "m = keras.models.load_model(sys.argv[1])\n"
            "e = m.get_layer('embed')\n"
            "f = np.load(sys.argv[2])\n"
            "loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(f['y_test'], m(f['x_test']))\n"
            "print(json.dumps([type(e).__module__ + '.' + type(e).__name__, list(e.embeddings.shape), float(loss)]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(model), str(data)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ""}, cwd=data.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    cls, shape, loss = json.loads(out.stdout.strip().splitlines()[-1])
    assert cls.startswith("keras.") and cls.endswith("Embedding") and shape == [ROWS, DIM]
    assert loss == pytest.approx(test_loss, rel=1e-5)


def _checkpoint_weights(ckpt: Path) -> list[np.ndarray]:
    with np.load(ckpt / "weights.npz") as f:
        return [f[k] for k in sorted(f.files)]


# SGD without momentum or weight decay: MXNet's lazy update is the dense one. Adam's lazy update
# keeps per-row state in the store, which a resumed run must get back.
PLAIN_SGD = ["optimizer.lr=0.5", "optimizer.momentum=0", "optimizer.wd=0"]
ADAM = ["optimizer=adam", "optimizer.lr=0.05"]


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["keras-embedding-sgd", "sharded-adam"])
def test_tfkv_run_trains_checkpoints_resumes_and_exports_row_sparse(sharded, tmp_path):
    model = [f"+model.sharded={str(sharded).lower()}", *(ADAM if sharded else PLAIN_SGD)]
    final, straight = _run(tmp_path, "straight", *model, "kvstore.row_sparse=true", "epochs=2")
    assert final["test_accuracy"] > 0.5  # labels follow the first id: the table learned them
    if not sharded:  # the same run trained dense: the same weights
        _, dense = _run(tmp_path, "dense", *model, "epochs=2")
        _assert_close(_checkpoint_weights(straight / "checkpoints" / "epoch-0002"),
                      _checkpoint_weights(dense / "checkpoints" / "epoch-0002"))
    # resume from epoch 1 goes on exactly (the table's rows and the optimizer state from the store)
    _, resumed = _run(tmp_path, "resumed", *model, "kvstore.row_sparse=true", "epochs=2",
                      f"resume={straight / 'checkpoints' / 'epoch-0001'}")
    for a, b in zip(_checkpoint_weights(resumed / "checkpoints" / "epoch-0002"),
                    _checkpoint_weights(straight / "checkpoints" / "epoch-0002"), strict=True):
        np.testing.assert_array_equal(a, b)
    _assert_plain_keras_evaluates(straight / "model.keras", tmp_path / "ids.npz", final["test_loss"])
    # eval_only of the last checkpoint: the same test loss, and the same model exported
    evaluated, ev_dir = _run(tmp_path, "eval", *model, "kvstore.row_sparse=true", "eval_only=true",
                             f"resume={straight / 'checkpoints' / 'epoch-0002'}")
    assert evaluated["test_loss"] == pytest.approx(final["test_loss"], rel=1e-6)
    assert (ev_dir / "model.keras").is_file()


# -- a real dist job: 2 workers, 2 servers holding the tables by rows ---------------------------

WORKER = Path(__file__).resolve().parent / "workers" / "sparse_worker.py"


def _start_workers(c, mode, *args, env=None):
    outs = []
    for i in range(c.num_workers):
        out = c.dir / f"worker{i}.npz"
        c.start(f"worker {i}", "worker", [sys.executable, str(WORKER), mode, str(out), *args], TFKV_RANK_HINT=str(i),
                **(env or {}))
        outs.append(out)
    return outs


def _finished(c, timeout):
    codes = c.wait(timeout)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"


@pytest.mark.slow
def test_dist_async_workers_train_the_tables_with_rows_requested_before_each_batch(cluster):
    """dist_async: each worker asks for the next batch's rows before this batch computes (no
    round to wait for); both train, the servers' tables move and stay finite."""
    c = cluster(num_servers=2, num_workers=2, TEST_KVSTORE="dist_async")
    c.start_servers()
    outs = _start_workers(c, "exact")
    _finished(c, 300)
    for out in outs:
        with np.load(out) as f:
            start, end = f["start1"], f["end1"]
        assert np.isfinite(end).all() and not np.allclose(start, end)


@pytest.mark.slow
@pytest.mark.parametrize("sharding,servers,steps", [("range", 2, 5), ("hash", 2, 5), ("range", 5, 20)],
                         ids=["range", "hash", "range-5-servers"])
def test_dist_sync_two_workers_learn_what_keras_learns_at_the_global_batch(cluster, sharding, servers, steps):
    """Worker r takes rows r::2 of each global batch; the servers sum both workers' rows before
    the update, so the tables and the dense weights end as plain Keras's at the global batch.
    The next batch's rows are requested after this worker's push: they hold the round's update.
    With 5 servers (more than workers; by range, Zipf ids: most batches' ids skip some servers) a
    worker pushes the next round to a server its last pull skipped, maybe while that server's
    round is still open: the pull after it must still hold the round it pushed (issue 40, point 1)."""
    import sparse_worker as W

    c = cluster(num_servers=servers, num_workers=2, TFKV_ROW_SHARDING=sharding)
    c.start_servers()
    outs = _start_workers(c, "exact", str(steps))
    _finished(c, 300)
    results = []
    for out in outs:
        with np.load(out) as f:
            n = sum(1 for k in f.files if k.startswith("start"))
            results.append(([f[f"start{i}"] for i in range(n)], [f[f"end{i}"] for i in range(n)], int(f["cache_rows"])))
    (start, end, cache), (start1, end1, _) = results
    assert cache == 2 * W.BATCH * W.WIDTH  # worker holds a cache, the servers the ShardedEmbedding's table
    for a, b in zip(start + end, start1 + end1):
        np.testing.assert_array_equal(a, b)  # both workers see the same tables
    plain = W.two_tables()  # outside a store: both embeddings plain Keras
    plain.set_weights(start)
    plain.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for x, y in W.global_batches(2, steps):
        plain.train_on_batch(x, y)
    _assert_close(end, plain.get_weights())
    assert not np.allclose(end[1], start[1]), "the ShardedEmbedding's table did not move"


# -- a table larger than a worker may hold ----------------------------------------------------------

MIB = 1 << 20
WORKER_LIMIT = 1024 * MIB  # a TensorFlow worker training a small model peaks near 750 MiB
BIG_ROWS, BIG_DIM = 26_000_000, 16  # 1.66 GB of float32 (over 1.5x the limit): the two servers hold it


def _memory_cgroup(name: str, limit: int) -> Path | None:
    """A cgroup v1 memory group inside this process's own, limited to `limit` bytes (swap too);
    None where the machine has none this process may make."""
    root = Path("/sys/fs/cgroup/memory")
    try:
        own = next(line.rstrip("\n").split(":", 2)[2] for line in open("/proc/self/cgroup")
                   if line.split(":")[1] == "memory")
        path = root / own.lstrip("/") / name
        path.mkdir()
    except (OSError, StopIteration):
        return None
    (path / "memory.limit_in_bytes").write_text(str(limit))
    if (path / "memory.memsw.limit_in_bytes").exists():
        (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
    return path


def _in_cgroup(group: Path, argv: list[str]) -> list[str]:
    """`argv` run as a member of `group` (it joins before it starts, so all it allocates counts)."""
    return ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" "$@"', *argv]


@pytest.mark.slow
def test_a_worker_trains_checkpoints_resumes_and_exports_a_table_larger_than_the_memory_it_may_use(cluster, tmp_path):
    """A worker in a memory group below the table's size trains it (the servers hold it),
    checkpoints it (written by rows), and a job resumed from that checkpoint by another such
    worker gets the table back (by rows), trains on, checkpoints and exports model.keras, which
    plain Keras loads: its table's rows are the store's, its loss tfkv's."""
    table_bytes = BIG_ROWS * BIG_DIM * 4
    assert table_bytes > 1.5 * WORKER_LIMIT
    group = _memory_cgroup(f"tfkv-sparse-{os.getpid()}", WORKER_LIMIT)
    if group is None:
        pytest.skip("no cgroup v1 memory controller this process may make a group in (/sys/fs/cgroup/memory, as root)")
    run_dir, outs, peaks = tmp_path / "run", [], []
    try:
        # The limit holds: a process of the group that makes the table itself is killed.
        alloc = subprocess.run(_in_cgroup(group, [sys.executable, "-c", f"import numpy as np; "
                                                  f"a = np.ones({table_bytes // 4}, np.float32); print(a.sum())"]),
                               capture_output=True, timeout=120)
        assert alloc.returncode in (-9, 137), (alloc.returncode, alloc.stderr[-500:])
        for phase in ([], ["resume"]):  # a job, then another (new servers) resumed from its checkpoint
            c = cluster(num_servers=2, num_workers=1)
            c.start_servers()
            outs.append(c.dir / f"worker0{'-'.join(['', *phase])}.npz")
            c.start("worker 0", "worker", _in_cgroup(group, [sys.executable, str(WORKER), "memory", str(outs[-1]),
                                                             str(BIG_ROWS), str(BIG_DIM), "30", str(run_dir), *phase]),
                    TFKV_RANK_HINT="0")
            _finished(c, 600)
            peaks.append(int((group / "memory.max_usage_in_bytes").read_text()))
    finally:
        try:
            group.rmdir()
        except OSError:  # a process still in it: the cluster fixture kills it, the group stays empty behind
            pass
    trained, resumed = (dict(np.load(out)) for out in outs)
    for f in (trained, resumed):
        assert int(f["cache_rows"]) == 256 * 3  # the worker's rows: one batch's
        # RSS counts the pages of the checkpoint's memory map read so far (file pages, which the
        # group drops under its limit): below the table; the group's limit held (no kill)
        assert int(f["peak_rss"]) < table_bytes
    assert max(peaks) <= WORKER_LIMIT < table_bytes
    assert trained["losses"][-5:].mean() < 0.8 * trained["losses"][:5].mean(), trained["losses"]  # it learns
    assert resumed["losses"].mean() < trained["losses"][:5].mean()  # it goes on from where it stopped
    # the checkpoint holds the whole table; the resumed store began with its rows and trained them
    with np.load(run_dir / "checkpoints" / "epoch-0001" / "weights.npz") as f:  # numpy's reader, whole
        table = f["w0000"]
    assert table.shape == (BIG_ROWS, BIG_DIM)
    np.testing.assert_array_equal(table[trained["ids"]], trained["after"])
    np.testing.assert_array_equal(table[resumed["ids"]], resumed["before"])
    del table
    assert not np.allclose(resumed["after"], resumed["before"])
    # model.keras: plain Keras (no tfkv) loads a keras Embedding with the whole table, whose rows
    # are the store's at the end, and gives tfkv's loss on a batch
    code = ("import json, sys, numpy as np, keras\n"
            "m = keras.models.load_model(sys.argv[1])\n"
            "e, f = m.get_layer('big'), np.load(sys.argv[2])\n"
            "loss = keras.losses.MeanSquaredError()(f['test_y'], m(f['test_x']))\n"
            "same = bool(np.array_equal(e.embeddings.numpy()[f['ids']], f['after']))\n"
            "print(json.dumps([type(e).__module__ + '.' + type(e).__name__, list(e.embeddings.shape), same, "
            "float(loss)]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir / "model.keras"), str(outs[1])], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    cls, shape, same, loss = json.loads(out.stdout.strip().splitlines()[-1])
    assert cls.endswith("Embedding") and cls.startswith("keras.") and shape == [BIG_ROWS, BIG_DIM] and same
    assert loss == pytest.approx(float(resumed["test_loss"]), rel=1e-5)


@pytest.mark.slow
def test_tfkv_run_dist_sync_job_trains_a_sharded_table_and_exports_it_whole(tmp_path):
    """tfkv-run with kvstore=dist_sync cluster=local: 2 workers, 2 servers holding the table by
    rows; worker 0 checkpoints and exports the table gathered from the servers; eval_only of the
    checkpoint, alone, gives the job's test loss."""
    from conftest import REPO, tfkv_run

    env = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'workers'}"}
    job = [*_args(tmp_path), "+model.sharded=true", *ADAM, "kvstore=dist_sync", "cluster=local",
           "cluster.num_workers=2", "cluster.num_servers=2"]
    tfkv_run(*job, "epochs=2", "hydra.run.dir=run", cwd=tmp_path, env=env, timeout=600)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["test_accuracy"] > 0.5
    _assert_plain_keras_evaluates(tmp_path / "run" / "model.keras", tmp_path / "ids.npz", metrics["test_loss"])
    weights = _checkpoint_weights(tmp_path / "run" / "checkpoints" / "epoch-0002")
    assert weights[0].shape == (ROWS, DIM)
    tfkv_run(*job, "eval_only=true", "resume=run", "hydra.run.dir=eval", cwd=tmp_path, env=env, timeout=300)
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-6)
    # the job resumed from epoch 1 (the table's rows and Adam's per-row state back on the servers)
    # ends where the uninterrupted one did, to the round-off of the servers' sums
    tfkv_run(*job, "epochs=2", f"resume={tmp_path / 'run' / 'checkpoints' / 'epoch-0001'}", "hydra.run.dir=resumed",
             cwd=tmp_path, env=env, timeout=600)
    for a, b in zip(_checkpoint_weights(tmp_path / "resumed" / "checkpoints" / "epoch-0002"), weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_resume_refuses_a_checkpoint_of_the_other_row_sparse_setting_in_one_line(tmp_path):
    """The tables' keys come after the dense ones with row_sparse: the optimizer states of the
    two settings do not fit each other. A checkpoint from before the setting existed is dense."""
    from tfkv.checkpoint.resume import check_fits
    from tfkv.errors import ConfigError

    ours = {"model": {"_target_": "m"}, "optimizer": {"name": "sgd"}, "kvstore": {"row_sparse": False}}
    (tmp_path / "config.yaml").write_text("model: {_target_: m}\noptimizer: {name: sgd}\nkvstore: {row_sparse: true}\n")
    with pytest.raises(ConfigError) as e:
        check_fits(tmp_path, ours)
    assert "kvstore.row_sparse is True in the checkpoint, False here" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "config.yaml").write_text("model: {_target_: m}\noptimizer: {name: sgd}\nkvstore: {type: local}\n")
    check_fits(tmp_path, ours)
