"""The shipped experiments train end to end through `tfkv-run` on tiny files written in the real
on-disk formats (MNIST IDX, CIFAR-10 python batches), split over logical devices."""

import json

import pytest
from conftest import tfkv_run
from formats import write_cifar, write_mnist


def _metrics(root):
    (path,) = root.glob("outputs/*/*/metrics.json")
    return json.loads(path.read_text())


def test_mnist_lenet_on_idx_files(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=512, n_test=64)
    tfkv_run("+experiment=mnist_lenet", f"dataset.root={tmp_path / 'mnist'}", "epochs=2",
             "devices=[cpu:0,cpu:1]", "work_load_list=[3,1]", cwd=tmp_path)
    m = _metrics(tmp_path)
    assert m["epoch"] == 2 and [h["samples"] for h in m["history"]] == [512, 512]


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["cifar_vgg11", "cifar_resnet18"])
def test_cifar_experiments_on_python_batches(tmp_path, experiment):
    write_cifar(tmp_path / "cifar", n=32)  # 5 x 32 training images, 32 test images
    tfkv_run(f"+experiment={experiment}", f"dataset.root={tmp_path / 'cifar'}", "epochs=1",
             "batch_size=32", "devices=[cpu:0,cpu:1]", "kvstore=device", "model.width=16", cwd=tmp_path)
    m = _metrics(tmp_path)
    assert m["epoch"] == 1 and m["history"][0]["samples"] == 160
    assert m["train_loss"] > 0
