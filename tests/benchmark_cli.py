"""Running a benchmark as a user does: `python -m benchmarks NAME [args]` from the repository root
(benchmarks/ is a package of the checkout, not installed), with this checkout first on PYTHONPATH
so that the benchmark's own processes import this checkout's tfkv and benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def env_with_checkout(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, and `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_benchmark(name: str, *args: str, timeout: float = 240, env: dict[str, str] | None = None
                  ) -> subprocess.CompletedProcess:
    """`python -m benchmarks name args` in the repository root; its output captured."""
    return subprocess.run([sys.executable, "-m", "benchmarks", name, *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=REPO, env=env or env_with_checkout())
