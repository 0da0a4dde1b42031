"""The cluster benchmark's rows read back, compared and drawn: the table, the issue's targets as ratios
measured in one run, and the PNG plots. Rows of different runs are never compared: `load` refuses
them (one line, exit 2).

A row: run (the run's id), model, hosts, link, contender, samples_per_sec (median of the trials;
None when the job failed, with `error`), trials (each trial's samples/s), cpus (per host),
cpus_each (every host's budget, a straggler's too; tfkv_spare's server hosts' too), straggler,
global_batch, params, timings (a tfkv worker's step split, seconds per step), ratios {vs_mwms,
vs_pss, vs_local}; a tfkv_spare row also server_hosts (how many hosts ran its servers, beside its
`hosts` worker hosts; it is compared with the others at the same worker hosts).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable

REQUIRED = ("run", "model", "hosts", "link", "contender", "samples_per_sec", "cpus")


def load(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every row of the files, all of one run; else one line on stderr and exit 2."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            got = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            refuse(f"cannot read {path} ({e}); give `python -m benchmarks cluster --json` files")
        if isinstance(got, dict):  # a result record (benchmarks/harness.py): its rows
            got = got.get("rows")
        if not isinstance(got, list) or not all(isinstance(r, dict) and all(k in r for k in REQUIRED) for r in got):
            refuse(f"{path} is not a `python -m benchmarks cluster --json` file (a list of rows with {', '.join(REQUIRED)})")
        rows += got
    runs = sorted({r["run"] for r in rows})
    if len(runs) > 1:
        refuse(f"the rows come from {len(runs)} runs ({', '.join(runs)}): contenders measured in different runs are "
               "not compared; give the files of one run")
    return rows


def refuse(line: str) -> None:
    print(f"bench_cluster: {line}", file=sys.stderr)
    sys.exit(2)


def find(rows: list[dict], contender: str, model: str, hosts: int | None = None, link: str | None = None,
         straggler: bool = False, global_batch: int | None = None) -> dict | None:
    for r in rows:
        if (r["contender"], r["model"], bool(r.get("straggler"))) != (contender, model, straggler):
            continue
        if hosts is not None and r["hosts"] != hosts:
            continue
        if link is not None and r["link"] != link and r["hosts"] > 1:  # one host sends nothing over its link
            continue
        if global_batch is not None and r.get("global_batch") != global_batch:
            continue
        if r["samples_per_sec"]:
            return r
    return None


def find_any(rows: list[dict], contender: str) -> bool:
    """Whether the run has `contender` at all (its target is then shown, failed or not)."""
    return any(r["contender"] == contender for r in rows)


def add_ratios(rows: list[dict]) -> None:
    """Each row's samples/s over MWMS's, PSS's (same model, hosts, link) and local's (one host,
    the same global batch), where those were measured."""
    for r in rows:
        r["ratios"] = ratios = {}
        if not r["samples_per_sec"] or r["contender"] == "local":  # local is compared with, at its global batch
            continue
        for name in ("mwms", "pss"):
            base = find(rows, name, r["model"], r["hosts"], r["link"], bool(r.get("straggler")))
            if base:
                ratios[f"vs_{name}"] = round(r["samples_per_sec"] / base["samples_per_sec"], 3)
        local = find(rows, "local", r["model"], global_batch=r.get("global_batch"))
        if local:
            ratios["vs_local"] = round(r["samples_per_sec"] / local["samples_per_sec"], 3)


def _spread(r: dict) -> str:
    """A row's trials as min-max (samples/s), where it has more than one."""
    t = [x for x in r.get("trials") or [] if x]
    return f"{min(t):.0f}-{max(t):.0f}" if len(t) > 1 else ""


