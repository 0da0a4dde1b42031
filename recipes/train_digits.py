"""Train an MLP on the embedded digits over several devices with the Python API, no Hydra.

The same pieces `tfkv-run` uses: a KVStore, the data set's factory and the model's builder
named as in conf/ (`_target_` nodes), the data sharded by the store's rank (tfkv.data.Source),
and DataParallel splitting each batch across devices. Run:

    python recipes/train_digits.py --devices 4 --kvstore device
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import tfkv.data  # noqa: E402
import tfkv.models  # noqa: E402
import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.config import split_batch  # noqa: E402
from tfkv.parallel import devices as tfkv_devices  # noqa: E402
from tfkv.parallel.data_parallel import DataParallel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2, help="logical CPU devices (or GPUs with --gpu)")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--kvstore", default="local")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    kind = "gpu" if args.gpu else "cpu"
    devs = tfkv_devices.setup([f"{kind}:{i}" for i in range(args.devices)])
    keras.utils.set_random_seed(0)
    store = tfkv.store.create(args.kvstore, devices=devs)
    print(f"Total number of workers: {store.num_workers}; this worker's rank: {store.rank}")

    # conf/dataset/digits.yaml and conf/model/mlp.yaml, as plain dicts
    digits = tfkv.data.Source({"_target_": "tfkv.data.digits.load", "test_fraction": 0.2}, seed=0,
                              batch_size=args.batch_size, eval_batch_size=500,
                              num_workers=store.num_workers, rank=store.rank)
    mlp = {"_target_": "tfkv.models.mlp.build", "hidden": [256, 128]}
    sgd = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-4)
    net = DataParallel(lambda: tfkv.models.build(mlp, input_shape=digits.input_shape, num_classes=digits.num_classes),
                       devs, store, sgd, split_batch(args.batch_size, None, len(devs)))
    for epoch in range(1, args.epochs + 1):
        # Each worker reads only its part of the data (SplitSampler), reshuffled every epoch.
        for x, y in digits.train(epoch):
            net.step(x, y)
        train, _ = net.take_metrics()
        test = net.evaluate(digits.test())
        print(f"Epoch {epoch}: loss {train['loss']:.4f} train_acc {train['accuracy']:.4f} "
              f"Test_acc {test['accuracy']:.4f} ({digits.steps} steps)")


if __name__ == "__main__":
    main()
