"""Model builders: the built-in zoo as conf/model `_target_` entries (output shapes, parameter
counts, argument and input-size errors, seeded determinism), and what tfkv asks of any builder
(the values it injects by parameter name, the one-line refusals)."""

import os
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from tfkv import cli, models  # noqa: E402
from tfkv.errors import ConfigError  # noqa: E402

MODEL_CONF = Path(cli.conf_dir()) / "model"
ZOO = sorted(p.stem for p in MODEL_CONF.glob("*.yaml") if p.stem != "saved")


def _cfg(name: str, **kw):
    """conf/model/<name>.yaml with `kw` overriding its arguments, as `model=<name> model.k=v` composes it."""
    return OmegaConf.merge(OmegaConf.load(MODEL_CONF / f"{name}.yaml"), kw)


def _build(node, shape, num_classes: int = 10, **provided):
    return models.build(node, input_shape=shape, num_classes=num_classes, **provided)


def _trainable(model: keras.Model) -> int:
    return sum(int(np.prod(w.shape)) for w in model.trainable_weights)


def _logits(model: keras.Model, shape: tuple[int, ...], batch: int = 2) -> np.ndarray:
    x = np.random.default_rng(0).random((batch, *shape), dtype=np.float32)
    return keras.ops.convert_to_numpy(model(x, training=False))


@pytest.mark.parametrize(
    "name, shape, kw",
    [
        ("mlp", (8, 8, 1), {"hidden": [16, 8], "dropout": 0.5}),
        ("mlp", (64,), {"hidden": [16]}),
        ("lenet", (8, 8, 1), {}),
        ("lenet", (28, 28, 1), {}),
        ("lenet", (32, 32, 3), {}),
        ("vgg11", (32, 32, 3), {"width": 8, "dropout": 0.5}),
        ("vgg11", (32, 32, 3), {"width": 8, "batch_norm": False}),
        ("resnet18", (32, 32, 3), {"width": 8}),
        ("resnet18", (8, 8, 1), {"width": 8}),
    ],
)
def test_builds_and_gives_logits(name, shape, kw):
    model = _build(_cfg(name, **kw), shape, 7)
    assert isinstance(model, keras.Model)
    out = _logits(model, shape, batch=3)
    assert out.shape == (3, 7)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()


SMALL = {"mlp": {"hidden": [16]}, "lenet": {}, "vgg11": {"width": 8}, "resnet18": {"width": 8}}


def test_the_zoo_is_ordinary_target_entries():
    assert ZOO == ["dlrm", "lenet", "lstm_lm", "mlp", "resnet18", "vgg11"]
    # lstm_lm: tests/parallel/test_model_parallel.py; dlrm (dict inputs): tests/test_ctr_dlrm.py
    for name in sorted(set(ZOO) - {"lstm_lm", "dlrm"}):
        node = _cfg(name, **SMALL[name])
        assert node._target_.startswith("tfkv.models.") and models.check(node) is not None
        assert _build(node, (32, 32, 3)).name == name


def test_resnet18_matches_published_parameter_count():
    model = _build(_cfg("resnet18"), (32, 32, 3))
    assert _trainable(model) == 11_173_962  # kuangliu/pytorch-cifar ResNet18


def test_vgg11_parameter_count():
    # kuangliu's VGG11 has 9,231,114 with a (redundant) bias on every conv before BN; ours omits
    # those 2,752 biases.
    model = _build(_cfg("vgg11"), (32, 32, 3))
    assert _trainable(model) == 9_231_114 - 2_752


def test_layer_names_are_readable():
    paths = {w.path for w in _build(_cfg("resnet18", width=8), (32, 32, 3)).weights}
    for path in ("conv1/kernel", "bn1/gamma", "stage2_block1_conv1/kernel",
                 "stage2_block1_shortcut_conv/kernel", "stage4_block2_bn2/moving_mean",
                 "fc/kernel", "fc/bias"):
        assert path in paths
    assert "stage1_block1_shortcut_conv/kernel" not in paths  # identity shortcut there
    vgg = {w.path for w in _build(_cfg("vgg11", width=8), (32, 32, 3)).weights}
    assert {"block1_conv1/kernel", "block5_bn2/beta", "fc/kernel"} <= vgg


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("vgg11", (8, 8, 1),
         "model vgg11 needs inputs of at least 32x32 (5 pooling stages); dataset gives 8x8: "
         "pick model=mlp or lenet, or a 32x32 data set"),
        ("resnet18", (4, 4, 1), None),
        ("lenet", (3, 3, 1), None),
        ("vgg11", (64,), None),
    ],
)
def test_too_small_input_is_a_one_line_config_error(name, shape, expected):
    with pytest.raises(ConfigError) as err:
        _build(_cfg(name, **SMALL[name]), shape)
    message = str(err.value)
    assert "\n" not in message
    assert f"model {name} needs" in message
    if expected is not None:
        assert message == expected


