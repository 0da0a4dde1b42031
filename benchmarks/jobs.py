"""The multi-process jobs the benchmarks start, in one module: who runs, where, and how each
process measures.

- On this machine: one `dist_sync` training job (N local workers, 1 server, started by
  tfkv.launcher make_plan + local.run: `run_job`, `collect`) for the compression_training and
  scaling suites; the pieces dist_training and pushpull use too (the synthetic batch, the agreed
  step count, the timed loop, running a plan under a time limit, checking that workers agree); for
  every benchmark of the parameter server, a job's security variables (`security_env`) and a
  scheduler and server for a worker the benchmark itself runs (`start_ps`).
- The tf.distribute contenders' roles (`run_tfkv`, `run_mwms`, `run_pss`, `run_pss_server`,
  `collect_roles`), which `python -m benchmarks dist_training --role ...` runs for the
  dist_training, cluster and embedding suites.
- On the hosts of an emulated cluster (tfkv.emulate): one job per contender of the cluster suite
  (`run`, `launch_tfkv`, `supervise`).

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
backward pass instead of from inside it (the A/B of the compression_training suite).
`--kvstore local` is one process alone (the cluster suite's scaling baseline); `--kvstore
dist_async` steps each worker for `--seconds` of its own clock instead (a straggler runs fewer
steps), and the job's samples/s is the sum of the workers' own.

Run as `python -m benchmarks.jobs` it is one worker (the suites start it, the cluster suite
through tfkv-launch on an emulated cluster); `run_job` is the parent side on this machine,
`collect` reads a job's figures back.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks import harness

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {
    # name: (model node, as conf/model/*.yaml, input shape)
    "lenet": ({"_target_": "tfkv.models.lenet.build"}, (28, 28, 1)),
    "mlp": ({"_target_": "tfkv.models.mlp.build", "hidden": [256, 128]}, (8, 8, 1)),
    "mlp5m": ({"_target_": "tfkv.models.mlp.build", "hidden": [2048, 2048]}, (28, 28, 1)),  # 5.8M parameters
    # ResNet-18 (CIFAR variant) at 1/8 width on 32x32x3: 176K parameters, conv-heavy
    "resnet8w": ({"_target_": "tfkv.models.resnet.build_resnet18", "width": 8}, (32, 32, 3)),
}
# The models the training comparisons name (the dist_training and cluster suites): LeNet, the
# 5.8M-parameter MLP, a small ResNet; the names they are known by -> MODELS.
TRAINING_MODELS = {"lenet": "lenet", "mlp": "mlp5m", "resnet": "resnet8w"}
# name: (model node, as conf/model/*.yaml, input shape): lenet, mlp (5.8M parameters), resnet (small)
TRAINING = {name: MODELS[job_name] for name, job_name in TRAINING_MODELS.items()}
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
    harness.warm_up(step, WARMUP_STEPS)
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


def configured(kvstore: str, overrides: Sequence[str]) -> Any:
    """The tfkv-run config of a `kvstore` job with `overrides` (kvstore.* keys, e.g.
    kvstore.compression.type=2bit), composed as tfkv-run composes it; Failed, in one line naming
    them, when this tfkv's config lacks one (the parent checks before it starts the job)."""
    from hydra.errors import HydraException

    from tfkv.config import tree

    try:
        return tree.compose([f"kvstore={kvstore}", *overrides])
    except HydraException as e:
        raise Failed(f"the config overrides {' '.join(overrides)} do not fit this tfkv's config: "
                     f"{str(e).splitlines()[0]}") from None


def configure(kv: Any, kvstore: str, overrides: Sequence[str]) -> None:
    """`overrides` (see `configured`) given to the store as a tfkv-run job's config gives them
    (tfkv.trainer.parts.compress), so that a contender means what the same config means."""
    from tfkv.trainer import parts

    try:
        cfg = configured(kvstore, overrides)
    except Failed as e:
        sys.exit(f"jobs: {e}")
    parts.compress(cfg, kv)


