"""One GPU per worker: a worker's `devices` with {rank}/{local_rank} expanded, and only its own
GPUs visible to it (CUDA_VISIBLE_DEVICES), set before TensorFlow is imported.

A launched worker knows its rank (TFKV_RANK_HINT) and its index among the workers on its host
(TFKV_LOCAL_RANK; tfkv.launcher.plan sets both). When a GPU entry of `devices` has a placeholder,
the worker binds itself as Horovod's recipe does: CUDA_VISIBLE_DEVICES lists exactly the GPUs its
devices name, in order, and TensorFlow then numbers them from gpu:0 (worker 3 of `gpu:{local_rank}`
sees physical GPU 3 as gpu:0, and no other GPU: no CUDA context, no memory on the others).
CUDA_VISIBLE_DEVICES set before (by the user, or a resource manager that gives each task its GPUs)
is respected: the indices count within it, as CUDA counts them. Devices without a placeholder are
left as written, so a hand-written config behaves as before.

TensorFlow reads CUDA_VISIBLE_DEVICES once, when it first looks for GPUs: `bind` must run before
TensorFlow is imported (tfkv.worker and tfkv-run call it first); it imports no TensorFlow itself.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import MutableMapping, Sequence

from tfkv.config.checks import LOCAL_RANK, device_template, expand_devices, parse_device
from tfkv.errors import ConfigError

VISIBLE = "CUDA_VISIBLE_DEVICES"
RANK = "TFKV_RANK_HINT"
# Where the NVIDIA driver lists the host's GPUs, one directory each: counted without CUDA or TF.
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")

# What the last `bind` in this process did, for devices.setup's message when a GPU is missing.
bound: str | None = None


def host_gpus(root: Path = NVIDIA_GPUS) -> int | None:
    """How many GPUs the NVIDIA driver shows on this host; None where it is not loaded."""
    try:
        return sum(1 for _ in root.iterdir())
    except OSError:
        return None


def bind(devices: Sequence[str], environ: MutableMapping[str, str] = os.environ,
         gpus_here: int | None = None) -> list[str]:
    """This worker's devices, expanded; where a GPU entry had a placeholder, CUDA_VISIBLE_DEVICES
    in `environ` is set to the GPUs they name and the list renumbers them from gpu:0. A GPU this
    host does not have (as far as the driver or CUDA_VISIBLE_DEVICES tell) is a ConfigError that
    names the rank, the host and the GPUs found. `gpus_here`: the host's GPU count (default: the
    driver's, `host_gpus`)."""
    global bound
    rank, local_rank = int(environ.get(RANK) or 0), int(environ.get(LOCAL_RANK) or 0)
    expanded = expand_devices(list(devices), rank, local_rank)
    if not any(device_template(d) and device_template(d)[0] == "gpu" for d in devices):
        return expanded
    parsed = [parse_device(d) for d in expanded]
    wanted = list(dict.fromkeys(i for kind, i in parsed if kind == "gpu"))
    given = environ.get(VISIBLE)
    visible = None
    if given is not None:  # set, even to "" or -1 (no GPU): CUDA counts within it, stopping at a bad entry
        visible = [v.strip() for v in given.split(",") if v.strip()]
        visible = visible[:next((n for n, v in enumerate(visible) if v.startswith("-")), len(visible))]
    count = len(visible) if visible is not None else (host_gpus() if gpus_here is None else gpus_here)
    where = f"worker {rank} (local rank {local_rank}) on {socket.gethostname()}"
    if count is not None:
        missing = [i for i in wanted if i >= count]
        if missing:
            found = f"{VISIBLE}={given!r} shows {count}" if visible is not None else f"the driver shows {count}"
            raise ConfigError(f"{where}: devices {list(devices)} name gpu:{missing[0]}, but {found} GPU(s); run "
                              "fewer workers on this host (cluster.workers_per_host, slots= in the hosts file) or "
                              "name GPUs that exist")
    environ[VISIBLE] = ",".join(visible[i] for i in wanted) if visible is not None else ",".join(map(str, wanted))
    bound = f"{where}: devices {list(devices)} bound to {VISIBLE}={environ[VISIBLE]}"
    number = {i: n for n, i in enumerate(wanted)}
    return [f"gpu:{number[i]}" if kind == "gpu" else f"{kind}:{i}" for kind, i in parsed]