def table(rows: list[dict]) -> str:
    spread = any(_spread(r) for r in rows)
    lines = [f"{'model':<7} {'hosts':>5} {'link':<7} {'contender':<11} {'batch':>6} {'samples/s':>10} "
             + (f"{'trials':>11} " if spread else "") + f"{'vs mwms':>8} "
             f"{'vs pss':>7} {'vs local':>9}  tfkv worker's step (ms): compute / push inside it / pull+wait"]
    for r in rows:
        q = r.get("ratios", {})
        sps = f"{r['samples_per_sec']:.0f}" if r["samples_per_sec"] else "FAILED"
        t = r.get("timings") or {}
        split = (f"{1e3 * t.get('compute', 0):.0f} / {1e3 * t.get('push', 0):.0f} / {1e3 * t.get('pull', 0):.0f}"
                 if t and r["contender"] != "local" else "")
        link = (r["link"] or "-") + ("*" if r.get("straggler") else "")
        hosts = f"{r['hosts']}+{r['server_hosts']}" if r.get("server_hosts") else str(r["hosts"])
        lines.append(f"{r['model']:<7} {hosts:>5} {link:<7} {r['contender']:<11} {r.get('global_batch', ''):>6} {sps:>10} "
                     + (f"{_spread(r):>11} " if spread else "")
                     + " ".join(f"{q[k]:>{w}.2f}" if k in q else " " * w
                                for k, w in (("vs_mwms", 8), ("vs_pss", 7), ("vs_local", 9)))
                     + f"  {split}")
    if spread:
        lines.append("samples/s: the median of the trials; trials: their lowest-highest")
    if any(r.get("straggler") for r in rows):
        lines.append("* one host has half the others' CPU (the straggler setting)")
    if any(r.get("server_hosts") for r in rows):
        lines.append("W+S: tfkv_spare's W worker hosts and S server hosts (its servers and scheduler), each of the "
                     "same budget; its ratios are against the others on the W worker hosts alone (MWMS cannot use "
                     "the spare hosts)")
    if any(r["contender"] == "local" for r in rows):
        lines.append("local: one host alone, training the global batch of the rows it is compared with (batch)")
    return "\n".join(lines)


def _verdict(what: str, figure: float | None, goal: float, why: str = "") -> dict:
    holds = figure is not None and figure >= goal
    return {"target": what, "figure": None if figure is None else round(figure, 3), "goal": goal,
            "holds": holds if figure is not None else None, "why": why}


def _ratio(rows: list[dict], a: str, b: str, model: str, hosts: int, link: str | None,
           straggler: bool = False) -> float | None:
    ra, rb = find(rows, a, model, hosts, link, straggler), find(rows, b, model, hosts, link, straggler)
    return ra["samples_per_sec"] / rb["samples_per_sec"] if ra and rb else None


def _step(rows: list[dict], contender: str, model: str, hosts: int, link: str | None) -> str:
    """Where a tfkv worker's step went, as a reason."""
    r = find(rows, contender, model, hosts, link)
    t = (r or {}).get("timings") or {}
    if not t:
        return ""
    step = sum(t.values())
    return (f"{contender} step {1e3 * step:.0f} ms: compute {1e3 * t.get('compute', 0):.0f} (pushes inside "
            f"{1e3 * t.get('push', 0):.0f}), pull+wait {1e3 * t.get('pull', 0):.0f}")


