"""The config tree composes for every experiment and the schema and validation reject mistakes
with one line, without TensorFlow."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf.errors import ConfigAttributeError, ValidationError

from conftest import REPO, tfkv_run
from tfkv import check, cli, config
from tfkv.errors import ConfigError

CONF = cli.conf_dir()
EXPERIMENTS = sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml"))


def _compose(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_all_groups_and_experiments_exist():
    for group, names in {"model": ["mlp", "lenet", "vgg11", "resnet18"],
                         "dataset": ["digits", "mnist", "cifar10", "synthetic"],
                         "optimizer": ["sgd", "adam"], "kvstore": ["local", "device"]}.items():
        assert {p.stem for p in (Path(CONF) / group).glob("*.yaml")} >= set(names), group
    assert {"digits_mlp", "mnist_lenet", "cifar_vgg11", "cifar_resnet18"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment):
    cfg = _compose(f"+experiment={experiment}")
    check.validate(cfg)
    model = experiment.replace("cifar_", "").replace("mnist_", "").replace("digits_", "")
    model = {"lstm_ptb": "lstm_lm", "ctr_dlrm": "dlrm"}.get(experiment, model)
    assert cfg.model._target_ == _compose(f"model={model}").model._target_


def test_defaults_are_the_embedded_job():
    cfg = _compose()
    check.validate(cfg)
    assert (cfg.model._target_, cfg.dataset._target_, cfg.kvstore.type, list(cfg.devices)) == (
        "tfkv.models.mlp.build", "tfkv.data.digits.load", "local", ["cpu:0"])
    assert (cfg.optimizer.name, cfg.cluster.launcher) == ("sgd", "none")


def test_schema_rejects_typos_and_wrong_types():
    with pytest.raises(Exception) as e:
        _compose("model.hiden=[3]")
    assert isinstance(e.value.__cause__, ConfigAttributeError)
    with pytest.raises(Exception) as e:
        _compose("epochs=many")
    assert isinstance(e.value.__cause__, ValidationError)


@pytest.mark.parametrize("overrides,message", [
    (["kvstore.type=dist_nope"], "kvstore.type='dist_nope' is not known"),
    (["model._target_=tfkv.models.alexnet.build"],
     "model._target_='tfkv.models.alexnet.build': cannot import 'tfkv.models.alexnet'"),
    (["model._target_=tfkv.models.mlp.biuld"],
     "module 'tfkv.models.mlp' has no 'biuld' (did you mean tfkv.models.mlp.build?)"),
    (["model._target_=tfkv.models.PROVIDED"], "is a tuple, not a callable"),
    (["model._target_=nopkg_tfkv_test.nets.build"], "cannot import 'nopkg_tfkv_test.nets'"),
    (["dataset._target_=nopkg_tfkv_test.data.make"], "dataset._target_='nopkg_tfkv_test.data.make': cannot import"),
    (["+model.num_classes=3"], "model.num_classes is provided by tfkv"),
    (["+dataset.split=train"], "dataset.split is provided by tfkv"),
    (["+dataset.test_frac=0.5"], "dataset.test_frac is not an argument of tfkv.data.digits.load; "
                                 "did you mean dataset.test_fraction?"),
    (["optimizer.name=rmsprop"], "optimizer.name='rmsprop' is not known"),
    (["devices=[tpu:0]"], "'tpu:0' is not a device"),
    (["devices=[cpu:0,cpu:0]"], "names a device twice"),
    (["devices=[]"], "devices is empty"),
    (["work_load_list=[3,1]"], "2 entries for 1 devices"),
    (["devices=[cpu:0,cpu:1]", "work_load_list=[1,-1]"], "positive weights"),
    (["devices=[cpu:0,cpu:1]", "work_load_list=[100,1]", "batch_size=8"], "[8, 0] examples per device"),
    (["epochs=0"], "epochs=0 must be at least 1"),
    (["seed=4294967296"], "seed=4294967296 must be between 0 and 4294967295"),
    (["+model.hiden=[3]"], "model.hiden is not an argument of tfkv.models.mlp.build; did you mean model.hidden?"),
    # a key the chosen option does not have (another option's, or a typo added with +)
    (["optimizer=adam", "+optimizer.momentum=0.9"],
     "optimizer.momentum is not a setting of optimizer=adam; its settings: beta1, beta2, clip_gradient, clipnorm, "
     "epsilon, lr"),
    (["+optimizer.lrr=0.5"], "optimizer.lrr is not a setting of optimizer=sgd (did you mean optimizer.lr?); "
                             "its settings: clip_gradient, clipnorm, lr, momentum"),
    (["model=mlp", "+model.width=8"], "model.width is not an argument of tfkv.models.mlp.build; "
                                      "its arguments: dropout, hidden"),
    (["+cluster.num_servers=4"], "cluster.num_servers is not a setting of cluster=none; its settings: launcher"),
    (["kvstore=dist_sync", "cluster=local", "+cluster.hostfile=hosts"],
     "cluster.hostfile is not a setting of cluster=local"),
    (["+epoch=3"], "epoch is not a setting tfkv knows (did you mean epochs?)"),
    (["optimizer.schedule.name=linear"], "optimizer.schedule.name='linear' is not known"),
    (["kvstore.compression.type=1bit"], "kvstore.compression.type='1bit' is not known; choose one of none, "
                                        "2bit_mxnet, 2bit"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit", "optimizer=adam"],
     "kvstore.compression.type=2bit applies SGD's momentum on the workers before quantising; optimizer=adam has "
     "none: use optimizer=sgd, or kvstore.compression.type=2bit_mxnet (MXNet's 2-bit)"),
    (["kvstore=device", "kvstore.compression.type=2bit", "kvstore.update_on_kvstore=false"],
     "kvstore.update_on_kvstore=false updates on the devices: set kvstore.update_on_kvstore=true, or "
     "kvstore.compression.type=2bit_mxnet"),
    (["kvstore.compression.type=2bit_mxnet"], "kvstore=local sends neither"),
    # refused at the edge, whatever the store type, not once a job has formed or at step 1
    (["kvstore.row_sharding=modulo"], "kvstore.row_sharding='modulo' is not a row sharding tfkv knows; choose one "
                                      "of range, hash"),
    (["kvstore=device", "kvstore.row_sharding=modulo"], "kvstore.row_sharding='modulo' is not a row sharding"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.row_sharding=Hash"], "kvstore.row_sharding='Hash' is not"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.reduction_nthreads=-2"], "kvstore.reduction_nthreads=-2 is not a "
     "count of threads: set it to 0 (a server uses one thread per CPU it may use)"),
    (["kvstore=device", "kvstore.row_sparse=true", "kvstore.compression.type=2bit_mxnet"],
     "kvstore.compression.type=2bit_mxnet compresses dense gradients, but kvstore.row_sparse=true makes every "
     "Embedding a row-sparse key, whose rows are pushed uncompressed"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.row_sparse=true", "kvstore.compression.type=2bit",
      "optimizer=sgd"], "kvstore.row_sparse=true makes every Embedding a row-sparse key"),
    (["model=lstm_lm", "dataset=ptb", "devices=[cpu:0,cpu:1]", "placement=auto", "kvstore.row_sparse=true"],
     "kvstore.row_sparse=true trains with data parallelism; with placement (model parallelism) the embeddings "
     "train dense"),
    (["kvstore.compression.type=2bit"], "kvstore=local sends neither: use kvstore=device or kvstore=dist_sync"),
    (["kvstore.type=dist"], "kvstore.type='dist' is MXNet's name for dist_sync; write kvstore=dist_sync"),
    (["kvstore.type=nccl"], "kvstore.type='nccl': KVStore type 'nccl' is MXNet's, not tfkv's; use device"),
    (["optimizer.rescale_grad=0"], "optimizer.rescale_grad=0.0 must be positive"),
    (["optimizer.clip_gradient=-1"], "optimizer.clip_gradient=-1.0 must be positive"),
    (["optimizer.clipnorm=0"], "optimizer.clipnorm=0.0 must be positive"),
    (["precision=float16"], "precision='float16' is not a policy tfkv trains with; choose one of float32, "
                            "mixed_float16, mixed_bfloat16"),
    (["model=lstm_lm", "dataset=ptb", "devices=[cpu:0,cpu:1]", "placement=auto", "precision=mixed_float16"],
     "precision=mixed_float16 is data parallelism's; a model split over devices (placement) trains in float32"),
    (["model=lstm_lm", "dataset=ptb", "devices=[cpu:0,cpu:1]", "placement=auto", "jit_compile=true"],
     "jit_compile=true compiles each model copy's step"),
    (["model=lstm_lm", "dataset=ptb", "devices=[cpu:0,cpu:1]", "placement=auto", "optimizer.clipnorm=1"],
     "optimizer.clipnorm clips each model copy's gradient (data parallelism)"),
    (["optimizer.momentum=-1"], "sgd.momentum=-1.0 must be at least 0"),
    # training needs a positive rate; the store API takes any finite one (MXNet's tests use -1)
    (["optimizer.lr=-1"], "optimizer.lr=-1.0 must be positive"),
    (["optimizer.lr=nan"], "schedule.lr=nan must be a finite number"),
    (["optimizer=adam", "optimizer.beta1=1"], "adam.beta1=1.0 must be from 0 to below 1"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit", "kvstore.compression.threshold=0"],
     "threshold=0.0 must be positive"),
    # two-way compression: a type to compress with, servers to reply, a positive threshold of replies
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.both_ways=true"],
     "kvstore.compression.type=none compresses nothing: choose a type (2bit_mxnet, 2bit) or set both_ways=false"),
    (["kvstore=device", "devices=[cpu:0,cpu:1]", "kvstore.compression.type=2bit", "kvstore.compression.both_ways=true"],
     "kvstore=device has no servers: use kvstore=dist_sync (or dist_async, dist_sync_device, dist_async_device)"),
    (["kvstore.compression.type=2bit", "kvstore.compression.both_ways=true"], "kvstore=local has no servers"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit", "kvstore.compression.both_ways=true",
      "kvstore.compression.pull_threshold=-1"], "kvstore.compression.pull_threshold=-1.0 must be positive"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit", "kvstore.compression.pull_threshold=0.1"],
     "only both_ways=true compresses"),
])
def test_validation_gives_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        check.validate(_compose(*overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_row_sharding_from_the_environment_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("TFKV_ROW_SHARDING", "modulo")  # the environment wins over the config: checked too
    with pytest.raises(ConfigError, match="^TFKV_ROW_SHARDING='modulo' is not a row sharding tfkv knows"):
        check.validate(_compose())


def test_server_threads_from_the_environment_are_checked_naming_the_variable(monkeypatch):
    monkeypatch.setenv("MXNET_KVSTORE_REDUCTION_NTHREADS", "-1")
    with pytest.raises(ConfigError, match="^MXNET_KVSTORE_REDUCTION_NTHREADS=-1 is not a count of threads"):
        check.validate(_compose())
    monkeypatch.setenv("MXNET_KVSTORE_REDUCTION_NTHREADS", "many")
    with pytest.raises(ConfigError, match="^MXNET_KVSTORE_REDUCTION_NTHREADS='many' is not an int"):
        check.validate(_compose())


def test_options_are_typed_with_their_own_defaults():
    """Each option's node is its own schema's: adam has betas and no momentum, ssh a sync_dst_dir."""
    cfg = _compose("optimizer=adam")
    check.validate(cfg)
    assert (cfg.optimizer.beta1, cfg.optimizer.epsilon, "momentum" in cfg.optimizer) == (0.9, 1e-8, False)
    cfg = _compose("kvstore=dist_sync", "cluster=ssh", "cluster.sync_dst_dir=/tmp/x")
    check.validate(cfg)
    assert (cfg.cluster.sync_dst_dir, cfg.cluster.python, cfg.cluster.heartbeat_timeout > 0) == (
        "/tmp/x", "python3", True)
    cfg = _compose()
    check.validate(cfg)
    assert set(cfg.cluster) == {"launcher"}


def test_compression_validates_for_dist_types():
    check.validate(_compose("kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit",
                             "kvstore.compression.threshold=0.25"))
    check.validate(_compose("kvstore=device", "kvstore.compression.type=2bit"))  # between devices, as MXNet
    for kind in ("dist_async", "dist_sync_device", "dist_async_device"):
        check.validate(_compose(f"kvstore={kind}", "cluster=local", "kvstore.compression.type=2bit"))
    # MXNet's exact 2-bit takes any optimizer, also where the devices update
    check.validate(_compose("kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit_mxnet",
                             "optimizer=adam"))
    check.validate(_compose("kvstore=device", "kvstore.compression.type=2bit_mxnet", "kvstore.update_on_kvstore=false"))


def test_mxnet_spellings_of_kvstore_types_compose():
    for name, kind in (("dist", "dist_sync"), ("dist_device_sync", "dist_sync_device"),
                       ("dist_device_async", "dist_async_device")):
        cfg = _compose(f"kvstore={name}", "cluster=local")
        assert cfg.kvstore.type == kind
        check.validate(cfg)


def test_validation_leaves_tensorflow_unstarted():
    """Validation imports what the config names (model and loss `_target_`s may import Keras), but
    never starts TensorFlow: the trainer splits the CPU into logical devices after it. A mistake in
    tfkv's own keys is found before anything imports TensorFlow at all."""
    code = ("import sys; from tfkv import check, cli; from tfkv.errors import ConfigError\n"
            "from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={CONF!r}, version_base='1.3'):\n"
            "    for bad in ('+epoch=3', '+optimizer.lrr=0.5', '+cluster.num_servers=4'):\n"
            "        try:\n"
            "            check.validate(compose('config', overrides=[bad]))\n"
            "        except ConfigError:\n"
            "            pass\n"
            "        else:\n"
            "            raise AssertionError(bad + ' was accepted')\n"
            "    assert 'tensorflow' not in sys.modules, 'a key mistake imported TensorFlow'\n"
            "    check.validate(compose('config', overrides=['+experiment=cifar_resnet18']))\n"
            "from tfkv.parallel import devices; import tensorflow as tf\n"
            "devices.setup(['cpu:0'])\n"
            "assert len(tf.config.list_logical_devices('CPU')) == 8, 'validation started TensorFlow'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)


PACKAGE = Path(config.__file__).resolve().parent
TFKV = PACKAGE.parent  # (which layers config may import: tests/test_layers.py, the import contracts)


def test_config_is_small_modules_with_one_job_each():
    files = sorted(PACKAGE.glob("*.py")) + sorted((TFKV / "check").glob("*.py")) + [TFKV / "knobs.py"]
    assert {f.stem for f in files} >= {"schema", "cluster", "device_specs", "tree", "rules", "knobs"}
    for f in files:
        assert len(f.read_text().splitlines()) <= 400, f"{f.relative_to(TFKV.parent)} is over 400 lines"


def test_cluster_options_are_defined_once():
    """The structured config's cluster settings are the job's options and tfkv-launch's flags:
    same names, defaults and help, so a setting added to the schema is a flag at once."""
    import dataclasses

    from tfkv.launcher import cli as launch_cli, job

    from tfkv.launcher import base

    fields = {f.name: f for schema in base.schemas().values() for f in dataclasses.fields(schema)}
    assert {f.name: f.default for f in dataclasses.fields(job.Options)} == {n: f.default for n, f in fields.items()}
    actions = {a.dest: a for a in launch_cli.parser()._actions}
    for name, f in fields.items():
        assert actions[name].help.startswith(f.metadata["help"]), name
    # every spelling users have, and the settings the config had and tfkv-launch lacked
    args = launch_cli.parser().parse_args([
        "-n", "3", "-s", "2", "-H", "hosts", "--launcher", "local", "--sync-dst-dir", "/d", "--interface", "lo",
        "--port", "5", "--python", "py", "--heartbeat-timeout", "2.5", "--verbose", "1", "--run-dir", "r",
        "--host", "10.0.0.1", "--no-secure", "--", "cmd"])
    assert (args.num_workers, args.num_servers, args.hostfile, args.launcher, args.sync_dst_dir, args.interface,
            args.port, args.python, args.heartbeat_timeout, args.verbose, args.run_dir, args.host, args.secure,
            args.command) == (3, 2, "hosts", "local", "/d", "lo", 5, "py", 2.5, 1, "r", "10.0.0.1", False, ["--", "cmd"])
    plain = launch_cli.parser().parse_args(["-n", "2", "--", "cmd"])  # tfkv-launch's own defaults stay
    assert (plain.launcher, plain.num_servers, plain.secure, plain.port) == ("ssh", None, True, 0)
    assert job.Options("ssh", 3, 2, "hosts", "/d").sync_dst_dir == "/d"  # positional, as callers write it


# Variables that wire a process into its job (which role, where the scheduler is, the job's keys,
# run directory and config): set by the launcher per role, never a knob.
WIRING = {"TFKV_ROLE", "TFKV_RANK_HINT", "TFKV_RUN_DIR", "TFKV_CONFIG", "TFKV_SCHEDULER_HOST", "TFKV_SCHEDULER_PORT",
          "TFKV_NUM_SERVER", "TFKV_NUM_WORKER", "TFKV_CURVE_PUBLIC", "TFKV_CURVE_SECRET", "TFKV_CURVE_KEYFILE",
          "TFKV_SECURE", "TFKV_SECRETS_ON_STDIN", "TFKV_ADVERTISE_ADDRESS", "TFKV_LOCAL_RANK", "TFKV_LOCAL_SIZE"}


def test_every_backend_knob_has_one_row_and_one_reader():
    """Every MXNET_*/PS_*/TFKV_* name in tfkv's code is a knob of tfkv.knobs or process wiring,
    and no code reads a knob's variable but through knobs.get (no environ.get, env[...], ...)."""
    import ast
    import re

    from tfkv import knobs

    def name(node):
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str)
        return node.value if ok and re.fullmatch(r"(MXNET|PS|TFKV)_[A-Z0-9_]+", node.value) else None

    named, reads = set(), []
    for f in TFKV.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            named.add(name(node))
            if f.name == "knobs.py":
                continue
            if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                                   and getattr(node.func.value, "id", "") == "knobs"):
                reads += [(f.name, name(a)) for a in node.args if name(a) in knobs.BY_NAME]
            if isinstance(node, ast.Subscript) and name(node.slice) in knobs.BY_NAME:
                reads.append((f.name, name(node.slice)))
    assert not sorted(named - {None} - WIRING - set(knobs.BY_NAME)), "not a knob of tfkv.knobs"
    assert not reads, "knob variables read outside knobs.get"
    # and every variable a knob reads is one users can know of: no alias nobody documents
    page = (REPO / "docs" / "reference" / "knobs.md").read_text()  # the repository's: CI installs tfkv into site-packages
    assert not sorted(n for n in knobs.BY_NAME if n not in page), "knob variables the knobs page does not name"