def run_for(step: Callable[[], Any], rank: int, seconds: float, sync_dir: str, tag: str,
            before_timed: Callable[[], None]) -> tuple[int, float]:
    """dist_async: warm up, line up with the others on rank 0's file, then step for `seconds` of
    this worker's own clock: (steps, seconds). The workers' step counts differ (a straggler runs
    fewer), so the job's samples/s is the sum of the workers' own."""
    harness.warm_up(step, WARMUP_STEPS)
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
    with harness.closing(kv, "dist_job"):
        rank, workers = kv.rank, kv.num_workers
        if args.config:  # before any key exists, as the trainer does
            configure(kv, args.kvstore, args.config)
        elif args.compression != "none":
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

            def step() -> None:
                dp.step(x, y)
                if args.vote:  # what tfkv-run's workers add to a step when the store shares_feedback
                    kv.all_workers(True)

            timed = run_for if args.kvstore == "dist_async" else measure
            n, elapsed = timed(step, rank, args.seconds, args.sync_dir, f"steps-{args.tag}-{model}",
                               reset)
            said = {**report(dp, n, elapsed, len(x) * workers), "push_bytes": kv.push_bytes / n,
                    "timings": {k: v / n for k, v in dp.timings.items() if k != "steps"}}
            with open(os.path.join(args.out, f"{args.tag}-{model}-{rank}.json"), "w") as f:
                json.dump(said, f)


