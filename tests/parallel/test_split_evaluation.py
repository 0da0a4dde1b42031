"""Evaluation split across workers: each worker evaluates its part of the test split, and the
parts' tallies summed (through the scheduler's barrier, tfkv.ps.sums) give the figures of one
process evaluating the whole split with the same weights."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import tfkv_run
from tfkv.parallel.criterion import Criterion
from tfkv.parallel.metrics import Tally, evaluate
from tfkv.ps import protocol as P
from tfkv.ps import sums

def _tally_of(batches, criterion: Criterion, model, combine=None):
    tally = Tally(criterion)

    @tf.function
    def step(x, y):
        pred = model(x, training=False)
        tally.add(y, pred, criterion.losses(y, pred), tf.shape(y)[0])

    return evaluate(tally, step, batches, combine)


def test_summed_tallies_of_the_parts_are_the_tally_of_the_whole() -> None:
    """Three parts, one of them empty (it still makes every metric variable: AUC's, and F1's
    that appear at the first update), summed as the store sums them: the whole split's figures."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((41, 4)).astype(np.float32), rng.integers(0, 3, 41).astype(np.int32)
    one_hot = lambda ds: ds.map(lambda a, b: (a, tf.one_hot(b, 3)))  # noqa: E731 - F1 takes one-hot labels
    criterion = Criterion({"_target_": "keras.losses.CategoricalCrossentropy", "from_logits": True},
                          ["categorical_accuracy", {"_target_": "keras.metrics.F1Score", "average": "macro"},
                           {"_target_": "keras.metrics.AUC", "from_logits": True}])
    whole = tf.data.Dataset.from_tensor_slices((x, y))
    expected, _, n = _tally_of(one_hot(whole).batch(6), criterion, model)
    cuts = [(0, 20), (20, 20), (20, 41)]  # the middle part is empty
    states, owns = [], []

    def keep(state):  # each part's state, summed once all are in (what sum_over_workers does)
        states.append(state)
        return state

    for a, b in cuts:
        _, own, _ = _tally_of(one_hot(tf.data.Dataset.from_tensor_slices((x[a:b], y[a:b]))).batch(6),
                              criterion, model, keep)
        owns.append(own)
    assert owns == [20, 0, 21] and n == 41
    assert len({s.size for s in states}) == 1  # the empty part has every variable too
    # a fourth, empty part takes the sum of the three: the combined tally
    empty = one_hot(tf.data.Dataset.from_tensor_slices((x[:0], y[:0]))).batch(6)
    combined, own, seen = _tally_of(empty, criterion, model, lambda state: sums.total(states[:3]))
    assert (own, seen) == (0, 41)
    assert combined["categorical_accuracy"] == expected["categorical_accuracy"]
    for name in ("loss", "f1_score", "auc"):
        assert combined[name] == pytest.approx(expected[name], rel=1e-6), name


class Peak(keras.metrics.SparseCategoricalAccuracy):
    """A user's metric class: tfkv cannot know that its state is a sum."""


def per_example_error(y_true, y_pred):
    return tf.cast(tf.not_equal(tf.cast(y_true, tf.int64), tf.argmax(y_pred, axis=-1)), tf.float32)


def test_only_keras_metric_classes_are_summed() -> None:
    """A function is averaged by Keras's MeanMetricWrapper (a sum); a class of the user's own
    keeps the evaluation whole on every worker (Parallel.evaluate_split)."""
    tally = Tally(Criterion(None, ["accuracy", per_example_error, Peak(name="peak"), "auc"]))
    tally.prepare(tf.zeros((0,), tf.int32))
    assert tally.unsummable() == ["peak"]


