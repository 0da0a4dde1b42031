"""Time to pack and unpack a 5.8M-value 2-bit push against a plain copy of its float32 buffer.

The limit of any pass over a push is reading and writing its float32 values once: the
baseline is `np.copyto` of the buffer, timed in the same run, trials alternating. Each kind
(MXNet's `2bit`, `2bit_momentum`) is packed by each implementation: the numpy scheme the KVStore
API's pushes and the servers use (tfkv.ps.compression: pack or pack_corrected, unpack) and the
TensorFlow ops a compiled step runs (tfkv.store.tf_compression, in a tf.function, the words
brought to numpy as the push hook takes them). `x copy` is the implementation's time over the
copy's (target: 3 or less).

    python -m benchmarks compression_speed [--values 5800000] [--seconds 0.5] [--trials 5]
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from benchmarks import harness

KINDS = ("2bit", "2bit_momentum")
THRESHOLD, MOMENTUM = 0.5, 0.9  # as a tfkv-run config's defaults and SGD's usual momentum

REPORT = harness.Report(
    "2-bit packing and unpacking against a copy",
    "Milliseconds to pack (quantise with error feedback) and to unpack a 5.8M-value push, per kind and "
    "implementation (numpy: the API's pushes and the servers; tf: the compiled step's ops), against "
    "`np.copyto` of the push's float32 buffer in the same run; `x_copy` is their ratio (target <= 3).",
    ["kind", "impl", "op"], ["ms"], "ms", columns=["kind", "impl", "op", "ms", "copy_ms", "x_copy"])


def contenders(kind: str, n: int) -> dict[tuple[str, str], Callable[[], Any]]:
    """(implementation, op) -> one call, on a push of `n` values of `kind`."""
    import numpy as np
    import tensorflow as tf

    from tfkv.ps import compression
    from tfkv.store import tf_compression

    rng = np.random.default_rng(0)
    grad = rng.normal(scale=0.3, size=n).astype(np.float32)
    residual, velocity = np.zeros(n, np.float32), np.zeros(n, np.float32)
    momentum = kind == "2bit_momentum"
    if momentum:
        np_pack = lambda: compression.pack_corrected(grad, velocity, residual, THRESHOLD, MOMENTUM)  # noqa: E731
    else:
        np_pack = lambda: compression.pack(grad, residual, THRESHOLD)  # noqa: E731
    words = np_pack()
    t_residual = tf.Variable(tf.zeros([n]))
    t_velocity = tf.Variable(tf.zeros([n])) if momentum else None
    t_grad, t_words = tf.constant(grad), tf.constant(words)
    tf_pack = tf.function(lambda g: tf_compression.pack(g, t_residual, THRESHOLD, t_velocity, MOMENTUM))
    tf_unpack = tf.function(lambda w: tf_compression.unpack(w, n, THRESHOLD))
    return {("numpy", "pack"): np_pack,
            ("numpy", "unpack"): lambda: compression.unpack(words, n, THRESHOLD),
            ("tf", "pack"): lambda: tf_pack(t_grad).numpy(),
            ("tf", "unpack"): lambda: tf_unpack(t_words).numpy()}


def milliseconds(call: Callable[[], Any], seconds: float) -> float:
    harness.warm_up(call)
    n, elapsed = harness.timed(call, seconds)
    return 1e3 * elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=5_800_000, help="values in the push (the MLP's 5.8M)")
    ap.add_argument("--seconds", type=float, default=0.5, help="per trial and contender")
    ap.add_argument("--trials", type=int, default=5)
    harness.add_argument(ap, "compression_speed")
    args = ap.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    src = np.random.default_rng(1).normal(size=args.values).astype(np.float32)
    dst = np.empty_like(src)
    copy = ("copy", "copy")
    print(f"{'kind':<14} {'impl':<6} {'op':<7} {'ms':>8} {'copy ms':>8} {'x copy':>7}  "
          f"({args.values} values, median of {args.trials})")
    rows = []
    for kind in KINDS:
        calls = {copy: lambda: np.copyto(dst, src), **contenders(kind, args.values)}
        times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
        for trial in range(args.trials):
            for k in harness.alternating(list(calls), trial):
                times[k].append(milliseconds(calls[k], args.seconds))
        med = harness.medians(times)
        for (impl, op), ms in med.items():
            if (impl, op) == copy:
                continue
            print(f"{kind:<14} {impl:<6} {op:<7} {ms:>8.2f} {med[copy]:>8.2f} {ms / med[copy]:>7.2f}")
            rows.append({"kind": kind, "impl": impl, "op": op, "values": args.values, "ms": ms,
                         "copy_ms": med[copy], "x_copy": ms / med[copy]})
    harness.write(args.result, "compression_speed", harness.settings_of(args), rows)


if __name__ == "__main__":
    main()
