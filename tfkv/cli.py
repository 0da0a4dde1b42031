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
import difflib
import errno
import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from tfkv.errors import TfkvError

log = logging.getLogger("tfkv")

# A full or read-only disk is the machine's state, not a bug: one line, like a config mistake.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

_run_dir: Path | None = None  # the job's run directory once known, for the Ctrl-C line


def conf_dir() -> str:
    """The config tree: inside the installed package, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"tfkv's config tree is missing (looked in {here / 'conf'}); reinstall tfkv")


def _main(cfg: Any) -> Any:
    """The Hydra task: one job (a trial of its own where it is one job of a sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from tfkv.ps.cluster_env import ClusterEnv

    if HydraConfig.get().mode == RunMode.MULTIRUN and ClusterEnv.role_of() is None:
        from tfkv.sweep import task

        return task.run(cfg, _job, _explain)
    try:
        return _job(cfg)
    except Exception as e:  # exit here: past this point Hydra adds its own lines to the message
        text = user_error(e)
        if text is None:
            raise
        print(f"tfkv-run: {text}", file=sys.stderr)
        sys.exit(2)


def _explain(e: BaseException) -> str | None:
    """A trial's failure as one line, or None for a bug (tfkv.sweep.task logs its traceback)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    text = user_error(e)
    if text is None and isinstance(e, (HydraException, OmegaConfBaseException)):
        text = _one_line(e)  # e.g. an interpolation that resolves only in the job
    return text


def user_error(e: BaseException) -> str | None:
    """The one line for an error the user fixes outside tfkv's code, or None for a bug."""
    from tfkv.ps.cluster_env import ClusterEnvError
    from tfkv.ps.scheduler_link import ClusterError
    from tfkv.ps.security import SecurityError

    if isinstance(e, (TfkvError, ClusterEnvError, ClusterError, SecurityError)):
        text = str(e)
        if text.startswith("in user code:"):
            # raised while TensorFlow traced a step (a loss that does not fit the model's output):
            # TensorFlow prefixes the trace, the message is its last line, after the type's name
            last = [line.strip() for line in text.splitlines() if line.strip()][-1]
            text = last.split(": ", 1)[1] if last.startswith(f"{type(e).__name__}: ") else last
        return text
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        where = f" writing {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}; free space there or choose another hydra.run.dir"
    return None


def _job(cfg: Any) -> float:
    global _run_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from tfkv import check, config as config_schema, knobs
    from tfkv.ps.cluster_env import ClusterEnv

    check.validate(cfg)
    hc = HydraConfig.get()
    run_dir = _run_dir = Path(hc.runtime.output_dir)
    in_job = ClusterEnv.role_of() is not None
    values = knobs.resolve(knobs.settings(cfg), os.environ)  # the environment wins over the config
    knobs.configure(values)
    if not in_job:
        (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        knobs.record(run_dir, values)
        if config_schema.is_distributed(cfg.kvstore.type) and not cfg.eval_only:  # eval_only: here, alone
            return _launch(cfg, run_dir, list(hc.overrides.task), Path(hc.runtime.cwd))
    from tfkv.trainer import train

    final = train(cfg, run_dir, list(hc.overrides.task), search_root=Path(hc.runtime.cwd))
    return _done(cfg, final, run_dir)


def _done(cfg: Any, final: dict[str, Any], run_dir: Path) -> float:
    """The run's `objective` (what a sweeper optimises), logged with where the run's files are."""
    from tfkv.errors import ConfigError

    if cfg.objective not in final:
        reported = ", ".join(k for k, v in final.items() if isinstance(v, (int, float)) and k != "epoch")
        raise ConfigError(f"objective={cfg.objective} is not a metric of this run; it reports {reported}: "
                          "choose one of those, e.g. objective=test_loss")
    value = float(final[cfg.objective])
    log.info("done: %s %.4f after %d epochs; run directory %s", cfg.objective, value, final.get("epoch", 0), run_dir)
    return value


def _launch(cfg: Any, run_dir: Path, overrides: list[str], cwd: Path) -> float:
    """Start the whole parameter-server job; its workers write into this run directory.

    Every worker runs this process's config as recorded in config_resolved.yaml (tfkv.worker),
    never one composed again from the overrides: --config-dir, hydra.searchpath and every
    decision made here (the checkpoint resume=true means) reach every host as they are."""
    from hydra.core.hydra_config import HydraConfig

    from tfkv import checkpoint, knobs, worker
    from tfkv.errors import ClusterFailed
    from tfkv.launcher import job

    c = cfg.cluster
    # the settings this launcher has (config.CLUSTER_SCHEMAS); Options' defaults for the rest
    opts = job.Options(**{f.name: c[f.name] for f in dataclasses.fields(job.Options) if f.name in c})
    # resume=true means an earlier run of this command here, where its outputs are; the workers
    # get the checkpoint's path as they see it (under sync_dst_dir on the hosts of a synced tree).
    resume_from = checkpoint.find_resume(cfg.resume, run_dir, cwd, overrides)
    cfg.resume = job.remote_path(opts, cwd, resume_from) if resume_from else False
    hc = HydraConfig.get()
    env = worker.record(cfg, run_dir, hc)
    python = sys.executable if c.launcher == "local" else c.get("python", "python3")
    result = job.launch(opts, [python, "-m", "tfkv.worker"], cwd, run_dir, _command_line(hc, overrides),
                        sys.stdout, env, knobs.settings(cfg))
    if result.returncode > 128:  # stopped by Ctrl-C (130) or SIGTERM (143): exit as a single run does
        print(f"tfkv-run: the {cfg.kvstore.type} job failed: {result.failure}; logs in {run_dir}", file=sys.stderr)
        sys.exit(result.returncode)
    if result.failure:
        raise ClusterFailed(f"the {cfg.kvstore.type} job failed: {result.failure}; logs in {run_dir}")
    return _done(cfg, json.loads((run_dir / "metrics.json").read_text()), run_dir)


def _command_line(hc: Any, overrides: list[str]) -> list[str]:
    """This job's tfkv-run command, for the record's rerun.sh: its own config directory and
    name, Hydra's overrides (hydra.searchpath, ...) and the job's (one job of a sweep)."""
    argv = ["tfkv-run"]
    argv += [f"--config-dir={s.path}" for s in hc.runtime.config_sources if s.provider == "command-line"]
    if hc.job.config_name != "config":
        argv.append(f"--config-name={hc.job.config_name}")
    return argv + [o for o in hc.overrides.hydra if not o.startswith("hydra.mode=")] + overrides


def _one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, folded into one line with a hint."""
    from hydra.errors import MissingConfigException, OverrideParseException

    parts = []
    for e in (exc, exc.__cause__):
        if e is not None and str(e).strip():
            parts.append(str(e).strip().splitlines()[0].rstrip("."))
    text = ": ".join(dict.fromkeys(parts))
    plugin = _plugin_package(str(getattr(exc, "missing_cfg_file", "") or ""))
    if isinstance(exc, MissingConfigException) and plugin:
        # hydra/launcher=ray: a Hydra plug-in that is not installed
        extra = _extra_with(plugin)
        # tfkv's extra pins what the plug-in needs with tfkv (optuna 2's SQLite storage: SQLAlchemy<2)
        also = f"pip install 'tfkv[{extra}]', which has it with the versions tfkv is tested with, or " if extra else ""
        return f"{text}: it is a Hydra plug-in that is not installed; {also}pip install {plugin}"
    if isinstance(exc, MissingConfigException) and exc.options:
        # `model=resnet19`: Hydra's list of what there is, and the nearest name
        wanted = str(exc.missing_cfg_file).rsplit("/", 1)[-1]
        text += f"; available: {', '.join(exc.options)}"
        close = difflib.get_close_matches(wanted, exc.options, n=1)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    elif "No match in the defaults list" in str(exc):
        # `experiment=x`: a group that is not in the defaults is added with +, as Hydra's second line says
        m = re.search(r"use (\+\S+)", str(exc))
        if m:
            text += f"; to add it, write {m.group(1)}"
    elif "is not a ListConfig" in str(exc.__cause__):  # devices=cpu:0
        text += "; write a list in brackets, e.g. devices=[cpu:0]"
    elif re.search(r"is not in struct|not in '\w+'", str(exc.__cause__)) and _option_keys(str(exc)):
        # (not in 'AdamConfig': the option's schema, conf/optimizer/adam.yaml's defaults)
        # optimizer=adam optimizer.momentum=0.9: the key belongs to another option of the group
        text += f"; {_option_keys(str(exc))}"
        return text
    elif isinstance(exc, OverrideParseException):
        text += ("; write lists as key=[a,b] and quote a value holding spaces or special characters "
                 "for both the shell and Hydra, e.g. 'key=\"a value\"'")
    cause = exc.__cause__ or exc
    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    if key is not None and str(key) not in known:  # a known key with a bad value needs no spelling hint
        close = difflib.get_close_matches(str(key), known, n=1)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    return text + "; see tfkv-run --help"


# Hydra's launcher and sweeper plug-ins on PyPI, by the option name each registers.
HYDRA_PLUGINS = {
    "hydra/launcher": {"joblib": "hydra-joblib-launcher", "ray": "hydra-ray-launcher",
                       "ray_aws": "hydra-ray-launcher", "rq": "hydra-rq-launcher",
                       "submitit_local": "hydra-submitit-launcher", "submitit_slurm": "hydra-submitit-launcher"},
    "hydra/sweeper": {"ax": "hydra-ax-sweeper", "optuna": "hydra-optuna-sweeper",
                      "tfkv_optuna": "hydra-optuna-sweeper", "nevergrad": "hydra-nevergrad-sweeper"},
}


def _extra_with(package: str) -> str | None:
    """The extra of the installed tfkv that requires `package` (`sweep`), from tfkv's metadata."""
    from importlib import metadata

    try:
        requires = metadata.requires("tfkv") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"([A-Za-z0-9_.\-]+).*;\s*extra\s*==\s*[\"']([\w-]+)[\"']", req)
        if m and m.group(1).lower() == package.lower():
            return m.group(2)
    return None


def _plugin_package(missing: str) -> str | None:
    """The pip package of a missing `hydra/launcher/<name>` or `hydra/sweeper/<name>`, if known."""
    group, _, name = missing.rpartition("/")
    return HYDRA_PLUGINS.get(group, {}).get(name)


def _option_keys(message: str) -> str | None:
    """For `Could not override 'G.K'` where G is an option group: the keys the chosen option has,
    read from the config composed without the overrides of G's keys."""
    m = re.search(r"override '(\w+)\.([\w.]+)'", message)
    if not m or m.group(1) not in ("optimizer", "cluster", "model", "dataset", "kvstore"):
        return None
    group = m.group(1)
    try:
        from hydra import compose, initialize_config_dir

        from tfkv import check, config, models, target
        from tfkv.data import source

        args = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")
                and not a.lstrip("+~").startswith(f"{group}.")]
        dirs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config-dir=")]
        searchpath = [f"hydra.searchpath=[{','.join('file://' + os.path.abspath(d) for d in dirs)}]"] if dirs else []
        with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
            node = compose("config", overrides=[*args, *searchpath])[group]
        if group in ("model", "dataset"):
            import inspect

            fn = target.locate(node["_target_"], f"{group}._target_")
            provided = models.PROVIDED if group == "model" else source.PROVIDED
            keys = [n for n in inspect.signature(fn).parameters if n not in provided]
            option = node["_target_"]
        else:
            schema = {"optimizer": lambda: config.OPTIMIZER_SCHEMAS[node.name],
                      "cluster": lambda: check.cluster_schema(node.launcher),
                      "kvstore": lambda: config.KVStoreConfig}[group]()
            keys = [f.name for f in dataclasses.fields(schema)]
            option = node.get("name") or node.get("launcher") or node.get("type")
    except Exception:  # noqa: BLE001 - only a better message; the plain one stands without it
        return None
    close = difflib.get_close_matches(m.group(2).split(".")[0], keys, n=1)
    mean = f"did you mean {group}.{close[0]}? " if close else ""
    return f"{mean}{group} {option} has the settings: {', '.join(keys)}"


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

    Hydra's override grammar has no unquoted `~` in a value, so without this the README's own
    `dataset.root=~/data/mnist` is a lexer error. A quoted value (`'key="~/x"'`) stays as written.
    """
    m = _OVERRIDE.match(arg)
    if not m or not m.group(2).startswith("~"):
        return arg
    value = _HOME.sub(lambda h: h.group(1) + os.path.expanduser(h.group(2)), m.group(2))
    return f"{m.group(1)}={value}"


def _interrupted() -> str:
    """The Ctrl-C line: where the newest checkpoint is, when this job got one."""
    if _run_dir is not None:
        from tfkv import checkpoint

        newest = checkpoint.latest(_run_dir)
        if newest is not None:
            return (f"interrupted; checkpoint {newest.name} is in {_run_dir} "
                    "(resume=true continues from it)")
    return "interrupted"


def _hydra_app() -> Callable[[], Any]:
    import hydra

    from tfkv import config, plugins  # noqa: F401  (importing config registers the schema with Hydra)

    plugins.load()  # installed packages' models, data sets, stores and launchers as config options
    return hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")(_main)


def versions() -> str:
    """`tfkv-run --version`: tfkv's version and those of what it runs on, read from the installed
    packages' metadata (TensorFlow is not imported: this answers in a blink)."""
    from importlib import metadata

    def installed(*names: str) -> str:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return "not installed"

    try:
        import zmq

        libzmq = zmq.zmq_version()
    except ImportError:
        libzmq = "not installed"
    tf = installed("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly", "tensorflow-intel")
    return (f"tfkv {installed('tfkv')}, TensorFlow {tf}, Hydra {installed('hydra-core')}, "
            f"ZeroMQ {libzmq} (pyzmq {installed('pyzmq')})")


def _run() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "--version" in sys.argv[1:]:  # Hydra's own --version names Hydra alone
        print(f"tfkv-run {versions()}")
        return
    from tfkv.ps.cluster_env import ClusterEnv

    if ClusterEnv.role_of() in ("scheduler", "server"):
        from tfkv.ps import node

        node.main()  # serves until the job ends, then exits
    # The user's own package (model._target_: myproj.nets.build) imports from the directory
    # tfkv-run started in, as `python -m` would have it: a console script's sys.path lacks it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    sys.argv[1:] = [expand_home(a) for a in sys.argv[1:]]
    from tfkv.launcher.plan import worker_overrides

    sys.argv += worker_overrides(sys.argv[1:], os.environ)  # a launched job's worker: its run directory
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
        print(f"tfkv-run: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        text = user_error(e)  # e.g. Hydra's own writes into the run directory on a full disk
        if text is None and _from_hydra_itself(e):
            text = f"{e}; see tfkv-run --help"
        if text is None:
            raise
        print(f"tfkv-run: {text}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """Console entry point of `tfkv-run`."""
    try:
        _run()
    except KeyboardInterrupt:
        print(f"tfkv-run: {_interrupted()}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
