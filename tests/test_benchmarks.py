"""Every benchmark script runs to the end and prints its table, with tiny settings (the figures
themselves are not checked here: these machines are shared and noisy; see the README)."""

import subprocess
import sys

import pytest

from conftest import REPO

CASES = [
    ("bench_local_step.py", ["--seconds", "0.2", "--trials", "1"], "plain TF"),
    ("bench_pushpull.py", ["--seconds", "0.2", "--trials", "1", "--sizes", "4K,1M"], "ratio = tfkv / raw"),
    ("bench_security.py", ["--seconds", "0.2", "--rounds", "1", "--sizes", "1M"], "secure/plain"),
    ("bench_overlap.py", ["--seconds", "0.2", "--trials", "1"], "raw chunked"),
    ("bench_scaling.py", ["--seconds", "0.3", "--trials", "1", "--workers", "2"], "secure/plain"),
    ("bench_compression_training.py", ["--seconds", "0.3", "--trials", "1", "--workers", "2", "--overlap-ab"],
     "pushed after backward"),
    ("bench_dist_training.py", ["--seconds", "0.3", "--trials", "1", "--models", "lenet", "--no-pss"], "dist/MWMS"),
    ("bench_model_parallel.py", ["--seconds", "0.2", "--trials", "1", "--hidden", "32,32", "--vocab", "200",
                                 "--batch", "16", "--seq-len", "5"], "pipelined / naive"),
    ("bench_sweep.py", ["--lrs", "0.1", "--epochs", "1"], "ratio one-by-one / two-at-once"),
    ("bench_gpu.py", ["--device", "cpu:0", "--rows", "float32", "--epochs", "2", "--num-train", "128", "--width", "4",
                      "--batch", "32", "--trials", "1"], "tfkv/fit"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,args,expected", CASES, ids=[c[0] for c in CASES])
def test_benchmark_runs(script, args, expected):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]
