"""`hydra/launcher=tfkv`: a sweep's trials packed onto a cluster's hosts, each a whole distributed job.

    tfkv-run -m hydra/launcher=tfkv kvstore=dist_sync cluster=ssh cluster.hostfile=hosts \\
        hydra.launcher.hosts_per_trial=2 optimizer.lr=0.1,0.05,0.02,0.01

The hosts are those of `hydra.launcher.hostfile` (default: the sweep's `cluster.hostfile`); each
trial gets `hosts_per_trial` of them, in the hosts file's order, through a hosts file of its own
(`<trial run dir>/trial.hosts`, its `cluster.hostfile`). As many trials run at once as the hosts
hold, and the next starts as soon as one ends and gives its hosts back.

Each trial runs in a child process (`python -m tfkv.sweep.launcher`) that calls Hydra's run_job
with tfkv-run's task function, as Hydra's basic launcher does in its own process: the trial
writes its run directory, its trial.json (tfkv.sweep.trial) and its log, and launches its job
(ssh, mpi) on its hosts. The child's output comes back prefixed `[trial N]`. Its JobReturn here
carries the trial's value from trial.json (None for a failed or pruned trial, as the task function
returns in-process), so the table and any sweeper (Optuna) read it as from any launcher.

A failed trial's hosts are probed over ssh before they are used again: a host that does not
answer is dropped for the rest of the sweep (and named in the trial's reason); when none is left,
every trial not yet run is recorded failed with that reason. `sweep.fail_fast=true` stops the
running trials at the first failure and ends the sweep. Ctrl-C (or SIGTERM) goes to every running
trial, which tears its job down on its hosts; a trial process that has not ended 60 s later is
killed, and the children die with this process if it is killed (their ssh channels close, and the
roles' wrappers end the roles).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional, Sequence

from hydra import version
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from tfkv import knobs, store
from tfkv.errors import ConfigError
from tfkv.launcher import base, signals
from tfkv.launcher.hosts import Host, read_hosts
from tfkv.launcher.process import die_with_parent, signal_group, status_text, warn_without_parent_death

log = logging.getLogger("tfkv")

STOP_WAIT = 60.0  # seconds a trial gets to tear its job down after Ctrl-C before it is killed
HOSTS_FILE = "trial.hosts"


@dataclass
class TfkvLauncherConf:
    _target_: str = "hydra_plugins.tfkv_sweep.tfkv_launcher.TfkvLauncher"
    hostfile: Optional[str] = None  # the cluster's hosts; null: the sweep's cluster.hostfile
    hosts_per_trial: int = 1  # hosts each trial's job gets (its cluster.hostfile lists them)


@dataclass
class _Trial:
    idx: int
    overrides: list[str]
    config: DictConfig  # composed for this trial, hydra.sweep.dir resolved
    run_dir: Path
    hosts: list[Host] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    pump: Optional[threading.Thread] = None
    tail: deque = field(default_factory=lambda: deque(maxlen=20))  # its last output lines


class TfkvLauncher(Launcher):
    """Hydra launcher: whole distributed trials side by side on disjoint hosts (module docstring)."""

    def __init__(self, hostfile: Optional[str] = None, hosts_per_trial: int = 1) -> None:
        self.hostfile = hostfile
        self.hosts_per_trial = hosts_per_trial
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None
        self.hosts: Optional[list[Host]] = None  # the hosts still answering; read at the first launch
        self.dropped: dict[str, str] = {}  # host -> why it was dropped
        self._out_lock = threading.Lock()

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    # -- the sweep's hosts ----------------------------------------------------------------------

    def _read_hosts(self) -> list[Host]:
        assert self.config is not None
        path = self.hostfile or OmegaConf.select(self.config, "cluster.hostfile")
        if not path:
            raise ConfigError("hydra/launcher=tfkv needs the cluster's hosts: set cluster.hostfile (with "
                              "cluster=ssh) or hydra.launcher.hostfile to a hosts file")
        path = Path(str(path)).expanduser()
        if not path.is_absolute():
            path = Path(self.config.hydra.runtime.cwd) / path
        hosts = list(dict.fromkeys(read_hosts(path)))  # a host listed twice is still one host to pack
        servers = [h.name for h in hosts if h.server] + list(OmegaConf.select(self.config, "cluster.server_hosts") or [])
        if servers:  # a trial's hosts file lists its share of the hosts, plain: a server host would take workers
            raise ConfigError(f"hydra/launcher=tfkv packs the hosts of {path} into trials, but {servers[0]} is a server "
                              "host (role=server, cluster.server_hosts), which a trial's share does not keep; drop "
                              "the server hosts from the sweep")
        if not 1 <= self.hosts_per_trial <= len(hosts):
            raise ConfigError(f"hydra.launcher.hosts_per_trial={self.hosts_per_trial} but {path} lists "
                              f"{len(hosts)} host(s); set hosts_per_trial between 1 and {len(hosts)}, or add hosts")
        return hosts

    # -- Hydra's entry point ----------------------------------------------------------------------

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hydra.core.utils import configure_log, setup_globals

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        if self.hosts is None:
            self.hosts = self._read_hosts()
        sweep_dir = Path(self.config.hydra.runtime.cwd) / str(self.config.hydra.sweep.dir)
        trials = [self._compose(initial_job_idx + i, list(o), sweep_dir) for i, o in enumerate(job_overrides)]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("tfkv launcher: %d trial(s) of %d host(s) each on %s", len(trials), self.hosts_per_trial,
                 ", ".join(map(str, self.hosts)) or "no hosts")
        results: dict[int, JobReturn] = {}
        pending = deque(trials)
        running: list[_Trial] = []
        warn_without_parent_death()
        try:
            with signals.stop_once():
                while pending or running:
                    free = self._free(running)
                    while pending and len(free) >= self.hosts_per_trial:
                        t = pending.popleft()
                        t.hosts, free = free[:self.hosts_per_trial], free[self.hosts_per_trial:]
                        self._start(t)
                        running.append(t)
                    if not running:  # trials wait, no host is left to run them
                        break
                    ended = [t for t in running if t.proc.poll() is not None]
                    if not ended:
                        time.sleep(0.1)
                        continue
                    for t in ended:
                        running.remove(t)
                        results[t.idx] = self._finish(t, running)
        except KeyboardInterrupt:
            self._stop(running, interrupted=True)
            raise
        if pending:  # too few hosts left to run them
            left = (f"only {len(self.hosts)} host(s) of the sweep answer, {self.hosts_per_trial} needed per trial"
                    if self.hosts else "no host of the sweep is left")
            why = f"{left}: " + "; ".join(f"{h} {reason}" for h, reason in self.dropped.items())
            for t in pending:
                results[t.idx] = self._job_return(t, self._record_failed(t, why))
        return [results[t.idx] for t in trials]

    def _free(self, running: list[_Trial]) -> list[Host]:
        """The live hosts no running trial holds, in the hosts file's order."""
        busy = {h for t in running for h in t.hosts}
        return [h for h in self.hosts or [] if h not in busy]

    # -- one trial ------------------------------------------------------------------------------

    def _compose(self, idx: int, overrides: list[str], sweep_dir: Path) -> _Trial:
        """The trial's config, as Hydra's basic launcher composes it; refused in one line when its
        job is not one this launcher can place on hosts."""
        from hydra.core.hydra_config import HydraConfig

        assert self.config is not None and self.hydra_context is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
            cfg.hydra.sweep.dir = str(sweep_dir)  # ${now:...} resolved here, once for every trial
        launcher = OmegaConf.select(cfg, "cluster.launcher")
        kvstore = str(OmegaConf.select(cfg, "kvstore.type") or "")
        # a launcher that places a job's roles on the hosts of its hosts file (its declared trait)
        placing = launcher in base.REGISTRY and base.traits(launcher).places_roles
        if not placing or not store.capabilities(kvstore).distributed:
            shown = " ".join(overrides) or "(no overrides)"
            raise ConfigError(f"hydra/launcher=tfkv runs each trial as a distributed job on hosts of its own, but "
                              f"trial #{idx} ({shown}) has kvstore={kvstore or 'none'} cluster={launcher}; use "
                              "kvstore=dist_sync (or another dist_* type) with cluster=ssh or cluster=mpi")
        # The run directory as run_job will make it: hydra.sweep.subdir may name ${hydra:job.num}.
        hc = HydraConfig.instance()
        before = hc.cfg
        try:
            hc.set_config(cfg)
            run_dir = sweep_dir / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        finally:
            hc.cfg = before
        return _Trial(idx, overrides, cfg, run_dir)

    def _start(self, t: _Trial) -> None:
        t.run_dir.mkdir(parents=True, exist_ok=True)
        hosts_file = t.run_dir / HOSTS_FILE
        hosts_file.write_text("".join(f"{h}\n" for h in t.hosts))
        with read_write(t.config), open_dict(t.config):
            t.config.cluster.hostfile = str(hosts_file)
        log.info("tfkv launcher: trial #%d on %s: %s", t.idx, ", ".join(h.name for h in t.hosts),
                 " ".join(t.overrides))
        # The payload goes to the child over this pipe only (never a socket, never a file another
        # user could write): a pickle, as joblib's and submitit's launchers hand a job to their
        # workers, because run_job needs the config's structured types (HydraConf) that YAML loses.
        payload = pickle.dumps({"config": t.config, "task_function": self.task_function,
                                "version_base": str(version.getbase())})
        t.proc = subprocess.Popen(
            [sys.executable, "-m", "tfkv.sweep.launcher"], cwd=str(self.config.hydra.runtime.cwd),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM))
        try:
            t.proc.stdin.write(payload)
            t.proc.stdin.close()
        except BrokenPipeError:  # the child died at once; its output says why
            pass
        t.pump = threading.Thread(target=self._pump, args=(t, t.proc.stdout, sys.stdout), daemon=True)
        t.pump.start()

    def _pump(self, t: _Trial, stream: IO[bytes], out: IO[str]) -> None:
        prefix = f"[trial {t.idx}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            t.tail.append(line)
            with self._out_lock:
                out.write(prefix + line + "\n")
                out.flush()
        stream.close()

    def _finish(self, t: _Trial, running: list[_Trial]) -> JobReturn:
        """The ended trial's result; a failed trial's hosts are probed, a dead one dropped."""
        from tfkv.sweep import trial

        if t.pump is not None:
            t.pump.join(timeout=10)
        record = trial.read(t.run_dir)
        if record is None:
            last = next((ln.strip() for ln in reversed(t.tail) if ln.strip()), "")
            record = self._record_failed(t, f"the trial's process {status_text(t.proc.returncode)} without recording "
                                            f"the trial" + (f" ({last})" if last else ""))
        record["hosts"] = [str(h) for h in t.hosts]
        if record.get("status") == "failed":
            dead = self._probe(t.hosts, self._ssh_config())
            if dead:
                for host, why in dead.items():
                    self.dropped[str(host)] = why
                    log.warning("tfkv launcher: host %s dropped from the sweep: %s", host, why)
                self.hosts = [h for h in self.hosts or [] if h not in dead]
                record["reason"] = f"{record.get('reason')}; " + "; ".join(
                    f"host {h} does not answer ssh, dropped from the sweep" for h in dead)
        trial.write(t.run_dir, record)
        if record.get("status") == "failed" and OmegaConf.select(t.config, "sweep.fail_fast"):
            self._stop(running, interrupted=False)
            raise trial.SweepStopped(f"trial #{t.idx} ({' '.join(t.overrides) or 'no overrides'}) failed: "
                                     f"{record.get('reason')}; sweep.fail_fast=true ends the sweep there")
        return self._job_return(t, record)

    def _record_failed(self, t: _Trial, reason: str) -> dict[str, Any]:
        from tfkv.sweep import trial

        now = time.time()
        record = trial.failed(t.idx, t.overrides, t.run_dir, reason, objective=OmegaConf.select(t.config, "objective"),
                              direction=OmegaConf.select(t.config, "direction"), started=now, ended=now,
                              duration_s=0.0, hosts=[str(h) for h in t.hosts])
        trial.write(t.run_dir, record)
        return record

    def _job_return(self, t: _Trial, record: dict[str, Any]) -> JobReturn:
        """What run_job would have returned in this process: the trial's value (None unless ok,
        as tfkv.cli's task function returns: Hydra's Optuna sweeper ends the sweep on a NaN)."""
        ret = JobReturn()
        ret.overrides = t.overrides
        cfg = copy.deepcopy(t.config)
        with read_write(cfg.hydra), open_dict(cfg.hydra):  # (HydraConfig made it read-only)
            cfg.hydra.runtime.output_dir = str(t.run_dir)
        ret.hydra_cfg = OmegaConf.masked_copy(cfg, "hydra")
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        ret.cfg = cfg
        ret.working_dir = str(self.config.hydra.runtime.cwd)
        ret.task_name = str(t.config.hydra.job.name)
        ret.status = JobStatus.COMPLETED
        value = record.get("value")
        ret.return_value = float(value) if record.get("status") == "ok" and value is not None else None
        return ret

    # -- hosts that died, trials that must stop ---------------------------------------------------

    def _ssh_config(self) -> Optional[str]:
        """The ssh config the trials' jobs reach their hosts with: cluster.ssh_config, or TFKV_SSH_CONFIG."""
        assert self.config is not None
        return knobs.resolve(knobs.settings(self.config), os.environ)["cluster.ssh_config"]

    @staticmethod
    def _probe(hosts: list[Host], ssh_config: Optional[str] = None) -> dict[Host, str]:
        """The hosts that do not answer ssh now, with why (one line each)."""
        from tfkv.launcher.backends import ssh_connect as ssh

        def answer(host: Host) -> Optional[str]:
            try:
                conn = ssh.connect(host, ssh_config)
            except Exception as e:  # noqa: BLE001 - every way of not answering is one line
                return "does not answer ssh: " + ssh.connect_problem(host, e, ssh_config).split(": ", 1)[-1]
            try:
                r = conn.run("true", hide=True, warn=True, in_stream=False, timeout=ssh.CONNECT_TIMEOUT)
                return None if r.exited == 0 else f"cannot run a command over ssh (exit {r.exited})"
            except Exception as e:  # noqa: BLE001
                return f"does not answer ssh: {type(e).__name__}: {e}"
            finally:
                conn.close()

        with ThreadPoolExecutor(max_workers=min(16, len(hosts) or 1)) as pool:
            answers = list(pool.map(answer, hosts))
        return {h: why for h, why in zip(hosts, answers) if why is not None}

    @staticmethod
    def _stop(running: list[_Trial], interrupted: bool) -> None:
        """Stop the running trials: SIGINT (Ctrl-C) or SIGTERM to each trial's process group, which
        tears its job down on its hosts; whatever still runs STOP_WAIT s later is killed."""
        from tfkv.sweep import trial

        with signals.shielded():
            sig = signal.SIGINT if interrupted else signal.SIGTERM
            for t in running:
                if t.proc is not None and t.proc.poll() is None:
                    log.warning("tfkv launcher: stopping trial #%d", t.idx)
                    signal_group(t.proc.pid, sig)
            deadline = time.monotonic() + STOP_WAIT
            while time.monotonic() < deadline and any(t.proc.poll() is None for t in running if t.proc):
                time.sleep(0.1)
            for t in running:
                if t.proc is not None:
                    signal_group(t.proc.pid, signal.SIGKILL)
                    t.proc.wait()
                if t.pump is not None:
                    t.pump.join(timeout=5)
                record = trial.read(t.run_dir)  # what the trial recorded as it stopped
                if record is not None:
                    trial.write(t.run_dir, {**record, "hosts": [str(h) for h in t.hosts]})


