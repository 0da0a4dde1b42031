"""tfkv against tf.distribute on an emulated cluster (tfkv.emulate), same run, same hosts: training
samples/s of every contender at each host count and link, and issue 29's targets as ratios.

Each setting (hosts x link) is one emulated cluster: hosts with their own network namespace,
sshd, hostname, CPU budget (a cgroup quota of --cpus cores each) and link rate (tc tbf, both
directions; no added latency: netem is not in this kernel). On it every contender trains the same
models on the same synthetic data with the same global batch (hosts x --batch) and the same
threads (benchmarks/jobs.py says how each is started and placed). The straggler setting
(the largest host count, the fastest link) gives the last host half the others' CPU and runs
tfkv dist_sync and dist_async, for the claim that async is faster there. With the contender
tfkv_spare a setting's cluster has --server-hosts more hosts of the same budget, tfkv_spare's
server hosts (BytePS's placement); every other contender runs on the worker hosts alone, MWMS
because an all-reduce cannot use a host without a worker.

    python -m benchmarks cluster [--hosts 1,2,4] [--link 1gbit,10gbit] [--cpus 0.4]
        [--models lenet,mlp,resnet] [--contenders tfkv,tfkv_plain,...] [--seconds S] [--trials T]
        [--server-hosts S] [--json OUT] [--plots DIR] [--no-straggler]
    python -m benchmarks cluster --quick      # 2 hosts, 1gbit, mlp; tfkv, tfkv_plain, tfkv_2bit, mwms
    python -m benchmarks cluster --table OUT.json...   # the table and targets of a run's rows
    python -m benchmarks cluster --plot OUT.json...    # its PNGs (into --plots)

Needs root (namespaces, cgroups, tc); a cluster this machine cannot hold is refused in one line
(exit 2) before anything runs. Rows of different runs are never compared (exit 2). A failed job
is a row with its error, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks import cluster_report, harness, jobs
from benchmarks.jobs import TRAINING as MODELS, Failed


def largest_setting(rows: list[dict]) -> list[dict]:
    """The page's rows: the largest host count without a straggler, where the contenders differ most."""
    most = max((r["hosts"] for r in rows), default=0)
    return sorted((r for r in rows if r["hosts"] == most and not r.get("straggler")), key=lambda r: r["model"])


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Emulated cluster against tf.distribute",
    "Samples/s of tfkv's stores against `MultiWorkerMirroredStrategy` and `ParameterServerStrategy` on an "
    "emulated cluster (network namespaces, a CPU budget per host, shaped links), every contender in the "
    "same run. The table shows the largest host count without a straggler; the record has every setting.",
    ["model", "link", "contender"], ["samples_per_sec"], "samples/s",
    columns=["model", "hosts", "link", "contender", "samples_per_sec"], select=largest_setting)


