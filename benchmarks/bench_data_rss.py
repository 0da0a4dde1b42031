"""A worker's peak RSS training from TFRecords as the set grows, and samples/s from TFRecords
against the same data held in memory, same run.

For every size (100 MB and 2 GB of TFRecord files by default) the script writes CIFAR-shaped
records (32x32x3 uint8 pixels as raw bytes, an int64 label; files of at most 64 MB), then a
fresh worker process trains one full epoch on them through `tfkv.data.tfrecord.load` (rank 0
of 1) and reports its peak resident set (VmHWM); the files are deleted
before the next size. The model of the memory run is small (an MLP) so that the epoch over
2 GB takes seconds and the reader, not the model, sets the pace: the worst case for memory.

Throughput uses the smallest set: one worker process trains a small CNN with the same batch
from the TFRecord reader and from the same records held in memory (uint8 arrays gathered per
(seed, epoch) and batched as tfkv's in-memory pipeline does, scaled in a parallel map), both
prefetched. Trials alternate between the two and the median is reported, because this machine
is shared and noisy.

    python benchmarks/bench_data_rss.py [--sizes 100M,2G] [--dir /tmp] [--seconds 10] [--trials 3]
                                        [--batch 128]

Targets (issue 13): RSS within 200 MiB from the smallest to the largest size; TFRecord / memory
samples/s of at least 0.9. Exits non-zero if a worker fails or the disk has too little room.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

SHAPE = (32, 32, 3)
CLASSES = 10
FILE_BYTES = 64 << 20
POOL = 4096  # distinct images; records cycle through them (the content does not matter here)
RSS_TARGET_MIB = 200
RATE_TARGET = 0.9
FEATURES = {"image": {"shape": list(SHAPE), "dtype": "string", "decode": "uint8", "scale": 255},
            "label": {"shape": [], "dtype": "int64"}}


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def pool() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (POOL, *SHAPE), dtype=np.uint8), rng.integers(0, CLASSES, POOL)


def write_set(folder: str, size: int) -> int:
    """TFRecord files under `folder` holding about `size` bytes; returns the record count."""
    import tensorflow as tf

    images, labels = pool()
    records = [tf.train.Example(features=tf.train.Features(feature={
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[img.tobytes()])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(lab)])),
    })).SerializeToString() for img, lab in zip(images, labels)]
    per_record = len(records[0]) + 16  # framing: length, its CRC, the payload's CRC
    total = size // per_record
    per_file = FILE_BYTES // per_record
    for f, start in enumerate(range(0, total, per_file)):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part-{f:05d}.tfrecord")) as w:
            for i in range(start, min(start + per_file, total)):
                w.write(records[(i * 7919) % POOL])
    return total


def make_model(kind: str):
    import keras

    keras.utils.set_random_seed(0)
    if kind == "mlp":
        layers = [keras.layers.Flatten(), keras.layers.Dense(64, activation="relu")]
    else:
        layers = [keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
                  keras.layers.Flatten(), keras.layers.Dense(128, activation="relu")]
    return keras.Sequential([keras.Input(SHAPE), *layers, keras.layers.Dense(CLASSES)])


def train_step(model):
    """A plain Keras/TensorFlow training step (GradientTape + SGD) in one tf.function."""
    import keras
    import tensorflow as tf

    opt = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    return step


def tfrecord_data(folder: str, batch: int, epoch: int):
    from tfkv.data import tfrecord

    return tfrecord.load(os.path.join(folder, "*.tfrecord"), FEATURES, "label", batch_size=batch, epoch=epoch)


def memory_data(x: np.ndarray, y: np.ndarray, batch: int, epoch: int):
    """The same records in memory, as tfkv's in-memory pipeline serves them."""
    import tensorflow as tf

    steps = len(x) // batch
    order = np.random.default_rng([0, epoch]).permutation(len(x))[: steps * batch]
    xs = x[order].reshape(steps, batch, *SHAPE)
    ys = y[order].reshape(steps, batch)
    return (tf.data.Dataset.from_tensor_slices((xs, ys))
            .map(lambda a, b: (tf.cast(a, tf.float32) / 255.0, b), num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE))