def worker_argv(model: str, batch: int, seconds: float, tmp: str, tag: str, kvstore: str = "dist_sync",
                compression: str = "none", threshold: float = 0.5, overlap: str = "graph",
                threads: int = 0, python: str = sys.executable, config: Sequence[str] = (),
                vote: bool = False) -> list[str]:
    """The command line of a worker of this module (`model`: one name or several, comma separated;
    `config`: kvstore.* overrides of a tfkv-run config, see `configure`)."""
    return [*harness.module_argv("jobs", python), "--out", tmp, "--sync-dir", tmp, "--tag", tag, "--model", model,
            "--batch", str(batch), "--seconds", str(seconds), "--kvstore", kvstore, "--compression", compression,
            "--threshold", str(threshold), "--overlap", overlap, "--threads", str(threads),
            *(a for o in config for a in ("--config", o)), *(["--vote"] if vote else [])]


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
            secure: bool = True, env: dict[str, str] | None = None, vote: bool = False) -> dict:
    """Run one dist_sync job on this machine (`workers` workers, 1 server); returns `collect`'s
    figures. Raises Failed (with the job's log tail) on any failure or hang. `secure`: with a
    fresh key for the job, as a launched job is by default; else TFKV_SECURE=0. `env`: more
    variables for every role (e.g. a knob: TFKV_TIMELINE). `vote`: each step ends with
    tfkv-run's checkpoint vote (`--vote`)."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    argv = worker_argv(model, batch, seconds, tmp, tag, compression=compression, threshold=threshold,
                       overlap=overlap, threads=threads, vote=vote)
    plan = make_plan(workers, 1, argv, [sys.executable, "-m", "tfkv.ps.node"], ["127.0.0.1"], "127.0.0.1",
                     free_port(), extra_env={**security_env(secure), **(env or {})})
    run_plan(plan, timeout, tag)
    return collect(tmp, tag, model, workers)


# -- the tf.distribute contenders' roles (python -m benchmarks dist_training --role ...) ------

def run_tfkv(args: argparse.Namespace, kind: str) -> None:
    """`local` (one process, batch 2b) or one `dist_sync` worker (batch b)."""
    import keras

    from tfkv import optim, store
    from tfkv.models import build
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel

    set_threads(args.worker_threads if kind == "dist_sync" else 0)
    tf_devices = devices.setup(["cpu:0"])
    kv = store.create(kind, devices=tf_devices)
    with harness.closing(kv, "bench_dist_training"):
        rank, workers = kv.rank, kv.num_workers
        reports = {}
        for name in args.models.split(","):
            cfg, shape = TRAINING[name]
            x, y = synthetic(2 * args.batch, shape)
            if kind == "dist_sync":
                x, y = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
            keras.utils.set_random_seed(0)
            sgd = optim.SGD(schedule=optim.Schedule(lr=LR), momentum=MOMENTUM)
            dp = DataParallel(lambda: build(cfg, input_shape=shape, num_classes=10), tf_devices, kv, sgd, [len(x)])
            n, elapsed = measure(lambda: dp.step(x, y), rank, args.seconds, args.sync_dir, f"{kind}-{name}")
            reports[name] = report(dp, n, elapsed, len(x) * workers)
        with open(os.path.join(args.out, f"{kind}-{rank}.json"), "w") as f:
            json.dump(reports, f)


def run_mwms(args: argparse.Namespace) -> None:
    """One MultiWorkerMirroredStrategy worker; TF_CONFIG is set by the parent."""
    import tensorflow as tf
    import keras

    from tfkv.models import build

    set_threads(args.worker_threads)
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    reports = {}
    for name in args.models.split(","):
        cfg, shape = TRAINING[name]
        x, y = synthetic(workers * args.batch, shape)
        x, y = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        x, y = tf.constant(x), tf.constant(y)
        global_batch = args.batch * workers
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build(cfg, input_shape=shape, num_classes=10)
            opt = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
            opt.build(model.trainable_variables)
        loss_sum = tf.Variable(0.0, dtype=tf.float64, trainable=False)

        def replica_step(x, y):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                losses = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
                loss = tf.reduce_sum(losses) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces the gradients
            return tf.reduce_sum(tf.cast(losses, tf.float64))

        @tf.function
        def train_step(x, y):
            loss_sum.assign_add(strategy.experimental_local_results(strategy.run(replica_step, args=(x, y)))[0])

        n, elapsed = measure(lambda: train_step(x, y), rank, args.seconds, args.sync_dir, f"mwms-{name}")
        seen = (WARMUP_STEPS + CALIBRATION_STEPS + 1 + n) * args.batch
        reports[name] = {"steps": n, "seconds": elapsed, "batch": global_batch, "loss": float(loss_sum.numpy()) / seen,
                         "params": int(model.count_params()),
                         "checksum": weights_checksum([v.numpy() for v in model.trainable_variables])}
    with open(os.path.join(args.out, f"mwms-{rank}.json"), "w") as f:
        json.dump(reports, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # MWMS's gRPC server can keep a process alive after the work is done


def run_pss_server(args: argparse.Namespace) -> None:
    """A ParameterServerStrategy worker or ps task: a TF server until the chief says it is done."""
    import tensorflow as tf

    set_threads(args.worker_threads)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                         protocol="grpc", start=True)
    done = os.path.join(args.sync_dir, "pss-done")
    while not os.path.exists(done):
        time.sleep(0.2)
    os._exit(0)  # a TF server has no clean stop


def run_pss(args: argparse.Namespace) -> None:
    """The ParameterServerStrategy chief: builds the model on the ps, schedules steps on the workers."""
    import tensorflow as tf

    from tfkv.models import build

    set_threads(args.worker_threads)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    reports = {}
    try:
        for name in args.models.split(","):
            cfg, shape = TRAINING[name]
            x, y = synthetic(args.batch, shape)
            with strategy.scope():
                model = build(cfg, input_shape=shape, num_classes=10)
                velocity = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]
            batches = iter(coordinator.create_per_worker_dataset(
                lambda: tf.data.Dataset.from_tensors((x, y)).repeat()))

            @tf.function
            def step(iterator):
                def replica(xb, yb):
                    with tf.GradientTape() as tape:
                        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(yb, model(xb, training=True))
                        loss = tf.reduce_mean(losses)
                    for w, v, g in zip(model.trainable_variables, velocity,
                                       tape.gradient(loss, model.trainable_variables)):
                        v.assign(MOMENTUM * v - LR * g)
                        w.assign_add(v)
                    return loss
                return strategy.run(replica, args=next(iterator))

            def steps(n: int) -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    last = coordinator.schedule(step, args=(batches,))
                coordinator.join()
                steps.loss = float(last.fetch())
                return time.perf_counter() - t0

            steps(WARMUP_STEPS * 2)
            per_step = steps(CALIBRATION_STEPS * 2) / (CALIBRATION_STEPS * 2)
            n = max(4, int(args.seconds / per_step))
            elapsed = steps(n)
            reports[name] = {"steps": n, "seconds": elapsed, "batch": args.batch, "loss": steps.loss,
                             "params": int(model.count_params())}
        with open(os.path.join(args.out, "pss-0.json"), "w") as f:
            json.dump(reports, f)
    finally:
        open(os.path.join(args.sync_dir, "pss-done"), "w").close()
    sys.stdout.flush()
    os._exit(0)


def collect_roles(tmp: str, kind: str, ranks: int) -> dict[str, dict]:
    """{model: {samples_s, params, loss}} of one job; checks that the workers agree."""
    reports = []
    for r in range(ranks):
        with open(os.path.join(tmp, f"{kind}-{r}.json")) as f:
            reports.append(json.load(f))
    out = {}
    for name in reports[0]:
        rs = [rep[name] for rep in reports]
        check_agreement(rs, f"{kind} {name}")
        out[name] = {"samples_s": rs[0]["batch"] * rs[0]["steps"] / max(r["seconds"] for r in rs),
                     "params": rs[0]["params"], "loss": rs[0]["loss"]}
    return out


# -- on the hosts of an emulated cluster (tfkv.emulate): one job per contender ------------------
#
# How each contender of the cluster suite trains on the hosts of an emulated cluster
# (tfkv.emulate): the parent side, one job per contender (tfkv: one per model), every model of the run in it.
#
# Every contender runs one worker per host with the same per-worker batch b (global batch: hosts x
# b), the same models, synthetic batch, SGD (lr 0.01, momentum 0.9) and time-based steps
# (above), the same TensorFlow thread setting, inside the hosts' CPU budgets and
# behind their links:
#
#     tfkv        tfkv-launch --launcher ssh over the cluster's sshds (ssh config: the cluster's),
#                 MXNet's placement with -n hosts -s hosts: the scheduler on host 1, one server and
#                 one worker per host; dist_sync, secure (a fresh key per job, as launched jobs are)
#     tfkv_plain  the same, --no-secure
#     tfkv_2bit   the same, with a tfkv-run config's `kvstore.compression.type=2bit` (`configure`:
#                 the accurate 2-bit), threshold 0.5
#     tfkv_2way   the same with `kvstore.compression.type=2bit kvstore.compression.both_ways=true`
#                 (the servers' replies compressed too; fails, naming the key, where tfkv lacks it)
#     tfkv_async  the same, dist_async: each worker steps for the same time on its own clock;
#                 samples/s is the sum of the workers' own
#     tfkv_spare  a worker on each of the W worker hosts and the scheduler and one server on each
#                 of S more hosts of the same budget (the cluster's last S, `role=server` in its
#                 hosts file: BytePS's placement); every other contender runs on the W worker
#                 hosts alone (an all-reduce has no use for a host without a worker)
#     mwms        tf.distribute.MultiWorkerMirroredStrategy, one worker per host (TF_CONFIG naming
#                 the hosts' addresses), started on the hosts by Host.popen; the custom loop of
#                 the dist_training suite (gRPC, ring all-reduce)
#     pss         tf.distribute.ParameterServerStrategy: one ps and one worker per host (as tfkv's
#                 servers and workers), the chief (coordinator) on host 1 beside its ps and
#                 worker, as tfkv's scheduler is
#     local       one host alone (host 1), tfkv DataParallel with the `local` store in one process,
#                 training the whole global batch (hosts x b) per step: the scaling baseline
#
# Each job runs under a time limit; its processes are killed with their process groups when it
# fails or hangs, and Failed names the contender with its log's tail.



@dataclass(frozen=True)
class Tfkv:
    """A tfkv contender: its store type, security, kvstore.* settings (a tfkv-run config's
    overrides, `configure`) and whether its servers run on the cluster's server hosts."""

    kvstore: str = "dist_sync"
    secure: bool = True
    config: tuple[str, ...] = ()
    spare: bool = False


