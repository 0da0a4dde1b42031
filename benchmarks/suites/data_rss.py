"""A worker's peak RSS training from TFRecords as the set grows, and samples/s from TFRecords
against the same data held in memory, same run; both through `tfkv-run`.

For every size (100 MB, 1 GB and 2 GB of TFRecord files by default) the script writes CIFAR-shaped
records (32x32x3 uint8 pixels as raw bytes, an int64 label; files of at most 64 MB, and a
test file of 2048 records), then runs `tfkv-run dataset=tfrecord` for one epoch over all of
them (kvstore=local: the tfkv-run process is the worker) and records its peak resident set
(ru_maxrss, from wait4); the files are deleted before the next size. That run's model is
small (an MLP with 64 hidden units) so that the epoch over 2 GB takes a minute or two and
the reader, not the model, sets the pace: the worst case for memory.

Throughput uses the smallest set: `tfkv-run model=lenet` with the same batch, from the
TFRecord reader and from the same records held in memory (a factory in this file returns them
as uint8 arrays; tfkv serves arrays through its in-memory pipeline, shuffled per (seed,
epoch)), `--steps` steps per epoch; the figure is the second epoch's samples/s (the first
traces the step). Trials alternate between the two and the median is reported, because this
machine is shared and noisy.

    python -m benchmarks data_rss [--sizes 100M,1G,2G] [--dir /tmp] [--steps 100] [--trials 5]
                                        [--batch 128]

Targets (issue 13): RSS within 200 MiB from the smallest to the largest size; TFRecord / memory
samples/s of at least 0.9. Exits non-zero if a run fails or the disk has too little room.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Streaming data from TFRecords",
    "Peak resident memory of a `tfkv-run dataset=tfrecord` worker over TFRecord sets of growing size (it "
    "should stay flat), and samples/s from the TFRecord reader against the same records held in memory.",
    ["set"], ["peak_rss_mib", "peak_rss_mib_run_2"], "MiB")


SHAPE = (32, 32, 3)
CLASSES = 10
FILE_BYTES = 64 << 20
TEST_RECORDS = 2048
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
    with tf.io.TFRecordWriter(os.path.join(folder, "test.tfrecord")) as w:  # evaluated after every epoch
        for i in range(TEST_RECORDS):
            w.write(records[i % POOL])
    return total


def memory(folder: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A data factory for tfkv-run: the same records read whole into memory as (uint8 images,
    labels), which tfkv serves through its in-memory pipeline (shuffled per (seed, epoch))."""
    from tfkv.data import tfrecord

    files = os.path.join(folder, "part-*.tfrecord" if split == "train" else "test.tfrecord")
    raw = {**FEATURES, "image": {**FEATURES["image"], "scale": None}}
    xs, ys = [], []
    for x, y in tfrecord.load(files, raw, "label", split="test", batch_size=4096):  # file order, every record
        xs.append(x.numpy())
        ys.append(y.numpy())
    return np.concatenate(xs), np.concatenate(ys)


def tfkv_run(cwd: str, args: list[str]) -> tuple[dict, float]:
    """`tfkv-run args` in `cwd` (alone, no launcher: the process is the worker); (its last epoch's
    metrics, its peak RSS in MiB from wait4)."""
    # the in-memory contender's data set is this module's `memory`: the repository root on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([shutil.which("tfkv-run") or "tfkv-run", *args, "progress=false"], cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # not proc.wait(): wait4 also returns the child's rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"tfkv-run {' '.join(args)} exited {proc.returncode}: {log.read()[-3000:]}")
    (path,) = glob.glob(os.path.join(cwd, "outputs", "*", "*", "metrics.json"))
    with open(path) as f:
        metrics = json.load(f)["history"][-1]
    shutil.rmtree(os.path.join(cwd, "outputs"))
    return metrics, usage.ru_maxrss / 1024  # Linux: KiB


