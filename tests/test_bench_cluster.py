"""The cluster benchmark (`python -m benchmarks cluster`) end to end on a tiny emulated cluster (2 hosts; tfkv through its ssh
launcher against MultiWorkerMirroredStrategy; the figures are not checked: this machine is shared),
its JSON rows' schema, its plots, and its refusals: rows of different runs, a cluster this machine
cannot hold, each one line and exit 2."""

import json
import os

import pytest

from benchmark_cli import run_benchmark
from conftest import REPO, need_root


def bench(*args: str, timeout: float = 60):
    return run_benchmark("cluster", *args, timeout=timeout)


def test_a_cluster_this_machine_cannot_hold_is_one_line(tmp_path):
    too_much = str(os.cpu_count() + 1)
    proc = bench("--hosts", "1,2", "--link", "1gbit", "--cpus", too_much, "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "refused" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith(f"bench_cluster: per-host budget {too_much} core(s)"), proc.stdout
    assert not (tmp_path / "out.json").exists()


def test_tfkv_spare_s_server_hosts_count_in_the_cluster_this_machine_must_hold(tmp_path):
    """3 hosts of a third of this machine fit; tfkv_spare's 2 more server hosts do not: refused,
    one line naming them, before any cluster is made."""
    cpus = str(round(os.cpu_count() / 3, 2))
    proc = bench("--hosts", "3", "--link", "1gbit", "--cpus", cpus, "--models", "mlp", "--contenders",
                 "tfkv,tfkv_spare,mwms", "--no-straggler", "--json", str(tmp_path / "out.json"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "(3 worker hosts + 2 tfkv_spare server hosts, --server-hosts)" in proc.stderr
    assert "MWMS cannot use the spare hosts" in proc.stdout, proc.stdout
    assert not (tmp_path / "out.json").exists()


def test_rows_of_different_runs_are_refused(tmp_path):
    row = {"model": "mlp", "hosts": 2, "link": "1gbit", "contender": "tfkv", "samples_per_sec": 100.0, "cpus": 0.4}
    (tmp_path / "a.json").write_text(json.dumps([{**row, "run": "one"}]))
    (tmp_path / "b.json").write_text(json.dumps([{**row, "contender": "mwms", "run": "two"}]))
    proc = bench("--table", str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "2 runs (one, two)" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "samples/s" not in proc.stdout  # no table of mixed rows
    (tmp_path / "c.json").write_text(json.dumps([{"model": "mlp"}]))
    proc = bench("--plot", str(tmp_path / "c.json"))
    assert proc.returncode == 2 and "not a `python -m benchmarks cluster --json` file" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.bench
def test_bench_cluster_runs_end_to_end(tmp_path):
    need_root("the cluster benchmark (an emulated cluster)")
    out = tmp_path / "rows.json"
    proc = bench("--hosts", "2", "--link", "1gbit", "--cpus", "0.5", "--models", "lenet", "--contenders",
                 "tfkv,tfkv_2bit,tfkv_spare,mwms,local", "--server-hosts", "1", "--seconds", "0.3", "--no-straggler",
                 "--json", str(out), timeout=700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert "per-host budget 0.5 core(s)" in first and "1gbit" in first, first
    rows = json.loads(out.read_text())["rows"]  # a benchmarks/harness.py record
    assert {r["contender"] for r in rows} == {"tfkv", "tfkv_2bit", "tfkv_spare", "mwms", "local"}
    assert len({r["run"] for r in rows}) == 1
    for r in rows:
        assert r["model"] == "lenet" and r["cpus"] == 0.5 and r["samples_per_sec"] > 0, r
        assert (r["hosts"], r["link"]) == ((1, None) if r["contender"] == "local" else (2, "1gbit")), r
        assert r["global_batch"] == 128 and len(r["trials"]) == 1, r
        # tfkv_spare: 2 worker hosts and 1 server host of the same budget; the others the 2 worker hosts
        spare = r["contender"] == "tfkv_spare"
        assert (r.get("server_hosts"), len(r["cpus_each"])) == ((1, 3) if spare else (None, 1 if r["hosts"] == 1 else 2))
    tfkv = next(r for r in rows if r["contender"] == "tfkv")
    assert set(tfkv["ratios"]) == {"vs_mwms", "vs_local"}
    assert tfkv["ratios"]["vs_mwms"] == pytest.approx(tfkv["samples_per_sec"] / next(
        r["samples_per_sec"] for r in rows if r["contender"] == "mwms"), rel=1e-3)
    assert "tfkv >= 1.0x mwms, lenet, 2 hosts, 1gbit" in proc.stdout
    assert "2+1" in proc.stdout and "MWMS cannot use the spare hosts" in proc.stdout
    spare = next(r for r in rows if r["contender"] == "tfkv_spare")
    assert set(spare["ratios"]) == {"vs_mwms", "vs_local"}
    for png in ("cluster_scaling.png", "cluster_contenders.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    again = bench("--table", str(out))  # a run's own rows are shown again
    assert again.returncode == 0 and "targets" in again.stdout, again.stderr


@pytest.fixture
def benchmarks_on_path(monkeypatch):
    """The benchmarks package from this checkout: CI installs tfkv from a copy, so the checkout's root is
    not on sys.path."""
    monkeypatch.syspath_prepend(str(REPO))


def test_a_spare_row_shows_its_server_hosts_and_trials_their_spread(benchmarks_on_path):
    """The table: tfkv_spare's hosts as W+S, compared with MWMS on the W worker hosts; with
    several trials, each row's lowest-highest beside the median."""
    from benchmarks import cluster_report

    base = {"run": "r", "model": "mlp", "hosts": 4, "link": "1gbit", "cpus": 0.3, "global_batch": 256}
    rows = [{**base, "contender": "mwms", "samples_per_sec": 100.0, "trials": [90.0, 100.0, 120.0]},
            {**base, "contender": "tfkv_spare", "samples_per_sec": 150.0, "trials": [140.0, 150.0, 155.0],
             "server_hosts": 2, "cpus_each": [0.3] * 6}]
    cluster_report.add_ratios(rows)
    assert rows[1]["ratios"] == {"vs_mwms": 1.5}
    text = cluster_report.table(rows)
    spare = next(ln for ln in text.splitlines() if "tfkv_spare" in ln)
    assert spare.split()[:2] == ["mlp", "4+2"] and "140-155" in spare and "1.50" in spare, text
    assert "MWMS cannot use the spare hosts" in text and "lowest-highest" in text
    (target,) = [t for t in cluster_report.targets(rows) if t["target"].startswith("tfkv_spare")]
    assert target["figure"] == 1.5 and target["holds"] and "4 worker + 2 server hosts" in target["target"]


def test_a_contender_s_config_key_this_tfkv_lacks_fails_in_one_line_before_its_job(benchmarks_on_path):
    from benchmarks import jobs

    assert jobs.configured("dist_sync", ["kvstore.compression.type=2bit"]).kvstore.compression.type == "2bit"
    with pytest.raises(jobs.Failed, match=r"^the config overrides kvstore.compression.nonesuch=1 do not fit this "
                                          r"tfkv's config: Could not override 'kvstore.compression.nonesuch'\.$"):
        jobs.configured("dist_sync", ["kvstore.compression.nonesuch=1"])