TFKV = {"tfkv": Tfkv(), "tfkv_plain": Tfkv(secure=False),
        "tfkv_2bit": Tfkv(config=("kvstore.compression.type=2bit",)),
        "tfkv_2way": Tfkv(config=("kvstore.compression.type=2bit", "kvstore.compression.both_ways=true")),
        "tfkv_async": Tfkv(kvstore="dist_async"), "tfkv_spare": Tfkv(spare=True)}
CONTENDERS = (*TFKV, "mwms", "pss", "local")
TF_PORT = 23456  # tf.distribute's gRPC port on every host (each host has a network of its own)


@dataclass
class Settings:
    """What every contender of a run trains the same way."""

    models: list[str]  # TRAINING names
    batch: int  # per worker
    seconds: float  # timed steps per model
    threads: int  # TF intra/inter-op threads per process (0: TensorFlow's default)
    timeout: float  # seconds before a job counts as hung
    server_hosts: int = 0  # the cluster's last hosts, tfkv_spare's server hosts (the others ignore them)
    timeline: Path | None = None  # a tfkv job's kvstore.timeline: <timeline>/<model>/, merged into timeline.json


def run(contender: str, cluster: Any, hosts_file: Path, s: Settings, tmp: Path) -> dict[str, dict]:
    """{model: collect's figures} of one job of `contender` on the worker hosts of `cluster` (all
    but its last `s.server_hosts`; tfkv_spare: its servers on those)."""
    hosts = cluster.hosts[:len(cluster.hosts) - s.server_hosts]
    n = len(hosts)
    if contender in TFKV:
        c = TFKV[contender]
        servers = [h.name for h in cluster.hosts[n:]] if c.spare else []
        if c.config:
            configured(c.kvstore, c.config)  # a key this tfkv lacks: Failed before any job starts
        if s.server_hosts:  # the worker hosts alone, or with the server hosts
            hosts_file = cluster.write_hosts(tmp / "hosts", hosts=[h.name for h in hosts] + servers, servers=servers)
        for m in s.models:  # a job per model: a model's keys start at 0, DataParallel's
            worker = worker_argv(TRAINING_MODELS[m], s.batch, s.seconds, str(tmp), contender, kvstore=c.kvstore,
                                 threads=s.threads, config=c.config)
            where = s.timeline / m if s.timeline else None
            launch_tfkv(cluster, hosts_file, worker, c.secure, tmp / f"launch-{m}", s.timeout,
                        f"{contender} {c.kvstore}", workers=n, servers=len(servers) or n,
                        env={"TFKV_TIMELINE": str(where)} if where else None)
            if where:
                _merge_timeline(where)
        return _collect(tmp, contender, s.models, n, synchronous=c.kvstore == "dist_sync")
    if contender == "local":
        argv = worker_argv(_job_models(s), n * s.batch, s.seconds, str(tmp), "local", kvstore="local",
                                    threads=s.threads)
        supervise([(hosts[0], argv, {})], s.timeout, "local", tmp)
        return _collect(tmp, "local", s.models, 1)
    if contender == "mwms":
        workers = [f"{h.address}:{TF_PORT}" for h in hosts]
        tasks = [(h, _role_argv("mwms", s, tmp), _tf_config({"worker": workers}, "worker", i))
                 for i, h in enumerate(hosts)]
        supervise(tasks, s.timeout, "mwms", tmp)
        return {m: r for m, r in collect_roles(str(tmp), "mwms", n).items()}
    if contender == "pss":
        spec = {"chief": [f"{hosts[0].address}:{TF_PORT + 2}"],
                "worker": [f"{h.address}:{TF_PORT}" for h in hosts],
                "ps": [f"{h.address}:{TF_PORT + 1}" for h in hosts]}
        tasks = [(hosts[0], _role_argv("pss", s, tmp), _tf_config(spec, "chief", 0))]
        for kind in ("ps", "worker"):
            tasks += [(h, _role_argv("pss_server", s, tmp), _tf_config(spec, kind, i))
                      for i, h in enumerate(hosts)]
        supervise(tasks, s.timeout, "pss", tmp)
        return collect_roles(str(tmp), "pss", 1)
    raise ValueError(f"unknown contender {contender!r}; known: {', '.join(CONTENDERS)}")