def targets(rows: list[dict]) -> list[dict]:
    """The targets of issue 42's point 5 (tfkv against MWMS in every row of every model, tfkv_2way,
    tfkv_spare, LeNet's scaling to 4 hosts), issue 29's against PSS and tfkv_2bit, and the
    reference documents' claims, each with its figure."""
    got: list[dict] = []
    links = sorted({r["link"] for r in rows if r["link"]}, key=_link_bits)
    hosts = sorted({r["hosts"] for r in rows if r["contender"] != "local"})
    models = list(dict.fromkeys(r["model"] for r in rows))
    many = [h for h in hosts if h > 1]
    for m in models:
        for n in many:
            for link in links:
                f = _ratio(rows, "tfkv", "mwms", m, n, link)
                why = "" if f is None or f >= 1 else _step(rows, "tfkv", m, n, link)
                got.append(_verdict(f"tfkv >= 1.0x mwms, {m}, {n} hosts, {link}", f, 1.0, why))
    if 4 in hosts and "1gbit" in links:
        f = _ratio(rows, "tfkv_2bit", "mwms", "mlp", 4, "1gbit")
        got.append(_verdict("tfkv_2bit (accurate 2-bit compression + pushes overlapping the backward pass + one server "
                            "per host) >= 1.3x mwms, mlp, 4 hosts, 1gbit", f, 1.3, _step(rows, "tfkv_2bit", "mlp", 4, "1gbit")))
    if 4 in hosts and "1gbit" in links:
        f = _ratio(rows, "tfkv_2way", "mwms", "mlp", 4, "1gbit")
        if "mlp" in models and find_any(rows, "tfkv_2way"):
            got.append(_verdict("tfkv_2way (2-bit both ways) >= 2x mwms, mlp, 4 hosts, 1gbit", f, 2.0,
                                _step(rows, "tfkv_2way", "mlp", 4, "1gbit")))
        for m in ("mlp", "resnet"):
            r = find(rows, "tfkv_spare", m, 4, "1gbit")
            if m in models and find_any(rows, "tfkv_spare"):
                f = _ratio(rows, "tfkv_spare", "mwms", m, 4, "1gbit")
                got.append(_verdict(f"tfkv_spare (4 worker + {(r or {}).get('server_hosts', 'S')} server hosts) >= 1.3x "
                                    f"mwms on the 4 worker hosts, {m}, 1gbit", f, 1.3,
                                    _step(rows, "tfkv_spare", m, 4, "1gbit")))
    for m in models:
        for n in hosts:
            for link in links[:1] if n == 1 else links:
                f = _ratio(rows, "tfkv", "pss", m, n, link)
                if f is not None:
                    got.append(_verdict(f"tfkv >= 1.2x pss, {m}, {n} hosts, {link}", f, 1.2))
    if 4 in hosts and "10gbit" in links:
        r = find(rows, "tfkv", "lenet", 4, "10gbit")
        local = r and find(rows, "local", "lenet", global_batch=r["global_batch"])
        f = r["samples_per_sec"] / local["samples_per_sec"] if r and local else None
        got.append(_verdict("scaling: tfkv lenet, 4 hosts, 10gbit >= 3.5x one host of the same budget (local, same "
                            "global batch)", f, 3.5, _step(rows, "tfkv", "lenet", 4, "10gbit")))
    top = max(hosts) if hosts else 0
    small = []
    for m in models:
        for link in links:
            r = find(rows, "tfkv", m, top, link)
            local = r and find(rows, "local", m, global_batch=r["global_batch"])
            if r and local and top > 1:
                f = r["samples_per_sec"] / local["samples_per_sec"]
                got.append(_verdict(f"claim: several hosts faster than one: tfkv {m}, {top} hosts, {link} / local",
                                    f, 1.0, "" if f > 1 else _step(rows, "tfkv", m, top, link)))
                small.append((f, m, link))
    for m in models:
        f = _ratio(rows, "tfkv_async", "tfkv", m, top, None, straggler=True)
        if f is not None:
            got.append(_verdict(f"claim: dist_async >= 1.3x dist_sync with one host at half CPU, {m}, {top} hosts",
                                f, 1.3))
    if "1gbit" in links:
        f = _ratio(rows, "tfkv_2bit", "tfkv", "mlp", top, "1gbit")
        if f is not None:
            got.append(_verdict(f"claim: 2-bit >= 1.5x uncompressed, mlp, {top} hosts, 1gbit", f, 1.5,
                                _step(rows, "tfkv", "mlp", top, "1gbit")))
    if small:
        slower = [(f, m, link) for f, m, link in small if f < 1]
        f, m, link = min(small)
        got.append({"target": "claim: a small model (little compute for its parameters) is slower distributed, where "
                              "that holds", "figure": round(f, 3),
                    "goal": "< 1", "holds": bool(slower),
                    "why": ("slower distributed: " + ", ".join(f"{m} {link} {f:.2f}x" for f, m, link in slower)
                            if slower else f"no model is: the lowest is {m} {link} at {f:.2f}x local")})
    return got


