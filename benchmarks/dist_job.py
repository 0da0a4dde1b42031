"""What the distributed benchmarks share: one `dist_sync` training job (N local workers, 1
server, started by tfkv.launcher make_plan + local.run) and its worker, for
bench_compression_training.py and bench_scaling.py; and the pieces bench_dist_training.py and
bench_pushpull.py use too (the synthetic batch, the agreed step count, the timed loop, running a
plan under a time limit, checking that workers agree), and for every benchmark of the parameter
server, a job's security variables (`security_env`) and a scheduler and server for a worker the
benchmark itself runs (`start_ps`).

Each worker trains tfkv DataParallel on its slice of one synthetic in-memory global batch with
SGD (lr 0.01, momentum 0.9, the server runs the optimizer), traces and warms up, times a few
calibration steps, and then runs a step count that rank 0 picks to last about `--seconds` (every
worker must run the same count). Over the timed steps it records the job's samples/s (global
batch x steps / the slowest worker's time), the bytes it pushed (DistStore.push_bytes), where its
step time went (DataParallel.timings: compute = the gradient tf.function, including the pushes
made from inside it; push = the part of it spent pushing; pull = waiting for the replies, which
includes waiting for the other workers; assign = writing the pulled weights into the variables),
and a checksum of its trainable weights, which must agree across workers. `--overlap after`
hides the store's async_pushpull from DataParallel, so every key is pushed after the whole
backward pass instead of from inside it (the A/B of benchmarks/bench_compression_training.py).
`--kvstore local` is one process alone (bench_cluster's scaling baseline); `--kvstore dist_async`
steps each worker for `--seconds` of its own clock instead (a straggler runs fewer steps), and
the job's samples/s is the sum of the workers' own.

Run as a script it is one worker (the parent scripts start it, bench_cluster.py through
tfkv-launch on an emulated cluster); `run_job` is the parent side on this machine, `collect`
reads a job's figures back.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {
    # name: (model node, as conf/model/*.yaml, input shape)
    "lenet": ({"_target_": "tfkv.models.lenet.build"}, (28, 28, 1)),
    "mlp": ({"_target_": "tfkv.models.mlp.build", "hidden": [256, 128]}, (8, 8, 1)),
    "mlp5m": ({"_target_": "tfkv.models.mlp.build", "hidden": [2048, 2048]}, (28, 28, 1)),  # 5.8M parameters
    # ResNet-18 (CIFAR variant) at 1/8 width on 32x32x3: 176K parameters, conv-heavy
    "resnet8w": ({"_target_": "tfkv.models.resnet.build_resnet18", "width": 8}, (32, 32, 3)),
}
# The models the training comparisons name (bench_dist_training, bench_cluster): LeNet, the
# 5.8M-parameter MLP, a small ResNet; the names they are known by -> MODELS.
TRAINING_MODELS = {"lenet": "lenet", "mlp": "mlp5m", "resnet": "resnet8w"}
LR, MOMENTUM = 0.01, 0.9
WARMUP_STEPS, CALIBRATION_STEPS = 3, 3


class Failed(RuntimeError):
    """A benchmark job failed or hung; the message ends with its log's tail."""


def security_env(secure: bool) -> dict[str, str]:
    """What a job's processes get: a fresh key (secure, as tfkv-run launches every job by
    default), or TFKV_SECURE=0 (plain, `cluster.secure=false`)."""
    from tfkv import keys as job_keys

    return job_keys.keys_env(job_keys.new_keys()) if secure else {job_keys.SECURE: "0"}


def start_ps(secure: bool, quiet: bool = False) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """A scheduler and one server (`python -m tfkv.ps.node`) on 127.0.0.1 for one worker that the
    calling benchmark runs itself: (the processes, the worker's environment less DMLC_ROLE). Stop
    them with tfkv.launcher.supervisor.stop_groups once the worker's store is closed."""
    from tfkv.launcher.ports import free_port

    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", **security_env(secure)}
    out = subprocess.DEVNULL if quiet else None
    procs = [subprocess.Popen([sys.executable, "-m", "tfkv.ps.node"], env={**env, "DMLC_ROLE": role},
                              stdout=out, stderr=out, start_new_session=True) for role in ("scheduler", "server")]
    return procs, env


# -- inside a worker process ------------------------------------------------------------------

def synthetic(batch: int, shape: tuple[int, ...], seed: int = 0):
    """The same global batch in every process; worker r trains on slice r."""
    import numpy as np

    rng = np.random.RandomState(seed)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.randint(0, 10, size=batch).astype(np.int32)
    return x, y