def test_knobs_are_config_keys_the_environment_overrides():
    from tfkv import knobs

    from tfkv.launcher import base

    schemas = {"kvstore": config.KVStoreConfig, "cluster": base.schemas()}
    for k in knobs.KNOBS:
        group, setting = k.key.split(".", 1)
        found = ([schemas[group]] if group == "kvstore" else list(schemas[group].values()))
        defaults = {f.default for s in found for f in dataclasses.fields(s) if f.name == setting}
        assert defaults == {k.default}, k.key
    cfg = _compose("kvstore=dist_sync", "cluster=local", "kvstore.chunk_bytes=1024", "cluster.request_timeout=7",
                   "kvstore.resend=true")
    check.validate(cfg)
    values = knobs.resolve(knobs.settings(cfg), {"TFKV_REQUEST_TIMEOUT": "9", "PS_VERBOSE": "2"})
    assert (values["kvstore.chunk_bytes"], values["cluster.request_timeout"], values["cluster.verbose"],
            values["kvstore.resend"], values["kvstore.bigarray_bound"]) == (1024, 9.0, 2, True, 1_000_000)
    env = knobs.environment(values)
    assert (env["TFKV_CHUNK_BYTES"], env["PS_RESEND"], env["PS_VERBOSE"]) == ("1024", "1", "2")
    assert "TFKV_SSH_CONFIG" not in env  # a launcher's knob stays with the launcher
    assert knobs.get("TFKV_CHUNK_BYTES", env) == 1024 and knobs.get("kvstore.chunk_bytes", {}) == 16 << 20
    with pytest.raises(ValueError, match="MXNET_KVSTORE_BIGARRAY_BOUND='x' is not an int"):
        knobs.get("TFKV_BIGARRAY_BOUND", {"MXNET_KVSTORE_BIGARRAY_BOUND": "x"})
    with pytest.raises(ValueError, match="TFKV_BIGARRAY_BOUND='x' is not an int"):  # the variable the user set
        knobs.get("kvstore.bigarray_bound", {"TFKV_BIGARRAY_BOUND": "x"})


