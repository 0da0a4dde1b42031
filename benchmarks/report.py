"""Write the performance page from the result files: docs/performance.md and docs/performance/*.png.

Each benchmark (benchmarks/suites/<name>.py) gets the section it declares (its REPORT, a
harness.Report): what it measures and against which baseline, the table of its latest record
(benchmarks/results/<name>.json), a plot, the date, commit and machine, and the command that
reruns it (`python -m benchmarks <name> ...`). A benchmark without a record gets a section that
says so.

    python -m benchmarks report            # rewrite the page and its plots
    python -m benchmarks report --check    # exit 1 if the committed page differs from the records

The page is a function of the records only (no time of generation), so `--check` can hold it to
them. `--check` compares the Markdown and that every plot it names exists; it does not compare the
PNG bytes, which depend on the matplotlib and FreeType versions that drew them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import Report
from benchmarks.suites import SUITES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def scripts() -> list[str]:
    """Every benchmark (benchmarks.suites.SUITES), in the page's order."""
    return list(SUITES)


def spec_of(name: str) -> Report:
    """The section the benchmark declares (its module's REPORT); one without: its docstring's
    first line and a table of every scalar field."""
    declared = getattr(importlib.import_module(f"benchmarks.suites.{name}"), "REPORT", None)
    if declared is not None:
        return declared
    doc = (HERE / "suites" / f"{name}.py").read_text().split('"""')
    first = doc[1].strip().splitlines()[0] if len(doc) > 2 else name
    return Report(name, first, [], [], "")


def rerun_command(command: str) -> str:
    """The command that reruns a record today: a record made before the benchmarks were a package
    says `python benchmarks/bench_<name>.py ...`, now `python -m benchmarks <name> ...`."""
    return re.sub(r"^python benchmarks/bench_(\w+)\.py\b", r"python -m benchmarks \1", command)


def fmt(v: Any) -> str:
    """A table cell: thousands separated above 1,000, three decimals below 100, '-' for none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 100:
            return f"{v:.0f}"
        return f"{v:.3f}".rstrip("0").rstrip(".") or "0"
    return str(v).replace("|", "\\|")


def columns_of(spec: Report, rows: list[dict]) -> list[str]:
    if spec.columns:
        return [c for c in spec.columns if any(c in r for r in rows)]
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and not isinstance(v, (dict, list))]
    return cols


def table(spec: Report, rows: list[dict]) -> str:
    cols = columns_of(spec, rows)
    lines = ["| " + " | ".join(c.replace("_", " ") for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(m: dict) -> str:
    if not m:
        return "not recorded"
    if "description" in m:
        return m["description"]
    gpu = ", ".join(m.get("gpus") or []) or "no GPU"
    versions = ", ".join(f"{k} {m[k]}" for k in ("python", "tensorflow", "tfkv", "pyzmq", "libzmq") if m.get(k))
    return (f"`{m.get('hostname')}`: {m.get('cpu')}, {m.get('logical_cores')} logical cores, "
            f"{m.get('memory_gib')} GiB, {gpu}; {m.get('os')}; {versions}")


def plot_name(name: str) -> str:
    return f"performance/{name}.png"


def plottable(spec: Report, rows: list[dict]) -> bool:
    return bool(spec.values) and any(isinstance(r.get(v), (int, float)) and not isinstance(r.get(v), bool)
                                     for r in rows for v in spec.values)


def section(name: str, rec: dict | None) -> str:
    spec = spec_of(name)
    out = [f"## {spec.title}", "", f"`python -m benchmarks {name}` (`benchmarks/suites/{name}.py`). {spec.what}", ""]
    rerun = rerun_command((rec or {}).get("command") or spec.rerun or f"python -m benchmarks {name}")
    if rec is None:
        out += ["Not yet recorded: no result file. Run it and regenerate this page:", "",
                "```bash", rerun, "python -m benchmarks report", "```", ""]
        return "\n".join(out)
    rows = spec.select(rec.get("rows") or [])
    out += [table(spec, rows), ""]
    if plottable(spec, rows):
        out += [f"![{spec.title}]({plot_name(name)})", ""]
    facts = [f"Measured {rec.get('date', 'on an unknown date')}",
             f"commit `{rec['commit']}`" if rec.get("commit") else None,
             f"on {machine_line(rec.get('machine') or {})}"]
    out += [", ".join(f for f in facts if f) + "."]
    if rec.get("source"):
        out += [f"Source: {rec['source']}."]
    if rec.get("note"):
        out += [f"Note: {rec['note'].rstrip('.')}."]
    out += ["", "Rerun:", "", "```bash", rerun, "```", ""]
    return "\n".join(out)


HEAD = """# Performance

