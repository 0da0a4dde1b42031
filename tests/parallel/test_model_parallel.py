"""Model parallelism: layer groups on their devices, pipelined micro-batches that give the
unsplit batch's gradients, balanced automatic plans, the PTB reader, and the LSTM example end
to end through `tfkv-run`.

Tolerances. The pipelined gradient is the sum over micro-batches of per-micro-batch gradients;
the unsplit model sums the same terms over the whole batch inside its matrix products, in a
different order. In float32 that changes results by round-off only: measured |difference| is
~2e-7 of each gradient's largest entry. The checks allow 1e-5 of the largest entry (plus 1e-5
relative), 50x the measured error and still ~1000x below what a real mistake gives (a missing
micro-batch, a wrong scale, or a gradient applied to the wrong group changes entries by >1e-2
relative).
"""

import itertools
import json
import math
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import tfkv_run

from tfkv import data, models, optim, store
from tfkv.data import ptb
from tfkv.errors import ConfigError, DataError
from tfkv.parallel import placement
from tfkv.parallel.data_parallel import DataParallel
from tfkv.parallel.model_parallel import ModelParallel

T, V, B = 6, 40, 16  # sequence length, vocabulary, batch
LSTM = "tfkv.models.lstm_lm.build"
CFG = {"_target_": LSTM, "hidden": [16, 12], "embed_dim": 8}
SGD = optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9)


def _batch(seed=0, batch=B):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.integers(0, V, (batch, T)).astype(np.float32)),
            tf.constant(rng.integers(0, V, (batch, T)).astype(np.int32)))


def _model_parallel(devices, micro_batches, cfg=CFG, batch=B, opt=SGD):
    keras.utils.set_random_seed(3)
    groups = models.build_groups(cfg, (T,), V)
    return ModelParallel(groups, devices, store.create("local"), opt, batch,
                         micro_batches=micro_batches)


def _assert_close(got, want):
    for g, w in zip(got, want):
        scale = float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale)


# -- placement: every variable and op of a group on its device ------------------------------------

def test_groups_variables_and_ops_live_on_their_devices(tf_devices):
    cfg = {**CFG, "dropout": 0.1}  # dropout: seed state too
    groups = models.build_groups(cfg, (T,), V)
    specs = placement.assign({"embed": "cpu:0", "lstm1": "cpu:1", "lstm2": "cpu:2", "decoder": "cpu:3"},
                             groups, ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], "lstm_lm")
    devices = [tf_devices[int(s.split(":")[1])] for s in specs]
    mp = ModelParallel(groups, devices, store.create("local"), SGD, B, micro_batches=4)
    short = lambda d: d.split("/")[-1].upper().replace("DEVICE:", "")  # noqa: E731
    for model, d in zip(mp.models, devices):
        assert model.variables, model.name
        assert {short(v.value.device) for v in model.variables} == {short(d)}, model.name
    for state in mp._updaters[0]._state.values():  # momentum beside its weight
        for var in state:
            assert short(var.device) in {short(d) for d in devices}
    x, y = _batch()
    mp.metrics.prepare(y)  # what step() does before the compiled call: the metric objects
    graph = mp._step.get_concrete_function(x, y).graph
    seen = {g.name: 0 for g in groups}
    for op in graph.get_operations():
        m = re.match(r"^(?:gradient_tape/)?(embed|lstm1|lstm2|decoder)(?:_\d+)?/", op.name)
        if m and op.device:  # ops without a device are variable reads, placed with the variable
            assert short(op.device) == short(devices[[g.name for g in groups].index(m.group(1))]), op.name
            seen[m.group(1)] += 1
    assert all(n > 10 for n in seen.values()), seen  # forward and backward ops of every group


# -- pipelining: the unsplit model's gradients ----------------------------------------------------

@pytest.mark.parametrize("case", [dict(n=4, m=4, batch=16), dict(n=2, m=3, batch=10)],
                         ids=lambda c: f"{c['n']}dev-{c['m']}micro-b{c['batch']}")
