"""A worker of the two-way compression tests: `python twoway_worker.py OUT_NPZ MODE STEPS [STATE]`.

Pushes the gradients of `grads` (dyadic: exact in float32 and in the test's numpy oracle), 2-bit
both ways, and saves into OUT_NPZ every value pulled, the pull bytes of each step and, with
`STATE`, worker 0's checkpoint of the servers' optimizer state and every worker's residuals
(`share_feedback`) after the steps. MODE:
- "sgd": SGD (lr 0.5, momentum 0.5) on the servers;
- "sum": no optimizer on the servers (update_on_kvstore=false: they sum, the workers update);
- "resume": as "sgd", but the key is initialised with the copy, the servers' state and each
  worker's residuals of STATE (a checkpoint "sgd" saved), then STEPS more steps.
On a `*_device` type each gradient is pushed as two device values of half of it.
"""

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402

SIZE = 3000  # over 2 servers (MXNET_KVSTORE_BIGARRAY_BOUND=1000) and chunks of 4000 bytes
PUSH_T, PULL_T, LR, MOMENTUM = 0.5, 0.25, 0.5, 0.5


def grads(step: int, rank: int) -> np.ndarray:
    """Worker `rank`'s gradient at `step`: multiples of 1/8 in [-1, 1]."""
    return (np.random.default_rng(1000 * step + rank).integers(-8, 9, SIZE) / 8).astype(np.float32)


def initial() -> np.ndarray:
    return (np.random.default_rng(7).integers(-64, 65, SIZE) / 64).astype(np.float32)


def main() -> None:
    out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    state = sys.argv[4] if len(sys.argv) > 4 else None
    kv = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))
    kv.set_gradient_compression({"type": "2bit", "threshold": PUSH_T, "both_ways": True, "pull_threshold": PULL_T})
    start = 0
    if mode == "resume":
        with np.load(state + ".copy.npz") as f:
            kv.init("w", f["copy"])
            start = int(f["steps"])
    else:
        kv.init("w", initial())
    if mode != "sum":
        kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=LR), momentum=MOMENTUM))
    if mode == "resume":
        kv.load_optimizer_states(state)
    pulled, nbytes = [kv.pull("w")], []
    for step in range(start, start + steps):
        g = grads(step, kv.rank)
        before = kv.pull_bytes
        kv.push("w", [g * 0.5, g * 0.5] if kv.type.endswith("_device") else g)
        pulled.append(kv.pull("w"))
        nbytes.append(kv.pull_bytes - before)
    if state and mode != "resume":
        kv.share_feedback()  # every worker's residuals into worker 0's checkpoint
        if kv.rank == 0:
            kv.save_optimizer_states(state)
            np.savez(state + ".copy.npz", copy=pulled[-1], steps=steps)
    kv.barrier()
    np.savez(out, pulled=np.stack(pulled), nbytes=np.array(nbytes))
    kv.close()


if __name__ == "__main__":
    main()
