"""Every benchmark script runs to the end and prints its table, with tiny settings (the figures
themselves are not checked here: these machines are shared and noisy; see the README).

The scripts that start jobs or train models are marked `bench` as well: CI leaves them out (each
costs 20-50 s of its 20 minutes); `pytest -m bench` runs them, before a benchmark is changed or
its figures quoted."""

import subprocess
import sys

import pytest

from conftest import REPO

CASES = [
    pytest.param("bench_local_step.py", ["--seconds", "0.2", "--trials", "1"], "plain TF", marks=pytest.mark.bench),
    ("bench_pushpull.py", ["--seconds", "0.2", "--trials", "1", "--sizes", "4K,1M"], "ratio = tfkv / raw"),
    ("bench_security.py", ["--seconds", "0.2", "--rounds", "1", "--sizes", "1M"], "secure/plain"),
    ("bench_overlap.py", ["--seconds", "0.2", "--trials", "1"], "raw chunked"),
    pytest.param("bench_scaling.py", ["--seconds", "0.3", "--trials", "1", "--workers", "2"], "secure/plain", marks=pytest.mark.bench),
    pytest.param("bench_compression_training.py", ["--seconds", "0.3", "--trials", "1", "--workers", "2", "--overlap-ab"],
     "pushed after backward", marks=pytest.mark.bench),
    pytest.param("bench_compression_accuracy.py", ["--seeds", "0", "--epochs", "1"], "vs uncompressed (points)",
                 marks=pytest.mark.bench),
    pytest.param("bench_dist_training.py", ["--seconds", "0.3", "--trials", "1", "--models", "lenet", "--no-pss"], "dist/MWMS", marks=pytest.mark.bench),
    pytest.param("bench_model_parallel.py", ["--seconds", "0.2", "--trials", "1", "--hidden", "32,32", "--vocab", "200",
                                 "--batch", "16", "--seq-len", "5"], "pipelined / naive", marks=pytest.mark.bench),
    pytest.param("bench_sweep.py", ["--lrs", "0.1", "--epochs", "1"], "ratio one-by-one / two-at-once", marks=pytest.mark.bench),
    pytest.param("bench_gpu.py", ["--device", "cpu:0", "--rows", "float32", "--epochs", "2", "--num-train", "128", "--width", "4",
                      "--batch", "32", "--trials", "1"], "tfkv/fit", marks=pytest.mark.bench),
    pytest.param("bench_checkpoint.py", ["--what", "overhead", "--trials", "1", "--epochs", "2"],
                 "ratio every_steps=50 / none", marks=pytest.mark.bench),
    pytest.param("bench_failfast.py", ["--roles", "worker 1"], "ratio hang/death", marks=pytest.mark.bench),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,args,expected", CASES, ids=[getattr(c, "values", c)[0] for c in CASES])
def test_benchmark_runs(script, args, expected):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]