This page shows the latest result of every benchmark in `benchmarks/`: what it measures, its table
and plot, where and when it ran, and how to rerun it. Every ratio compares two contenders measured
in the same run, on the same machine.

The page is generated from `benchmarks/results/*.json` by `python -m benchmarks report`; do not
edit it by hand. [Running the benchmarks](development/benchmarks.md) says how long each takes and
where its result goes. Figures marked "transcribed" were copied from an earlier README with the
date and machine it gave; rerun the benchmark to replace them with a full record.
"""


def load_records(results: Path, names: list[str]) -> dict[str, dict | None]:
    got: dict[str, dict | None] = {}
    for n in names:
        path = results / f"{n}.json"
        got[n] = json.loads(path.read_text()) if path.exists() else None
        if isinstance(got[n], list):  # rows written before records existed
            got[n] = {"rows": got[n]}
    return got


def page(records: dict[str, dict | None]) -> str:
    index = ["| benchmark | measured | on |", "|---|---|---|"]
    for n, rec in records.items():
        anchor = spec_of(n).title
        when = (rec or {}).get("date", "not yet recorded")[:10] if rec else "not yet recorded"
        kind = "transcribed" if rec and "transcribed" in rec.get("source", "") else ("run" if rec else "-")
        index.append(f"| [{anchor}](#{slug(anchor)}) | {when} | {kind} |")
    body = [section(n, rec) for n, rec in records.items()]
    return HEAD + "\n" + "\n".join(index) + "\n\n" + "\n".join(body).rstrip() + "\n"


def slug(title: str) -> str:
    """MkDocs' (Python-Markdown toc) anchor of a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", title).strip().lower())


def draw(name: str, rec: dict, out: Path) -> Path | None:
    """Bars of the spec's values per labelled row; None where there is nothing to plot."""
    spec = spec_of(name)
    rows = spec.select(rec.get("rows") or [])
    if not plottable(spec, rows):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [" ".join(fmt(r.get(k)) for k in spec.labels) for r in rows]
    values = [v for v in spec.values if any(v in r for r in rows)]
    height = max(2.2, 0.28 * len(rows) * max(1, len(values)) + 1.0)
    fig, ax = plt.subplots(figsize=(7.5, height), dpi=100)
    bar = 0.8 / len(values)
    for i, v in enumerate(values):
        ys = [j + (i - (len(values) - 1) / 2) * bar for j in range(len(rows))]
        xs = [r.get(v) if isinstance(r.get(v), (int, float)) else float("nan") for r in rows]
        ax.barh(ys, xs, height=bar, label=v.replace("_", " "))
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(spec.unit)
    ax.set_title(spec.title)
    if len(values) > 1:
        ax.legend(loc="best", fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None})  # no version stamp: the same records draw the same file
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=HERE / "results", help="where the records are")
    ap.add_argument("--docs", type=Path, default=REPO / "docs", help="where performance.md and performance/ go")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the records give")
    args = ap.parse_args(argv)
    records = load_records(args.results, scripts())
    text = page(records)
    target = args.docs / "performance.md"
    plots = [args.docs / plot_name(n) for n, rec in records.items()
             if rec and plottable(spec_of(n), spec_of(n).select(rec.get("rows") or []))]
    if args.check:
        stale = not target.exists() or target.read_text() != text
        missing = [str(p) for p in plots if not p.exists()]
        if stale or missing:
            if stale:
                print(f"report: {target} is out of date with {args.results}", file=sys.stderr)
            for p in missing:
                print(f"report: missing plot {p}", file=sys.stderr)
            print("report: run `python -m benchmarks report` and commit docs/performance.md and docs/performance/",
                  file=sys.stderr)
            return 1
        print(f"report: {target} matches {args.results}")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    for n, rec in records.items():
        if rec:
            draw(n, rec, args.docs / plot_name(n))
    print(f"report: wrote {target} and {len(plots)} plots in {args.docs / 'performance'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
