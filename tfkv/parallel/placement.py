"""Which device each layer group of a model runs on: from the config, or balanced automatically.

A model that supports model parallelism declares an ordered list of named `LayerGroup`s (MXNet's
`ctx_group`s); the config maps group names to devices (MXNet's `group2ctx`), or says
`placement=auto`, which cuts the group sequence into one contiguous stage per device so that the
most expensive stage is as cheap as possible (the spec's heuristics: neighbouring layers stay
together, the work is balanced). Costs are estimates: forward FLOPs per example, with parameter
counts as the tie-breaker (memory). Nothing here imports TensorFlow, so the config layer can
check a placement before TensorFlow starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tfkv.config import parse_device
from tfkv.errors import ConfigError
from tfkv.models.groups import LayerGroup  # what a model declares; placed here

AUTO = "auto"


@dataclass(frozen=True)
class Stage:
    """Consecutive groups on one device: the unit that pipelines against its neighbours."""

    device: str  # a config device spec, e.g. "cpu:1"
    groups: tuple[str, ...]
    flops: float
    params: int


def canonical(spec: str) -> str:
    """`CPU:1 ` -> `cpu:1` (a ConfigError if it is no device)."""
    kind, index = parse_device(spec)
    return f"{kind}:{index}"


def is_auto(placement: Any) -> bool:
    return isinstance(placement, str) and placement.strip().lower() == AUTO


def check(placement: Any, group_names: Sequence[str], devices: Sequence[str], model: str) -> None:
    """Reject a placement that cannot be carried out, in one line naming what exists.

    `placement` is `auto` or a mapping group -> device; every group must be placed, only on
    devices listed in `devices`, and every listed device must get a group (an idle device is
    almost certainly a mistake in the mapping).
    """
    names = list(group_names)
    devices = [canonical(d) for d in devices]
    if is_auto(placement):
        if len(devices) > len(names):
            raise ConfigError(
                f"placement=auto: {len(devices)} devices but model {model} has {len(names)} layer groups "
                f"({', '.join(names)}); use at most {len(names)} devices or a model with more layers")
        return
    if isinstance(placement, str) or not hasattr(placement, "items"):
        raise ConfigError(
            f"placement={placement!r} must be auto or a mapping of layer groups to devices, "
            f"e.g. placement={{{names[0]}:{devices[0]},...}}")
    given = {str(k): v for k, v in placement.items()}
    unknown = [g for g in given if g not in names]
    if unknown:
        raise ConfigError(
            f"placement: model {model} has no layer group {', '.join(map(repr, unknown))}; "
            f"its groups are {', '.join(names)}")
    missing = [g for g in names if g not in given]
    if missing:
        raise ConfigError(
            f"placement: no device for {', '.join(missing)}; map every layer group of model {model} "
            f"({', '.join(names)}) or use placement=auto")
    used = set()
    for g in names:
        try:
            d = canonical(str(given[g]))
        except ConfigError:
            raise ConfigError(f"placement: {g} -> {given[g]!r} is not a device; write cpu:N or gpu:N") from None
        if d not in devices:
            raise ConfigError(
                f"placement: {g} -> {d}, which is not in devices=[{','.join(devices)}]; "
                f"add it, e.g. devices=[{','.join(devices + [d])}]")
        used.add(d)
    idle = [d for d in devices if d not in used]
    if idle:
        raise ConfigError(
            f"placement puts no layer group on {', '.join(idle)}; drop it from devices or place a group there")


def assign(placement: Any, groups: Sequence[LayerGroup], devices: Sequence[str], model: str) -> list[str]:
    """The device spec of each group, in group order (`auto`: balanced contiguous stages)."""
    check(placement, [g.name for g in groups], devices, model)
    devices = [canonical(d) for d in devices]
    if not is_auto(placement):
        return [canonical(str(placement[g.name])) for g in groups]
    runs = partition([g.flops for g in groups], len(devices), tie=[float(g.params) for g in groups])
    out: list[str] = []
    for device, (start, end) in zip(devices, runs):
        out += [device] * (end - start)
    return out


def stages(groups: Sequence[LayerGroup], assignment: Sequence[str]) -> list[Stage]:
    """Merge runs of consecutive groups on the same device into stages."""
    out: list[Stage] = []
    for g, d in zip(groups, assignment):
        if out and out[-1].device == d:
            s = out[-1]
            out[-1] = Stage(d, s.groups + (g.name,), s.flops + g.flops, s.params + g.params)
        else:
            out.append(Stage(d, (g.name,), g.flops, g.params))
    return out


def format_plan(plan: Sequence[Stage], title: str) -> str:
    """The plan as a table: stage, device, groups, estimated cost and its share of the total."""
    total = sum(s.flops for s in plan) or 1.0
    params = sum(s.params for s in plan) or 1
    width = max(len(", ".join(s.groups)) for s in plan)
    lines = [f"{title}: {len(plan)} stage(s); cost = forward FLOPs per example (estimate)"]
    for i, s in enumerate(plan):
        lines.append(f"  stage {i}  {s.device:<6} {', '.join(s.groups):<{width}}  "
                     f"{s.flops / 1e6:10.3f} MFLOP ({100 * s.flops / total:5.1f}%)  "
                     f"{s.params / 1e6:7.3f}M params ({100 * s.params / params:5.1f}%)")
    worst = max(s.flops for s in plan)
    lines.append(f"  bottleneck stage: {worst / total:.1%} of the work "
                 f"(ideal for {len(plan)} stage(s): {1 / len(plan):.1%})")
    return "\n".join(lines)


def partition(costs: Sequence[float], k: int, tie: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Cut items 0..n-1 into k contiguous, non-empty runs [start, end), minimising the largest
    run's cost; among the optimal cuts, minimise the largest run's `tie` (e.g. parameters).

    Contiguous runs keep neighbouring layers on one device (activations cross a device boundary
    only k-1 times); minimising the maximum balances the pipeline, whose rate is that of its
    slowest stage. Exact dynamic programming, O(k n^2): n is a model's number of groups.
    """
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} items into {k} non-empty runs")
    best, runs = _min_max_split(list(map(float, costs)), k)
    if tie is not None:
        # Second pass: keep the optimal bottleneck (with slack for float round-off), balance `tie`.
        limit = best * (1 + 1e-9) + 1e-12
        _, runs = _min_max_split(list(map(float, tie)), k, bound=(list(map(float, costs)), limit))
    return runs


def _min_max_split(w: list[float], k: int, bound: tuple[list[float], float] | None = None
                   ) -> tuple[float, list[tuple[int, int]]]:
    n = len(w)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    bpre = [0.0]
    if bound is not None:
        for x in bound[0]:
            bpre.append(bpre[-1] + x)
    inf = float("inf")
    # best[j][i]: the smallest possible largest-run cost of items [0, i) cut into j runs
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for p in range(j - 1, i):
                if best[j - 1][p] == inf:
                    continue
                if bound is not None and bpre[i] - bpre[p] > bound[1]:
                    continue
                c = max(best[j - 1][p], pre[i] - pre[p])
                if c < best[j][i]:
                    best[j][i], cut[j][i] = c, p
    runs, i = [], n
    for j in range(k, 0, -1):
        p = cut[j][i]
        runs.append((p, i))
        i = p
    return best[k][n], runs[::-1]
