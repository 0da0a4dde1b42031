"""The reference pages (docs/reference/*.md) are what docs/gen_reference.py writes from the code,
and every config key, knob, command-line option, exit status and entry-point group the code has
is on its page. The second part finds them its own way (the composed configs, the parsers, the
source), not through the generator's loops, so that a generator that drops one is caught too.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "reference"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return _generator().generate()


def _page(name: str) -> str:
    return (PAGES / name).read_text()


def test_every_page_is_generated(generated):
    assert sorted(generated) == sorted(p.name for p in PAGES.glob("*.md"))


@pytest.mark.parametrize("name", ["config.md", "knobs.md", "cli.md", "exit-codes.md", "entry-points.md"])
def test_the_committed_page_is_the_generators_output(generated, name):
    assert _page(name) == generated[name], f"docs/reference/{name} is stale: run python docs/gen_reference.py"


def test_check_exits_1_naming_a_stale_page(generated, tmp_path, monkeypatch, capsys):
    gen = _generator()
    monkeypatch.setattr(gen, "OUT", tmp_path)
    monkeypatch.setattr(gen, "generate", lambda: generated)  # the pages made once, above
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
    (tmp_path / "knobs.md").write_text((tmp_path / "knobs.md").read_text().replace("TFKV_CHUNK_BYTES", "X"))
    assert gen.main(["--check"]) == 1
    assert "docs/reference/knobs.md differs from the code" in capsys.readouterr().err


# ---------------------------------------------------------------- what the code has, found independently


def _leaves(node, prefix: str = "") -> list[str]:
    from omegaconf import OmegaConf

    out = []
    for key in node.keys():
        child = node._get_node(key)
        if OmegaConf.is_dict(child) and len(child) and not str(key).startswith("_"):
            out += _leaves(child, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


@functools.cache
def config_keys() -> list[str]:
    """Every key of every config tfkv-run composes from one option of each group."""
    from tfkv.config import tree

    conf = ROOT / "conf"
    keys: set[str] = set(_leaves(tree.compose([])))
    for group in ("model", "dataset", "optimizer", "kvstore", "cluster", "logger"):
        for option in (p.stem for p in (conf / group).glob("*.yaml")):
            cfg = tree.compose([f"{group}={option}"])
            keys |= {k for k in _leaves(cfg) if k.startswith(f"{group}.")}
    return sorted(keys)


def group_options() -> list[tuple[str, str]]:
    return sorted((p.parent.name, p.stem) for p in (ROOT / "conf").glob("*/*.yaml"))


def missing_config(text: str) -> list[str]:
    missing = [k for k in config_keys() if f"`{k}`" not in text]
    missing += [f"{g}={o}" for g, o in group_options()
                if f"`{o}`" not in next((line for line in text.splitlines() if line.startswith(f"| `{g}=`")), "")]
    return missing


def missing_knobs(text: str) -> list[str]:
    """A knob is missing unless one table row names its config key and all its variables."""
    from tfkv import knobs

    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [k.key for k in knobs.KNOBS
            if not any(f"`{k.key}`" in row and all(f"`{n}`" in row for n in k.names) for row in rows)]


def command_options() -> list[str]:
    from hydra._internal.utils import get_args_parser

    from tfkv.emulate import cli as emulate
    from tfkv.launcher import cli as launch

    flags = [s for a in get_args_parser()._actions for s in a.option_strings]
    flags += [s for a in launch.parser()._actions for s in a.option_strings]
    parser = emulate._parser()
    flags += [s for a in parser._actions for s in a.option_strings]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            flags += [f"tfkv-emulate {name}" for name in action.choices]
            flags += [s for p in action.choices.values() for a in p._actions for s in a.option_strings]
    return sorted(set(flags))


def missing_options(text: str) -> list[str]:
    from tfkv.launcher.base import REGISTRY

    own = set(REGISTRY.names()) - set(REGISTRY.plugins())  # an installed plug-in's are not tfkv's
    return [f for f in command_options() if f"`{f}`" not in text and f"### {f}" not in text
            and f not in _plugin_flags()] + [n for n in sorted(own) if n not in text]


def _plugin_flags() -> set[str]:
    """Flags that an installed plug-in launcher's settings add to tfkv-launch (not on the page)."""
    from tfkv.config import cluster
    from tfkv.launcher.base import schemas

    ours = {"--" + f.name.replace("_", "-") for f in cluster.options(*schemas().values())}
    from tfkv.launcher import cli as launch

    return {s for a in launch.parser()._actions for s in a.option_strings
            if s.startswith("--") and s not in ours and s not in ("--help", "--version", "--run-dir")
            and not s.startswith("--no-")}


def error_family() -> list[str]:
    """Classes derived (by name) from TfkvError or one of its subclasses anywhere in tfkv/."""
    pattern = re.compile(r"^class (\w+)\(([^)]*)\):", re.M)
    found = {m.group(1): {b.strip().split(".")[-1] for b in m.group(2).split(",")}
             for path in (ROOT / "tfkv").rglob("*.py") for m in pattern.finditer(path.read_text())}
    family = {"TfkvError"}
    while True:
        more = {name for name, bases in found.items() if bases & family} - family
        if not more:
            return sorted(family)
        family |= more


def missing_exit_codes(text: str) -> list[str]:
    from tfkv import errors

    missing = [name for name in dir(errors) if name.startswith("EXIT_")
               and not re.search(rf"\| `{getattr(errors, name)}` \| `{name}` \|", text)]
    missing += [name for name in error_family() if f"| `{name}` |" not in text]
    return missing


def missing_entry_points(text: str) -> list[str]:
    from tfkv import plugins

    return [f"{ep}" for group, ep in plugins.GROUPS.items()
            if f"## {ep}" not in text or f"`{group}=<entry point name>`" not in text]


CHECKS = {"config.md": missing_config, "knobs.md": missing_knobs, "cli.md": missing_options,
          "exit-codes.md": missing_exit_codes, "entry-points.md": missing_entry_points}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_everything_the_code_has_is_on_its_page(name):
    assert CHECKS[name](_page(name)) == []


# A row of each page and what dropping it loses: the checks above fail when a page lacks one.
DROPPED = {
    "config.md": ("| `epochs` |", "epochs"),
    "knobs.md": ("| `TFKV_CHUNK_BYTES` |", "kvstore.chunk_bytes"),
    "cli.md": ("| `--sync-dst-dir` |", "--sync-dst-dir"),
    "exit-codes.md": ("| `KnobError` |", "KnobError"),
    "entry-points.md": ("## tfkv.datasets", "tfkv.datasets"),
}


@pytest.mark.parametrize("name", sorted(DROPPED))
def test_a_page_that_lacks_a_line_fails_the_check(name):
    start, lost = DROPPED[name]
    text = _page(name)
    kept = [line for line in text.splitlines() if not line.startswith(start)]
    assert len(kept) == len(text.splitlines()) - 1, f"no single line of {name} starts with {start!r}"
    assert lost in CHECKS[name]("\n".join(kept))


def test_the_config_check_sees_a_missing_option():
    text = _page("config.md").replace("`lstm_ptb`, ", "")
    assert "experiment=lstm_ptb" in missing_config(text)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
