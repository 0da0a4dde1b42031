"""`tfkv-run`: the Hydra app. Composes and validates the config, then trains.

With a `dist_*` KVStore and a cluster launcher, this process only plans and launches the job:
the scheduler, the servers and the workers (`python -m tfkv.worker`, each running the config this
process recorded) start as their own processes, and this one waits and reports. A process whose environment gives it a
role (DMLC_ROLE=server, ...) takes that role before Hydra or TensorFlow start.

A mistake a user can fix (a typo, a wrong type, an unknown name, a missing data set, missing
keys, a full disk) is printed as one line and exits with status 2, before TensorFlow starts
where the config alone shows it; Ctrl-C is one line and status 130. This module imports only
the standard library at first, so that even an early Ctrl-C finds its handler in place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from tfkv.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, message, report
from tfkv import conf_dir, versions
from tfkv.hydra_messages import one_line

_run_dir: Path | None = None  # the job's run directory once known, for the Ctrl-C line


def _main(cfg: Any) -> Any:
    """The Hydra task: one job (a trial of its own where it is one job of a sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from tfkv.ps import node

    if HydraConfig.get().mode == RunMode.MULTIRUN and node.role() is None:
        from tfkv.sweep import task

        return task.run(cfg, _job, _explain)
    try:
        return _job(cfg)
    except Exception as e:  # exit here: past this point Hydra adds its own lines to the message
        report("tfkv-run", e)
        raise


def _explain(e: BaseException) -> str | None:
    """A trial's failure as one line, or None for a bug (tfkv.sweep.task logs its traceback)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    text = message(e)
    if text is None and isinstance(e, (HydraException, OmegaConfBaseException)):
        text = one_line(e)  # e.g. an interpolation that resolves only in the job
    return text


def _job(cfg: Any) -> float:
    global _run_dir
    import contextlib

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from tfkv import check, checkpoint, knobs, rundir, store, worker
    from tfkv.checkpoint import lock
    from tfkv.ps import node

    check.validate(cfg)
    hc = HydraConfig.get()
    run_dir = _run_dir = Path(hc.runtime.output_dir)
    in_job = node.role() is not None
    if not in_job:
        check.timeline(cfg, run_dir)  # before any role starts: they write into it
    if cfg.resume == checkpoint.AUTO and not in_job and _new_each_run(hc):
        logging.getLogger("tfkv").warning(
            "resume=auto looks for checkpoints in the run's own directory, but %s is named after the time it "
            "started: a rerun gets another one and never resumes; fix it with hydra.run.dir=runs/<name>", run_dir)
    # the run directory is this job's alone (held from before Hydra wrote into it: tfkv.rundir);
    # a role of a launched job runs inside its launcher's hold
    with contextlib.nullcontext() if in_job else lock.hold(run_dir):
        if not in_job:
            if cfg.eval_only:  # its record never over a run's results: eval/<checkpoint>/ beside them
                run_dir = rundir.evaluation_dir(cfg, run_dir, Path(hc.runtime.cwd), list(hc.overrides.task))
            if store.capabilities(cfg.kvstore.type).distributed and not cfg.eval_only:  # eval_only: here, alone
                check.tables(cfg)  # what only the model shows, before any role starts
                # its launcher records the config its workers run (config_resolved.yaml: tfkv.worker.record)
                # and the knobs (knobs.json), and hands both to every role
                return _launch(cfg, run_dir, list(hc.overrides.task), Path(hc.runtime.cwd))
            (run_dir / worker.RECORD).write_text(OmegaConf.to_yaml(cfg, resolve=True))
        values = knobs.resolve(knobs.settings(cfg), os.environ)  # the environment wins over the config
        if not in_job:  # a role of a job: its launcher's record
            knobs.record(run_dir, values)
        return _train(cfg, run_dir, hc, values)  # to its store and the store's ClusterEnv


def _train(cfg: Any, run_dir: Path, hc: Any, knobs: dict[str, Any]) -> float:
    """Train in this process: a single run, or a worker of a job started by hand or by tfkv-launch."""
    from tfkv.parallel import binding

    cfg.devices = binding.bind(cfg.devices)  # {local_rank}: this process's GPU, before TensorFlow sees any
    from tfkv.sweep import pruning
    from tfkv.trainer import objective, train

    final = train(cfg, run_dir, list(hc.overrides.task), search_root=Path(hc.runtime.cwd), knobs=knobs,
                  trackers=[pruning.build])
    return objective(cfg, final, run_dir)


def _new_each_run(hc: Any) -> bool:
    """Whether the run directory is named after the time the run started (Hydra's default, kept
    where no hydra.run.dir or hydra.sweep.dir is given): every run gets a new one."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    node = hc.sweep if hc.mode == RunMode.MULTIRUN else hc.run
    return "${now:" in str(OmegaConf.to_container(node, resolve=False)["dir"])


def _launch(cfg: Any, run_dir: Path, overrides: list[str], cwd: Path) -> float:
    """Start the whole parameter-server job; its workers write into this run directory.

    Every worker runs this process's config as recorded in config_resolved.yaml (tfkv.worker),
    never one composed again from the overrides: --config-dir, hydra.searchpath and every
    decision made here (the checkpoint resume=true means) reach every host as they are."""
    import signal

    from hydra.core.hydra_config import HydraConfig

    from tfkv import checkpoint, knobs, worker
    from tfkv.checkpoint import preemption
    from tfkv.errors import EXIT_PREEMPTED, ClusterFailed
    from tfkv.launcher import base, job
    from tfkv.trainer import objective

    c = cfg.cluster
    # the settings this launcher has (its declared schema: tfkv.launcher.base.schemas); Options' defaults for the rest
    opts = job.Options(**{f.name: c[f.name] for f in dataclasses.fields(job.Options) if f.name in c})
    # resume=true means an earlier run of this command here, where its outputs are; the workers
    # get the checkpoint's path as they see it (under sync_dst_dir on the hosts of a synced tree).
    resume_auto = cfg.resume == checkpoint.AUTO
    resume_from = checkpoint.find_resume(cfg.resume, run_dir, cwd, overrides)
    if resume_from:  # before any role starts
        from omegaconf import OmegaConf

        checkpoint.check_fits(resume_from, OmegaConf.to_container(cfg, resolve=True))
    cfg.resume = job.remote_path(opts, cwd, resume_from) if resume_from else False
    if resume_auto and job.requeues_itself(opts):  # run again by Slurm, without this launcher: the
        cfg.resume = checkpoint.AUTO  # workers look in the run directory themselves, each time
    hc = HydraConfig.get()
    env = worker.record(cfg, run_dir, hc)
    python = sys.executable if base.traits(c.launcher).runs_here else c.get("python", "python3")
    if opts.dry_run:  # every command and script printed, no role started: there is no objective
        job.dry_run(opts, [python, "-m", "tfkv.worker"], cwd, run_dir, sys.stdout, env, settings=knobs.settings(cfg))
        return float("nan")
    # SIGUSR1 here (a batch system's warning): worker 0 checkpoints at the end of a step and stops the job
    asked = signal.signal(preemption.SIGNAL, lambda *_: preemption.ask(run_dir))

    def again(_failed: Any) -> dict[str, str] | None:
        """cluster.max_restarts: the next attempt resumes from the newest checkpoint this run has
        written (else as the first did); a preempted job is not restarted but requeued by its owner."""
        if (run_dir / preemption.DONE).exists():
            return None
        newest = checkpoint.newest_valid(run_dir)
        if newest is not None:
            cfg.resume = job.remote_path(opts, cwd, newest)
        return worker.record(cfg, run_dir, hc)

    try:
        result = job.launch(opts, [python, "-m", "tfkv.worker"], cwd, run_dir, _command_line(hc, overrides),
                            sys.stdout, env, settings=knobs.settings(cfg), again=again, devices=list(cfg.devices),
                            preemptible=checkpoint.takes_sigterm())
    finally:
        signal.signal(preemption.SIGNAL, asked)
    preempted = preemption.done(run_dir)
    if result.returncode > 128:  # stopped by Ctrl-C (130) or SIGTERM (143): exit as a single run does
        print(f"tfkv-run: the {cfg.kvstore.type} job failed: {result.failure}{_left(run_dir) or f'; logs in {run_dir}'}",
              file=sys.stderr)
        sys.exit(result.returncode)
    if preempted:  # worker 0 checkpointed and stopped; the rest of the job stopped with it
        print(f"tfkv-run: {preempted}", file=sys.stderr)
        if result.requeued:  # the slurm launcher's batch job: it goes on from there by itself
            print(f"tfkv-run: its Slurm batch job requeued itself and continues from that checkpoint without "
                  f"tfkv-run (squeue; its output: {run_dir / 'launch' / 'slurm' / 'job.log'})", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    if result.failure:
        raise ClusterFailed(f"the {cfg.kvstore.type} job failed: {result.told()}; logs in {run_dir}")
    return objective(cfg, json.loads((run_dir / "metrics.json").read_text()), run_dir)


def _command_line(hc: Any, overrides: list[str]) -> list[str]:
    """This job's tfkv-run command, for the record's rerun.sh: its own config directory and
    name, Hydra's overrides (hydra.searchpath, ...) and the job's (one job of a sweep)."""
    argv = ["tfkv-run"]
    argv += [f"--config-dir={s.path}" for s in hc.runtime.config_sources if s.provider == "command-line"]
    if hc.job.config_name != "config":
        argv.append(f"--config-name={hc.job.config_name}")
    return argv + [o for o in hc.overrides.hydra if not o.startswith("hydra.mode=")] + overrides


def _from_hydra_itself(exc: BaseException) -> bool:
    """Raised by Hydra's command-line handling (`-m ... --cfg job`), not by a job of ours."""
    import hydra

    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    if not frames or any(f.f_code is _main.__code__ for f in frames):
        return False
    return frames[-1].f_code.co_filename.startswith(os.path.dirname(hydra.__file__) + os.sep)


# A value that starts with ~ (or ~user), alone or as an element of a sweep: dataset.root=~/data
_HOME = re.compile(r"(^|,)(~[\w.-]*)(?=/|,|$)")
_OVERRIDE = re.compile(r"^([+~]{0,2}[\w.\-/@]+)=(.*)$", re.S)


def expand_home(arg: str) -> str:
    """`key=~/data` -> `key=/home/me/data`, as the shell expands `~` in an assignment.

    Hydra's override grammar has no unquoted `~` in a value, so without this the docs' own
    `dataset.root=~/data/mnist` is a lexer error. A quoted value (`'key="~/x"'`) stays as written.
    """
    m = _OVERRIDE.match(arg)
    if not m or not m.group(2).startswith("~"):
        return arg
    value = _HOME.sub(lambda h: h.group(1) + os.path.expanduser(h.group(2)), m.group(2))
    return f"{m.group(1)}={value}"


def _interrupted() -> str:
    """The Ctrl-C line: where the newest checkpoint is, when this job got one."""
    return "interrupted" + (_left(_run_dir) if _run_dir is not None else "")


def _left(run_dir: Path) -> str:
    """`; checkpoint <name> is in <run_dir> (...)` for a run stopped by a signal, where it
    got one; else nothing."""
    from tfkv import checkpoint

    newest = checkpoint.latest(run_dir)
    return f"; checkpoint {newest.name} is in {run_dir} (resume=true continues from it)" if newest else ""


def _hydra_app() -> Callable[[], Any]:
    import hydra

    from tfkv import config, plugins  # noqa: F401  (importing config registers the schema with Hydra)

    plugins.load()  # installed packages' models, data sets, stores and launchers as config options
    return hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")(_main)


def _run() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "--version" in sys.argv[1:]:  # Hydra's own --version names Hydra alone
        print(f"tfkv-run {versions()}")
        return
    from tfkv.ps import node

    node.main(workers_return=True)  # a scheduler or server serves until the job ends, then exits
    # The user's own package (model._target_: myproj.nets.build) imports from the directory
    # tfkv-run started in, as `python -m` would have it: a console script's sys.path lacks it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    sys.argv[1:] = [expand_home(a) for a in sys.argv[1:]]
    from tfkv.launcher.plan import worker_overrides

    sys.argv += worker_overrides(sys.argv[1:], os.environ, node.role())  # a launched job's worker: its run directory
    app = _hydra_app()
    from tfkv.sweep import summary

    try:
        _app(app)
    finally:
        summary.finish()  # a sweep that ended early (fail_fast, Ctrl-C): the table of what ran
    failed, total = summary.failed()
    if failed:  # a sweep: every trial ran, the table says which failed and why
        print(f"tfkv-run: {failed} of {total} trials failed; see the table above", file=sys.stderr)
        sys.exit(1)


def _app(app: Callable[[], Any]) -> None:
    """Hydra's app, its errors as one line each."""
    from tfkv.sweep.trial import SweepStopped

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        app()
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra's errors reach us instead of printing them
    try:
        app()
    except SweepStopped as e:  # sweep.fail_fast: the table of what ran, then why it stopped
        from tfkv.sweep import summary

        summary.finish()
        print(f"tfkv-run: {e}", file=sys.stderr)
        sys.exit(1)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"tfkv-run: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        report("tfkv-run", e)  # e.g. Hydra's own writes into the run directory on a full disk
        if not _from_hydra_itself(e):
            raise
        print(f"tfkv-run: {e}; see tfkv-run --help", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """Console entry point of `tfkv-run`."""
    try:
        _run()
    except KeyboardInterrupt:
        print(f"tfkv-run: {_interrupted()}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as e:
        if e.code == EXIT_PREEMPTED:
            _requeue()
        raise


def _requeue() -> None:
    """Preempted inside a Slurm batch job: requeue it (tfkv.launcher.requeue); not as a role of
    a launched job, whose launcher decides."""
    from tfkv.ps import node

    if node.role() is None:
        from tfkv.launcher import requeue

        requeue.requeue(_run_dir, lambda line: print(f"tfkv-run: {line}", file=sys.stderr, flush=True))


if __name__ == "__main__":
    run()