def _child() -> None:
    """`python -m tfkv.sweep.launcher`: one trial, its config and task function on stdin (from the
    TfkvLauncher that started this process), run as Hydra's basic launcher runs a job."""
    from hydra._internal.callbacks import Callbacks
    from hydra import version
    from hydra.core.utils import run_job, setup_globals

    from tfkv.sweep.trial import SweepStopped

    payload = pickle.load(sys.stdin.buffer)  # our parent's pipe: see TfkvLauncher._start
    config, task_function = payload["config"], payload["task_function"]
    version.setbase(payload["version_base"])  # the app's (hydra.main's): e.g. whether run_job chdirs
    setup_globals()
    # run_job reads only the callbacks of its context (on_job_start / on_job_end)
    context = HydraContext(config_loader=None, callbacks=Callbacks(config))  # type: ignore[arg-type]
    try:
        ret = run_job(hydra_context=context, task_function=task_function, config=config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    except SweepStopped:  # sweep.fail_fast: recorded in trial.json; the launcher ends the sweep
        sys.exit(1)
    if ret.status == JobStatus.FAILED:
        raise ret._return_value  # a bug in the task: its traceback, in the trial's output


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        _child()
    except KeyboardInterrupt:  # the launcher's Ctrl-C: the trial recorded it and tore its job down
        sys.exit(130)


if __name__ == "__main__":
    main()
