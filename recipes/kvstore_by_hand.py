"""Multi-device training written out by hand against the KVStore API, as MXNet's Gluon example
does with `split_and_load`, `autograd.record` and `trainer.step`.

Every device holds a copy of a Keras model and computes gradients on its slice of the batch;
each parameter's gradients are pushed as one list (the store sums them and runs the optimizer)
and the updated weight is pulled back into every copy. Run:

    python recipes/kvstore_by_hand.py --devices 2
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfkv.data  # noqa: E402
import tfkv.data.digits  # noqa: E402
import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.parallel import devices as tfkv_devices  # noqa: E402


def make_model() -> keras.Model:
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                             keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=8)
    args = ap.parse_args()
    ctx = tfkv_devices.setup([f"cpu:{i}" for i in range(args.devices)])
    keras.utils.set_random_seed(0)

    nets = []
    for d in ctx:
        with tf.device(d):
            nets.append(make_model())
    kv = tfkv.store.create("device", devices=ctx)
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9))
    params = [net.trainable_variables for net in nets]
    for i, p in enumerate(params[0]):  # every copy starts from the first one's weights
        kv.broadcast(i, p, out=[ps[i] for ps in params])

    @tf.function
    def train_batch(x, y):
        n = x.shape[0] // len(ctx)
        grads = []
        for j, (d, net) in enumerate(zip(ctx, nets)):  # split and load
            with tf.device(d), tf.GradientTape() as tape:
                logits = net(x[j * n:(j + 1) * n], training=True)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    y[j * n:(j + 1) * n], logits)) / x.shape[0]
            grads.append(tape.gradient(loss, net.trainable_variables))
        for i in range(len(params[0])):
            kv.push(i, [g[i] for g in grads], priority=-i)
            kv.pull(i, out=[ps[i] for ps in params], priority=-i)

    digits = tfkv.data.digits.load()  # the built-in set in memory: both splits as arrays
    for epoch in range(1, args.epochs + 1):
        for x, y in tfkv.data.train_dataset(digits, 64, epoch, seed=0):
            train_batch(x, y)
        correct = total = 0
        for x, y in tfkv.data.test_dataset(digits, 500):
            pred = tf.argmax(nets[0](x, training=False), -1, output_type=tf.int32)
            correct += int(tf.reduce_sum(tf.cast(pred == y, tf.int32)))
            total += int(y.shape[0])
        print(f"Epoch {epoch}: Test_acc {correct / total:.4f}")


if __name__ == "__main__":
    main()
