"""Plug-ins from other packages: tests/plugin_pkg is installed with pip (offline, into a target
directory on PYTHONPATH: this interpreter's environment for the subprocesses, without touching
the site-packages the other tests use), and each kind it declares is used through tfkv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tfkv_run
from tfkv.tfimport import shown

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "tfkv-plugin-example"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees the installed plug-in package; uninstalled after."""
    root = tmp_path_factory.mktemp("plugins")
    source, target = root / "src", root / "site"
    shutil.copytree(REPO / "tests" / "plugin_pkg", source)  # setuptools builds in the source tree
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--disable-pip-version-check", "--root-user-action=ignore",
                    "--target", str(target), str(source)], check=True, capture_output=True, text=True)
    assert list(target.glob("tfkv_plugin_example-*.dist-info/entry_points.txt"))
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    yield {**os.environ, "PYTHONPATH": path}
    shutil.rmtree(target)  # pip --target has no uninstall: the package is its directory


def run_python(code: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 120) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


def test_plugins_become_names_and_config_options_without_importing_tensorflow(plugin_env):
    out = run_python("""
        import json, sys
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf
        from tfkv import plugins, store
        from tfkv.launcher import base
        plugins.load()
        plugins.load()  # twice: nothing more is said
        repo = ConfigStore.instance().repo
        nodes = {g: {k: OmegaConf.to_container(v.node) for k, v in repo.get(g, {}).items()}
                 for g in ("kvstore", "cluster", "model", "dataset")}
        out = {"stores": store.names(), "launchers": base.REGISTRY.names(), "nodes": nodes,
               "canonical": store.canonical("twin"), "tensorflow": "tensorflow" in sys.modules,
               "keras": "keras" in sys.modules}
        # a plug-in's capabilities are its class's: asking imports it (here, with TensorFlow)
        out["capabilities"] = vars(store.capabilities("twin"))
        print(json.dumps(out))
    """, plugin_env)
    assert "twin" in out["stores"] and "shaky" in out["stores"] and "twin" in out["launchers"]
    assert out["canonical"] == "twin"
    assert out["capabilities"] == {"distributed": False, "sync": True, "compression": False}  # LocalStore's
    nodes = out["nodes"]
    assert nodes["kvstore"]["twin.yaml"] == {"type": "twin"}
    # the settings schema the launcher class declares (config = RemoteCluster), filled in
    assert nodes["cluster"]["twin.yaml"]["launcher"] == "twin"
    assert nodes["cluster"]["twin.yaml"]["num_workers"] == 2 and nodes["cluster"]["twin.yaml"]["python"] == "python3"
    # the builder's keyword defaults that are plain values; not what tfkv passes (input_shape,
    # num_classes) nor a default that is an object (init=keras.initializers...)
    assert nodes["model"]["tinynet.yaml"] == {"_target_": "tfkv_plugin_example.nets.build", "width": 16,
                                              "dropout": 0.0, "activation": "relu"}
    assert nodes["dataset"]["blobs.yaml"] == {"_target_": "tfkv_plugin_example.data.make", "n": 600,
                                              "features": 8, "classes": 3, "spread": 0.5}
    # a callable that is no plain def in its module's source: its signature, once imported
    assert nodes["dataset"]["blobs_again.yaml"] == {**nodes["dataset"]["blobs.yaml"],
                                                    "_target_": "tfkv_plugin_example.make_blobs"}
    assert "local.yaml" not in nodes["kvstore"] and "gone.yaml" not in nodes["dataset"]
    # reading the names ran no plug-in's module: nets.py imports keras at its top
    assert not out["tensorflow"] and not out["keras"]
    # one line per broken plug-in, naming its package and entry point
    # (asking the plug-in's capabilities imported TensorFlow, whose load-time C++ lines are not ours)
    lines = [line for line in out["stderr"].splitlines() if line.strip() and shown(line, 2)]
    clash = [line for line in lines if "local = tfkv_plugin_example.stores:TwinStore" in line]
    gone = [line for line in lines if "gone = tfkv_plugin_example.missing:make" in line]
    assert len(clash) == 1 and f"package {PACKAGE}" in clash[0] and "tfkv's is used" in clash[0], lines
    assert len(gone) == 1 and f"package {PACKAGE}" in gone[0] and "no module named" in gone[0].lower(), lines
    assert len(lines) == 2 and "Traceback" not in out["stderr"], lines