def agree_on_steps(rank: int, per_step: float, seconds: float, sync_dir: str, tag: str) -> int:
    """Rank 0 decides the step count and writes it; the others wait for the file."""
    path = os.path.join(sync_dir, f"{tag}.steps")
    if rank == 0:
        n = max(5, math.ceil(seconds / max(per_step, 1e-6)))
        with open(path + ".tmp", "w") as f:
            f.write(str(n))
        os.replace(path + ".tmp", path)
        return n
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 never wrote {path}")
        time.sleep(0.005)
    with open(path) as f:
        return int(f.read())


def measure(step: Callable[[], Any], rank: int, seconds: float, sync_dir: str, tag: str,
            before_timed: Callable[[], None] | None = None) -> tuple[int, float]:
    """Warm up, calibrate, agree on a step count lasting about `seconds`, run it timed: (steps,
    seconds). `before_timed` runs just before the timed steps (resetting counters)."""
    for _ in range(WARMUP_STEPS):
        step()
    t0 = time.perf_counter()
    for _ in range(CALIBRATION_STEPS):
        step()
    n = agree_on_steps(rank, (time.perf_counter() - t0) / CALIBRATION_STEPS, seconds, sync_dir, tag)
    step()  # lines the workers up again after the file hand-over
    if before_timed is not None:
        before_timed()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return n, time.perf_counter() - t0


def weights_checksum(weights) -> list[float]:
    import numpy as np

    return [float(np.sum(np.asarray(w, np.float64))) for w in weights]


def report(dp: Any, steps: int, elapsed: float, global_batch: int) -> dict[str, Any]:
    """What a worker says of its timed loop: steps, seconds, global batch, last loss, model size
    and a checksum of its weights (workers of one job must agree on it)."""
    loss = dp.take_metrics()[0]["loss"]
    return {"steps": steps, "seconds": elapsed, "batch": global_batch, "loss": loss,
            "params": int(dp.replicas[0].count_params()),
            "checksum": weights_checksum(dp.replicas[0].trainable_weights)}  # BN statistics are each worker's own


def set_threads(n: int) -> None:
    """TensorFlow's intra/inter-op threads (0: its default)."""
    import tensorflow as tf

    if n:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(n)


# -- the parent side --------------------------------------------------------------------------

