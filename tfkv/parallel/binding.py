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
from typing import MutableMapping, Sequence

from tfkv import gpus
from tfkv.config.device_specs import LOCAL_RANK, bound_gpus, expand_devices, parse_device

RANK = "TFKV_RANK_HINT"

# What the last `bind` in this process did, for devices.setup's message when a GPU is missing.
bound: str | None = None


def bind(devices: Sequence[str], environ: MutableMapping[str, str] = os.environ,
         gpus_here: int | None = None) -> list[str]:
    """This worker's devices, expanded; where a GPU entry had a placeholder, CUDA_VISIBLE_DEVICES
    in `environ` is set to the GPUs they name and the list renumbers them from gpu:0. A GPU this
    host does not have (as far as the driver or CUDA_VISIBLE_DEVICES tell, tfkv.gpus) is a
    ConfigError that names the rank, the host and the GPUs found. `gpus_here`: the driver's GPU
    count to assume (default: the driver's own)."""
    global bound
    rank, local_rank = int(environ.get(RANK) or 0), int(environ.get(LOCAL_RANK) or 0)
    expanded = expand_devices(list(devices), rank, local_rank)
    wanted = bound_gpus(list(devices), rank, local_rank)
    if wanted is None:
        return expanded
    visible = gpus.visible(environ)
    count = len(visible) if visible is not None else (gpus.count({}) if gpus_here is None else gpus_here)
    where = f"worker {rank} (local rank {local_rank}) on {socket.gethostname()}"
    if count is not None and max(wanted) >= count:
        how = f"{gpus.VISIBLE}={environ[gpus.VISIBLE]!r}" if visible is not None else "the driver"
        raise gpus.beyond(devices, wanted, count, where, how)
    environ[gpus.VISIBLE] = ",".join(visible[i] for i in wanted) if visible is not None else ",".join(map(str, wanted))
    bound = f"{where}: devices {list(devices)} bound to {gpus.VISIBLE}={environ[gpus.VISIBLE]}"
    number = {i: n for n, i in enumerate(wanted)}
    return [f"gpu:{number[i]}" if kind == "gpu" else f"{kind}:{i}" for kind, i in map(parse_device, expanded)]