@pytest.mark.slow  # imports TensorFlow
def test_a_plugin_store_is_created_by_name_and_a_broken_one_is_one_line(plugin_env):
    out = run_python("""
        import json
        import numpy as np
        from tfkv import store
        from tfkv.errors import ConfigError
        try:
            store.create("shaky")
            broken = None
        except ConfigError as e:
            broken = str(e)
        kv = store.create("twin")
        kv.init(3, np.ones(4, "float32"))
        kv.push(3, [np.full(4, 2.0, "float32"), np.full(4, 5.0, "float32")])
        pulled = np.zeros(4, "float32")
        kv.pull(3, out=pulled)
        print(json.dumps({"class": type(kv).__name__, "type": kv.type, "pulled": pulled.tolist(),
                          "broken": broken}))
    """, plugin_env)
    assert out["class"] == "TwinStore" and out["type"] == "twin"
    assert out["pulled"] == [7.0] * 4  # no optimizer: the store keeps the sum pushed, as local does
    assert out["broken"] and "\n" not in out["broken"], out
    assert f"shaky = tfkv_plugin_example.shaky:Store ([tfkv.stores] of package {PACKAGE})" in out["broken"]
    assert "tfkv_plugin_example_missing_dependency" in out["broken"] and "uninstall" in out["broken"]


def test_plugin_config_options_compose_with_hydra(plugin_env):
    out = run_python("""
        import json, sys
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf
        from tfkv import config, plugins
        from tfkv.cli import conf_dir
        plugins.load()
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            a = compose("config", overrides=["kvstore=twin"])
            b = compose("config", overrides=["kvstore=dist_sync", "cluster=twin", "cluster.num_workers=3",
                                             "cluster.port=5000", f"cluster.python={sys.executable}"])
            c = compose("config", overrides=["kvstore=local"])
            d = compose("config", overrides=["model=tinynet", "model.width=8", "dataset=blobs", "dataset.n=300"])
        print(json.dumps({"a": a.kvstore.type, "c": c.kvstore.type,
                          "b": [b.kvstore.type, b.cluster.launcher, b.cluster.num_workers, b.cluster.port,
                                b.cluster.python],
                          "d": [OmegaConf.to_container(d.model), OmegaConf.to_container(d.dataset)]}))
    """, plugin_env)
    assert out["a"] == "twin" and out["b"] == ["dist_sync", "twin", 3, 5000, sys.executable]
    assert out["c"] == "local"  # tfkv's own option, not the plug-in that claims the name
    model, dataset = out["d"]  # the plug-ins' keyword defaults are overridden without +
    assert model == {"_target_": "tfkv_plugin_example.nets.build", "width": 8, "dropout": 0.0, "activation": "relu"}
    assert dataset["_target_"] == "tfkv_plugin_example.data.make" and dataset["n"] == 300


def test_a_plugin_launchers_own_settings_are_tfkv_launch_flags_and_reach_it(plugin_env):
    """The settings schema a plug-in launcher declares (`config`) is tfkv-launch's flags, and the
    launcher is constructed with them (tfkv-launch's and tfkv-run's job options alike)."""
    out = run_python("""
        import dataclasses, json
        from tfkv.launcher import cli, job
        args = cli.parser().parse_args(["-n", "2", "--launcher", "twin", "--greeting", "hi", "--", "cmd"])
        opts = job.Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(job.Options)})
        launcher = job.backend(opts)
        helps = {a.dest: a.help for a in cli.parser()._actions}
        default = job.backend(job.Options("twin", 1, 1)).settings.greeting
        print(json.dumps({"greeting": launcher.settings.greeting, "schema": type(launcher.settings).__name__,
                          "help": helps["greeting"], "default": default}))
    """, plugin_env)
    assert (out["greeting"], out["schema"], out["default"]) == ("hi", "TwinCluster", "starting the job")
    assert out["help"] == "what the twin launcher says as it starts the job"