def tfrecord_args(folder: str) -> list[str]:
    spec = "{image: {shape: [32, 32, 3], dtype: string, decode: uint8, scale: 255}, label: {dtype: int64}}"
    return ["dataset=tfrecord", f"dataset.files={{train: '{folder}/part-*.tfrecord', test: '{folder}/test.tfrecord'}}",
            f"dataset.features={spec}", "dataset.label=label", f"dataset.num_classes={CLASSES}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,1G,2G", help="TFRecord set sizes in bytes (K/M/G = 1e3/1e6/1e9)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the files are written (then deleted)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="steps per epoch of the rate test")
    ap.add_argument("--trials", type=int, default=5)
    harness.add_argument(ap, "data_rss")
    args = ap.parse_args()

    sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    free = shutil.disk_usage(args.dir).free
    if free < sizes[-1] + (1 << 30):
        sys.exit(f"{args.dir} has {free / 2**30:.1f} GiB free, the {sizes[-1] / 1e9:.1f} GB set needs it plus "
                 "1 GiB; use --dir elsewhere or smaller --sizes")
    common = [f"batch_size={args.batch}", "eval_batch_size=1024", "seed=0"]
    print(f"{'set':>8} {'records':>9} {'write s':>8} {'epoch s':>8} {'peak RSS MiB':>13}")
    peaks, rates, rows = [], None, []
    with tempfile.TemporaryDirectory(prefix="tfkv-bench-run-") as cwd:
        for size in sizes:
            folder = tempfile.mkdtemp(prefix="tfkv-bench-rss-", dir=args.dir)
            try:
                t0 = time.perf_counter()
                records = write_set(folder, size)
                written = time.perf_counter() - t0
                # One epoch over every record: the reader's worst case for memory, with a small model.
                metrics, peak = tfkv_run(cwd, [*tfrecord_args(folder), "model=mlp", "model.hidden=[64]", "epochs=1",
                                               *common])
                print(f"{size / 1e6:>6.0f}MB {records:>9} {written:>8.1f} {metrics['train_seconds']:>8.1f} "
                      f"{peak:>13.0f}", flush=True)
                peaks.append(peak)
                rows.append({"set": f"{size / 1e6:.0f} MB", "records": records, "write_s": written,
                             "epoch_s": metrics["train_seconds"], "peak_rss_mib": peak})
                if rates is None:  # the smallest set, which also fits in memory: LeNet from both sources
                    rates = rate(cwd, folder, args, common)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    growth = peaks[-1] - peaks[0]
    steps = ", ".join(f"{b / 1e6:.0f} MB {q - p:+.0f}" for b, p, q in zip(sizes[1:], peaks, peaks[1:]))
    print(f"peak RSS growth {sizes[0] / 1e6:.0f} MB -> {sizes[-1] / 1e6:.0f} MB: {growth:+.0f} MiB "
          f"(target within {RSS_TARGET_MIB} MiB; by step: {steps})")
    print("samples/s per trial: " + "; ".join(f"{k} {', '.join(f'{v:.0f}' for v in vs)}" for k, vs in rates.items()))
    tfr, mem = (statistics.median(rates[k]) for k in ("tfrecord", "memory"))
    print(f"samples/s (lenet, batch {args.batch}, {args.steps} steps, 2nd epoch, median of {args.trials}): "
          f"tfrecord {tfr:.0f}, memory {mem:.0f}, ratio = tfrecord / memory {tfr / mem:.3f} (target >= {RATE_TARGET})")
    harness.write(args.result, "data_rss", harness.settings_of(args), rows, rss_growth_mib=growth,
                 samples_per_sec={"tfrecord": tfr, "memory": mem, "tfrecord/memory": tfr / mem})


def rate(cwd: str, folder: str, args: argparse.Namespace, common: list[str]) -> dict[str, list[float]]:
    """samples/s of tfkv-run's second epoch (the first traces the step), trials alternating."""
    conf = os.path.join(cwd, "conf", "dataset")
    os.makedirs(conf, exist_ok=True)
    with open(os.path.join(conf, "bench_memory.yaml"), "w") as f:
        f.write(f"_target_: benchmarks.suites.data_rss.memory\nfolder: {folder}\n")
    contenders = {"tfrecord": tfrecord_args(folder), "memory": ["--config-dir", "conf", "dataset=bench_memory"]}
    shared = ["model=lenet", "epochs=2", f"steps_per_epoch={args.steps}", *common]
    results: dict[str, list[float]] = {k: [] for k in contenders}
    for t in range(args.trials):
        for k in harness.alternating(list(contenders), t):
            results[k].append(tfkv_run(cwd, [*contenders[k], *shared])[0]["samples_per_sec"])
    return results


if __name__ == "__main__":
    main()
