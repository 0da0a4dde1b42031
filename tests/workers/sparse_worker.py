"""A worker of a real dist job training row-sparse tables (tests/test_sparse_training.py):
`python sparse_worker.py MODE OUT.npz [args]`, its store `tfkv.store.create($TEST_KVSTORE)`.

`ids_model` is the tfkv-run model of the tests (model._target_=sparse_worker.ids_model).
exact [STEPS]: the model of `two_tables` (a row-sparse keras Embedding and a ShardedEmbedding)
  trained with SGD on slice `rank` of each global batch of `global_batches` (STEPS of them, 5 unless
  given); OUT holds the weights before and after (gathered from the servers), for the test to
  compare with plain Keras.
memory ROWS DIM STEPS RUN_DIR [resume]: a ShardedEmbedding of ROWS x DIM float32 held by the
  servers, trained for STEPS steps of Zipf ids, then checkpointed into RUN_DIR (the table written
  by rows); with `resume`, the job starts from RUN_DIR's newest checkpoint instead (the table put
  back by rows), trains, checkpoints again and exports model.keras from that checkpoint. OUT
  holds this process's peak RSS, the table's bytes, the losses, some rows as the store holds them
  (after the resume, before training; and at the end), an evaluated batch and its loss.
"""

import os
import resource
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROWS, DIM, WIDTH, CLASSES, BATCH, STEPS = 120, 4, 3, 5, 8, 5  # BATCH per worker


def ids_model(input_shape, num_classes, rows=ROWS, dim=DIM, sharded=False, rows_per_batch=48):
    """ids -> embedding (keras, or tfkv's ShardedEmbedding) -> flatten -> logits (a tfkv-run model)."""
    import keras

    from tfkv.layers import ShardedEmbedding

    inp = keras.Input(tuple(input_shape), dtype="int32")
    embed = (ShardedEmbedding(rows, dim, rows_per_batch, seed=3, name="embed") if sharded
             else keras.layers.Embedding(rows, dim, name="embed"))
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Flatten()(embed(inp)))
    return keras.Model(inp, keras.layers.Dense(num_classes)(hidden))


def two_tables(rows=ROWS, dim=DIM, rows_per_batch=2 * BATCH * WIDTH):
    """ids -> [keras Embedding ; ShardedEmbedding] -> logits. Built outside a store, both are
    plain Keras embeddings (the oracle's model)."""
    import keras

    from tfkv.layers import ShardedEmbedding

    inp = keras.Input((WIDTH,), dtype="int32")
    a = keras.layers.Embedding(rows, dim, name="keras_embed")(inp)
    b = ShardedEmbedding(rows, dim, rows_per_batch, init="normal", scale=0.1, seed=5, name="sharded_embed")(inp)
    h = keras.layers.Flatten()(keras.layers.Concatenate()([a, b]))
    return keras.Model(inp, keras.layers.Dense(CLASSES)(keras.layers.Dense(8, activation="tanh")(h)))


def global_batches(workers, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    n = workers * BATCH
    ids = np.minimum(rng.zipf(1.3, size=(steps * n, WIDTH)) - 1, ROWS - 1).astype(np.int32)
    labels = rng.integers(0, CLASSES, steps * n).astype(np.int32)
    return [(ids[i * n:(i + 1) * n], labels[i * n:(i + 1) * n]) for i in range(steps)]


def exact(kv, out):
    import keras
    import tensorflow as tf

    from tfkv import optim
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel

    devs = devices.setup(["cpu:0"])
    keras.utils.set_random_seed(7)  # every worker builds the same keras Embedding (worker 0's wins anyway)
    dp = DataParallel(two_tables, devs, kv, optim.SGD(schedule=optim.Schedule(lr=0.5)), [BATCH], row_sparse=True)
    start = dp.get_weights()
    mine = [(tf.constant(x[kv.rank::kv.num_workers]), tf.constant(y[kv.rank::kv.num_workers]))
            for x, y in global_batches(kv.num_workers, *(int(a) for a in sys.argv[3:4]))]
    for i, (x, y) in enumerate(mine):
        dp.step(x, y, mine[i + 1][0] if i + 1 < len(mine) else None)
    end = dp.get_weights()
    np.savez(out, **{f"start{i}": w for i, w in enumerate(start)}, **{f"end{i}": w for i, w in enumerate(end)},
             cache_rows=np.int64(dp.replicas[0].get_layer("sharded_embed").embeddings.shape[0]))


def memory(kv, out):
    import keras
    import tensorflow as tf

    from tfkv import checkpoint, export, optim
    from tfkv.layers import ShardedEmbedding, serving_rows
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel

    rows, dim, steps = (int(a) for a in sys.argv[3:6])
    batch = 256

    def build():
        inp = keras.Input((WIDTH,), dtype="int64")
        e = ShardedEmbedding(rows, dim, batch * WIDTH, init="uniform", scale=0.05, seed=1, name="big")(inp)
        return keras.Model(inp, keras.layers.Dense(1)(keras.layers.Flatten()(e)))

    run_dir, resume = sys.argv[6], sys.argv[7:] == ["resume"]
    ckpt = checkpoint.load(checkpoint.latest(run_dir)) if resume else None
    devs = devices.setup(["cpu:0"])
    keras.utils.set_random_seed(3)
    dp = DataParallel(build, devs, kv, optim.SGD(schedule=optim.Schedule(lr=0.1)), [batch],
                      criterion=_mse(), initial_weights=ckpt.weights if ckpt else None)
    if ckpt:
        dp.load_optimizer(ckpt.optimizer, run_dir)
    rng = np.random.default_rng(kv.rank + 10 * resume)
    batches = []
    for _ in range(steps):  # ids over the whole table: Zipf ranks scattered by a fixed permutation
        ids = (np.minimum(rng.zipf(1.2, size=(batch, WIDTH)), rows) * 2654435761 % rows).astype(np.int64)
        batches.append((tf.constant(ids), tf.constant((ids[:, :1] % 2).astype(np.float32))))
    some = np.unique(np.concatenate([[0, rows - 1], batches[0][0].numpy()[:4, 0]]))
    before = kv.row_sparse_pull(dp.sparse.tables[0].key, row_ids=some).data
    losses = []
    for i, (x, y) in enumerate(batches):
        dp.step(x, y, batches[i + 1][0] if i + 1 < len(batches) else None)
        losses.append(dp.take_metrics()[0]["loss"])
    after = kv.row_sparse_pull(dp.sparse.tables[0].key, row_ids=some).data
    test_x, test_y = batches[0]
    test_loss = dp.evaluate([(test_x, test_y)])["loss"]  # through the store: the batch's rows
    saved = checkpoint.save(run_dir, 2 if resume else 1, dp.streamed_weights(), dp.weight_names(), dp.save_optimizer, [])
    if resume:
        with serving_rows():
            model = build()
        export.save_by_rows(model, checkpoint.load(saved).weights, run_dir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    np.savez(out, peak_rss=np.int64(peak), table_bytes=np.int64(rows * dim * 4), losses=np.array(losses),
             cache_rows=np.int64(dp.replicas[0].get_layer("big").embeddings.shape[0]), ids=some, before=before,
             after=after, test_x=test_x.numpy(), test_y=test_y.numpy(), test_loss=np.float64(test_loss))


def _mse():
    from tfkv.parallel.criterion import Criterion

    return Criterion.from_config("mean_squared_error", [])


if __name__ == "__main__":
    import tfkv.store

    store = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))
    {"exact": exact, "memory": memory}[sys.argv[1]](store, sys.argv[2])
    store.close()
