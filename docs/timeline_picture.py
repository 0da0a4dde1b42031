"""Draw the timeline guide's picture (docs/guides/timeline.png) from a merged trace, as the guide's
reader sees it in ui.perfetto.dev: a row per role's lane, a bar per event, over a few steps. (A
browser's screenshot cannot be taken where the docs are built; this draws the same events.)

    python -m tfkv.timeline merge runs/x/timeline -o all.json
    python docs/timeline_picture.py all.json [--skip 5] [--steps 2] [-o docs/guides/timeline.png]

Rows: each worker's steps (step, compute, push, pack, wait, assign), then its keys in flight (every
key's lane drawn in one row, each flight a translucent bar), then each server's requests (push,
pull, pushpull) with the sums, updates and replies inside them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# name: (colour, bottom, height) within a row of height 1; nested events drawn above their parent
STYLE = {
    "step": ("#d0d0d0", 0.05, 0.9), "compute": ("#4c72b0", 0.15, 0.5), "wait": ("#c44e52", 0.15, 0.5),
    "assign": ("#55a868", 0.15, 0.5), "push": ("#dd8452", 0.45, 0.4), "pack": ("#8c564b", 0.6, 0.25),
    "pushpull": ("#8172b3", 0.2, 0.6), "pull": ("#8172b3", 0.2, 0.6), "push ": ("#937860", 0.2, 0.6),
    "sum": ("#17becf", 0.45, 0.4), "update": ("#e377c2", 0.45, 0.4), "reply": ("#7f7f7f", 0.45, 0.4),
}
KEYS = 1000
DEPTH = {"step": 0, "push": 2, "pull": 0, "pushpull": 0, "pack": 3}  # drawn in this order (others: 1)


def rows_of(events: list[dict]) -> list[tuple[str, int, bool]]:
    """(label, pid, keys) per row: a worker's steps then its keys, a server's requests."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    order = sorted(names, key=lambda pid: (not names[pid].startswith("worker"), names[pid]))
    rows = []
    for pid in order:
        label = names[pid].split(" (")[0]
        if label.startswith("worker"):
            rows += [(f"{label}: steps", pid, False), (f"{label}: keys in flight", pid, True)]
        else:
            rows.append((f"{label}: requests", pid, False))
    return rows


def window(events: list[dict], skip: int, steps: int) -> tuple[float, float]:
    """From worker 0's step `skip` to the end of the `steps` after it (microseconds)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    first = min(pid for pid, n in names.items() if n.startswith("worker 0"))
    ts = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and e["pid"] == first
                and e["name"] == "step")
    chosen = ts[skip:skip + steps]
    return chosen[0][0], chosen[-1][1]


def draw(trace: Path, out: Path, skip: int, steps: int) -> None:
    events = json.loads(trace.read_text())["traceEvents"]
    start, end = window(events, skip, steps)
    rows = rows_of(events)
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.4))
    for y, (_, pid, keys) in enumerate(reversed(rows)):
        for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: DEPTH.get(e["name"], 1)):
            if e["pid"] != pid or (e["tid"] >= KEYS) != keys:
                continue
            if e["ts"] + e["dur"] < start or e["ts"] > end:
                continue
            colour, bottom, height = STYLE.get(e["name"], ("#bcbd22", 0.2, 0.6))
            if not keys and e["name"] in ("push", "pull", "pushpull") and not _on_worker(rows, pid):
                colour, bottom, height = ("#b5b35c", 0.1, 0.8)  # a server's request: the bar the work sits in
            ax.broken_barh([((e["ts"] - start) / 1e3, max(e["dur"], 1) / 1e3)], (y + bottom, height),
                           facecolors=colour, alpha=0.45 if keys else 1.0, linewidth=0)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], [label for label, _, _ in reversed(rows)])
    ax.set_xlim(0, (end - start) / 1e3)
    ax.set_xlabel("milliseconds")
    shown = ["step", "compute", "push", "wait", "assign", "pushpull", "sum", "update", "reply"]
    handles = [Patch(color=STYLE[n][0], label=n + (" (a key's flight)" if n == "pushpull" else "")) for n in shown]
    handles.append(Patch(color="#b5b35c", label="a server's request"))
    ax.legend(handles=handles, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False, fontsize=8)
    ax.set_title(f"{trace.name}: {steps} steps of a dist_sync job")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}")


def _on_worker(rows: list[tuple[str, int, bool]], pid: int) -> bool:
    return any(p == pid and label.startswith("worker") for label, p, _ in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="a merged trace (python -m tfkv.timeline merge)")
    ap.add_argument("--skip", type=int, default=5, help="worker 0's steps left out first (warm-up)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("-o", "--output", type=Path, default=Path(__file__).parent / "guides" / "timeline.png")
    args = ap.parse_args()
    draw(args.trace, args.output, args.skip, args.steps)


if __name__ == "__main__":
    main()
