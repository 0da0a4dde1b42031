"""samples/s of model-parallel LSTM training: pipelined vs naive, balanced vs unbalanced, same run.

Every contender trains the same multi-layer LSTM language model (`tfkv.models.lstm_lm`) on the
same random token batch through `ModelParallel` with the `local` store:

  * 1 device: every group on cpu:0, no micro-batches (the reference);
  * 2 and 4 logical devices with the `placement=auto` plan, naive (1 micro-batch: one device
    works while the others wait) and pipelined (`--micro` micro-batches: device s works on
    micro-batch i while device s+1 works on i-1);
  * the auto plan against a deliberately unbalanced one on 2 devices (the embedding alone on
    the first device, every LSTM layer and the decoder on the second), both pipelined.

Trials alternate between contenders and the median is reported, because this machine is shared
and noisy. Logical CPU devices share the host's cores, so overlap can only use cores that one
stage leaves idle; on separate GPUs each stage has its own.

    python -m benchmarks model_parallel [--seconds 1] [--trials 5] [--micro 4]
"""

from __future__ import annotations

import argparse
import os

from benchmarks import harness

# This benchmark's section of the performance page (benchmarks/report.py), which imports this module
# for it alone: TensorFlow and tfkv are imported where they run.
REPORT = harness.Report(
    "Model parallelism",
    "Samples/s of an LSTM language model split over logical devices, naive (one micro-batch) and "
    "pipelined, against the whole model on one device (`vs 1dev`), in the same run.",
    ["contender"], ["samples/s"], "samples/s")


def contender(groups, specs, tf_by_spec, batch, micro, x, y, seq_len):
    import keras

    from tfkv import optim, store
    from tfkv.parallel.model_parallel import ModelParallel

    keras.utils.set_random_seed(0)
    sgd = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9)
    mp = ModelParallel(groups, [tf_by_spec[s] for s in specs], store.create("local"), sgd, batch,
                       micro_batches=micro)  # a token's loss: the mean over the sequence
    return lambda: mp.step(x, y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per trial and contender")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches of the pipelined contenders")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--hidden", default="256,256,256", help="LSTM layer sizes")
    ap.add_argument("--intra-op-threads", type=int, default=0,
                    help="threads per op (0: TensorFlow's default, all cores); 1 makes a logical "
                         "device behave like one core of its own, so stages can only gain by overlapping")
    harness.add_argument(ap, "model_parallel")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from tfkv import models
    from tfkv.parallel import devices, placement

    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)

    cfg = {"_target_": "tfkv.models.lstm_lm.build", "hidden": [int(h) for h in args.hidden.split(",")]}
    groups = models.build_groups(cfg, (args.seq_len,), args.vocab)
    specs4 = [f"cpu:{i}" for i in range(4)]
    tf_by_spec = dict(zip(specs4, devices.setup(specs4)))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, args.vocab, (args.batch, args.seq_len)).astype(np.float32))
    y = tf.constant(rng.integers(0, args.vocab, (args.batch, args.seq_len)).astype(np.int32))

    plans = {
        "1dev": [("cpu:0",) * len(groups), 1],
        "2dev-auto-m1": [placement.assign("auto", groups, specs4[:2], "lstm_lm"), 1],
        "2dev-auto-pipe": [placement.assign("auto", groups, specs4[:2], "lstm_lm"), args.micro],
        "4dev-auto-m1": [placement.assign("auto", groups, specs4, "lstm_lm"), 1],
        "4dev-auto-pipe": [placement.assign("auto", groups, specs4, "lstm_lm"), args.micro],
        "2dev-unbal-pipe": [["cpu:0"] + ["cpu:1"] * (len(groups) - 1), args.micro],
    }
    print(f"LSTM LM: hidden {cfg['hidden']}, vocab {args.vocab}, seq_len {args.seq_len}, batch {args.batch}, "
          f"pipelined = {args.micro} micro-batches; {args.trials} trials x {args.seconds}s, median; "
          f"intra-op threads {args.intra_op_threads or 'default'}, {os.cpu_count()} cores")
    for name in ("2dev-auto-pipe", "4dev-auto-pipe", "2dev-unbal-pipe"):
        print(placement.format_plan(placement.stages(groups, plans[name][0]), name))
    steps = {name: contender(groups, list(specs), tf_by_spec, args.batch, micro, x, y, args.seq_len)
             for name, (specs, micro) in plans.items()}
    results: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.trials):
        for name, step in steps.items():
            results[name].append(harness.samples_per_second(step, args.batch, args.seconds, every=5))
    med = harness.medians(results)

    print(f"\n{'contender':<16} {'samples/s':>10} {'vs 1dev':>8}")
    for name in steps:
        print(f"{name:<16} {med[name]:>10.0f} {med[name] / med['1dev']:>8.3f}")
    print("\nratios (>1: the first is faster)")
    print(f"  pipelined / naive, 2 devices : {med['2dev-auto-pipe'] / med['2dev-auto-m1']:.3f}")
    print(f"  pipelined / naive, 4 devices : {med['4dev-auto-pipe'] / med['4dev-auto-m1']:.3f}")
    print(f"  balanced / unbalanced, 2 dev : {med['2dev-auto-pipe'] / med['2dev-unbal-pipe']:.3f}")
    harness.write(args.result, "model_parallel", harness.settings_of(args),
                 [{"contender": name, "samples/s": med[name], "vs 1dev": med[name] / med["1dev"]} for name in steps])


if __name__ == "__main__":
    main()
