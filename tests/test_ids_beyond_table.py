"""Row ids in the data beyond an embedding table's rows: one line naming the layer, the id and the
table's size, exit 2, and the checkpoints already written left where they are. Before, the local
stores ended in TensorFlow's InvalidArgumentError traceback (the store's check, by key number)
and a dist_sync job in a worker's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = '''
"""A user's package: embeddings of 40 rows, and data whose ids reach past 40 in epoch 2 only."""
import keras
import numpy as np
import tensorflow as tf


def bag(num_classes):
    ids = keras.Input(shape=(4,), dtype="int32")
    x = keras.layers.Embedding(40, 8, name="words")(ids)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(num_classes)(x))


class ShardedBag(keras.Model):
    """Subclassed, so its ShardedEmbedding fetches its rows at lookup time (no probe)."""

    def __init__(self, num_classes, **kwargs):
        super().__init__(**kwargs)
        from tfkv.layers import ShardedEmbedding

        self.embed = ShardedEmbedding(40, 8, rows_per_batch=64, name="sharded_words")
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.out(self.pool(self.embed(x)))


def sharded_bag(num_classes):
    return ShardedBag(num_classes)


def tokens(split, epoch):
    rng = np.random.default_rng(2 if split == "train" else 3)
    x = rng.integers(0, 40, size=(256, 4)).astype(np.int32)
    y = (x[:, 0] >= 20).astype(np.int32)
    if split == "train" and epoch >= 2:
        x[100, 2] = 57  # past the table
    return tf.data.Dataset.from_tensor_slices((x, y))
'''

WORDS = ("~model.hidden", "~model.dropout", "dataset._target_=userpkg.tokens",
         "~dataset.test_fraction", "+dataset.num_classes=2", "batch_size=32", "epochs=3")


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "userpkg.py").write_text(textwrap.dedent(PACKAGE))
    return tmp_path


def _run(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    # tfkv-run as a user starts it, from the directory the user's package is in
    return subprocess.run([sys.executable, "-m", "tfkv.cli", "hydra.run.dir=out", "progress=false", *overrides],
                          cwd=cwd, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, capture_output=True, text=True,
                          timeout=900)


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("model, row_sparse, layer", [
    ("bag", "true", "words"), ("bag", "false", "words"), ("sharded_bag", "false", "sharded_words"),
], ids=["row-sparse", "dense", "subclassed-sharded"])
def test_an_embedding_fed_an_id_past_its_table(project: Path, model: str, row_sparse: str, layer: str) -> None:
    """Epoch 1 trains and checkpoints; epoch 2's data holds id 57 for a table of 40 rows. A
    row-sparse table's ids are checked before its rows are asked for; a dense one's lookup fails
    inside the step (on CPU), and a subclassed model's ShardedEmbedding's fetch at lookup time
    refuses them: TensorFlow's error is told as the same line."""
    proc = _run(project, f"model._target_=userpkg.{model}", *WORDS, f"kvstore.row_sparse={row_sparse}")
    _one_line(proc, f"'{layer}'", "row id 57", "40 rows")
    assert (project / "out" / "checkpoints" / "epoch-0001").is_dir()  # what was written stays
    assert not (project / "out" / "model.keras").exists()


def test_the_ctr_experiment_with_a_larger_vocabulary_in_the_data(tmp_path: Path) -> None:
    """ShardedEmbedding tables of 1000 rows, the data's first vocabulary 2000 ids."""
    proc = _run(tmp_path, "+experiment=ctr_dlrm", "dataset.vocab_sizes=[2000,1000,1000,1000]", "dataset.num_train=2048",
                "dataset.num_test=512")
    _one_line(proc, "'embedding0'", "1000 rows", "model.vocab_sizes")


@pytest.mark.slow
def test_in_a_dist_sync_job(project: Path) -> None:
    proc = _run(project, "model._target_=userpkg.bag", *WORDS, "kvstore.row_sparse=true", "kvstore=dist_sync",
                "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "batch_size=16")
    _one_line(proc, "'words'", "row id 57", "40 rows")
    assert (project / "out" / "checkpoints" / "epoch-0001").is_dir()
