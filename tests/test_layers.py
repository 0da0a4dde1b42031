"""The import layers of pyproject.toml's [tool.importlinter] hold (cli -> trainer -> parallel ->
store -> ps -> base, the launcher beside the trainer on the base alone, the launcher and ps without
TensorFlow, no cycles; docs/development/architecture.md draws them), so the fast suite checks them
as CI's `lint-imports` step does."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on the package and pyproject.toml under `root`."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run([exe, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)})


def test_import_contracts_are_kept():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    # every contract of pyproject.toml ran and was kept
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in out.stdout, out.stdout


@pytest.mark.parametrize("module", ["trainer/loop.py", "export.py", "checkpoint/files.py", "tracking/tensorboard.py"])
def test_the_trainer_layer_may_not_import_the_launcher(module, tmp_path):
    """A copy of the package whose trainer-layer module imports the launcher breaks the contract
    that says so (the layers contract alone lets the trainer's siblings import each other)."""
    shutil.copytree(ROOT / "tfkv", tmp_path / "tfkv", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "tfkv" / module, "a") as f:
        f.write("\nimport tfkv.launcher.plan  # noqa: E402\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0 and "the trainer layer never imports the launcher" in out.stdout, out.stdout
    assert "1 broken" in out.stdout, out.stdout
