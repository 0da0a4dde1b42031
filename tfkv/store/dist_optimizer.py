"""The servers' optimizer and gradient compression, as a dist store's worker sets them: the
`ServerOptimizer` part of `tfkv.store.dist.DistStore` (MXNet's set_optimizer,
set_gradient_compression, save_optimizer_states and load_optimizer_states). Worker 0 tells the
servers; every worker waits at a barrier so that no request is served by an optimizer it was
not made under. With the `2bit_momentum` compression the momentum is applied on the workers and
the servers get the optimizer with momentum 0 (`compression.split_momentum`)."""

from __future__ import annotations

import logging
from typing import Any

from tfkv import optim
from tfkv.ps import compression, replies
from tfkv.ps.feedback import Sender
from tfkv.store import dist_state, npz


class ServerOptimizer:
    """What the servers run and how pushes are compressed; mixed into DistStore, whose
    `worker` (tfkv.ps.kvworker.KVWorker: the requests, and the compression's `sender`), `keys`,
    `env`, `rank`, `num_workers` and `barrier` it uses."""

    _optimizer: Any = None  # what the servers run
    _user_optimizer: Any = None  # what set_optimizer was given

    def set_gradient_compression(self, compression_params: Any) -> None:
        """MXNet's API, e.g. {"type": "2bit", "threshold": 0.5}, or tfkv's {"type":
        "2bit_momentum", ...}; every worker calls it (each keeps its residuals), worker 0 tells the
        servers how to decode (the same words for both kinds) and, when the kind moves momentum
        to the workers after an optimizer was set, sends the servers' optimizer again.
        Beyond MXNet, "both_ways": True compresses the servers' replies to pulls too (with their
        own error feedback, tfkv.ps.replies), at "pull_threshold" (default:
        compression.pull_threshold_for the servers' optimizer); row-sparse keys stay uncompressed."""
        setting = compression.parse(compression_params)
        worker = self.worker
        if setting != (worker.sender and worker.sender.setting):  # a new setting starts from nothing held back
            worker.sender = Sender(setting) if setting is not None else None
            if worker.timeline is not None and worker.sender is not None:
                worker.timeline.wrap(worker.sender, "pack", "pack", key_arg=0)
            worker.keep_copies(False)  # every copy asked for whole again
        worker.keep_copies(setting is not None and setting.both_ways)
        self._tell_compression()
        if self._user_optimizer is not None:
            self.set_optimizer(self._user_optimizer)
            return
        self.barrier()

    def set_optimizer(self, optimizer: Any) -> None:
        """The servers run `optimizer`, less its momentum when the compression applies it on the
        workers (`compression.split_momentum`: the servers learn it from the optimizer they get)."""
        sender = self.worker.sender
        served, momentum = compression.split_momentum(sender and sender.setting, optimizer)
        if sender is not None:
            sender.momentum = momentum
        self._user_optimizer, self._optimizer = optimizer, served
        if self.num_workers > 1:
            # Every worker's requests so far are served by the optimizer they were made under:
            # worker 0 must not swap it while another still pushes or reads its state.
            self.barrier()
        if self.rank == 0:
            self.worker.set_optimizer(optim.to_dict(served))
            if sender is not None and sender.setting.both_ways:  # the replies' threshold follows the optimizer
                self._tell_compression()
        self.barrier()

    def _tell_compression(self) -> None:
        """Worker 0 tells the servers how pushes decode and, under both_ways, at which threshold
        they reply (compression.pull_threshold_for the optimizer they run)."""
        sender = self.worker.sender
        if self.rank != 0 or sender is None:
            return
        setting = sender.setting
        pull_threshold = None
        if setting.both_ways:
            pull_threshold = compression.pull_threshold_for(setting, self._optimizer,
                                                            self.num_workers if self.sync else 1)
            logging.getLogger("tfkv").info("the servers' replies 2-bit at threshold %g%s", pull_threshold,
                                           "" if self._optimizer is not None or setting.pull_threshold else
                                           " (no optimizer on the servers yet: they reply with sums)")
        self.worker.set_compression(setting.threshold, pull_threshold)

    def _require_optimizer(self) -> None:
        # Asked before any request goes out, as the local store does: the servers would each
        # answer with an error, and errors of requests not yet waited for surface in later calls.
        if not self._has_optimizer:
            raise RuntimeError("this store has no optimizer; call set_optimizer() first")

    def save_optimizer_states(self, fname: str) -> None:
        """Gather the optimizer state of every key from the servers into one npz file."""
        self._require_optimizer()
        dist_state.save(self.keys, self.worker, list(self._optimizer.state_names), self.env.chunk_bytes, fname,
                        self.feedback_state())

    def load_optimizer_states(self, fname: str) -> None:
        self._require_optimizer()
        self.restore_feedback(npz.load(fname))  # this worker's residuals (tfkv.store.dist_feedback)
        # Every worker's pushes so far applied first: a round still open (another worker's push on its
        # way) would otherwise close after the state was put back, and move it again.
        self.barrier()
        if self.rank == 0:
            sender = self.worker.sender
            kept = (replies.STATE,) if sender is not None and sender.setting.both_ways else ()
            dist_state.load(self.keys, self.worker, list(self._optimizer.state_names), self.env.chunk_bytes, fname,
                            kept)
        self.barrier()

    @property
    def _has_optimizer(self) -> bool:
        return self._user_optimizer is not None