def worker_epoch(folder: str, batch: int) -> None:
    """One full epoch from the TFRecord reader (a separate process: its peak RSS is the figure)."""
    step = train_step(make_model("mlp"))
    n = 0
    for x, y in tfrecord_data(folder, batch, 1):
        step(x, y)
        n += 1
    print(f"steps {n}\npeak {peak_rss_mib():.1f}", flush=True)


def worker_rate(folder: str, batch: int, seconds: float, trials: int) -> None:
    """samples/s of the CNN from TFRecords and from memory, alternating; prints one line each."""
    # The in-memory copy: every record of the set, read once through the reader in file order.
    xs, ys = [], []
    from tfkv.data import tfrecord

    for x, y in tfrecord.load(os.path.join(folder, "*.tfrecord"), {**FEATURES, "image": {
            **FEATURES["image"], "scale": None}}, "label", split="test", batch_size=1024):
        xs.append(x.numpy())
        ys.append(y.numpy())
    x, y = np.concatenate(xs), np.concatenate(ys)
    model = make_model("cnn")
    step = train_step(model)
    sources = {"tfrecord": lambda e: tfrecord_data(folder, batch, e), "memory": lambda e: memory_data(x, y, batch, e)}
    iters = {k: iter(make(1).repeat()) for k, make in sources.items()}
    for it in iters.values():  # trace and warm both pipelines
        for _ in range(5):
            step(*next(it))
    results = {k: [] for k in sources}
    for t in range(trials):
        for k in (list(sources) if t % 2 == 0 else list(sources)[::-1]):
            it, n, t0 = iters[k], 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds:
                for _ in range(10):
                    loss = step(*next(it))
                n += 10
            float(loss)  # the last step has finished
            results[k].append(batch * n / (time.perf_counter() - t0))
    for k, v in results.items():
        print(f"rate {k} {statistics.median(v):.1f}", flush=True)


def peak_rss_mib() -> float:
    """This process's high-water resident set (VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def run_worker(args: list[str]) -> str:
    """Run this script as a worker (a fresh process); its output."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"worker {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,2G", help="TFRecord set sizes in bytes (K/M/G = 1e3/1e6/1e9)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files are written (then deleted)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=10.0, help="per trial and contender of the rate test")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, folder = args.worker
        if kind == "epoch":
            worker_epoch(folder, args.batch)
        else:
            worker_rate(folder, args.batch, args.seconds, args.trials)
        return

    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    free = shutil.disk_usage(args.dir).free
    if free < sizes[-1] + (1 << 30):
        sys.exit(f"{args.dir} has {free / 2**30:.1f} GiB free, the {sizes[-1] / 1e9:.1f} GB set needs it plus "
                 "1 GiB; use --dir elsewhere or smaller --sizes")
    print(f"{'set':>8} {'records':>9} {'write s':>8} {'epoch s':>8} {'peak RSS MiB':>13}")
    peaks, rates = [], None
    for size in sizes:
        folder = tempfile.mkdtemp(prefix="tfkv-bench-rss-", dir=args.dir)
        try:
            t0 = time.perf_counter()
            records = write_set(folder, size)
            written = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = run_worker(["--batch", str(args.batch), "--worker", "epoch", folder])
            peak = float(out.split("peak ")[1].split()[0])
            print(f"{size / 1e6:>6.0f}MB {records:>9} {written:>8.1f} {time.perf_counter() - t0:>8.1f} "
                  f"{peak:>13.0f}", flush=True)
            peaks.append(peak)
            if rates is None:  # the smallest set: it also fits in memory
                out = run_worker(["--batch", str(args.batch), "--seconds", str(args.seconds), "--trials",
                                     str(args.trials), "--worker", "rate", folder])
                rates = {line.split()[1]: float(line.split()[2]) for line in out.splitlines()
                         if line.startswith("rate ")}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    growth = peaks[-1] - peaks[0]
    print(f"peak RSS growth {sizes[0] / 1e6:.0f} MB -> {sizes[-1] / 1e6:.0f} MB: {growth:+.0f} MiB "
          f"(target within {RSS_TARGET_MIB} MiB)")
    ratio = rates["tfrecord"] / rates["memory"]
    print(f"samples/s (CNN, batch {args.batch}, median of {args.trials}): tfrecord {rates['tfrecord']:.0f}, "
          f"memory {rates['memory']:.0f}, ratio = tfrecord / memory {ratio:.3f} (target >= {RATE_TARGET})")


if __name__ == "__main__":
    main()