# tfkv_async runs in the straggler setting, where its claim is; name it to run it everywhere
DEFAULT_CONTENDERS = [c for c in jobs.CONTENDERS if c != "tfkv_async"]
# with one host nothing is compressed across a link or waited for: the variants are left out there
ONE_HOST = ("tfkv", "mwms", "pss")
QUICK = {"hosts": "2", "link": "1gbit", "models": "mlp", "contenders": "tfkv,tfkv_plain,tfkv_2bit,mwms",
         "straggler": False}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="1,2,4", help="host counts, comma separated")
    ap.add_argument("--link", default="1gbit,10gbit", help="link rates (tc's syntax), comma separated")
    ap.add_argument("--cpus", type=float, default=0.4, help="CPU budget of each host, in cores")
    ap.add_argument("--models", default="lenet,mlp,resnet", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                    help=f"of {', '.join(jobs.CONTENDERS)} (the straggler setting runs tfkv and tfkv_async)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed steps per model, contender and trial")
    ap.add_argument("--trials", type=int, default=1, help="jobs per contender and setting (the median is kept)")
    ap.add_argument("--server-hosts", type=int, default=2,
                    help="tfkv_spare's server hosts, beside the worker hosts, each of --cpus (the others run on "
                         "the worker hosts alone)")
    ap.add_argument("--batch", type=int, default=64, help="per worker")
    ap.add_argument("--threads", type=int, default=0,
                    help="TF intra/inter-op threads of every contender's processes (0: TensorFlow's default)")
    ap.add_argument("--straggler", action=argparse.BooleanOptionalAction, default=True,
                    help="also the straggler setting (async against sync)")
    ap.add_argument("--job-timeout", type=float, default=300.0)
    ap.add_argument("--timeline", type=Path, metavar="DIR",
                    help="a timeline per tfkv row (tfkv.timeline): DIR/<hosts>h-<link>/<contender>-t<trial>/<model>/, "
                         "each role's file and their merge, timeline.json")
    harness.add_argument(ap, "cluster", "--json", "--result")
    ap.add_argument("--plots", help="where the PNGs go (default: --json's directory; none with --json none)")
    ap.add_argument("--quick", action="store_true", help=f"the short run: {QUICK}")
    ap.add_argument("--table", nargs="+", metavar="FILE", help="print the table and targets of a run's JSON rows")
    ap.add_argument("--plot", nargs="+", metavar="FILE", help="draw the PNGs of a run's JSON rows")
    args = ap.parse_args()
    if args.plots is None and (args.plot or args.result != "none"):
        args.plots = str(Path(args.plot[0] if args.plot else args.result).resolve().parent)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    try:
        args.hosts = sorted({int(h) for h in args.hosts.split(",")})
        assert all(h >= 1 for h in args.hosts)
    except (ValueError, AssertionError):
        ap.error(f"--hosts {args.hosts} must be host counts of at least 1, e.g. 1,2,4")
    if args.server_hosts < 1:
        ap.error(f"--server-hosts {args.server_hosts} must be at least 1 (tfkv_spare's server hosts)")
    args.link, args.models, args.contenders = (v.split(",") for v in (args.link, args.models, args.contenders))
    if args.timeline:
        from tfkv import timeline

        try:
            args.timeline = timeline.directory(str(args.timeline), what=f"--timeline {args.timeline}", remedy="")
        except timeline.TimelineError as e:
            ap.error(str(e))
    for what, given, known in (("model", args.models, MODELS), ("contender", args.contenders, jobs.CONTENDERS)):
        bad = [g for g in given if g not in known]
        if bad:
            ap.error(f"unknown {what} {bad[0]!r}; known: {', '.join(known)}")
    return args


def settings(args) -> list[tuple[int, str, bool]]:
    """(hosts, link, straggler) of every cluster the run brings up, in order. One host sends
    nothing over its link: it runs once, on the first link."""
    got = [(n, link, False) for link in args.link for n in args.hosts if n > 1 or link == args.link[0]]
    if args.straggler and max(args.hosts) > 1:
        from tfkv.emulate.spec import rate_bits

        got.append((max(args.hosts), max(args.link, key=rate_bits), True))
    return got


def specs(n: int, link: str, cpus: float, straggler: bool) -> list:
    from tfkv.emulate import HostSpec

    return [HostSpec(f"node{i + 1}", cpus=cpus / 2 if straggler and i == n - 1 else cpus, link=link)
            for i in range(n)]


def spare_hosts(args, n: int, straggler: bool) -> int:
    """The server hosts a setting's cluster has beside its `n` worker hosts: tfkv_spare's, if it runs there."""
    return args.server_hosts if "tfkv_spare" in contenders_of(args, n, straggler) else 0


def check_all(args) -> None:
    """Every cluster of the run (tfkv_spare's server hosts counted), refused (one line, exit 2)
    before the first is made."""
    from tfkv.emulate import Refused
    from tfkv.emulate.spec import check

    for n, link, straggler in settings(args):
        spare = spare_hosts(args, n, straggler)
        try:
            check(specs(n + spare, link, args.cpus, straggler))
        except Refused as e:
            cluster_report.refuse(f"refused: {e}" + (f" ({n} worker hosts + {spare} tfkv_spare server hosts, "
                                                       "--server-hosts)" if spare else ""))


def contenders_of(args, n: int, straggler: bool) -> list[str]:
    if straggler:
        return ["tfkv", "tfkv_async"]
    return [c for c in args.contenders if c != "local" and (n > 1 or c in ONE_HOST)]