def targets_table(got: list[dict]) -> str:
    lines = [f"{'holds':<9} {'figure':>7} {'goal':>6}  target (why, where it does not hold)"]
    for t in got:
        holds = "n/a" if t["holds"] is None else "holds" if t["holds"] else "NOT"
        fig = "-" if t["figure"] is None else f"{t['figure']:.2f}x"
        goal = f"{t['goal']:g}x" if isinstance(t["goal"], float) else t["goal"]
        lines.append(f"{holds:<9} {fig:>7} {goal:>6}  {t['target']}" + (f"  [{t['why']}]" if t["why"] else ""))
    return "\n".join(lines)


def _link_bits(link: str) -> float:
    from tfkv.emulate.spec import rate_bits

    return rate_bits(link)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """cluster_scaling.png (samples/s against hosts, a panel per model and link, a line per
    contender; local at each global batch dashed) and cluster_contenders.png (the contenders side
    by side at the largest host count, a panel per link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["samples_per_sec"] and not r.get("straggler")]
    models = list(dict.fromkeys(r["model"] for r in rows))
    links = sorted({r["link"] for r in rows if r["link"]}, key=_link_bits)
    contenders = list(dict.fromkeys(r["contender"] for r in rows if r["contender"] != "local"))
    run, cpus = rows[0]["run"], rows[0]["cpus"]
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(models), len(links), figsize=(5 * len(links), 3.6 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for c in contenders:
                pts = sorted((n, r["samples_per_sec"]) for n in sorted({r["hosts"] for r in rows})
                             for r in [find(rows, c, m, n, link)] if r)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=c)
            batch = {r["hosts"]: r["global_batch"] for r in rows if r["model"] == m and r["contender"] != "local"}
            local = sorted((n, r["samples_per_sec"]) for n, b in batch.items()
                           for r in [find(rows, "local", m, global_batch=b)] if r)
            if local:
                ax.plot(*zip(*local), "k--", marker="x", label="local (1 host, same global batch)")
            ax.set_title(f"{m}, {link}")
            ax.set_xlabel("hosts")
            ax.set_ylabel("samples/s")
            ax.set_xticks(sorted(batch))
            ax.grid(alpha=0.3)
    scaling = _save(fig, axes, out_dir / "cluster_scaling.png", run, cpus)

    top = max(r["hosts"] for r in rows)
    names = contenders + (["local"] if any(r["contender"] == "local" for r in rows) else [])
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 3.8), squeeze=False)
    for j, link in enumerate(links):
        ax = axes[0][j]
        width = 0.8 / len(names)
        for k, c in enumerate(names):
            vals = []
            for m in models:
                ref = find(rows, "tfkv", m, top, link)
                r = (find(rows, "local", m, global_batch=ref["global_batch"]) if c == "local" and ref
                     else find(rows, c, m, top, link))
                vals.append(r["samples_per_sec"] if r else 0)
            ax.bar([i + k * width for i in range(len(models))], vals, width, label=c)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
        ax.set_ylabel("samples/s")
        ax.set_title(f"{top} hosts, {link}")
    return [scaling, _save(fig, axes, out_dir / "cluster_contenders.png", run, cpus)]


def _save(fig: Any, axes: Any, path: Path, run: str, cpus: float) -> Path:
    import matplotlib.pyplot as plt

    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bench_cluster run {run}: {cpus} core(s) per host")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
