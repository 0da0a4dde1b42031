"""kvstore.timeline: each role of a dist_* job writes a Chrome-trace / Perfetto file of its work,
one clock per host, and `python -m tfkv.timeline merge` joins them into one trace."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_cli import run_benchmark
from conftest import need_root, tfkv_run

from tfkv import timeline


def _x(events: list[dict], name: str | None = None) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and (name is None or e["name"] == name)]


def test_a_role_file_is_trace_json_flushed_in_bulk_and_closed(tmp_path):
    tl = timeline.Timeline(tmp_path, "worker", 3)
    t = timeline.now()
    tl.span("compute", t, t + 0.002, args={"step": 1})
    replies = list(tl.arrivals(iter([("w", 1)])))  # a pull never pushed: "pull" on its key's lane
    assert replies == [("w", 1)]
    assert tl.path.read_text().count('"ph":"X"') == 0  # buffered: nothing per event on disk
    tl.close()
    tl.span("late", t, t)  # a closed timeline records nothing more
    events = json.loads(tl.path.read_text())
    meta = {e["name"]: e["args"] for e in events if e["ph"] == "M" and e["tid"] == timeline.MAIN}
    assert meta["process_name"] == {"name": "worker 3"} and meta[timeline.CLOCK]["host"]
    (compute,) = _x(events, "compute")
    assert compute["dur"] == pytest.approx(2000, abs=1) and compute["ts"] == pytest.approx(t * 1e6, abs=1)
    (pull,) = _x(events, "pull")
    assert pull["tid"] == timeline.KEYS and {"name": "key w"} in [e["args"] for e in events if e["tid"] == timeline.KEYS]
    assert [e["name"] for e in _x(events)] == ["compute", "pull", "wait"]


def test_a_role_killed_mid_job_leaves_what_it_flushed_readable(tmp_path):
    # No exit handler runs (os._exit, as a job's teardown kills a role): the periodic flush kept it.
    code = ("import os, sys; from pathlib import Path; from tfkv import timeline as T; T.FLUSH_EVENTS = 10\n"
            "tl = T.Timeline(Path(sys.argv[1]), 'server', 0)\n"
            "for i in range(25): t = T.now(); tl.span('sum', t, t, args={'key': i})\n"
            "os._exit(1)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, timeout=60)
    text = (tmp_path / "server-0.json").read_text()
    assert not text.rstrip().endswith("]")
    assert [e["args"]["key"] for e in _x(timeline.read(tmp_path / "server-0.json"))] == list(range(20))


def test_a_full_timeline_stops_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "MAX_EVENTS", 5)
    monkeypatch.setattr(timeline, "FLUSH_EVENTS", 3)
    tl = timeline.Timeline(tmp_path, "worker", 0)
    for _ in range(10):
        t = timeline.now()
        tl.span("push", t, t)
    events = json.loads(tl.path.read_text())  # closed when full
    assert len(_x(events)) == 5 and "timeline full" in events[-1]["name"]


def test_merge_puts_each_host_on_the_wall_clock_and_renumbers_the_roles(tmp_path):
    def role(name: str, host: str, perf_us: float, unix_us: float, ts: float) -> None:
        events = [{"name": "process_name", "ph": "M", "pid": 7, "tid": 0, "args": {"name": name}},
                  {"name": timeline.CLOCK, "ph": "M", "pid": 7, "tid": 0,
                   "args": {"host": host, "perf_counter_us": perf_us, "unix_us": unix_us}},
                  {"name": "step", "ph": "X", "ts": ts, "dur": 5.0, "pid": 7, "tid": 0}]
        (tmp_path / f"{name.replace(' ', '-')}.json").write_text(json.dumps(events)[:-1])  # cut short: no ]

    role("server 0", "a", 100.0, 1_000_100.0, 150.0)  # host a: unix = perf + 1_000_000
    role("worker 0", "a", 400.0, 1_000_401.0, 160.0)  # same host, read 1 us apart: a's first pair kept
    role("worker 1", "b", 9_000.0, 1_000_000.0, 9_070.0)  # host b: unix = perf + 991_000
    out = tmp_path / "all.json"
    proc = subprocess.run([sys.executable, "-m", "tfkv.timeline", "merge", str(tmp_path), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(out.read_text())
    steps = {e["pid"]: e["ts"] for e in _x(merged["traceEvents"], "step")}
    names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["server 0 (a)", "worker 0 (a)", "worker 1 (b)"] and len(steps) == 3
    by_name = {names[pid]: ts for pid, ts in steps.items()}
    # on the wall clock: server 0 at 1_000_150, worker 0 at 1_000_160 (not 161), worker 1 at 1_000_070
    assert by_name == {"server 0 (a)": 80.0, "worker 0 (a)": 90.0, "worker 1 (b)": 0.0}


def test_merge_of_a_directory_without_timelines_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tfkv.timeline", "merge", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "no role's timeline file" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["kvstore=dist_sync", "cluster=local", "kvstore.timeline={blocked}/tl"], "cannot write timeline files into"),
    (["kvstore.timeline=tl"], "kvstore.timeline records the roles of a dist_* job"),
])
def test_a_timeline_that_cannot_be_written_is_refused_before_any_role_starts(tmp_path, args, message):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory cannot be made under a file, even by root
    proc = tfkv_run(*[a.format(blocked=blocked) for a in args], "epochs=1", "hydra.run.dir=run", cwd=tmp_path,
                    check=False, timeout=180)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "[server 0]" not in proc.stdout + proc.stderr and not (tmp_path / "run" / "config_resolved.yaml").exists()


@pytest.mark.slow
def test_a_dist_sync_job_writes_each_roles_timeline_on_one_clock(tmp_path):
    tfkv_run("kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=2", "epochs=1",
             "progress=false", "kvstore.timeline=tl", "hydra.run.dir=run", cwd=tmp_path, timeout=600)
    where = tmp_path / "run" / "tl"  # relative: in the run directory
    roles = sorted(p.stem for p in where.glob("*.json"))
    assert roles == ["server-0", "server-1", "worker-0", "worker-1"]
    events = {r: json.loads((where / f"{r}.json").read_text()) for r in roles}  # closed: whole JSON arrays
    for r, evs in events.items():
        assert all(e["dur"] >= 0 and e["ts"] > 0 and {"name", "pid", "tid"} <= set(e) for e in _x(evs)), r
    for w in ("worker-0", "worker-1"):
        names = {e["name"] for e in _x(events[w])}
        assert {"step", "compute", "push", "pushpull", "wait", "assign"} <= names, names
        assert len(_x(events[w], "step")) == len(_x(events[w], "compute")) >= 5
        keys = {e["args"]["key"] for e in _x(events[w], "pushpull")}
        assert keys == {e["args"]["key"] for e in _x(events[w], "push")} and len(keys) >= 4  # every key, per key
        assert all(e["tid"] >= timeline.KEYS for e in _x(events[w], "pushpull"))
    served = [e for s in ("server-0", "server-1") for e in _x(events[s])]
    assert {"pushpull", "sum", "update", "reply"} <= {e["name"] for e in served}
    # One clock on this host: a server serves a worker's request while that worker waits for it,
    # between the request leaving and its reply landing (its key's flight).
    flights = sorted((e["ts"], e["ts"] + e["dur"]) for w in ("worker-0", "worker-1")
                     for e in _x(events[w], "pushpull"))
    for e in (e for e in served if e["name"] == "pushpull"):
        assert any(sent <= e["ts"] <= landed for sent, landed in flights), e
    out = tmp_path / "all.json"
    subprocess.run([sys.executable, "-m", "tfkv.timeline", "merge", str(where), "-o", str(out)], check=True,
                   timeout=120)
    merged = json.loads(out.read_text())
    names = sorted(e["args"]["name"].split(" (")[0] for e in merged["traceEvents"] if e["name"] == "process_name")
    assert names == ["server 0", "server 1", "worker 0", "worker 1"]
    assert min(e["ts"] for e in _x(merged["traceEvents"])) == 0


def test_bench_cluster_refuses_a_timeline_it_cannot_write_in_one_line(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    proc = run_benchmark("cluster", "--quick", "--timeline", str(blocked / "tl"), "--json", "none", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"--timeline {blocked / 'tl'}: cannot write timeline files into" in proc.stderr.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.bench
def test_bench_cluster_writes_a_timeline_per_tfkv_row(tmp_path):
    need_root("the cluster benchmark (an emulated cluster)")
    proc = run_benchmark("cluster", "--hosts", "2", "--link", "1gbit", "--cpus", "0.5", "--models", "lenet",
                         "--contenders", "tfkv,mwms", "--seconds", "0.3", "--no-straggler", "--json", "none",
                         "--timeline", str(tmp_path / "tl"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = [p for p in (tmp_path / "tl").glob("*/*") if p.is_dir()]  # tfkv's row alone: mwms has none
    assert row.relative_to(tmp_path / "tl").as_posix() == "2h-1gbit/tfkv-t1"
    files = sorted(p.name for p in (row / "lenet").iterdir())
    assert files == ["server-0.json", "server-1.json", "timeline.json", "worker-0.json", "worker-1.json"]
    merged = json.loads((row / "lenet" / "timeline.json").read_text())["traceEvents"]
    hosts = {e["args"]["name"] for e in merged if e["name"] == "process_name"}
    assert len(hosts) == 4 and {h.split(" (")[1] for h in hosts} == {"node1)", "node2)"}, hosts
    assert {"step", "pushpull", "sum", "update"} <= {e["name"] for e in merged if e["ph"] == "X"}


@pytest.mark.slow
def test_an_mxnet_style_job_records_with_TFKV_TIMELINE_and_computes_the_same(cluster, tmp_path):
    """Roles started by hand (DMLC_* and TFKV_TIMELINE in each one's environment), the KVStore API
    called directly, 2-bit compressed: the same results as without a timeline, and the packing,
    pulls, waits, sums and replies recorded."""
    where = tmp_path / "tl"
    c = cluster(num_servers=2, num_workers=2, TFKV_TIMELINE=str(where), MXNET_KVSTORE_BIGARRAY_BOUND="1000",
                TFKV_CHUNK_BYTES="4000")
    c.start_servers()
    outs = c.start_workers("compressed")
    codes = c.wait(180)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    for r in (json.loads(p.read_text()) for p in outs):  # as tests/store/test_dist.py has them without one
        assert (r["a"], r["big"], r["big_residual"], r["plain"]) == ([0.0, 1.0], [1.0, 1.0], [0.5, 0.5], 0.5)
        assert (r["plain_bytes"], r["compressed_bytes"]) == (12000, 752)
    assert sorted(p.stem for p in where.glob("*.json")) == ["server-0", "server-1", "worker-0", "worker-1"]
    worker = {e["name"] for e in _x(json.loads((where / "worker-0.json").read_text()))}
    assert {"pack", "pull", "wait"} <= worker, worker
    server = {e["name"] for e in _x(json.loads((where / "server-1.json").read_text()))}
    assert {"push", "pull", "sum", "reply"} <= server, server
