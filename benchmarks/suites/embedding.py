"""A large embedding table trained by tfkv (dist_sync, row-sparse, ShardedEmbedding) against
tf.distribute's ParameterServerStrategy with partitioned variables, same run, same model, same data:
samples/s, bytes on the wire per step, and the peak memory of every process.

Both contenders train the DLRM-like model of tfkv.models.dlrm (bottom MLP [64, dim], one table of
`--dim` float32 per categorical feature, `--tables` rows each, the first of at least 10M rows by
default, dot interaction, top MLP [64, 32], one logit) on the same synthetic click log
(tfkv.data.clicks: Zipf ids, one pool of `--pool` batches per worker, drawn once from seed 0),
with plain SGD (lr `--lr`, lazy: only the rows a batch touched change), 2 workers and 2 servers:

    tfkv   DataParallel + KVStore `dist_sync` (2 worker processes, 2 servers, a scheduler, started
           by tfkv.launcher make_plan + local.run, secure as a launched job is by default); each
           table a tfkv.layers.ShardedEmbedding: the rows live on the servers, sharded by range;
           a worker pulls the rows of its next batch while the current one computes (the trainer's
           prefetch) and pushes the rows it touched. Bytes per step: the store's push_bytes +
           pull_bytes counters (payload), per worker, over the timed steps. The workers' dense
           weights must agree at the end (a job that stopped synchronising fails).
    PSS    tf.distribute.ParameterServerStrategy: a chief (the ClusterCoordinator) schedules steps
           on 2 worker tasks against 2 ps tasks (TF_CONFIG, gRPC, in subprocesses on 127.0.0.1);
           built inside strategy.scope() with variable_partitioner=MinSizePartitioner (the tables
           split in one shard per ps, each shard initialised on its ps); the same model in TF ops
           (tf.nn.embedding_lookup on the ShardedVariable), each shard updated by scatter_sub of
           its IndexedSlices gradient; batches from coordinator.create_per_worker_dataset. PSS is
           asynchronous, so its samples/s is steps x b / the chief's time. Bytes per step are an
           estimate (TF counts none): the rows it gathers and the rows it scatters (one per id of
           the batch, no dedup: embedding_lookup gathers duplicates), plus every dense weight read
           and its gradient written, 4 bytes a float.

Peak memory: each process's VmHWM (/proc/<pid>/status), polled by this script every 50 ms
(workers and the chief also report their own at the end); the table itself is `table_bytes`.

    python -m benchmarks embedding [--tables 10000000,100000] [--dim 64] [--batch 4096]
        [--seconds 10] [--trials 1] [--contenders tfkv,pss,tfkv_plain] [--emulate 10gbit --cpus 0.9] [--json OUT]

Where: on loopback (127.0.0.1, every process on this machine), or with --emulate LINK on an
emulated cluster (tfkv.emulate, needs root): 2 hosts of --cpus cores and LINK links, each a worker
and a server (tfkv: tfkv-launch --launcher ssh, as the cluster benchmark; PSS: a ps and a worker per
host, the chief on the first). The output and the record's `network` say which.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import harness, jobs  # noqa: E402
from benchmarks.jobs import (CALIBRATION_STEPS, WARMUP_STEPS, Failed, check_agreement, measure, run_plan,  # noqa: E402
                             run_pss_server, security_env, weights_checksum)


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Embedding tables larger than a worker",
    "Samples/s, bytes per step (per worker) and every process's peak memory of a DLRM with a table of "
    "10M+ rows trained by tfkv (`dist_sync`, row-sparse, `ShardedEmbedding`) against "
    "`ParameterServerStrategy` with partitioned variables, 2 workers and 2 servers each, same run; the "
    "network (emulated cluster or loopback) is the row's. PSS's bytes are an estimate.",
    ["contender"], ["samples_per_sec"], "samples/s",
    columns=["contender", "samples_per_sec", "bytes_per_step", "bytes_measured", "worker_peak_rss_mib",
             "server_peak_rss_mib", "table_mib", "network"])


WORKERS, SERVERS = 2, 2
BOTTOM, TOP = [64], [64, 32]
NUM_DENSE = 8
MARK, ROLE = "TFKV_BENCH_RUN", "TFKV_BENCH_ROLE"  # in the environment of every process of a run
CONTENDERS = ("tfkv", "pss", "tfkv_plain")  # tfkv_plain (TFKV_SECURE=0, as PSS's gRPC is) when named


def spec_of(args: argparse.Namespace) -> Any:
    from tfkv.data.clicks import Clicks

    return Clicks(num_dense=NUM_DENSE, vocab_sizes=tuple(args.table_rows))


def pool(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """The examples every contender's workers draw their batches from (seed 0, stream 1)."""
    from tfkv.data.clicks import generate

    return generate(spec_of(args), 0, args.batch * args.pool * WORKERS, stream=1)


