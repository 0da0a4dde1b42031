"""Training samples/s of tfkv `dist_sync` (2 local workers, 1 server) against `local` in one
process, tf.distribute MultiWorkerMirroredStrategy (2 local workers) and ParameterServerStrategy
(2 workers, 1 parameter server), same run.

Five contenders train the same model on the same synthetic in-memory batch with SGD (lr 0.01,
momentum 0.9), the loss being the mean over the global batch of 2 x b examples:

    local      tfkv DataParallel + KVStore `local`, one process, one device, batch 2 x b
    dist_sync  tfkv DataParallel + KVStore `dist_sync`, 2 worker processes (b each) and 1 server,
               started by tfkv.launcher (make_plan + local.run); the server runs the optimizer;
               secure, as a launched job is by default (a fresh key for the job)
    plain      the same job with TFKV_SECURE=0 (cluster.secure=false): what security costs
    MWMS       tf.distribute.MultiWorkerMirroredStrategy, 2 worker processes (b each; TF_CONFIG
               with two 127.0.0.1 ports, gRPC + ring all-reduce), the model built inside
               strategy.scope(), a custom loop: tf.function(strategy.run(step)) with GradientTape
               and keras SGD.apply_gradients (the loop bench_local_step.py uses as its baseline).
               model.fit is no alternative: with Keras 3 it fails under MWMS ("Attempt to convert
               a value (PerReplica...) to a Tensor", keras-team/keras#20585)
    PSS        tf.distribute.ParameterServerStrategy: a chief (the coordinator) schedules steps on
               2 worker processes (b each) against 1 parameter-server process (TF_CONFIG, gRPC);
               the model built inside strategy.scope() (its variables live on the ps), a
               tf.function step per worker with GradientTape and SGD momentum written as TF ops
               on momentum variables on the ps (v = 0.9 v - lr g; w += v, Keras SGD's rule), the
               batches from coordinator.create_per_worker_dataset. PSS is asynchronous (each
               step updates the ps on its own), so its samples/s is steps x b / the chief's time

Models: LeNet (tfkv `lenet`) and an MLP of ~5.8M parameters (tfkv `mlp`, hidden [2048, 2048]),
28x28x1 inputs, 10 classes, b = 64 per worker (and `resnet`, ResNet-18 at 1/8 width on 32x32x3,
with --models: dist_job.TRAINING_MODELS). The MWMS and PSS roles serve bench_cluster.py too,
with one worker per emulated host. Each process traces and warms up, times a few
calibration steps, and then runs a fixed number of steps lasting about `--seconds` (the workers of
a job must run the same count, so rank 0 picks it and writes it to a file the others wait for).
Samples/s is for the whole job: global batch x steps / the slowest worker's time. After the timed
steps both workers' weights are compared (they must agree), so a baseline that silently stopped
synchronising cannot win. Trials alternate between contenders (order reversed every other trial)
and the median is reported, because this machine is shared and noisy.

    python benchmarks/bench_dist_training.py [--seconds 2] [--trials 4] [--models lenet,mlp] [--no-pss]
                                             [--batch 64] [--worker-threads 0]

Every process runs in its own process group under a timeout and is killed with its group when it
hangs (MWMS workers can); the script exits non-zero if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dist_job  # noqa: E402
import record  # noqa: E402 - benchmarks/record.py
from dist_job import (CALIBRATION_STEPS, LR, MOMENTUM, WARMUP_STEPS, Failed, check_agreement,  # noqa: E402
                      measure, report, run_plan, security_env, set_threads, synthetic, weights_checksum)

# name: (model node, as conf/model/*.yaml, input shape): lenet, mlp (5.8M parameters), resnet (small)
MODELS = {name: dist_job.MODELS[job_name] for name, job_name in dist_job.TRAINING_MODELS.items()}

# -- inside a worker process ------------------------------------------------------------------

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
    try:
        rank, workers = kv.rank, kv.num_workers
        reports = {}
        for name in args.models.split(","):
            cfg, shape = MODELS[name]
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
    except BaseException:
        kv.abort("bench_dist_training worker failed")
        raise
    kv.close()


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
        cfg, shape = MODELS[name]
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
            cfg, shape = MODELS[name]
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


# -- the parent: launching, timeouts, teardown ------------------------------------------------

def run_processes(envs: list[dict[str, str]], argv: list[str], timeout: float, what: str) -> None:
    """One process per env, run as a job by tfkv.launcher (its supervisor names the first failure
    and tears every process group down, also on timeout); Failed with the log's tail."""
    from tfkv.launcher.plan import Process

    plan = [Process(f"{what} process {i}", "worker", i, "127.0.0.1", argv, env) for i, env in enumerate(envs)]
    run_plan(plan, timeout, what)