@pytest.mark.slow
def test_a_plugin_launcher_runs_a_job(plugin_env, tmp_path):
    """tfkv-launch --launcher twin: the plug-in launcher (tfkv's local one under another name)
    starts a scheduler, a server and two workers that train through the parameter server."""
    proc = subprocess.run(["tfkv-launch", "-n", "2", "-s", "1", "--launcher", "twin", "--python", sys.executable,
                           "--run-dir", "rec", "--", sys.executable, str(REPO / "tests" / "workers" / "dist_worker.py"),
                           "updates", "out{rank}.json", "4"],
                          cwd=tmp_path, env=plugin_env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "twin launcher: starting the job" in (tmp_path / "rec" / "launch" / "job.log").read_text()
    for i in range(2):
        assert json.loads((tmp_path / f"out{i}.json").read_text())["final"] == [100.0 - 4 * 3] * 4


def run_dir(cwd: Path) -> Path:
    (found,) = cwd.glob("outputs/*/*/metrics.json")
    return found.parent


def test_tfkv_run_names_a_broken_plugin_and_refuses_it_in_one_line(plugin_env, tmp_path):
    proc = tfkv_run("dataset=gone", "--cfg", "job", cwd=tmp_path, env=plugin_env, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 3 and "Traceback" not in proc.stderr, proc.stderr  # the two warnings, the error
    assert any("gone = tfkv_plugin_example.missing:make" in line for line in lines[:2])
    assert lines[2].startswith("tfkv-run: ") and "dataset/gone" in lines[2] and "blobs" in lines[2]


@pytest.mark.slow
def test_tfkv_run_trains_a_plugin_model_on_a_plugin_store(plugin_env, tmp_path):
    proc = tfkv_run("model=tinynet", "model.width=8", "kvstore=twin", "epochs=1", cwd=tmp_path, env=plugin_env)
    assert "tinynet: width 8, dropout 0.0" in proc.stdout
    run = run_dir(tmp_path)
    assert "kvstore=twin" in (run / "tfkv.log").read_text()
    # digits: 10 classes, chance 0.1; one epoch of a width-8 net ends near 0.3, on either side of it
    # as the threads' order of sums goes (0.29 in one CI rehearsal), so twice chance is what it proves
    assert json.loads((run / "metrics.json").read_text())["test_accuracy"] > 0.2
    # the plug-in that cannot be imported is one line when chosen, naming it
    proc = tfkv_run("kvstore=shaky", "epochs=1", cwd=tmp_path, env=plugin_env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"shaky = tfkv_plugin_example.shaky:Store ([tfkv.stores] of package {PACKAGE}), which fails to " \
           "import" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_tfkv_run_trains_a_plugin_data_set_with_a_plugin_launcher(plugin_env, tmp_path):
    """cluster=twin starts the job; its workers build the plug-in model on the plug-in data."""
    tfkv_run("kvstore=dist_sync", "cluster=twin", "cluster.num_workers=2",
             f"cluster.python={sys.executable}",  # a setting of the launcher's own schema, not every launcher's
             "cluster.greeting=greets",  # one of the plug-in's own schema: it reaches the launcher
             "model=tinynet", "dataset=blobs", "dataset.n=400", "epochs=1", cwd=tmp_path, env=plugin_env,
             timeout=300)
    run = run_dir(tmp_path)
    log = (run / "launch" / "job.log").read_text()
    assert "twin launcher: greets" in log and "tinynet: width 16" in log
    assert json.loads((run / "metrics.json").read_text())["test_accuracy"] > 0.5  # 3 well-separated blobs
