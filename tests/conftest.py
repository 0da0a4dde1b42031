"""Shared set-up: quiet TensorFlow, and the host CPU split into logical devices before first use."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # TensorFlow fixes its devices at first use, so split the CPU before any test touches it.
    from tfkv.parallel import devices

    devices.setup(["cpu:0"])


@pytest.fixture(scope="session")
def tf_devices():
    """Eight logical CPU devices (what tfkv.parallel.devices.setup makes), as TensorFlow names."""
    from tfkv.parallel import devices

    return devices.setup([f"cpu:{i}" for i in range(8)])


def tfkv_run(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run the installed `tfkv-run` console script as a user would."""
    exe = shutil.which("tfkv-run")
    assert exe, "tfkv-run is not on PATH: install the package first (pip install '.[cpu,test]')"
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"tfkv-run {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def python(script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
