"""samples/s of the CIFAR VGG11 experiment through `tfkv-run` on one GPU against plain Keras `fit`
of the same model in the same run: float32 and mixed_bfloat16, XLA off and on, and two workers
sharing the GPU through `dist_sync`.

Each tfkv contender is what a user runs:

    tfkv-run +experiment=cifar_vgg11 dataset=synthetic kvstore=device devices=[gpu:0] \
             precision=<p> jit_compile=<j> epochs=<e>

and its samples/s is the run's own figure in metrics.json (training time of every epoch after the
first, which pays for tracing; evaluation is not counted). The baseline builds the same model
(tfkv.models.build of conf/model/vgg11.yaml), sets the same Keras precision policy, compiles it with
SGD momentum 0.9 and the same `jit_compile`, and calls `model.fit` on the same synthetic arrays with
the same batch, timing every epoch after the first the same way; it runs in its own process, as
tfkv-run does, so that neither inherits the other's policy or GPU memory. The dist_sync row runs
`cluster=local cluster.num_workers=2` on the same GPU (each worker the experiment's batch, so twice
the work per step) and is compared with the float32 `fit`. Trials alternate and medians are printed,
with the GPU's name, because a lent machine is shared too.

    python -m benchmarks gpu [--device gpu:0] [--epochs 3] [--num-train 8192] [--trials 3]
                                   [--batch 128] [--width 64] [--rows all]

`--device cpu:0 --width 8 --num-train 256` runs the same table on a CPU (smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "GPU: tfkv-run against Keras fit",
    "Samples/s of the `cifar_vgg11` experiment on synthetic data through `tfkv-run` against plain Keras "
    "`fit` of the same model in the same run: float32, `mixed_bfloat16`, XLA, and two `dist_sync` workers "
    "sharing the GPU. Run it first on a GPU machine.",
    ["row"], ["tfkv-run", "keras fit"], "samples/s")


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_TEST = 512
# name: (precision, jit_compile, workers)
ROWS = {
    "float32": ("float32", False, 1),
    "bf16": ("mixed_bfloat16", False, 1),
    "float32+xla": ("float32", True, 1),
    "bf16+xla": ("mixed_bfloat16", True, 1),
    "dist_sync x2": ("float32", False, 2),
}


def keras_fit(args: argparse.Namespace) -> None:
    """In its own process: plain Keras fit; prints {"samples_per_sec": ...} as its last line."""
    import keras
    import tensorflow as tf

    from tfkv.data.synthetic import load
    from tfkv.models import build

    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(args.precision)
    data = load(num_train=args.num_train, num_test=NUM_TEST)
    with tf.device(args.device):
        model = build({"_target_": "tfkv.models.vgg.build_vgg11", "batch_norm": True, "width": args.width,
                       "dropout": 0.0}, input_shape=(32, 32, 3), num_classes=10)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=args.jit)
        times: list[float] = []

        class Clock(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.t0 = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                times.append(time.perf_counter() - self.t0)

        steps = args.num_train // args.batch
        model.fit(data.x_train[:steps * args.batch], data.y_train[:steps * args.batch], batch_size=args.batch,
                  epochs=args.epochs, shuffle=True, verbose=0, callbacks=[Clock()])
    steady = times[1:] or times
    print(json.dumps({"samples_per_sec": steps * args.batch * len(steady) / sum(steady)}))


def run_fit(args: argparse.Namespace, precision: str, jit: bool) -> float:
    argv = [*harness.suite_argv("gpu"), "--keras-fit", "--precision", precision, "--device", args.device,
            "--epochs", str(args.epochs), "--num-train", str(args.num_train), "--batch", str(args.batch),
            "--width", str(args.width)] + (["--jit"] if jit else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"keras fit ({precision}, jit={jit}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["samples_per_sec"]


def run_tfkv(args: argparse.Namespace, precision: str, jit: bool, workers: int, tmp: Path) -> float:
    run_dir = Path(tempfile.mkdtemp(dir=tmp))
    argv = ["tfkv-run", "+experiment=cifar_vgg11", "dataset=synthetic", f"dataset.num_train={args.num_train}",
            f"dataset.num_test={NUM_TEST}", f"model.width={args.width}", f"batch_size={args.batch}",
            f"epochs={args.epochs}", f"devices=[{args.device}]", f"precision={precision}",
            f"jit_compile={str(jit).lower()}", "progress=false", f"hydra.run.dir={run_dir}"]
    if workers == 1:
        argv.append("kvstore=device")
    else:
        argv += ["kvstore=dist_sync", "cluster=local", f"cluster.num_workers={workers}", "cluster.num_servers=1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "metrics.json").read_text())["samples_per_sec"]


def gpu_name(device: str) -> str:
    if not device.startswith("gpu"):
        return "CPU (no GPU)"
    proc = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="gpu:0")
    ap.add_argument("--epochs", type=int, default=3, help="the first of them is not timed")
    ap.add_argument("--num-train", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--width", type=int, default=64, help="VGG11's first conv width (the experiment's: 64)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--keras-fit", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)
    harness.add_argument(ap, "gpu")
    args = ap.parse_args()
    if args.keras_fit:
        return keras_fit(args)
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    print(f"VGG11 (width {args.width}), synthetic 32x32x3, batch {args.batch}, on {gpu_name(args.device)}; "
          f"samples/s, median of {args.trials}")
    print(f"{'row':<14} {'tfkv-run':>10} {'keras fit':>10} {'tfkv/fit':>9}")
    fits: dict[tuple[str, bool], list[float]] = {}
    ours: dict[str, list[float]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            order = harness.alternating(rows, trial)
            for row in order:
                precision, jit, workers = ROWS[row]
                if workers == 1 or (precision, jit) not in fits:
                    fits.setdefault((precision, jit), []).append(run_fit(args, precision, jit))
                ours[row].append(run_tfkv(args, precision, jit, workers, Path(tmp)))
    table = []
    for row in rows:
        precision, jit, _ = ROWS[row]
        a, b = statistics.median(ours[row]), statistics.median(fits[(precision, jit)])
        print(f"{row:<14} {a:>10.0f} {b:>10.0f} {a / b:>9.3f}")
        table.append({"row": row, "tfkv-run": a, "keras fit": b, "tfkv/fit": a / b})
    harness.write(args.result, "gpu", harness.settings_of(args), table, device_name=gpu_name(args.device))


if __name__ == "__main__":
    main()
