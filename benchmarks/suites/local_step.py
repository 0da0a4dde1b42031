"""samples/s of a tfkv `local` training step against a plain TensorFlow custom loop, same run.

The baseline is what a TensorFlow user writes by hand: GradientTape + keras SGD.apply_gradients
inside one tf.function, on the same model, batch and device. tfkv runs the same model through
DataParallel + KVStore(local) on 1 device, then on k logical CPU devices. Trials alternate
between the contenders and the median is reported, because this machine is shared and noisy.

    python -m benchmarks local_step [--seconds 1] [--trials 5] [--devices 4]
"""

from __future__ import annotations

import argparse
import os

from benchmarks import harness

# This benchmark's section of the performance page (benchmarks/report.py), which imports this module
# for it alone: TensorFlow and tfkv are imported where they run.
REPORT = harness.Report(
    "Training step against plain TensorFlow",
    "Samples/s of a tfkv `local` training step against a plain TensorFlow custom loop (GradientTape and "
    "`apply_gradients` in one `tf.function`) on the same model, batch and device, trials alternating. "
    "`ratio` is tfkv on one device over plain TF; the last column splits the CPU into 4 logical devices.",
    ["case"], ["plain_tf", "tfkv_1", "tfkv_4"], "samples/s")


CASES = {
    # name: (model node, as conf/model/*.yaml, input shape, batch)
    "mlp-digits": ({"_target_": "tfkv.models.mlp.build", "hidden": [256, 128]}, (8, 8, 1), 64),
    "mlp-1M": ({"_target_": "tfkv.models.mlp.build", "hidden": [1024, 256]}, (28, 28, 1), 128),
    "lenet-mnist": ({"_target_": "tfkv.models.lenet.build"}, (28, 28, 1), 128),
}


def plain_tf(make, x, y, lr):
    import keras
    import tensorflow as tf

    model = make()
    opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return lambda: step(x, y)


def tfkv_step(make, x, y, lr, tf_devices, kind="local"):
    from tfkv import optim, store
    from tfkv.parallel.data_parallel import DataParallel

    batch = int(x.shape[0])
    k = len(tf_devices)
    sizes = [batch // k] * k
    sizes[-1] += batch - sum(sizes)
    sgd = optim.SGD(schedule=optim.Schedule(lr=lr), momentum=0.9)
    dp = DataParallel(make, tf_devices, store.create(kind, devices=tf_devices), sgd, sizes)
    return lambda: dp.step(x, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per trial and contender")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--cases", default=",".join(CASES))
    harness.add_argument(ap, "local_step")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    from tfkv.models import build
    from tfkv.parallel import devices

    tf_devices = devices.setup([f"cpu:{i}" for i in range(args.devices)])
    print(f"{'case':<12} {'plain TF':>10} {'tfkv x1':>10} {'ratio':>6}   "
          f"{'tfkv x' + str(args.devices):>10} {'vs x1':>6}  (samples/s, median of {args.trials})")
    rows = []
    for name in args.cases.split(","):
        cfg, shape, batch = CASES[name]
        keras.utils.set_random_seed(0)
        x = tf.random.normal((batch, *shape))
        y = tf.random.uniform((batch,), 0, 10, dtype=tf.int32)
        make = lambda: build(cfg, input_shape=shape, num_classes=10)  # noqa: E731
        contenders = {
            "plain": plain_tf(make, x, y, 0.01),
            "x1": tfkv_step(make, x, y, 0.01, tf_devices[:1]),
            "xk": tfkv_step(make, x, y, 0.01, tf_devices),
        }
        results = {k: [] for k in contenders}
        for _ in range(args.trials):
            for k, step in contenders.items():
                results[k].append(harness.samples_per_second(step, batch, args.seconds, every=10))
        med = harness.medians(results)
        print(f"{name:<12} {med['plain']:>10.0f} {med['x1']:>10.0f} {med['x1'] / med['plain']:>6.3f}   "
              f"{med['xk']:>10.0f} {med['xk'] / med['x1']:>6.3f}")
        rows.append({"case": name, "batch": batch, "plain_tf": med["plain"], "tfkv_1": med["x1"],
                     "ratio": med["x1"] / med["plain"], f"tfkv_{args.devices}": med["xk"],
                     f"{args.devices}_vs_1": med["xk"] / med["x1"]})
    harness.write(args.result, "local_step", harness.settings_of(args), rows)


if __name__ == "__main__":
    main()