def run_plan(plan: list, timeout: float, what: str) -> str:
    """Run a make_plan job with tfkv.launcher.backends.local (which tears every process group down, also
    when this gives up): its merged log; Failed, with the log's tail, if it fails or runs past `timeout`."""
    from tfkv.launcher.backends import local

    log = io.StringIO()

    def expired(*_):
        raise Failed(f"{what} ran past {timeout:.0f} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(timeout))
    try:
        result = local.run(plan, out=log)
    except Failed as e:
        raise Failed(f"{e}\n{log.getvalue()[-4000:]}") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    if result.failure is not None:
        raise Failed(f"{what}: {result.failure}\n{log.getvalue()[-4000:]}")
    return log.getvalue()


def check_agreement(reports: list[dict], what: str) -> None:
    """The workers of one job ran the same steps, ended with the same weights, a finite loss."""
    if len({r["steps"] for r in reports}) != 1:
        raise Failed(f"{what}: the workers ran different step counts")
    for r in reports[1:]:
        for a, b in zip(reports[0]["checksum"], r["checksum"]):
            if abs(a - b) > 1e-4 * max(1.0, abs(a)):
                raise Failed(f"{what}: the workers' weights differ ({a} vs {b}): not synchronised")
    if not all(math.isfinite(r["loss"]) for r in reports):
        raise Failed(f"{what}: the loss is not finite")


def config_compression(kind: str, threshold: float) -> dict[str, Any] | None:
    """What a tfkv-run config's `kvstore.compression` gives the store (as tfkv.trainer passes it),
    so that `2bit` here means what it means in a config: the accurate, momentum-corrected 2-bit;
    `2bit_mxnet` is MXNet's exact one."""
    from tfkv.ps.compression import from_config

    compressing = from_config(kind, threshold)
    return compressing.params() if compressing else None


def run_for(step: Callable[[], Any], rank: int, seconds: float, sync_dir: str, tag: str,
            before_timed: Callable[[], None]) -> tuple[int, float]:
    """dist_async: warm up, line up with the others on rank 0's file, then step for `seconds` of
    this worker's own clock: (steps, seconds). The workers' step counts differ (a straggler runs
    fewer), so the job's samples/s is the sum of the workers' own."""
    for _ in range(WARMUP_STEPS):
        step()
    agree_on_steps(rank, 1.0, 1.0, sync_dir, tag)
    before_timed()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
    return n, time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """One worker of a `local`, `dist_sync` or `dist_async` job: each of `args.model` (comma
    separated) in turn, one report file each (`<tag>-<model>-<rank>.json`)."""
    import keras

    from tfkv import optim, store
    from tfkv.models import build
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel

    set_threads(args.threads)
    tf_devices = devices.setup(["cpu:0"])
    kv = store.create(args.kvstore, devices=tf_devices)
    if args.overlap == "after":
        kv.async_pushpull = False
    try:
        rank, workers = kv.rank, kv.num_workers
        if args.compression != "none":  # before any key exists, as the trainer does
            kv.set_gradient_compression(config_compression(args.compression, args.threshold))
        for model in args.model.split(","):
            cfg, shape = MODELS[model]
            x, y = synthetic(workers * args.batch, shape)
            x, y = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
            keras.utils.set_random_seed(0)
            sgd = optim.SGD(schedule=optim.Schedule(lr=LR), momentum=MOMENTUM)
            dp = DataParallel(lambda: build(cfg, input_shape=shape, num_classes=10), tf_devices, kv, sgd, [len(x)])

            def reset() -> None:
                dp.reset_timings()
                kv.push_bytes = 0

            timed = run_for if args.kvstore == "dist_async" else measure
            n, elapsed = timed(lambda: dp.step(x, y), rank, args.seconds, args.sync_dir, f"steps-{args.tag}-{model}",
                               reset)
            said = {**report(dp, n, elapsed, len(x) * workers), "push_bytes": kv.push_bytes / n,
                    "timings": {k: v / n for k, v in dp.timings.items() if k != "steps"}}
            with open(os.path.join(args.out, f"{args.tag}-{model}-{rank}.json"), "w") as f:
                json.dump(said, f)
    except BaseException:
        kv.abort("dist_job worker failed")
        raise
    kv.close()


def worker_argv(model: str, batch: int, seconds: float, tmp: str, tag: str, kvstore: str = "dist_sync",
                compression: str = "none", threshold: float = 0.5, overlap: str = "graph",
                threads: int = 0, python: str = sys.executable) -> list[str]:
    """The command line of a worker of this module (`model`: one name or several, comma separated)."""
    return [python, os.path.abspath(__file__), "--out", tmp, "--sync-dir", tmp, "--tag", tag, "--model", model,
            "--batch", str(batch), "--seconds", str(seconds), "--kvstore", kvstore, "--compression", compression,
            "--threshold", str(threshold), "--overlap", overlap, "--threads", str(threads)]


def collect(tmp: str, tag: str, model: str, workers: int, synchronous: bool = True) -> dict:
    """One model's figures from a job's report files: {samples_s, push_bytes (per step, per worker),
    timings (worker means), step_s, steps, params, loss}. Synchronous jobs' workers must agree
    (check_agreement); a dist_async job's samples/s is the sum of its workers' own."""
    reports = []
    for r in range(workers):
        with open(os.path.join(tmp, f"{tag}-{model}-{r}.json")) as f:
            reports.append(json.load(f))
    if synchronous:
        check_agreement(reports, f"{tag} {model}")
        samples_s = reports[0]["batch"] * reports[0]["steps"] / max(r["seconds"] for r in reports)
    else:
        if not all(math.isfinite(r["loss"]) for r in reports):
            raise Failed(f"{tag} {model}: the loss is not finite")
        samples_s = sum(r["batch"] / workers * r["steps"] / r["seconds"] for r in reports)
    phases = reports[0]["timings"].keys()
    return {"samples_s": samples_s, "push_bytes": sum(r["push_bytes"] for r in reports) / workers,
            "timings": {p: sum(r["timings"][p] for r in reports) / workers for p in phases},
            "step_s": sum(r["seconds"] / r["steps"] for r in reports) / workers,
            "steps": reports[0]["steps"], "params": reports[0]["params"], "loss": reports[0]["loss"]}


def run_job(workers: int, model: str, batch: int, seconds: float, tmp: str, tag: str, timeout: float,
            compression: str = "none", threshold: float = 0.5, overlap: str = "graph", threads: int = 0,
            secure: bool = True) -> dict:
    """Run one dist_sync job on this machine (`workers` workers, 1 server); returns `collect`'s
    figures. Raises Failed (with the job's log tail) on any failure or hang. `secure`: with a
    fresh key for the job, as a launched job is by default; else TFKV_SECURE=0."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    argv = worker_argv(model, batch, seconds, tmp, tag, compression=compression, threshold=threshold,
                       overlap=overlap, threads=threads)
    plan = make_plan(workers, 1, argv, [sys.executable, "-m", "tfkv.ps.node"], ["127.0.0.1"], "127.0.0.1",
                     free_port(), extra_env=security_env(secure))
    run_plan(plan, timeout, tag)
    return collect(tmp, tag, model, workers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sync-dir", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--model", required=True, help=f"one of {', '.join(MODELS)}, or several, comma separated")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--kvstore", choices=["local", "dist_sync", "dist_async"], default="dist_sync")
    ap.add_argument("--compression", default="none")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--overlap", choices=["graph", "after"], default="graph")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    unknown = [m for m in args.model.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    worker(args)


if __name__ == "__main__":
    main()
