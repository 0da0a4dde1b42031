"""Device specs as a config writes them: `cpu:N`, `gpu:N`, or a worker's own GPU by placeholder
(`gpu:{local_rank}`, `gpu:{rank}`), and MXNet's split of a batch over devices. Parsed here for
every layer that reads them (validation at the edge, the launcher's plan, the worker's binding,
the trainer's devices); the config's rules are tfkv.check's.
"""

from __future__ import annotations

import re
from typing import List, Optional

from tfkv.errors import ConfigError

_DEVICE = re.compile(r"^(cpu|gpu):(\d+)$")


def parse_device(spec: str) -> tuple[str, int]:
    """`gpu:2` -> ("gpu", 2); anything else is a ConfigError."""
    m = _DEVICE.match(str(spec).strip().lower())
    if not m:
        raise ConfigError(
            f"devices: {spec!r} is not a device; write cpu:N or gpu:N, e.g. devices=[gpu:0,gpu:1]"
        )
    return m.group(1), int(m.group(2))


# A device whose index is the worker's place in the job: `gpu:{local_rank}` (its index among the
# workers on its host, TFKV_LOCAL_RANK) or `gpu:{rank}` (its rank in the job). Each worker expands
# them when it starts (tfkv.parallel.binding), so one config serves every worker of a job.
DEVICE_PLACEHOLDERS = ("rank", "local_rank")
# The variables a launched worker finds them in: set by tfkv.launcher.plan (and the role helper
# under Slurm), read by tfkv.parallel.binding; a worker's own script may read them too.
LOCAL_RANK = "TFKV_LOCAL_RANK"  # the worker's index among the workers on its host, in rank order
LOCAL_SIZE = "TFKV_LOCAL_SIZE"  # how many workers its host runs
_TEMPLATE = re.compile(r"^(cpu|gpu):\{([^{}]*)\}$")


def device_template(spec: str) -> tuple[str, str] | None:
    """`gpu:{local_rank}` -> ("gpu", "local_rank"); None for a device without a placeholder; a
    ConfigError for a placeholder that is not one of DEVICE_PLACEHOLDERS."""
    m = _TEMPLATE.match(str(spec).strip().lower())
    if not m:
        return None
    if m.group(2) not in DEVICE_PLACEHOLDERS:
        raise ConfigError(f"devices: {spec!r} names {{{m.group(2)}}}; a device index may be a number, {{rank}} "
                          "(the worker's rank in the job) or {local_rank} (its index among the workers on its host)")
    return m.group(1), m.group(2)


def expand_devices(devices: List[str], rank: int, local_rank: int) -> list[str]:
    """`devices` with {rank} and {local_rank} replaced by this worker's numbers."""
    places = {"rank": rank, "local_rank": local_rank}
    out = []
    for spec in devices:
        template = device_template(spec)
        out.append(f"{template[0]}:{places[template[1]]}" if template else str(spec))
    return out


def bound_gpus(devices: List[str], rank: int, local_rank: int) -> list[int] | None:
    """The GPUs a worker is bound to (made the only ones it sees, tfkv.parallel.binding): those
    its expanded devices name, in order, when a GPU entry has a placeholder; else None (devices
    as written, nothing bound)."""
    if not any((device_template(d) or ("",))[0] == "gpu" for d in devices):
        return None
    parsed = [parse_device(d) for d in expand_devices(devices, rank, local_rank)]
    return list(dict.fromkeys(i for kind, i in parsed if kind == "gpu"))


def split_batch(batch_size: int, work_load_list: Optional[List[float]], num_devices: int) -> list[int]:
    """Examples per device, MXNet's rule: proportional to the work load, the remainder to the last."""
    loads = list(work_load_list) if work_load_list else [1.0] * num_devices
    total = float(sum(loads))
    sizes = [int(round(w * batch_size / total)) for w in loads]
    sizes[-1] += batch_size - sum(sizes)
    return sizes
