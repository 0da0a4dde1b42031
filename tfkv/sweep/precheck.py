"""Bad input of a sweep, found before its first trial starts: every config the sweep can produce
is composed by Hydra's own config loader and checked by tfkv.check.validate, so an objective
no metric has, a key that only some options have (`optimizer=sgd,adam optimizer.momentum=0.9`)
or a bad value is one line naming the trial, not a failure discovered hours into the sweep.

Each sweep override gives its values: a choice list, a range or a glob its own values, an
interval (Optuna's search space, on the command line or in hydra.sweeper.params) its two
bounds. Up to MAX_CONFIGS configs, every combination is checked; beyond that, enough that every
value is checked at least once.
"""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

# Composing and validating one config takes about 0.1 s of CPU: at most ~2 s before a sweep.
MAX_CONFIGS = 16


def problem(config: Any) -> str | None:
    """The first problem of the sweep whose master config (Hydra's, with `hydra`) this is, as one
    line naming the trial's overrides; None when every config composes and validates."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    from tfkv import check
    from tfkv.errors import message
    from tfkv.hydra_messages import one_line

    loader = GlobalHydra.instance().config_loader()
    # as written, not resolved: `key=${oc.env:X}` is checked below as its job resolves it
    node = OmegaConf.select(config, "hydra.sweeper.params")
    params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
    lines = [f"{k}={v}" for k, v in params.items()] + OmegaConf.to_container(config.hydra.overrides.task,
                                                                               resolve=False)
    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(lines)
        values = _values(parsed)
    except (HydraException, OmegaConfBaseException) as e:
        return one_line(e)
    objectives: dict[tuple[str, str], str] = {}  # (objective, direction): the first trial that has it
    for combo in combinations(values):
        # Hydra escapes a sweep's values (`$\{oc.env\:X\}`): shown as the user wrote them
        named = " ".join(re.sub(r"\\(.)", r"\1", o) for o, (_, choices) in zip(combo, values.items())
                         if len(choices) > 1)
        where = f"trial {named}: " if named else ""
        try:
            cfg = loader.load_sweep_config(config, list(combo))
            task = copy.deepcopy(cfg)
            with read_write(task), open_dict(task):
                del task["hydra"]
            _resolve(cfg, task)
            check.validate(task)
        except (HydraException, OmegaConfBaseException) as e:
            return where + one_line(e)
        except Exception as e:  # noqa: BLE001 - a user's mistake is one line; a bug keeps its traceback
            text = message(e)
            if text is None:
                raise
            return where + text
        objectives.setdefault((str(task.objective), str(task.direction)), named or "(no overrides)")
    return _one_objective(objectives) or _sweeper_direction(config, *next(iter(objectives)))


def _one_objective(objectives: dict[tuple[str, str], str]) -> str | None:
    """Trials compared to each other must return the same value, better the same way."""
    if len(objectives) < 2:
        return None
    (a, first), (b, second) = list(objectives.items())[:2]
    return (f"trial {first} returns {a[0]} ({a[1]}) but trial {second} {b[0]} ({b[1]}): the best trial "
            "would compare different values; set objective= (and direction=) for the whole sweep")


def _sweeper_direction(config: Any, objective: str, direction: str) -> str | None:
    """An Optuna sweeper's hydra.sweeper.direction against the objective's (tfkv.config.objective):
    one study and one table, one best trial. Hydra's sweeper defaults to minimize; tfkv's follows."""
    from enum import Enum

    from omegaconf import OmegaConf

    if not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("OptunaSweeper"):
        return None
    declared = OmegaConf.select(config, "hydra.sweeper.direction")
    if declared is None:  # tfkv_optuna's default: the objective's
        return None
    ways = [d.name if isinstance(d, Enum) else str(d) for d in (declared if OmegaConf.is_list(declared)
                                                                 or isinstance(declared, list) else [declared])]
    if ways == [direction]:
        return None
    return (f"hydra.sweeper.direction={','.join(ways)} but objective {objective} is to {direction} (direction="
            f"{OmegaConf.select(config, 'direction')}); set hydra.sweeper.direction={direction}, or direction= "
            "and hydra.sweeper.direction= alike where the objective's better way is the other")


def _resolve(cfg: Any, task: Any) -> None:
    """Resolve every interpolation of the task config as its job will (`${oc.env:DATA}` with DATA
    unset fails here), with ${hydra:...} reading this config's Hydra node as the launcher sets it."""
    import os

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict, read_write

    with read_write(cfg.hydra), open_dict(cfg.hydra):
        cfg.hydra.job.num = cfg.hydra.job.id = 0
        cfg.hydra.runtime.output_dir = os.path.abspath(os.path.join(str(cfg.hydra.sweep.dir),
                                                                    str(cfg.hydra.sweep.subdir)))
    hydra_config = HydraConfig.instance()
    before = hydra_config.cfg
    hydra_config.set_config(cfg)
    try:
        OmegaConf.to_container(task, resolve=True)
    finally:
        hydra_config.cfg = before


def _values(overrides: list[Any]) -> dict[str, list[str]]:
    """Each key's overrides to try, `key=value` strings, later ones replacing earlier ones as the
    sweepers do (hydra.sweeper.params first, the command line after)."""
    from hydra.core.override_parser.types import IntervalSweep

    out: dict[str, list[str]] = {}
    for o in overrides:
        key = o.get_key_element()
        if o.is_discrete_sweep():  # choice(...), a,b,c, range(...), glob(...)
            out[key] = [f"{key}={v}" for v in o.sweep_string_iterator()]
        elif o.is_interval_sweep():  # interval(a, b): its bounds stand for it
            sweep = o.value()
            assert isinstance(sweep, IntervalSweep)
            ints = "int" in (sweep.tags or set()) or all(isinstance(x, int) for x in (sweep.start, sweep.end))
            bounds = [int(x) if ints else x for x in (sweep.start, sweep.end)]
            out[key] = [f"{key}={v}" for v in dict.fromkeys(bounds)]
        else:
            out[key] = [f"{key}={o.get_value_element_as_str()}"]
    return out


def combinations(values: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """Every combination when there are at most MAX_CONFIGS; otherwise one row per value of the
    longest list, each list cycled, so that every value appears at least once."""
    lists = list(values.values())
    total = 1
    for v in lists:
        total *= len(v)
    if total <= MAX_CONFIGS:
        return list(itertools.product(*lists))
    rows = max(len(v) for v in lists)
    return [tuple(v[i % len(v)] for v in lists) for i in range(rows)]