def run_setting(args, run_id: str, n: int, link: str, straggler: bool, with_local: bool) -> list[dict]:
    """Bring one cluster up, run its contenders `--trials` times (order reversed every other
    trial), take it down; its rows."""
    from tfkv.emulate import Cluster

    names = contenders_of(args, n, straggler) + (["local"] if with_local else [])
    spare = spare_hosts(args, n, straggler)
    job = jobs.Settings(args.models, args.batch, args.seconds, args.threads, args.job_timeout, spare)
    got: dict[str, list[dict]] = {c: [] for c in names}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_cluster_") as state:
        with Cluster.up(specs(n + spare, link, args.cpus, straggler), state_dir=Path(state)) as cluster:
            hosts_file = Path(state) / "hosts"
            cluster.write_hosts(hosts_file)
            for trial in range(args.trials):
                for c in harness.alternating(names, trial):
                    if c in errors:
                        continue
                    t0 = time.monotonic()
                    with tempfile.TemporaryDirectory(prefix=f"bench_cluster_{c}_", dir="/tmp") as tmp:
                        try:
                            got[c].append(jobs.run(c, cluster, hosts_file, traced(args, job, n, link, straggler, c,
                                                                                  trial), Path(tmp)))
                        except (Failed, OSError, ValueError, KeyError) as e:
                            errors[c] = str(e)
                            print(f"  {c}: FAILED: {e}", file=sys.stderr, flush=True)
                    print(f"  {n} hosts {link}{' straggler' if straggler else ''}: {c} trial {trial + 1} "
                          f"({time.monotonic() - t0:.0f} s)", flush=True)
            cpus_each = [h.cpus for h in cluster.hosts]
    rows = []
    for c in names:
        for m in args.models:
            trials = [t[m]["samples_s"] for t in got[c]]
            last = got[c][-1][m] if got[c] else {}
            rows.append({"run": run_id, "model": m, "hosts": 1 if c == "local" else n,
                         "link": None if c == "local" else link, "contender": c,
                         "samples_per_sec": statistics.median(trials) if trials else None,
                         "trials": trials, "cpus": args.cpus,
                         "cpus_each": cpus_each[:1 if c == "local" else n + (spare if c == "tfkv_spare" else 0)],
                         **({"server_hosts": spare} if c == "tfkv_spare" else {}),
                         "straggler": straggler, "global_batch": n * args.batch, "batch_per_worker": args.batch,
                         "params": last.get("params"), "timings": last.get("timings"), "step_s": last.get("step_s"),
                         "push_bytes": last.get("push_bytes"), "seconds": args.seconds,
                         **({"error": errors[c].splitlines()[0]} if c in errors else {})})
    return rows


def traced(args, job: jobs.Settings, n: int, link: str, straggler: bool, contender: str, trial: int) -> jobs.Settings:
    """`job`, writing a timeline of the row under --timeline (tfkv's contenders only)."""
    if not args.timeline or not contender.startswith("tfkv"):
        return job
    row = f"{n}h-{link}{'-straggler' if straggler else ''}/{contender}-t{trial + 1}"
    return dataclasses.replace(job, timeline=args.timeline / row)


def show(rows: list[dict], plots: str | None) -> None:
    print(cluster_report.table(rows))
    got = cluster_report.targets(rows)
    print("\ntargets (ratios measured in this run)")
    print(cluster_report.targets_table(got))
    if plots:
        for p in cluster_report.plot(rows, Path(plots)):
            print(f"plot: {p}")


def main() -> None:
    args = parse()
    if args.table or args.plot:
        rows = cluster_report.load(args.table or args.plot)
        cluster_report.add_ratios(rows)
        show(rows, args.plots if args.plot else None)
        return
    run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    print(f"bench_cluster: per-host budget {args.cpus:g} core(s) (cgroup CPU quota), link(s) "
          f"{', '.join(args.link)} each way (tc tbf; no added latency); hosts {', '.join(map(str, args.hosts))}; "
          f"models {', '.join(args.models)}; batch {args.batch} per worker; run {run_id}", flush=True)
    if "tfkv_spare" in args.contenders:
        print(f"tfkv_spare: {args.server_hosts} more host(s) of the same budget run its servers; mwms and the "
              "other contenders run on the worker hosts alone (MWMS cannot use the spare hosts: an all-reduce "
              "has no place for a host without a worker)", flush=True)
    check_all(args)
    rows: list[dict] = []
    t_start = time.monotonic()
    for n, link, straggler in settings(args):
        # local (one host alone) once per global batch, on the first link's clusters
        with_local = "local" in args.contenders and not straggler and link == args.link[0]
        rows += run_setting(args, run_id, n, link, straggler, with_local)
        print(f"setting {n} hosts {link}{' straggler' if straggler else ''} done "
              f"({time.monotonic() - t_start:.0f} s in all)", flush=True)
    cluster_report.add_ratios(rows)
    harness.write(args.result, "cluster", harness.settings_of(args), rows, run=run_id)
    show(rows, args.plots)
    if any(r["samples_per_sec"] is None for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
