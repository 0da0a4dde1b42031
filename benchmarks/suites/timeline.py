"""What the timeline costs: dist_sync training samples/s with kvstore.timeline on against off, same run.

Two contenders train the same model on the same synthetic batch, each a `dist_sync` job of 2 worker
processes and 1 server on this machine, secure, started by tfkv.launcher (benchmarks.jobs.run_job,
the job the dist_training and overlap suites time):

    off   kvstore.timeline unset: every hook is a None check
    on    TFKV_TIMELINE=<a fresh directory per trial> in every role's environment: each worker
          records its steps (compute, each key's push, its flight, wait, assign), the server each
          request, sum, update and reply, and each writes its file (tfkv.timeline)

Trials alternate (the order reversed every other trial); medians are reported, with `on/off` the
ratio of samples/s. Beside it, the recorder alone: the microseconds one event costs (recorded and
written, in this process), times the events per step the `on` job's files hold (every role's,
per worker step): what the timeline adds to a step by that count, to set against the step time.
The machine is shared, so the ratio is noisy: several trials, and read it with the predicted cost.

    python -m benchmarks timeline [--seconds 3] [--trials 3] [--models lenet,mlp] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks import harness, jobs

REPORT = harness.Report(
    "The timeline's cost",
    "Training samples/s of a `dist_sync` job (2 workers, 1 server, secure) with `kvstore.timeline` on "
    "against off, in the same run, and the recorder's cost per step predicted from its cost per event.",
    ["model"], ["off", "on"], "samples/s")

CONTENDERS = ("off", "on")


def event_cost(events: int = 200_000) -> float:
    """Microseconds one span costs the recorder: appended, then written with the others."""
    from tfkv import timeline

    with tempfile.TemporaryDirectory() as where:
        tl = timeline.Timeline(Path(where), "bench", 0)
        t0 = timeline.now()
        for i in range(events):
            t = timeline.now()
            tl.span("push", t, t, args={"key": i & 63})
        tl.close()
        return (timeline.now() - t0) / events * 1e6


def events_per_step(where: Path) -> float:
    """Every role's events in `where` per step of worker 0 (its "step" spans)."""
    from tfkv import timeline

    events = {f.stem: [e for e in timeline.read(f) if e["ph"] == "X"] for f in where.glob("*-*.json")}
    steps = sum(e["name"] == "step" for e in events["worker-0"])
    return sum(len(v) for v in events.values()) / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per job")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--models", default="lenet,mlp", help=f"of {', '.join(jobs.TRAINING_MODELS)}")
    ap.add_argument("--batch", type=int, default=64, help="per worker")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a job may take")
    harness.add_argument(ap, "timeline")
    args = ap.parse_args()
    per_event = event_cost()
    print(f"recorder: {per_event:.2f} us per event (recorded and written)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            rates: dict[str, list[float]] = {c: [] for c in CONTENDERS}
            step_s, counts = [], []
            for trial in range(args.trials):
                for c in harness.alternating(list(CONTENDERS), trial):
                    where = Path(tmp) / f"tl-{model}-{trial}"
                    env = {"TFKV_TIMELINE": str(where)} if c == "on" else {}
                    got = jobs.run_job(2, jobs.TRAINING_MODELS[model], args.batch, args.seconds, tmp,
                                       f"{c}-{trial}", args.timeout, env=env)
                    rates[c].append(got["samples_s"])
                    if c == "off":
                        step_s.append(got["step_s"])
                    else:
                        counts.append(events_per_step(where))
            off, on = (statistics.median(rates[c]) for c in CONTENDERS)
            per_step, step = statistics.median(counts), statistics.median(step_s)
            predicted = per_step * per_event / 1e6 / step
            rows.append({"model": model, "off": off, "on": on, "on/off": on / off, "events/step": per_step,
                         "step ms": step * 1e3, "predicted cost": predicted})
            print(f"{model}: off {off:.0f} samples/s, on {on:.0f} samples/s, on/off {on / off:.3f} "
                  f"(trials: off {', '.join(f'{r:.0f}' for r in rates['off'])}; on "
                  f"{', '.join(f'{r:.0f}' for r in rates['on'])}); {per_step:.0f} events per step of "
                  f"{step * 1e3:.1f} ms: {predicted:.2%} of a step predicted", flush=True)
    harness.write(args.result, "timeline", harness.settings_of(args), rows, us_per_event=per_event)


if __name__ == "__main__":
    main()