def peak_rss_mib(pid: int | str = "self") -> float:
    """A process's peak resident set (VmHWM), in MiB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return 0.0


def dense_params(args: argparse.Namespace) -> int:
    """The weights outside the tables (the MLPs), as tfkv.models.dlrm.build makes them."""
    sizes = [NUM_DENSE, *BOTTOM, args.dim]
    n = sum(a * b + b for a, b in zip(sizes, sizes[1:]))
    features = len(args.table_rows) + 1
    width = args.dim + features * (features - 1) // 2
    for units in [*TOP, 1]:
        n += width * units + units
        width = units
    return n


# -- the PSS chief and its tasks --------------------------------------------------------------

def run_pss(args: argparse.Namespace) -> None:
    """The chief: the model's variables on the ps tasks (tables partitioned), steps scheduled."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute.sharded_variable import ShardedVariable

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1 << 20, max_shards=SERVERS)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    try:
        dense, cat, click = pool(args)
        rng = np.random.default_rng(0)

        def uniform(shape: tuple[int, ...], scale: float) -> Any:
            # called on the ps, one shard at a time (the partition_* arguments say which)
            def init(partition_shape: Any = None, partition_offset: Any = None) -> Any:
                return tf.random.uniform(partition_shape or shape, -scale, scale, seed=int(rng.integers(1 << 30)))
            return tf.Variable(init, shape=shape, dtype=tf.float32)

        with strategy.scope():
            tables = [uniform((rows, args.dim), 0.05) for rows in args.table_rows]
            layers = []
            for sizes in ([NUM_DENSE, *BOTTOM, args.dim], None):
                if sizes is None:
                    f = len(tables) + 1
                    sizes = [args.dim + f * (f - 1) // 2, *TOP, 1]
                layers.append([(uniform((a, b), (6.0 / (a + b)) ** 0.5), tf.Variable(tf.zeros([b])))
                               for a, b in zip(sizes, sizes[1:])])
        bottom, top = layers
        # a table too small to split (under 2 MiB) is one variable on one ps
        shards = [s for t in tables for s in (t.variables if isinstance(t, ShardedVariable) else [t])]
        weights = [w for layer in layers for pair in layer for w in pair]
        n = len(tables) + 1
        pairs = [i * n + j for i in range(n) for j in range(i + 1, n)]

        def mlp(x: Any, stack: list, last_relu: bool) -> Any:
            for i, (w, b) in enumerate(stack):
                x = tf.matmul(x, w) + b
                if last_relu or i < len(stack) - 1:
                    x = tf.nn.relu(x)
            return x

        def replica(xd: Any, xc: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                b = mlp(xd, bottom, True)
                vectors = [b] + [tf.nn.embedding_lookup(t, xc[:, i]) for i, t in enumerate(tables)]
                stacked = tf.stack(vectors, axis=1)
                dots = tf.reshape(tf.einsum("nid,njd->nij", stacked, stacked), (-1, n * n))
                logit = mlp(tf.concat([b, tf.gather(dots, pairs, axis=1)], axis=1), top, False)
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, logit))
            grads = tape.gradient(loss, shards + weights)
            for v, g in zip(shards + weights, grads):
                if isinstance(g, tf.IndexedSlices):  # a table shard: only the rows looked up change
                    v.scatter_sub(tf.IndexedSlices(args.lr * g.values, g.indices, g.dense_shape))
                else:
                    v.assign_sub(args.lr * g)
            return loss

        def dataset_fn() -> Any:
            data = tf.data.Dataset.from_tensor_slices((dense, cat, click[:, None]))
            return data.shuffle(len(click)).batch(args.batch, drop_remainder=True).repeat()

        batches = iter(coordinator.create_per_worker_dataset(dataset_fn))

        @tf.function
        def step(iterator: Any) -> Any:
            return strategy.run(replica, args=next(iterator))

        def steps(count: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            results = [coordinator.schedule(step, args=(batches,)) for _ in range(count)]
            coordinator.join()
            return time.perf_counter() - t0, float(np.mean([r.fetch() for r in results[-10:]]))

        steps(WARMUP_STEPS * WORKERS)
        per_step = steps(CALIBRATION_STEPS * WORKERS)[0] / (CALIBRATION_STEPS * WORKERS)
        count = max(4, int(args.seconds / per_step))
        elapsed, loss = steps(count)
        ids = args.batch * len(args.table_rows)
        estimate = 4 * (2 * ids * args.dim + 2 * dense_params(args))  # rows gathered + scattered, weights + grads
        out = {"steps": count, "seconds": elapsed, "samples": count * args.batch, "loss": loss,
               "bytes_per_step": estimate, "bytes_measured": False, "chief_peak_rss_mib": peak_rss_mib()}
        Path(args.out, "pss.json").write_text(json.dumps(out))
    finally:
        Path(args.sync_dir, "pss-done").touch()
    sys.stdout.flush()
    os._exit(0)


def job_pss(args: argparse.Namespace, tmp: str, cluster: Any = None) -> None:
    """The chief, the workers and the ps tasks: on 127.0.0.1, or on the emulated hosts (the chief
    on the first beside its ps and worker, as tfkv's scheduler; one ps and one worker per host)."""
    from tfkv.launcher.plan import Process
    from tfkv.launcher.ports import free_port

    tasks = [("chief", 0)] + [("worker", i) for i in range(WORKERS)] + [("ps", i) for i in range(SERVERS)]
    if cluster is None:
        spec = {"chief": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(WORKERS)],
                "ps": [f"127.0.0.1:{free_port()}" for _ in range(SERVERS)]}
    else:
        port = jobs.TF_PORT
        spec = {"chief": [f"{cluster.hosts[0].address}:{port + 2}"],
                "worker": [f"{h.address}:{port}" for h in cluster.hosts],
                "ps": [f"{h.address}:{port + 1}" for h in cluster.hosts]}
    argv = {t: role_argv(args, "pss" if t == "chief" else "pss_server", tmp) for t, _ in tasks}
    env = {(t, i): {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": t, "index": i}}), ROLE: f"{t} {i}"}
           for t, i in tasks}
    if cluster is None:
        run_plan([Process(f"PSS {t} {i}", "worker", rank, "127.0.0.1", argv[t], env[(t, i)])
                  for rank, (t, i) in enumerate(tasks)], args.job_timeout, "ParameterServerStrategy")
    else:
        jobs.supervise([(cluster.hosts[i], argv[t], env[(t, i)]) for t, i in tasks], args.job_timeout,
                               "pss", Path(tmp))


# -- tfkv ------------------------------------------------------------------------------------------

def run_tfkv(args: argparse.Namespace) -> None:
    """One tfkv worker: DataParallel over the model with ShardedEmbedding tables, store dist_sync."""
    import keras

    from tfkv import optim, store
    from tfkv.models import dlrm
    from tfkv.parallel import devices
    from tfkv.parallel.criterion import Criterion
    from tfkv.parallel.data_parallel import DataParallel

    tf_devices = devices.setup(["cpu:0"])
    kv = store.create("dist_sync", devices=tf_devices)
    with harness.closing(kv, "bench_embedding"):
        rank = kv.rank
        dense, cat, click = pool(args)
        lo, hi = rank * args.batch * args.pool, (rank + 1) * args.batch * args.pool  # this worker's slice
        batches = [({"dense": dense[i:i + args.batch], "cat": cat[i:i + args.batch]}, click[i:i + args.batch, None])
                   for i in range(lo, hi, args.batch)]
        keras.utils.set_random_seed(0)
        dp = DataParallel(
            lambda: dlrm.build({"dense": (NUM_DENSE,), "cat": (len(args.table_rows),)}, vocab_sizes=args.table_rows,
                               embedding_dim=args.dim, bottom=BOTTOM, top=TOP, embedding="sharded",
                               rows_per_batch=args.batch),
            tf_devices, kv, optim.SGD(schedule=optim.Schedule(lr=args.lr)), [args.batch],
            criterion=Criterion({"_target_": "keras.losses.BinaryCrossentropy", "from_logits": True}, []))
        count = iter(range(1 << 62))

        def step() -> None:
            i = next(count) % len(batches)
            dp.step(*batches[i], batches[(i + 1) % len(batches)][0])

        def reset() -> None:
            dp.take_metrics()
            dp.reset_timings()
            kv.push_bytes = 0
            if hasattr(kv, "pull_bytes"):
                kv.pull_bytes = 0

        n, elapsed = measure(step, rank, args.seconds, args.sync_dir, "tfkv", before_timed=reset)
        moved = kv.push_bytes + getattr(kv, "pull_bytes", 0)
        out = {"steps": n, "seconds": elapsed, "samples": n * args.batch * kv.num_workers,
               "loss": dp.take_metrics()[0]["loss"], "bytes_per_step": moved / n,
               "bytes_measured": hasattr(kv, "pull_bytes"), "peak_rss_mib": peak_rss_mib(),
               "ms_per_step": {k: 1000 * v / n for k, v in dp.timings.items() if k != "steps"},
               "checksum": weights_checksum(dp.params[0])}  # the dense weights: every worker's alike
        Path(args.out, f"tfkv-{rank}.json").write_text(json.dumps(out))


def job_tfkv(args: argparse.Namespace, tmp: str, secure: bool = True, cluster: Any = None) -> None:
    """2 workers, 2 servers and a scheduler: on 127.0.0.1 (make_plan + local.run), or on the
    emulated hosts through tfkv-launch --launcher ssh (one server and one worker per host)."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    what = f"tfkv dist_sync{'' if secure else ' (plain)'}"
    worker = role_argv(args, "tfkv", tmp)
    if cluster is not None:
        jobs.launch_tfkv(cluster, args.hosts_file, [args.python, *worker[1:]], secure, Path(tmp, "launch"),
                                 args.job_timeout, what, python=args.python)
        return
    plan = make_plan(WORKERS, SERVERS, worker, [sys.executable, "-m", "tfkv.ps.node"],
                     ["127.0.0.1"], "127.0.0.1", free_port(), extra_env=security_env(secure))
    run_plan(plan, args.job_timeout, what)


def collect_tfkv(tmp: str, peaks: dict[str, float]) -> dict[str, Any]:
    """The job's figures: samples/s over the slowest worker's time, bytes per step per worker."""
    reports = [json.loads(Path(tmp, f"tfkv-{r}.json").read_text()) for r in range(WORKERS)]
    check_agreement(reports, "tfkv")  # same steps, same dense weights, a finite loss
    for r, rep in enumerate(reports):
        peaks[f"worker {r}"] = max(peaks.get(f"worker {r}", 0.0), rep["peak_rss_mib"])
    return {"steps": reports[0]["steps"], "seconds": max(r["seconds"] for r in reports),
            "samples": reports[0]["samples"], "loss": reports[0]["loss"],
            "bytes_per_step": sum(r["bytes_per_step"] for r in reports) / WORKERS,
            "bytes_measured": reports[0]["bytes_measured"], "ms_per_step": reports[0]["ms_per_step"]}


# -- the parent ---------------------------------------------------------------------------------

class PeakWatch:
    """Polls the VmHWM of every process of this run, on this machine or an emulated host (they
    share /proc): those whose environment holds MARK=<this run's id> (set in this process's
    environment, so inherited, and forwarded over ssh by tfkv-launch as every TFKV_ variable),
    named by their role (ROLE, or DMLC_ROLE and the launcher's rank hint for tfkv's): {role: MiB}."""

    def __init__(self, interval: float = 0.05) -> None:
        self.peaks: dict[str, float] = {}
        self.run_id = uuid.uuid4().hex
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakWatch:
        os.environ[MARK] = self.run_id
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()
        os.environ.pop(MARK, None)

    def _role(self, pid: str) -> str | None:
        """The process's role; '' when it is not of this run (yet: a child between fork and exec)."""
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except (OSError, UnicodeDecodeError):
            return ""
        if env.get(MARK) != self.run_id:
            return ""
        if ROLE in env:
            return env[ROLE]
        role = env.get("DMLC_ROLE")
        if role in ("worker", "server"):  # tfkv's: the launcher's rank hint numbers them
            return f"{role} {env.get('TFKV_RANK_HINT', '?')}"
        return role

    def _run(self) -> None:
        roles: dict[str, str | None] = {}  # None: not of this run, for good
        me = str(os.getpid())
        while not self._stop.wait(self._interval):
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or pid == me or roles.get(pid, "") is None:
                    continue
                if not roles.get(pid):
                    role = self._role(pid)
                    # a process older than a second that is not of this run never will be
                    roles[pid] = role or (None if _age(pid) > 1.0 else "")
                if roles[pid]:
                    self.peaks[roles[pid]] = max(self.peaks.get(roles[pid], 0.0), peak_rss_mib(pid))


