"""What a run leaves for use outside tfkv: model.keras that loads where tfkv cannot be imported,
the SavedModel for serving, and eval_only evaluating a checkpoint without training."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import tfkv_run

# The child hides tfkv: -I drops PYTHONPATH, the current directory and the user's site, and a
# finder placed before every other (the editable install's included) refuses any tfkv module.
_NO_TFKV = textwrap.dedent("""
    import importlib.abc, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"

    class NoTfkv(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "tfkv":
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")

    sys.meta_path.insert(0, NoTfkv())
    try:
        import tfkv
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("tfkv is still importable")
""")


def _outputs_without_tfkv(model_file: Path, x: np.ndarray, tmp_path: Path) -> np.ndarray:
    """The outputs of `keras.models.load_model(model_file)` on `x`, computed in a process where
    tfkv cannot be imported."""
    np.save(tmp_path / "x.npy", x)
    code = _NO_TFKV + textwrap.dedent(f"""
        import numpy as np, keras
        model = keras.models.load_model({str(model_file)!r})
        np.save({str(tmp_path / "y.npy")!r}, np.asarray(model(np.load({str(tmp_path / "x.npy")!r}))))
    """)
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(tmp_path / "y.npy")


def test_lstm_model_with_tfkv_embedding_saves_as_plain_keras(tmp_path):
    """The LSTM model's Embedding is tfkv's own class: the saved model has Keras' in its place,
    loads without tfkv and computes the same outputs."""
    from tfkv import export
    from tfkv.models import lstm_lm

    model = lstm_lm.build((6,), 40, hidden=[8, 8], embed_dim=5)
    assert any(type(layer).__module__.startswith("tfkv") for layer in model.layers)
    x = np.random.default_rng(0).integers(0, 40, size=(4, 6)).astype("int32")
    path = export.save(model, tmp_path)
    assert path == tmp_path / "model.keras" and not list(tmp_path.glob(".tmp*"))
    np.testing.assert_allclose(_outputs_without_tfkv(path, x, tmp_path), np.asarray(model(x)), rtol=1e-5,
                               atol=1e-6)


def test_a_model_of_keras_classes_only_is_saved_as_it_is():
    import keras

    from tfkv import export

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert export.portable(model) is model


def _run(tmp_path: Path, *args: str) -> Path:
    tfkv_run("epochs=1", "progress=false", "hydra.run.dir=outputs/a/train", *args, cwd=tmp_path)
    return tmp_path / "outputs" / "a" / "train"


def _trained_outputs(run: Path, x: np.ndarray) -> np.ndarray:
    """The trained model's outputs on the digits `x` as the data set holds them: the MLP rebuilt
    with the weights of the run's last checkpoint, given `x` scaled as tfkv's pipeline scales it."""
    from tfkv import checkpoint
    from tfkv.data import digits
    from tfkv.models import mlp

    data = digits.load()
    model = mlp.build(input_shape=x.shape[1:], num_classes=10, hidden=[256, 128])
    model.set_weights(checkpoint.load(checkpoint.latest(run)).weights)
    return np.asarray(model((x - np.float32(data.mean[0])) / np.float32(data.std[0])))


def test_the_exported_model_takes_the_data_sets_own_inputs(tmp_path):
    """The digits as tfkv.data.digits.load() gives them ([0, 1]; tfkv's pipeline standardises them
    with the training split's statistics): plain Keras, without tfkv, given those inputs scores
    what tfkv reported (before the fix: 0.908 where tfkv said 0.983)."""
    import keras

    from tfkv.data import digits

    run = _run(tmp_path)
    reported = json.loads((run / "metrics.json").read_text())
    data = digits.load()
    logits = _outputs_without_tfkv(run / "model.keras", data.x_test, tmp_path)
    assert float(np.mean(np.argmax(logits, -1) == data.y_test)) == pytest.approx(reported["test_accuracy"], abs=1e-6)
    loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(data.y_test, logits))
    assert loss == pytest.approx(reported["test_loss"], rel=1e-4)
    assert reported["test_accuracy"] > 0.8
    # Trained on from the export (model=saved), with steps too small to change a weight (lr
    # 1e-30): the same model, its inputs scaled once by the pipeline, never twice.
    tfkv_run("epochs=1", "progress=false", "model=saved", f"model.path={run / 'model.keras'}", "optimizer.lr=1e-30",
             "optimizer.wd=0", "hydra.run.dir=outputs/b", cwd=tmp_path)
    again = json.loads((tmp_path / "outputs" / "b" / "metrics.json").read_text())
    assert again["test_accuracy"] == reported["test_accuracy"]
    assert again["test_loss"] == pytest.approx(reported["test_loss"], rel=1e-5)


def _digits_batch() -> np.ndarray:
    from tfkv.data import digits

    return (digits.raw()[0][:32] / 16.0).astype("float32")[..., None]  # as tfkv.data.digits.load: (8, 8, 1)


@pytest.mark.slow
def test_every_run_leaves_model_keras_and_a_saved_model_when_asked(tmp_path):
    import tensorflow as tf

    run = _run(tmp_path, "export.saved_model=true")
    x = _digits_batch()
    expected = _trained_outputs(run, x)
    np.testing.assert_allclose(_outputs_without_tfkv(run / "model.keras", x, tmp_path), expected,
                               rtol=1e-5, atol=1e-6)
    loaded = tf.saved_model.load(str(run / "saved_model"))  # held: serve's variables live in it
    served = loaded.serve(tf.constant(x))
    np.testing.assert_allclose(np.asarray(served), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_eval_only_reproduces_the_final_test_metrics_of_the_run_it_resumes(tmp_path):
    run = _run(tmp_path)
    assert (run / "model.keras").is_file() and not (run / "saved_model").exists()
    trained = json.loads((run / "metrics.json").read_text())
    proc = tfkv_run("epochs=1", "progress=false", "+eval_only=true", f"resume={run}",
                    "hydra.run.dir=outputs/a/eval", cwd=tmp_path)
    evaluated = json.loads((tmp_path / "outputs" / "a" / "eval" / "metrics.json").read_text())
    assert evaluated["epoch"] == 1 and evaluated["checkpoint"] == str(run / "checkpoints" / "epoch-0001")
    for key in ("test_loss", "test_accuracy"):
        assert evaluated[key] == pytest.approx(trained[key], abs=1e-6), key
    log = proc.stdout + proc.stderr
    assert "eval_only: checkpoint" in log and "epoch 1/1" not in log  # evaluated, not trained
    assert not (tmp_path / "outputs" / "a" / "eval" / "checkpoints").exists()
    assert (tmp_path / "outputs" / "a" / "eval" / "model.keras").is_file()
    # resume=true: the newest checkpoint of the same command, eval_only aside
    tfkv_run("epochs=1", "progress=false", "eval_only=true", "resume=true", "hydra.run.dir=outputs/a/eval2",
             cwd=tmp_path)
    again = json.loads((tmp_path / "outputs" / "a" / "eval2" / "metrics.json").read_text())
    assert again["checkpoint"] == evaluated["checkpoint"]


@pytest.mark.parametrize("args", [["+eval_only=true"], ["eval_only=true", "resume=false"]])
def test_eval_only_without_resume_is_one_line(tmp_path, args):
    proc = tfkv_run(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert len(lines) == 1 and "eval_only=true evaluates a checkpoint" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("outputs/*/*/tensorboard"))  # refused before anything started


@pytest.mark.slow
def test_eval_only_of_a_dist_sync_command_evaluates_in_one_process(tmp_path):
    """The command of a dist_sync job plus eval_only: no job starts; the checkpoint (its optimizer
    state the servers' own) is evaluated here, the whole test split in one process, and gives the
    job's final test metrics, which its two workers evaluated half of the split each."""
    job = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "epochs=1",
           "progress=false", "eval_batch_size=100"]  # digits' 359 test examples: 179 and 180, in batches of 100
    tfkv_run(*job, "hydra.run.dir=outputs/a/train", cwd=tmp_path, timeout=240)
    run = tmp_path / "outputs" / "a" / "train"
    assert (run / "model.keras").is_file() and (run / "launch").is_dir()
    trained = json.loads((run / "metrics.json").read_text())
    tfkv_run(*job, "+eval_only=true", "resume=true", "hydra.run.dir=outputs/a/eval", cwd=tmp_path)
    ev = tmp_path / "outputs" / "a" / "eval"
    evaluated = json.loads((ev / "metrics.json").read_text())
    assert evaluated["checkpoint"] == str(run / "checkpoints" / "epoch-0001")
    assert evaluated["test_accuracy"] == trained["test_accuracy"]  # the same examples counted right
    assert evaluated["test_loss"] == pytest.approx(trained["test_loss"], rel=1e-5)
    assert evaluated["evaluated_examples"] == trained["history"][-1]["evaluated_examples"] == 359
    assert trained["history"][-1]["worker_evaluated_examples"] == 179  # worker 0's part; worker 1's: 180
    assert not (ev / "launch").exists()  # no job was launched
