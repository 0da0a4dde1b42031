"""The transport's benchmarks on two source trees in the same run: what a refactor did to speed.

A change to the parameter server or the store (issue 30's redesign, say) must keep the figures of
the pushpull, security and dist_training benchmarks. This machine is shared and noisy, so
figures from another day say little: this runs each benchmark from each tree (its own
benchmark: `python -m benchmarks NAME`, or `benchmarks/bench_NAME.py` in a checkout from before the
package; its own `tfkv` first on PYTHONPATH, its own processes) in alternating order, round after
round (base, new, new, base, ...), and reports for every figure the median of each tree and
new/base, beside the spread between the base tree's own rounds (the noise a ratio must clear).

    python -m benchmarks trees --base /path/to/old/checkout [--new .] [--rounds 2]
                                     [--only pushpull,security,dist_training] [--out results/trees]

The base tree is any checkout of tfkv (`git worktree add --detach /tmp/base <commit>`). Each
benchmark runs with short settings (below, `SETTINGS`): enough to see a change of 10%, not the
benchmarks' own full runs. Writes <out>.json and <out>.md; exits non-zero if a run fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Two checkouts compared",
    "The push/pull, security and distributed-training benchmarks run on two checkouts of tfkv, rounds "
    "alternating: `new/base` is the later tree's median over the earlier tree's, `base spread` the "
    "earlier tree's own spread between rounds.",
    ["bench", "row", "figure"], ["new/base"], "new / base",
    columns=["bench", "row", "figure", "base_median", "new_median", "new/base", "base_spread"])


# Per benchmark: its arguments here, the first word of its table's header line, and the names of
# the table's columns (the header itself has names with spaces in them).
SETTINGS = {
    "pushpull": (["--sizes", "4K,1M,16M,keyset", "--trials", "3", "--seconds", "0.5", "--no-copy-baseline"], "size",
                 ["size", "raw1", "tfkv1", "tfkv1/raw1", "raw2", "tfkv2", "tfkv2/raw2", "mxnet", "secure1",
                  "secure1/tfkv1"]),
    "security": (["--sizes", "4K,1M,16M,64M", "--rounds", "3", "--seconds", "0.5"], "size",
                 ["size", "plain", "secure", "secure/plain"]),
    "dist_training": (["--trials", "2", "--seconds", "2", "--no-pss"], "model",
                      ["model", "params", "local", "mwms", "dist_sync", "plain", "dist/mwms", "dist/local",
                       "secure/plain"]),
}
# The figures compared (the rest are baselines of the benchmark's own, printed for context).
COMPARED = {
    "pushpull": ["tfkv1", "tfkv1/raw1", "tfkv2", "tfkv2/raw2", "secure1"],
    "security": ["plain", "secure"],
    "dist_training": ["dist_sync", "plain", "dist/mwms"],
}


def parse_table(text: str, first: str, columns: list[str]) -> dict[str, dict[str, float]]:
    """{row label: {column: value}} of the table whose header line starts with `first`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first])
    rows = {}
    for line in lines[start + 1:]:
        cells = line.split()
        if len(cells) > 1 and cells[1] in ("B", "KiB", "MiB", "GiB"):  # a size label: "4 KiB"
            cells = [" ".join(cells[:2]), *cells[2:]]
        if len(cells) != len(columns):
            break
        values = {}
        for name, cell in zip(columns[1:], cells[1:]):
            try:
                values[name] = float(cell.replace(",", ""))
            except ValueError:
                values[name] = float("nan")  # a '-' (no MXNet figure at that size)
        rows[cells[0]] = values
    if not rows:
        raise ValueError(f"no rows under the {first!r} header")
    return rows


def command(tree: Path, bench: str) -> list[str]:
    """How `tree` runs one of its benchmarks: `python -m benchmarks NAME` where the tree has the
    package, its script by path in a checkout from before (benchmarks/bench_NAME.py)."""
    if (tree / "benchmarks" / "__main__.py").exists():
        return harness.suite_argv(bench)
    return [sys.executable, str(tree / "benchmarks" / f"bench_{bench}.py")]


def run_one(tree: Path, bench: str) -> dict[str, dict[str, float]]:
    args, first, columns = SETTINGS[bench]
    with tempfile.TemporaryDirectory(prefix="bench_trees_") as records:
        # the runs' own records go to a scratch folder: a comparison must not replace a tree's results;
        # the tree first on PYTHONPATH: its own tfkv (and its own benchmarks package)
        env = {**os.environ, "PYTHONPATH": str(tree), harness.ENV: records}
        done = subprocess.run([*command(tree, bench), *args], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench_{bench} on {tree} exited {done.returncode}: {done.stderr.strip()[-800:]}")
    return parse_table(done.stdout, first, columns)


def summarise(runs: dict[str, list[dict]], bench: str) -> list[dict]:
    """One row per (table row, compared figure): medians, new/base, the base's round spread."""
    out = []
    for label in runs["base"][0]:
        for fig in COMPARED[bench]:
            base = [r[label][fig] for r in runs["base"]]
            new = [r[label][fig] for r in runs["new"]]
            mb, mn = statistics.median(base), statistics.median(new)
            spread = (max(base) - min(base)) / mb if mb else float("nan")
            out.append({"bench": bench, "row": label, "figure": fig, "base": base, "new": new,
                        "base_median": mb, "new_median": mn, "new/base": mn / mb if mb else float("nan"),
                        "base_spread": spread})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, type=Path, help="the tree before (a checkout of tfkv)")
    ap.add_argument("--new", type=Path, default=harness.REPO, help="the tree after")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every benchmark per tree")
    ap.add_argument("--only", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=harness.default_path("trees").with_suffix(""),
                    help="where the results go: OUT.json (the record) and OUT.md")
    a = ap.parse_args()
    benches = a.only.split(",")
    unknown = [b for b in benches if b not in SETTINGS]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    trees = {"base": a.base.resolve(), "new": a.new.resolve()}
    for name, tree in trees.items():
        if not (tree / "tfkv" / "__init__.py").exists():
            ap.error(f"--{name} {tree} is not a checkout of tfkv (no tfkv/__init__.py)")
    commits = {n: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for n, t in trees.items()}
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        for bench in benches:
            runs: dict[str, list[dict]] = {"base": [], "new": []}
            for r in range(a.rounds):
                for name in harness.alternating(["base", "new"], r):
                    runs[name].append(run_one(trees[name], bench))
                    print(f"  {bench} round {r + 1}/{a.rounds} {name} done ({time.monotonic() - t0:.0f} s)",
                          flush=True)
            rows += summarise(runs, bench)
    except (RuntimeError, ValueError, StopIteration, subprocess.TimeoutExpired) as e:
        print(f"bench_trees: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    head = (f"base {commits['base']} vs new {commits['new']}, {a.rounds} alternating rounds each, medians; "
            "spread = (max - min) / median of the base's own rounds")
    table = [f"| bench | row | figure | base | new | new/base | base spread |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        table.append(f"| {row['bench']} | {row['row']} | {row['figure']} | {row['base_median']:.3f} | "
                     f"{row['new_median']:.3f} | {row['new/base']:.3f} | {row['base_spread']:.3f} |")
    print(head)
    print("\n".join(table))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    harness.write(a.out.with_suffix(".json"), "trees", {b: SETTINGS[b][0] for b in benches}, rows, commits=commits,
                 rounds=a.rounds)
    a.out.with_suffix(".md").write_text(f"# bench_trees\n\n{head}\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
