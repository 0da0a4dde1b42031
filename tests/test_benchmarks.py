"""Every benchmark (`python -m benchmarks NAME`) runs to the end, prints its table and writes its result record, with tiny
settings (the figures themselves are not checked here: these machines are shared and noisy). The
records go to a temporary directory ($TFKV_BENCH_RESULTS): a smoke run never replaces a committed
figure in benchmarks/results.

The benchmarks that start jobs or train models are marked `bench` as well: CI leaves them out (each
costs 20-50 s of its 20 minutes); `pytest -m bench` runs them, before a benchmark is changed or
its figures quoted."""

import json
import os

import pytest

from benchmark_cli import env_with_checkout, run_benchmark
from conftest import REPO

CASES = [
    pytest.param("local_step", ["--seconds", "0.2", "--trials", "1"], "plain TF", marks=pytest.mark.bench),
    ("pushpull", ["--seconds", "0.2", "--trials", "1", "--sizes", "4K,1M"], "ratio = tfkv / raw"),
    ("security", ["--seconds", "0.2", "--rounds", "1", "--sizes", "1M"], "secure/plain"),
    pytest.param("server_cpu", ["--mib", "1", "--steps", "3", "--trials", "1"], "ms CPU/MiB", marks=pytest.mark.bench),
    ("overlap", ["--seconds", "0.2", "--trials", "1"], "raw chunked"),
    ("compression_speed", ["--seconds", "0.05", "--trials", "1", "--values", "100003"], "x copy"),
    pytest.param("scaling", ["--seconds", "0.3", "--trials", "1", "--workers", "2"], "secure/plain", marks=pytest.mark.bench),
    pytest.param("compression_training", ["--seconds", "0.3", "--trials", "1", "--workers", "2", "--overlap-ab",
                                       "--vote-ab"], "checkpoint vote, 2 workers:", marks=pytest.mark.bench),
    pytest.param("compression_accuracy", ["--seeds", "0", "--epochs", "1"], "vs uncompressed (points)",
                 marks=pytest.mark.bench),
    pytest.param("dist_training", ["--seconds", "0.3", "--trials", "1", "--models", "lenet", "--no-pss"], "dist/MWMS", marks=pytest.mark.bench),
    pytest.param("model_parallel", ["--seconds", "0.2", "--trials", "1", "--hidden", "32,32", "--vocab", "200",
                                 "--batch", "16", "--seq-len", "5"], "pipelined / naive", marks=pytest.mark.bench),
    pytest.param("sweep", ["--lrs", "0.1", "--epochs", "1"], "ratio one-by-one / two-at-once", marks=pytest.mark.bench),
    pytest.param("gpu", ["--device", "cpu:0", "--rows", "float32", "--epochs", "2", "--num-train", "128", "--width", "4",
                      "--batch", "32", "--trials", "1"], "tfkv/fit", marks=pytest.mark.bench),
    pytest.param("checkpoint", ["--what", "overhead", "--trials", "1", "--epochs", "2"],
                 "ratio every_steps=50 / none", marks=pytest.mark.bench),
    pytest.param("failfast", ["--roles", "worker 1"], "ratio hang/death", marks=pytest.mark.bench),
]


