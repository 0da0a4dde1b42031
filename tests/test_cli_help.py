"""`--help` and `--version` of tfkv's commands, run as a user runs them (the console scripts)."""

import shutil
import subprocess
from pathlib import Path

import pytest

import tfkv


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which(argv[0])
    assert exe, f"{argv[0]} is not on PATH: install the package first (pip install '.[cpu,test]')"
    return subprocess.run([exe, *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_tfkv_run_help_opens_with_tfkvs_usage_before_hydras(tmp_path):
    proc = _run("tfkv-run", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.splitlines()[0].startswith("tfkv-run: train a Keras model")
    ours = text[:text.index("== Config groups")]  # what comes before Hydra's own lists
    for needed in ("Usage:", "tfkv-run -m", "+experiment=", "epochs=", "batch_size=", "kvstore=dist_sync",
                   "kvstore.type", "cluster=local", "cluster.num_workers=", "optimizer.lr=", "docs/",
                   "docs/reference/config.md"):
        assert needed in ours, needed
    # the config's compression kinds, each with its name in the API, whose 2bit is the config's 2bit_mxnet
    assert "kvstore.compression.type=2bit          2-bit, SGD's momentum on the senders (the API's 2bit_momentum)" in ours
    assert "kvstore.compression.type=2bit_mxnet    MXNet's exact 2-bit (the API's set_gradient_compression 2bit)" in ours
    # then Hydra's: every group with its options from conf/, the composed config, the footer
    groups = text[text.index("== Config groups"):text.index("== The composed config")]
    options = sorted(p.stem for p in (Path(tfkv.conf_dir()) / "model").glob("*.yaml"))
    assert f"model: {', '.join(options)}" in groups
    assert "epochs: 10" in text and text.rstrip().endswith("tfkv-run --shell-completion install=bash")


@pytest.mark.parametrize("command", ["tfkv-run", "tfkv-launch", "tfkv-emulate"])
def test_version_names_tfkv_and_what_it_runs_on(command, tmp_path):
    proc = _run(command, "--version", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"{command} tfkv {tfkv.__version__}, TensorFlow ") and "Hydra " in line, line
    assert "\n" not in line and line.endswith(")")  # one line: pyzmq's version closes it