def test_a_job_hands_its_knobs_to_every_role(tmp_path, monkeypatch):
    """A job option (tfkv-launch's flag, the config's key) sets a knob, the launching shell's
    variable overrides one; every role's environment has both, the launcher's own knobs stay
    here. (tests/launcher/test_cluster_run.py: recorded in the run directory's knobs.json.)"""
    from tfkv import knobs
    from tfkv.launcher import job

    monkeypatch.setenv("PS_RESEND", "1")
    monkeypatch.setenv("TFKV_SSH_CONFIG", str(tmp_path))
    j = job.plan_job(job.Options("local", 1, 1, secure=False, request_timeout=7.0, srun_args="-p x"), ["true"],
                     tmp_path, tmp_path / "run")
    assert len(j.plan) == 3
    for p in j.plan:
        assert (p.env["TFKV_REQUEST_TIMEOUT"], p.env["PS_RESEND"], p.env["TFKV_HEARTBEAT_TIMEOUT"]) == ("7.0", "1", "4.0")
        assert "TFKV_SRUN_ARGS" not in p.env and "TFKV_SSH_CONFIG" not in p.env
    launcher = job.knob_values(job.Options("local", 1, 1, srun_args="-p x"))  # what the launcher itself reads
    assert (launcher["cluster.srun_args"], launcher["cluster.ssh_config"]) == ("-p x", str(tmp_path))
    # the launcher's own knobs go to the backend that has them, as its settings
    assert job.backend(job.Options("slurm", 1, 1, srun_args="-p x")).settings.srun_args == "-p x"
    assert job.backend(job.Options("ssh", 1, 1)).settings.ssh_config == str(tmp_path)
    recorded = json.loads(knobs.record(tmp_path, job.knob_values(job.Options("local", 1, 1))).read_text())
    assert recorded["kvstore.resend"] == {"env": "PS_RESEND", "value": True}


