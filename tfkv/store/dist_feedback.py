"""A dist store worker's error feedback: its 2-bit compression's residuals (and 2bit_momentum's
velocities), kept between pushes, whichever side packs them: the store's numpy `Sender`
(tfkv.ps.feedback) for the KVStore API's pushes, or the compiled step, which packs a key's
gradients as TensorFlow ops and hands the store the words (`packed_push`, `pushpull_packed_async`;
tfkv.parallel.packing holds that state and lends it here with `hold_feedback`).

The state is this worker's own, not the servers' optimizer state: `feedback_state` gives it by
key, as flat float32 arrays named "worker_feedback/<rank>/<key>/<residual|velocity>" in the
optimizer state file (the servers' error feedback, if any, lives under names of its own), and
`restore_feedback` puts back the entries of this worker's rank (every worker reads the file).

Only worker 0 writes the file, so in a dist_sync job of several workers the others' state
travels to it at the checkpoint's step (`share_feedback`, called by every worker at the same
point of the same step): each worker sends its arrays to the servers of its key parts (FEEDBACK
requests, as a push's parts go: the workers may share no file system, and a part's server is
the one its bytes already go to), a barrier, then worker 0 asks every server for the other
workers' arrays and keeps them for its next `feedback_state`. A server keeps one copy per worker
(the last one sent), so a checkpoint costs each worker one push of its feedback, worker 0 a pull
of everyone's, and steps without a checkpoint nothing here. dist_async has no step at which the
workers' states belong together (no worker waits for another), so there each worker's state is
not shared: worker 0's is saved, the others' start from zero on resume (a warning says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from tfkv.ps.kvworker import Packed
from tfkv.ps.parts import Pull
from tfkv.store.dist_keys import Key

PREFIX = "worker_feedback"


@dataclass(frozen=True)
class PackPlan:
    """How the compiled step packs key's gradients for this store: the threshold, the momentum
    applied first (2bit_momentum; None for MXNet's 2bit) and each part's [start, end)."""

    threshold: float
    momentum: float | None
    bounds: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return self.bounds[-1][1]


class FeedbackHolder(Protocol):
    """State kept outside the store (the compiled step's variables), by key and name."""

    def feedback_state(self) -> dict[tuple[Key, str], np.ndarray]: ...

    def restore_feedback(self, saved: dict[tuple[Key, str], np.ndarray]) -> None: ...


class WorkerFeedback:
    """The `DistStore` part for pushes packed elsewhere and for its worker's error feedback; it
    uses the store's `worker` (its `sender`), `keys`, `rank` and `servers`."""

    #: takes a key's push as 2-bit words already packed per part (`pushpull_packed_async`), when
    #: compression is set (`packing` says how to pack)
    packed_push = True
    _holders: Sequence[FeedbackHolder] = ()
    _others: dict[str, np.ndarray] = {}  # worker 0: the other workers' state, from `share_feedback`

    @property
    def shares_feedback(self) -> bool:
        """Whether a checkpoint needs `share_feedback` first: a dist_sync job of several workers
        that compresses (only worker 0 writes the file)."""
        return self.sync and self.num_workers > 1 and self.worker.sender is not None

    def share_feedback(self) -> None:
        """Every worker, at the same step: hand this worker's state to worker 0 through the
        servers, for the checkpoint worker 0 writes next (see the module's docstring)."""
        if not self.shares_feedback:
            return
        own = self._own_feedback()
        if self.rank != 0:
            for (k, what), flat in own.items():
                self.worker.keep_feedback(self.keys.layout(k)[1], self.rank, what, flat)
        self.barrier()  # settles this worker's requests first: every state is on the servers
        if self.rank == 0:  # the others hold what worker 0 holds (one setting, the same keys)
            self._others = {_name(r, k, what): self.worker.kept_feedback(self.keys.layout(k)[1], r, what)
                            for r in range(1, self.num_workers) for (k, what) in own}

    def packing(self, key: Key) -> PackPlan | None:
        """How to pack `key`'s gradients for `pushpull_packed_async`; None without compression."""
        sender = self.worker.sender
        if sender is None:
            return None
        layout = self.keys.layout(key)[1]
        return PackPlan(sender.setting.threshold, sender.momentum if sender.setting.kind.worker_momentum else None,
                        tuple((p.start, p.end) for p in layout.parts))

    def pushpull_packed_async(self, key: Key, words: Sequence[np.ndarray], out: Any = None) -> list[Pull]:
        """pushpull_async of one key whose push is `words` (uint32, one array per part, packed
        as `packing` said); the servers decode them as any 2-bit push."""
        if self.worker.sender is None:
            raise RuntimeError(f"packed push of key {key!r}: this store compresses nothing "
                               "(set_gradient_compression first)")
        self._check_can_push()
        layout = self.keys.layout(key)[1]
        packed = Packed(layout, [np.asarray(w) for w in words])
        outs = [] if out is None else (list(out) if isinstance(out, (list, tuple)) else [out])
        with self.servers.lock:
            return self.worker.pushpull([(key, layout, outs, lambda: packed)])

    def hold_feedback(self, holder: FeedbackHolder) -> None:
        """Keep `holder`'s error feedback with this worker's (in `feedback_state`)."""
        self._holders = [*self._holders, holder]

    def feedback_state(self) -> dict[str, np.ndarray]:
        """This worker's residuals and velocities, by their name in the optimizer state file; on
        worker 0 also the other workers' of the last `share_feedback` (then forgotten)."""
        others, self._others = self._others, {}
        return {**{_name(self.rank, k, what): v for (k, what), v in self._own_feedback().items()}, **others}

    def _own_feedback(self) -> dict[tuple[Key, str], np.ndarray]:
        by_key: dict[tuple[Key, str], np.ndarray] = {}
        sender = self.worker.sender
        for k, _, layout, table in self.keys:
            if table is not None or sender is None:
                continue
            for what, arrays in sender.held_arrays().items():
                held = [(p, arrays.get(p.skey)) for p in layout.parts]
                if any(a is not None for _, a in held):
                    flat = np.zeros(layout.size, np.float32)
                    for p, a in held:
                        if a is not None:
                            flat[p.start:p.end] = a
                    by_key[(k, what)] = flat
        for holder in self._holders:
            by_key.update(holder.feedback_state())
        return by_key

    def restore_feedback(self, saved: Any) -> None:
        """Put back this worker's entries of an optimizer state file (an npz mapping); without
        any while compressing, say that they start from zero."""
        sender = self.worker.sender
        mine = f"{PREFIX}/{self.rank}/"
        names = {k: k for k, _, layout, table in self.keys if table is None}
        found: dict[tuple[Key, str], np.ndarray] = {}
        for entry in saved.keys():
            if entry.startswith(mine):
                name, what = entry[len(mine):].rsplit("/", 1)
                key = next((k for k in names if str(k) == name), None)
                if key is not None:
                    found[(key, what)] = np.asarray(saved[entry], np.float32)
        if sender is not None and not found:  # dist_async's workers 1.., or a checkpoint of before
            logging.getLogger("tfkv").warning(
                "gradient compression %s: the checkpoint holds no %s of worker %d; they start from zero, so the "
                "updates from here differ from those of a job never stopped", sender.setting.kind.name,
                sender.held, self.rank)
        if sender is not None:
            for (k, what), flat in found.items():
                for p in self.keys.layout(k)[1].parts:
                    sender.restore(what, p.skey, flat[p.start:p.end])
        for holder in self._holders:
            holder.restore_feedback(found)


def _name(rank: int, key: Key, what: str) -> str:
    """An entry's name in the optimizer state file."""
    return f"{PREFIX}/{rank}/{key}/{what}"
