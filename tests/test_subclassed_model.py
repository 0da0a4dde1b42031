"""A user's subclassed Keras model whose builder never calls it (its layers made in `__init__`,
no weight yet) trains through `tfkv-run` as Keras `fit` trains it, in every kind of store, and
its exported model.keras, loaded by plain Keras, scores what tfkv reported. Keras `fit` builds
such a model on its first batch; before tfkv did, the store got no keys and nothing trained."""

from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import tfkv_run

PACKAGE = '''
"""A user's package: subclassed models, never called by their builders, and their data."""
import keras
import numpy as np


@keras.saving.register_keras_serializable(package="userpkg")
class Net(keras.Model):
    def __init__(self, num_classes, width=16, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.width = num_classes, width
        self.flat = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.out = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.out(self.hidden(self.flat(x)))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "width": self.width}


@keras.saving.register_keras_serializable(package="userpkg")
class Bag(keras.Model):
    """Token ids -> an Embedding (a row-sparse key with kvstore.row_sparse=true) -> classes."""

    def __init__(self, num_classes, vocab=40, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.vocab = num_classes, vocab
        self.embed = keras.layers.Embedding(vocab, 8)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.out = keras.layers.Dense(num_classes)

    def call(self, x):
        return self.out(self.pool(self.embed(x)))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "vocab": self.vocab}


def net(num_classes):
    return Net(num_classes)


def bag(num_classes):
    return Bag(num_classes)


def blobs(split):
    """Two Gaussian blobs in 6 dimensions: an untrained model scores about one half."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    centres = np.random.default_rng(7).normal(0.0, 1.0, size=(2, 6))
    y = rng.integers(0, 2, size=512 if split == "train" else 256)
    x = centres[y] + rng.normal(0.0, 0.6, size=(len(y), 6))
    return x.astype(np.float32), y.astype(np.int32)


def tokens(split):
    """Four token ids of 40; the class is whether their sum is above the middle."""
    rng = np.random.default_rng(2 if split == "train" else 3)
    x = rng.integers(0, 40, size=(512 if split == "train" else 256, 4)).astype(np.int32)
    return x, (x.sum(axis=1) >= 78).astype(np.int32)
'''

NET = ("model._target_=userpkg.net", "dataset._target_=userpkg.blobs")
BAG = ("model._target_=userpkg.bag", "dataset._target_=userpkg.tokens")
EPOCHS, BATCH, LR = 5, 32, 0.1


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "userpkg.py").write_text(textwrap.dedent(PACKAGE))
    return tmp_path


def _userpkg(project: Path):
    """This test's userpkg.py, loaded from its file: other tests of the same pytest worker import
    modules of their own named userpkg, and `import userpkg` would return theirs."""
    spec = importlib.util.spec_from_file_location(f"userpkg_{project.name}", project / "userpkg.py")
    userpkg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(userpkg)
    return userpkg


def _train(project: Path, which: tuple[str, str], *overrides: str) -> dict:
    tfkv_run("hydra.run.dir=out", "progress=false", *which, "~model.hidden", "~model.dropout", "~dataset.test_fraction",
             f"epochs={EPOCHS}", f"batch_size={BATCH}", f"optimizer.lr={LR}", "optimizer.wd=0", *overrides,
             cwd=project, timeout=600)
    return json.loads((project / "out" / "metrics.json").read_text())


def _keras_fit_accuracy(userpkg, which: tuple[str, str], batch: int) -> float:
    """The oracle: Keras `fit` of the same never-called model on the same arrays."""
    import keras

    keras.utils.set_random_seed(0)
    model = getattr(userpkg, which[0].rsplit(".", 1)[1])(2)
    data = getattr(userpkg, which[1].rsplit(".", 1)[1])
    (x, y), (xt, yt) = data("train"), data("test")
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(x, y, batch_size=batch, epochs=EPOCHS, verbose=0)
    return float(model.evaluate(xt, yt, verbose=0)[1])


def _check(project: Path, which: tuple[str, str], metrics: dict, batch: int = BATCH) -> None:
    """Trained as Keras fit trains it, and the exported model scores, in plain Keras, what tfkv said."""
    import keras

    userpkg = _userpkg(project)
    history = metrics["history"]
    # It learns: an untrained model of two classes stays near log 2 (0.688 before the fix)
    assert history[-1]["train_loss"] < 0.75 * np.log(2), [h["train_loss"] for h in history]
    oracle = _keras_fit_accuracy(userpkg, which, batch)
    assert oracle > 0.85 and metrics["test_accuracy"] == pytest.approx(oracle, abs=0.04), (metrics, oracle)
    xt, yt = getattr(userpkg, which[1].rsplit(".", 1)[1])("test")
    model = keras.models.load_model(project / "out" / "model.keras", compile=False)
    assert type(model).__name__ == type(getattr(userpkg, which[0].rsplit(".", 1)[1])(2)).__name__
    logits = np.asarray(model.predict(xt, batch_size=256, verbose=0))
    assert float(np.mean(np.argmax(logits, -1) == yt)) == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(yt, logits)
    assert float(loss) == pytest.approx(metrics["test_loss"], rel=1e-4)


@pytest.mark.parametrize("which, overrides", [
    (NET, ()),
    (NET, ("kvstore=device", "devices=[cpu:0,cpu:1]")),
    (BAG, ("kvstore.row_sparse=true",)),
], ids=["local", "device-2-copies", "row-sparse-embedding"])
def test_a_never_called_subclassed_model_trains_and_exports(project: Path, which, overrides) -> None:
    _check(project, which, _train(project, which, *overrides))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["dist_sync", "dist_async"])
def test_a_never_called_subclassed_model_trains_in_a_job(project: Path, store: str) -> None:
    """Two workers and a server: every worker builds its copy before the keys are initialised."""
    metrics = _train(project, NET, f"kvstore={store}", "cluster=local", "cluster.num_workers=2",
                     "cluster.num_servers=1", f"batch_size={BATCH // 2}")
    _check(project, NET, metrics)
