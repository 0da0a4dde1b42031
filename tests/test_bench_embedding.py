"""The embedding benchmark (`python -m benchmarks embedding`) runs both contenders to the end with tiny tables, on loopback and on
a 2-host emulated cluster, prints its table and writes its record with the rows the issue names
(the figures are not checked: a shared machine). Multi-process (two jobs of five processes each):
slow, and `bench` as the other training benchmarks."""

import json
import sys

import pytest

from benchmark_cli import env_with_checkout, run_benchmark
from conftest import REPO, need_root


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.parametrize("where", ["loopback", "emulated"])
def test_bench_embedding_runs(tmp_path, where):
    extra = []
    if where == "emulated":
        need_root("an emulated cluster")
        python = tmp_path / "python"  # the hosts' Python, importing this checkout's tfkv
        python.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} \"$@\"\n")
        python.chmod(0o755)
        extra = ["--emulate", "10gbit", "--cpus", "0.9", "--python", str(python)]
    proc = run_benchmark("embedding", "--tables", "20000,500", "--dim", "8", "--batch", "64", "--pool", "4",
                         "--seconds", "0.5", *extra, timeout=300, env=env_with_checkout(TFKV_BENCH_RESULTS=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tfkv/PSS samples/s" in proc.stdout, proc.stdout[-3000:]
    got = json.loads((tmp_path / "embedding.json").read_text())
    assert got["benchmark"] == "embedding" and got["network"].startswith(
        "loopback" if where == "loopback" else "emulated cluster"), got["network"]
    assert got["network"] in proc.stdout
    assert got["command"].startswith("python -m benchmarks embedding ")
    rows = {r["contender"]: r for r in got["rows"]}
    assert set(rows) == {"tfkv", "pss"}
    for r in rows.values():
        assert set(r["peaks_mib"]) >= {"worker 0", "worker 1"}, r["peaks_mib"]
        assert r["samples_per_sec"] > 0 and r["worker_peak_rss_mib"] > 100 and r["table_bytes"] == 20500 * 8 * 4
    assert rows["tfkv"]["bytes_measured"] and not rows["pss"]["bytes_measured"]
    # a tfkv step moves the rows of its batch, not the table: 64 examples x 2 features x 8 floats
    # pushed and pulled, the dense weights aside, is far less than the table's 656 KB
    assert 0 < rows["tfkv"]["bytes_per_step"] < 20500 * 8 * 4 / 2
