"""What a newcomer hit from the README (issue 28, point 15), each as the user met it: the CSV
regression line of docs/getting-started/own-model-and-data.md run as written, the num_classes hint run as written, model=saved, a
read-only run directory, resume=auto without a fixed run directory, kvstore=nccl, and Ctrl-C of
a distributed job naming its checkpoint."""

import json
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Launching, tfkv_run

OWN = Path(__file__).resolve().parents[1] / "docs" / "getting-started" / "own-model-and-data.md"  # the page a newcomer reads


def _refusal(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("tfkv-run: "), proc.stderr[-3000:]
    return lines[0]


def test_the_documented_csv_regression_runs_as_written_and_its_test_mae_is_the_saved_models(tmp_path):
    (line,) = [ln for ln in OWN.read_text().splitlines() if ln.startswith("tfkv-run dataset=csv ") and "objective=" in ln]
    args = line.split()[1:]
    (tmp_path / "data").mkdir()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 3)).astype(np.float32)
    price = x @ np.array([1.0, 2.0, -1.0], np.float32) + 0.5
    rows = "\n".join(",".join(f"{v:.5f}" for v in (*r, p)) for r, p in zip(x, price))
    (tmp_path / "data" / "houses.csv").write_text("rooms,area,age,price\n" + rows + "\n")
    tfkv_run(*args, "hydra.run.dir=run", "progress=false", cwd=tmp_path)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    import keras

    model = keras.models.load_model(tmp_path / "run" / "model.keras")
    assert model.output_shape == (None, 1)  # a regressor's one output, not a class count's logits
    mae = float(np.mean(np.abs(model.predict(x, verbose=0)[:, 0] - price)))  # the oracle: plain Keras
    assert metrics["history"][-1]["evaluated_examples"] == len(x)
    assert metrics["test_mae"] == pytest.approx(mae, rel=1e-3, abs=1e-4)


OWN_DATA = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf

    def load(split):
        x = np.random.default_rng(0 if split == "train" else 1).normal(size=(64, 4)).astype("float32")
        return tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype("int64")))
""")


@pytest.mark.slow
@pytest.mark.parametrize("dataset", [["dataset._target_=own_data.load", "~dataset.test_fraction"],
                                     ["dataset=csv", "dataset.files=data/t.csv", "dataset.label=y"]])
def test_the_num_classes_hint_runs_as_written(tmp_path, dataset):
    """For the user's own factory (whose node has no num_classes key) and a built-in reader's (which has one)."""
    (tmp_path / "own_data.py").write_text(OWN_DATA)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "t.csv").write_text("a,b,y\n" + "".join(f"{i % 3},{i % 5},{i % 2}\n" for i in range(200)))
    base = [*dataset, "epochs=1", "progress=false"]
    line = _refusal(tfkv_run(*base, "hydra.run.dir=first", cwd=tmp_path, check=False))
    hint = re.search(r"set (\S+num_classes=N)", line).group(1)
    tfkv_run(*base, hint.replace("=N", "=2"), "hydra.run.dir=second", cwd=tmp_path)
    assert json.loads((tmp_path / "second" / "metrics.json").read_text())["epoch"] == 1


@pytest.mark.slow
def test_model_path_points_to_model_saved_which_runs_as_the_docs_write_it(tmp_path):
    assert "tfkv-run model=saved model.path=my.keras\n" in OWN.read_text()
    line = _refusal(tfkv_run("model.path=my.keras", cwd=tmp_path, check=False))
    assert "write model=saved model.path=..." in line, line
    import keras

    keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]).save(tmp_path / "my.keras")
    tfkv_run("model=saved", "model.path=my.keras", "epochs=1", "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test_accuracy"] > 0.5


def test_a_read_only_run_directory_is_told_to_be_made_writable(tmp_path):
    """A read-only file system, mounted in a mount namespace of its own (unshare: no root needed)."""
    (tmp_path / "ro").mkdir()
    script = f"mount -t tmpfs -o ro tmpfs {tmp_path / 'ro'} && exec tfkv-run hydra.run.dir={tmp_path / 'ro' / 'run'}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    line = _refusal(proc)
    assert "Read-only file system" in line and "make it writable or choose another hydra.run.dir" in line, line
    assert "free space" not in line


@pytest.mark.slow
def test_resume_auto_without_a_fixed_run_directory_says_it_cannot_resume(tmp_path):
    said = "resume=auto looks for checkpoints in the run's own directory, but"
    fresh = tfkv_run("resume=auto", "epochs=1", "progress=false", cwd=tmp_path)
    assert said in fresh.stderr + fresh.stdout and "fix it with hydra.run.dir=runs/<name>" in fresh.stderr + fresh.stdout
    fixed = tfkv_run("resume=auto", "epochs=1", "progress=false", "hydra.run.dir=run", cwd=tmp_path)
    assert said not in fixed.stderr + fixed.stdout


@pytest.mark.parametrize("name,use", [("nccl", "device"), ("local_update_cpu", "local")])
def test_an_mxnet_kvstore_name_on_the_command_line_points_to_tfkvs(tmp_path, name, use):
    line = _refusal(tfkv_run(f"kvstore={name}", cwd=tmp_path, check=False))
    assert f"write kvstore={use}" in line, line


@pytest.mark.slow
def test_ctrl_c_of_a_distributed_job_names_the_checkpoint_it_left(tmp_path):
    job = Launching(["kvstore=dist_sync", "cluster=local", "epochs=200", "progress=false", "hydra.run.dir=run"],
                    tmp_path, dict(os.environ), timeout=240, program="tfkv-run")
    job.wait_for("epoch 2/200")
    # Epoch 1's checkpoint published first: epochs take 0.1 s here, and a checkpoint still being
    # written when Ctrl-C comes is not left (the line then names none).
    deadline = time.monotonic() + 60
    while not (tmp_path / "run" / "checkpoints" / "epoch-0001").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    job.proc.send_signal(signal.SIGINT)
    code, out = job.end(timeout=120)
    assert code == 130, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("tfkv-run:")][-1]
    assert re.search(r"checkpoint epoch-\d{4}\S* is in \S+/run \(resume=true continues from it\)", line), line


SHARDED_COMPRESSED = ["+experiment=ctr_dlrm", "kvstore.compression.type=2bit_mxnet", "optimizer=sgd", "epochs=1",
                      "steps_per_epoch=2", "progress=false", "hydra.run.dir=run"]
SHARDED_REFUSAL = ("tfkv-run: kvstore.compression.type=2bit_mxnet compresses dense gradients, but this model's layers "
                   "embedding0, embedding1, embedding2, embedding3 are row-sparse tables (tfkv.layers.ShardedEmbedding), "
                   "whose rows are pushed uncompressed: set kvstore.compression.type=none, or use keras.layers.Embedding "
                   "with kvstore.row_sparse=false")


def test_compression_with_sharded_tables_is_refused_before_a_dist_job_starts(tmp_path):
    """Issue 40, point 16: the model's ShardedEmbedding tables are known once it is built; tfkv-run
    builds it before the launch, so no role starts (no launch record) and no worker's traceback."""
    line = _refusal(tfkv_run(*SHARDED_COMPRESSED, "kvstore=dist_sync", "cluster=local", cwd=tmp_path, check=False))
    assert line == SHARDED_REFUSAL
    assert not (tmp_path / "run" / "launch").exists() and not (tmp_path / "run" / "metrics.json").exists()