def job_local(args, tmp: str) -> None:
    run_processes([{}], worker_argv(args, "local", tmp), args.job_timeout, "local")


def job_mwms(args, tmp: str) -> None:
    from tfkv.launcher.ports import free_port

    ports = [free_port(), free_port()]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    envs = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})} for i in range(2)]
    run_processes(envs, worker_argv(args, "mwms", tmp), args.job_timeout, "MWMS")


def job_pss(args, tmp: str) -> None:
    from tfkv.launcher.plan import Process
    from tfkv.launcher.ports import free_port

    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)],
               "ps": [f"127.0.0.1:{free_port()}"]}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    envs = [{"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": t, "index": i}})} for t, i in tasks]
    plan = [Process(f"PSS {t} {i}", "worker", rank, "127.0.0.1", worker_argv(args, "pss" if t == "chief" else "pss_server",
                                                                              tmp), env)
            for rank, ((t, i), env) in enumerate(zip(tasks, envs))]
    run_plan(plan, args.job_timeout, "ParameterServerStrategy")


def job_dist_sync(args, tmp: str, model: str, secure: bool = True) -> None:
    """One dist_sync job: secure as a launched job is by default (a fresh key for the job), or
    plain (TFKV_SECURE=0, what `cluster.secure=false` gives)."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    plan = make_plan(2, 1, worker_argv(args, "dist_sync", tmp, models=model), [sys.executable, "-m", "tfkv.ps.node"],
                     ["127.0.0.1"], "127.0.0.1", free_port(), extra_env=security_env(secure))
    run_plan(plan, args.job_timeout, f"dist_sync {model}{'' if secure else ' (plain)'}")


def worker_argv(args, role: str, tmp: str, models: str | None = None) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--role", role, "--out", tmp, "--sync-dir", tmp,
            "--models", models or args.models, "--batch", str(args.batch), "--seconds", str(args.seconds),
            "--worker-threads", str(args.worker_threads)]


def collect(tmp: str, kind: str, ranks: int) -> dict[str, dict]:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="timed steps per model, contender and trial")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--models", default="lenet,mlp")
    ap.add_argument("--batch", type=int, default=64, help="per worker (local trains on 2x this)")
    ap.add_argument("--worker-threads", type=int, default=0,
                    help="TF intra/inter-op threads per distributed worker (0: TensorFlow's default)")
    ap.add_argument("--job-timeout", type=float, default=150.0, help="seconds before a job counts as hung")
    ap.add_argument("--no-pss", action="store_true", help="leave ParameterServerStrategy out")
    ap.add_argument("--role", choices=["local", "dist_sync", "mwms", "pss", "pss_server"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", help=argparse.SUPPRESS)
    record.add_argument(ap, "dist_training")
    args = ap.parse_args()
    for m in args.models.split(","):
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    if args.role == "mwms":
        return run_mwms(args)
    if args.role == "pss":
        return run_pss(args)
    if args.role == "pss_server":
        return run_pss_server(args)
    if args.role:
        return run_tfkv(args, args.role)

    models = args.models.split(",")
    print(f"training samples/s (whole job), median of {args.trials} trials of ~{args.seconds:g} s; "
          f"b={args.batch} per worker, global batch {2 * args.batch}; SGD momentum {MOMENTUM}; "
          f"MWMS baseline: custom loop (tf.function(strategy.run) + GradientTape + keras SGD; "
          f"Keras 3 model.fit fails under MWMS); PSS: custom step scheduled by a ClusterCoordinator", flush=True)
    contenders = ["local", "dist_sync", "dist_plain", "mwms"] + ([] if args.no_pss else ["pss"])
    samples: dict[tuple[str, str], list[float]] = {}
    info: dict[str, dict] = {}
    t_start = time.monotonic()
    try:
        for trial in range(args.trials):
            for kind in (contenders if trial % 2 == 0 else contenders[::-1]):
                with tempfile.TemporaryDirectory(prefix="bench_dist_training_") as tmp:
                    if kind == "local":
                        job_local(args, tmp)
                        got = collect(tmp, "local", 1)
                    elif kind == "mwms":
                        job_mwms(args, tmp)
                        got = collect(tmp, "mwms", 2)
                    elif kind == "pss":
                        job_pss(args, tmp)
                        got = collect(tmp, "pss", 1)
                    else:
                        got = {}
                        for m in models:
                            job_dist_sync(args, tmp, m, secure=kind == "dist_sync")
                            got.update(collect(tmp, "dist_sync", 2))
                for m, r in got.items():
                    samples.setdefault((kind, m), []).append(r["samples_s"])
                    info.setdefault(m, {})[kind] = r
            print(f"  trial {trial + 1}/{args.trials} done ({time.monotonic() - t_start:.0f} s)", flush=True)
    except (Failed, OSError, ValueError, KeyError) as e:
        print(f"bench_dist_training: FAILED: {e}", file=sys.stderr)
        sys.exit(1)

    med = {k: statistics.median(v) for k, v in samples.items()}
    pss = "pss" in contenders
    print(f"{'model':<6} {'params':>10} {'local':>9} {'MWMS':>9} " + (f"{'PSS':>9} " if pss else "")
          + f"{'dist_sync':>10} {'plain':>9} {'dist/MWMS':>10} " + (f"{'dist/PSS':>9} " if pss else "")
          + f"{'dist/local':>11} {'secure/plain':>13}   (samples/s)")
    slower, rows = [], []
    for m in models:
        params = {info[m][k]["params"] for k in contenders}
        if len(params) != 1:
            print(f"bench_dist_training: FAILED: {m} has different parameter counts {params}", file=sys.stderr)
            sys.exit(1)
        lo, mw, ds, pl = med[("local", m)], med[("mwms", m)], med[("dist_sync", m)], med[("dist_plain", m)]
        ps = med[("pss", m)] if pss else None
        print(f"{m:<6} {params.pop():>10,} {lo:>9.0f} {mw:>9.0f} " + (f"{ps:>9.0f} " if pss else "")
              + f"{ds:>10.0f} {pl:>9.0f} {ds / mw:>10.3f} " + (f"{ds / ps:>9.3f} " if pss else "")
              + f"{ds / lo:>11.3f} {ds / pl:>13.3f}")
        rows.append({"model": m, "params": info[m]["local"]["params"], "local": lo, "MWMS": mw,
                     **({"PSS": ps} if pss else {}), "dist_sync": ds, "plain": pl, "dist_sync/MWMS": ds / mw,
                     **({"dist_sync/PSS": ds / ps} if pss else {}), "dist_sync/local": ds / lo, "secure/plain": ds / pl})
        if ds <= mw:
            slower.append(m)
    print(f"Targets (secure dist_sync): >= 1.3x MWMS, >= 1.2x PSS, secure/plain >= 0.9. "
          f"dist_sync faster than MultiWorkerMirroredStrategy: "
          f"{'met' if not slower else 'NOT met for ' + ', '.join(slower)}. Both run 2 workers on this "
          f"machine's cores, so neither can beat `local` here; dist/local shows the cost of distribution. "
          f"dist_sync is secure, as a launched job is by default; plain = cluster.secure=false (target: "
          f"secure costs <= 10%, secure/plain >= 0.9).")
    print("per-trial samples/s: " + "; ".join(
        f"{k} {m} " + "/".join(f"{v:.0f}" for v in samples[(k, m)]) for m in models for k in contenders))
    record.write(args.result, "dist_training", record.settings_of(args), rows)


if __name__ == "__main__":
    main()