def test_pipelined_gradients_equal_the_unsplit_model(case, tf_devices):
    """m micro-batches over n devices (m=3 with batch 10: pieces of 3, 3, 4) give the gradient
    of the whole batch computed by the chained model on one device, to float32 round-off."""
    batch, n = case["batch"], case["n"]
    groups = models.build_groups(CFG, (T,), V)
    devices = [tf_devices[min(i * n // len(groups), n - 1)] for i in range(len(groups))]
    mp = _model_parallel(devices, case["m"], batch=batch)
    x, y = _batch(1, batch)
    got = mp.gradients(x, y)
    with tf.device(tf_devices[0]):
        full = models.build(CFG, input_shape=(T,), num_classes=V)
        full.set_weights(mp.get_weights())
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, full(x, training=True)))
            loss = loss / T  # summed over the batch: what is pushed (rescale_grad divides by it)
        want = [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(loss, full.trainable_variables)]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(np.abs(w).max() > 0 for w in want)
    _assert_close(got, want)


def test_training_matches_data_parallelism_and_one_device(tf_devices):
    """Five SGD-momentum steps: model-parallel (2 devices, 4 micro-batches), data-parallel on
    2 devices and one device end with the same weights (sequence labels, per-token loss)."""
    batches = [_batch(s) for s in range(5)]

    mp = _model_parallel([tf_devices[0], tf_devices[0], tf_devices[1], tf_devices[1]], 4)
    start = mp.get_weights()  # the chained model has the same variables in the same order

    def data_parallel(devices):
        kv = store.create("local", devices=devices)
        return DataParallel(lambda: models.build(CFG, input_shape=(T,), num_classes=V), devices, kv, SGD, [B // len(devices)] * len(devices),
                            initial_weights=start)

    one, two = data_parallel(tf_devices[:1]), data_parallel(tf_devices[:2])
    for x, y in batches:
        for trainer in (mp, one, two):
            trainer.step(x, y)
    _assert_close(mp.get_weights(), one.get_weights())
    _assert_close(two.get_weights(), one.get_weights())
    assert any(not np.allclose(a, b) for a, b in zip(start, mp.get_weights()))
    values, seen = mp.take_metrics()
    assert seen == 5 * B and 0 < values["loss"] < 2 * math.log(V) and 0 <= values["accuracy"] <= 1
    assert values["perplexity"] == pytest.approx(math.exp(values["loss"]))
    assert mp.evaluate([_batch(9)])["loss"] > 0


def test_weights_and_optimizer_state_restore_exactly(tf_devices):
    """A run stopped after 2 steps and rebuilt from its weights and optimizer state (what a
    checkpoint holds) continues exactly as one never stopped (Adam: state matters)."""
    adam = optim.Adam(schedule=optim.Schedule(lr=1e-2))
    devices = [tf_devices[0], tf_devices[1], tf_devices[1], tf_devices[2]]
    batches = [_batch(s) for s in range(4)]
    straight = _model_parallel(devices, 2, opt=adam)
    for x, y in batches:
        straight.step(x, y)
    first = _model_parallel(devices, 2, opt=adam)
    for x, y in batches[:2]:
        first.step(x, y)
    resumed = ModelParallel(models.build_groups(CFG, (T,), V), devices, store.create("local"), adam, B,
                            micro_batches=2, initial_weights=first.get_weights())
    resumed.load_optimizer_states(first.optimizer_states())
    for x, y in batches[2:]:
        resumed.step(x, y)
    for a, b in zip(resumed.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(resumed.weight_names()) == len(resumed.get_weights())
    assert resumed.weight_names()[0].startswith("0000/embed/")


# -- automatic balancing --------------------------------------------------------------------------

def _brute_force(costs, k):
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_minimises_the_bottleneck():
    assert placement.partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert placement.partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    runs = placement.partition(list(range(1, 10)), 3)  # the textbook case: 1..5 | 6 7 | 8 9
    assert runs == [(0, 5), (5, 7), (7, 9)]
    # ties on cost go to the plan with the smaller largest parameter share
    assert placement.partition([2, 0, 0, 2], 2, tie=[0, 5, 5, 0]) == [(0, 2), (2, 4)]
    rng = np.random.default_rng(0)
    for _ in range(30):
        costs = list(rng.integers(1, 50, rng.integers(2, 8)))
        k = int(rng.integers(1, len(costs) + 1))
        runs = placement.partition(costs, k)
        assert runs[0][0] == 0 and runs[-1][1] == len(costs) and len(runs) == k
        assert all(a < b for a, b in runs) and all(r[1] == s[0] for r, s in zip(runs, runs[1:]))
        assert max(sum(costs[a:b]) for a, b in runs) == _brute_force(costs, k)


def test_auto_plan_balances_the_lstm_and_prints_costs():
    cfg = {"_target_": LSTM, "hidden": [200, 200, 200, 200], "embed_dim": 200}
    groups = models.build_groups(cfg, (35,), 1000)
    assert [g.name for g in groups] == ["embed", "lstm1", "lstm2", "lstm3", "lstm4", "decoder"]
    lstm, decoder = groups[1].flops, groups[-1].flops
    assert lstm == 8 * 400 * 200 * 35 and decoder == 2 * 200 * 1000 * 35
    specs = placement.assign("auto", groups, ["cpu:0", "cpu:1"], "lstm_lm")
    assert specs == ["cpu:0"] * 3 + ["cpu:1"] * 3  # embed+2 LSTMs | 2 LSTMs+decoder
    text = placement.format_plan(placement.stages(groups, specs), "plan")
    assert "stage 0  cpu:0  embed, lstm1, lstm2" in text and "stage 1  cpu:1  lstm3, lstm4, decoder" in text
    share = 100 * (2 * lstm + decoder) / (4 * lstm + decoder + groups[0].flops)
    assert f"({share:5.1f}%)" in text and "MFLOP" in text and "bottleneck stage" in text
    four = placement.stages(groups, placement.assign("auto", groups, [f"cpu:{i}" for i in range(4)], "lstm_lm"))
    assert [s.groups for s in four] == [("embed", "lstm1"), ("lstm2",), ("lstm3",), ("lstm4", "decoder")]


@pytest.mark.parametrize("value,devices,message", [
    ({"embed": "cpu:0", "lstm9": "cpu:1"}, ["cpu:0", "cpu:1"],
     "no layer group 'lstm9'; its groups are embed, lstm1, lstm2, decoder"),
    ({"embed": "cpu:0", "lstm1": "cpu:0", "lstm2": "cpu:2", "decoder": "cpu:1"}, ["cpu:0", "cpu:1"],
     "lstm2 -> cpu:2, which is not in devices=[cpu:0,cpu:1]"),
    ({"embed": "cpu:0", "lstm1": "cpu:0"}, ["cpu:0"], "no device for lstm2, decoder"),
    ({"embed": "cpu:0", "lstm1": "cpu:0", "lstm2": "cpu:0", "decoder": "cpu:0"}, ["cpu:0", "cpu:1"],
     "puts no layer group on cpu:1"),
    ("auto", [f"cpu:{i}" for i in range(5)], "5 devices but model lstm_lm has 4 layer groups"),
    ("everywhere", ["cpu:0"], "must be auto or a mapping"),
])
def test_bad_placements_are_one_line(value, devices, message):
    with pytest.raises(ConfigError) as e:
        placement.check(value, models.group_names({"_target_": LSTM, "hidden": [8, 8]}), devices, "lstm_lm")
    assert message in str(e.value) and "\n" not in str(e.value)


# -- the PTB reader and the embedded corpus -------------------------------------------------------

PTB_TRAIN = [" aer banknote berlitz calloway <unk> ", " the cat sat on the mat ", " the dog sat N times "]


def _write_ptb(root, train=PTB_TRAIN, valid=(" the cat sat ",), test=(" the mat sat on the dog ",)):
    root.mkdir(parents=True, exist_ok=True)
    for name, lines in (("train", train), ("valid", valid), ("test", test)):
        (root / f"ptb.{name}.txt").write_text("".join(line + "\n" for line in lines))


def _ptb(root, **kw):
    return ptb.load(root=str(root), **{"seq_len": 4, "vocab_size": 0, **kw})


def test_ptb_files_are_read_as_the_reference_reader_does(tmp_path):
    _write_ptb(tmp_path)
    ds = _ptb(tmp_path)
    tokens = ptb.read_tokens(PTB_TRAIN)
    assert tokens[:6] == ["aer", "banknote", "berlitz", "calloway", "<unk>", "<eos>"]
    assert tokens.count("<eos>") == 3 and len(tokens) == 19
    vocab = ptb.build_vocab(tokens)
    # most frequent first (<eos> 3, the 3, sat 2), ties alphabetical; <unk> last, once
    assert vocab[:3] == ["<eos>", "the", "sat"] and vocab[-1] == "<unk>" and vocab.count("<unk>") == 1
    assert ds.num_classes == len(vocab) == len(set(tokens))
    ids = ptb.encode(tokens, vocab)
    assert ds.x_train.shape == (4, 4) and ds.y_train.shape == (4, 4)  # (19 - 1) // 4 sequences
    np.testing.assert_array_equal(ds.x_train.ravel(), ids[:16])
    np.testing.assert_array_equal(ds.y_train.ravel(), ids[1:17])  # the next token
    assert [vocab[i] for i in ds.x_train[1]] == ["<unk>", "<eos>", "the", "cat"]
    assert [vocab[i] for i in ds.y_train[1]] == ["<eos>", "the", "cat", "sat"]
    test_tokens = ["the", "mat", "sat", "on", "the", "dog", "<eos>"]
    assert [vocab[i] for i in ds.x_test[0]] == test_tokens[:4] and ds.x_test.shape == (1, 4)
    valid = _ptb(tmp_path, eval_split="valid", seq_len=2)  # the, cat, sat, <eos>
    assert [vocab[i] for i in valid.x_test[0]] == ["the", "cat"] and valid.x_test.shape == (1, 2)


def test_vocabulary_cap_maps_rare_words_to_unk(tmp_path):
    _write_ptb(tmp_path)
    ds = _ptb(tmp_path, vocab_size=4)
    assert ds.num_classes == 4
    vocab = ptb.build_vocab(ptb.read_tokens(PTB_TRAIN), 4)
    assert vocab == ["<eos>", "the", "sat", "<unk>"]
    assert [vocab[i] for i in ds.x_train[1]] == ["<unk>", "<eos>", "the", "<unk>"]


def test_missing_ptb_files_are_one_line(tmp_path):
    (tmp_path / "ptb.train.txt").write_text(" a b c \n")
    with pytest.raises(DataError) as e:
        _ptb(tmp_path)
    msg = str(e.value)
    assert "ptb.valid.txt, ptb.test.txt" in msg and str(tmp_path) in msg and "ptb.train.txt" not in msg
    assert "dataset=embedded_text" in msg and "\n" not in msg


def test_embedded_corpus_is_real_english_and_fixed():
    a, b = (ptb.load_embedded(seq_len=20, vocab_size=10000) for _ in range(2))
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.shape[0] * 20 > 20_000 and a.x_test.shape[0] > 50
    splits = ptb.split_sentences(ptb.embedded_sentences())
    vocab = ptb.build_vocab(ptb.read_tokens(splits["train"]), 10000)
    assert vocab[:2] == ["the", "<eos>"] and {"of", "and", "is", "object"} <= set(vocab[:20])
    assert a.num_classes == len(vocab) > 1000
    sizes = {k: len(v) for k, v in splits.items()}
    assert sizes["valid"] == sizes["test"] or abs(sizes["valid"] - sizes["test"]) == 1
    assert 7 * sizes["test"] < sizes["train"] < 9 * sizes["test"]
    # PTB's conventions: lowercase words, numbers as N, at least a few words per line
    assert all(len(line.split()) >= 3 and re.fullmatch(r"([a-z']+|N)( ([a-z']+|N))*", line)
               for line in splits["train"])


# -- the LSTM example through tfkv-run ------------------------------------------------------------

SMALL = ["model.hidden=[32,32]", "dataset.seq_len=10", "progress=false"]


def _metrics(root):
    (path,) = root.glob("outputs/*/*/metrics.json")
    return json.loads(path.read_text())


def test_lstm_ptb_on_two_devices_reports_perplexity(tmp_path):
    proc = tfkv_run("+experiment=lstm_ptb", "devices=[cpu:0,cpu:1]", "placement=auto", "epochs=1",
                    "steps_per_epoch=8", *SMALL, cwd=tmp_path)  # the plan, the stages and the metrics: a few steps
    out = proc.stdout + proc.stderr
    assert "model-parallel plan (placement=auto, 4 micro-batches): 2 stage(s)" in out
    assert re.search(r"stage 1  cpu:1  .*decoder .*MFLOP \(\s*\d+\.\d%\)", out), out
    m = _metrics(tmp_path)
    assert m["epoch"] == 1 and {"train_perplexity", "test_perplexity"} <= set(m)
    assert 1 < m["test_perplexity"] < 10000 and m["test_perplexity"] == pytest.approx(math.exp(m["test_loss"]))
    assert m["history"][0]["train_perplexity"] == pytest.approx(math.exp(m["history"][0]["train_loss"]))


@pytest.mark.slow
def test_lstm_ptb_on_four_devices_with_a_placement_from_config(tmp_path):
    _write_ptb(tmp_path / "ptb", train=PTB_TRAIN * 40, test=(" the mat sat on the dog ",) * 4)
    tfkv_run("+experiment=lstm_ptb", "devices=[cpu:0,cpu:1,cpu:2,cpu:3]", "epochs=2", "batch_size=8",
             "placement={embed:cpu:0,lstm1:cpu:1,lstm2:cpu:2,decoder:cpu:3}", "dataset=ptb",
             f"dataset.root={tmp_path / 'ptb'}", *SMALL, cwd=tmp_path)
    m = _metrics(tmp_path)
    assert m["epoch"] == 2 and m["history"][1]["train_perplexity"] < m["history"][0]["train_perplexity"]


@pytest.mark.parametrize("args,message", [
    (["placement={embed:cpu:0,lstm7:cpu:1}"], "lstm_lm.build has no layer group 'lstm7'; its groups are"),
    (["placement={embed:cpu:0,lstm1:cpu:0,lstm2:cpu:3,decoder:cpu:1}"], "lstm2 -> cpu:3, which is not in devices"),
    (["placement=null", "micro_batches=4"], "micro_batches=4 pipelines a model split over devices"),
    (["model=mlp", "placement=null", "micro_batches=1", "epochs=1"],  # found when the first step traces
     "loss: sparse_categorical_crossentropy does not fit the model's output (16, 2348) and the labels (16, 20)"),
])
def test_bad_model_parallel_config_is_one_line_and_exit_2(tmp_path, args, message):
    proc = tfkv_run("+experiment=lstm_ptb", *args, cwd=tmp_path, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_each_dist_sync_worker_is_model_parallel(tmp_path):
    from conftest import TAG, tagged_pids

    env = {TAG: f"mp-dist-{tmp_path.name}"}
    proc = tfkv_run("+experiment=lstm_ptb", "kvstore=dist_sync", "cluster=local", "cluster.num_workers=2",
                    "devices=[cpu:0,cpu:1]", "epochs=1", *SMALL, cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    assert out.count("model-parallel plan") == 2 and "2 worker(s)" in out
    m = _metrics(tmp_path)
    assert m["epoch"] == 1 and 1 < m["test_perplexity"] < 10000
    assert not tagged_pids(env[TAG], wait=15)


def test_placement_is_checked_before_tensorflow_starts():
    import subprocess
    import sys

    from tfkv import cli

    code = ("import sys; from tfkv import check, cli; from hydra import compose, initialize_config_dir\n"
            "from tfkv.errors import ConfigError\n"
            f"with initialize_config_dir(config_dir={cli.conf_dir()!r}, version_base='1.3'):\n"
            "    check.validate(compose('config', overrides=['+experiment=lstm_ptb', 'devices=[cpu:0,cpu:1,cpu:2,cpu:3]']))\n"
            "    for bad, msg in ((['placement=auto'], 'mlp.build declares no layer groups'),\n"
            "                     (['+experiment=lstm_ptb', 'placement={embed:cpu:0}'], 'no device for lstm1'),\n"
            "                     (['+experiment=lstm_ptb', 'micro_batches=64', 'batch_size=32'], 'more than batch_size')):\n"
            "        try:\n"
            "            check.validate(compose('config', overrides=bad))\n"
            "            raise SystemExit(f'{bad} was accepted')\n"
            "        except ConfigError as e:\n"
            "            assert msg in str(e), str(e)\n"
            "assert 'tensorflow' not in sys.modules, 'validation imported TensorFlow'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
