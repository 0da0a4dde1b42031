"""Worker 0's own hooks on the loop: its checkpoints and metrics.json, the stop for a preemption,
the progress bar. With the trackers (tfkv.tracking) they are called in the order `for_chief` gives.

Worker 0 checkpoints at every epoch's end and where `checkpoint.every_steps`/`every_minutes` say
(tfkv.checkpoint.policy). SIGUSR1 (a batch system's warning) or SIGTERM (its stop) to any process
of the job makes worker 0 checkpoint at the end of a step and stop the job, resumable
(tfkv.checkpoint.preemption); at an epoch's end it stops once the epoch's record is written and
the trackers have it, unless that was the last epoch.

A dist_sync job that compresses keeps every worker's error feedback in worker 0's checkpoints
(`KVStore.shares_feedback`): every worker hands it over at the checkpoint's step
(`FeedbackAtCheckpoints`). Epoch ends and `every_steps` are the same step on every worker, but
`every_minutes` and a preemption are worker 0's to see, so after every step worker 0's decision
reaches the others through a vote (`KVStore.all_workers`, one small sum through the scheduler).
"""

from __future__ import annotations

from typing import Any, Sequence

from tfkv import checkpoint, tracking
from tfkv.errors import Preempted
from tfkv.export import write_metrics
from tfkv.tracking import Hook, StepEnd
from tfkv.trainer import rng
from tfkv.trainer.loop import summary
from tfkv.trainer.parts import Run


def for_chief(run: Run, preemption: checkpoint.Preemption, trackers: Sequence[tracking.Builder] = ()) -> list[Hook]:
    """Worker 0's hooks, in the order they are called: its checkpoint is decided first at the end
    of a step, and each epoch's record is on disk before the trackers see it (a pruned trial keeps
    its epochs); on the other workers only their part in worker 0's checkpoints where the store
    `shares_feedback`. `trackers`: the entry layer's, after tfkv.tracking's."""
    if not run.chief:
        return [FeedbackAtCheckpoints(run)] if run.store.shares_feedback else []
    preemption.clear()
    progress = [Progress(run)] if run.cfg.progress else []
    return [Checkpoints(run, preemption), *progress, *tracking.for_run(run.cfg, run.run_dir, trackers),
            StopWhenPreempted(run, preemption)]


class Checkpoints(Hook):
    """The checkpoints (every epoch's end, mid-epoch as the policy says, before a preemption's
    stop) and metrics.json after every epoch."""

    def __init__(self, run: Run, preemption: checkpoint.Preemption) -> None:
        self.run = run
        self.preemption = preemption
        self.policy = checkpoint.Policy.from_config(run.cfg.checkpoint)
        self.feedback = FeedbackAtCheckpoints(run) if run.store.shares_feedback else None

    def save(self, epoch: int, step: int = 0, background: bool = True) -> None:
        run = self.run
        run.saver.save(run.run_dir, epoch, run.parallel.streamed_weights(), run.parallel.weight_names(),
                       run.parallel.save_optimizer, run.history, step=step, rng=rng.state(run.parallel),
                       config=run.config_yaml, resumes=run.resumes, keep_last=run.cfg.checkpoint.keep_last,
                       background=background)
        self.policy.saved()

    def step(self, end: StepEnd) -> None:
        if end.step >= self.run.steps:  # the epoch's end has its own checkpoint
            return
        stop = self.preemption.requested
        due = stop or self.policy.due(end.global_step)
        if self.feedback is not None:
            due = self.feedback.at_step(due)
        if due:
            self.save(end.epoch - 1, end.step, background=not stop)  # a preempted job ends on a durable one
        if stop:
            raise preempted(self.preemption, self.run)

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        if self.feedback is not None:
            self.feedback.epoch(epoch, record)
        self.save(epoch)
        write_metrics(self.run.run_dir, summary(self.run.history, self.run.resumes))


class FeedbackAtCheckpoints(Hook):
    """Every worker's part in worker 0's checkpoints of a store that `shares_feedback`: after
    each step the vote on worker 0's decision, and at a checkpoint's step (and every epoch's
    end) `share_feedback`. Worker 0's `Checkpoints` calls it; the other workers hook it on."""

    def __init__(self, run: Run) -> None:
        self.store = run.store
        self.steps = run.steps

    def at_step(self, due: bool = False) -> bool:
        """Whether worker 0 checkpoints after this step (`due`: its own decision; False on the
        others), the workers' feedback shared if so. Not at an epoch's last step: `epoch` is."""
        due = not self.store.all_workers(not due)
        if due:
            self.store.share_feedback()
        return due

    def step(self, end: StepEnd) -> None:
        if end.step < self.steps:  # as worker 0's `Checkpoints.step`
            self.at_step()

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        self.store.share_feedback()


class StopWhenPreempted(Hook):
    """At an epoch's end, after its checkpoint and the trackers: stop for a preemption that
    came during the epoch (or its evaluation), unless the run is done anyway."""

    def __init__(self, run: Run, preemption: checkpoint.Preemption) -> None:
        self.run = run
        self.preemption = preemption

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        if self.preemption.requested and epoch < self.run.cfg.epochs:
            self.run.saver.wait()
            raise preempted(self.preemption, self.run)


def preempted(preemption: checkpoint.Preemption, run: Run) -> Preempted:
    """Worker 0's stop after its checkpoint: one line, also for the launcher of a launched job."""
    newest = checkpoint.latest(run.run_dir)
    line = (f"preempted ({preemption.name}): checkpoint {newest.name if newest else '?'} is in {run.run_dir}; "
            "the same command with resume=auto (or resume=<that directory>) continues it")
    preemption.stopped(line if run.store.distributed else None)
    return Preempted(line)


class Progress(Hook):
    """The epoch's bar (on a terminal): steps done, the running values, the learning rate and
    samples per second, redrawn every `log_every` steps."""

    def __init__(self, run: Run) -> None:
        self.epochs = run.cfg.epochs
        self.steps = run.steps
        self.lr_at = run.lr_at
        self.bar: Any = None

    def epoch_begin(self, epoch: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=self.steps, desc=f"epoch {epoch}/{self.epochs}", unit="step", leave=False,
                        disable=None, mininterval=0.5)

    def step(self, end: StepEnd) -> None:
        if end.running is None:
            return
        self.bar.update(end.step - self.bar.n)
        self.bar.set_postfix({**{k: f"{v:.4f}" for k, v in end.running.items()},
                              "lr": f"{self.lr_at(end.global_step):.3g}", "samples/s": f"{end.samples_per_sec:.0f}"})
        if end.step == self.steps:  # gone before the evaluation
            self.bar.close()

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        self.bar.close()

    def close(self, error: BaseException | None) -> None:
        if self.bar is not None:
            self.bar.close()
