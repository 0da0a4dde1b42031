"""Gradient compression on numpy arrays: the kinds a store takes (one registry), and 2-bit
quantisation with error feedback, MXNet's scheme, with or without momentum correction.

With threshold t, each element of (value + residual) becomes +t, -t or 0; what was not sent
stays in the residual for the next push. Codes take 2 bits each (0: 0, 1: +t, 2: -t; 3 is
invalid), 16 per little-endian uint32 word, element i in bits 2*(i % 16). No TensorFlow here.

The kinds differ only in what is quantised, never in the words on the wire:
- `2bit` (MXNet's API name; `2bit_mxnet` in a tfkv-run config): the gradient itself, MXNet's
  exact scheme. The store's optimizer (SGD's momentum included) runs on what it receives.
- `2bit_momentum` (`2bit` in a tfkv-run config): Deep Gradient Compression's momentum
  correction (Lin et al., 2018) with a masking of its own. The sender keeps a velocity
  u = m*u + g per value, with m the momentum of the optimizer the store is given, adds u into
  the residual, quantises the residual as above, and zeroes u where the channel is saturated
  (`pack_corrected`); the store's optimizer runs with momentum 0, so momentum is applied once,
  before the quantisation, and a value still being sent from the residual is not amplified by
  it again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from tfkv import optim


@dataclass(frozen=True)
class Kind:
    """One kind of gradient compression and what it needs of the store that runs it."""

    name: str  # its `type` in set_gradient_compression (MXNet's API)
    config: str  # its kvstore.compression.type in a tfkv-run config
    quantises: bool  # what is sent is 2-bit words (else float32 values, as without compression)
    # the optimizer's momentum runs on the sender, before quantising; the store's optimizer runs
    # without it (so it needs SGD, in the store: update_on_kvstore)
    worker_momentum: bool
    scheme: str = ""  # what it is, in words (a run's log names it)


KINDS = (
    Kind("none", "none", quantises=False, worker_momentum=False),
    Kind("2bit", "2bit_mxnet", quantises=True, worker_momentum=False, scheme="MXNet's exact 2-bit"),
    Kind("2bit_momentum", "2bit", quantises=True, worker_momentum=True,
         scheme="2-bit with SGD's momentum applied by each sender (momentum correction)"),
)
TYPES = tuple(k.name for k in KINDS)
CONFIG_TYPES = tuple(k.config for k in KINDS)


@dataclass(frozen=True)
class Setting:
    """A parsed compression setting: its kind, its threshold, and whether the servers' replies to
    pulls are 2-bit compressed too (`both_ways`, beyond MXNet: tfkv.ps.replies), with their own
    threshold (`pull_threshold`; None: derived from the servers' optimizer, `pull_threshold_for`)."""

    kind: Kind
    threshold: float
    both_ways: bool = False
    pull_threshold: float | None = None

    def params(self) -> dict[str, Any]:
        """What set_gradient_compression takes for it."""
        params: dict[str, Any] = {"type": self.kind.name, "threshold": self.threshold}
        if self.both_ways:
            params["both_ways"] = True
            if self.pull_threshold is not None:
                params["pull_threshold"] = self.pull_threshold
        return params


def describe(setting: Setting) -> str:
    """The scheme `setting` runs, by its name in a config and in the API, and how to get the other
    2-bit scheme in each: the names differ (a config's 2bit is the API's 2bit_momentum)."""
    other = next(k for k in KINDS if k.quantises and k is not setting.kind)
    both = ""
    if setting.both_ways:
        at = "from the servers' optimizer" if setting.pull_threshold is None else f"{setting.pull_threshold:g}"
        both = f"; the servers' replies 2-bit too, with error feedback on the servers (threshold {at})"
    return (f"gradient compression: {setting.kind.scheme}, threshold {setting.threshold:g}{both} "
            f"(kvstore.compression.type={setting.kind.config}; set_gradient_compression type {setting.kind.name!r}); "
            f"for {other.scheme}: kvstore.compression.type={other.config} (type {other.name!r})")


def split_momentum(setting: Setting | None, optimizer: optim.Optimizer) -> tuple[optim.Optimizer, float]:
    """(the optimizer a store runs, the momentum its senders apply first) under `setting`: a kind
    with worker momentum takes SGD's momentum out of the optimizer (the store applies no momentum
    a second time; rate, schedule, rescale_grad, clipping and weight decay stay). ValueError for
    an optimizer without SGD's momentum."""
    if setting is None or not setting.kind.worker_momentum:
        return optimizer, 0.0
    if not isinstance(optimizer, optim.SGD):
        raise ValueError(f"gradient compression {setting.kind.name} applies SGD's momentum on the workers; "
                         f"optimizer {optimizer.name} has none: use SGD, or compression type 2bit (MXNet's)")
    return replace(optimizer, momentum=0.0), float(optimizer.momentum)


def words(count: int) -> int:
    """uint32 words that hold `count` 2-bit codes."""
    return (count + 15) // 16


def parse(params: Mapping[str, Any] | None, where: str = "compression") -> Setting | None:
    """MXNet's compression params ({"type": "2bit", "threshold": 0.5}) -> the Setting, or None for
    no compression. Raises ValueError on anything else, naming the setting as `where`.type etc."""
    if not params:
        return None
    unknown = set(params) - {"type", "threshold", "both_ways", "pull_threshold"}
    if unknown:
        raise ValueError(f"{where}: unknown parameter(s) {', '.join(sorted(unknown))}; known: type, threshold, "
                         "both_ways, pull_threshold")
    return _setting(_kind(str(params.get("type", "none")).lower(), "name", where), params.get("threshold", 0.5),
                    where, params.get("both_ways", False), params.get("pull_threshold"), "name")


def from_config(kind: str, threshold: Any, where: str = "kvstore.compression", both_ways: Any = False,
                pull_threshold: Any = None) -> Setting | None:
    """A tfkv-run config's kvstore.compression (type by its config name) -> the Setting, or None."""
    return _setting(_kind(str(kind).lower(), "config", where), threshold, where, both_ways, pull_threshold, "config")


def _kind(name: str, field: str, where: str) -> Kind:
    for k in KINDS:
        if getattr(k, field) == name:
            return k
    choices = ", ".join(getattr(k, field) for k in KINDS)
    raise ValueError(f"{where}.type={name!r} is not known; choose one of {choices}")


def _setting(kind: Kind, threshold: Any, where: str, both_ways: Any, pull_threshold: Any,
             field: str) -> Setting | None:
    """The Setting; `field` names the kinds as the caller does (a config's names or the API's)."""
    if not isinstance(both_ways, (bool, np.bool_)):
        raise ValueError(f"{where}.both_ways={both_ways!r} must be true or false")
    if not kind.quantises:
        if both_ways:
            choices = ", ".join(getattr(k, field) for k in KINDS if k.quantises)
            raise ValueError(f"{where}.both_ways=true compresses the servers' replies as the pushes are, but "
                             f"{where}.type={getattr(kind, field)} compresses nothing: choose a type ({choices}) "
                             "or set both_ways=false")
        return None
    threshold = _positive(threshold, f"{where}.threshold")
    if pull_threshold is not None:
        if not both_ways:
            raise ValueError(f"{where}.pull_threshold={pull_threshold} sets the threshold of the servers' "
                             f"replies, which only both_ways=true compresses: set {where}.both_ways=true "
                             "or leave pull_threshold unset")
        pull_threshold = _positive(pull_threshold, f"{where}.pull_threshold")
    return Setting(kind, threshold, bool(both_ways), pull_threshold)


def _positive(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a positive number") from None
    if not np.isfinite(number) or number <= 0:
        raise ValueError(f"{name}={number} must be positive")
    return number


def pack(grad: np.ndarray, residual: np.ndarray, threshold: float) -> np.ndarray:
    """Add `grad` into `residual` (in place), quantise it, take the sent part out of the residual;
    return the codes as uint32 words."""
    from tfkv.ps import kernels  # (Numba loads on first use: a job without compression never pays it)

    out = np.empty(words(residual.size), np.uint32)
    kernels.pack(_values(grad, residual.size), _state(residual), np.float32(threshold), out)
    return out


def pack_corrected(grad: np.ndarray, velocity: np.ndarray, residual: np.ndarray, threshold: float,
                   momentum: float) -> np.ndarray:
    """Momentum correction: velocity = momentum * velocity + grad is added into the residual and
    quantised as `pack` does; then the velocity is zeroed where the residual still holds a whole
    threshold after sending (both float32 arrays change in place). There the 2-bit channel, at
    most t a step, is saturated: more momentum would only pile up a backlog that is sent after
    the gradient has turned (the overshoot of server-side momentum), so it restarts from the next
    gradient; everywhere else the momentum runs on. DGC's own masking, zeroing the velocity of
    every value sent, also stops momentum where the channel keeps up, and no masking lets the
    backlog grow: both end further from uncompressed (benchmarks/results/compression_masking.md)."""
    from tfkv.ps import kernels

    out = np.empty(words(residual.size), np.uint32)
    kernels.pack_corrected(_values(grad, residual.size), _state(velocity), _state(residual), np.float32(threshold),
                           np.float32(momentum), out)
    return out


def _values(grad: np.ndarray, size: int) -> np.ndarray:
    grad = np.ascontiguousarray(grad, np.float32).reshape(-1)
    if grad.size != size:
        raise ValueError(f"{grad.size} values pushed into a residual of {size}")
    return grad


def _state(array: np.ndarray) -> np.ndarray:
    """A residual or velocity, changed in place: it must be a flat float32 array of its own."""
    if array.dtype != np.float32 or array.ndim != 1 or not array.flags.c_contiguous or not array.flags.writeable:
        raise TypeError("a 2-bit residual or velocity is a flat, writeable, contiguous float32 array")
    return array


_ODD = np.uint32(0x55555555)  # the low bit of each of a word's 16 codes


def unpack(packed: np.ndarray, count: int, threshold: float) -> np.ndarray:
    """The float32 values (length `count`) that `packed` represents; ValueError if malformed."""
    from tfkv.ps import kernels

    out = np.empty(count, np.float32)
    kernels.unpack(_checked(packed, count), np.float32(threshold), out)
    return out


def unpack_onto(base: np.ndarray, packed: np.ndarray, threshold: float) -> np.ndarray:
    """base + unpack(packed, base.size, threshold), as a new array, in one pass: a copy of weights
    that a 2-bit reply moves (no key-sized array of the decoded values on the way)."""
    from tfkv.ps import kernels

    out = np.empty(base.size, np.float32)
    kernels.unpack_onto(_checked(packed, base.size), np.float32(threshold),
                        np.ascontiguousarray(base, np.float32).reshape(-1), out)
    return out


def _checked(packed: np.ndarray, count: int) -> np.ndarray:
    """`packed` as contiguous little-endian words, if they are `count` values' words with no code 3
    and zero padding; else ValueError."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint32 or packed.ndim != 1 or packed.size != words(count):
        raise ValueError(f"2-bit payload of {packed.size} words cannot hold exactly {count} values")
    w = np.ascontiguousarray(packed, "<u4")
    # Code 3 is both bits of a code set: a word's (w & w >> 1) has a code's low bit set for it.
    both = np.right_shift(w, np.uint32(1))
    np.bitwise_and(both, w, out=both)
    np.bitwise_and(both, _ODD, out=both)
    if both.any():
        raise ValueError("2-bit payload holds the invalid code 3")
    if count % 16 and int(w[-1]) >> (2 * (count % 16)):
        raise ValueError("2-bit payload has non-zero padding after its last value")
    return w


# The replies' threshold in steps: how many of one step's largest change (`pull_threshold_for`). At
# 1 the channel just keeps up; a weight that goes back and forth below the threshold then stays in
# the servers' residual instead of reaching the copies as noise. Chosen by accuracy, 3 seeds
# (benchmarks/results/design_figures.md): a quarter step cost 4 points, 1 and 2 up to 1.7, 4 and 8
# at most 0.84 and 0.56.
PULL_STEPS = 8


def pull_threshold_for(setting: Setting, optimizer: optim.Optimizer | None, pushers: int) -> float:
    """The threshold of the servers' 2-bit replies (`both_ways`): the setting's own, or PULL_STEPS
    times one step's largest change of a weight, so that the reply channel (at most one threshold
    a round per value) keeps up with the weights: SGD's rate x rescale_grad x the push threshold x
    the pushes summed into one update (`pushers`: the workers of a synchronous job, 1 in an
    asynchronous one) / (1 - the servers' momentum); a rule that scales its steps (Adam) moves each
    value by about its rate. With no optimizer on the servers the replies carry the sum of the
    2-bit pushes, on their scale: the push threshold."""
    if setting.pull_threshold is not None:
        return setting.pull_threshold
    if optimizer is None:
        return setting.threshold
    lr = float(optimizer.schedule.lr)
    if not isinstance(optimizer, optim.SGD):
        return PULL_STEPS * abs(lr)
    rescale = 1.0 if optimizer.rescale_grad is None else float(optimizer.rescale_grad)
    return PULL_STEPS * abs(lr * rescale) * setting.threshold * pushers / (1.0 - float(optimizer.momentum))
