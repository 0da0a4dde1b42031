"""The config tree composes for every experiment and the schema and validation reject mistakes
with one line, without TensorFlow."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf.errors import ConfigAttributeError, ValidationError

from tfkv import cli, config
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
    config.validate(cfg)
    model = experiment.replace("cifar_", "").replace("mnist_", "").replace("digits_", "")
    assert cfg.model.name in {"lstm_ptb": "lstm_lm"}.get(experiment, model)


def test_defaults_are_the_embedded_job():
    cfg = _compose()
    config.validate(cfg)
    assert (cfg.model.name, cfg.dataset.name, cfg.kvstore.type, list(cfg.devices)) == ("mlp", "digits", "local", ["cpu:0"])


def test_schema_rejects_typos_and_wrong_types():
    with pytest.raises(Exception) as e:
        _compose("model.hiden=[3]")
    assert isinstance(e.value.__cause__, ConfigAttributeError)
    with pytest.raises(Exception) as e:
        _compose("epochs=many")
    assert isinstance(e.value.__cause__, ValidationError)


@pytest.mark.parametrize("overrides,message", [
    (["kvstore.type=dist_nope"], "kvstore.type='dist_nope' is not known"),
    (["model.name=alexnet"], "model.name='alexnet' is not known"),
    (["devices=[tpu:0]"], "'tpu:0' is not a device"),
    (["devices=[cpu:0,cpu:0]"], "names a device twice"),
    (["devices=[]"], "devices is empty"),
    (["work_load_list=[3,1]"], "2 entries for 1 devices"),
    (["devices=[cpu:0,cpu:1]", "work_load_list=[1,-1]"], "positive weights"),
    (["devices=[cpu:0,cpu:1]", "work_load_list=[100,1]", "batch_size=8"], "[8, 0] examples per device"),
    (["epochs=0"], "epochs=0 must be at least 1"),
    (["seed=4294967296"], "seed=4294967296 must be between 0 and 4294967295"),
    (["model.dropout=2"], "model.dropout=2.0 must be at least 0 and below 1"),
    (["model.hidden=[64,0]"], "model.hidden=[64, 0] must list layer sizes of at least 1"),
    (["model.width=0"], "model.width=0 must be at least 1"),
    (["+experiment=lstm_ptb", "model.embed_dim=-1"], "model.embed_dim=-1 must be 0"),
    (["+model.hiden=[3]"], "model.hiden is not a setting tfkv knows (did you mean model.hidden?)"),
    (["optimizer.schedule.name=linear"], "optimizer.schedule.name='linear' is not known"),
    (["kvstore.compression.type=1bit"], "kvstore.compression.type='1bit' is not known"),
    (["kvstore.compression.type=2bit"], "kvstore=local sends neither: use kvstore=device or kvstore=dist_sync"),
    (["kvstore.type=dist"], "kvstore.type='dist' is MXNet's name for dist_sync; write kvstore=dist_sync"),
    (["kvstore.type=nccl"], "kvstore.type='nccl': KVStore type 'nccl' is MXNet's, not tfkv's; use device"),
    (["optimizer.rescale_grad=0"], "optimizer.rescale_grad=0.0 must be positive"),
    (["optimizer.clip_gradient=-1"], "optimizer.clip_gradient=-1.0 must be positive"),
    (["optimizer.momentum=-1"], "sgd.momentum=-1.0 must be at least 0"),
    (["optimizer=adam", "optimizer.beta1=1"], "adam.beta1=1.0 must be from 0 to below 1"),
    (["kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit", "kvstore.compression.threshold=0"],
     "threshold=0.0 must be positive"),
])
def test_validation_gives_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        config.validate(_compose(*overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_compression_validates_for_dist_types():
    config.validate(_compose("kvstore=dist_sync", "cluster=local", "kvstore.compression.type=2bit",
                             "kvstore.compression.threshold=0.25"))
    config.validate(_compose("kvstore=device", "kvstore.compression.type=2bit"))  # between devices, as MXNet


def test_mxnet_spellings_of_kvstore_types_compose():
    for name, kind in (("dist", "dist_sync"), ("dist_device_sync", "dist_sync_device"),
                       ("dist_device_async", "dist_async_device")):
        cfg = _compose(f"kvstore={name}", "cluster=local")
        assert cfg.kvstore.type == kind
        config.validate(cfg)


def test_validation_does_not_import_tensorflow():
    code = ("import sys; from tfkv import cli, config; from hydra import compose, initialize_config_dir\n"
            f"with initialize_config_dir(config_dir={CONF!r}, version_base='1.3'):\n"
            "    config.validate(compose('config', overrides=['+experiment=cifar_resnet18']))\n"
            "assert 'tensorflow' not in sys.modules, 'validation imported TensorFlow'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
