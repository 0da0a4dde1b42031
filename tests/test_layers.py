"""The import layers of pyproject.toml's [tool.importlinter] hold (cli -> trainer -> parallel ->
store -> ps -> base, the launcher beside the trainer on the base alone, the launcher and ps without
TensorFlow, no cycles; docs/development/architecture.md draws them), so the fast suite checks them
as CI's `lint-imports` step does."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # every contract of pyproject.toml ran and was kept
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert f"{len(contracts)} kept, 0 broken" in out.stdout, out.stdout
