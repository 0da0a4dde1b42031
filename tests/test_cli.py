"""`tfkv-run` end to end, as a user runs it: the installed console script in a fresh directory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tfkv_run


def _run_dirs(root: Path, kind: str = "outputs") -> list[Path]:
    pattern = "*/*" if kind == "outputs" else "*/*/*"
    return sorted(p for p in (root / kind).glob(pattern) if (p / ".hydra").is_dir())


def test_default_job_trains_and_leaves_its_record(tmp_path):
    proc = tfkv_run("epochs=3", "devices=[cpu:0,cpu:1]", cwd=tmp_path)
    (run,) = _run_dirs(tmp_path)
    metrics = json.loads((run / "metrics.json").read_text())
    assert {"test_accuracy", "train_loss", "samples_per_sec", "epoch"} <= set(metrics)
    assert metrics["epoch"] == 3 and len(metrics["history"]) == 3
    assert metrics["test_accuracy"] >= 0.9, metrics
    assert metrics["history"][-1]["train_loss"] < metrics["history"][0]["train_loss"]
    assert "epoch 3/3" in proc.stdout + proc.stderr
    assert (run / "config_resolved.yaml").is_file() and (run / ".hydra" / "config.yaml").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001", "epoch-0002", "epoch-0003"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "tfkv.log").read_text().count("  test_accuracy ") == 3  # one line per epoch


@pytest.mark.parametrize("args,message", [
    (["epoch=3"], "did you mean 'epochs'?"),
    (["batch_size=lots"], "could not be converted to Integer"),
    (["progress=maybe"], "not a valid bool (type str); see tfkv-run --help"),  # a known key: no "did you mean"
    (["kvstore=dist_nope"], "Could not find 'kvstore/dist_nope'"),
    (["model=vgg11"], "needs inputs of at least 32x32"),
    (["devices=[gpu:7]"], "gpu:7 does not exist on this machine"),
    (["dataset=mnist", "dataset.download=false", "dataset.root=nowhere"], "nowhere"),
    (["seed=-1"], "seed=-1 must be between 0 and 4294967295"),
    (["+epoch=3"], "epoch is not a setting tfkv knows (did you mean epochs?)"),  # + got past the schema
    (["model=resnet19"], "available: dlrm, lenet, lstm_lm, mlp, resnet18, saved, vgg11 (did you mean 'resnet18'?)"),
    (["experiment=mnist_lenet"], "to add it, write +experiment=mnist_lenet"),
    (["-m", "epochs=1", "--cfg", "job"], "Only one of --run, --multirun, --cfg"),
    (["devices=[cpu:0"], "write lists as key=[a,b]"),
    (["devices=cpu:0"], "write a list in brackets, e.g. devices=[cpu:0]"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, args, message):
    proc = tfkv_run(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


USER_MODULE = """
import keras


def not_a_model(input_shape, num_classes):
    return "a model"


def fine(input_shape, num_classes, units=4):
    inputs = keras.Input(shape=input_shape)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
