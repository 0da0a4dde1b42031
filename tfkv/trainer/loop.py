"""The training loop: epochs of steps, each epoch evaluated and recorded. What else a run does as it
goes (checkpoints, preemption, the progress bar, TensorBoard, trackers) hangs on its hooks.

Every value the criterion reports (`loss`, each metric, per-output losses, `perplexity` for
sequence labels with a crossentropy loss: see `tfkv.parallel.metrics`) goes to the epoch's
record as `train_<name>` / `test_<name>`; the test values are of the whole test split, each
worker of a job evaluating its part of it. A training loss that is NaN or infinite fails its
step inside the graph (tfkv.parallel.metrics) and ends the run in one line naming the epoch and
step (Diverged), the last finite checkpoint kept. A run resumed from the middle of an epoch
skips that epoch's batches already taken, so it sees the batches, dropout masks and updates an
uninterrupted run would have.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tfkv.errors import Diverged
from tfkv.export import write_metrics
from tfkv.tracking import Hook, StepEnd, metric_keys
from tfkv.trainer.parts import Run

log = logging.getLogger("tfkv")


def fit(run: Run, hooks: Hook) -> dict[str, Any]:
    """Train from `run.start` to `cfg.epochs`; the final metrics, in metrics.json on worker 0."""
    cfg = run.cfg
    for epoch in range(run.start, cfg.epochs + 1):
        record = _epoch(run, epoch, hooks)
        run.history.append(record)
        log.info("epoch %d/%d  %s  %.0f samples/s  %.1fs", epoch, cfg.epochs,
                 "  ".join(f"{k} {record[k]:.4f}" for k in metric_keys(record)),
                 record["samples_per_sec"], record["train_seconds"])
        hooks.epoch(epoch, record)
    if not run.history:
        raise RuntimeError(f"nothing to train: epochs={cfg.epochs} and the checkpoint is at "
                           f"epoch {run.start - 1}")
    final = summary(run.history, run.resumes)
    if run.chief:
        run.saver.wait()
        write_metrics(run.run_dir, final)
    run.store.barrier()
    return final


def summary(history: list[dict[str, Any]], resumes: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json: the last epoch's values, the steady rate, every epoch's record, the resumes."""
    last = history[-1]
    # The first epoch pays for tracing and warm-up; steady state is what a user plans with.
    steady = history[1:] or history
    samples = sum(h["samples"] for h in steady)
    seconds = sum(h["train_seconds"] for h in steady)
    return {
        "epoch": last["epoch"],
        **{k: last[k] for k in metric_keys(last)},
        "samples_per_sec": samples / seconds if seconds else 0.0,
        "history": history,
        **({"resumes": resumes} if resumes else {}),
    }


def _epoch(run: Run, epoch: int, hooks: Hook) -> dict[str, Any]:
    """One epoch's steps (those after a mid-epoch checkpoint in the first), then its record."""
    import tensorflow as tf

    from tfkv.parallel.metrics import nonfinite

    first = run.skip if epoch == run.start else 0  # a mid-epoch checkpoint: its steps are done
    batches = run.source.train(epoch)
    if first:  # the epoch's order is a function of (seed, epoch): the same batches follow
        batches = batches.skip(first)
    hooks.epoch_begin(epoch)
    # The workers start the clock together: otherwise a worker's epoch would include
    # waiting for worker 0's checkpoint and the others' evaluation (no-op alone).
    run.store.barrier()
    t0 = time.perf_counter()
    # A step that prefetches (row-sparse tables) is shown the next batch while it computes.
    peeking = getattr(run.parallel, "prefetches", False)
    for i, (x, y, upcoming) in enumerate(_peeked(batches) if peeking else ((x, y, None) for x, y in batches),
                                         first + 1):
        try:
            run.parallel.step(x, y, upcoming) if peeking else run.parallel.step(x, y)
        except tf.errors.InvalidArgumentError as e:  # before anything saves or evaluates the weights
            if not nonfinite(e):
                raise
            raise _diverged(epoch, i, run) from None
        hooks.step(_step_end(run, epoch, i, first, t0))
    return _record(run, epoch, time.perf_counter() - t0, first)


def _peeked(batches: Any) -> Any:
    """(x, y, the next batch's x or None) for each batch."""
    it = iter(batches)
    current = next(it, None)
    while current is not None:
        following = next(it, None)
        yield current[0], current[1], None if following is None else following[0]
        current = following


def _step_end(run: Run, epoch: int, i: int, first: int, t0: float) -> StepEnd:
    """Step `i` of `epoch`, with the running values every `log_every` steps and at the last."""
    if i % run.cfg.log_every and i != run.steps:
        return StepEnd(epoch, i, (epoch - 1) * run.steps + i, None, 0.0)
    rate = (i - first) * run.cfg.batch_size * run.store.num_workers / (time.perf_counter() - t0)
    return StepEnd(epoch, i, (epoch - 1) * run.steps + i, run.parallel.peek_metrics(), rate)


def _record(run: Run, epoch: int, seconds: float, first: int) -> dict[str, Any]:
    """The epoch's record: its training values, the test split's, rates and times."""
    dp, kvstore = run.parallel, run.store
    train, seen = dp.take_metrics()
    # BatchNorm statistics: this worker's copies averaged; worker 0's are evaluated and saved.
    dp.sync_non_trainable()
    # Each worker evaluates its part of the test split; the parts' tallies are summed.
    t_eval = time.perf_counter()
    test = dp.evaluate_split(run.source.test)
    eval_seconds = time.perf_counter() - t_eval
    # Workers of a synchronous job move in step: the job's rate is this worker's times
    # the number of workers.
    record = {
        "epoch": epoch,
        **{f"train_{k}": v for k, v in train.items()},
        **{f"test_{k}": v for k, v in test.items()},
        "samples_per_sec": seen * kvstore.num_workers / seconds,
        "worker_samples_per_sec": seen / seconds,
        "samples": seen * kvstore.num_workers, "train_seconds": seconds,
        "lr": run.lr_at(epoch * run.steps),  # of the epoch's last update
        # the test split's examples, and how many of them this worker evaluated
        "evaluated_examples": dp.evaluated[1], "worker_evaluated_examples": dp.evaluated[0],
        "eval_seconds": eval_seconds,  # this worker's, the parts' sum included
    }
    if first:  # the training values are of the steps after the checkpoint
        record["resumed_at_step"] = first
    return record


def _diverged(epoch: int, step: int, run: Run) -> Diverged:
    """The one line for a training loss that became NaN or infinite at (epoch, step); the
    checkpoints saved before it (all finite: this is checked at every step) stay."""
    from tfkv import checkpoint

    run.saver.close()  # the last checkpoint may still be landing in the background
    newest = checkpoint.latest(run.run_dir)
    kept = (f"the last finite checkpoint, {newest.name}, is kept in {run.run_dir}" if newest is not None
            else "no checkpoint was saved before it")
    return Diverged(f"training diverged: the loss became NaN or infinite at epoch {epoch}, step {step} of "
                    f"{run.steps} (worker {run.store.rank}); lower optimizer.lr, normalise the inputs, "
                    f"or set optimizer.clipnorm; {kept}")

