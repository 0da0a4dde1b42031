"""How many GPUs a process on this host would see, asked without CUDA or TensorFlow: the entries
of CUDA_VISIBLE_DEVICES where it is set (as CUDA reads it), else the NVIDIA driver's GPU list.

Read where TensorFlow must not be imported yet (a worker binding its GPU, tfkv.parallel.binding)
or at all (the launcher's pre-flight on every host, tfkv.launcher.record).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from tfkv.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"
# Where the NVIDIA driver lists the host's GPUs, one directory each.
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def visible(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it (up to its first negative entry: "-1" is none);
    None where it is unset."""
    given = environ.get(VISIBLE)
    if given is None:
        return None
    entries = [v.strip() for v in given.split(",") if v.strip()]
    return entries[:next((n for n, v in enumerate(entries) if v.startswith("-")), len(entries))]


def count(environ: Mapping[str, str] = os.environ, root: Path = NVIDIA_GPUS) -> int | None:
    """How many GPUs a process started with `environ` sees here; None where neither
    CUDA_VISIBLE_DEVICES nor the NVIDIA driver says."""
    shown = visible(environ)
    if shown is not None:
        return len(shown)
    try:
        return sum(1 for _ in root.iterdir())
    except OSError:
        return None


def beyond(devices: Sequence[str], wanted: list[int], found: int, where: str, how: str) -> ConfigError:
    """The one line for a worker whose devices name a GPU its host does not have: `where` names
    the worker, `how` how the `found` GPUs were counted."""
    missing = next(i for i in wanted if i >= found)
    return ConfigError(f"{where}: devices {list(devices)} name gpu:{missing}, but {how} shows {found} GPU(s); run "
                       "fewer workers on this host (cluster.workers_per_host, slots= in the hosts file) or name "
                       "GPUs that exist")