"""


@pytest.mark.parametrize("args,words", [
    # a key the chosen option does not have: another option's, a typo, with or without +
    (["optimizer=adam", "optimizer.momentum=0.9"], ["optimizer.momentum", "adam", "beta1, beta2, epsilon"]),
    (["+optimizer.lrr=0.5"], ["optimizer.lrr", "did you mean optimizer.lr?", "momentum"]),
    (["optimizer.lrr=0.5"], ["optimizer.lrr", "did you mean optimizer.lr?", "momentum"]),
    (["model=mlp", "model.width=8"], ["model.width", "hidden, dropout"]),
    (["model=mlp", "+model.width=8"], ["model.width is not an argument of tfkv.models.mlp.build", "dropout, hidden"]),
    (["cluster.num_servers=4"], ["cluster.num_servers", "cluster none has the settings: launcher"]),
    (["+cluster.num_servers=4"], ["cluster.num_servers is not a setting of cluster=none; its settings: launcher"]),
    # a typo in a setting of a setting: the nearest key of that node, and its keys
    (["kvstore.compression.typ=2bit"], ["kvstore.compression.typ", "did you mean kvstore.compression.type?",
                                        "kvstore.compression has the settings: type, threshold"]),
    (["optimizer.schedule.nam=cosine"], ["did you mean optimizer.schedule.name?", "name, factor, milestones"]),
    (["+kvstore.compression.typ=2bit"], ["did you mean kvstore.compression.type?"]),
    # a _target_ that cannot be imported, an unknown argument of one, a factory returning the wrong type
    (["model._target_=nopkg_tfkv_test.nets.build"], ["model._target_='nopkg_tfkv_test.nets.build'", "cannot import"]),
    (["model._target_=userpkg_cli.fine", "~model.hidden", "~model.dropout", "+model.unit=3"],
     ["model.unit is not an argument of userpkg_cli.fine", "did you mean model.units?"]),
    (["model._target_=userpkg_cli.not_a_model", "~model.hidden", "~model.dropout"],
     ["model._target_=userpkg_cli.not_a_model returned a str, not a keras.Model"]),
    # the built-in zoo's own argument checks
    (["model.dropout=2"], ["model.dropout=2 must be at least 0 and below 1"]),
    (["model=lenet", "model.dropout=1.5"], ["model.dropout=1.5 must be at least 0 and below 1"]),
])
def test_what_the_option_does_not_take_is_one_line_before_training(tmp_path, args, words):
    (tmp_path / "userpkg_cli.py").write_text(USER_MODULE)  # the user's module, beside where tfkv-run starts
    proc = tfkv_run(*args, "epochs=1", "progress=false", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    assert "epoch 1/1" not in proc.stdout + proc.stderr and not list(tmp_path.glob("outputs/*/*/checkpoints/*"))


def test_sweep_runs_every_job_in_its_own_directory(tmp_path):
    tfkv_run("-m", "optimizer.lr=0.1,0.05", "kvstore=local,device", "devices=[cpu:0,cpu:1]",
             "epochs=1", "steps_per_epoch=2", "progress=false", cwd=tmp_path)
    runs = _run_dirs(tmp_path, "multirun")
    assert len(runs) == 4
    seen = set()
    for run in runs:
        cfg = (run / "config_resolved.yaml").read_text()
        lr = [ln for ln in cfg.splitlines() if ln.strip().startswith("lr:")][0].split()[-1]
        kind = [ln for ln in cfg.splitlines() if ln.strip().startswith("type:")][0].split()[-1]
        seen.add((lr, kind))
        assert json.loads((run / "metrics.json").read_text())["epoch"] == 1
    assert seen == {("0.1", "local"), ("0.1", "device"), ("0.05", "local"), ("0.05", "device")}


SLOW_JOB = ["dataset=synthetic", "dataset.shape=[16,16,3]", "dataset.num_train=2048", "model=lenet",
            "epochs=4", "batch_size=32", "devices=[cpu:0,cpu:1]", "optimizer.lr=0.02", "progress=false"]


def _weights(ckpt: Path) -> list[np.ndarray]:
    with np.load(ckpt / "weights.npz") as f:
        return [f[k] for k in sorted(f.files)]


@pytest.mark.slow
def test_resume_after_a_crash_continues_as_if_never_stopped(tmp_path):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    clean.mkdir(), crashed.mkdir()
    tfkv_run(*SLOW_JOB, cwd=clean)
    (clean_run,) = _run_dirs(clean)

    # Kill the same command hard once its second epoch is checkpointed.
    proc = subprocess.Popen(["tfkv-run", *SLOW_JOB], cwd=crashed, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.time() + 240
    while time.time() < deadline and not list(crashed.glob("outputs/*/*/checkpoints/epoch-0002")):
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    (first,) = _run_dirs(crashed)
    assert not (first / "checkpoints" / "epoch-0004").exists()

    out = tfkv_run(*SLOW_JOB, "resume=true", cwd=crashed)
    resumed = [r for r in _run_dirs(crashed) if r != first][0]
    assert "resumed from" in out.stdout + out.stderr
    metrics = json.loads((resumed / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]
    # Same data order (seeded by epoch), same weights and optimizer state: the same result.
    for a, b in zip(_weights(resumed / "checkpoints" / "epoch-0004"),
                    _weights(clean_run / "checkpoints" / "epoch-0004")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    clean_metrics = json.loads((clean_run / "metrics.json").read_text())
    assert metrics["test_accuracy"] == pytest.approx(clean_metrics["test_accuracy"], abs=1e-6)


def test_resume_from_an_explicit_run_directory(tmp_path):
    tfkv_run("epochs=1", "steps_per_epoch=4", "kvstore.update_on_kvstore=false", "devices=[cpu:0,cpu:1]", cwd=tmp_path)
    (first,) = _run_dirs(tmp_path)
    out = tfkv_run("epochs=2", "steps_per_epoch=4", "kvstore.update_on_kvstore=false", "devices=[cpu:0,cpu:1]",
                   f"resume={first}", cwd=tmp_path)
    assert f"resumed from {first / 'checkpoints' / 'epoch-0001'}" in out.stdout + out.stderr
    second = [r for r in _run_dirs(tmp_path) if r != first][0]
    assert [h["epoch"] for h in json.loads((second / "metrics.json").read_text())["history"]] == [1, 2]


def test_home_in_a_path_is_expanded_as_the_shell_does(tmp_path):
    """The docs' `dataset.root=~/data/mnist` (a lexer error in Hydra's grammar) works as typed."""
    proc = tfkv_run("--cfg", "job", "dataset=mnist", "dataset.root=~/data/mnist", "hydra.run.dir=~/runs/x",
                    cwd=tmp_path, env={"HOME": str(tmp_path)})
    assert f"root: {tmp_path}/data/mnist" in proc.stdout, proc.stdout
    quoted = tfkv_run("--cfg", "job", "dataset=mnist", "dataset.root='~/data'", cwd=tmp_path,
                      env={"HOME": str(tmp_path)})
    assert "root: ~/data" in quoted.stdout  # quoted: as written; the data loaders expand it when reading


def test_home_expansion_covers_sweeps_and_leaves_the_rest_alone():
    from tfkv.cli import expand_home

    home = os.path.expanduser("~")
    assert expand_home("dataset.root=~/a,~/b") == f"dataset.root={home}/a,{home}/b"
    assert expand_home("+resume=~") == f"+resume={home}"
    for kept in ("~epochs", "~epochs=3", "dataset.root='~/a'", "dataset.root=a~b", "-m", "seed=1"):
        assert expand_home(kept) == kept


@pytest.mark.parametrize("role", ["scheduler", "server", "worker"])
@pytest.mark.parametrize("keyfile", ["missing", "readable by others"])
def test_a_bad_key_file_is_one_line_for_every_role(tmp_path, role, keyfile):
    path = tmp_path / "curve.key"
    if keyfile == "readable by others":
        import subprocess as sp
        import sys

        sp.run([sys.executable, "-m", "tfkv.keys", str(path)], check=True, capture_output=True)
        path.chmod(0o644)
    env = {"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_SERVER": "1",
           "DMLC_NUM_WORKER": "1", "TFKV_CURVE_KEYFILE": str(path)}
    proc = tfkv_run("kvstore=dist_sync", "epochs=1", cwd=tmp_path, env=env, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"TFKV_CURVE_KEYFILE={path}" in lines[0], proc.stderr


def test_resume_no_means_false_without_a_warning(tmp_path):
    proc = tfkv_run("epochs=1", "resume=no", "progress=false", cwd=tmp_path)
    assert "WARNING" not in proc.stdout + proc.stderr and "epoch 1/1" in proc.stdout


def _interrupt(tmp_path: Path, when: str) -> subprocess.CompletedProcess:
    """Ctrl-C (SIGINT, as a terminal sends it) `when`: "importing" (Hydra: Python reports each
    import as it ends, so the signal lands mid-import whatever the load) or "training"."""
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"} if when == "importing" else None
    proc = subprocess.Popen(["tfkv-run", "epochs=200", "progress=false"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        if when == "importing":
            next(ln for ln in proc.stderr if ln.rsplit("|", 1)[-1].strip() == "omegaconf")
        else:
            next(ln for ln in proc.stdout if "epoch 2/200" in ln)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = "".join(ln for ln in err.splitlines(keepends=True) if not ln.startswith("import time:"))
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("when", ["importing", "training"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, when):
    proc = _interrupt(tmp_path, when)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tfkv-run: interrupted"), proc.stderr
    if when == "training":
        assert "checkpoint epoch-000" in lines[0] and "resume=true" in lines[0], lines


def _exception_classes() -> list[type]:
    """Every exception class tfkv defines, found by reading its source (a new one is checked too);
    only the modules that define one are imported."""
    import ast
    import importlib

    import tfkv

    root = Path(tfkv.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        names = [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                 and any(ast.unparse(b).endswith(("Error", "Exception", "Failed", "Pruned")) for b in node.bases)]
        if names:
            module = importlib.import_module(".".join(("tfkv", *path.relative_to(root).with_suffix("").parts)))
            found += [getattr(module, name) for name in names]
    return found


def test_every_exception_tfkv_defines_is_one_family_with_its_exit_status():
    from tfkv.errors import TfkvError

    classes = [c for c in _exception_classes() if issubclass(c, Exception)]
    assert len(classes) >= 15, classes  # the source walk found them (ps, launcher, data, store...)
    outside = [f"{c.__module__}.{c.__name__}" for c in classes if not issubclass(c, TfkvError)]
    assert not outside, f"not under TfkvError: {outside}"
    assert all(isinstance(c.exit_code, int) and 0 < c.exit_code < 256 for c in classes)
    # the standard bases callers catch them by stay
    from tfkv.ps.protocol import ProtocolError
    from tfkv.ps.scheduler_link import ClusterError

    assert issubclass(ProtocolError, ValueError) and issubclass(ClusterError, RuntimeError)


def test_one_handler_gives_any_family_error_its_line_and_status(tmp_path):
    """tfkv.errors.report: `prog: line` and the class's exit status, for an error of the runtime
    (not a list of classes the entry point knows) and for a subclass with its own status."""
    code = ("import sys; from tfkv import errors; from tfkv.keys import SecurityError\n"
            "class Custom(errors.TfkvError):\n    exit_code = 7\n"
            "err = {'security': SecurityError('keys are exposed'), 'custom': Custom('own status'),\n"
            "       'bug': KeyError('x')}[sys.argv[1]]\n"
            "try:\n    raise err\nexcept Exception as e:\n    errors.report('tfkv-run', e)\n    raise\n")
    runs = {kind: subprocess.run([sys.executable, "-c", code, kind], capture_output=True, text=True, timeout=60)
            for kind in ("security", "custom", "bug")}
    assert (runs["security"].returncode, runs["security"].stderr) == (2, "tfkv-run: keys are exposed\n")
    assert (runs["custom"].returncode, runs["custom"].stderr) == (7, "tfkv-run: own status\n")
    assert runs["bug"].returncode == 1 and "Traceback" in runs["bug"].stderr


@pytest.mark.slow
def test_the_log_of_a_run_names_its_compression_scheme_and_the_other(tmp_path):
    """A config's 2bit_mxnet is the API's "2bit" (MXNet's scheme); the log says which runs and
    how to get the other in a config and in the API (a port tripped on the names)."""
    tfkv_run("epochs=1", "steps_per_epoch=2", "kvstore=device", "devices=[cpu:0,cpu:1]", "progress=false",
             "kvstore.compression.type=2bit_mxnet", "kvstore.compression.threshold=0.25", cwd=tmp_path)
    (run,) = _run_dirs(tmp_path)
    assert ("gradient compression: MXNet's exact 2-bit, threshold 0.25 (kvstore.compression.type=2bit_mxnet; "
            "set_gradient_compression type '2bit'); for 2-bit with SGD's momentum applied by each sender (momentum "
            "correction): kvstore.compression.type=2bit (type '2bit_momentum')") in (run / "tfkv.log").read_text()
