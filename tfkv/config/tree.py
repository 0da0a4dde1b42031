"""tfkv's config tree (`tfkv.conf_dir()`) read outside a Hydra app: a config composed from it
(with a user's --config-dir), and which option of a group has a setting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from tfkv import conf_dir


def compose(overrides: Sequence[str], config_dirs: Sequence[str] = ()) -> Any:
    """The config `tfkv-run` would compose from `overrides`, with `config_dirs` (--config-dir) on
    Hydra's search path, as tfkv-run's app composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    searchpath = [f"hydra.searchpath=[{','.join('file://' + os.path.abspath(d) for d in config_dirs)}]"] \
        if config_dirs else []
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, *searchpath])


def option_with(group: str, key: str) -> str | None:
    """The option of `group` (conf/<group>/*.yaml) whose node has `key`, if exactly one has it."""
    from omegaconf import OmegaConf

    owners = [p.stem for p in sorted((Path(conf_dir()) / group).glob("*.yaml")) if key in OmegaConf.load(p).keys()]
    return owners[0] if len(owners) == 1 else None
