"""2-bit compression in a real training job: tfkv-run, dist_sync, 2 workers, the default
experiment (digits MLP); test accuracy of the exported model.keras by plain Keras."""

import json

import keras
import numpy as np
import pytest

from conftest import tfkv_run
from tfkv.data import digits


def _accuracy(run_dir):
    """The exported model's test accuracy by plain Keras; the run's metrics.json must say the same."""
    data = digits.load()
    model = keras.saving.load_model(run_dir / "model.keras", compile=False)
    # the data set's own inputs: the exported model standardises them as tfkv's pipeline does
    accuracy = float(np.mean(np.argmax(model.predict(data.x_test, verbose=0), axis=-1) == data.y_test))
    assert accuracy == pytest.approx(json.loads((run_dir / "metrics.json").read_text())["test_accuracy"], abs=1e-6)
    return accuracy


def _runs(tmp_path, seed, common, contenders):
    accuracy = {}
    for name, extra in contenders.items():
        run_dir = tmp_path / f"{name}{seed}"
        tfkv_run(*common, *extra, f"seed={seed}", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=300)
        accuracy[name] = _accuracy(run_dir)
    return accuracy


@pytest.mark.slow
def test_accurate_2bit_keeps_the_default_experiments_accuracy_with_momentum(tmp_path):
    """The default experiment as it is (SGD momentum 0.9), 2 workers, threshold 0.5: the config's
    2bit (momentum on the workers, the servers' SGD without it) ends within 1 point of
    uncompressed, where MXNet's exact 2-bit (2bit_mxnet: server-side momentum on the quantised
    gradients) ends far below (benchmarks/results/compression_accuracy.json has three seeds)."""
    common = ["kvstore=dist_sync", "cluster=local", "progress=false", "kvstore.compression.threshold=0.5"]
    accuracy = _runs(tmp_path, 0, common, {"plain": [], "2bit": ["kvstore.compression.type=2bit"],
                                           "2bit_mxnet": ["kvstore.compression.type=2bit_mxnet"]})
    assert accuracy["plain"] > 0.97, accuracy
    assert accuracy["2bit"] >= accuracy["plain"] - 0.01, accuracy
    assert accuracy["2bit_mxnet"] < accuracy["plain"] - 0.1, accuracy  # the failure the accurate one mends


@pytest.mark.slow
def test_mxnet_threshold_on_the_default_experiment_matches_uncompressed(tmp_path):
    """Workers push gradient sums and the optimizer applies rescale_grad = 1/global batch, as
    MXNet's Module, so MXNet's threshold 0.5 works as it does there: the default experiment
    (digits MLP, batch 64 per worker, SGD lr 0.1) with MXNet's exact 2-bit ends within 1 point of
    uncompressed (one seed in CI: each seed costs some 25 s of the 20 minutes CI may take; seed
    1 passed in CI until 2026-11-25). Without momentum: server-side momentum 0.9 turns the stale
    residual of a large gradient (sent at most +-0.5 a step) into a long overshoot on this
    110-step job, in MXNet's scheme too (the test above)."""
    common = ["kvstore=dist_sync", "cluster=local", "optimizer.momentum=0", "progress=false"]
    accuracy = _runs(tmp_path, 0, common, {"plain": [], "2bit_mxnet": ["kvstore.compression.type=2bit_mxnet",
                                                                       "kvstore.compression.threshold=0.5"]})
    assert accuracy["plain"] > 0.9, accuracy
    assert accuracy["2bit_mxnet"] >= accuracy["plain"] - 0.01, accuracy


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["2bit", "2bit_mxnet"])
def test_a_compressed_dist_job_resumed_from_a_checkpoint_ends_with_the_uninterrupted_weights(tmp_path, kind):
    """A dist_sync job packs its pushes in the compiled step; every worker's residuals (and, for
    the config's 2bit, velocities) go into worker 0's checkpoint beside the servers' state, the
    other workers' through the servers at the checkpoint's step, and each worker gets its own
    back on resume: from a mid-epoch checkpoint (every_steps), epoch 2 ends with the weights of
    the job never stopped, bit for bit. Two workers: worker 0's own state and another's (what a
    one-worker job would check is worker 0's half of this)."""
    _resumed_exactly(tmp_path, kind, 2, "checkpoint.every_steps=5")


@pytest.mark.slow
def test_checkpoints_by_the_clock_are_at_one_step_on_every_worker_and_resume_exactly(tmp_path):
    """every_minutes is worker 0's clock: its decision reaches the other worker through the vote
    after each step, so the worker shares its state at that very step (a checkpoint at almost
    every step here), and a resume from one of them ends with the uninterrupted weights."""
    _resumed_exactly(tmp_path, "2bit", 2, "checkpoint.every_minutes=0.0005")


def _resumed_exactly(tmp_path, kind, workers, when):
    common = ["kvstore=dist_sync", "cluster=local", f"cluster.num_workers={workers}", "progress=false", "epochs=2",
              "deterministic=true", "steps_per_epoch=20", f"kvstore.compression.type={kind}", "seed=0", when]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    tfkv_run(*common, f"hydra.run.dir={straight}", cwd=tmp_path, timeout=600)
    middle = sorted((straight / "checkpoints").glob("epoch-0001-step-*"))[0]  # its data set gives 7 steps or more
    with np.load(middle / "optimizer.npz") as f:
        held = {k: f[k] for k in f.files if k.startswith("worker_feedback/")}
    for rank in range(workers):  # restarting from zero would change the updates
        mine = {k: v for k, v in held.items() if k.startswith(f"worker_feedback/{rank}/")}
        assert mine and any(v.any() for v in mine.values()), (rank, sorted(held))
        assert any(k.endswith("/velocity") for k in mine) == (kind == "2bit")
    if workers > 1:  # each worker's own, not worker 0's again
        zero = {k.split("/", 2)[2]: v for k, v in held.items() if k.startswith("worker_feedback/0/")}
        assert any(not np.array_equal(zero[k.split("/", 2)[2]], v) for k, v in held.items()
                   if k.startswith("worker_feedback/1/"))
    run = tfkv_run(*common, f"hydra.run.dir={resumed}", f"resume={middle}", cwd=tmp_path, timeout=600)
    assert "start from zero" not in run.stderr
    with np.load(straight / "checkpoints" / "epoch-0002" / "weights.npz") as a, \
            np.load(resumed / "checkpoints" / "epoch-0002" / "weights.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.slow
def test_two_way_2bit_keeps_the_default_experiments_accuracy(tmp_path):
    """kvstore.compression.both_ways=true: the servers' replies 2-bit too (threshold derived from
    their optimizer), the workers training on copies that follow the servers' weights: within 1
    point of uncompressed on the default experiment (seed 1; benchmarks/results/design_figures.md
    has three seeds)."""
    common = ["kvstore=dist_sync", "cluster=local", "progress=false", "kvstore.compression.threshold=0.5"]
    accuracy = _runs(tmp_path, 1, common, {"plain": [], "both_ways": ["kvstore.compression.type=2bit",
                                                                      "kvstore.compression.both_ways=true"]})
    assert accuracy["plain"] > 0.97, accuracy
    assert accuracy["both_ways"] >= accuracy["plain"] - 0.01, accuracy
