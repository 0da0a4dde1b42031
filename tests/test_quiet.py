"""Quiet: a refusal never imports TensorFlow, and TensorFlow's C++ start-up lines (absl's
"All log messages before absl::InitializeLog()", oneDNN's) show only at a verbose
TF_CPP_MIN_LOG_LEVEL, also when a streaming reader or the user's own module loads TensorFlow."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import tfkv_run

ABSL = "All log messages before absl::InitializeLog()"

# tfkv-run's entry point in a process of its own; the last line of stdout says whether TensorFlow
# was imported (a refusal must not need it).
REFUSE = textwrap.dedent("""
    import sys
    sys.argv = ["tfkv-run", *sys.argv[1:]]
    from tfkv import cli
    try:
        cli.run()
    except SystemExit as e:
        print("exit", e.code)
    print("tensorflow imported:", "tensorflow" in sys.modules)
""")

OWN_MODEL = textwrap.dedent("""
    import keras  # at the top, as a user's module does: TensorFlow loads when tfkv imports it

    def build(input_shape, **settings):
        return keras.Sequential([keras.Input(input_shape), keras.layers.Dense(1)])
""")


def _csv(tmp_path):
    (tmp_path / "data").mkdir()
    rows = "\n".join(f"{i % 7},{i % 5},{(i % 7) * 2 - (i % 5)}" for i in range(64))
    (tmp_path / "data" / "houses.csv").write_text("rooms,age,price\n" + rows + "\n")
    (tmp_path / "own_model.py").write_text(OWN_MODEL)


REGRESSION = ["dataset=csv", "dataset.files=data/houses.csv", "dataset.label=price", "loss=mse", "metrics=[mae]",
              "objective=test_mae", "model._target_=own_model.build"]


@pytest.mark.parametrize("args,words", [
    (["cluster=none", "cluster.num_servers=4"], "Key 'num_servers' not in 'NoCluster'"),
    ([*REGRESSION, "optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
    ([*REGRESSION, "cluster=local"], "cluster=local starts a parameter-server job"),
    ([*REGRESSION, "epochs=0"], "epochs=0 must be at least 1"),
])
def test_a_refusal_is_one_line_without_tensorflow(tmp_path, args, words):
    _csv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", REFUSE, *args, "hydra.run.dir=run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[-2:] == ["exit 2", "tensorflow imported: False"], proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and words in lines[0], proc.stderr


@pytest.mark.slow
def test_tensorflows_start_up_lines_show_only_at_a_verbose_level(tmp_path):
    """A streaming reader (csv) and the user's own module, which imports keras at its top."""
    _csv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    quiet = tfkv_run(*REGRESSION, "epochs=1", "progress=false", "hydra.run.dir=quiet", cwd=tmp_path, env=env)
    assert ABSL not in quiet.stderr and "oneDNN" not in quiet.stderr, quiet.stderr
    loud = tfkv_run(*REGRESSION, "epochs=1", "progress=false", "hydra.run.dir=loud", cwd=tmp_path,
                    env={**env, "TF_CPP_MIN_LOG_LEVEL": "0"})
    assert ABSL in loud.stderr, loud.stderr  # the verbose setting still shows them