def _committed_results() -> dict[str, tuple[int, int]]:
    """benchmarks/results/ as (size, mtime) per file: what a test must leave as it was."""
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in (REPO / "benchmarks" / "results").iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("bench,args,expected", CASES, ids=[getattr(c, "values", c)[0] for c in CASES])
def test_benchmark_runs(bench, args, expected, tmp_path):
    before = _committed_results()
    proc = run_benchmark(bench, *args, env=env_with_checkout(TFKV_BENCH_RESULTS=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expected in proc.stdout, proc.stdout[-3000:]
    got = json.loads((tmp_path / f"{bench}.json").read_text())
    assert got["benchmark"] == bench and got["rows"] and got["command"].startswith(f"python -m benchmarks {bench} ")
    assert got["machine"]["logical_cores"] == os.cpu_count() and got["date"].endswith("Z"), got
    assert _committed_results() == before, "a smoke run wrote into benchmarks/results"


@pytest.mark.slow
def test_control_plane_benchmark_writes_a_row_per_job(tmp_path):
    """The control_plane benchmark with one job size (8 nodes: 6 workers, 2 servers), secure and plain:
    every row's figures are there and plausible, the job ended clean, the table is written beside."""
    out = tmp_path / "cp.json"
    proc = run_benchmark("control_plane", "--nodes", "8", "--barriers", "3", "--idle", "0.5", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["workers"], r["servers"], r["secure"]) for r in rows] == [(8, 6, 2, True), (8, 6, 2, False)]
    for r in rows:
        assert r["exit"] == "every process 0" and r["false_failures"] == 0, r
        assert 0 < r["protocol_s"] < r["startup_s"] and 0 < r["python_s"] < r["startup_s"], r
        assert 0 < r["barrier_ms"] <= r["barrier_max_ms"] and 0 < r["shutdown_s"] < 60, r
        assert 10 < r["sched_rss_mib"] <= r["sched_peak_mib"] < 1000, r
        assert 0 < r["heartbeats_per_s"] and r["heartbeats_expected_per_s"] == 16, r
    assert "| 8 (6+2) | secure |" in (tmp_path / "cp.md").read_text()
    assert "no false failure met" in proc.stdout


def _scaling_model(*args: str):
    return run_benchmark("scaling_model", *args, timeout=60)


def test_scaling_model_compares_its_predictions_with_a_cluster_run(tmp_path):
    """--compare on made-up costs whose prediction is closed form: 100 ms of compute per step of 64,
    one 1,000-float key, free messages, bytes and server work, so samples/s = 64 H / (0.1 s + the
    wire time of 2 x 4,000 x (H-1)/H bytes at 0.95 of the link)."""
    comm = {"a_s": 0.0, "b_s_per_byte": 0.0, "k_s": 0.0}
    costs = {"cpus": 0.4, "batch": 64, "compute": {"lenet": {"step_s": 0.1, "keys": [1000]}},
             "comm": {"secure": comm, "plain": comm}, "server": {"sum_s_per_byte": 0.0, "update_s_per_byte": 0.0}}
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    wire = 2 * 4000 * 3 / 4 / (0.95 * 1e10 / 8)
    rows = [{"model": "lenet", "hosts": 2, "link": "1gbit", "contender": "tfkv", "samples_per_sec": 1280.0, "cpus": 0.4},
            {"model": "lenet", "hosts": 4, "link": "10gbit", "contender": "tfkv_plain", "samples_per_sec": 2000.0,
             "cpus": 0.4},
            {"model": "lenet", "hosts": 4, "link": "10gbit", "contender": "mwms", "samples_per_sec": 1.0, "cpus": 0.4}]
    (tmp_path / "cluster.json").write_text(json.dumps(rows))
    proc = _scaling_model("--costs", str(tmp_path / "costs.json"), "--compare", str(tmp_path / "cluster.json"))
    assert proc.returncode == 0, proc.stderr
    predicted = 256 / (0.1 + wire)
    assert f"| lenet | tfkv_plain | 4 | 10gbit | {predicted:.1f} | 2000.0 | {100 * (predicted / 2000 - 1):+.0f}% |" \
        in proc.stdout, proc.stdout
    assert "| lenet | tfkv | 2 | 1gbit |" in proc.stdout and "mwms" not in proc.stdout
    assert "largest error 28%" in proc.stdout and "NOT met" in proc.stdout
    table = proc.stdout
    (tmp_path / "cluster.json").write_text(json.dumps({"benchmark": "cluster", "rows": rows}))  # a result record
    proc = _scaling_model("--costs", str(tmp_path / "costs.json"), "--compare", str(tmp_path / "cluster.json"))
    assert proc.returncode == 0 and proc.stdout == table, proc.stderr

    rows[0]["cpus"] = 0.2  # measured in another budget than the costs: refused, one line
    (tmp_path / "cluster.json").write_text(json.dumps(rows))
    proc = _scaling_model("--costs", str(tmp_path / "costs.json"), "--compare", str(tmp_path / "cluster.json"))
    assert proc.returncode != 0 and "another budget" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "cluster.json").write_text("not json")
    proc = _scaling_model("--costs", str(tmp_path / "costs.json"), "--compare", str(tmp_path / "cluster.json"))
    assert proc.returncode != 0 and "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_trees_reads_the_three_tables(monkeypatch):
    """The trees benchmark compares figures it reads from each benchmark's printed table: a header whose
    names have spaces, size labels with a unit ("4 KiB"), parameter counts with commas, '-' cells."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.suites import trees as bench_trees
    pushpull = ("    size  raw 1x1 tfkv 1x1  ratio    raw 2x2 tfkv 2x2  ratio   MXNet 1.9.1 ratio 1x1   secure 1x1 "
                "secure/plain\n   4 KiB    0.050    0.030  0.600      0.080    0.040  0.500                       -"
                "        0.020        0.667\n  keyset    1.000    0.900  0.900      1.500    1.200  0.800   "
                "                    -        0.700        0.778\nratio = tfkv / raw")
    rows = bench_trees.parse_table(pushpull, "size", bench_trees.SETTINGS["pushpull"][2])
    assert rows["4 KiB"]["tfkv1"] == 0.03 and rows["keyset"]["secure1"] == 0.7 and rows["4 KiB"]["mxnet"] != 0.0
    training = ("model      params     local      MWMS  dist_sync     plain  dist/MWMS  dist/local  secure/plain   "
                "(samples/s)\nlenet      61,706      3000      1000       1500      1600      1.500       0.500"
                "         0.938\nTargets")
    rows = bench_trees.parse_table(training, "model", bench_trees.SETTINGS["dist_training"][2])
    assert rows == {"lenet": {"params": 61706.0, "local": 3000.0, "mwms": 1000.0, "dist_sync": 1500.0, "plain": 1600.0,
                              "dist/mwms": 1.5, "dist/local": 0.5, "secure/plain": 0.938}}
    with pytest.raises(ValueError, match="no rows"):
        bench_trees.parse_table("size plain\nnothing here at all\n", "size", ["size", "plain", "secure"])
