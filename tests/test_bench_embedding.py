"""benchmarks/bench_embedding.py runs both contenders to the end with tiny tables, prints its table
and writes its record with the rows the issue names (the figures are not checked: a shared machine).
Multi-process (two jobs of five processes each): slow, and `bench` as the other training benchmarks."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.bench
def test_bench_embedding_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_embedding.py"), "--tables", "20000,500",
                           "--dim", "8", "--batch", "64", "--pool", "4", "--seconds", "0.5"],
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env={**os.environ, "TFKV_BENCH_RESULTS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tfkv/PSS samples/s" in proc.stdout and "loopback" in proc.stdout, proc.stdout[-3000:]
    got = json.loads((tmp_path / "embedding.json").read_text())
    assert got["benchmark"] == "embedding" and got["network"] == "loopback"
    assert got["command"].startswith("python benchmarks/bench_embedding.py ")
    rows = {r["contender"]: r for r in got["rows"]}
    assert set(rows) == {"tfkv", "pss"}
    for r in rows.values():
        assert r["samples_per_sec"] > 0 and r["worker_peak_rss_mib"] > 100 and r["table_bytes"] == 20500 * 8 * 4
    assert rows["tfkv"]["bytes_measured"] and not rows["pss"]["bytes_measured"]
    # a tfkv step moves the rows of its batch, not the table: 64 examples x 2 features x 8 floats
    # pushed and pulled, the dense weights aside, is far less than the table's 656 KB
    assert 0 < rows["tfkv"]["bytes_per_step"] < 20500 * 8 * 4 / 2