def test_compression_with_sharded_tables_is_refused_before_the_first_step(tmp_path):
    """kvstore=device in this process: refused once the model is built, before any step (not
    `push of key 10` from inside the compiled step)."""
    line = _refusal(tfkv_run(*SHARDED_COMPRESSED, "kvstore=device", cwd=tmp_path, check=False))
    assert line == SHARDED_REFUSAL
    assert not list((tmp_path / "run").glob("checkpoints/*")) and not (tmp_path / "run" / "metrics.json").exists()


def test_a_sharded_table_larger_than_memory_is_one_line_naming_its_layer(tmp_path):
    """kvstore=local: the table is drawn whole in this process; one larger than the memory
    available is refused before it is drawn (was: TensorFlow's OOM traceback after seconds),
    naming the layer, not the store's key number."""
    line = _refusal(tfkv_run("+experiment=ctr_dlrm", "model.vocab_sizes=[100000000000,1000,1000,1000]", "epochs=1",
                             "steps_per_epoch=2", "progress=false", "hydra.run.dir=run", cwd=tmp_path, check=False))
    assert line.startswith("tfkv-run: layer embedding0 (tfkv.layers.ShardedEmbedding): a table of 100000000000 rows "
                           "of 16 values (5960.5 GiB) is made whole in this process"), line
    assert "spread it over parameter servers" in line and "key 10" not in line


@pytest.mark.slow
def test_a_server_s_refusal_of_a_training_table_names_its_layer(tmp_path):
    """Issue 40, point 16: the trainer keys its tables by number (embedding0 is key 10 here); a
    server refusing one too large for its memory answers the init asynchronously, by key id,
    and the worker's line, passed on by the launcher, names the layer (was: `key 10`)."""
    line = _refusal(tfkv_run("+experiment=ctr_dlrm", "model.vocab_sizes=[100000000000,1000,1000,1000]", "epochs=1",
                             "steps_per_epoch=2", "progress=false", "kvstore=dist_sync", "cluster=local",
                             "cluster.num_workers=1", "cluster.num_servers=1", "hydra.run.dir=run",
                             cwd=tmp_path, check=False))
    assert "worker 0 exited with status 2: server 0: layer embedding0 (tfkv.layers.ShardedEmbedding): a shard of " \
           "100000000000 rows of 16 values" in line and "more than this server's memory" in line, line
    assert not re.search(r"\bkey \d", line), line