def _merge_timeline(where: Path) -> None:
    """The roles' timeline files of one job, merged into where/timeline.json."""
    from tfkv import timeline

    (where / "timeline.json").write_text(json.dumps(timeline.merge(sorted(where.glob("*-*.json")))))


def _job_models(s: Settings) -> str:
    return ",".join(TRAINING_MODELS[m] for m in s.models)


def _collect(tmp: Path, tag: str, models: list[str], workers: int, synchronous: bool = True) -> dict[str, dict]:
    return {m: collect(str(tmp), tag, TRAINING_MODELS[m], workers, synchronous) for m in models}


def _tf_config(cluster_spec: dict, kind: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": {"type": kind, "index": index}})}


def _role_argv(role: str, s: Settings, tmp: Path) -> list[str]:
    """A worker, ps or chief of the dist_training suite's tf.distribute contenders."""
    return [*harness.suite_argv("dist_training"), "--role", role, "--out", str(tmp), "--sync-dir", str(tmp),
            "--models", ",".join(s.models), "--batch", str(s.batch), "--seconds", str(s.seconds),
            "--worker-threads", str(s.threads)]


def launch_tfkv(cluster: Any, hosts_file: Path, worker: list[str], secure: bool, run_dir: Path, timeout: float,
                what: str, python: str = sys.executable, workers: int | None = None,
                servers: int | None = None, env: dict[str, str] | None = None) -> None:
    """`worker` as a tfkv job through tfkv-launch's ssh launcher on the hosts of `hosts_file`:
    `workers` workers and `servers` servers (default: one each per host of `cluster`), placed by
    the launcher (MXNet's placement, or the server hosts the file names); Failed with the log's
    tail if it fails or runs past `timeout` (tfkv-launch is then interrupted: it stops every role
    on every host). `env`: knobs for tfkv-launch to hand every role (e.g. TFKV_TIMELINE)."""
    n = len(cluster.hosts)
    argv = [sys.executable, "-m", "tfkv.launcher.cli", "-n", str(workers or n), "-s", str(servers or n),
            "-H", str(hosts_file),
            "--launcher", "ssh", "--python", python, "--run-dir", str(run_dir),
            "--secure" if secure else "--no-secure", "--", *worker]
    log = Path(f"{run_dir}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **cluster.env(), **(env or {})}, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # tfkv-launch stops every role on every host, then exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise Failed(f"{what} ran past {timeout:.0f} s\n{_tail(log)}") from None
    if code != 0:
        raise Failed(f"{what} exited with status {code}\n{_tail(log)}")


def supervise(tasks: Sequence[tuple[Any, list[str], dict[str, str]]], timeout: float, what: str, tmp: Path) -> None:
    """Start each (host, argv, env) on its host (Host.popen), each in a process group of its own
    and with a log of its own under `tmp`; wait for all. The first to fail, or the time limit,
    kills every group and raises Failed with that process's log tail."""
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        for i, (host, argv, env) in enumerate(tasks):
            log = tmp / f"{what}-{i}-{host.name}.log"
            with open(log, "w") as out:
                procs.append((host.popen(argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True), log))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p, _ in procs]
            bad = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if bad is not None:
                raise Failed(f"{what} process {bad} ({tasks[bad][0].name}) exited with status {codes[bad]}\n"
                             f"{_tail(procs[bad][1])}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                raise Failed(f"{what} ran past {timeout:.0f} s\n{_tail(procs[0][1])}")
            time.sleep(0.2)
    finally:
        for p, _ in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


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
    ap.add_argument("--vote", action="store_true",
                    help="end each step with the vote on worker 0's checkpoint decision (tfkv.trainer.hooks)")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                    help="a kvstore.* setting of a tfkv-run config, taken as tfkv-run takes it (instead of "
                         "--compression/--threshold)")
    args = ap.parse_args()
    unknown = [m for m in args.model.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    worker(args)


if __name__ == "__main__":
    main()
