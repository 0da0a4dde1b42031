"""How each contender of bench_cluster.py trains on the hosts of an emulated cluster
(tfkv.emulate): the parent side, one job per contender (tfkv: one per model), every model of the run in it.

Every contender runs one worker per host with the same per-worker batch b (global batch: hosts x
b), the same models, synthetic batch, SGD (lr 0.01, momentum 0.9) and time-based steps
(benchmarks/dist_job.py), the same TensorFlow thread setting, inside the hosts' CPU budgets and
behind their links:

    tfkv        tfkv-launch --launcher ssh over the cluster's sshds (ssh config: the cluster's),
                MXNet's placement with -n hosts -s hosts: the scheduler on host 1, one server and
                one worker per host; dist_sync, secure (a fresh key per job, as launched jobs are)
    tfkv_plain  the same, --no-secure
    tfkv_2bit   the same, with the 2-bit compression a tfkv-run config's
                `kvstore.compression.type=2bit` gives (dist_job.config_compression), threshold 0.5
    tfkv_async  the same, dist_async: each worker steps for the same time on its own clock;
                samples/s is the sum of the workers' own
    mwms        tf.distribute.MultiWorkerMirroredStrategy, one worker per host (TF_CONFIG naming
                the hosts' addresses), started on the hosts by Host.popen; the custom loop of
                bench_dist_training.py (gRPC, ring all-reduce)
    pss         tf.distribute.ParameterServerStrategy: one ps and one worker per host (as tfkv's
                servers and workers), the chief (coordinator) on host 1 beside its ps and
                worker, as tfkv's scheduler is
    local       one host alone (host 1), tfkv DataParallel with the `local` store in one process,
                training the whole global batch (hosts x b) per step: the scaling baseline

Each job runs under a time limit; its processes are killed with their process groups when it
fails or hangs, and Failed names the contender with its log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_dist_training  # noqa: E402
import dist_job  # noqa: E402
from dist_job import Failed  # noqa: E402

CONTENDERS = ("tfkv", "tfkv_plain", "tfkv_2bit", "tfkv_async", "mwms", "pss", "local")
TF_PORT = 23456  # tf.distribute's gRPC port on every host (each host has a network of its own)


@dataclass
class Settings:
    """What every contender of a run trains the same way."""

    models: list[str]  # bench_dist_training.MODELS names
    batch: int  # per worker
    seconds: float  # timed steps per model
    threads: int  # TF intra/inter-op threads per process (0: TensorFlow's default)
    timeout: float  # seconds before a job counts as hung


def run(contender: str, cluster: Any, hosts_file: Path, s: Settings, tmp: Path) -> dict[str, dict]:
    """{model: dist_job.collect's figures} of one job of `contender` on every host of `cluster`."""
    n = len(cluster.hosts)
    if contender.startswith("tfkv"):
        kvstore = "dist_async" if contender == "tfkv_async" else "dist_sync"
        for m in s.models:  # a job per model: a model's keys start at 0, DataParallel's
            _tfkv(cluster, hosts_file, m, s, tmp, kvstore, secure=contender != "tfkv_plain",
                  compression="2bit" if contender == "tfkv_2bit" else "none")
        return _collect(tmp, contender, s.models, n, synchronous=kvstore == "dist_sync")
    if contender == "local":
        argv = dist_job.worker_argv(_job_models(s), n * s.batch, s.seconds, str(tmp), "local", kvstore="local",
                                    threads=s.threads)
        supervise([(cluster.hosts[0], argv, {})], s.timeout, "local", tmp)
        return _collect(tmp, "local", s.models, 1)
    if contender == "mwms":
        workers = [f"{h.address}:{TF_PORT}" for h in cluster.hosts]
        tasks = [(h, _role_argv("mwms", s, tmp), _tf_config({"worker": workers}, "worker", i))
                 for i, h in enumerate(cluster.hosts)]
        supervise(tasks, s.timeout, "mwms", tmp)
        return {m: r for m, r in bench_dist_training.collect(str(tmp), "mwms", n).items()}
    if contender == "pss":
        spec = {"chief": [f"{cluster.hosts[0].address}:{TF_PORT + 2}"],
                "worker": [f"{h.address}:{TF_PORT}" for h in cluster.hosts],
                "ps": [f"{h.address}:{TF_PORT + 1}" for h in cluster.hosts]}
        tasks = [(cluster.hosts[0], _role_argv("pss", s, tmp), _tf_config(spec, "chief", 0))]
        for kind in ("ps", "worker"):
            tasks += [(h, _role_argv("pss_server", s, tmp), _tf_config(spec, kind, i))
                      for i, h in enumerate(cluster.hosts)]
        supervise(tasks, s.timeout, "pss", tmp)
        return bench_dist_training.collect(str(tmp), "pss", 1)
    raise ValueError(f"unknown contender {contender!r}; known: {', '.join(CONTENDERS)}")


def _job_models(s: Settings) -> str:
    return ",".join(dist_job.TRAINING_MODELS[m] for m in s.models)


def _collect(tmp: Path, tag: str, models: list[str], workers: int, synchronous: bool = True) -> dict[str, dict]:
    return {m: dist_job.collect(str(tmp), tag, dist_job.TRAINING_MODELS[m], workers, synchronous) for m in models}


def _tf_config(cluster_spec: dict, kind: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": {"type": kind, "index": index}})}


def _role_argv(role: str, s: Settings, tmp: Path) -> list[str]:
    """A worker, ps or chief of bench_dist_training.py's tf.distribute contenders."""
    return [sys.executable, bench_dist_training.__file__, "--role", role, "--out", str(tmp), "--sync-dir", str(tmp),
            "--models", ",".join(s.models), "--batch", str(s.batch), "--seconds", str(s.seconds),
            "--worker-threads", str(s.threads)]


def _tfkv(cluster: Any, hosts_file: Path, model: str, s: Settings, tmp: Path, kvstore: str, secure: bool,
          compression: str) -> None:
    """One tfkv job through tfkv-launch's ssh launcher: one server and one worker per host."""
    worker = dist_job.worker_argv(dist_job.TRAINING_MODELS[model], s.batch, s.seconds, str(tmp), _tag(kvstore, secure, compression),
                                  kvstore=kvstore, compression=compression, threads=s.threads)
    launch_tfkv(cluster, hosts_file, worker, secure, tmp / f"launch-{model}", s.timeout, f"tfkv {kvstore}")


def launch_tfkv(cluster: Any, hosts_file: Path, worker: list[str], secure: bool, run_dir: Path, timeout: float,
                what: str, python: str = sys.executable) -> None:
    """`worker` as a tfkv job through tfkv-launch's ssh launcher, MXNet's placement with -n hosts
    -s hosts (one server and one worker per host); Failed with the log's tail if it fails or
    runs past `timeout` (tfkv-launch is then interrupted: it stops every role on every host)."""
    n = len(cluster.hosts)
    argv = [sys.executable, "-m", "tfkv.launcher.cli", "-n", str(n), "-s", str(n), "-H", str(hosts_file),
            "--launcher", "ssh", "--python", python, "--run-dir", str(run_dir),
            "--secure" if secure else "--no-secure", "--", *worker]
    log = Path(f"{run_dir}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **cluster.env()}, start_new_session=True)
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


def _tag(kvstore: str, secure: bool, compression: str) -> str:
    """The report files' tag: the contender's name."""
    if kvstore == "dist_async":
        return "tfkv_async"
    return "tfkv_2bit" if compression != "none" else "tfkv" if secure else "tfkv_plain"


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
