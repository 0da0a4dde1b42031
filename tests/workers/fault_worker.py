"""A worker that stays in its job (pushing, pulling) until killed or told a peer failed:
`python fault_worker.py OUT_JSON SECONDS`. Works for every dist type (sets an optimizer, which
the async types require)."""

import json
import os
import sys
import time

import numpy as np

import tfkv.store
from tfkv import optim

if __name__ == "__main__":
    out, seconds = sys.argv[1], float(sys.argv[2])
    kv = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=0.01)))
    kv.init(0, np.zeros(1000, np.float32))
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "rank": kv.rank}, f)
    steps, deadline = 0, time.time() + seconds
    while time.time() < deadline:
        kv.push(0, np.ones(1000, np.float32))
        kv.pull(0)
        steps += 1
        time.sleep(0.01)
    with open(out, "w") as f:
        json.dump({"pid": os.getpid(), "rank": kv.rank, "steps": steps, "value": float(kv.pull(0)[0])}, f)
    kv.close()