@pytest.mark.parametrize("name", ["mlp", "vgg11", "resnet18"])
def test_same_seed_gives_same_weights(name):
    def weights(seed):
        keras.utils.set_random_seed(seed)
        model = _build(_cfg(name, **SMALL[name]), (32, 32, 3))
        return [w.numpy() for w in model.weights]

    first, again, other = weights(1), weights(1), weights(2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("name, kw, message", [
    ("mlp", {"dropout": 2}, "model.dropout=2 must be at least 0 and below 1"),
    ("lenet", {"dropout": 1.5}, "model.dropout=1.5 must be at least 0 and below 1"),
    ("mlp", {"hidden": [64, 0]}, "model.hidden=[64, 0] must list layer sizes of at least 1"),
    ("vgg11", {"width": 0}, "model.width=0 must be at least 1"),
    ("resnet18", {"width": 0}, "model.width=0 must be at least 1"),
    ("lstm_lm", {"embed_dim": -1}, "model.embed_dim=-1 must be 0"),
])
def test_bad_arguments_of_the_zoo_are_one_line(name, kw, message):
    shape = (20,) if name == "lstm_lm" else (32, 32, 3)
    with pytest.raises(ConfigError) as e:
        _build(_cfg(name, **kw), shape)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- any builder: what tfkv passes it and what it refuses ------------------------------------------------

def from_spec(input_spec, num_classes, units=4):
    """A user's builder that reads the data set's description from `input_spec`."""
    inputs = keras.Input(shape=input_spec.shape, dtype=input_spec.dtype.name, name="x")
    x = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(keras.layers.Dense(units)(x)))


def with_head(input_shape, head):
    """A builder whose argument is itself a `_target_` node (built by Hydra's instantiate)."""
    inputs = keras.Input(shape=input_shape)
    return keras.Model(inputs, head(keras.layers.Flatten()(inputs)))


def two_inputs(input_shape, num_classes):
    """Dict inputs: input_shape is a dict name -> shape."""
    ins = {k: keras.Input(shape=s, name=k) for k, s in input_shape.items()}
    x = keras.layers.Concatenate()([keras.layers.Flatten()(v) for v in ins.values()])
    return keras.Model(ins, keras.layers.Dense(num_classes)(x))


def needs_depth(input_shape, depth):
    raise AssertionError("never called: depth is missing")


def not_a_model(input_shape, num_classes):
    return keras.layers.Dense(num_classes)


def test_a_builder_gets_what_it_asks_for_by_name():
    import tensorflow as tf

    spec = tf.TensorSpec((3, 2), tf.float32)
    model = _build({"_target_": "test_models.from_spec", "units": 5}, (3, 2), 6, input_spec=spec)
    assert _logits(model, (3, 2)).shape == (2, 6)
    assert [w.shape for w in model.trainable_weights][:1] == [(6, 5)]  # units=5 reached it
    head = {"_target_": "keras.layers.Dense", "units": 3, "name": "head"}
    model = _build({"_target_": "test_models.with_head", "head": head}, (4,))
    assert model.layers[-1].name == "head" and _logits(model, (4,)).shape == (2, 3)
    model = _build({"_target_": "test_models.two_inputs"}, {"a": (2,), "b": (3, 1)}, 4)
    out = model({"a": np.ones((5, 2), np.float32), "b": np.ones((5, 3, 1), np.float32)})
    assert tuple(out.shape) == (5, 4)


@pytest.mark.parametrize("node, words", [
    ({"_target_": "nopkg_tfkv_test.nets.build"}, ["model._target_='nopkg_tfkv_test.nets.build'", "cannot import"]),
    ({"_target_": "test_models.form_spec"}, ["has no 'form_spec'", "did you mean test_models.from_spec?"]),
    ({"_target_": "test_models.from_spec", "unit": 3}, ["model.unit is not an argument of test_models.from_spec",
                                                         "did you mean model.units?"]),
    ({"_target_": "test_models.needs_depth"}, ["model: test_models.needs_depth needs depth; set model.depth=..."]),
    ({"_target_": "test_models.from_spec", "num_classes": 3}, ["model.num_classes is provided by tfkv"]),
    ({"_target_": "test_models.not_a_model"}, ["model._target_=test_models.not_a_model returned a Dense, "
                                               "not a keras.Model"]),
    ({"path": "nowhere/model.keras"}, ["model.path=nowhere/model.keras: no such file"]),
    ({"path": "m.keras", "hidden": [3]}, ["model.hidden has no meaning with it"]),
])
def test_a_builder_that_does_not_fit_is_one_line(node, words):
    with pytest.raises(ConfigError) as e:
        models.check(node)  # what validation finds before anything starts
        _build(node, (4,))
    for word in words:
        assert word in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_num_classes_asked_for_but_unknown_is_one_line():
    with pytest.raises(ConfigError) as e:
        _build(_cfg("mlp"), (4,), None)
    assert "takes num_classes but the data set does not say" in str(e.value) and "\n" not in str(e.value)
    # the fix it names works: model.num_classes is tfkv's to provide (refused above), dataset.num_classes is read
    assert "dataset.num_classes=N" in str(e.value) and "model.num_classes" not in str(e.value)