def _age(pid: str) -> float:
    """Seconds since process `pid` started (0 if unknown)."""
    try:
        start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - start / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def role_argv(args: argparse.Namespace, role: str, tmp: str) -> list[str]:
    return [*harness.suite_argv("embedding"), "--role", role, "--out", tmp, "--sync-dir", tmp,
            "--tables", args.tables, "--dim", str(args.dim), "--batch", str(args.batch), "--pool", str(args.pool),
            "--lr", str(args.lr), "--seconds", str(args.seconds), "--worker-threads", str(args.worker_threads)]


def run_contender(args: argparse.Namespace, contender: str, cluster: Any = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench_embedding_{contender}_", dir="/tmp") as tmp, PeakWatch() as watch:
        if contender == "pss":
            job_pss(args, tmp, cluster)
            got = json.loads(Path(tmp, "pss.json").read_text())
            watch.peaks["chief 0"] = max(watch.peaks.get("chief 0", 0.0), got.pop("chief_peak_rss_mib"))
        else:
            job_tfkv(args, tmp, secure=contender == "tfkv", cluster=cluster)
            got = collect_tfkv(tmp, watch.peaks)
    got["peaks"] = dict(sorted(watch.peaks.items()))
    return got


def host_specs(args: argparse.Namespace) -> list[Any]:
    from tfkv.emulate import HostSpec

    return [HostSpec(f"node{i + 1}", cpus=args.cpus, link=args.emulate) for i in range(WORKERS)]


def run_trials(args: argparse.Namespace, contenders: list[str], cluster: Any) -> tuple[dict[str, list], bool]:
    """Every contender `--trials` times, the order reversed every other trial: ({contender: [its
    figures per trial]}, whether one failed)."""
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    failed = False
    for trial in range(args.trials):
        for contender in harness.alternating(contenders, trial):
            try:
                got = run_contender(args, contender, cluster)
            except Failed as e:
                print(f"{contender}: FAILED {e}", flush=True)
                failed = True
                continue
            got["samples_per_sec"] = got["samples"] / got["seconds"]
            runs[contender].append(got)
            print(f"trial {trial + 1} {contender}: {got['samples_per_sec']:.0f} samples/s, "
                  f"{got['bytes_per_step'] / 2**10:.0f} KiB/step per worker"
                  f"{'' if got['bytes_measured'] else ' (estimated)'}, loss {got['loss']:.4f}, peak RSS MiB "
                  + ", ".join(f"{k} {v:.0f}" for k, v in got["peaks"].items())
                  + ("; ms/step " + ", ".join(f"{k} {v:.1f}" for k, v in got["ms_per_step"].items())
                     if "ms_per_step" in got else ""), flush=True)
    return runs, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default="10000000,100000",
                    help="rows of each categorical feature's table, comma-separated (the first: >= 10M for the claim)")
    ap.add_argument("--dim", type=int, default=64, help="embedding width (float32; 64: a 10M-row table of 2.4 GiB, three times a TensorFlow process)")
    ap.add_argument("--batch", type=int, default=4096, help="examples per worker step (DLRM trains on large batches)")
    ap.add_argument("--pool", type=int, default=16, help="distinct batches per worker in the data pool")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seconds", type=float, default=10.0, help="timed steps per contender and trial")
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--contenders", default="tfkv,pss", help=f"of {', '.join(CONTENDERS)}")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    ap.add_argument("--emulate", metavar="LINK", help="run on an emulated cluster (tfkv.emulate, needs root): "
                    "2 hosts with LINK links (e.g. 10gbit), each a worker and a server; default: loopback")
    ap.add_argument("--cpus", type=float, default=0.9, help="--emulate: each host's CPU budget, in cores")
    ap.add_argument("--python", default=sys.executable, help="--emulate: the Python the hosts run tfkv's job with")
    ap.add_argument("--worker-threads", type=int, default=0,
                    help="TF intra/inter-op threads of each PSS task (0: TensorFlow's default)")
    ap.add_argument("--role", choices=["tfkv", "pss", "pss_server"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--sync-dir", help=argparse.SUPPRESS)
    harness.add_argument(ap, "embedding", "--json", "--result")
    args = ap.parse_args()
    try:
        args.table_rows = [int(r) for r in args.tables.split(",")]
        assert args.table_rows and min(args.table_rows) >= 1
    except (ValueError, AssertionError):
        ap.error(f"--tables={args.tables!r} must be row counts of at least 1, comma-separated (e.g. 10000000,100000)")
    if args.role == "pss":
        return run_pss(args)
    if args.role == "pss_server":
        return run_pss_server(args)
    if args.role == "tfkv":
        return run_tfkv(args)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        ap.error(f"--contenders: {unknown[0]!r} is not one of {', '.join(CONTENDERS)}")
    table_bytes = sum(args.table_rows) * args.dim * 4
    if args.emulate:
        from tfkv.emulate import Refused
        from tfkv.emulate.spec import check

        try:
            check(host_specs(args))
        except Refused as e:
            print(f"bench_embedding: refused: {e}", file=sys.stderr)
            sys.exit(2)
        network = (f"emulated cluster (tfkv.emulate): {WORKERS} hosts of {args.cpus} cores, {args.emulate} links, "
                   "one worker and one server each")
    else:
        network = "loopback (127.0.0.1, every process on this machine)"
    print(f"bench_embedding: {network}; {WORKERS} workers, {SERVERS} servers; tables {args.tables} rows x "
          f"{args.dim} float32 = {table_bytes / 2**20:.0f} MiB; batch {args.batch} per worker, SGD lr {args.lr}",
          flush=True)
    with contextlib.ExitStack() as stack:
        cluster = None
        if args.emulate:
            from tfkv.emulate import Cluster

            state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_embedding_cluster_")))
            cluster = stack.enter_context(Cluster.up(host_specs(args), state_dir=state))
            args.hosts_file = cluster.write_hosts(state / "hosts")
        runs, failed = run_trials(args, contenders, cluster)
    rows = []
    for contender, got in runs.items():
        if not got:
            continue
        best = sorted(got, key=lambda g: g["samples_per_sec"])[len(got) // 2]  # the median trial
        workers = [v for k, v in best["peaks"].items() if k.startswith("worker")]
        servers = [v for k, v in best["peaks"].items() if k.startswith(("server", "ps"))]
        rows.append({"contender": contender, "samples_per_sec": statistics.median(g["samples_per_sec"] for g in got),
                     "bytes_per_step": best["bytes_per_step"], "bytes_measured": best["bytes_measured"],
                     "worker_peak_rss_mib": max(workers, default=0.0), "server_peak_rss_mib": max(servers, default=0.0),
                     "table_bytes": table_bytes, "table_mib": table_bytes / 2**20, "loss": best["loss"],
                     "peaks_mib": best["peaks"], "trials": len(got), "network": network,
                     **({"ms_per_step": best["ms_per_step"]} if "ms_per_step" in best else {})})
    print(f"\n{'contender':<9} {'samples/s':>10} {'KiB/step':>9} {'worker MiB':>11} {'server MiB':>11} "
          f"{'table MiB':>10} {'worker/table':>13}")
    for r in rows:
        print(f"{r['contender']:<9} {r['samples_per_sec']:>10.0f} {r['bytes_per_step'] / 2**10:>9.0f}"
              f"{'' if r['bytes_measured'] else '*'} {r['worker_peak_rss_mib']:>10.0f} {r['server_peak_rss_mib']:>11.0f} "
              f"{r['table_mib']:>10.0f} {r['worker_peak_rss_mib'] / r['table_mib']:>13.2f}")
    speed = {r["contender"]: r["samples_per_sec"] for r in rows}
    for name in ("tfkv", "tfkv_plain"):
        if name in speed and "pss" in speed:
            print(f"{name}/PSS samples/s: {speed[name] / speed['pss']:.2f} (target >= 1.5)")
    print("worker peak RSS / table: target well below 1")
    print("* estimated: PSS rows gathered + scattered and dense weights + gradients, 4 bytes a float; "
          f"tfkv: the store's push_bytes + pull_bytes. Network: {network}.", flush=True)
    settings = harness.settings_of(args)
    settings.pop("hosts_file", None)  # the emulated cluster's, gone with it
    harness.write(args.result, "embedding", settings, rows, network=network)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
