"""A cost model of a tfkv dist_sync step, from costs measured on this machine; its predictions
for the emulated cluster (benchmarks/suites/cluster.py) and a projection past one machine.

    python -m benchmarks scaling_model --measure      # costs -> benchmarks/results/scaling_costs.json
    python -m benchmarks scaling_model                # the model's tables -> results/scaling_model.{json,md}
    python -m benchmarks scaling_model --compare benchmarks/results/cluster.json   # predicted vs measured

`--measure` needs root (a cgroup v1 CPU quota, tfkv.emulate.budget): every cost is measured with
the processes inside a budget of --cpus cores (0.4, the emulated hosts'), as they run there:
  compute   a worker's forward and backward pass per model at the bench's per-worker batch (64),
            TensorFlow alone in the budget (GradientTape; the update runs on the servers);
  comm      push+pull (one pushpull) between 1 worker and 1 server sharing the budget, through
            tfkv's real parameter server (benchmarks/suites/pushpull.py's run_tfkv), secure and plain, at
            4 KiB, 1 MiB and 16 MiB and the 196-key set: per message (a), per byte (b) and per
            small fused key (k) come from a fit of these points;
  server    numpy's sum of a push into a round and tfkv's server SGD-momentum update
            (tfkv.ps.updater), per byte.
The link is not measured here: a tc tbf link carries 0.95 of its rate (issue 29's measurement).
No latency term: netem is not in this kernel, so none could be emulated or measured.

The step model (docs/concepts/scaling.md has it with the tables this writes): H hosts, one worker and one
server each, W = S = H, model of P bytes in keys (n_split keys of 1M elements or more, cut in a part per
server; n_whole keys over 64 KiB, a message each; n_small keys fused into a PUSHPULL per server),
per-worker batch B:
  T_cpu  = compute + (n_split*H + n_whole + min(H, n_small))*a + n_small*k + b*P
           + (H-1)/H*P*s_sum + P/H*s_update
  T_wire = 2*P*(H-1)/H / (0.95*rate)                  (each direction of a host's link)
  T_step = T_cpu + T_wire;   samples/s = H*B / T_step
All of a host's roles share its budget, so their CPU work adds; the wire time is counted as not
overlapping it (a pull's reply cannot leave before every worker's push of that key arrived).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from benchmarks import harness
from benchmarks.jobs import TRAINING as MODELS  # the cluster suite's models, by its names

RESULTS = str(harness.RESULTS)
COSTS = os.path.join(RESULTS, "scaling_costs.json")
BATCH = 64  # per worker, as the cluster suite's default
WIRE_EFFICIENCY = 0.95  # a tc tbf link's measured share of its rate
LINKS = {"1gbit": 1e9, "10gbit": 1e10, "25gbit": 25e9}
BIGARRAY_BOUND = 1_000_000  # elements: a key this big is cut into one part per server
FUSED_KEY_BYTES = 64 << 10  # tfkv.ps.kvworker: keys up to this size go together in one PUSHPULL per server
TARGET = 0.20


# -- probes: run inside the budget, print one JSON line ------------------------------------------

def probe_compute(model: str, seconds: float) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from tfkv.models import build

    cfg, shape = MODELS[model]
    net = build(cfg, input_shape=shape, num_classes=10)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((BATCH, *shape), np.float32))
    y = tf.constant(rng.integers(0, 10, BATCH).astype(np.int32))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            value = loss(y, net(x, training=True))
        return tape.gradient(value, net.trainable_weights)

    for _ in range(3):
        step()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        step()
        n += 1
    return {"step_s": (time.perf_counter() - t0) / n,
            "keys": [int(np.prod(w.shape)) for w in net.trainable_weights]}


def probe_comm(secure: bool, seconds: float) -> dict:
    from benchmarks.suites import pushpull as bp  # its tfkv contender and key set

    sizes = [4 << 10, 1 << 20, 16 << 20, bp.KEYSET]
    runs = [bp.run_tfkv(1, 1, sizes, seconds, 300, secure=secure) for _ in range(3)]
    # seconds per pushpull of a point: both directions' bytes / the rate
    return {str(n): statistics.median(2 * bp.point_bytes(n) / (r[n] * 1e9) for r in runs) for n in sizes}


def probe_server(seconds: float) -> dict:
    import numpy as np

    from tfkv import optim
    from tfkv.ps.updater import NumpyUpdater

    n = 4 << 20  # 16 MiB of float32
    acc, push = np.ones(n, np.float32), np.full(n, 0.5, np.float32)
    updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=0.01), momentum=0.9))
    weight = np.zeros(n, np.float32)

    def per_byte(fn) -> float:
        fn()
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or k < 3:
            fn()
            k += 1
        return (time.perf_counter() - t0) / k / (4 * n)

    return {"sum_s_per_byte": per_byte(lambda: np.add(acc, push, out=acc)),
            "update_s_per_byte": per_byte(lambda: updater.update(0, weight, push))}


# -- measuring: the probes in a budget -----------------------------------------------------------

def in_budget(cpus: float, argv: list[str]) -> dict:
    """Run `argv` (a probe) in a fresh cgroup of `cpus` cores; the JSON of its last output line."""
    from tfkv.emulate import budget

    group = budget.path("tfkv-scaling", str(os.getpid()))
    budget.make(group, cpus)
    try:
        proc = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv],
                              capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  p for p in (str(harness.REPO), os.environ.get("PYTHONPATH")) if p)})
    finally:
        budget.kill(lambda: budget.pids(group))
        budget.remove(group)
    if proc.returncode != 0:
        raise RuntimeError(f"probe {argv[argv.index('--probe'):]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fit_comm(points: dict) -> dict:
    """Per message a, per byte b (s, for a pushpull's bytes each way) and per small fused key k
    from the 1x1 pushpull times of 4 KiB, 1 MiB, 16 MiB and the key set."""
    from benchmarks.suites import pushpull as bp  # its tfkv contender and key set

    t4k, t1m, t16m = points[str(4 << 10)], points[str(1 << 20)], points[str(16 << 20)]
    b = (t16m - t1m) / ((16 << 20) - (1 << 20))
    a = max(t4k - b * (4 << 10), 0.0)
    whole = [c for c in bp.KEYSET_COUNTS if 4 * c > FUSED_KEY_BYTES]  # a message each
    small = [c for c in bp.KEYSET_COUNTS if 4 * c <= FUSED_KEY_BYTES]  # fused, one PUSHPULL for all
    t_keys = points[str(bp.KEYSET)]
    k = max(t_keys - (len(whole) + 1) * a - b * 4 * sum(bp.KEYSET_COUNTS), 0.0) / len(small)
    return {"a_s": a, "b_s_per_byte": b, "k_s": k}


def measure(cpus: float, seconds: float) -> dict:
    me = [*harness.suite_argv("scaling_model"), "--probe"]
    costs: dict = {"cpus": cpus, "batch": BATCH, "cores": os.cpu_count(), "load_before": os.getloadavg()[0],
                   "wire_efficiency": WIRE_EFFICIENCY, "compute": {}, "comm": {}}
    for m in MODELS:
        costs["compute"][m] = in_budget(cpus, [*me, "compute", "--model", m, "--seconds", str(seconds)])
        print(f"  compute {m}: {costs['compute'][m]['step_s'] * 1000:.0f} ms per step of {BATCH}", flush=True)
    for mode in ("secure", "plain"):
        points = in_budget(cpus, [*me, "comm", "--mode", mode, "--seconds", str(seconds / 2)])
        costs["comm"][mode] = {"points_s": points, **fit_comm(points)}
        print(f"  comm {mode}: {costs['comm'][mode]}", flush=True)
    costs["server"] = in_budget(cpus, [*me, "server", "--seconds", str(seconds / 2)])
    print(f"  server: {costs['server']}", flush=True)
    return costs


# -- the model -----------------------------------------------------------------------------------

def key_parts(keys: list[int]) -> tuple[int, int, int, int]:
    """(bytes, keys cut over the servers, other keys sent alone, small fused keys) of a model's
    keys (float32 elements each)."""
    split = sum(1 for n in keys if n >= BIGARRAY_BOUND)
    small = sum(1 for n in keys if 4 * n <= FUSED_KEY_BYTES)
    return 4 * sum(keys), split, len(keys) - split - small, small


def predict(costs: dict, model: str, hosts: int, link: str | None, secure: bool) -> dict:
    """The emulated cluster's step: `hosts` hosts of costs['cpus'] cores, one worker and one
    server each, behind `link`; its parts and samples/s."""
    c, s = costs["comm"]["secure" if secure else "plain"], costs["server"]
    P, split, whole, small = key_parts(costs["compute"][model]["keys"])
    h = hosts
    cpu = {"compute": costs["compute"][model]["step_s"],
           "messages": (split * h + whole + min(h, small)) * c["a_s"] + small * c["k_s"], "bytes": c["b_s_per_byte"] * P,
           "sum": (h - 1) / h * P * s["sum_s_per_byte"], "update": P / h * s["update_s_per_byte"]}
    wire = 0.0 if h == 1 else 2 * P * (h - 1) / h / (WIRE_EFFICIENCY * LINKS[link] / 8)
    step = sum(cpu.values()) + wire
    return {"model": model, "hosts": h, "link": link, "secure": secure, "step_s": step,
            "samples_per_sec": h * costs["batch"] / step, "wire_s": wire, **{f"{k}_s": v for k, v in cpu.items()}}


def project(costs: dict, model: str, workers: int, servers: int, link: str, cores: float, secure: bool) -> dict:
    """Past one machine: `workers` worker hosts and `servers` server hosts (separate), `cores`
    each, `link` each. CPU costs measured at costs['cpus'] cores scale by cpus/cores (CPU-bound
    work; a server's serving thread holds the GIL, so it gains nothing past 1 core). Each end pays
    half of a 1x1 pushpull's measured cost (worker and server both encode, seal, copy)."""
    c, s = costs["comm"]["secure" if secure else "plain"], costs["server"]
    P, split, whole, small = key_parts(costs["compute"][model]["keys"])
    w_scale = costs["cpus"] / cores
    s_scale = costs["cpus"] / min(cores, 1.0)
    rate = WIRE_EFFICIENCY * LINKS[link] / 8
    fan_in = workers / servers
    worker_cpu = w_scale * (costs["compute"][model]["step_s"] + 0.5 * (
        (split * servers + whole + min(servers, small)) * c["a_s"] + small * c["k_s"] + c["b_s_per_byte"] * P))
    server_cpu = s_scale * (0.5 * ((split + (whole + min(servers, small)) / servers) * workers * c["a_s"]
                                   + fan_in * small * c["k_s"] + fan_in * c["b_s_per_byte"] * P)
                            + (workers - 1) * P / servers * s["sum_s_per_byte"] + P / servers * s["update_s_per_byte"])
    wire = max(P, fan_in * P) / rate
    step = worker_cpu + server_cpu + wire
    return {"model": model, "workers": workers, "servers": servers, "link": link, "cores": cores, "secure": secure,
            "worker_cpu_s": worker_cpu, "server_cpu_s": server_cpu, "wire_s": wire, "step_s": step,
            "samples_per_sec": workers * costs["batch"] / step,
            "per_worker_vs_one": (workers * costs["batch"] / step) / workers / (costs["batch"] / (
                w_scale * costs["compute"][model]["step_s"]))}


def tables(costs: dict) -> tuple[list[dict], list[dict], str]:
    rows = [predict(costs, m, h, link if h > 1 else None, secure) for m in MODELS for secure in (True, False)
            for link in ("1gbit", "10gbit") for h in (1, 2, 4) if not (h == 1 and link == "10gbit")]
    proj = [project(costs, m, 64, 16, "25gbit", cores, secure) for m in MODELS for cores in (1.0, 4.0)
            for secure in (True, False)]
    md = [f"Costs measured in a {costs['cpus']:g}-core budget (scaling_costs.json)", "",
          "| cost | secure | plain |", "|---|---|---|"]
    md += [f"| {name} | " + " | ".join(f"{costs['comm'][m][key] * scale:.3g}" for m in ("secure", "plain")) + " |"
           for name, key, scale in (("a: per message, ms", "a_s", 1e3), ("b: per byte each way, ns", "b_s_per_byte", 1e9),
                                    ("k: per small fused key, us", "k_s", 1e6))]
    md += [f"| server sum, ns/byte | {costs['server']['sum_s_per_byte'] * 1e9:.3g} | |",
           f"| server SGD-momentum update, ns/byte | {costs['server']['update_s_per_byte'] * 1e9:.3g} | |"]
    md += [f"| compute of {m}, ms per step of {costs['batch']} ({len(c['keys'])} keys, {sum(c['keys']) / 1e6:.2f} M "
           f"params) | {c['step_s'] * 1e3:.1f} | |" for m, c in costs["compute"].items()]
    md += ["", "Predicted for the emulated cluster (one worker and one server per host)", "",
           "| model | mode | hosts | link | compute ms | messages ms | bytes ms | sum ms | update ms | wire ms | "
          "step ms | samples/s |", "|" + "---|" * 12]
    for r in rows:
        md.append(f"| {r['model']} | {'secure' if r['secure'] else 'plain'} | {r['hosts']} | {r['link'] or '-'} | "
                  + " | ".join(f"{1000 * r[k]:.1f}" for k in ("compute_s", "messages_s", "bytes_s", "sum_s",
                                                              "update_s", "wire_s", "step_s"))
                  + f" | {r['samples_per_sec']:.0f} |")
    md += ["", "Projection: 64 worker hosts, 16 server hosts, 25 Gbit/s links", "",
           "| model | mode | cores/host | worker CPU ms | server CPU ms | wire ms | step ms | samples/s | "
           "per-worker speed vs one host alone |", "|" + "---|" * 9]
    for r in proj:
        md.append(f"| {r['model']} | {'secure' if r['secure'] else 'plain'} | {r['cores']:g} | "
                  + " | ".join(f"{1000 * r[k]:.1f}" for k in ("worker_cpu_s", "server_cpu_s", "wire_s", "step_s"))
                  + f" | {r['samples_per_sec']:.0f} | {r['per_worker_vs_one']:.2f} |")
    return rows, proj, "\n".join(md)


def compare(costs: dict, path: str) -> tuple[str, bool]:
    """Predicted against measured samples/s for bench_cluster's tfkv (secure) and tfkv_plain rows."""
    try:
        with open(path) as f:
            measured = json.load(f)
        if isinstance(measured, dict):  # a result record (benchmarks/harness.py): its rows
            measured = measured.get("rows") or []
        rows = [r for r in measured if r.get("contender") in ("tfkv", "tfkv_plain") and not r.get("straggler")
                and r.get("samples_per_sec") and r.get("model") in MODELS]
    except (OSError, ValueError, AttributeError) as e:
        raise SystemExit(f"scaling_model: cannot read {path} ({e}); expected the cluster benchmark's JSON list of rows")
    if not rows:
        raise SystemExit(f"scaling_model: {path} has no tfkv or tfkv_plain row of {', '.join(MODELS)}")
    if any(abs(r.get("cpus", costs["cpus"]) - costs["cpus"]) > 1e-9 for r in rows):
        raise SystemExit(f"scaling_model: {path} was measured at another budget than the costs ({costs['cpus']} "
                         "cores); rerun --measure --cpus with its budget")
    lines = ["| model | contender | hosts | link | predicted | measured | error |", "|" + "---|" * 7]
    errors = []
    for r in sorted(rows, key=lambda r: (r["model"], r["contender"], r["link"] or "", r["hosts"])):
        p = predict(costs, r["model"], r["hosts"], r["link"] if r["hosts"] > 1 else None, r["contender"] == "tfkv")
        err = p["samples_per_sec"] / r["samples_per_sec"] - 1
        errors.append(abs(err))
        lines.append(f"| {r['model']} | {r['contender']} | {r['hosts']} | {r['link'] or '-'} | "
                     f"{p['samples_per_sec']:.1f} | {r['samples_per_sec']:.1f} | {100 * err:+.0f}% |")
    ok = max(errors) <= TARGET
    lines.append(f"\nlargest error {100 * max(errors):.0f}%, median {100 * statistics.median(errors):.0f}% over "
                 f"{len(errors)} rows: target within {100 * TARGET:.0f}% {'met' if ok else 'NOT met'}")
    return "\n".join(lines), ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="measure the costs (root: a cgroup budget)")
    ap.add_argument("--cpus", type=float, default=0.4, help="the budget the costs are measured in, in cores")
    ap.add_argument("--seconds", type=float, default=3.0, help="per compute probe (half per comm and server point)")
    ap.add_argument("--costs", default=COSTS)
    ap.add_argument("--compare", metavar="CLUSTER_JSON", help="predicted vs measured for the cluster benchmark's rows")
    ap.add_argument("--out", default=os.path.join(RESULTS, "scaling_model.json"))
    ap.add_argument("--probe", choices=["compute", "comm", "server"], help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=list(MODELS), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["secure", "plain"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        got = {"compute": lambda: probe_compute(args.model, args.seconds),
               "comm": lambda: probe_comm(args.mode == "secure", args.seconds),
               "server": lambda: probe_server(args.seconds)}[args.probe]()
        print(json.dumps(got))
        return
    if args.measure:
        if os.geteuid() != 0:
            ap.error("--measure needs root: it makes a cgroup v1 CPU budget under /sys/fs/cgroup/cpu")
        print(f"scaling_model: measuring costs in a budget of {args.cpus:g} cores (cgroup quota) on "
              f"{os.cpu_count()} cores", flush=True)
        costs = measure(args.cpus, args.seconds)
        os.makedirs(os.path.dirname(os.path.abspath(args.costs)), exist_ok=True)
        with open(args.costs, "w") as f:
            json.dump(costs, f, indent=1)
    try:
        with open(args.costs) as f:
            costs = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"no costs at {args.costs} ({e}); run with --measure first (root)")
    if args.compare:
        text, _ = compare(costs, args.compare)
        print(text)
        return
    rows, proj, md = tables(costs)
    print(md)
    with open(args.out, "w") as f:
        json.dump({"costs": args.costs, "emulated": rows, "projection": proj}, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(f"# Scaling model\n\n`python -m benchmarks scaling_model` (costs: `--measure --cpus "
                f"{costs['cpus']:g}`)\n\n{md}\n")


if __name__ == "__main__":
    main()