def test_a_run_passes_its_knobs_to_its_store_and_cluster_env_and_leaves_the_environment_alone(monkeypatch):
    """tfkv-run and tfkv.worker resolve the knobs once (the shell's variable wins over the config)
    and pass the values down: the store the trainer makes (tfkv.trainer.parts.store) and its
    ClusterEnv take them, and this process's environment stays as it was. Given no values (an
    MXNet-style script that sets the variables itself), both read the environment; a plug-in
    store whose constructor takes no `knobs` is made without them and reads it too."""
    from tfkv import knobs, store
    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.store.local import LocalStore
    from tfkv.trainer import parts

    for k in knobs.KNOBS:
        for name in k.names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TFKV_CHUNK_BYTES", "1024")  # the shell's wins over the config's
    before = dict(os.environ)
    values = knobs.resolve({"kvstore.gpu_p2p": False, "kvstore.chunk_bytes": 64, "cluster.heartbeat_timeout": 9.0},
                           os.environ)
    wiring = {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
              "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "TFKV_CHUNK_BYTES": "1024"}
    given = ClusterEnv.from_env(wiring, knobs=values)
    assert (given.chunk_bytes, given.heartbeat_timeout) == (1024, 9.0)
    plain = ClusterEnv.from_env({**wiring, "TFKV_HEARTBEAT_TIMEOUT": "3"})  # MXNet-style: the variables
    assert (plain.chunk_bytes, plain.heartbeat_timeout) == (1024, 3.0)
    cfg = _compose("kvstore=device", "kvstore.gpu_p2p=false")
    assert not parts.store(cfg, ["/cpu:0"], values)._sum_on_home  # the config's value reached the store
    assert parts.store(cfg, ["/cpu:0"])._sum_on_home  # no values: the environment's (unset: the default)
    monkeypatch.setenv("MXNET_ENABLE_GPU_P2P", "0")
    assert not store.create("device", devices=["/cpu:0"])._sum_on_home
    monkeypatch.delenv("MXNET_ENABLE_GPU_P2P")

    class Documented(LocalStore):  # docs/development/extending.md's shape: devices alone
        def __init__(self, devices=None):
            super().__init__(devices)

    store.register("knobless", f"{__name__}:Documented")
    globals()["Documented"] = Documented
    try:
        plugged = _compose("kvstore=local")
        plugged.kvstore.type = "knobless"
        made = parts.store(plugged, ["/cpu:0"], values)
        assert type(made).__name__ == "Documented" and made._sum_on_home  # made without them: the environment's
    finally:
        store.REGISTRY.unregister("knobless")
        del globals()["Documented"]
    assert dict(os.environ) == before


# A model factory of the user's that writes what its worker's ClusterEnv says; and tfkv-run, in a
# process that logs every opening of a knobs.json or config_resolved.yaml for writing.
KNOBBY = """
import json, os
import keras
from tfkv.ps.cluster_env import ClusterEnv


def build(input_shape, num_classes):
    env = ClusterEnv.from_env()
    seen = {"fusion_bytes": env.fusion_bytes, "heartbeat_timeout": env.heartbeat_timeout,
            "resend_timeout": env.resend_timeout, "request_timeout": env.request_timeout}
    with open(os.path.join(os.environ["TFKV_RUN_DIR"], "cluster_env." + os.environ["TFKV_RANK_HINT"]), "w") as f:
        json.dump(seen, f)
    inputs = keras.Input(shape=input_shape)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs)))
"""
COUNTING = """
import builtins, io, sys
log, opened = sys.argv.pop(1), io.open


def counting(file, mode="r", *args, **kwargs):
    if str(file).endswith(("knobs.json", "config_resolved.yaml")) and set(mode) & set("wax"):
        with opened(log, "a") as f:
            f.write(str(file) + "\\n")
    return opened(file, mode, *args, **kwargs)


io.open = builtins.open = counting
from tfkv.cli import run
sys.argv[0] = "tfkv-run"
run()
"""


@pytest.mark.slow
def test_a_launched_role_reads_the_knobs_its_config_sets_and_the_run_records_them_once(tmp_path):
    """kvstore.fusion_bytes and cluster.heartbeat_timeout set in the config, PS_RESEND_TIMEOUT in the
    shell: every launched worker's ClusterEnv has them (from the environment its launcher filled),
    and the run's knobs.json and config_resolved.yaml are written once each, by the launcher."""
    (tmp_path / "knobby.py").write_text(KNOBBY)
    (tmp_path / "counting.py").write_text(COUNTING)
    log = tmp_path / "knobs-writes.log"
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "counting.py"), str(log), "kvstore=dist_sync", "cluster=local",
         "cluster.num_workers=2", "cluster.num_servers=1", "epochs=1", "steps_per_epoch=2", "progress=false",
         "model._target_=knobby.build", "~model.hidden", "~model.dropout", "kvstore.fusion_bytes=4096",
         "cluster.heartbeat_timeout=6"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400, env={**os.environ, "PS_RESEND_TIMEOUT": "500"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (run,) = {p.parent for p in tmp_path.glob("outputs/*/*/metrics.json")}
    for rank in (0, 1):
        seen = json.loads((run / f"cluster_env.{rank}").read_text())
        assert seen == {"fusion_bytes": 4096, "heartbeat_timeout": 6.0, "resend_timeout": 0.5, "request_timeout": 60.0}
    assert sorted(log.read_text().splitlines()) == [str(run / "config_resolved.yaml"), str(run / "knobs.json")]
    recorded = json.loads((run / "knobs.json").read_text())
    assert (recorded["kvstore.fusion_bytes"]["value"], recorded["cluster.heartbeat_timeout"]["value"],
            recorded["kvstore.resend_timeout"]["value"]) == (4096, 6.0, 500.0)


def test_a_knob_variable_of_the_wrong_type_is_one_line_before_any_process_starts(tmp_path):
    proc = tfkv_run("kvstore=dist_sync", "cluster=local", cwd=tmp_path, env={"TFKV_BIGARRAY_BOUND": "x"}, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "tfkv-run: TFKV_BIGARRAY_BOUND='x' is not an int; set it to one or unset it (kvstore.bigarray_bound in the config)"]


# Keras metrics that need arguments to be built, with some.
KERAS_METRIC_ARGS = {"PrecisionAtRecall": (0.5,), "RecallAtPrecision": (0.5,), "SensitivityAtSpecificity": (0.5,),
                     "SpecificityAtSensitivity": (0.5,), "IoU": (2, [0]), "MeanIoU": (2,), "OneHotIoU": (2, [0]),
                     "OneHotMeanIoU": (2,)}


def test_direction_follows_the_objective_as_keras_s_own_metrics_declare_it():
    """The oracle is Keras: every metric class it ships says which way it is better (what its
    callbacks' mode="auto" follows); tfkv's direction of test_<its name> must be the same."""
    import inspect

    import keras

    from tfkv.config import objective

    checked = 0
    for name, cls in vars(keras.metrics).items():
        if not (inspect.isclass(cls) and issubclass(cls, keras.metrics.Metric)) or name == "MeanMetricWrapper":
            continue
        metric = cls(*KERAS_METRIC_ARGS.get(name, ()))
        way = {"up": "maximize", "down": "minimize"}.get(getattr(metric, "_direction", None))
        if way is not None:
            assert objective.better(f"test_{metric.name}") == way, (name, metric.name)
            checked += 1
    assert checked >= 30  # Keras declares a direction for most of its metrics
    for name, way in {"test_loss": "minimize", "train_loss": "minimize", "test_mae": "minimize",
                      "test_mse": "minimize", "test_acc": "maximize", "test_perplexity": "minimize",
                      "test_fmeasure": "maximize", "samples_per_sec": "maximize"}.items():
        assert objective.better(name) == way, name
    # one output's values (<output>_loss, <output>_<metric>, tfkv.parallel.criterion) whose output
    # name holds "r2", "f1", "acc", "auc" or "iou" as letters of a word, not as a word of the name
    for name, way in {"test_decoder2_loss": "minimize", "test_tower2_loss": "minimize", "test_conf1_loss": "minimize",
                      "test_previous_loss": "minimize", "test_header2_mae": "minimize", "test_caucus_mse": "minimize",
                      "test_decoder2_accuracy": "maximize", "test_mean_io_u": "maximize"}.items():
        assert objective.better(name) == way, name


def test_a_run_that_names_no_objective_returns_what_it_reports():
    """Not a sweep: no objective needed. Its default is test_accuracy where the run reports it,
    else test_loss; direction (auto) follows it, and a user's own direction stays."""
    cfg = _compose("loss=mse", "metrics=[mae]")
    check.validate(cfg)
    assert (cfg.objective, cfg.direction) == ("test_loss", "minimize")
    cfg = _compose()
    check.validate(cfg)
    assert (cfg.objective, cfg.direction) == ("test_accuracy", "maximize")
    cfg = _compose("objective=test_loss")
    check.validate(cfg)
    assert cfg.direction == "minimize"
    cfg = _compose("loss=mse", "metrics=[mae]", "objective=test_mae", "direction=maximize")
    check.validate(cfg)
    assert (cfg.objective, cfg.direction) == ("test_mae", "maximize")
    with pytest.raises(ConfigError, match="direction='up' is not a direction"):
        check.validate(_compose("direction=up"))


# The writes into a process's own environment that tfkv makes, each a start-up setting or a
# launched role's environment (docs/development/architecture.md lists them): file -> variables.
ENVIRON_WRITES = {
    "cli.py": {"TF_CPP_MIN_LOG_LEVEL", "HYDRA_FULL_ERROR"},  # before TensorFlow; Hydra's errors to tfkv-run's handler
    "worker.py": {"TFKV_CONFIG", "hydra.job.env_set", "TF_CPP_MIN_LOG_LEVEL"},  # taken out once read; Hydra's env_set
    "sweep/launcher.py": {"TF_CPP_MIN_LOG_LEVEL"},  # a trial's process, before TensorFlow
    "parallel/binding.py": {"CUDA_VISIBLE_DEVICES"},  # a worker's GPUs, before TensorFlow sees any
    "launcher/backends/ssh_remote.py": {"TFKV_SECRETS_ON_STDIN", "the job's keys"},  # the remote role's own
}


def test_no_value_is_passed_through_the_process_s_own_environment():
    """tfkv writes into os.environ only the start-up settings and a launched role's own variables
    (ENVIRON_WRITES); knobs and the rest are passed down as values (a store's `knobs`,
    ClusterEnv.from_env(knobs=), train(knobs=)), never put in the environment to be read back."""
    import ast

    def environ(node):
        return (isinstance(node, ast.Name) and node.id == "environ") or (
            isinstance(node, ast.Attribute) and node.attr == "environ")

    def script(text):  # a string that is Python code (ssh's WRAPPER), else None
        try:
            return ast.parse(text) if "os.environ" in text else None
        except SyntaxError:
            return None

    writes = {}
    for f in TFKV.rglob("*.py"):
        tree = ast.parse(f.read_text())
        strings = (c.value for c in ast.walk(tree) if isinstance(c, ast.Constant) and isinstance(c.value, str))
        trees = [tree, *filter(None, map(script, strings))]
        for node in (n for tree in trees for n in ast.walk(tree)):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if call and (node.func.attr in ("update", "setdefault", "pop", "clear", "popitem") and environ(node.func.value)
                         or node.func.attr in ("putenv", "unsetenv")):
                writes.setdefault(str(f.relative_to(TFKV)), []).append(ast.unparse(node)[:60])
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) and environ(node.value):
                writes.setdefault(str(f.relative_to(TFKV)), []).append(ast.unparse(node)[:60])
    assert set(writes) == set(ENVIRON_WRITES), writes
    assert sum(map(len, writes.values())) == 9, writes  # one each, as listed
