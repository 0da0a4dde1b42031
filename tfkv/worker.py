"""The worker role of a launched `tfkv-run` job: runs the config the launcher recorded.

`tfkv-run kvstore=dist_* cluster=...` composes and validates the config once, resolves what
depends on the launching machine (`resume=true`: which checkpoint), writes the result to the run
directory's `config_resolved.yaml` and starts every worker as `python -m tfkv.worker` with that
same config in its environment (TFKV_CONFIG). A worker never composes a config of its own, so
`--config-dir`, `hydra.searchpath`, interpolations and whatever else the launcher saw reach it
as their result, on every backend and host.

TFKV_CONFIG is the config (with Hydra's job_logging and job.env_set, which Hydra applied to the
launcher's own job) as JSON, zlib-compressed and base64url-encoded:
only letters, digits, `-`, `_` and `=`, so it passes unchanged through every backend's way of
setting a variable (ssh's command line, `mpirun -x`, srun and qsub's inherited environment,
YARN's `-shell_env`, which refuses quotes), and is small (a few hundred bytes to a few KiB).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import logging.config
import os
import sys
import zlib
from pathlib import Path
from typing import Any, MutableMapping

from tfkv.launcher.plan import CONFIG, RUN_DIR

log = logging.getLogger("tfkv")

RECORD = "config_resolved.yaml"  # the recorded config, in the run directory
# Linux refuses an environment string over 128 KiB (MAX_ARG_STRLEN) when it starts a process.
MAX_ENCODED = 120_000


def digest(config: dict[str, Any]) -> str:
    """sha256 of a config's content (key order aside): what a worker logs, so the run directory
    shows that every worker ran the recorded config."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode(config: dict[str, Any], hydra: dict[str, Any] | None = None) -> str:
    """`config` and the parts of Hydra's config a worker applies (job_logging, env_set)."""
    from tfkv.errors import ConfigError

    text = json.dumps({"config": config, "hydra": hydra or {}}, separators=(",", ":"))
    value = base64.urlsafe_b64encode(zlib.compress(text.encode(), 9)).decode()
    if len(value) > MAX_ENCODED:
        raise ConfigError(f"the composed config is {len(value) // 1024} KiB compressed, more than a worker's "
                          f"environment can carry ({MAX_ENCODED // 1024} KiB); keep bulky values (lists of "
                          "files, tables) in a file that the model or data factory reads")
    return value


def decode(value: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config and Hydra's parts that `encode` made `value` of."""
    from tfkv.errors import ConfigError

    try:
        payload = json.loads(zlib.decompress(base64.urlsafe_b64decode(value.encode())))
        return payload["config"], payload["hydra"]
    except (ValueError, TypeError, KeyError, zlib.error) as e:  # binascii.Error is a ValueError
        raise ConfigError(f"{CONFIG} is not a config that tfkv-run recorded ({type(e).__name__}); start the "
                          "job with tfkv-run, which sets it") from None


def record(cfg: Any, run_dir: Path, hydra: Any = None) -> dict[str, str]:
    """Write `cfg` (validated, with every launcher-side decision made) as the run directory's
    config_resolved.yaml; return the environment that gives the workers exactly that config.
    `hydra`: the launcher's Hydra config, whose job_logging and job.env_set the workers apply."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True)
    parts = {}
    if hydra is not None:
        parts = {"job_logging": OmegaConf.to_container(hydra.job_logging, resolve=True),
                 "env_set": OmegaConf.to_container(hydra.job.env_set, resolve=True)}
    value = encode(config, parts)
    (Path(run_dir) / RECORD).write_text(OmegaConf.to_yaml(OmegaConf.create(config)))
    return {CONFIG: value}


def _setup_logging(job_logging: dict[str, Any] | None, path: Path) -> None:
    """The launcher's Hydra job_logging (console and a file), its file handlers writing to this
    worker's `worker<rank>.log`: what Hydra set up for tfkv-run's own workers before."""
    if not job_logging:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        return
    for handler in job_logging.get("handlers", {}).values():
        if "filename" in handler:
            handler["filename"] = str(path)
    logging.config.dictConfig(job_logging)


def run(environ: MutableMapping[str, str] = os.environ) -> dict[str, Any]:
    """Train as the recorded config says, in the job's run directory; the final metrics."""
    value = environ.pop(CONFIG, None)  # never passed on to what this worker starts
    run_dir = environ.get(RUN_DIR)
    if not value or not run_dir:
        from tfkv.errors import ConfigError

        raise ConfigError(f"python -m tfkv.worker runs a worker of a job that tfkv-run launched ({CONFIG} or "
                          f"{RUN_DIR} is unset); start the job with tfkv-run kvstore=dist_sync cluster=local")
    config, hydra = decode(value)
    environ.update({k: str(v) for k, v in (hydra.get("env_set") or {}).items()})
    from tfkv.parallel import binding

    config["devices"] = binding.bind(config["devices"], environ)  # before TensorFlow sees the GPUs
    # The project's own package (model and data factories named by _target_) imports from the
    # working directory: the launcher's, or its rsynced copy on a remote host. `python -m` puts
    # it on sys.path too, but not under PYTHONSAFEPATH, and only as a relative ''.
    project = os.getcwd()
    if project not in sys.path:
        sys.path.insert(0, project)
    run_dir_path = Path(run_dir)
    run_dir_path.mkdir(parents=True, exist_ok=True)
    _setup_logging(hydra.get("job_logging"), run_dir_path / f"worker{environ.get('TFKV_RANK_HINT', '')}.log")
    log.info("config sha256 %s (the launcher's %s)", digest(config), RECORD)

    from omegaconf import OmegaConf

    from tfkv import knobs
    from tfkv.sweep import pruning
    from tfkv.trainer import objective, train

    cfg = OmegaConf.create(config)
    OmegaConf.set_struct(cfg, True)  # a key the trainer misspells is an error, as under Hydra
    # the values the launcher resolved, which it put in this role's environment (which wins)
    values = knobs.resolve(knobs.settings(cfg), environ)
    # resume is the launcher's decision already (a checkpoint's path, or false): no search here
    final = train(cfg, run_dir_path, [], search_root=Path(project), knobs=values, trackers=[pruning.build])
    objective(cfg, final, run_dir_path)
    return final


def main() -> None:
    """`python -m tfkv.worker`: a mistake the user fixes is one line and status 2, as in tfkv-run."""
    from tfkv.errors import EXIT_INTERRUPTED, report

    try:
        run()
    except KeyboardInterrupt:  # the launcher tells the user where the checkpoints are
        print("tfkv-run: interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:
        report("tfkv-run", e)
        raise


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