def test_a_barrier_sum_travels_exactly_and_is_checked() -> None:
    values = np.array([0.1, -0.0, 2.0**53, np.inf, np.nan, 1e-300])
    back = sums.decode(sums.encode(values))
    assert np.array_equal(back, values, equal_nan=True)
    msg = P.Message(P.Type.BARRIER, sender=3, meta={"sum": sums.encode(values), "of": values.size})
    assert np.array_equal(sums.decode(P.decode(P.encode(msg)).meta["sum"]), values, equal_nan=True)
    assert P.decode(P.encode(P.Message(P.Type.BARRIER, sender=3))).meta is None  # a plain barrier
    for meta in ({"sum": "not base64!", "of": 1}, {"sum": sums.encode(values)}, {"x": 1},
                 {"sum": "AAAA", "of": 1}):  # AAAA: 3 bytes, not a float64
        with pytest.raises(P.ProtocolError):
            P.decode(P.encode(P.Message(P.Type.BARRIER, sender=3, meta=meta)))
    names = ["worker 0", "worker 1"]
    chunk = lambda v, of: {"sum": sums.encode(v), "of": of}  # noqa: E731
    assert sums.release([None, None], names) is None  # a plain barrier releases plainly
    done = sums.release([chunk([1.0, 2.5], 2), chunk([0.5, -2.5], 2)], names)
    assert done["of"] == 2 and sums.decode(done["sum"]).tolist() == [1.5, 0.0]
    for metas in ([chunk([1.0], 1), None], [chunk([1.0], 1), chunk([1.0, 2.0], 2)], [chunk([1.0], 2), chunk([1.0], 1)]):
        with pytest.raises(ValueError, match="different sums"):  # the scheduler fails the job, naming them
            sums.release(metas, names)
    big = np.arange(sums.CHUNK * 2 + 5, dtype=np.float64)
    assert [c.size for c in sums.chunks(big)] == [sums.CHUNK, sums.CHUNK, 5]
    assert len(P.encode(P.Message(P.Type.BARRIER, meta={"sum": sums.encode(sums.chunks(big)[0]),
                                                         "of": big.size}))[1]) < P.MAX_META


SUMMING_WORKER = """
import json, sys
import numpy as np
import tfkv.store
from tfkv.ps import sums

kv = tfkv.store.create(sys.argv[2])
factor = kv.rank + 1
big = kv.sum_over_workers(np.arange(2 * sums.CHUNK + 3, dtype=np.float64) * factor)  # three barriers
small = kv.sum_over_workers([0.1 * factor, 2.0 ** 52, float(kv.rank)])
json.dump({"big": bool(np.array_equal(big, np.arange(2 * sums.CHUNK + 3) * 3.0)), "small": small.tolist()},
          open(sys.argv[1], "w"))
kv.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_every_worker_gets_the_same_sum_through_the_scheduler(cluster, tmp_path: Path, kind: str) -> None:
    """Real scheduler and server, two workers: a vector of three chunks and a small one, summed
    exactly and alike on both, for both kinds of store (dist_async's servers would apply a push)."""
    script = tmp_path / "summing.py"
    script.write_text(SUMMING_WORKER)
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = [tmp_path / f"sum{i}.json" for i in range(2)]
    for i, out in enumerate(outs):
        c.start(f"worker {i}", "worker", [sys.executable, str(script), str(out), kind], TFKV_RANK_HINT=str(i))
    codes = c.wait(60)
    assert set(codes.values()) == {0}, c.outputs()
    results = [json.loads(out.read_text()) for out in outs]
    assert all(r["big"] for r in results)
    assert results[0]["small"] == results[1]["small"] == [0.1 + 0.2, 2.0 ** 53, 1.0]


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


USER_PACKAGE = '''
"""A model with BatchNormalization (each worker's statistics differ) and an odd-sized test split."""
import keras
import numpy as np


def data(split):
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 512 if split == "train" else 301
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] + 0.3 * x[:, 2] > 0)).astype(np.int64)
    return x, y


def bn_net(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape)
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


@pytest.mark.slow
def test_dist_async_splits_evaluation_with_worker_0s_batchnorm_statistics(tmp_path: Path) -> None:
    """dist_async: each worker's weights are its own last pull and its BatchNorm statistics its
    own; the split evaluation still equals eval_only (one process, the whole split) of the
    checkpoint it wrote."""
    (tmp_path / "userpkg.py").write_text(textwrap.dedent(USER_PACKAGE))
    job = ["kvstore=dist_async", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "epochs=1",
           "progress=false", "model._target_=userpkg.bn_net", "~model.hidden", "~model.dropout",
           "dataset._target_=userpkg.data", "~dataset.test_fraction", "batch_size=32", "eval_batch_size=40",
           "metrics=[accuracy,{_target_:keras.metrics.SparseTopKCategoricalAccuracy,k:2,name:top2}]"]
    env = {"PYTHONPATH": str(tmp_path)}
    tfkv_run(*job, "hydra.run.dir=out/train", cwd=tmp_path, env=env, timeout=300)
    trained = _metrics(tmp_path / "out" / "train")
    last = trained["history"][-1]
    assert last["evaluated_examples"] == 301 and last["worker_evaluated_examples"] == 150  # worker 1: 151
    tfkv_run(*job, "+eval_only=true", f"resume={tmp_path / 'out' / 'train'}", "hydra.run.dir=out/eval", cwd=tmp_path,
             env=env)
    alone = _metrics(tmp_path / "out" / "eval")
    assert alone["evaluated_examples"] == 301
    assert alone["test_accuracy"] == trained["test_accuracy"] and alone["test_top2"] == trained["test_top2"]
    assert alone["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-5)
