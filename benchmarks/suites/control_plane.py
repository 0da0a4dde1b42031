"""The control plane at scale: jobs of 8, 32 and 128 nodes on this machine, secure and plain.

A job of N nodes is a scheduler, N/4 servers and 3N/4 workers (128: 96 workers, 32 servers),
started by tfkv's own launcher (make_plan + local.run: one interpreter per role, as `tfkv-launch`
starts them). The servers are tfkv's (`tfkv.ps.node`'s main, behind a two-line wrapper that notes
when its imports are done); the workers import no TensorFlow: each opens a `dist_sync` store
(tfkv.store.dist, numpy only), pushes and pulls one 1 KiB key per server (keys 0..S-1 land on
S different servers) for a few steps, checks every pulled value against the closed form (the
servers sum: worker r pushes r + 1, so every element is W(W+1)/2), meets K barriers, idles
(heartbeats only) and closes. Secure is a launched job's default (a fresh key for the job:
CURVE to the scheduler, sealed data plane); plain is TFKV_SECURE=0.

Per job it reports:

    startup     launching the processes -> every worker has done its first push/pull (wall);
                split into `python` (launch -> the last role's imports done: interpreter start and
                imports, which 2 cores serialise) and `protocol` (-> every first step: registration,
                the address book, the data-plane sessions, init, the first round)
    import_cpu  CPU seconds one role spends starting Python and importing (median), and
                N x that / cores: the floor this machine puts under `startup` whatever tfkv does
    barrier     median over K barriers of (last worker released - last worker arrived)
    sched_rss   the scheduler's resident memory in the idle window (and its peak, VmHWM)
    heartbeats  messages/s the scheduler heard in the idle window's job (its own count, logged at
                the end), and the scheduler's CPU share (fraction of a core) while only heartbeats flow
    shutdown    the first worker's close() -> every process exited
    false       failures detected: a job whose every process exits 0 and whose log has no ERROR
                line has 0 (a node declared dead, a silent peer, a refused barrier would show)

Targets (at 128 nodes): startup <= 10 s and no false failure. On this machine every role's
interpreter competes for 2 cores, so `startup` carries N x import_cpu / 2 of Python start that
hosts of their own would run in parallel; the table gives the protocol part apart, and the
target is judged on a host's own start (import_cpu of one role) + the protocol part as well.

    python -m benchmarks control_plane [--nodes 8,32,128] [--barriers 20] [--idle 3]
                                             [--json benchmarks/results/control_plane.json]

Writes the JSON (a list of rows) and a Markdown table beside it (.md). Exits non-zero if a job fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Control plane at scale",
    "Start-up, barrier latency, the scheduler's memory and heartbeat load, and shut-down of jobs of 8 to "
    "128 nodes (a quarter servers) on one machine, secure and plain, with workers that import no "
    "TensorFlow.",
    ["nodes", "secure"], ["startup_s"], "start-up seconds",
    columns=["nodes", "workers", "servers", "secure", "startup_s", "protocol_s", "barrier_ms", "sched_rss_mib",
             "heartbeats_per_s", "shutdown_s", "false_failures"])


KEY_FLOATS = 256  # 1 KiB keys: the control plane, not the bytes, is measured
STARTUP_TARGET = 10.0


def process_started() -> float:
    """When this process was started (exec'd), as a time.time(): /proc's start time (10 ms ticks)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def mark_ready(out: str, role: str, rank: str) -> dict:
    """Note that this role's imports are done (a file the parent reads); the note's contents."""
    note = {"pid": os.getpid(), "started": process_started(), "ready": time.time(), "import_cpu": cpu_seconds()}
    with open(os.path.join(out, f"{role}-{rank}.ready"), "w") as f:
        json.dump(note, f)
    return note


# -- inside the roles -------------------------------------------------------------------------

def node_role(out: str) -> None:
    """The scheduler or a server: tfkv.ps.node's main, once its role's module is imported."""
    import importlib

    from tfkv.ps import node

    role = os.environ["DMLC_ROLE"]
    importlib.import_module("tfkv.ps.scheduler" if role == "scheduler" else "tfkv.ps.server")
    mark_ready(out, role, os.environ["TFKV_RANK_HINT"])
    node.main()


def worker_role(args: argparse.Namespace) -> None:
    import numpy as np

    import tfkv.store

    import tfkv.store.dist  # noqa: F401 - imported here so that `ready` is after every import

    note = mark_ready(args.out, "worker", os.environ["TFKV_RANK_HINT"])
    store = tfkv.store.create("dist_sync")  # registers, waits for the address book, opens the sessions
    ok = False
    try:
        note["joined"], note["joined_cpu"] = time.time(), cpu_seconds()
        rank, workers, servers = store.rank, store.num_workers, store.link.num_servers
        keys = list(range(servers))  # key * 9973 % S: one key on every server
        store.init(keys, [np.zeros(KEY_FLOATS, np.float32)] * servers)
        values = [np.full(KEY_FLOATS, rank + 1, np.float32)] * servers
        outs = [np.empty(KEY_FLOATS, np.float32) for _ in keys]
        expected = workers * (workers + 1) / 2
        for step in range(args.steps):
            store.pushpull(keys, values, out=outs)
            if step == 0:
                note["first_step"], note["first_step_cpu"] = time.time(), cpu_seconds()
            if not all(np.all(o == expected) for o in outs):
                raise AssertionError(f"step {step}: pulled {outs[0][:3]}..., expected {expected} everywhere")
        store.barrier()  # warm-up: the timed barriers start together
        note["barriers"] = []
        for _ in range(args.barriers):
            arrived = time.time()
            store.barrier()
            note["barriers"].append((arrived, time.time()))
        note["idle"] = (time.time(), time.time() + args.idle)
        time.sleep(args.idle)  # heartbeats only
        store.barrier()
        note["close"] = time.time()
        store.close()
        ok = True
    finally:
        if not ok:
            store.abort("bench_control_plane worker failed")
    note["closed"] = time.time()
    with open(os.path.join(args.out, f"worker-{rank}.json"), "w") as f:
        json.dump(note, f)


# -- the parent side --------------------------------------------------------------------------

class Watch(threading.Thread):
    """Samples the scheduler's CPU time and memory (/proc) every 50 ms while it runs."""

    def __init__(self, out: str):
        super().__init__(daemon=True)
        self.out, self.samples, self.stop = out, [], threading.Event()

    def run(self) -> None:
        ready = os.path.join(self.out, "scheduler-0.ready")
        while not os.path.exists(ready) and not self.stop.wait(0.05):
            pass
        try:
            with open(ready) as f:
                pid = json.load(f)["pid"]
        except (OSError, ValueError):
            return
        tick = os.sysconf("SC_CLK_TCK")
        while not self.stop.wait(0.05):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/status") as f:
                    status = {k: v for k, _, v in (line.partition(":") for line in f)}
            except OSError:
                return  # it exited
            kib = lambda name: int(status.get(name, "0 kB").split()[0])  # noqa: E731
            self.samples.append((time.time(), (int(fields[11]) + int(fields[12])) / tick,
                                 kib("VmRSS") / 1024, kib("VmHWM") / 1024))


def within(samples: list, t0: float, t1: float) -> list:
    return [s for s in samples if t0 <= s[0] <= t1]


def run_job(nodes: int, secure: bool, args: argparse.Namespace, tmp: str) -> dict:
    from benchmarks.jobs import Failed, run_plan, security_env
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    servers = max(1, nodes // 4)
    workers = nodes - servers
    out = os.path.join(tmp, f"n{nodes}-{'secure' if secure else 'plain'}")
    os.makedirs(out)
    me = [*harness.suite_argv("control_plane"), "--out", out]
    worker = [*me, "--role", "worker", "--steps", str(args.steps), "--barriers", str(args.barriers),
              "--idle", str(args.idle)]
    plan = make_plan(workers, servers, worker, [*me, "--role", "node"], ["127.0.0.1"], "127.0.0.1",
                     free_port(), extra_env=security_env(secure))
    watch = Watch(out)
    watch.start()
    launched = time.time()
    try:
        lines = run_plan(plan, args.job_timeout, f"{nodes} nodes").splitlines()
        failure = None
    except Failed as e:
        failure, *lines = str(e).splitlines()  # the failure line, then the log's tail
    ended = time.time()
    watch.stop.set()
    watch.join()
    errors = [line for line in lines if "][ERROR]" in line or "failed (" in line or "silent" in line]
    row = {"nodes": nodes, "workers": workers, "servers": servers, "secure": secure, "cores": os.cpu_count(),
           "load_before": os.getloadavg()[0], "exit": failure or "every process 0", "false_failures": len(errors),
           "error_lines": errors[:5]}
    if failure:
        return row
    notes = []
    for name in os.listdir(out):
        if name.endswith(".ready") and not name.startswith("worker"):
            with open(os.path.join(out, name)) as f:
                notes.append(json.load(f))
    reports = []
    for r in range(workers):
        with open(os.path.join(out, f"worker-{r}.json")) as f:
            reports.append(json.load(f))
    ready = max(n["ready"] for n in notes + reports)
    first = max(r["first_step"] for r in reports)
    import_cpu = statistics.median(n["import_cpu"] for n in notes + reports)
    barriers = [max(r["barriers"][k][1] for r in reports) - max(r["barriers"][k][0] for r in reports)
                for k in range(args.barriers)]
    idle0, idle1 = max(r["idle"][0] for r in reports), min(r["idle"][1] for r in reports)
    idle = within(watch.samples, idle0, idle1)
    heard = next((line for line in reversed(lines) if "scheduler: heard" in line), "")
    counts = {kind: int(n) for n, kind in (part.split() for part in
              heard.split("heard ", 1)[1].split(" in ")[0].split(", "))} if heard else {}
    formed_s = float(heard.rsplit(" in ", 1)[1].split()[0]) if heard else float("nan")
    row.update({
        "startup_s": first - launched, "python_s": ready - launched, "protocol_s": first - ready,
        "joined_s": max(r["joined"] for r in reports) - ready,
        "import_cpu_s": import_cpu, "import_floor_s": (nodes + 1) * import_cpu / os.cpu_count(),
        "host_startup_s": import_cpu + (first - ready),
        "barrier_ms": 1000 * statistics.median(barriers), "barrier_max_ms": 1000 * max(barriers),
        "sched_rss_mib": idle[-1][2] if idle else float("nan"),
        "sched_peak_mib": max((s[3] for s in watch.samples), default=float("nan")),
        "heartbeats_per_s": counts.get("HEARTBEAT", 0) / formed_s,
        "heartbeats_expected_per_s": (nodes) / args.heartbeat_interval,
        "sched_cpu_idle": (idle[-1][1] - idle[0][1]) / (idle[-1][0] - idle[0][0]) if len(idle) > 1 else float("nan"),
        "shutdown_s": ended - min(r["close"] for r in reports),
        "workers_closed_s": max(r["closed"] for r in reports) - min(r["close"] for r in reports),
        "worker_protocol_cpu_s": statistics.median(r["first_step_cpu"] - r["import_cpu"] for r in reports),
        "worker_join_cpu_s": statistics.median(r["joined_cpu"] - r["import_cpu"] for r in reports),
    })
    return row


def table(rows: list[dict]) -> str:
    head = ("| nodes (W+S) | mode | startup s | python s | protocol s | import CPU s/role | floor s | "
            "host start s | barrier ms | sched RSS MiB | heartbeats/s | sched CPU | shutdown s | false failures |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mode = "secure" if r["secure"] else "plain"
        nodes = f"{r['nodes']} ({r['workers']}+{r['servers']})"
        if "startup_s" not in r:
            out.append(f"| {nodes} | {mode} | FAILED: {r['exit']} |" + " |" * 11)
            continue
        out.append(f"| {nodes} | {mode} | {r['startup_s']:.1f} | {r['python_s']:.1f} | {r['protocol_s']:.2f} | "
                   f"{r['import_cpu_s']:.2f} | {r['import_floor_s']:.1f} | {r['host_startup_s']:.2f} | "
                   f"{r['barrier_ms']:.1f} | {r['sched_rss_mib']:.0f} ({r['sched_peak_mib']:.0f} peak) | "
                   f"{r['heartbeats_per_s']:.0f} | {r['sched_cpu_idle']:.3f} | {r['shutdown_s']:.2f} | "
                   f"{r['false_failures']} |")
    return "\n".join(out)


def verdict(rows: list[dict]) -> str:
    top = max(r["nodes"] for r in rows)
    at = [r for r in rows if r["nodes"] == top]
    clean = all(r.get("false_failures", 1) == 0 and "startup_s" in r for r in at)
    host = max((r.get("host_startup_s", float("inf")) for r in at))
    wall = max((r.get("startup_s", float("inf")) for r in at))
    return (f"at {top} nodes: no false failure {'met' if clean else 'NOT met'}; start-up on hosts of their own "
            f"(one role's Python start + the protocol) {host:.1f} s <= {STARTUP_TARGET:.0f} s "
            f"{'met' if host <= STARTUP_TARGET else 'NOT met'}; on this machine's {os.cpu_count()} cores, "
            f"{wall:.1f} s wall {'met' if wall <= STARTUP_TARGET else 'NOT met'} "
            f"(Python start of every role serialised on {os.cpu_count()} cores is the floor column)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="8,32,128", help="job sizes, servers + workers (a quarter servers)")
    ap.add_argument("--modes", default="secure,plain")
    ap.add_argument("--steps", type=int, default=5, help="push/pull steps per worker")
    ap.add_argument("--barriers", type=int, default=20)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of heartbeats only, for their load")
    ap.add_argument("--job-timeout", type=float, default=300.0)
    harness.add_argument(ap, "control_plane", "--json", "--result")
    ap.add_argument("--role", choices=["node", "worker"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "node":
        return node_role(args.out)
    if args.role == "worker":
        return worker_role(args)

    import tempfile

    from tfkv import knobs

    try:
        sizes = [int(n) for n in args.nodes.split(",")]
        modes = [{"secure": True, "plain": False}[m] for m in args.modes.split(",")]
    except (ValueError, KeyError):
        ap.error(f"--nodes {args.nodes!r} must be integers >= 2 and --modes {args.modes!r} secure and/or plain")
    if min(sizes) < 2 or args.barriers < 1 or args.steps < 1:
        ap.error("--nodes must each be >= 2 (a server and a worker), --barriers and --steps >= 1")
    args.heartbeat_interval = knobs.get("cluster.heartbeat_interval", os.environ)
    print(f"control plane: jobs of {args.nodes} nodes (a quarter servers), {args.modes}, on this machine's "
          f"{os.cpu_count()} cores; heartbeat every {args.heartbeat_interval:g} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_control_plane_") as tmp:
        for nodes in sizes:
            for secure in modes:
                rows.append(run_job(nodes, secure, args, tmp))
                r = rows[-1]
                print(f"  {nodes} nodes {'secure' if secure else 'plain'}: "
                      + (f"start-up {r['startup_s']:.1f} s, {r['false_failures']} false failures"
                         if "startup_s" in r else f"FAILED: {r['exit']}"), flush=True)
    text = table(rows) + "\n\n" + verdict(rows) + "\n"
    print(text)
    if harness.write(args.result, "control_plane", harness.settings_of(args), rows):
        with open(os.path.splitext(args.result)[0] + ".md", "w") as f:
            f.write(f"# Control plane at scale\n\n`python -m benchmarks control_plane --nodes {args.nodes}"
                    f" --barriers {args.barriers} --idle {args.idle:g}`\n\n{text}")
    if any("startup_s" not in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
