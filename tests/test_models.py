"""Model builders: output shapes, parameter counts, input-size errors, seeded determinism."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tfkv import models  # noqa: E402
from tfkv.config import ModelConfig  # noqa: E402
from tfkv.errors import ConfigError  # noqa: E402


def _cfg(name: str, **kw) -> ModelConfig:
    return ModelConfig(name=name, **kw)


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
    model = models.build(_cfg(name, **kw), shape, 7)
    assert isinstance(model, keras.Model)
    out = _logits(model, shape, batch=3)
    assert out.shape == (3, 7)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()


def test_build_dispatches_by_name():
    assert models.names() == ["lenet", "lstm_lm", "mlp", "resnet18", "vgg11"]
    for name in sorted(set(models.names()) - models.SEQUENCE):  # lstm_lm: tests/test_model_parallel.py
        assert models.build(_cfg(name, width=8), (32, 32, 3), 10).name == name


def test_resnet18_matches_published_parameter_count():
    model = models.build(_cfg("resnet18"), (32, 32, 3), 10)
    assert _trainable(model) == 11_173_962  # kuangliu/pytorch-cifar ResNet18


def test_vgg11_parameter_count():
    # kuangliu's VGG11 has 9,231,114 with a (redundant) bias on every conv before BN; ours omits
    # those 2,752 biases.
    model = models.build(_cfg("vgg11"), (32, 32, 3), 10)
    assert _trainable(model) == 9_231_114 - 2_752


def test_layer_names_are_readable():
    paths = {w.path for w in models.build(_cfg("resnet18", width=8), (32, 32, 3), 10).weights}
    for path in ("conv1/kernel", "bn1/gamma", "stage2_block1_conv1/kernel",
                 "stage2_block1_shortcut_conv/kernel", "stage4_block2_bn2/moving_mean",
                 "fc/kernel", "fc/bias"):
        assert path in paths
    assert "stage1_block1_shortcut_conv/kernel" not in paths  # identity shortcut there
    vgg = {w.path for w in models.build(_cfg("vgg11", width=8), (32, 32, 3), 10).weights}
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
        models.build(_cfg(name, width=8), shape, 10)
    message = str(err.value)
    assert "\n" not in message
    assert f"model {name} needs" in message
    if expected is not None:
        assert message == expected


@pytest.mark.parametrize("name", ["mlp", "vgg11", "resnet18"])
def test_same_seed_gives_same_weights(name):
    def weights(seed):
        keras.utils.set_random_seed(seed)
        model = models.build(_cfg(name, width=8, hidden=[16]), (32, 32, 3), 10)
        return [w.numpy() for w in model.weights]

    first, again, other = weights(1), weights(1), weights(2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
